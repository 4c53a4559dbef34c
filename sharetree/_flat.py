"""``destructure`` / ``restructure``: a flat vector of the unique parameters."""

from __future__ import annotations

import copy
import functools
import itertools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError
from sharetree._materialize import expand_leaves, leaves_and_structure
from sharetree._paths import format_aval, path_str
from sharetree._resolve import Structure
from sharetree._transforms import canonical_dtype

__all__ = ["destructure", "Restructure"]


@functools.cache
def _inexact(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


@functools.cache
def _complex(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.complexfloating))


_HOST, _DEVICE, _OTHER = 0, 1, 2


def _kind(x: Any, cpu: bool) -> int:
    """Whether a leaf is an array NumPy reads directly, another array, or not an array."""
    if isinstance(x, (np.ndarray, np.generic)):
        return _HOST
    if isinstance(x, jax.Array):
        return _HOST if cpu and not isinstance(x, jax.core.Tracer) else _DEVICE
    return _OTHER


def _is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class _Static:
    """A non-parameter leaf kept by ``restructure``; compared by value (arrays by content)."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._key: Any
        if isinstance(value, jax.core.Tracer):  # an integer leaf under jit: same trace only
            self._key = ("id", id(value))
        elif _is_prng_key(value):  # typed keys have no NumPy form: compare impl and key data
            data = np.asarray(jax.random.key_data(value))
            impl = str(jax.random.key_impl(value))
            self._key = ("key", impl, data.shape, data.dtype.str, data.tobytes())
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

    **Faster compiles: pass it to ``jit`` as an argument.** A ``Restructure``
    is also a pytree whose only leaves are the buffers' integer offsets in the
    vector. Closed over (or passed as a static argument) the offsets are
    constants: XLA compiles one kernel per distinct slice, which dominates the
    compile time of big trees (as for ``ravel_pytree``'s ``unravel``). Passed
    as an ordinary argument, the offsets arrive at run time, the slices of
    equal shape become one kernel, and ``jit(grad(f))`` compiles three to
    four times as fast at a few hundred to a few thousand buffers (on
    XLA:CPU, benchmarks/README.md); values and gradients are the same
    (the gradient is still assembled by concatenates, in two levels from 64
    buffers on, with no per-buffer padding). Under ``vmap`` give it
    ``in_axes=None``. Its leaves are offsets, not parameters: do not
    ``tree_map`` over it (a changed offset is an error outside ``jit``).

    Attributes:
        structure: the resolved sharing structure of the canonical tree.
        shapes: the shape of each buffer in the vector, in flatten order.
        dtypes: the dtype ``restructure`` gives each buffer back.
        sizes: the number of elements of each buffer.
        offsets: where each buffer starts in the vector.
        size: the length of the vector.
        flat_dtype: the dtype of the vector (the buffers' promoted dtype).

    Example:
        >>> import jax, jax.numpy as jnp, sharetree as st
        >>> tree = {"w": jnp.ones((2, 3)), "wT": st.Tied("w", st.T), "b": jnp.zeros(3)}
        >>> flat, re = st.destructure(tree)
        >>> loss = lambda v, re: jnp.sum(2 * re(v)["wT"]) + jnp.sum(re(v)["b"])
        >>> jax.jit(jax.grad(loss))(flat, re)  # re as an argument: runtime offsets
        Array([1., 1., 1., 2., 2., 2., 2., 2., 2.], dtype=float32)
        >>> jax.tree.leaves(re)  # the offsets of "b" and "w" in the vector
        [np.int32(0), np.int32(3)]
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
        self.offsets = tuple(itertools.accumulate(self.sizes[:-1], initial=0)) if shapes else ()
        self._key = (structure.treedef, slots, shapes, dtypes, statics, flat_dtype)
        self._hash = hash(self._key)
        self._runtime: tuple[Any, ...] | None = None  # offsets given as pytree leaves

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Restructure) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def _tree_flatten(self) -> tuple[tuple[Any, ...], Restructure]:
        # int32 offsets index any vector below 2**31 elements; larger ones keep static offsets.
        if self._runtime is not None:
            return self._runtime, self._static()
        if len(self.slots) < 2 or self.size >= 2**31:
            return (), self
        leaves = self.__dict__.get("_leaves_np")
        if leaves is None:
            leaves = self._leaves_np = tuple(np.int32(o) for o in self.offsets)
        return leaves, self

    def _static(self) -> Restructure:
        if self._runtime is None:
            return self
        static = copy.copy(self)
        static._runtime = None
        return static

    @classmethod
    def _tree_unflatten(cls, static: Restructure, leaves: Any) -> Restructure:
        if not leaves:
            return static
        new = copy.copy(static)
        new._runtime = tuple(leaves)
        return new

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
        if _complex(np.dtype(dtype)) and not _complex(self.flat_dtype):
            raise TieError(
                f"restructure: expected a real vector ({self.flat_dtype.name}): every buffer of "
                f"this tree is real, but the vector is {np.dtype(dtype).name}, whose imaginary "
                "parts would be dropped. Fix: pass a real vector (e.g. jnp.real(flat) if the "
                "imaginary parts are zero on purpose)."
            )

    def _leaves(self, flat: Any) -> list[Any]:
        self._check(flat)
        leaves: list[Any] = [None] * self.structure.treedef.num_leaves
        for i, static in self.statics:
            leaves[i] = static.value
        if self.slots:
            pieces = self._split(jnp.asarray(flat))
            for i, piece, shape, dtype in zip(self.slots, pieces, self.shapes, self.dtypes):
                if _complex(piece.dtype) and not _complex(dtype):
                    piece = jnp.real(piece)  # a real buffer in a complex vector
                leaves[i] = piece.reshape(shape).astype(dtype)
        return leaves

    def _split(self, flat: jax.Array) -> list[jax.Array]:
        offsets = self._runtime
        if offsets is not None and any(isinstance(o, jax.core.Tracer) for o in offsets):
            return _split_at(flat, offsets, self.sizes)
        given = None if offsets is None else tuple(int(np.asarray(o)) for o in offsets)
        if given is not None and given != self.offsets:
            bad = next(i for i, (g, e) in enumerate(zip(given, self.offsets)) if g != e)
            raise TieError(
                f"restructure: its pytree leaves are the buffers' offsets in the vector, but "
                f"offset {bad} is {given[bad]}, expected {self.offsets[bad]}. "
                "Fix: do not tree_map over a Restructure; pass the one destructure returned."
            )
        return _static_split(flat, self.sizes)

    def __call__(self, flat: Any) -> Any:
        """The materialized tree whose unique parameters are ``flat``."""
        leaves = self._leaves(flat)
        return jtu.tree_unflatten(
            self.structure.expanded_treedef, expand_leaves(self.structure, leaves)
        )

    def canonical(self, flat: Any) -> Any:
        """The canonical tree (``Tied`` nodes kept) whose unique parameters are ``flat``."""
        return jtu.tree_unflatten(self.structure.treedef, self._leaves(flat))


def _static_split(flat: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
    return jax.lax.split(flat, sizes) if len(sizes) > 1 else [flat]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _split_at(flat: jax.Array, offsets: tuple[Any, ...], sizes: tuple[int, ...]) -> list[jax.Array]:
    """``lax.split`` with runtime offsets: slices of equal size compile to one kernel."""
    # Offsets are never negative: no index wrapping (four fewer ops per buffer to trace).
    return [
        jax.lax.dynamic_slice(flat, (o,), (n,), allow_negative_indices=False)
        for o, n in zip(offsets, sizes)
    ]


@_split_at.defjvp
def _split_at_jvp(sizes: tuple[int, ...], primals: Any, tangents: Any) -> Any:
    # The tangent is a static split: linear, so reverse mode transposes it into
    # concatenates (a dynamic_slice would transpose into a full-size pad per buffer).
    (flat, offsets), (dflat, _) = primals, tangents
    return _split_at(flat, offsets, sizes), _grouped_split(dflat, sizes)


_GROUPED_MIN = 64
"""From this many buffers on, the runtime-offset tangent splits in two levels."""

_FUSED_GROUPS_MIN = 256
"""From this many buffers on, the first level groups 8 buffers (see ``_grouped_split``)."""

_FUSED_GROUP = 8
"""XLA:CPU fuses a concatenate of up to 8 operands with their producers (9 are not)."""


def _grouped_split(flat: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
    """``lax.split`` in two levels behind an optimization barrier.

    Its transpose assembles the gradient with one concatenate per group of
    cotangents, then one of their results, instead of one n-operand concatenate
    (the barrier keeps XLA from flattening them back into one). Groups hold
    about sqrt(n) buffers up to 255 buffers, then 8: XLA:CPU fuses a concatenate
    of at most 8 operands into one kernel with the ops that produce them, which
    shrinks the graph its runtime schedules. Measured on XLA:CPU at 1,750
    buffers: sqrt groups compile about 15% faster than one concatenate, groups
    of 8 about 40% faster than sqrt groups; below a few hundred buffers sqrt
    groups are the faster; run time is the same (benchmarks/README.md). The
    values are those of one ``lax.split``.
    """
    n = len(sizes)
    if n < _GROUPED_MIN:
        return _static_split(flat, sizes)
    per = _FUSED_GROUP if n >= _FUSED_GROUPS_MIN else math.isqrt(n - 1) + 1  # else ceil(sqrt(n))
    groups = [sizes[i : i + per] for i in range(0, n, per)]
    chunks = jax.lax.optimization_barrier(jax.lax.split(flat, [sum(g) for g in groups]))
    return [piece for chunk, g in zip(chunks, groups) for piece in _static_split(chunk, g)]


jtu.register_pytree_node(Restructure, Restructure._tree_flatten, Restructure._tree_unflatten)


_ALIGN = 64
"""Byte alignment of the host vector: XLA:CPU then adopts it without a copy."""


def _aligned_empty(size: int, dtype: np.dtype) -> np.ndarray:
    raw = np.empty(size * dtype.itemsize + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + size * dtype.itemsize].view(dtype)


def _concat(leaves: list[Any], dtype: np.dtype, on_host: bool, size: int) -> Any:
    if not leaves:
        return jnp.zeros((0,), dtype)
    if not on_host:
        return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])
    # Host arrays: one NumPy concatenate and one transfer beat thousands of dispatches.
    # The vector is 64-byte aligned so that device_put on CPU takes it without a copy
    # (it is private: nothing else holds or writes it).
    out = _aligned_empty(size, dtype)
    np.concatenate(leaves, axis=None, out=out)
    return jax.device_put(out)


_LAST_STATICS: dict[Any, tuple[tuple[int, _Static], ...]] = {}
_LAST_STATICS_SIZE = 64  # structures remembered (oldest out)
_WARNED: set[Any] = set()


def _warn_on_changed_statics(restructure: Restructure) -> None:
    """Warn once per leaf when a static leaf changed since the last destructure of its layout.

    ``Restructure`` compares static leaves by value, so a ``jit`` that takes it as an
    argument retraces whenever one changes (a step counter: every step).
    """
    key = restructure._key[:4] + restructure._key[5:]  # all but the static values
    before = _LAST_STATICS.pop(key, None)
    _LAST_STATICS[key] = restructure.statics
    if len(_LAST_STATICS) > _LAST_STATICS_SIZE:
        del _LAST_STATICS[next(iter(_LAST_STATICS))]
    if before is None:
        return
    for (i, old), (_, new) in zip(before, restructure.statics):
        if old != new and (key, i) not in _WARNED:
            _WARNED.add((key, i))
            where = path_str(restructure.structure.buffer_paths[i])
            warnings.warn(
                f"destructure: the static leaf {where!r} ({format_aval(new.value)}) changed "
                "since the last destructure of a tree of this structure. restructure keeps "
                "static leaves as values, so a jit that takes it as an argument retraces every "
                "time this leaf changes. Fix: keep values that change every step (a step "
                "counter) out of the tree you destructure, e.g. destructure state.params rather "
                "than the whole train state.",
                UserWarning,
                stacklevel=3,
            )


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
    cpu = jax.default_backend() == "cpu"
    kinds: dict[type, int] = {}  # leaf type -> _HOST, _DEVICE or _OTHER
    canonical: dict[Any, np.dtype | None] = {}  # leaf dtype -> flat dtype, None if not inexact
    slots: list[int] = []
    shapes: list[tuple[int, ...]] = []
    dtypes: list[np.dtype] = []
    statics: list[tuple[int, _Static]] = []
    on_host = True  # every buffer is a host or CPU array: one NumPy concatenate
    for i, x in enumerate(leaves):
        kind = kinds.get(type(x))
        if kind is None:
            kind = kinds[type(x)] = _kind(x, cpu)
        dtype = None
        if kind != _OTHER:
            dtype = canonical.get(x.dtype, False)
            if dtype is False:
                dtype = canonical[x.dtype] = canonical_dtype(x.dtype) if _inexact(x.dtype) else None
        if dtype is None:
            statics.append((i, _Static(x)))
            continue
        slots.append(i)
        shapes.append(tuple(x.shape))
        dtypes.append(dtype)
        on_host = on_host and kind == _HOST
    flat_dtype = (
        canonical_dtype(jnp.result_type(*set(dtypes)))
        if dtypes
        else np.dtype(jnp.result_type(float))
    )
    restructure = Restructure(
        structure, tuple(slots), tuple(shapes), tuple(dtypes), tuple(statics), flat_dtype
    )
    if statics:
        _warn_on_changed_statics(restructure)
    return _concat([leaves[i] for i in slots], flat_dtype, on_host, restructure.size), restructure
