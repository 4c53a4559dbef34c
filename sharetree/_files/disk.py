"""The disk: temporary files beside their target, atomic commits, small JSON files read bounded."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import Any, Union

from sharetree._errors import error, short, wrong_type

__all__ = [
    "PathOrStr",
    "file_path",
    "DuplicateKey",
    "unique_pairs",
    "create_temp",
    "replaced_mode",
    "atomic_write_text",
    "fsync_directory",
]


PathOrStr = Union[str, bytes, "os.PathLike[str]"]
"""A file's path, as ``open`` takes it."""


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


def fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
