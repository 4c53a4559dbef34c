"""Reading and writing safetensors files: clear errors for damaged files, atomic saves."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from sharetree._errors import TieError

__all__ = ["Reader", "atomic_write"]

# safetensors header dtype codes -> numpy dtype names (for the fallback reader)
_CODES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip


class Reader:
    """Reads tensors of one safetensors file, with a raw fallback for dtypes numpy lacks."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        try:
            with safe_open(path, framework="np") as f:
                self.metadata: dict[str, str] = dict(f.metadata() or {})
                self.names: list[str] = list(f.keys())
        except Exception as e:  # SafetensorError and friends
            raise TieError(
                f"load: {path!r} is not a readable safetensors file ({type(e).__name__}: {e}). "
                "It may be empty, truncated or of another format. Fix: save it again with "
                "st.save, or check that the path names the right file."
            ) from None
        self._header: dict[str, Any] | None = None

    def header(self) -> dict[str, Any]:
        if self._header is None:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._header = json.loads(f.read(n))
                self._header["__data_start__"] = 8 + n
        return self._header

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        from safetensors import safe_open

        with safe_open(self.path, framework="np") as f:
            for name in self.names:
                try:
                    a = f.get_tensor(name)
                except Exception:  # a dtype numpy lacks here
                    try:
                        a = self._raw(name)
                    except TieError:
                        raise
                    except Exception as e:
                        raise TieError(
                            f"load: cannot read tensor {name!r} of {self.path!r} "
                            f"({type(e).__name__}: {e}). Fix: check the file is complete."
                        ) from None
                yield name, np.array(a)  # own the memory (safetensors may hand out a view)

    def _raw(self, name: str) -> np.ndarray:
        entry = self.header()[name]
        code = entry["dtype"]
        if code not in _CODES:
            raise TieError(
                f"load: tensor {name!r} in {self.path!r} has the dtype code {code!r}, which "
                f"sharetree cannot read (known: {', '.join(_CODES)}). Fix: convert the file."
            )
        start, end = entry["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.header()["__data_start__"] + start)
            data = f.read(end - start)
        return np.frombuffer(data, jnp.dtype(_CODES[code])).reshape(entry["shape"])


def _serialize_file(
    tensors: dict[str, np.ndarray], filename: str, metadata: dict[str, str]
) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, filename, metadata=metadata)


def atomic_write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.close(fd)
        _serialize_file(tensors, tmp, metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
