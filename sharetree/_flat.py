"""``destructure`` / ``restructure``: a flat vector of the unique parameters."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import error, warn, wrong_type
from sharetree._flat_sharded import ShardedLayout, pack, sharded_layout, unpack, valid_mask
from sharetree._materialize import expand_leaves, expanded_tree, leaves_and_structure
from sharetree._paths import format_aval, path_str
from sharetree._resolve import Structure
from sharetree._transforms import canonical_dtype

__all__ = ["destructure", "Restructure"]


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


class _Static:
    """A non-parameter leaf kept by ``restructure``: arrays by identity, other values by value."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._key: Any = ("id", id(value))  # ``value`` is held, so the id stays its own
        if not isinstance(value, (jax.Array, np.ndarray)):
            try:  # faster than contextlib.suppress, and this runs per static leaf and call
                hash(value)
                self._key = ("value", type(value), value)
            except TypeError:
                pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


class Restructure:
    """Rebuild a tree from a flat vector of its unique parameters.

    Returned by :func:`destructure`. Calling it gives the **materialized** tree,
    :meth:`canonical` the canonical one (``Tied`` kept). Hashable (equal for the
    same structure, layout and static leaves) and a pytree node with no leaves;
    see the docs page "The flat path".

    Attributes:
        structure: the resolved sharing structure of the canonical tree.
        shapes: the shape of each buffer in the vector, in flatten order.
        dtypes: the dtype ``restructure`` gives each buffer back.
        sizes: the number of elements of each buffer.
        offsets: where each buffer starts in the vector (sharded: its part in each block).
        size: the length of the vector (sharded: with its zero padding).
        flat_dtype: the dtype of the vector (the buffers' promoted dtype).
        sharded: for a tree sharded over a mesh, the shard-major layout of the vector
            (see "The flat path at scale"); ``None`` for a tree on one device.

    Example:
        >>> import jax, jax.numpy as jnp, sharetree as st
        >>> tree = {"w": jnp.ones((2, 3)), "wT": st.Tied("w", st.T), "b": jnp.zeros(3)}
        >>> flat, re = st.destructure(tree)
        >>> loss = lambda v: jnp.sum(2 * re(v)["wT"]) + jnp.sum(re(v)["b"])
        >>> jax.jit(jax.grad(loss))(flat)  # "b" comes first in flatten order
        Array([1., 1., 1., 2., 2., 2., 2., 2., 2.], dtype=float32)
        >>> jax.tree.leaves((flat, re))  # re is a node with no leaves
        [Array([0., 0., 0., 1., 1., 1., 1., 1., 1.], dtype=float32)]
    """

    def __init__(
        self,
        structure: Structure,
        slots: tuple[int, ...],
        shapes: tuple[tuple[int, ...], ...],
        dtypes: tuple[np.dtype, ...],
        statics: tuple[tuple[int, _Static], ...],
        flat_dtype: np.dtype,
        sharded: ShardedLayout | None = None,
    ) -> None:
        self.structure = structure
        self.slots = slots
        self.shapes = shapes
        self.dtypes = dtypes
        self.statics = statics
        self.flat_dtype = flat_dtype
        self.sharded = sharded
        self.sizes = tuple(math.prod(s) for s in shapes)
        stored = self.sizes if sharded is None else sharded.parts
        self.size = sum(self.sizes) if sharded is None else sharded.length
        self.offsets = tuple(itertools.accumulate(stored[:-1], initial=0)) if shapes else ()
        self._key = (structure.treedef, slots, shapes, dtypes, statics, flat_dtype, sharded)
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Restructure) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        where = ""
        if self.sharded is not None:
            where = f", shard-major over {self.sharded.mesh.size} devices"
            where += f" with {self.sharded.padding:,} padding" if self.sharded.padding else ""
        return (
            f"Restructure({sum(self.sizes):,} {self.flat_dtype.name} parameters in "
            f"{len(self.slots)} buffers, {self.structure.treedef.num_leaves - len(self.slots)} "
            f"static leaves, {len(self.structure.views)} views{where})"
        )

    def _check(self, flat: Any) -> None:
        shape, dtype = getattr(flat, "shape", None), getattr(flat, "dtype", None)
        where, want = "restructure", f"a 1-D vector of {self.size} {self.flat_dtype.name} values"
        if shape is None or dtype is None or isinstance(flat, jax.ShapeDtypeStruct):
            raise wrong_type("E11", where, want, flat, _FIX_ARRAY)
        if len(shape) != 1:
            found = f"shape {tuple(shape)} (ndim {len(shape)})"
            raise error("E11", where, expected=want, found=found, fix=_FIX_BATCH)
        if shape[0] != self.size:
            numbers = sum(type(s.value) in (float, complex) for _, s in self.statics)
            fix = _FIX_LENGTH
            if 0 < shape[0] - self.size <= numbers:
                fix = f"make the {numbers} Python float/complex leaf/leaves arrays: {_FIX_FLOATS}"
            found = f"length {shape[0]} ({shape[0] - self.size:+d})"
            want = f"length {self.size} (the unique inexact parameters)"
            raise error("E10", where, expected=want, found=found, fix=fix)
        if not jax.dtypes.issubdtype(dtype, jnp.inexact) and self.size:
            want = f"a floating or complex vector ({self.flat_dtype.name})"
            raise error("E12", where, expected=want, found=f"dtype {dtype}", fix=_FIX_CAST)
        if _complex(np.dtype(dtype)) and not _complex(self.flat_dtype):
            want, found = f"a real vector ({self.flat_dtype.name})", np.dtype(dtype).name
            drop, fix = "would drop the imaginary parts", "pass jnp.real(flat) if it is meant"
            raise error("E12c", where, drop, expected=want, found=found, fix=fix)

    def mask(self) -> jax.Array:
        """A boolean vector like ``flat``: ``True`` at parameters, ``False`` at padding.

        Only a sharded vector has padding (zeros that get zero gradients); on one device
        every entry is a parameter. Pass it to ``optax.masked`` or multiply a random
        perturbation by it.

        Example:
            >>> import jax.numpy as jnp, sharetree as st
            >>> flat, re = st.destructure({"w": jnp.ones(3)})
            >>> re.mask()
            Array([ True,  True,  True], dtype=bool)
        """
        if self.sharded is None:
            return jnp.ones((self.size,), np.bool_)
        return valid_mask(self.sharded)

    def _leaves(self, flat: Any) -> list[Any]:
        self._check(flat)
        leaves: list[Any] = [None] * self.structure.treedef.num_leaves
        for i, static in self.statics:
            leaves[i] = static.value
        if self.sharded is not None:
            for i, buffer in zip(self.slots, unpack(flat, self.sharded, self.dtypes)):
                leaves[i] = buffer
        elif self.slots:
            pieces = self._split(jnp.asarray(flat))
            for i, piece, shape, dtype in zip(self.slots, pieces, self.shapes, self.dtypes):
                if _complex(piece.dtype) and not _complex(dtype):
                    piece = jnp.real(piece)
                leaves[i] = piece.reshape(shape).astype(dtype)
        return leaves

    def _split(self, flat: jax.Array) -> list[jax.Array]:
        sizes = self.sizes
        opaque = len(sizes) >= _OPAQUE_MIN and 0 < self.size < 2**31
        if opaque and isinstance(flat, jax.core.Tracer):
            # chosen at lowering: an export for cuda or tpu from a CPU host gets the plain split
            return list(
                jax.lax.platform_dependent(
                    flat,
                    cpu=functools.partial(_split_at, offsets=self.offsets, sizes=sizes),
                    default=functools.partial(_static_split, sizes=sizes),
                )
            )
        return _static_split(flat, sizes)

    def __call__(self, flat: Any) -> Any:
        """The materialized tree whose unique parameters are ``flat``."""
        leaves = self._leaves(flat)
        return expanded_tree(
            self.structure, leaves, expand_leaves(self.structure, leaves), "restructure"
        )

    def canonical(self, flat: Any) -> Any:
        """The canonical tree (``Tied`` nodes kept) whose unique parameters are ``flat``."""
        return jtu.tree_unflatten(self.structure.treedef, self._leaves(flat))


_FIX_ARRAY = "pass the vector from destructure (for shapes only, jax.eval_shape(restructure, flat))"
_FIX_BATCH = "pass one flat vector; use jax.vmap(restructure) for a batch"
_FIX_CAST = "cast it, e.g. flat.astype(jnp.float32)"
_FIX_FLOATS = "static outside jit, they are parameters inside it (or keep them out of the tree)"
_FIX_LENGTH = "pass the vector from the destructure of a tree of the same structure and shapes"


def _static_split(flat: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
    return list(jax.lax.split(flat, sizes)) if len(sizes) > 1 else [flat]


_OPAQUE_MIN = 8  # from this many buffers on, a traced vector is cut at opaque offsets (on CPU)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _split_at(flat: jax.Array, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[jax.Array]:
    """``lax.split`` at offsets XLA cannot fold (from a ``cond``): equal slices share a kernel."""
    pred = jax.lax.optimization_barrier(np.bool_(True))
    consts = tuple(np.int32(o) for o in offsets)
    starts = jax.lax.cond(pred, lambda: consts, lambda: consts)
    # offsets are never negative: no index wrapping (four fewer ops per buffer)
    return [
        jax.lax.dynamic_slice(flat, (o,), (n,), allow_negative_indices=False)
        for o, n in zip(starts, sizes)
    ]


@_split_at.defjvp
def _split_at_jvp(
    offsets: tuple[int, ...], sizes: tuple[int, ...], primals: Any, tangents: Any
) -> Any:
    # a static split transposes into concatenates (a dynamic_slice into a full-size pad)
    (flat,), (dflat,) = primals, tangents
    return _split_at(flat, offsets, sizes), _grouped_split(dflat, sizes)


_GROUPED_MIN = 64  # from this many buffers on, the opaque-offset tangent splits in two levels
_FUSED_GROUPS_MIN = 256  # from this many buffers on, the first level groups _FUSED_GROUP buffers
_FUSED_GROUP = 8  # XLA:CPU fuses a concatenate of up to 8 operands with their producers


def _grouped_split(flat: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
    """``lax.split`` in two levels behind a barrier: its transpose concatenates by groups."""
    n = len(sizes)
    if n < _GROUPED_MIN:
        return _static_split(flat, sizes)
    per = _FUSED_GROUP if n >= _FUSED_GROUPS_MIN else math.isqrt(n - 1) + 1  # else ceil(sqrt(n))
    groups = [sizes[i : i + per] for i in range(0, n, per)]
    chunks = jax.lax.optimization_barrier(jax.lax.split(flat, [sum(g) for g in groups]))
    return [piece for chunk, g in zip(chunks, groups) for piece in _static_split(chunk, g)]


jtu.register_pytree_node(Restructure, lambda r: ((), r), lambda r, _: r)


_ALIGN = 64  # byte alignment of the host vector: XLA:CPU then adopts it without a copy
LAYOUT_CACHE_SIZE = 32  # how many structures keep their last layout (oldest out)
_LAYOUTS: collections.OrderedDict[Structure, _Layout] = collections.OrderedDict()
_JIT_CONCAT_MAX = 2048  # above this many buffers, repeated calls keep the host concatenate


@dataclasses.dataclass
class _Layout:
    """How ``destructure`` flattened a tree; reused (jitted from the 2nd call) if one matches."""

    types: tuple[type, ...]  # of every leaf
    config: tuple[str, bool]  # default backend, x64
    leaf_dtypes: tuple[Any, ...]  # of every buffer, before canonicalization
    restructure: Restructure
    on_host: bool  # every buffer a host or CPU array: one NumPy concatenate
    jax_arrays: bool  # every buffer a concrete jax.Array: the jitted concatenate applies
    shardings: tuple[Any, ...] | None  # each buffer's, where jax has several devices
    calls: int = 0
    jitted: Any = None  # traces (and checks shapes and dtypes) only for a new signature

    def concat(self, buffers: list[Any]) -> Any:
        re = self.restructure
        if re.sharded is not None:  # each device packs its own shards
            return pack(buffers, re.sharded, re.flat_dtype)
        self.calls += 1
        n = len(buffers)
        if self.jitted is None and self.jax_arrays and self.calls > 1 and 1 < n <= _JIT_CONCAT_MAX:
            self.jitted = jax.jit(functools.partial(_concat_traced, layout=self))
        if self.jitted is not None:
            return self.jitted(*buffers)
        if not buffers:
            return jnp.zeros((0,), re.flat_dtype)
        if not self.on_host:
            return jnp.concatenate([jnp.ravel(x).astype(re.flat_dtype) for x in buffers])
        # one NumPy concatenate into an aligned vector that device_put on CPU adopts without a copy
        nbytes = re.size * re.flat_dtype.itemsize
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        out = raw[start : start + nbytes].view(re.flat_dtype)
        np.concatenate([np.asarray(x) for x in buffers], axis=None, out=out)
        return jax.device_put(out)


class _Mismatch(Exception):
    """The jitted concatenate was called with buffers of other shapes or dtypes."""


def _concat_traced(*buffers: Any, layout: _Layout) -> Any:
    # runs only when jit traces (a new signature): check it is this layout's
    if not _matches(layout, list(buffers)):
        raise _Mismatch
    dtype = layout.restructure.flat_dtype
    return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in buffers])


def _matches(layout: _Layout, buffers: list[Any]) -> bool:
    return (
        tuple(map(_shape, buffers)) == layout.restructure.shapes
        and tuple(map(_dtype, buffers)) == layout.leaf_dtypes
    )


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


def _flat_dtype(dtypes: set[np.dtype]) -> np.dtype:
    """The buffers' promoted dtype; 8-bit floats among others (JAX never promotes them): float32."""
    if len(dtypes) > 1:  # float8 and float4 values are exact in float32
        dtypes = {np.dtype(np.float32) if d.itemsize == 1 else d for d in dtypes}
    return canonical_dtype(jnp.result_type(*dtypes))


def _new_layout(
    leaves: list[Any], structure: Structure, types: tuple[type, ...], config: tuple[str, bool]
) -> _Layout:
    cpu = config[0] == "cpu"
    kinds: dict[type, int] = {}  # leaf type -> _HOST, _DEVICE or _OTHER
    canonical: dict[Any, np.dtype | None] = {}  # leaf dtype -> flat dtype, None if not inexact
    buffers: list[tuple[int, tuple[int, ...], np.dtype, Any]] = []  # slot, shape, dtype, leaf's
    statics: list[tuple[int, _Static]] = []
    on_host = jax_arrays = True
    for i, (x, t) in enumerate(zip(leaves, types)):
        kind = kinds.get(t)
        if kind is None:
            kind = kinds[t] = _kind(x, cpu)
        dtype = None
        if kind != _OTHER:
            if x.dtype not in canonical:
                inexact = jnp.issubdtype(x.dtype, jnp.inexact)
                canonical[x.dtype] = canonical_dtype(x.dtype) if inexact else None
            dtype = canonical[x.dtype]
        if dtype is None:
            statics.append((i, _Static(x)))
            continue
        buffers.append((i, tuple(x.shape), dtype, x.dtype))
        on_host = on_host and kind == _HOST
        jax_arrays = jax_arrays and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    slots, shapes, dtypes, leaf_dtypes = (tuple(c) for c in zip(*buffers)) if buffers else [()] * 4
    flat_dtype = _flat_dtype(set(dtypes)) if dtypes else np.dtype(jnp.result_type(float))
    sharded = shardings = None
    if jax.device_count() > 1:  # a buffer may span several devices: its layout is shard-major
        values = [leaves[i] for i in slots]
        shardings = tuple(map(_sharding, values))
        paths = [structure.buffer_paths[i] for i in slots]
        sharded = sharded_layout(values, paths, list(shapes))
    restructure = Restructure(structure, slots, shapes, dtypes, tuple(statics), flat_dtype, sharded)
    return _Layout(types, config, leaf_dtypes, restructure, on_host, jax_arrays, shardings)


def _sharding(x: Any) -> Any:
    return None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)


_WARNED: set[Any] = set()


def _warn_on_changed_statics(previous: Restructure, restructure: Restructure) -> None:
    """Warn once per leaf when only static leaves changed since the previous destructure."""
    key = restructure._key[:4] + restructure._key[5:]  # all but the static values
    if previous._key[:4] + previous._key[5:] != key:
        return
    for (i, old), (_, new) in zip(previous.statics, restructure.statics):
        if old != new and (key, i) not in _WARNED:
            _WARNED.add((key, i))
            where = path_str(restructure.structure.buffer_paths[i])
            where = f"destructure: the static leaf {where!r} ({format_aval(new.value)})"
            what = (
                "is another array object (arrays compare by identity) than at the last destructure"
                if new._key[0] == "id"
                else "changed since the last destructure of this structure"
            )
            warn("E160", where, f"{what}: a jit retraces", fix=_FIX_STATIC)


_FIX_STATIC = "keep values that change every step out of the tree, e.g. destructure state.params"


def destructure(tree: Any) -> tuple[jax.Array, Restructure]:
    """Flatten the unique inexact buffers of ``tree`` into one 1-D vector.

    Every floating or complex buffer, in flatten order, goes into ``flat`` in
    their promoted dtype (views are never stored). Other leaves (integer arrays,
    Python numbers, strings) stay static inside ``restructure``, held as they
    are; see the docs page "The flat path" for how they compare.

    Returns:
        ``(flat, restructure)``: ``restructure(flat)`` is the materialized tree
        with the original dtypes; ``restructure.canonical(flat)`` the canonical one.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> tree = {"x": jnp.array([7.0, 7.0]), "y": jnp.array([3.0, 4.0]), "z": st.Tied("x")}
        >>> flat, re = st.destructure(tree)
        >>> flat
        Array([7., 7., 3., 4.], dtype=float32)
        >>> re(jnp.array([1.0, 10.0, 100.0, 1000.0]))["z"]
        Array([ 1., 10.], dtype=float32)
    """
    leaves, structure = leaves_and_structure(tree)
    types = tuple(map(type, leaves))
    config = (jax.default_backend(), bool(jax.config.read("jax_enable_x64")))
    # nothing traced may outlive the trace (a traced integer leaf would leak): no layout kept
    traced = any(issubclass(t, jax.core.Tracer) for t in types)
    # the last layout of this structure, if the leaves' types, shapes, dtypes and statics match
    previous = None if traced else _LAYOUTS.get(structure)
    if previous is not None and previous.types == types and previous.config == config:
        re = previous.restructure
        buffers = [leaves[i] for i in re.slots]
        placed = previous.shardings is None or tuple(map(_sharding, buffers)) == previous.shardings
        if placed and all(_Static(leaves[i]) == static for i, static in re.statics):
            if previous.jitted is not None:
                try:  # a new signature traces again, which checks every shape and dtype
                    return previous.concat(buffers), re
                except _Mismatch:
                    pass
            elif _matches(previous, buffers):
                return previous.concat(buffers), re
    layout = _new_layout(leaves, structure, types, config)
    if not traced:
        _LAYOUTS[structure] = layout
        _LAYOUTS.move_to_end(structure)
        if len(_LAYOUTS) > LAYOUT_CACHE_SIZE:
            _LAYOUTS.popitem(last=False)
    if previous is not None and layout.restructure.statics:
        _warn_on_changed_statics(previous.restructure, layout.restructure)
    buffers = [leaves[i] for i in layout.restructure.slots]
    return layout.concat(buffers), layout.restructure
