"""The benchmark model: a deep tied MLP held five ways (sharetree and its peers).

``n_leaves`` counts the leaves of the *materialized* tree: ``n_leaves // 2``
layers, each a ``64 x 64`` weight ``W`` and a ``64`` bias ``b``. Every layer
``i`` with ``i % 4 == 3`` uses the transpose of the previous layer's weight, so
a quarter of the weights are tied as transposed views and the model holds
``n_leaves - n_leaves // 8`` unique buffers.

Every representation below computes the same function with the same work:

* ``canonical``: the sharetree canonical tree (``Tied(f"{i-1}/W", st.T)``);
* ``unique``: a plain tree of the unique buffers only, where the loss writes
  the transposes by hand (:func:`loss_by_hand`): the plain-tree *floor*, and
  what ``ravel_pytree`` flattens;
* ``eqx``: ``equinox.nn.Shared`` over the untied tree, ``get`` returning the
  transposes;
* ``nnx``: a Flax NNX module whose tied layers hold the previous layer's
  ``nnx.Param`` object and transpose it in ``__call__``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sharetree as st

D = 64
"""Width of every layer."""
BATCH = 8
"""Rows of the input batch."""


def num_layers(n_leaves: int) -> int:
    """Layers of a model with ``n_leaves`` materialized leaves (two per layer)."""
    if n_leaves < 8 or n_leaves % 2:
        raise ValueError(f"n_leaves must be even and >= 8, got {n_leaves}")
    return n_leaves // 2


def is_tied_layer(i: int) -> bool:
    """Whether layer ``i`` uses the transpose of layer ``i - 1``'s weight."""
    return i % 4 == 3


@dataclasses.dataclass
class TiedMLP:
    """One tied MLP in every representation the benchmarks compare.

    Attributes:
        n_leaves: leaves of the materialized tree.
        canonical: the sharetree canonical tree (a list of ``{"W", "b"}`` dicts).
        unique: the same unique buffers as a plain tree (tied layers have ``"b"`` only).
        x: the input batch.
    """

    n_leaves: int
    canonical: list[dict[str, Any]]
    unique: list[dict[str, Any]]
    x: jax.Array

    @property
    def layers(self) -> int:
        return len(self.unique)


def make_model(n_leaves: int, seed: int = 0) -> TiedMLP:
    """Build the tied MLP with ``n_leaves`` materialized leaves (deterministic)."""
    rng = np.random.default_rng(seed)
    canonical: list[dict[str, Any]] = []
    unique: list[dict[str, Any]] = []
    for i in range(num_layers(n_leaves)):
        b = jnp.asarray(rng.normal(0.0, 0.1, (D,)).astype(np.float32))
        if is_tied_layer(i):
            canonical.append({"W": st.Tied(f"{i - 1}/W", st.T), "b": b})
            unique.append({"b": b})
        else:
            w = jnp.asarray(rng.normal(0.0, 1.0 / np.sqrt(D), (D, D)).astype(np.float32))
            canonical.append({"W": w, "b": b})
            unique.append({"W": w, "b": b})
    x = jnp.asarray(rng.normal(0.0, 1.0, (BATCH, D)).astype(np.float32))
    return TiedMLP(n_leaves, canonical, unique, x)


def loss(tree: list[dict[str, Any]], x: jax.Array) -> jax.Array:
    """The loss of a materialized tree: every layer has its own ``W``."""
    h = x
    for layer in tree:
        h = jnp.tanh(h @ layer["W"] + layer["b"])
    return jnp.sum(h**2)


def loss_by_hand(tree: list[dict[str, Any]], x: jax.Array) -> jax.Array:
    """The same loss on the unique buffers, the tied views written by hand."""
    h = x
    for i, layer in enumerate(tree):
        w = tree[i - 1]["W"].T if is_tied_layer(i) else layer["W"]
        h = jnp.tanh(h @ w + layer["b"])
    return jnp.sum(h**2)


def materialize_by_hand(unique: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The materialized tree built by hand from the unique buffers (the reference)."""
    return [
        {"W": unique[i - 1]["W"].T if is_tied_layer(i) else layer["W"], "b": layer["b"]}
        for i, layer in enumerate(unique)
    ]


# --------------------------------------------------------------------------- Equinox


def make_eqx(model: TiedMLP) -> Any:
    """``equinox.nn.Shared`` over the untied tree; ``get`` returns the transposes.

    The untied tree holds a copy of each transposed weight at the tied positions
    (Shared checks shapes there and then drops them).
    """
    import equinox as eqx

    untied = materialize_by_hand(model.unique)
    tied = [i for i in range(model.layers) if is_tied_layer(i)]

    def where(t: Any) -> list[Any]:
        return [t[i]["W"] for i in tied]

    def get(t: Any) -> list[Any]:
        return [t[i - 1]["W"].T for i in tied]

    return eqx.nn.Shared(untied, where, get)


# --------------------------------------------------------------------------- Flax NNX


def make_nnx(model: TiedMLP) -> Any:
    """A Flax NNX module whose tied layers hold the previous layer's ``nnx.Param``."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, w: Any, b: Any, transposed: bool) -> None:
            self.W = w
            self.b = b
            self.transposed = transposed

    class Net(nnx.Module):
        def __init__(self, layers: list[Layer]) -> None:
            self.layers = nnx.List(layers)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = x
            for layer in self.layers:
                w = layer.W[...]
                if layer.transposed:
                    w = w.T
                h = jnp.tanh(h @ w + layer.b[...])
            return jnp.sum(h**2)

    layers: list[Layer] = []
    for i, layer in enumerate(model.unique):
        b = nnx.Param(layer["b"])
        if is_tied_layer(i):
            layers.append(Layer(layers[i - 1].W, b, True))  # the very same Param object
        else:
            layers.append(Layer(nnx.Param(layer["W"]), b, False))
    return Net(layers)


def nnx_unique_leaves(state: Any, layers: int) -> list[Any]:
    """The unique buffers of an NNX state (or its gradient) in the ``unique`` order."""
    out = []
    for i in range(layers):
        layer = state["layers"][i]
        if not is_tied_layer(i):
            out.append(_value(layer["W"]))
        out.append(_value(layer["b"]))
    return out


def _value(v: Any) -> Any:
    return v.get_value() if hasattr(v, "get_value") else v
