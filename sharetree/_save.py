"""``save``: one safetensors file per canonical tree, each buffer once, written atomically.

Every check runs before anything is written: the tree's keys, depth and leaves (walked
into the JSON structure of "The file format" in ``docs/saving_and_scaling.md``), the
``metadata=`` entries and the sharing graph; then ``_safetensors.atomic_write`` writes
a temporary file and renames it over the path (a replaced file keeps its mode).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._cooperate import (
    INDEX,
    FileOut,
    Group,
    Options,
    Plan,
    Spread,
    ThreadGroup,
    current_group,
    save_together,
    spread,
)
from sharetree._errors import (
    FIXES,
    TieError,
    add_context,
    check_bool,
    check_mapping,
    error,
    one_line,
    short,
    wrong_type,
)
from sharetree._format import (
    KEY_IMPLS,
    KEY_LIBRARY,
    KEY_TREE,
    KEY_VERSION,
    LIBRARY_VERSION,
    MAX_DEPTH,
    PREFIX,
)
from sharetree._materialize import abstract_expanded
from sharetree._paths import Path, check_flattens, key_name, path_str
from sharetree._resolve import structure_of
from sharetree._safetensors import NATIVE_CODES, PathOrStr, atomic_write, file_path, is_numeric
from sharetree._tied import Tied, is_tied
from sharetree._transforms import describe_transform, identity, is_described

__all__ = ["save"]

_KIND_OF: dict[type, str] = {
    dict: "dict",
    collections.OrderedDict: "odict",
    list: "list",
    tuple: "tuple",
}
"""The node kinds of the containers a file rebuilds on its own."""

_NOTHING = "; nothing was written"

_CODE_OF = {name: code for code, name in NATIVE_CODES.items()}
"""dtype name -> the safetensors code it is stored under."""


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
            reserved), read back by ``sharetree._load.read_metadata``.
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
    if not gather and _spread_over_processes(tree):
        group = current_group(f"save: {label!r}")
    if group is None and limit is not None:  # host buffers: process 0 writes, as for one file
        if jax.process_index() != 0:
            return
        group = ThreadGroup(0, 1, ThreadGroup.store())  # this process alone
    if group is not None:

        def build() -> Plan:
            return _build_together(path, tree, metadata, group, limit)

        save_together(group, Options(label, timeout, limit is not None), build)
        return
    path = _checked_path(path)
    writer = _Writer(gather)
    user = _user_metadata(metadata)
    structure = writer.node(tree, ())  # keys, depth and leaves first: names the path
    check_flattens(tree)  # dict keys jax cannot sort
    abstract_expanded(tree)  # validate the graph and every view's shape first
    meta = _file_metadata(user, writer, structure)
    from safetensors import SafetensorError

    try:
        if jax.process_index() == 0:
            atomic_write(path, writer.tensors, meta)
    except SafetensorError as e:  # a header over the 100 MB that every safetensors reader takes
        user_bytes = sum(len(k) + len(v) for k, v in user.items())
        sizes = f"{len(meta[KEY_TREE]):,} bytes of tree JSON and {user_bytes:,} of metadata="
        what = f"header too large for readers (100 MB): {sizes} ({one_line(e)}){_NOTHING}"
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


def _spread_over_processes(tree: Any) -> bool:
    """Whether a buffer of ``tree`` is held by several processes (none holds it whole)."""
    try:
        leaves = jtu.tree_leaves(tree, is_leaf=is_tied)
    except Exception:  # the walk names what is wrong
        return False
    return any(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not _addressable(x)
        for x in leaves
    )


def _file_metadata(user: dict[str, str], writer: _Writer, structure: Any) -> dict[str, str]:
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
    writer = _Writer(False, group)
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
    return Plan(out, facts, (INDEX, json.dumps(body, indent=2, ensure_ascii=False) + "\n"))


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


def _whole_views(path: str, tree: Any, writer: _Writer, user: dict[str, str]) -> dict[str, str]:
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
            what = f"names the view {view!r} in metadata=, where its tie is recorded{_NOTHING}"
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


def _spec(x: Tied, path: Path) -> Any:
    """The spec of the transform of ``x``, checked to be JSON that reads back as it."""

    def where() -> str:  # shown only on an error (a repr may be costly)
        return f"save: the tie at {short(path_str(path), 200)} ({short(x, 1000)}):"

    fix = "store a JSON value in each field (e.g. a dtype's name), or define spec() and from_spec()"
    try:
        spec = x.transform.spec()
    except TieError as e:  # an fn of a lambda: no name to write
        add_context(e, where())
        raise
    except Exception as e:  # a user transform's own spec()
        what, fix = f"its spec() raised {one_line(e)}", "make spec() return a dict of JSON values"
        raise error("E125", where(), what, fix=fix) from e
    why = _not_json(spec)
    if why is None:
        try:  # what a file holds must read back as this transform (given its classes)
            back = describe_transform(json.loads(json.dumps(spec, allow_nan=True)))
        except TieError as e:
            add_context(e, f"{where()}: its spec would not load")
            raise
        if is_described(back) or back == x.transform:  # fn: its function is named, not read
            return spec
        problem = f"its spec reads back as {short(back, 200)}, another transform"
    else:
        items = spec.items() if isinstance(spec, dict) else []
        field = next(((k, v) for k, v in items if _not_json(v) and isinstance(k, str)), None)
        problem = (
            f"its field {field[0]!r} holds {type(field[1]).__name__} {short(field[1], 60)}"
            if field is not None
            else f"its spec {short(spec)}"
        ) + f", which is not JSON ({why})"
    raise error("E125", where(), problem, fix=fix)


def _not_json(v: Any) -> str | None:
    """Why ``v`` is not JSON (``json.dumps``' error), or ``None``."""
    try:
        json.dumps(v, allow_nan=True)
    except (TypeError, ValueError) as e:
        return one_line(e)
    return None


def _addressable(x: jax.Array) -> bool:
    """Whether this process holds every shard of ``x`` (a seam for tests)."""
    return bool(x.is_fully_addressable)


class _Writer:
    """Walks a canonical tree into (JSON structure, {tensor name: array})."""

    def __init__(self, gather: bool, group: Group | None = None) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        self.gather = gather
        self.group = group  # several processes: each tensor a Spread, nothing read
        self.spreads: list[Spread] = []
        self.names: list[tuple[Path, str]] = []  # each buffer's path and tensor name
        self.load = [0] * (group.count if group else 1)  # bytes each process writes so far
        self.version = 1  # the oldest format that holds the tree: 2 keys, 3 climbs, 4 named refs

    def name_for(self, path: Path) -> str:
        # lone surrogates: a file holds UTF-8 names only
        base = "/".join(path).encode("utf-8", "backslashreplace").decode() if path else "<root>"
        name, k = base, 1
        # keys containing '/' can make two paths print alike; '__metadata__' is reserved
        while name in self.tensors or name == "__metadata__":
            name, k = f"{base}~{k}", k + 1
        return name

    def node(self, x: Any, path: Path) -> dict[str, Any]:
        if len(path) > MAX_DEPTH:
            at = f"save: the tree at {path_str(path[:8])!r}/..."
            raise error("E30", at, f"is nested deeper than {MAX_DEPTH} levels", fix="flatten it")
        if isinstance(x, Tied):
            return self.tied(x, path)
        if x is None:
            return {"t": "none"}
        kind, t = type(x), _KIND_OF.get(type(x))
        node: dict[str, Any] = {"t": t}
        if t in ("list", "tuple"):
            keys, values = [str(i) for i in range(len(x))], list(x)
        elif t is not None:
            keys = list(x.keys())
            for k in keys:
                if type(k) not in (str, int):
                    at = _at("a key of the dict", path)
                    raise wrong_type("E122", at, "str or int", k, "use str keys")
                _check_int(k, path, "a dict key")
            count = collections.Counter(map(str, keys))
            twice = [k for k in keys if count[str(k)] > 1]
            if twice or (t == "dict" and len(set(map(type, keys))) > 1):  # jax sorts dict keys
                one = f"the keys {short(twice, 60)}, one path"
                what = one if twice else f"str and int keys {short(keys, 60)}"
                fix = "use distinct keys of one type (str)"
                raise error("E31", _at("the dict", path), f"has {what}", fix=fix)
            node["keys"], values = keys, [x[k] for k in keys]
        elif not jtu.all_leaves([x]):  # any other pytree node: its children by their key names
            flat, _ = jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
            keys, values = [key_name(kp[0]) for kp, _ in flat], [c for _, c in flat]
            if len(set(keys)) != len(keys):
                what, fix = f"has equal key names {short(keys)}", "register it with distinct keys"
                raise error("E16", _at(f"the {kind.__name__}", path), what, fix=fix)
            node = {"t": "node", "type": f"{kind.__module__}.{kind.__qualname__}", "keys": keys}
        elif kind in (bool, int, float, str, complex):
            _check_int(x, path, "the leaf")
            value = [x.real, x.imag] if kind is complex else x
            return {"t": "value", "type": kind.__name__, "value": value}
        elif isinstance(x, (np.ndarray, np.generic, jax.Array)):
            return self.array(x, path)
        elif hasattr(x, "shape") and hasattr(x, "dtype"):  # a static would drop its values
            what = f"is a {kind.__name__} of shape {x.shape}, with no values{_NOTHING}"
            raise error("E59", _at("the leaf", path), what, fix="save arrays (np.asarray(x))")
        else:
            return {"t": "static", "type": f"{kind.__module__}.{kind.__qualname__}"}
        children = [self.node(c, (*path, str(k))) for k, c in zip(keys, values)]
        return {**node, "children": children}

    def tied(self, x: Tied, path: Path) -> dict[str, Any]:
        """The node of a tie: ``ref`` (and ``up``) for one ref, ``refs`` by name for several."""
        spec = _spec(x, path)
        if x.inputs is None:
            ref = x.refs[0][1]
            if ref.up is None:
                return {"t": "tied", "ref": list(ref.keys), "transform": spec}
            self.version = max(self.version, 3)  # an older reader would read the keys as scoped
            return {"t": "tied", "ref": list(ref.keys), "up": ref.up, "transform": spec}
        self.version = 4  # an older reader would miss the refs (a file without them stays older)
        refs = {
            name: {"ref": list(r.keys)} if r.up is None else {"ref": list(r.keys), "up": r.up}
            for name, r in x.refs
        }
        return {"t": "tied", "refs": refs, "transform": spec}

    def array(self, x: Any, path: Path) -> dict[str, Any]:
        at = _at("the buffer", path)
        if isinstance(x, jax.core.Tracer):
            raise error("E123", at, f"is traced{_NOTHING}", fix=FIXES["outside_jit"])
        if isinstance(x, jax.Array) and x.is_deleted():
            what = f"has been deleted (donate_argnums, x.delete()){_NOTHING}"
            raise error("E57", at, what, fix="save the tree the donating call returned")
        impl = None
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            if impl not in KEY_IMPLS:
                what, fix = f"holds PRNG keys of {impl!r}", "save jax.random.key_data(x)"
                raise error("E33", at, what, expected=", ".join(KEY_IMPLS), fix=fix)
            x, self.version = jax.random.key_data(x), max(self.version, 2)
        if self.group is not None:
            return self.spread(x, path, impl)
        if isinstance(x, jax.Array) and not _addressable(x):
            if not self.gather:
                what = f"is sharded over several processes{_NOTHING}"
                fix = "call st.save(path, tree, gather=True) on every process, or use Orbax"
                raise error("E34", at, what, fix=fix)
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        if isinstance(x, np.ma.MaskedArray) and np.ma.getmask(x) is not np.ma.nomask:
            fix = "save x.data and np.ma.getmaskarray(x), or x.filled()"
            raise error("E58", at, f"is a masked array; a file has no mask{_NOTHING}", fix=fix)
        a = np.asarray(x)
        if not is_numeric(a.dtype):
            what = f"has dtype {a.dtype}, not a numeric dtype{_NOTHING}"
            raise error("E124", at, what, fix="convert it to numbers or keep it out of the tree")
        dtype = a.dtype.name  # C order, little-endian: a copy only where needed
        a = a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)
        raw = dtype not in NATIVE_CODES.values()  # stored as bytes: no code of its own
        name = self.name_for(path)
        self.tensors[name] = np.frombuffer(a.tobytes(), np.uint8) if raw else a
        scalar = isinstance(x, np.generic)
        node = {"t": "buffer", "tensor": name, "dtype": dtype, "shape": list(a.shape), "raw": raw}
        return {**node, "scalar": scalar, **({} if impl is None else {"key": impl})}

    def spread(self, x: Any, path: Path, impl: str | None) -> dict[str, Any]:
        """The node of a buffer of a save of several processes: its checks, no data read."""
        at = _at("the buffer", path)
        if isinstance(x, np.ma.MaskedArray) and np.ma.getmask(x) is not np.ma.nomask:
            fix = "save x.data and np.ma.getmaskarray(x), or x.filled()"
            raise error("E58", at, f"is a masked array; a file has no mask{_NOTHING}", fix=fix)
        scalar = isinstance(x, np.generic)
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        dt = np.dtype(x.dtype)
        if not is_numeric(dt):
            what = f"has dtype {dt}, not a numeric dtype{_NOTHING}"
            raise error("E124", at, what, fix="convert it to numbers or keep it out of the tree")
        raw = dt.name not in NATIVE_CODES.values()
        name = self.name_for(path)
        self.tensors[name] = np.empty(0)  # the name is taken
        self.names.append((path, name))
        assert self.group is not None
        code = "U8" if raw else _CODE_OF[dt.name]
        self.spreads.append(spread(name, code, x, raw, at, self.group, self.load))
        node = {"t": "buffer", "tensor": name, "dtype": dt.name, "shape": list(x.shape), "raw": raw}
        return {**node, "scalar": scalar, **({} if impl is None else {"key": impl})}


def _at(what: str, path: Path) -> str:
    """Where a message of ``save`` points: ``what`` at ``path``."""
    return f"save: {what} at {short(path_str(path), 200)}"


def _check_int(x: Any, path: Path, what: str) -> None:
    """A TieError for an ``int`` too long for the JSON text of a file (Python's digit limit)."""
    if type(x) is int:
        try:
            str(x)
        except ValueError:
            bits, limit = x.bit_length(), sys.get_int_max_str_digits()
            problem = f"is an int of {bits:,} bits, over {limit:,} digits{_NOTHING}"
            raise error("E54", _at(what, path), problem, fix="store it as a str or array") from None
