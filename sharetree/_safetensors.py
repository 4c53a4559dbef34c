"""Reading and writing safetensors files: clear errors for damaged files, atomic saves.

The file format sharetree writes is described in one place,
``docs/saving_and_scaling.md`` ("The file format").
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from sharetree._errors import TieError

__all__ = [
    "NATIVE_CODES",
    "DuplicateKey",
    "Reader",
    "TensorInfo",
    "atomic_write",
    "file_path",
    "one_line",
    "unique_pairs",
]

NATIVE_CODES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
"""safetensors header dtype codes -> the dtype names ``st.save`` stores under their own code
(every safetensors from the lowest supported on writes these; torch reads the float8 ones)."""

# every code the raw fallback reader knows: the native ones and float8 (which numpy lacks)
_CODES = {
    **NATIVE_CODES, "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}  # fmt: skip


def one_line(e: BaseException) -> str:
    """``TypeName: message`` of an exception on one line (for messages quoting a library)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def file_path(path: Any, verb: str) -> str:
    """``path`` (a ``str``, ``bytes`` or ``os.PathLike``) as a ``str``; a :class:`TieError` if none.

    Example:
        >>> import pathlib
        >>> from sharetree._safetensors import file_path
        >>> file_path(pathlib.Path("m.safetensors"), "load"), file_path(b"m", "load")
        ('m.safetensors', 'm')
    """
    try:
        text = os.fsdecode(path)
    except TypeError:
        raise TieError(
            f"{verb}: the path should be a str or os.PathLike (such as pathlib.Path), found "
            f"{type(path).__name__} {path!r:.80}. Fix: pass the file's path, e.g. "
            "'model.safetensors'."
        ) from None
    if not text or "\0" in text:
        raise TieError(
            f"{verb}: the path {text!r:.80} is empty or holds a NUL character, so it names no "
            "file. Fix: pass the file's path, e.g. 'model.safetensors'."
        )
    return text


class DuplicateKey(ValueError):
    """A JSON object that names one key twice (raised by :func:`unique_pairs`)."""

    def __init__(self, key: str, first: Any, second: Any) -> None:
        super().__init__(f"the key {key!r} is given twice")
        self.key, self.first, self.second = key, first, second


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of ``json.loads`` that refuses a key given twice (one would be lost).

    Example:
        >>> import json
        >>> from sharetree._safetensors import unique_pairs
        >>> json.loads('{"a": 1, "a": 2}', object_pairs_hook=unique_pairs)
        Traceback (most recent call last):
        ...
        sharetree._safetensors.DuplicateKey: the key 'a' is given twice
    """
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
        name = _CODES.get(self.code)
        size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        return 0 if name is None else size * jnp.dtype(name).itemsize


class Reader:
    """The header of one safetensors file (metadata and tensor infos) and its tensors.

    Header and metadata are read by the safetensors library; a file it cannot
    read (empty, truncated, another format) is a :class:`TieError`.

    Example:
        >>> import os, tempfile, numpy as np
        >>> from safetensors.numpy import save_file
        >>> from sharetree._safetensors import Reader
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> save_file({"w": np.ones((2, 3), np.float32)}, path, metadata={"format": "np"})
        >>> r = Reader(path)
        >>> r.metadata, r.infos["w"]
        ({'format': 'np'}, TensorInfo(name='w', code='F32', shape=(2, 3)))
    """

    def __init__(self, path: str, verb: str = "load") -> None:
        from safetensors import safe_open

        self.path, self.verb = path, verb
        if os.path.exists(path) and not os.path.isfile(path):  # a pipe would block the read
            raise TieError(
                f"{verb}: {path!r} is not a regular file (it is a directory, a pipe or a "
                "device), so it is not a safetensors file. Fix: give the path of a "
                ".safetensors file."
            )
        try:
            with safe_open(path, framework="np") as f:
                self.metadata: dict[str, str] = dict(f.metadata() or {})
                self.infos: dict[str, TensorInfo] = {}  # in header order
                for name in f.keys():
                    s = f.get_slice(name)
                    self.infos[name] = TensorInfo(name, str(s.get_dtype()), tuple(s.get_shape()))
            with open(path, "rb") as raw:  # again, for what the library does not say
                (n,) = struct.unpack("<Q", raw.read(8))
                self._data_start = 8 + n
                self._header = json.loads(raw.read(n), object_pairs_hook=unique_pairs)
        except DuplicateKey as e:  # the library keeps the last of two: a silent pick
            raise TieError(
                f"{verb}: the header of {path!r} names {e.key!r} twice (a tensor or a metadata "
                "entry), so one of the two would be silently lost. The file is damaged or "
                "was written by a broken tool. Fix: write the file again."
            ) from None
        except Exception as e:  # SafetensorError, OSError of a directory, ...
            raise TieError(
                f"{verb}: {path!r} is not a readable safetensors file ({one_line(e)}). "
                "It may be empty, truncated or of another format. Fix: save it again with "
                "st.save, or check that the path names the right file."
            ) from e

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every tensor as a NumPy array that owns its memory, in header order."""
        from safetensors import safe_open

        with safe_open(self.path, framework="np") as f:
            for name, info in self.infos.items():
                try:
                    a = f.get_tensor(name)
                except Exception as e:  # a dtype numpy lacks (float8), or damaged data
                    if info.code not in _CODES:
                        raise TieError(
                            f"{self.verb}: tensor {name!r} of {self.path!r} has the dtype code "
                            f"{info.code!r}, which sharetree cannot read (known: "
                            f"{', '.join(_CODES)}). Fix: convert the file."
                        ) from e
                    a = self._raw(info, e)
                yield name, np.array(a)  # own the memory (safetensors may hand out a view)

    def _raw(self, info: TensorInfo, cause: BaseException) -> np.ndarray:
        """Read a tensor of a dtype the numpy backend lacks from its bytes.

        The library does not expose data offsets, so they come from the header
        (validated by the library when the file was opened).
        """
        try:
            start, end = (int(v) for v in self._header[info.name]["data_offsets"])
            with open(self.path, "rb") as f:
                f.seek(self._data_start + start)
                data = f.read(end - start)
            return np.frombuffer(data, jnp.dtype(_CODES[info.code])).reshape(info.shape)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TieError(
                f"{self.verb}: cannot read tensor {info.name!r} of {self.path!r} "
                f"({one_line(cause)}; {one_line(e)}). Fix: check the file is complete."
            ) from e


def _serialize_file(
    tensors: dict[str, np.ndarray], filename: str, metadata: dict[str, str]
) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, filename, metadata=metadata)


def _create_temp(directory: str, base: str) -> str:
    """Create a new file next to the target with mode ``0o666``, which the kernel masks."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        with contextlib.suppress(FileExistsError):
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
    raise FileExistsError(f"cannot create a temporary file in {directory!r}")  # pragma: no cover


def atomic_write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write a safetensors file to a temporary file beside ``path``, then rename it over ``path``.

    A failure (or an interrupt) at any point leaves a previous file at
    ``path`` as it was and removes the temporary file. A new file gets the
    permissions of the umask (``0o666 & ~umask``, applied by the kernel: the
    process umask is never changed); a file that is replaced keeps its mode.
    A symlink at ``path`` stays: the file it points to is written. A file
    the process may not write (read-only) is a ``PermissionError``, as for
    ``open(path, "wb")``, although a rename could replace it.

    Example:
        >>> import os, stat, tempfile, numpy as np
        >>> from sharetree._safetensors import atomic_write
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> atomic_write(path, {"w": np.ones(2)}, {})
        >>> os.chmod(path, 0o600)
        >>> atomic_write(path, {"w": np.zeros(2)}, {})
        >>> oct(stat.S_IMODE(os.stat(path).st_mode))
        '0o600'
    """
    target = os.path.realpath(path)  # through a symlink: the link stays, its target is replaced
    directory = os.path.dirname(target)
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    if mode is not None and not os.access(target, os.W_OK):  # as open(path, "wb") refuses
        raise PermissionError(
            errno.EACCES, f"cannot write {path!r}: the file is read-only (left as it was)"
        )
    try:
        tmp = _create_temp(directory, os.path.basename(target))
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
