"""``destructure`` / ``restructure``: a flat vector of the unique parameters."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError
from sharetree._graph import Structure, expand_leaves, leaves_and_structure
from sharetree._transforms import canonical_dtype

__all__ = ["destructure", "Restructure"]


@functools.cache
def _inexact(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


@functools.cache
def _complex(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.complexfloating))


def _is_inexact_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and _inexact(x.dtype)


class _Static:
    """A non-parameter leaf kept by ``restructure``; compared by value (arrays by content)."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._key: Any
        if isinstance(value, jax.core.Tracer):  # an integer leaf under jit: same trace only
            self._key = ("id", id(value))
        elif isinstance(value, (jax.Array, np.ndarray, np.generic)):
            arr = np.asarray(value)
            self._key = ("array", arr.shape, arr.dtype.str, arr.tobytes())
        else:
            try:
                hash(value)
                self._key = ("value", type(value), value)
            except TypeError:
                self._key = ("id", id(value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


class Restructure:
    """Rebuild a tree from a flat vector of its unique parameters.

    Returned by :func:`destructure`. Calling it gives the **materialized** tree
    (every view computed); :meth:`canonical` gives the canonical tree (``Tied``
    nodes kept). It is hashable and equal to any restructure of the same
    structure, layout and static leaves, so passing it to ``jit`` as a static
    argument does not retrace.

    Splitting the vector is one linear ``lax.split``; its transpose is a single
    concatenate, so the gradient is assembled in one pass over the unique
    elements, and forward mode (``jvp``, ``jacfwd``, ``hessian``) and ``vmap``
    work as for any JAX function.
    """

    def __init__(
        self,
        structure: Structure,
        slots: tuple[int, ...],
        shapes: tuple[tuple[int, ...], ...],
        dtypes: tuple[np.dtype, ...],
        statics: tuple[tuple[int, _Static], ...],
        flat_dtype: np.dtype,
    ) -> None:
        self.structure = structure
        self.slots = slots
        self.shapes = shapes
        self.dtypes = dtypes
        self.statics = statics
        self.flat_dtype = flat_dtype
        self.sizes = tuple(math.prod(s) for s in shapes)
        self.size = sum(self.sizes)
        self._key = (structure.treedef, slots, shapes, dtypes, statics, flat_dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Restructure) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return (
            f"Restructure({self.size:,} {self.flat_dtype.name} parameters in "
            f"{len(self.slots)} buffers, {self.structure.treedef.num_leaves - len(self.slots)} "
            f"static leaves, {len(self.structure.views)} views)"
        )

    def _check(self, flat: Any) -> None:
        shape = getattr(flat, "shape", None)
        dtype = getattr(flat, "dtype", None)
        if shape is None or dtype is None:
            raise TieError(
                f"restructure: expected a 1-D array of {self.size} {self.flat_dtype.name} "
                f"values, got {type(flat).__name__}. Fix: pass the vector from destructure."
            )
        if len(shape) != 1:
            raise TieError(
                f"restructure: expected a 1-D vector of length {self.size}, got an array of "
                f"shape {tuple(shape)} (ndim {len(shape)}). Fix: pass one flat vector; "
                "use jax.vmap(restructure) for a batch."
            )
        if shape[0] != self.size:
            raise TieError(
                f"restructure: expected a vector of length {self.size} (the unique inexact "
                f"parameters), got length {shape[0]} ({shape[0] - self.size:+d}). Fix: pass a "
                "vector from the destructure of a tree with the same structure and shapes."
            )
        if not jnp.issubdtype(dtype, jnp.inexact) and self.size:
            raise TieError(
                f"restructure: expected a floating or complex vector ({self.flat_dtype.name}), "
                f"got dtype {np.dtype(dtype).name}. Fix: cast it, e.g. flat.astype(jnp.float32)."
            )

    def _leaves(self, flat: Any) -> list[Any]:
        self._check(flat)
        leaves: list[Any] = [None] * self.structure.treedef.num_leaves
        for i, static in self.statics:
            leaves[i] = static.value
        if self.slots:
            pieces = jax.lax.split(jnp.asarray(flat), self.sizes) if len(self.slots) > 1 else [flat]
            for i, piece, shape, dtype in zip(self.slots, pieces, self.shapes, self.dtypes):
                if _complex(piece.dtype) and not _complex(dtype):
                    piece = jnp.real(piece)  # a real buffer in a complex vector
                leaves[i] = piece.reshape(shape).astype(dtype)
        return leaves

    def __call__(self, flat: Any) -> Any:
        """The materialized tree whose unique parameters are ``flat``."""
        leaves = self._leaves(flat)
        return jtu.tree_unflatten(
            self.structure.expanded_treedef, expand_leaves(self.structure, leaves)
        )

    def canonical(self, flat: Any) -> Any:
        """The canonical tree (``Tied`` nodes kept) whose unique parameters are ``flat``."""
        return jtu.tree_unflatten(self.structure.treedef, self._leaves(flat))


def _concat(leaves: list[Any], dtype: np.dtype) -> Any:
    if not leaves:
        return jnp.zeros((0,), dtype)
    on_host = jax.default_backend() == "cpu"
    if not all(
        isinstance(x, (np.ndarray, np.generic))
        or (on_host and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
        for x in leaves
    ):
        return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])
    # Host arrays: one NumPy concatenate and one transfer beat thousands of dispatches.
    return jax.device_put(np.concatenate(leaves, axis=None, dtype=dtype))


def destructure(tree: Any) -> tuple[jax.Array, Restructure]:
    """Flatten the unique inexact buffers of ``tree`` into one 1-D vector.

    Every floating or complex array buffer, in flatten order, goes into ``flat``
    in their promoted dtype (each view is computed from its buffer, never stored).
    Dtypes are those JAX computes with: while x64 is off, float64 buffers come
    back from ``restructure`` as float32, as from any JAX function.
    Other leaves (integer arrays, Python numbers, strings, functions) stay static
    inside ``restructure``.

    Args:
        tree: a canonical tree.

    Returns:
        ``(flat, restructure)``: ``restructure(flat)`` is the materialized tree
        with the original dtypes; ``restructure.canonical(flat)`` the canonical one.

    Example:
        >>> import jax, jax.numpy as jnp, sharetree as st
        >>> tree = {"x": jnp.array([7.0, 7.0]), "y": jnp.array([3.0, 4.0]), "z": st.Tied("x")}
        >>> flat, re = st.destructure(tree)
        >>> flat
        Array([7., 7., 3., 4.], dtype=float32)
        >>> re(jnp.array([1.0, 10.0, 100.0, 1000.0]))["z"]
        Array([ 1., 10.], dtype=float32)
        >>> loss = lambda v: 3 * re(v)["x"].sum() + 13 * re(v)["z"].sum()
        >>> jax.grad(loss)(jnp.zeros(4))
        Array([16., 16.,  0.,  0.], dtype=float32)
    """
    leaves, structure = leaves_and_structure(tree)
    slots = tuple(i for i, x in enumerate(leaves) if _is_inexact_array(x))
    inexact = [leaves[i] for i in slots]
    flat_dtype = (
        canonical_dtype(jnp.result_type(*{canonical_dtype(x.dtype) for x in inexact}))
        if inexact
        else np.dtype(jnp.result_type(float))
    )
    slot_set = set(slots)
    statics = tuple((i, _Static(x)) for i, x in enumerate(leaves) if i not in slot_set)
    restructure = Restructure(
        structure,
        slots,
        tuple(tuple(np.shape(x)) for x in inexact),
        tuple(canonical_dtype(x.dtype) for x in inexact),
        statics,
        flat_dtype,
    )
    return _concat(inexact, flat_dtype), restructure
