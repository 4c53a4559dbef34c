"""The untrusted ``sharetree.*`` metadata of a file, checked against a table of fields.

A file's ``sharetree.tree`` is parsed by ``json.loads`` (an object naming a key twice
is refused) and walked once: each node's fields are checked against :data:`FIELDS`
(name, JSON type, required or not, a normaliser), then its kind's rule checks what
spans fields (a buffer against the tensor the safetensors header describes), then the
node is made: containers rebuilt, a buffer a lazy ``BufferLeaf``, a tie's transform
made by the caller's ``resolve``. Nesting is bounded by ``MAX_DEPTH``. Nothing the
file names is imported or called: type names stay text, and ``resolve``
(``transform_from_spec`` with the caller's ``functions=``) calls nothing it is not
given. Every problem is a :class:`TieError` naming the file, the node's path and the
field. The format: "The file format" in ``docs/saving_and_scaling.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from sharetree._errors import TieError, add_context, error, one_line, short
from sharetree._files.container import NATIVE_CODES, Reader
from sharetree._files.disk import DuplicateKey, loads
from sharetree._files.format import (
    BAD,
    FIELDS,
    FORMAT_VERSION,
    KEY_LIBRARY,
    KEY_TREE,
    KEY_VERSION,
    MAX_DEPTH,
    REF_FIELDS,
    RESAVE,
    VALUES,
    Field,
)
from sharetree._files.reads import BufferLeaf, Tensor
from sharetree._paths import Path, Ref, format_aval, path_str
from sharetree._tied import Tied
from sharetree._transforms import ANY_NAMES, Transform, describe_several, input_names

__all__ = ["Unsaved", "Header", "read_header"]


_KIND = Field("t", (str,), "a node kind")

_UPGRADE = "upgrade sharetree (pip install -U sharetree)"

_INPUTS_FIX = (
    "load it with the transform classes that wrote it (their inputs), or save the tree again "
    "with st.save"
)

_DEFAULTS = {"scalar": False, "key": None, "up": None, "ref": None, "refs": None}


def _taken(takes: tuple[str, ...]) -> str:
    """The inputs a transform takes, for a message."""
    shown = ", ".join(map(repr, takes))
    return "inputs of any names" if takes == ANY_NAMES else f"the inputs {shown}"


@dataclasses.dataclass(frozen=True)
class Unsaved:
    """A ``static`` node: a leaf no file holds (a function), taken from ``like`` by ``load``."""

    kind: str

    def __repr__(self) -> str:
        return f"<unsaved {self.kind}>"


class Header(NamedTuple):
    """A file's checked ``sharetree.*`` metadata and the tree it describes."""

    version: int
    tree: Any  # containers rebuilt, ties resolved; buffers not read (BufferLeaf)
    statics: list[tuple[Path, str]]  # Unsaved leaves: where, and their type names
    generic: list[tuple[Path, str]]  # nodes of other types, rebuilt as dicts
    keys: list[Path]  # buffers of typed PRNG keys


def read_header(
    reader: Reader, resolve: Callable[[Any], Transform], *, lazy: bool = True
) -> Header:
    """The checked ``sharetree.*`` metadata of ``reader``'s file and the tree it describes.

    Each tie's transform is ``resolve(spec)`` (the caller decides what may be called);
    each buffer a :class:`BufferLeaf` that reads its tensor when asked, or without
    ``lazy`` the ``jax.ShapeDtypeStruct`` of its data. No tensor is read.
    """
    meta, where = reader.metadata, f"{reader.verb}: {reader.path!r}"
    text, by = meta[KEY_VERSION], short(meta.get(KEY_LIBRARY, "?"), 40)
    number = int(text) if text.isascii() and text.isdigit() and len(text) < 10 else 0
    if number > FORMAT_VERSION:
        problem = f"has format version {text} (by sharetree {by})"
        reads = f"format versions up to {FORMAT_VERSION}"
        raise error("E126", where, problem, expected=reads, fix=_UPGRADE)
    if number < 1 or KEY_TREE not in meta:
        problem = f"has {KEY_VERSION} {short(text, 60)}" if number < 1 else f"has no {KEY_TREE!r}"
        want = "an integer from 1" if number < 1 else None
        raise error("E29", where, problem, expected=want, fix=RESAVE)
    walk = _Walk(reader, number, resolve, lazy)
    try:
        tree = walk.node(loads(meta[KEY_TREE]), ())
    except DuplicateKey as e:  # the parser keeps the last of two: a silent pick
        problem = f"names the field {short(e.key, 60)} twice in one object"
        raise error("E52", f"{where}: {KEY_TREE}", problem, fix=RESAVE) from None
    except RecursionError:  # in the parser, or a value nested almost as deep, echoed
        problem = f"is nested deeper than Python recurses (a file holds {MAX_DEPTH} levels)"
        raise error("E30", f"{where}: {KEY_TREE}", problem, fix=RESAVE) from None
    except TieError:
        raise
    except ValueError as e:
        problem = f"is not valid JSON ({one_line(e)})"
        raise error("E29", f"{where}: {KEY_TREE}", problem, fix=RESAVE) from e
    unused = sorted(set(reader.infos) - walk.used)
    if unused:
        raise error("E127", where, "holds tensors its tree does not use", found=f"{unused[:5]}")
    return Header(walk.version, tree, walk.statics, walk.generic, walk.keys)


class _Walk:
    """One walk over the nodes of a tree's JSON, each checked against :data:`FIELDS`."""

    def __init__(
        self, reader: Reader, version: int, resolve: Callable[[Any], Transform], lazy: bool
    ) -> None:
        self.where, self.reader = f"{reader.verb}: {reader.path!r}", reader
        self.infos = reader.infos
        self.version, self.resolve, self.lazy = version, resolve, lazy
        self.used: set[str] = set()
        self.statics: list[tuple[Path, str]] = []
        self.generic: list[tuple[Path, str]] = []
        self.keys: list[Path] = []

    def at(self, path: Path, what: str = "") -> str:
        """Where a message points: the file, the node's path and ``what`` (a field)."""
        return f"{self.where}, node {short(path_str(path), 200)}{what and ', '}{what}"

    def bad(self, path: Path, field: str, want: str, v: Any = None, found: str = "") -> TieError:
        """The TieError for the field ``field`` of the node at ``path``: ``want``, not ``v``."""
        found = found or f"{type(v).__name__} {short(v, 60)}"
        return error("E29", self.at(path, field), expected=want, found=found, fix=RESAVE)

    def field(self, node: dict[str, Any], path: Path, f: Field, within: str = "") -> Any:
        """The value of the field ``f`` of ``node`` (``within`` a field: an input), normalised."""
        if f.name not in node and not f.required:
            return _DEFAULTS[f.name]
        v = node.get(f.name, BAD)
        value = BAD if type(v) not in f.json else v if f.norm is None else f.norm(v)
        if value is BAD:
            found = "nothing (the field is missing)" if v is BAD else ""
            raise self.bad(path, f"{within}{within and ', '}field {f.name!r}", f.want, v, found)
        return value

    def node(self, node: Any, path: Path) -> Any:
        if len(path) > MAX_DEPTH:
            where = f"{self.where}, node {path_str(path[:8])!r}/..."
            raise error("E30", where, f"is nested deeper than {MAX_DEPTH} levels", fix=RESAVE)
        if type(node) is not dict:
            raise self.bad(path, "", "a JSON object", node)
        t = self.field(node, path, _KIND)
        if t not in FIELDS:
            problem = f"has the unknown node kind {short(t, 60)}"
            raise error("E126", self.at(path), problem, fix=_UPGRADE)
        v = {f.name: self.field(node, path, f) for f in FIELDS[t]}
        if t in ("static", "value", "tied", "buffer"):
            return getattr(self, t)(v, path)
        return None if t == "none" else self.container(t, v, path)

    def container(self, t: str, v: dict[str, Any], path: Path) -> Any:
        children = v["children"]
        keys = v["keys"] if "keys" in v else list(range(len(children)))
        if len(keys) != len(children) or len(set(map(str, keys))) != len(keys):
            found = f"keys {short(keys, 60)} for {len(children)} children"
            raise self.bad(path, "field 'keys'", "as many distinct keys as children", found=found)
        if t == "dict" and len({type(k) for k in keys}) > 1:  # jax sorts a dict's keys
            problem = "is a dict of str and int keys"
            raise error("E31", self.at(path), problem, found=short(keys, 60), fix=RESAVE)
        if t == "node":  # rebuilt as a dict keyed by its key names (load warns)
            self.generic.append((path, v["type"]))
        values = [self.node(c, (*path, str(k))) for k, c in zip(keys, children)]
        if t in ("list", "tuple"):
            return list(values) if t == "list" else tuple(values)
        kind = collections.OrderedDict if t == "odict" else dict
        return kind(zip(map(str, keys) if t == "node" else keys, values))

    def static(self, v: dict[str, Any], path: Path) -> Unsaved:
        self.statics.append((path, v["type"]))
        return Unsaved(v["type"])

    def value(self, v: dict[str, Any], path: Path) -> Any:
        kind, value = v["type"], v["value"]
        if not VALUES[kind](value):
            raise self.bad(path, "field 'value'", f"a {kind} value", value)
        if kind == "complex":
            return complex(*value)
        return float(value) if kind == "float" else value

    def tied(self, v: dict[str, Any], path: Path) -> Tied:
        refs = self.refs(v, path)
        try:  # a spec its class refuses, an fn not given: the file says where
            transform = self.resolve(v["transform"])
            if refs is not None:  # describing: an unregistered class takes the names given
                transform = describe_several(transform)
        except TieError as e:
            add_context(e, self.at(path, "field 'transform'"))
            raise
        self.inputs(transform, None if refs is None else tuple(sorted(refs)), path)
        try:
            if refs is None:
                return Tied(tuple(v["ref"]), transform, up=v["up"])
            return Tied(refs, transform)
        except TieError as e:  # what Tied checks besides (E103 for a class's malformed inputs)
            add_context(e, self.at(path, "field 'transform'"))
            raise

    def refs(self, v: dict[str, Any], path: Path) -> dict[str, Ref] | None:
        """The named refs of a tie's ``refs`` field, each checked; ``None`` for one ``ref``."""
        refs, ref, up = v["refs"], v["ref"], v["up"]
        if refs is None:
            if ref is None:
                want = "a non-empty list of str or int keys (or 'refs', in version 4)"
                raise self.bad(path, "field 'ref'", want, found="nothing (the field is missing)")
            if up is not None and self.version < 3:
                found = f"'up' in a file of version {self.version}"
                raise self.bad(path, "field 'up'", "no 'up' before format version 3", found=found)
            return None
        if self.version < 4:
            found = f"'refs' in a file of version {self.version}"
            raise self.bad(path, "field 'refs'", "no 'refs' before format version 4", found=found)
        if ref is not None or up is not None:
            which = "ref" if ref is not None else "up"
            want, found = "'refs' alone (each input has its own 'ref' and 'up')", f"'{which}' too"
            raise self.bad(path, f"field {which!r}", want, found=found)
        out = {}
        for name, entry in refs.items():
            within = f"field 'refs', input {short(name, 60)}"
            if not name.isidentifier():
                want = "an input name that is an identifier ('base', 'a')"
                raise self.bad(path, within, want, found=f"the name {short(name, 60)}")
            if type(entry) is not dict:
                raise self.bad(path, within, 'a JSON object {"ref": [keys], "up": n}', entry)
            keys, climb = (self.field(entry, path, f, within) for f in REF_FIELDS)
            out[name] = Ref(tuple(keys), climb)
        return out

    def inputs(self, t: Transform, names: tuple[str, ...] | None, path: Path) -> None:
        """E131 unless ``t`` takes the inputs the tie names (``None``: one ref)."""
        takes = input_names(t)
        if takes is not None and not (
            isinstance(takes, tuple) and all(isinstance(n, str) for n in takes)
        ):
            return  # a class's malformed inputs: Tied says so (E103)
        if names is None or takes is None:
            if names is None and takes is None:
                return
            problem = (
                f"has one ref, but its transform {short(t, 100)} takes several inputs"
                if names is None
                else f"names the inputs {', '.join(map(repr, names))}, but its transform "
                f"{short(t, 100)} takes one value"
            )
            expected = "one ref" if takes is None else _taken(takes)
            raise error("E131", self.at(path), problem, expected=expected, fix=_INPUTS_FIX)
        if takes == ANY_NAMES:
            return
        missing, extra = sorted(set(takes) - set(names)), sorted(set(names) - set(takes))
        if missing or extra:
            name = (missing or extra)[0]
            problem = f"its transform {short(t, 100)} " + (
                "takes this input, which the tie does not name"
                if missing
                else "does not take this input"
            )
            found = f"the inputs {', '.join(map(repr, names))}"
            at = self.at(path, f"input {short(name, 60)}")
            raise error("E131", at, problem, expected=_taken(takes), found=found, fix=_INPUTS_FIX)

    def buffer(self, v: dict[str, Any], path: Path) -> Any:
        name, dtype, shape, raw, impl = v["tensor"], v["dtype"], v["shape"], v["raw"], v["key"]
        if v["scalar"] and shape:
            found = f"true for shape {list(shape)}"
            raise self.bad(path, "field 'scalar'", "true for shape [] only", found=found)
        if impl is not None and (self.version < 2 or dtype != np.uint32 or raw):
            found = f"{impl!r} on {'raw ' * raw}{dtype} data in a file of version {self.version}"
            want = "a key on uint32 data, format version 2"
            raise self.bad(path, "field 'key'", want, found=found)
        data = jax.ShapeDtypeStruct(shape, dtype)
        want = f"uint8[{data.size * dtype.itemsize}]" if raw else format_aval(data)
        info = self.infos.get(name)  # its dtype and shape as format_aval shows them
        got = info and f"{NATIVE_CODES.get(info.code, info.code)}{list(info.shape)}"
        if got != want or name in self.used:
            found = "no such tensor" if got is None else "used twice" if got == want else got
            expected = f"{want} (the bytes of {format_aval(data)})" if raw else want
            at = self.at(path, f"tensor {short(name, 60)}")
            raise error("E127", at, expected=expected, found=found, fix=RESAVE)
        self.used.add(name)
        aval = data
        if impl is not None:
            self.keys.append(path)
            try:  # the key data's shape fits the implementation (a shape check: nothing runs)
                aval = jax.eval_shape(functools.partial(jax.random.wrap_key_data, impl=impl), data)
            except (ValueError, TypeError) as e:
                found = f"{format_aval(data)} ({one_line(e)})"
                want = f"key data that fits {impl} keys"
                raise self.bad(path, "field 'key'", want, found=found) from e
        if not self.lazy:
            return data
        tensor = Tensor(self.reader, name, data.shape, data.dtype, view=raw)
        return BufferLeaf(tensor, aval.shape, aval.dtype, v["scalar"], impl)
