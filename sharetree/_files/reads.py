"""Lazy reads: a loaded tree's leaves read when asked, each process only its shards."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Sharding

from sharetree._errors import error, wrong_type
from sharetree._files.container import Index, Reader, part_shape
from sharetree._paths import Path, leaves_with_paths, path_str
from sharetree._sharding import check_fits
from sharetree._tied import is_tied

__all__ = ["Pending", "Tensor", "BufferLeaf", "read_tree", "check_load_fits", "only_in"]


_CHUNK = 16 << 20
"""Bytes of the stored tensor read at a time when a transposed tensor is read whole."""


class Pending(abc.ABC):
    """A leaf of a loaded tree not read yet: its ``shape`` and ``dtype``, and how to read it."""

    shape: tuple[int, ...]
    dtype: Any

    @abc.abstractmethod
    def read(self) -> Any:
        """The whole value, on the host."""

    @abc.abstractmethod
    def place(self, sharding: Any) -> jax.Array:
        """One global array with ``sharding``, each process reading only its shards."""


@dataclasses.dataclass(frozen=True, eq=False)
class Tensor(Pending):
    """A tensor of a file, not read yet: its shape and dtype, and how to read any part of it.

    ``axes``: the stored tensor transposed by these axes, each part as it is
    read. ``view``: the stored ``uint8`` tensor holds this array's raw bytes.
    """

    reader: Reader
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[int, ...] | None = None
    view: bool = False

    def read(self, index: Index | None = None) -> np.ndarray:
        """The array, or its part ``index``, as a NumPy array (only that part's bytes are read)."""
        if self.axes is None or not self.shape:
            view = (self.dtype, self.shape) if self.view else None
            return self.reader.read(self.name, index, view)
        index = tuple(slice(0, n) for n in self.shape) if index is None else index
        # the stored tensor's part: its axis axes[k] is this array's axis k
        stored, shape = [slice(0)] * len(self.axes), [0] * len(self.axes)
        for k, a in enumerate(self.axes):
            stored[a], shape[a] = index[k], self.shape[k]
        view = (self.dtype, tuple(shape)) if self.view else None
        out = np.empty(part_shape(index, self.shape), self.dtype)
        if out.size == 0:
            return out
        first = range(*index[0].indices(self.shape[0]))
        step = max(1, _CHUNK // out[0].nbytes)
        for i in range(0, len(first), step):  # a bounded part at a time: never two whole copies
            rows = first[i : i + step]
            stored[self.axes[0]] = slice(rows.start, rows.stop)
            part = self.reader.read(self.name, tuple(stored), view)
            out[i : i + step] = np.transpose(part, self.axes)
        return out

    def place(
        self, sharding: Sharding, wrap: Callable[[jax.Array], jax.Array] | None = None
    ) -> jax.Array:
        """One global array with ``sharding``: each distinct addressable part read once, then freed.

        ``wrap``: for typed PRNG keys: ``sharding`` is of ``shape[:-1]`` and
        each part (its last axis whole) is wrapped on its device.
        """
        shape = self.shape if wrap is None else self.shape[:-1]
        parts: dict[tuple[tuple[int, int], ...], tuple[Index, list[Any]]] = {}
        devices = sharding.addressable_devices_indices_map(shape)
        for device, where in devices.items():
            index: Index = tuple(where or ())
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
            parts.setdefault(bounds, (index, []))[1].append(device)
        on: dict[Any, jax.Array] = {}
        for index, replicas in parts.values():
            host = self.read(index if wrap is None else (*index, slice(None)))
            for device in replicas:
                to = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
                x = jax.device_put(host, to)
                on[device] = x if wrap is None else wrap(x)
            del host
        arrays = [on[device] for device in devices]  # in the sharding's order (keys need it)
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


@dataclasses.dataclass(frozen=True, eq=False)
class BufferLeaf(Pending):
    """A buffer of a file ``st.save`` wrote, not read yet: an array, NumPy scalar or typed keys."""

    tensor: Tensor
    shape: tuple[int, ...]
    dtype: Any
    scalar: bool = False  # a NumPy scalar (np.float32(1.0)) on the host
    key: str | None = None  # typed PRNG keys of this implementation, from their key data

    def _wrap(self, data: jax.Array) -> jax.Array:
        return jax.random.wrap_key_data(data, impl=self.key)

    def read(self) -> Any:
        a = self.tensor.read()
        if self.key is not None:
            return self._wrap(jnp.asarray(a))
        return a[()] if self.scalar else a

    def place(self, sharding: Any) -> jax.Array:
        return self.tensor.place(sharding, None if self.key is None else self._wrap)


def read_tree(label: str, tree: Any, shardings: Any) -> Any:
    """``tree`` with every :class:`Pending` leaf read (each once, every sharding checked first)."""
    got = dict(leaves_with_paths(tree, is_tied))
    want: dict[Path, Any] = {}
    if shardings is not None:
        want = dict(
            leaves_with_paths(
                shardings, lambda x: x is None or is_tied(x) or isinstance(x, Sharding)
            )
        )
        buffers = [p for p, x in got.items() if isinstance(x, Pending)]
        missing, extra = only_in(buffers, want), only_in(want, got)
        if missing != "none" or extra != "none":
            found = f"buffers without a sharding: {missing}; paths not in the file: {extra}"
            fix = "build them from the tree: jax.tree.map(lambda x: sharding, abstract_tree)"
            where = f"load: shardings= for {label}"
            raise error("E35", where, "does not match its buffers", found=found, fix=fix)
        want = {p: want[p] for p in buffers if want[p] is not None and not is_tied(want[p])}
        for p, s in want.items():
            if not isinstance(s, Sharding):
                where, expected = f"load: shardings= at {path_str(p)!r}", "a jax Sharding"
                raise wrong_type("E35", where, expected, s, "give a Sharding, or None: the host")
            check_load_fits(path_str(p), got[p].shape, s)
    leaves = [
        x if not isinstance(x, Pending) else x.place(want[p]) if p in want else x.read()
        for p, x in got.items()
    ]
    return _refill(tree, iter(leaves))


def _refill(x: Any, leaves: Iterator[Any]) -> Any:
    """``x`` with its leaves from ``leaves``; unlike ``tree_unflatten``, keeps dict key order."""
    if is_tied(x):
        return next(leaves)  # a leaf of leaves_with_paths(tree, is_tied)
    if type(x) is dict:
        values = {k: _refill(x[k], leaves) for k in sorted(x)}  # jax flattens dicts sorted
        return {k: values[k] for k in x}
    if jtu.all_leaves([x]):
        return next(leaves)
    children, node = jtu.tree_flatten(x, is_leaf=lambda y: y is not x)
    return jtu.tree_unflatten(node, [_refill(c, leaves) for c in children])


def check_load_fits(where: str, shape: tuple[int, ...], sharding: Any) -> None:
    """:func:`check_fits` for ``load``'s sharding of the buffer at ``where``."""
    fix = "or pass None to keep the buffer on the host"
    check_fits(f"load: the sharding at {where!r}", shape, sharding, fix, code="E90")


def only_in(paths: Any, other: Any) -> Any:
    """The first five of ``paths`` not in ``other``, sorted and shown (``'none'`` if none)."""
    return sorted(map(path_str, set(paths) - set(other)))[:5] or "none"
