"""``save``: one safetensors file per canonical tree, each buffer once, written atomically.

Every check runs before anything is written: the tree's keys, depth and leaves (walked
into the JSON structure of "The file format" in ``docs/saving_and_scaling.md``), the
``metadata=`` entries and the sharing graph; then ``container.atomic_write`` writes
a temporary file and renames it over the path (a replaced file keeps its mode).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import (
    check_bool,
    check_mapping,
    error,
    one_line,
    short,
    wrong_type,
)
from sharetree._files.container import atomic_write
from sharetree._files.disk import PathOrStr, file_path
from sharetree._files.format import KEY_LIBRARY, KEY_TREE, KEY_VERSION, LIBRARY_VERSION, PREFIX
from sharetree._files.hf import INDEX_FILE
from sharetree._files.plan import FileOut, Options, Plan, Spread
from sharetree._files.processes import Group, OneProcess, current_group
from sharetree._files.rounds import save_together
from sharetree._files.tree_json import NOTHING, Writer, spread_over_processes
from sharetree._materialize import abstract_expanded
from sharetree._paths import check_flattens, path_str
from sharetree._resolve import structure_of
from sharetree._transforms import identity

__all__ = ["save"]


def save(
    path: PathOrStr,
    tree: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    gather: bool = False,
    timeout: float = 600.0,
    max_shard_size: int | str | None = None,
) -> None:
    """Write a canonical tree to one safetensors file, each buffer stored once.

    Every check runs before anything is written, and the write is atomic.
    On several processes (a buffer no process holds whole), **every process
    calls** ``save`` and writes its own share of the one file (no process
    gathers a buffer); see "Saving at scale" in ``docs/saving_and_scaling.md``.

    Args:
        path: the file to write (conventionally ``*.safetensors``).
        tree: a canonical tree (any pytree; NumPy or JAX arrays).
        metadata: extra ``str -> str`` entries (``sharetree.*`` keys are
            reserved), read back by ``sharetree._files.load.read_metadata``.
        gather: ``True`` gathers buffers sharded over several processes and
            process 0 writes, so **every process must call** ``save``; every
            process returns once the file exists. ``False``: each process
            writes the parts it holds (one writer per set of replicas).
        timeout: seconds a process waits for the others at each step of a save
            of several processes (a killed process is an error, not a hang).
        max_shard_size: write Hugging Face's sharded layout instead: ``path`` is
            a directory of ``model-0000k-of-0000n.safetensors`` files of at most
            this many bytes each (an int, or ``"5GB"``, ``"500MiB"``) and
            ``model.safetensors.index.json``; each tensor in one file. The files
            hold the buffers as a state dict; a view of a whole buffer is recorded
            in their metadata (as ``safetensors.torch.save_model`` records a tied
            head), and ``st.load(path)`` restores it.

    Raises:
        TieError: any tree, argument or path that cannot be saved; nothing is
            written. On several processes, any failure (another process's too)
            is the same error on every live process, the previous file kept.
        OSError: the file cannot be written (a previous file is kept).

    Example:
        >>> import os, tempfile, numpy as np, sharetree as st
        >>> tree = {"emb": np.arange(6.0).reshape(3, 2), "head": st.Tied("emb", st.T)}
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> st.save(path, tree)
        >>> st.load(path)["head"]
        Tied('emb', T)
    """
    gather = check_bool(gather, "E55", "save: gather=")
    timeout = _check_timeout(timeout)
    label = _path_text(path)
    limit = None if max_shard_size is None else _check_shard_size(label, max_shard_size, gather)
    group = None
    if not gather and spread_over_processes(tree):
        group = current_group(f"save: {label!r}")
    if group is None and limit is not None:  # host buffers: process 0 writes, as for one file
        if jax.process_index() != 0:
            return
        group = OneProcess()  # one owner, no rounds
    if group is not None:

        def build() -> Plan:
            return _build_together(path, tree, metadata, group, limit)

        save_together(group, Options(label, timeout, limit is not None), build)
        return
    path = _checked_path(path)
    writer = Writer(gather)
    user = _user_metadata(metadata)
    structure = writer.node(tree, ())  # keys, depth and leaves first: names the path
    check_flattens(tree)  # dict keys jax cannot sort
    abstract_expanded(tree)  # validate the graph and every view's shape first
    meta = _file_metadata(user, writer, structure)
    try:
        if jax.process_index() == 0:
            atomic_write(path, writer.tensors, meta)
    except OverflowError as e:  # a header over the 100 MB that every safetensors reader takes
        user_bytes = sum(len(k) + len(v) for k, v in user.items())
        sizes = f"{len(meta[KEY_TREE]):,} bytes of tree JSON and {user_bytes:,} of metadata="
        what = f"header too large for readers (100 MB): {sizes} ({one_line(e)}){NOTHING}"
        fix = "store large text as arrays, or keep it out of the tree and metadata"
        raise error("E56", f"save: {path!r}", what, fix=fix) from e
    finally:  # with gather, every process returns once the file is there (even if it failed)
        if writer.gather and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"sharetree.save {path}")


def _checked_path(path: Any) -> str:
    """``path`` as a ``str`` naming a file (E49, E50)."""
    path = file_path(path, "save")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        fix = f"give a file name, e.g. {os.path.join(path, 'model.safetensors')!r}"
        raise error("E50", f"save: {path!r}", "is a directory; save writes one file", fix=fix)
    return path


def _path_text(path: Any) -> str:
    """``path`` as text for messages, whatever it is (checked later, on every process)."""
    try:
        return os.fsdecode(path)
    except TypeError:
        return short(path)


def _check_timeout(timeout: Any) -> float:
    """``timeout=`` as a float: a real number of seconds > 0 (E225)."""
    where, fix = "save: timeout=", "pass seconds, e.g. timeout=600"
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.number)):
        raise wrong_type("E225", where, "a number of seconds", timeout, fix)
    if not 0 < float(timeout) < float("inf"):
        raise error("E225", where, f"is {timeout!r}", expected="a number of seconds > 0", fix=fix)
    return float(timeout)


def _file_metadata(user: dict[str, str], writer: Writer, structure: Any) -> dict[str, str]:
    """The header's metadata: the user's entries and sharetree's (format, tree)."""
    return {
        **user,
        KEY_VERSION: str(writer.version),
        KEY_LIBRARY: LIBRARY_VERSION,
        KEY_TREE: json.dumps(structure, separators=(",", ":"), allow_nan=True),
    }


def _build_together(path: Any, tree: Any, metadata: Any, group: Group, limit: int | None) -> Plan:
    """The data-free part of a save by :func:`save_together`: its files, index and facts.

    ``limit``: Hugging Face's sharded layout, files of at most ``limit`` bytes.
    """
    text = _checked_path(path) if limit is None else _checked_directory(path)
    writer = Writer(False, group)
    user = _user_metadata(metadata)
    structure = writer.node(tree, ())
    check_flattens(tree)
    abstract_expanded(tree)
    facts = {
        "the path": text,
        "metadata=": json.dumps(user, sort_keys=True),
        "max_shard_size=": str(limit),
        **{f"buffer:{t.slot.name}": t.summary() for t in writer.spreads},
    }
    if limit is None:
        meta = _file_metadata(user, writer, structure)
        facts["the tree's structure"] = meta[KEY_TREE]
        return Plan([FileOut("", writer.spreads, meta)], facts)
    ties = _whole_views(text, tree, writer, user)
    facts["the tree's structure"] = json.dumps(structure, separators=(",", ":"), allow_nan=True)
    files = _shards(writer.spreads, limit)
    n = len(files)
    names = ["model.safetensors"] if n == 1 else [
        f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)
    ]  # fmt: skip
    meta = {**user, **ties}
    out = [FileOut(name, group_, meta) for name, group_ in zip(names, files)]
    if n == 1:  # as save_pretrained writes one file: no index
        return Plan(out, facts)
    weight_map = {t.slot.name: f.name for f in out for t in f.tensors}
    total = sum(t.slot.nbytes for t in writer.spreads)
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return Plan(out, facts, (INDEX_FILE, json.dumps(body, indent=2, ensure_ascii=False) + "\n"))


def _shards(tensors: list[Spread], limit: int) -> list[list[Spread]]:
    """The tensors in files of at most ``limit`` bytes, in order (a larger tensor alone)."""
    files: list[list[Spread]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.slot.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.slot.nbytes
    return files


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def _check_shard_size(path: str, size: Any, gather: bool) -> int:
    """``max_shard_size=`` in bytes: an int > 0 or ``"5GB"`` / ``"500MiB"`` (E226)."""
    where = f"save: max_shard_size= for {path!r}"
    fix = 'pass bytes or a size such as "5GB" (10**9 bytes) or "2GiB" (2**30 bytes)'
    if gather:
        what = "with gather=True: the sharded layout is written by every process"
        raise error("E226", where, what, fix="leave gather out (every process calls st.save)")
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer, str)):
        raise wrong_type("E226", where, "an int of bytes or a str such as '5GB'", size, fix)
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+)\s*([KMGT]I?B|B)?\s*", size.upper())
        if m is None:
            raise error("E226", where, f"is {size!r}", expected="a size such as '5GB'", fix=fix)
        size = int(m.group(1)) * _UNITS[m.group(2) or ""]
    if int(size) <= 0:
        raise error("E226", where, f"is {size!r}", expected="a size > 0 bytes", fix=fix)
    return int(size)


def _checked_directory(path: Any) -> str:
    """``path`` as a ``str`` naming a directory (made if missing) for the sharded layout."""
    path = file_path(path, "save")
    if os.path.exists(path) and not os.path.isdir(path):
        what = "is a file; with max_shard_size= save writes a directory"
        fix = "give a directory, or leave max_shard_size out to write one file"
        raise error("E228", f"save: {path!r}", what, fix=fix)
    return path


def _whole_views(path: str, tree: Any, writer: Writer, user: dict[str, str]) -> dict[str, str]:
    """The ``{view: buffer}`` metadata entries of the sharded layout: each view a whole buffer.

    A view with a transform, of several refs or of a part cannot be told by a state dict
    (E227): nothing is dropped silently.
    """
    st_ = structure_of(jtu.tree_structure(tree))
    names = dict(writer.names)
    out: dict[str, str] = {}
    for leaf in st_.expanded:
        if leaf.tie is None:
            continue
        whole = leaf.buffer < len(st_.buffer_paths) and leaf.transform in (None, identity)
        if not whole:
            what = (
                f"is a view ({short(st_.ties.get(leaf.tie), 200)}) that Hugging Face's layout "
                "cannot record: it records a view of a whole buffer only; nothing was written"
            )
            fix = "save one file (leave max_shard_size out), or st.untie the view first"
            raise error(
                "E227", f"save: the tie at {path_str(leaf.tie)!r} for {path!r}", what, fix=fix
            )
        view = "/".join(leaf.path).encode("utf-8", "backslashreplace").decode()
        if view in user:
            what = f"names the view {view!r} in metadata=, where its tie is recorded{NOTHING}"
            raise error("E227", f"save: {path!r}", what, fix="rename that metadata= entry")
        out[view] = names[st_.buffer_paths[leaf.buffer]]
    return out


def _user_metadata(metadata: Any) -> dict[str, str]:
    """``metadata=`` as the header's extra entries, checked (``str -> str``, UTF-8, not ours)."""
    if metadata is None:
        return {}
    want = "a dict of str -> str"
    check_mapping(metadata, "E32", "save: metadata=", want, 'pass e.g. {"format": "pt"}')
    for k, v in metadata.items():
        entry = f"save: the metadata entry {short(k, 60)}: {short(v, 60)}"
        if not isinstance(k, str) or not isinstance(v, str):
            bad = v if isinstance(k, str) else k
            raise wrong_type("E32", entry, "str -> str", bad, "convert it, e.g. with json.dumps")
        problem, fix = (
            (f"uses sharetree's prefix {PREFIX!r}", "use another key")
            if k.startswith(PREFIX)
            else ("is not UTF-8 (a lone surrogate)", "pass UTF-8 text")
            if (k + v).encode("utf-8", "replace").decode() != k + v
            else ("", "")
        )
        if problem:
            raise error("E32", entry, problem, fix=fix)
    return dict(metadata)
