"""A stack of tied autoencoder layers in Flax NNX tree mode, run with ``nnx.scan``.

Each layer's ``down`` kernel is its ``up`` kernel transposed. In tree mode
(``nnx.set_graph_mode(False)``) NNX refuses one Variable held in two places, so the tie
is data: ``sharetree.nnx.tie`` puts ``Tied('up/kernel/value', T)`` into the ``down``
Param, in place, inside the ``nnx.vmap`` that creates the stack. The scanned body
materializes its layer; ``nnx.Optimizer`` keeps one Adam state per buffer; the state is
saved with ``st.save`` (each buffer once) and loaded back into a fresh stack.

Run:  python examples/nnx_tree_mode_stack.py            (a few seconds on 2 CPU cores)
      python examples/nnx_tree_mode_stack.py --steps 3  (smoke test)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sharetree as st
import sharetree.nnx as stnnx

TIES = {"down/kernel": st.Tied("up/kernel", st.T)}


class Layer(nnx.Module):
    """A residual autoencoder layer whose decoder is its encoder, transposed."""

    def __init__(self, din: int, dlatent: int, *, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(din, dlatent, rngs=rngs)
        self.down = nnx.Linear(dlatent, din, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jnp.tanh(self.up(x)))


def make_stack(layers: int, din: int, dlatent: int, seed: int) -> Layer:
    """``layers`` tied layers stacked on a leading axis (tied one by one inside the vmap)."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key: jax.Array) -> Layer:
        return stnnx.tie(Layer(din, dlatent, rngs=nnx.Rngs(key)), TIES)

    return make(jax.random.split(jax.random.key(seed), layers))


def forward(stack: Layer, x: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h: jax.Array, layer: Layer) -> jax.Array:
        return st.materialize(layer)(h)  # one layer: its own up.T

    return body(x, stack)


def make_data(n: int, din: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """Inputs and targets: a fixed smooth map of ``R^din`` to learn, near the identity."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, din)).astype(np.float32)
    y = x + 0.5 * np.sin(x @ (rng.standard_normal((din, din)) / np.sqrt(din)))
    return jnp.asarray(x), jnp.asarray(y, jnp.float32)


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--din", type=int, default=16)
    ap.add_argument("--latent", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    x, y = make_data(256, args.din, args.seed)

    with nnx.set_graph_mode(False):
        stack = make_stack(args.layers, args.din, args.latent, args.seed)
        print(st.canonicalize(nnx.state(stack)))
        optimizer = nnx.Optimizer(stack, optax.adam(args.lr), wrt=nnx.Param)

        @nnx.jit
        def step(stack: Layer, optimizer: nnx.Optimizer) -> jax.Array:
            def loss_fn(stack: Layer) -> jax.Array:
                return jnp.mean((forward(stack, x) - y) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(stack)
            optimizer.update(stack, grads)
            return loss

        loss = float("nan")
        for i in range(args.steps):
            loss_arr = step(stack, optimizer)
            if i % 50 == 0 or i == args.steps - 1:
                loss = float(loss_arr)
                print(f"step {i:4d}  mse {loss:.5f}")
        assert stack.down.kernel.get_raw_value() == st.Tied("up/kernel/value", st.T)

        # a checkpoint of the state: each buffer once, loaded into a fresh tied stack
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "stack.safetensors"
            st.save(path, nnx.state(stack))
            fresh = make_stack(args.layers, args.din, args.latent, args.seed + 1)
            nnx.update(fresh, st.load(path, like=nnx.state(fresh)))
        assert np.array_equal(forward(fresh, x), forward(stack, x))
    print(f"final loss {loss:.5f}  ({time.perf_counter() - t0:.1f} s)")
    return loss


if __name__ == "__main__":
    main()
