"""Reading and writing safetensors files: clear errors for damaged files, atomic saves."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import errno
import json
import math
import os
import secrets
import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Sharding

from sharetree._errors import error, one_line, short, wrong_type
from sharetree._paths import Path, leaves_with_paths, path_str
from sharetree._sharding import check_fits
from sharetree._tied import is_tied

__all__ = [
    "NATIVE_CODES",
    "CODES",
    "BufferLeaf",
    "DuplicateKey",
    "PathOrStr",
    "check_load_fits",
    "is_numeric",
    "only_in",
    "Pending",
    "Reader",
    "Tensor",
    "TensorInfo",
    "read_tree",
    "atomic_write",
    "atomic_write_text",
    "byte_runs",
    "create_temp",
    "file_path",
    "header_bytes",
    "Layout",
    "replaced_mode",
    "Runs",
    "Slot",
    "unique_pairs",
    "write_runs",
]

NATIVE_CODES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
"""safetensors dtype codes -> the dtype names ``st.save`` stores under their own code."""

# every code the raw fallback reader knows: the native ones and float8 (which numpy lacks)
CODES = {
    **NATIVE_CODES, "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}  # fmt: skip


PathOrStr = Union[str, bytes, "os.PathLike[str]"]
"""A file's path, as ``open`` takes it."""

_RESAVE = "save the file again with st.save, or check that the path names the right file"


def is_numeric(dtype: np.dtype) -> bool:
    """Whether a file holds arrays of ``dtype``: numbers and booleans, ml_dtypes' types too."""
    return dtype.kind in "biufc" or (dtype.kind == "V" and bool(jnp.issubdtype(dtype, jnp.number)))


def file_path(path: Any, verb: str) -> str:
    """``path`` (a ``str``, ``bytes`` or ``os.PathLike``) as a ``str``, else a :class:`TieError`."""
    fix = "pass the file's path, e.g. 'model.safetensors'"
    try:
        text = os.fsdecode(path)
    except TypeError:
        raise wrong_type("E49", f"{verb}: the path", "a str or os.PathLike", path, fix) from None
    if not text or "\0" in text:
        raise error("E49", f"{verb}: the path {short(text)}", "is empty or holds a NUL", fix=fix)
    return text


class DuplicateKey(ValueError):
    """A JSON object that names one key twice (raised by :func:`unique_pairs`)."""

    def __init__(self, key: str, first: Any, second: Any) -> None:
        super().__init__(f"the key {key!r} is given twice")
        self.key, self.first, self.second = key, first, second


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of ``json.loads`` that refuses a key given twice."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k, out[k], v)
        out[k] = v
    return out


class TensorInfo(NamedTuple):
    """Name, safetensors dtype code (``"F32"``) and shape of one tensor, from the header."""

    name: str
    code: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of its data (0 for a dtype code sharetree does not know)."""
        name = CODES.get(self.code)
        return 0 if name is None else math.prod(self.shape) * jnp.dtype(name).itemsize


Index = tuple[slice, ...]
"""A part of an array: one ``slice`` per dimension, as ``Sharding.devices_indices_map`` gives."""


class Reader:
    """One safetensors file, opened once: its metadata, tensor infos and any part of a tensor."""

    def __init__(self, path: str, verb: str = "load") -> None:
        from safetensors import safe_open

        self.path, self.verb = path, verb
        where = f"{verb}: {path!r}"
        if os.path.exists(path) and not os.path.isfile(path):  # a pipe would block the read
            what, fix = "is not a regular file (a directory, a pipe or a device)", "give a file"
            raise error("E51", where, what, fix=f"{fix}, e.g. 'model.safetensors'")
        try:
            with open(path, "rb") as raw:  # for what the library does not say: duplicates, offsets
                (n,) = struct.unpack("<Q", raw.read(8))
                self._data_start = 8 + n
                header = raw.read(n) if n <= _MAX_HEADER else b""
            self._file = safe_open(path, framework="np")  # validates the header and offsets
            self._header = json.loads(header, object_pairs_hook=unique_pairs)
            self.metadata: dict[str, str] = self._header.pop("__metadata__", None) or {}
            self.infos: dict[str, TensorInfo] = {  # sorted, as the library lists them
                name: TensorInfo(name, h["dtype"], tuple(h["shape"]))
                for name, h in sorted(self._header.items())
            }
        except DuplicateKey as e:  # the library keeps the last of two: a silent pick
            what = f"its header names {short(e.key)} twice"
            raise error("E52", where, what, fix="write the file again") from None
        except Exception as e:  # SafetensorError, OSError of a directory, ...
            what = f"is not a readable safetensors file ({one_line(e)})"
            raise error("E120", where, what, fix=_RESAVE) from e

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every tensor as a NumPy array that owns its memory, in header order."""
        for name in self.infos:
            yield name, self.read(name)

    def read(
        self,
        name: str,
        index: Index | None = None,
        view: tuple[np.dtype, tuple[int, ...]] | None = None,
    ) -> np.ndarray:
        """The tensor ``name``, or its part ``index``, as a NumPy array that owns its memory.

        Only that part's bytes are read. ``view``: ``(dtype, shape)`` that a ``uint8`` tensor holds.
        """
        info, stored = self.infos[name], view is None
        if view is None:
            code = CODES.get(info.code)
            if code is None:
                where = f"{self.verb}: the tensor {short(name)} of {self.path!r}"
                what, known = f"has the dtype code {short(info.code)}", ", ".join(CODES)
                raise error("E121", where, what, expected=known, fix="convert the file")
            view = (jnp.dtype(code), info.shape)
        dtype, shape = view
        index = tuple(slice(0, n) for n in shape) if index is None else index
        part = _part_shape(index, shape)
        if 0 in part:
            return np.empty(part, dtype)
        cause: BaseException | None = None
        try:
            if stored:  # under its own code: the library reads it
                a = self._file.get_slice(name)[index]
                return a if a.flags.writeable else np.array(a)  # read-only: the file's memory
        except Exception as e:  # a dtype numpy lacks (float8), or damaged data
            cause = e
        try:  # from its bytes: the offsets come from the header (the library validated them)
            start = int(self._header[name]["data_offsets"][0])
            whole = np.memmap(self.path, dtype, "r", self._data_start + start, shape or (1,))
            return np.array(whole.reshape(shape)[index])
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = f"cannot be read ({one_line(cause) + '; ' if cause else ''}{one_line(e)})"
            where = f"{self.verb}: the tensor {short(name)} of {self.path!r}"
            raise error("E120", where, why, fix="check that the file is complete") from e


def _part_shape(index: Index, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the part ``index`` of an array of ``shape``."""
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


_MAX_HEADER = 100 << 20
"""The largest header any safetensors reader takes (a larger one is refused by the library)."""

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
        out = np.empty(_part_shape(index, self.shape), self.dtype)
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


def _serialize_file(
    tensors: dict[str, np.ndarray], filename: str, metadata: dict[str, str]
) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, filename, metadata=metadata)


def create_temp(directory: str, base: str, token: str | None = None) -> str:
    """Create a new file ``.{base}.{token}.tmp`` in ``directory``, mode ``0o666`` less the umask.

    ``token``: the hex token of its name (a fresh random one by default).
    """
    for _ in range(1 if token else 100):
        tmp = os.path.join(directory, f".{base}.{token or secrets.token_hex(6)}.tmp")
        with contextlib.suppress(FileExistsError):
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
    raise FileExistsError(f"cannot create a temporary file in {directory!r}")  # pragma: no cover


def replaced_mode(path: str, target: str) -> int | None:
    """The mode of the file ``target`` (``path`` resolved) that a save replaces, ``None`` if none.

    Raises:
        PermissionError: the file is read-only (as ``open(path, "wb")`` refuses).
    """
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    if mode is not None and not os.access(target, os.W_OK):
        raise PermissionError(
            errno.EACCES, f"cannot write {path!r}: the file is read-only (left as it was)"
        )
    return mode


class Slot(NamedTuple):
    """One tensor of a file being laid out: its name, dtype code, stored shape and byte size."""

    name: str
    code: str
    shape: tuple[int, ...]
    nbytes: int


class Layout(NamedTuple):
    """Where each tensor's bytes go in a safetensors file: the header and each tensor's start.

    ``start``: file offset of each tensor's first byte; ``size``: the file's size.
    """

    header: bytes
    start: dict[str, int]
    size: int


_ORDER = "U64 I64 F64 C64 F32 U32 I32 BF16 F16 U16 I16 F8_E8M0 F8_E4M3 F8_E5M2 I8 U8 BOOL".split()
"""The order of dtypes in a file ``safetensors.save_file`` writes (its dtype enum, descending):
the widest first, so every tensor's data starts aligned."""


def header_bytes(slots: list[Slot], metadata: dict[str, str]) -> Layout:
    """The layout of a safetensors file of ``slots``, as ``safetensors.save_file`` lays it out.

    The tensors are ordered by dtype (as ``safetensors`` orders them: the widest first), then
    by name; the header is padded with spaces to a multiple of 8 bytes, so every tensor
    starts aligned. The header is byte for byte the one ``safetensors`` writes.

    Example:
        >>> lay = header_bytes([Slot("a", "F32", (2,), 8), Slot("b", "U8", (3,), 3)], {})
        >>> lay.start, lay.size, len(lay.header) % 8
        ({'a': 120, 'b': 128}, 131, 0)
    """
    ordered = sorted(slots, key=lambda s: (_ORDER.index(s.code), s.name))
    entries: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset, offsets = 0, {}
    for s in ordered:
        entries[s.name] = {"dtype": s.code, "shape": list(s.shape), "data_offsets": [0, 0]}
        entries[s.name]["data_offsets"] = [offset, offset + s.nbytes]
        offsets[s.name], offset = offset, offset + s.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > _MAX_HEADER:
        raise OverflowError(f"a header of {len(text):,} bytes, over the readers' 100 MB")
    data = 8 + len(text)
    header = struct.pack("<Q", len(text)) + text
    return Layout(header, {k: data + v for k, v in offsets.items()}, data + offset)


class Runs(NamedTuple):
    """The contiguous runs of a part of an array.

    ``offsets``: each run's byte offset in the array (C order, in the part's order);
    ``length``: the bytes of every run.
    """

    offsets: np.ndarray
    length: int


def byte_runs(shape: tuple[int, ...], itemsize: int, bounds: tuple[tuple[int, int], ...]) -> Runs:
    """The contiguous runs of the part ``bounds`` of a C-ordered array, relative to its start.

    ``bounds``: ``(start, stop)`` per axis. A part whole in its trailing axes is one run
    per index of its leading axes (one run for a part of rows; a row per run for a part
    of columns).

    Example:
        >>> byte_runs((4, 6), 1, ((0, 4), (2, 4)))
        Runs(offsets=array([ 2,  8, 14, 20]), length=2)
        >>> byte_runs((4, 6), 4, ((2, 4), (0, 6)))
        Runs(offsets=array([48]), length=48)
    """
    k = len(shape)  # the axes from k on are whole in the part
    while k > 0 and bounds[k - 1] == (0, shape[k - 1]):
        k -= 1
    tail = math.prod(shape[k:]) * itemsize
    if k == 0:
        return Runs(np.zeros(1, np.int64), tail)
    lead = [np.arange(a, b, dtype=np.int64) for a, b in bounds[: k - 1]]
    first = bounds[k - 1]
    length = (first[1] - first[0]) * tail
    strides = [math.prod(shape[i + 1 : k]) * tail for i in range(k - 1)]
    offsets = np.zeros([len(x) for x in lead] or [1], np.int64)
    for i, idx in enumerate(lead):
        view = [1] * len(lead)
        view[i] = len(idx)
        offsets = offsets + (idx * strides[i]).reshape(view)
    return Runs(offsets.reshape(-1) + first[0] * tail, length)


def write_runs(fd: int, start: int, part: np.ndarray, runs: Runs) -> int:
    """Write the C-ordered bytes of ``part`` at ``start`` + each run's offset (``os.pwrite``).

    ``runs``: :func:`byte_runs` of the part. Returns the bytes written.
    """
    offsets, length = runs
    data = np.ascontiguousarray(part).reshape(-1).view(np.uint8).data
    if len(data) != len(offsets) * length:  # pragma: no cover - the plan and the part disagree
        raise ValueError(f"a part of {len(data)} bytes for {len(offsets)} runs of {length}")
    for i, offset in enumerate(offsets.tolist()):
        chunk = data[i * length : (i + 1) * length]
        at = start + offset
        while chunk:  # pwrite may write less than asked
            n = os.pwrite(fd, chunk, at)
            chunk, at = chunk[n:], at + n
    return len(data)


def atomic_write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write a safetensors file to a temporary file beside ``path``, then rename it over ``path``.

    A new file gets the umask's mode, a replaced file keeps its mode.
    """
    target = os.path.realpath(path)  # through a symlink: the link stays, its target is replaced
    directory = os.path.dirname(target)
    mode = replaced_mode(path, target)
    try:
        tmp = create_temp(directory, os.path.basename(target))
    except OSError as e:  # a missing or read-only directory: name the file, not the temporary
        raise type(e)(e.errno, f"cannot write {path!r}: {e.strerror} ({directory!r})") from e
    try:
        if mode is None:  # the kernel applied the umask to 0o666: that is the mode
            mode = stat.S_IMODE(os.stat(tmp).st_mode)
        _serialize_file(tensors, tmp, metadata)  # (safetensors may replace the file: new mode)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` beside ``path`` then rename it over ``path``, as ``atomic_write`` does.

    A new file gets the umask's mode, a replaced file keeps its mode (a read-only one is
    refused, left as it was).
    """
    target = os.path.realpath(path)
    mode = replaced_mode(path, target)
    tmp = create_temp(os.path.dirname(target), os.path.basename(target))
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
