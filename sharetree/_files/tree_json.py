"""The tree written as JSON: a canonical tree walked into ``sharetree.tree`` and its tensors."""

from __future__ import annotations

import collections
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import (
    FIXES,
    TieError,
    add_context,
    error,
    one_line,
    short,
    wrong_type,
)
from sharetree._files.container import CODE_OF, NATIVE_CODES, is_numeric
from sharetree._files.format import KEY_IMPLS, MAX_DEPTH
from sharetree._files.plan import Spread, spread
from sharetree._files.processes import Group
from sharetree._paths import Path, key_name, path_str
from sharetree._tied import Tied, is_tied
from sharetree._transforms import describe_transform, is_described

__all__ = ["NOTHING", "addressable", "spread_over_processes", "Writer"]


_KIND_OF: dict[type, str] = {
    dict: "dict",
    collections.OrderedDict: "odict",
    list: "list",
    tuple: "tuple",
}
"""The node kinds of the containers a file rebuilds on its own."""

NOTHING = "; nothing was written"


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


def addressable(x: jax.Array) -> bool:
    """Whether this process holds every shard of ``x`` (a seam for tests)."""
    return bool(x.is_fully_addressable)


def spread_over_processes(tree: Any) -> bool:
    """Whether a buffer of ``tree`` is held by several processes (none holds it whole)."""
    try:
        leaves = jtu.tree_leaves(tree, is_leaf=is_tied)
    except Exception:  # the walk names what is wrong
        return False
    return any(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not addressable(x)
        for x in leaves
    )


class Writer:
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
            what = f"is a {kind.__name__} of shape {x.shape}, with no values{NOTHING}"
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
            raise error("E123", at, f"is traced{NOTHING}", fix=FIXES["outside_jit"])
        if isinstance(x, jax.Array) and x.is_deleted():
            what = f"has been deleted (donate_argnums, x.delete()){NOTHING}"
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
        if isinstance(x, jax.Array) and not addressable(x):
            if not self.gather:
                what = f"is sharded over several processes{NOTHING}"
                fix = "call st.save(path, tree, gather=True) on every process, or use Orbax"
                raise error("E34", at, what, fix=fix)
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        if isinstance(x, np.ma.MaskedArray) and np.ma.getmask(x) is not np.ma.nomask:
            fix = "save x.data and np.ma.getmaskarray(x), or x.filled()"
            raise error("E58", at, f"is a masked array; a file has no mask{NOTHING}", fix=fix)
        a = np.asarray(x)
        if not is_numeric(a.dtype):
            what = f"has dtype {a.dtype}, not a numeric dtype{NOTHING}"
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
            raise error("E58", at, f"is a masked array; a file has no mask{NOTHING}", fix=fix)
        scalar = isinstance(x, np.generic)
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        dt = np.dtype(x.dtype)
        if not is_numeric(dt):
            what = f"has dtype {dt}, not a numeric dtype{NOTHING}"
            raise error("E124", at, what, fix="convert it to numbers or keep it out of the tree")
        raw = dt.name not in NATIVE_CODES.values()
        name = self.name_for(path)
        self.tensors[name] = np.empty(0)  # the name is taken
        self.names.append((path, name))
        assert self.group is not None
        code = "U8" if raw else CODE_OF[dt.name]
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
            problem = f"is an int of {bits:,} bits, over {limit:,} digits{NOTHING}"
            raise error("E54", _at(what, path), problem, fix="store it as a str or array") from None
