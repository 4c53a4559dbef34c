"""The disk: temporary files beside their target, atomic commits, small JSON files read bounded."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable
from typing import Any, NamedTuple, Union

from sharetree._errors import error, one_line, short, wrong_type

__all__ = [
    "PathOrStr",
    "file_path",
    "DuplicateKey",
    "unique_pairs",
    "read_json",
    "loads",
    "create_temp",
    "replaced_mode",
    "write_atomically",
    "write_text",
    "text_writer",
    "fsync_directory",
    "Staged",
    "commit_several",
    "write_several",
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


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses an object naming a key twice (:class:`DuplicateKey`).

    Example:
        >>> loads('{"a": 1, "b": {"c": 2}}')
        {'a': 1, 'b': {'c': 2}}
    """
    return json.loads(text, object_pairs_hook=unique_pairs)


def read_json(path: str, code: str, verb: str, limit: int, fix: str) -> dict[str, Any]:
    """The JSON object of the small file ``path``, read bounded: every problem a ``code`` error.

    The one reader of every small JSON file (a config, an index): a regular file (not a
    directory, a pipe or a device) of at most ``limit`` bytes, valid JSON naming no key twice
    in one object, an object at the top. ``verb``: the caller's (``load``), for the message.
    """
    where = f"{verb}: {path!r}"
    if not os.path.isfile(path):
        what = "is not a regular file (a directory, a pipe or a device)"
        raise error(code, where, what, fix=fix)
    if os.path.getsize(path) > limit:
        raise error(code, where, f"is larger than {limit >> 20} MiB", fix=fix)
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    try:
        data = loads(raw)
    except DuplicateKey as e:  # the parser keeps the last of two: a silent pick
        found = f"{short(e.first, 100)} and {short(e.second, 100)}"
        raise error(code, where, f"names {short(e.key)} twice", found=found, fix=fix) from None
    except (ValueError, RecursionError) as e:
        raise error(code, where, "is not valid JSON", found=one_line(e)[:200], fix=fix) from e
    if not isinstance(data, dict):
        raise error(code, where, "is not a JSON object", found=type(data).__name__, fix=fix)
    return data


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


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then commit it over ``path``.

    Through a symlink the link stays and its target is replaced. A new file gets the
    umask's mode; a replaced file keeps its mode (a read-only one is refused, left as it
    was). On any failure the temporary file is removed and ``path`` is left as it was.
    """
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    mode = replaced_mode(path, target)
    try:
        tmp = create_temp(directory, os.path.basename(target))
    except OSError as e:  # a missing or read-only directory: name the file, not the temporary
        raise type(e)(e.errno, f"cannot write {path!r}: {e.strerror} ({directory!r})") from e
    try:
        write(tmp)
        commit_several(path, [Staged(tmp, target, mode)])
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def text_writer(text: str) -> Callable[[str], None]:
    """A ``write(tmp)`` of ``text`` (UTF-8) for :func:`write_atomically`, :func:`write_several`."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return write


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`write_atomically`)."""
    write_atomically(path, text_writer(text))


class Staged(NamedTuple):
    """A file written under a temporary name, to be committed over ``target`` with ``mode``."""

    tmp: str
    target: str
    mode: int | None


def commit_several(label: str, files: list[Staged]) -> None:
    """The one commit of every file a save writes: one file, or several as one set.

    Each file is flushed to disk (``fsync``), given its mode (the replaced file's, or the
    umask's for a new one), renamed over its target, and the directory is flushed too, so
    the renames survive a crash. Several files are committed all, or none:

    In order (the file that names the others, an index or a config, last): each
    temporary file is flushed and given its mode, each replaced file is kept under a
    backup name, then each is renamed over its target. If a rename fails, the files
    already renamed are put back (a new one removed) and the error is raised; if that too
    fails, E270 names the files that changed. ``label``: the save, for the message.
    """
    for f in files:
        if f.mode is not None:
            os.chmod(f.tmp, f.mode)
        fd = os.open(f.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    backups: dict[str, str | None] = {}
    done: list[str] = []
    try:
        for f in files:
            backups[f.target] = None
            if os.path.lexists(f.target):
                backup = f.tmp + ".old"
                os.link(f.target, backup)
                backups[f.target] = backup
        for f in files:
            os.replace(f.tmp, f.target)
            done.append(f.target)
        for directory in dict.fromkeys(os.path.dirname(f.target) for f in files):
            fsync_directory(directory)
    except BaseException as e:
        _put_back(label, done, backups, e)
        raise
    finally:
        for left in backups.values():
            if left is not None:
                with contextlib.suppress(OSError):
                    os.unlink(left)


def write_several(label: str, writes: list[tuple[str, Callable[[str], None]]]) -> None:
    """Each ``write(tmp)`` to a temporary file beside its path, then all committed as one set.

    ``writes``: ``(path, write)`` in commit order (:func:`commit_several`); a failure
    before the commit leaves every path as it was and no temporary file behind.
    """
    staged: list[Staged] = []
    try:
        for path, write in writes:
            target = os.path.realpath(path)
            mode = replaced_mode(path, target)
            staged.append(Staged(create_temp(os.path.dirname(target), os.path.basename(target)),
                                 target, mode))  # fmt: skip
            write(staged[-1].tmp)
        commit_several(label, staged)
    finally:
        for f in staged:
            with contextlib.suppress(OSError):
                os.unlink(f.tmp)


def _put_back(label: str, done: list[str], backups: dict[str, str | None], cause: BaseException):
    """Undo the renames of ``done``: each replaced file back from its backup, a new one removed."""
    failed: list[str] = []
    for target in reversed(done):
        try:
            backup = backups[target]
            if backup is None:
                os.unlink(target)
            else:
                os.replace(backup, target)
                backups[target] = None
        except OSError:
            failed.append(target)
    for directory in dict.fromkeys(os.path.dirname(t) for t in done):
        fsync_directory(directory)
    if failed:
        failed = sorted(os.path.basename(t) for t in failed)
        kept = sorted(os.path.basename(t) for t in done if os.path.basename(t) not in failed)
        what = (
            f"failed while committing its files ({type(cause).__name__}: {cause}); "
            f"now holding the new version: {failed}; put back as they were: {kept or 'none'}"
        )
        fix = "save again (the files listed are from this save, the others from the previous one)"
        raise error("E270", f"save: {label!r}", what, fix=fix) from cause


def fsync_directory(directory: str) -> None:
    """Flush ``directory``'s entries (a rename in it) to disk, where the system allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
