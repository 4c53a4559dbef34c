"""Saving by every process of a job: one safetensors file, each process writing its own share.

``st.save`` called on every process of a multi-controller JAX job, with buffers that no
process holds whole, comes here. The header is known from the avals alone (names, dtypes,
shapes, offsets), so every process computes the same layout and the same plan: each
distinct part of a buffer (one per set of replicas) has one owner, the process holding it
with the fewest bytes to write so far. Then, in rounds through JAX's coordination service
(its key-value store; every round has a deadline, so a killed process is an error, never a
hang), every process reports its outcome and reads the others':

1. ``check``: every data-free check ran (the tree walk, the plan) and a digest of the
   arguments and the tree; the first process's failure is every process's error, and
   digests that differ are an error naming what differs.
2. ``prepare``: process 0 creates the temporary file beside the path, writes the header
   and reserves the file's size; each process writes a marker file beside it.
3. ``write``: each process checks that it sees every marker (a path on a filesystem every
   process sees), then writes its parts straight from its devices, a part at a time
   (``os.pwrite`` at their offsets; a part of columns as its strided runs), and ``fsync``.
4. ``commit``: process 0 renames the temporary file over the path (a replaced file keeps
   its mode) and removes what earlier failed saves left beside it.

A failure in any round leaves the previous file byte-identical: the temporary file is
removed (by process 0, once every process agreed to stop) and every live process raises
the same :class:`~sharetree.TieError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sharetree._errors import TieError, add_context, error, one_line, rebuilt, short
from sharetree._files.container import Layout, byte_runs, header_bytes, write_runs
from sharetree._files.disk import (
    Staged,
    commit_several,
    create_temp,
    fsync_directory,
    replaced_mode,
    text_writer,
)
from sharetree._files.hf import INDEX_FILE, WEIGHTS
from sharetree._files.plan import Options, Part, Plan, Spread
from sharetree._files.processes import Group

__all__ = ["save_together"]


class _Rounds:
    """The rounds of one save: each process publishes its outcome, then reads every other's."""

    def __init__(self, group: Group, path: str, timeout: float) -> None:
        self.group, self.path, self.timeout = group, path, timeout
        self.number = group.next_save()
        self.prefix = f"sharetree.save/{self.number}"

    def agree(self, name: str, failure: BaseException | None, **facts: Any) -> list[dict[str, Any]]:
        """Every process's facts of round ``name``; the first failure raised on every process."""
        g = self.group
        mine: dict[str, Any] = {"facts": facts, "error": None}
        if g.count == 1:  # one process: nobody to tell, no round
            if failure is not None:
                raise failure
            return [mine]
        if failure is not None:
            tie = isinstance(failure, TieError)
            message = str(failure) if tie else one_line(failure)
            code = getattr(failure, "code", None) if tie else None
            mine["error"] = {
                "message": message,
                "code": code,
                "type": isinstance(failure, TypeError),
            }
        g.publish(f"{self.prefix}/{name}/{g.me}", json.dumps(mine))
        outs: list[dict[str, Any]] = []
        for i in range(g.count):
            if i == g.me:
                outs.append(mine)
                continue
            try:
                outs.append(json.loads(g.read(f"{self.prefix}/{name}/{i}", self.timeout)))
            except TimeoutError as e:
                what = (
                    f"got no answer from process {i} of {g.count} within {self.timeout:g} s "
                    f"(the {name!r} round: killed, hung, or still writing); the previous file "
                    "is left as it was"
                )
                fix = "check that process's log; give a longer timeout= for slower disks"
                raise error(
                    "E224", f"save: {self.path!r}", what, found=one_line(e), fix=fix
                ) from failure
        failed = [(i, o["error"]) for i, o in enumerate(outs) if o["error"] is not None]
        if failed:
            i, got = failed[0]
            note = f"(process {i} of {g.count} found it in the {name!r} round; "
            note += "every process raised it)"
            if i == g.me and isinstance(failure, TieError):
                raise add_context(failure, note)
            if got["code"] is not None:
                same = rebuilt(got["message"], got["code"], got["type"])
                raise add_context(same, note) from failure
            what = f"failed on process {i} of {g.count}: {got['message']}"
            what += "; the previous file is left as it was"
            fix = "free space or fix the error on that process, then save again"
            raise add_context(
                error("E223", f"save: {self.path!r}", what, fix=fix), note
            ) from failure
        return outs


def save_together(group: Group, options: Options, build: Callable[[], Plan]) -> None:
    """Write the files of ``build()``'s plan with every process of ``group``.

    ``build``: the data-free part of the save, run on every process: the files (tensors
    with their plans, metadata), the index, and the facts every process must agree on
    (name -> text; ``"buffer:..."`` entries are compared one by one).
    """
    path, me = options.path, group.me
    rounds = _Rounds(group, path, options.timeout)
    failure: BaseException | None = None
    plan = Plan([], {})
    layouts: list[Layout] = []
    digest: dict[str, str] = {}
    try:
        plan = build()
        layouts = [_layout(path, f.tensors, f.meta) for f in plan.files]
        digest = {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in plan.facts.items()}
    except Exception as e:  # every process hears of it: none is left waiting
        failure = e
    token = secrets.token_hex(6) if me == 0 else None
    outs = rounds.agree("check", failure, digest=digest, token=token)
    if me == 0 and rounds.number:  # every process is past the previous save: its keys can go
        group.forget(f"sharetree.save/{rounds.number - 1}")
    _check_same(path, [o["facts"]["digest"] for o in outs])
    token = outs[0]["facts"]["token"]
    target = os.path.realpath(path)
    if options.directory:
        directory, names, base = target, [f.name for f in plan.files], INDEX_FILE
    else:
        directory, base = os.path.dirname(target), os.path.basename(target)
        names = [base]
    tmps = [os.path.join(directory, f".{name}.{token}.tmp") for name in names]
    marker = os.path.join(directory, f".{base}.{token}.p{me}")
    modes: list[int | None] = []
    made: list[str] = []
    try:
        failure = None
        try:
            os.makedirs(directory, exist_ok=True)
            if me == 0:
                for name, tmp, layout in zip(names, tmps, layouts):
                    modes.append(replaced_mode(path, os.path.join(directory, name)))
                    made.append(create_temp(directory, name, token))
                    _start_file(tmp, layout)
            if group.count > 1:  # each process shows the others it sees this directory
                made.append(_write_marker(directory, base, token, me))
        except OSError as e:
            failure = e
        rounds.agree("prepare", failure)
        try:
            if group.count > 1:
                _check_markers(path, directory, base, token, group.count, tmps)
            for tmp, f, layout in zip(tmps, plan.files, layouts):
                _write_share(group, tmp, f.tensors, layout)
        except Exception as e:
            failure = e
        rounds.agree("write", failure)
        if marker in made:
            with contextlib.suppress(OSError):
                os.unlink(marker)
            made.remove(marker)
        try:
            if me == 0:
                _commit(path, directory, names, tmps, modes, plan.index_file, options.directory)
                made.clear()  # committed or put back: none of them is this save's any more
                _remove_stale(directory, [*names, base])
        except Exception as e:
            failure = e
        rounds.agree("commit", failure)
    finally:  # after a failure every process agreed on: nobody writes any more
        for name in made:
            with contextlib.suppress(OSError):
                os.unlink(name)


def _commit(
    path: str,
    directory: str,
    names: list[str],
    tmps: list[str],
    modes: list[int | None],
    index: tuple[str, str] | None,
    layout_of_directory: bool,
) -> None:
    """Commit the written files as one set (``disk.commit_several``), the index last.

    In a directory, the weights files of an earlier save that the new ones do not
    replace are removed after, as ``save_pretrained`` does.
    """
    staged = [Staged(tmp, os.path.join(directory, n), m) for n, tmp, m in zip(names, tmps, modes)]
    if index is not None:
        name, text = index
        target = os.path.join(directory, name)
        mode = replaced_mode(path, target)
        staged.append(Staged(create_temp(directory, name), target, mode))
        text_writer(text)(staged[-1].tmp)
        names = [*names, name]
    try:
        commit_several(path, staged)
    finally:
        for f in staged:
            with contextlib.suppress(OSError):
                os.unlink(f.tmp)
    if layout_of_directory:
        for old in os.listdir(directory):
            if WEIGHTS.fullmatch(old) and old not in names:
                os.unlink(os.path.join(directory, old))
        fsync_directory(directory)


def _layout(path: str, tensors: list[Spread], meta: dict[str, str]) -> Layout:
    try:
        return header_bytes([t.slot for t in tensors], meta)
    except OverflowError as e:
        what = f"has a header too large for readers (100 MB): {e}; nothing was written"
        fix = "store large text as arrays, or keep it out of the tree and metadata"
        raise error("E56", f"save: {path!r}", what, fix=fix) from e


def _check_same(path: str, digests: list[dict[str, str]]) -> None:
    """E220 naming what differs between the processes' arguments and trees."""
    first = digests[0]
    for i, d in enumerate(digests[1:], 1):
        keys = sorted(set(first) | set(d))
        differ = [k for k in keys if first.get(k) != d.get(k)]
        if not differ:
            continue
        buffers = [k.split(":", 1)[1] for k in differ if k.startswith("buffer:")]
        named = [k for k in differ if not k.startswith("buffer:")]
        if buffers:
            named.append(f"the buffer(s) {short(buffers, 200)} (shape, dtype or sharding)")
        what = f"was called with different arguments on process 0 and process {i}: "
        what += f"{', '.join(named)} differ; nothing was written"
        fix = "call st.save with the same path, tree, metadata and options on every process"
        raise error("E220", f"save: {path!r}", what, fix=fix)


def _start_file(tmp: str, layout: Layout) -> None:
    """Write the header of the temporary file and reserve its size (a full disk fails here)."""
    fd = os.open(tmp, os.O_WRONLY)
    try:
        os.pwrite(fd, layout.header, 0)
        try:
            os.posix_fallocate(fd, 0, max(1, layout.size))
        except (AttributeError, OSError) as e:  # no fallocate here: a sparse file
            if isinstance(e, OSError) and e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL
                raise
        os.ftruncate(fd, layout.size)
    finally:
        os.close(fd)


def _write_marker(directory: str, base: str, token: str, me: int) -> str:
    """Create this process's marker beside the temporary file; returns its path."""
    marker = os.path.join(directory, f".{base}.{token}.p{me}")
    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    return marker


def _check_markers(
    path: str, directory: str, base: str, token: str, count: int, tmps: list[str]
) -> None:
    """E221 unless this process sees every process's marker and the temporary files."""
    missing = [
        i
        for i in range(count)
        if not os.path.exists(os.path.join(directory, f".{base}.{token}.p{i}"))
    ]
    unseen = not all(os.path.exists(t) for t in tmps)
    if missing or unseen:
        what = (
            f"is not on a filesystem every process sees: in {directory!r} this process does not "
            f"see the marker files of process(es) {missing}"
            + (" nor the temporary file(s) process 0 created" if unseen else "")
            + "; nothing was written"
        )
        fix = "save to a shared filesystem (NFS, Lustre) by an absolute path, or use Orbax"
        raise error("E221", f"save: {path!r}", what, fix=fix)


def _write_share(group: Group, tmp: str, tensors: list[Spread], layout: Layout) -> None:
    """Write the parts this process owns, each straight from its device, then ``fsync``."""
    mine = [(t, p) for t in tensors for p in t.parts if p.owner == group.me and t.slot.nbytes]
    if not mine:
        return
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for t, part in mine:
            host = _read_part(t, part)
            host = host.astype(host.dtype.newbyteorder("<"), order="C", copy=False)
            runs = byte_runs(t.shape, t.itemsize, part.bounds)
            write_runs(fd, layout.start[t.slot.name], host, runs)
            del host
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_part(t: Spread, part: Part) -> np.ndarray:
    """The part ``part`` of ``t`` on the host: from a device of this process that holds it."""
    index = tuple(slice(a, b) for a, b in part.bounds)
    x = t.value
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        for shard in x.addressable_shards:
            bounds = tuple(s.indices(n)[:2] for s, n in zip(shard.index, t.shape))
            if bounds == part.bounds:
                return np.asarray(shard.data)
        raise RuntimeError(f"no device of this process holds the part {index} of {t.slot.name!r}")
    return np.asarray(x)[index]


def _remove_stale(directory: str, bases: list[str]) -> None:
    """Remove the temporary and marker files earlier failed saves of ``bases`` left."""
    names = "|".join(re.escape(b) for b in bases)
    pattern = re.compile(rf"\.({names})\.[0-9a-f]{{12}}\.(tmp|tmp\.old|p\d+)")
    for name in os.listdir(directory):
        if pattern.fullmatch(name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
