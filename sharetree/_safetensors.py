"""Reading and writing safetensors files: clear errors for damaged files, atomic saves.

The file format sharetree writes is described in one place,
``docs/saving_and_scaling.md`` ("The file format").
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import struct
from collections.abc import Iterator
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from sharetree._errors import TieError

__all__ = ["NATIVE_CODES", "Reader", "TensorInfo", "atomic_write", "one_line"]

NATIVE_CODES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
}  # fmt: skip
"""safetensors header dtype codes -> the dtype names ``st.save`` stores under their own code."""

# every code the raw fallback reader knows: the native ones and float8 (which numpy lacks)
_CODES = {
    **NATIVE_CODES,
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip


def one_line(e: BaseException) -> str:
    """``TypeName: message`` of an exception on one line (for messages quoting a library)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


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
        try:
            with safe_open(path, framework="np") as f:
                self.metadata: dict[str, str] = dict(f.metadata() or {})
                self.infos: dict[str, TensorInfo] = {}  # in header order
                for name in f.keys():
                    s = f.get_slice(name)
                    self.infos[name] = TensorInfo(name, str(s.get_dtype()), tuple(s.get_shape()))
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
        (already validated by the library when the file was opened).
        """
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                start, end = (int(v) for v in json.loads(f.read(n))[info.name]["data_offsets"])
                f.seek(8 + n + start)
                data = f.read(end - start)
            return np.frombuffer(data, jnp.dtype(_CODES[info.code])).reshape(info.shape)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
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
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    tmp = _create_temp(directory, os.path.basename(path))
    try:
        if mode is None:  # the kernel applied the umask to 0o666: that is the mode
            mode = stat.S_IMODE(os.stat(tmp).st_mode)
        _serialize_file(tensors, tmp, metadata)  # (safetensors may replace the file: new mode)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
