"""The safetensors container: its header parsed and written, the byte range of each tensor."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from sharetree._errors import error, one_line, short
from sharetree._files.disk import DuplicateKey, loads, write_atomically

__all__ = [
    "NATIVE_CODES",
    "CODES",
    "is_numeric",
    "TensorInfo",
    "Index",
    "Reader",
    "part_shape",
    "Slot",
    "Layout",
    "header_bytes",
    "Runs",
    "byte_runs",
    "write_runs",
    "write_tensors",
    "atomic_write",
    "CODE_OF",
]


NATIVE_CODES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
"""safetensors dtype codes -> the dtype names ``st.save`` stores under their own code."""

CODE_OF = {name: code for code, name in NATIVE_CODES.items()}
"""dtype name -> the safetensors code it is stored under."""

CODES = {
    **NATIVE_CODES, "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}  # fmt: skip

_RESAVE = "save the file again with st.save, or check that the path names the right file"


def is_numeric(dtype: np.dtype) -> bool:
    """Whether a file holds arrays of ``dtype``: numbers and booleans, ml_dtypes' types too."""
    return dtype.kind in "biufc" or (dtype.kind == "V" and bool(jnp.issubdtype(dtype, jnp.number)))


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
            self._header = loads(header)
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
        part = part_shape(index, shape)
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


def part_shape(index: Index, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the part ``index`` of an array of ``shape``."""
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


_MAX_HEADER = 100_000_000
"""The largest header any safetensors reader takes (a larger one is refused by the library)."""


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


def header_bytes(slots: list[Slot], metadata: dict[str, str] | None) -> Layout:
    """The layout of a safetensors file of ``slots``, as ``safetensors.save_file`` lays it out.

    The tensors are ordered by dtype (as ``safetensors`` orders them: the widest first), then
    by name; the header is padded with spaces to a multiple of 8 bytes, so every tensor
    starts aligned. The header is byte for byte the one ``safetensors`` writes.

    Example:
        >>> lay = header_bytes([Slot("a", "F32", (2,), 8), Slot("b", "U8", (3,), 3)], None)
        >>> lay.start, lay.size, len(lay.header) % 8
        ({'a': 120, 'b': 128}, 131, 0)
    """
    ordered = sorted(slots, key=lambda s: (_ORDER.index(s.code), s.name))
    entries: dict[str, Any] = (
        {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}
    )
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


def write_tensors(
    path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None
) -> None:
    """Write the safetensors file of ``tensors`` and ``metadata`` to ``path`` (a new file).

    The one writer of a whole file: the header from :func:`header_bytes`, then each
    tensor's bytes (little-endian, C order) at its offset. The file is byte for byte the
    one ``safetensors.numpy.save_file`` writes for the same tensors and metadata.

    Example:
        >>> import os, tempfile, numpy as np
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> write_tensors(path, {"a": np.arange(3, dtype=np.float32)}, {"k": "v"})
        >>> Reader(path).read("a"), Reader(path).metadata
        (array([0., 1., 2.], dtype=float32), {'k': 'v'})
    """
    arrays = {name: np.asarray(a) for name, a in tensors.items()}
    slots = [Slot(n, CODE_OF[a.dtype.name], a.shape, a.nbytes) for n, a in arrays.items()]
    layout = header_bytes(slots, metadata)
    with open(path, "wb") as f:
        f.write(layout.header)
        for name in sorted(arrays, key=layout.start.__getitem__):  # in the file's order
            a = arrays[name]
            a = a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


def atomic_write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """:func:`write_tensors` to a temporary file beside ``path``, then committed over ``path``.

    A new file gets the umask's mode, a replaced file keeps its mode (``disk.commit``).
    """
    write_atomically(path, lambda tmp: write_tensors(tmp, tensors, metadata))
