"""The flat vector of a sharded tree: shard-major, each device's block its own shards.

A tree whose buffers are sharded over a mesh gets a flat vector sharded over the
mesh's devices (in the mesh's order): device ``d``'s block is the concatenation, in
flatten order, of its part of every buffer. A buffer split over every mesh axis
contributes its shard as it is. A buffer replicated over some axes (wholly, or
beside its sharded axes) is stored once, as FSDP stores it: its shard, zero-padded
to a multiple of the replica count, is cut into one part per replica, and
``restructure`` all-gathers the parts over those axes (a reduce-scatter in the VJP).
Packing and unpacking run in ``shard_map``: nothing else moves between devices.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharetree._errors import error
from sharetree._paths import Path, path_str

__all__ = ["ShardedLayout", "sharded_layout", "pack", "unpack", "valid_mask"]

_shard_map: Any = jax.shard_map  # jax >= 0.7 (jax.experimental.shard_map is deprecated)
# Where all_gather takes to="invarying" (jax 0.10), the gather is typed invariant and
# transposes to a slice: no collective in the VJP beyond the tree's own. Elsewhere the
# untyped gather transposes to a reduce-scatter of copies that JAX scales back (exact,
# one collective more per replicated buffer).
_TYPED = "to" in inspect.signature(jax.lax.all_gather).parameters
_PROGRAMS = 32  # compiled pack / unpack / mask programs kept per kind (each holds its mesh)


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """Where each buffer of a sharded tree sits in every device's block of the flat vector.

    Attributes:
        mesh: the mesh every buffer is sharded over; the vector spans its devices in order.
        specs: each buffer's ``PartitionSpec`` on ``mesh`` (``restructure`` gives it back).
        shard_shapes: the shape of each buffer's shard on one device.
        gather_axes: the mesh axes each buffer is replicated over (its parts gathered over).
        replicas: how many devices hold each shard (the product of those axes' sizes).
        parts: the length of each buffer's part in a block (its shard, padded, / replicas).
    """

    mesh: Mesh
    specs: tuple[PartitionSpec, ...]
    shard_shapes: tuple[tuple[int, ...], ...]
    gather_axes: tuple[tuple[str, ...], ...]
    replicas: tuple[int, ...]
    parts: tuple[int, ...]

    @property
    def block(self) -> int:
        """The length of one device's block."""
        return sum(self.parts)

    @property
    def length(self) -> int:
        """The length of the vector: one block per device."""
        return self.block * self.mesh.size

    @property
    def padding(self) -> int:
        """How many entries of the vector are zero padding (no parameter)."""
        return sum(
            (r * p - math.prod(s)) * (self.mesh.size // r)
            for s, r, p in zip(self.shard_shapes, self.replicas, self.parts)
        )

    @property
    def sharding(self) -> NamedSharding:
        """The vector's sharding: split over all the mesh's axes, in the mesh's device order."""
        return NamedSharding(self.mesh, self.flat_spec)

    @property
    def flat_spec(self) -> PartitionSpec:
        return PartitionSpec(tuple(self.mesh.axis_names))


def _used_axes(spec: PartitionSpec) -> set[str]:
    used: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        used.update((entry,) if isinstance(entry, str) else entry)
    return used


_FIX_MESH = (
    "put every floating buffer on one mesh, e.g. jax.device_put(x, NamedSharding(mesh, P())) "
    "to replicate one (the flat vector is laid out over one mesh's devices)"
)


def sharded_layout(
    buffers: Sequence[Any], paths: Sequence[Path], shapes: Sequence[tuple[int, ...]]
) -> ShardedLayout | None:
    """The layout of the buffers' vector when one of them spans several devices, else ``None``.

    Every concrete ``jax.Array`` buffer must be on one mesh (``NamedSharding``, E300);
    host arrays (NumPy) are replicated onto it by :func:`pack`.
    """
    shardings = [
        x.sharding if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else None
        for x in buffers
    ]
    first = next(
        (i for i, s in enumerate(shardings) if s is not None and len(s.device_set) > 1), None
    )
    if first is None:
        return None
    lead = shardings[first]
    if not isinstance(lead, NamedSharding):
        where = f"destructure {path_str(paths[first])!r}"
        raise error("E300", where, **_not_on_mesh(lead, None))
    mesh = typing.cast(Mesh, lead.mesh)
    specs, shard_shapes, gather, replicas, parts = [], [], [], [], []
    for s, path, shape in zip(shardings, paths, shapes):
        if s is None:  # a host array: replicated on the mesh
            spec = PartitionSpec()
        elif isinstance(s, NamedSharding) and s.mesh == mesh:
            spec = s.spec
        else:
            where, facts = f"destructure {path_str(path)!r}", _not_on_mesh(s, (paths[first], lead))
            if len(s.device_set) == 1:
                raise error("E301", where, **facts)
            raise error("E300", where, **facts)
        shard = tuple(NamedSharding(mesh, spec).shard_shape(tuple(shape)))
        used = _used_axes(spec)
        axes = tuple(a for a in mesh.axis_names if a not in used)
        r = math.prod(mesh.shape[a] for a in axes)
        specs.append(spec)
        shard_shapes.append(shard)
        gather.append(axes)
        replicas.append(r)
        parts.append(-(-math.prod(shard) // r))
    return ShardedLayout(
        mesh, tuple(specs), tuple(shard_shapes), tuple(gather), tuple(replicas), tuple(parts)
    )


def _not_on_mesh(sharding: Any, lead: tuple[Path, Any] | None) -> dict[str, str]:
    if lead is None:
        expected = "a NamedSharding for a buffer that spans several devices"
    else:
        expected = f"the mesh of {path_str(lead[0])!r} ({_mesh_text(lead[1])})"
    return {"expected": expected, "found": _mesh_text(sharding), "fix": _FIX_MESH}


def _mesh_text(sharding: Any) -> str:
    mesh = getattr(sharding, "mesh", None)
    if isinstance(sharding, NamedSharding) and isinstance(mesh, Mesh):
        axes = ", ".join(f"{a!r}: {n}" for a, n in mesh.shape.items())
        ids = [d.id for d in mesh.devices.flat]
        return f"a mesh {{{axes}}} of devices {ids}, spec {sharding.spec}"
    ids = sorted(d.id for d in sharding.device_set)
    return f"{type(sharding).__name__} on devices {ids}"


def _pack_local(*shards: jax.Array, layout: ShardedLayout, dtype: np.dtype) -> jax.Array:
    pieces = []
    for x, axes, r, p in zip(shards, layout.gather_axes, layout.replicas, layout.parts):
        v = jnp.ravel(x).astype(dtype)
        if r > 1:  # stored once: this replica's part of the zero-padded shard
            v = jnp.pad(v, (0, r * p - v.size))
            v = jax.lax.dynamic_slice(v, (jax.lax.axis_index(axes) * p,), (p,))
        pieces.append(v)
    return jnp.concatenate(pieces) if pieces else jnp.zeros((0,), dtype)


@functools.lru_cache(maxsize=_PROGRAMS)
def _packer(layout: ShardedLayout, dtype: np.dtype) -> Any:
    local = functools.partial(_pack_local, layout=layout, dtype=dtype)
    mapped = _shard_map(
        local,
        mesh=layout.mesh,
        in_specs=layout.specs,
        out_specs=layout.flat_spec,
        check_vma=_TYPED,
    )
    return jax.jit(mapped)


def pack(buffers: Sequence[Any], layout: ShardedLayout, dtype: np.dtype) -> jax.Array:
    """The flat vector of ``buffers``: each device packs its own shards, nothing moves."""
    on_mesh = [
        x
        if isinstance(x, jax.Array)
        else jax.device_put(np.asarray(x), NamedSharding(layout.mesh, s))
        for x, s in zip(buffers, layout.specs)
    ]
    return _packer(layout, dtype)(*on_mesh)


def _gather(part: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    if _TYPED:
        return jax.lax.all_gather(part, axes, tiled=True, to="invarying")
    return jax.lax.all_gather(part, axes, tiled=True)


def _unpack_local(
    block: jax.Array, layout: ShardedLayout, dtypes: tuple[np.dtype, ...]
) -> tuple[jax.Array, ...]:
    out = []
    start = 0
    for shape, axes, r, p, dtype in zip(
        layout.shard_shapes, layout.gather_axes, layout.replicas, layout.parts, dtypes
    ):
        v = jax.lax.slice(block, (start,), (start + p,))
        start += p
        if r > 1:  # the replicas' parts of the shard, then the padding cut off
            v = _gather(v, axes)[: math.prod(shape)]
        if jnp.issubdtype(v.dtype, jnp.complexfloating) and not jnp.issubdtype(
            dtype, jnp.complexfloating
        ):
            v = jnp.real(v)
        out.append(v.reshape(shape).astype(dtype))
    return tuple(out)


@functools.lru_cache(maxsize=_PROGRAMS)
def _unpacker(layout: ShardedLayout, dtypes: tuple[np.dtype, ...]) -> Any:
    local = functools.partial(_unpack_local, layout=layout, dtypes=dtypes)
    mapped = _shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(layout.flat_spec,),
        out_specs=layout.specs,
        check_vma=_TYPED,
    )
    return jax.jit(mapped)


def unpack(flat: Any, layout: ShardedLayout, dtypes: tuple[np.dtype, ...]) -> list[jax.Array]:
    """Every buffer of the vector with its sharding; only replicated buffers are gathered."""
    if not isinstance(flat, jax.core.Tracer) and getattr(flat, "sharding", None) != layout.sharding:
        flat = jax.device_put(
            flat if isinstance(flat, jax.Array) else np.asarray(flat), layout.sharding
        )
    return list(_unpacker(layout, dtypes)(flat))


@functools.lru_cache(maxsize=_PROGRAMS)
def _masker(layout: ShardedLayout) -> Any:
    def local(block: jax.Array) -> jax.Array:
        ones = [jnp.ones(s, np.bool_) for s in layout.shard_shapes]
        return _pack_local(*ones, layout=layout, dtype=np.dtype(np.bool_))

    mapped = _shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(layout.flat_spec,),
        out_specs=layout.flat_spec,
        check_vma=_TYPED,
    )
    return jax.jit(mapped)


def valid_mask(layout: ShardedLayout) -> jax.Array:
    """A boolean vector like the flat one: ``True`` at parameters, ``False`` at padding."""
    # one element per device: the mask is built where each block is, from the layout alone
    empty = jax.make_array_from_callback(
        (layout.mesh.size,), layout.sharding, lambda index: np.zeros(1, np.bool_)
    )
    return _masker(layout)(empty)
