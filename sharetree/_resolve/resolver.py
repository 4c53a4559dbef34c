"""Resolving ties: a canonical treedef becomes a :class:`Structure` (pure Python, iterative).

Each ``Tied``'s refs are looked up from the innermost subtree holding it out to the root
(or climbed), followed through views and composed; a view of several positions becomes
joins. Cycles, dangling refs and ties in static data are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, NamedTuple

import jax.tree_util as jtu

from sharetree._errors import TieError, error, short, warn
from sharetree._paths import (
    Path,
    Ref,
    closest,
    key_str,
    keypath_to_path,
    leaves_with_paths,
    nnx_variable,
    node_paths,
    path_str,
    plural,
    ref_str,
)
from sharetree._resolve.records import Input, Join, Leaf, Structure
from sharetree._resolve.refs import nodes_at, overlaps, treedef_nodes, written
from sharetree._tied import Tied, is_tied
from sharetree._transforms import Transform, chain, identity

__all__ = ["STRUCTURE_CACHE_SIZE", "structure_of"]

STRUCTURE_CACHE_SIZE = 512  # how many resolved treedefs structure_of keeps (least recent out)
_FIX_CYCLE = "put the array at one of these paths and tie the others to it"
_FIX_SELF = "refer to a path outside it that holds the array"
_FIX_KEY = "rename one key so that every path names one node"
_FIX_MISSING = "point the ref at an existing path, seen from the tie's subtree out to the root"


@dataclasses.dataclass(eq=False, slots=True)
class _Ref:
    """A pytree leaf: ``transform(canonical leaf i)``, in a view of the ``Tied`` at ``via``."""

    i: int
    transform: Transform = identity
    via: Path | None = None


def _compose(template: Any, t: Transform) -> Any:
    if t == identity:
        return template
    return jtu.tree_map(lambda r: _Ref(r.i, chain(r.transform, t)), template)


class _Hop(NamedTuple):
    """How the ref of one ``Tied`` was followed: as written (in its scope), then through views."""

    ref: Path  # the ref as written, from the subtree it was found in
    written: Path  # the ref exactly as the Tied holds it
    via: tuple[tuple[Path, Tied], ...]  # each view passed on the way: its path and its Tied
    lands: Path  # the node it lands on (a leaf, a Tied or a subtree)


def _hop_text(hop: _Hop, nxt: Path) -> str:
    """One step of a cycle as the user wrote it: ``'b/x' (via Tied('a') at 'b') -> 'a/x'``."""
    text = repr(path_str(hop.ref))
    if hop.written != hop.ref:
        text += f" (written {path_str(hop.written)!r})"
    if hop.via:
        text += " (via " + ", ".join(f"{t!r} at {path_str(p)!r}" for p, t in hop.via) + ")"
        text += f" -> {path_str(hop.lands)!r}"
    if hop.lands[: len(nxt)] == nxt and hop.lands != nxt:  # a path below the view at nxt
        text += f" (through the view {path_str(nxt)!r})"
    elif hop.lands != nxt:  # a subtree: the chain goes on at a tie inside it
        text += f" (holding the tie {path_str(nxt)!r})"
    return text


def _cycle_error(
    cycle: list[Path], hops: dict[Any, _Hop], dep_hop: dict[tuple[Path, Path], Any]
) -> TieError:
    """The whole cycle ``cycle[0] -> ... -> cycle[-1] == cycle[0]``, each ref as written."""
    keys = [dep_hop.get((a, b), (a, None)) for a, b in itertools.pairwise(cycle)]
    steps = [
        _hop_text(hops[key], b) + _input(key[1]) for key, b in zip(keys, cycle[1:], strict=True)
    ]
    shown = steps if len(steps) <= 8 else [*steps[:4], "...", *steps[-4:]]
    text = " -> ".join([repr(path_str(cycle[0])), *shown])
    ties = {*cycle, *(p for key in keys for p, _ in hops[key].via)}  # the views passed too
    where = f"{plural(len(ties), 'tie')}, starting at {path_str(cycle[0])!r}"
    return error("E2", f"cycle of ties: {text} ({where})", fix=_FIX_CYCLE)


class _Resolver:
    def __init__(self, placeholder: Any) -> None:
        self.placeholder = placeholder
        self.tied_at: dict[Path, Tied] = {}
        # the templates: canonical leaves (``_Ref``) by path, then each resolved ``Tied``
        self.memo: dict[Path, Any] = {}
        for path, x in leaves_with_paths(placeholder, is_tied):
            if path in self.memo or path in self.tied_at:
                raise error("E16", f"two positions share the path {path_str(path)!r}", fix=_FIX_KEY)
            (self.tied_at if isinstance(x, Tied) else self.memo)[path] = x
        self.buffer_paths = tuple(self.memo)
        self.nodes = node_paths([*self.memo, *self.tied_at])
        self.joins: list[Join] = []
        # by (Tied position, input name): None for a Tied of one ref
        self.targets: dict[_Key, tuple[Path, Transform]] = {}
        self.hops: dict[_Key, _Hop] = {}  # how each target was reached (for cycle errors)
        self.scoped: dict[_Key, Path] = {}  # each ref, from the scope it is found in
        self.dep_hop: dict[tuple[Path, Path], _Key] = {}  # the input a dependency comes from

    def _several(self, at: Path | None) -> bool:
        """Whether a ``Tied`` of several refs is at ``at`` (a view no path is followed through)."""
        return at in self.tied_at and self.tied_at[at].inputs is not None

    def target(self, at: Path, name: str | None = None) -> tuple[Path, Transform]:
        """Where one ref of the ``Tied`` at ``at`` lands through any views, and its transform.

        A path below a view of several refs (a subtree) is not followed further: its
        template is read from that view's once it is built.
        """
        key = (at, name)
        if key in self.targets:
            return self.targets[key]
        t = self.tied_at[at]
        first = self._scope(at, name)
        if overlaps(first, at):
            rel = "itself" if first == at else "a path inside itself"
            if len(first) < len(at):
                rel = "a subtree that contains it"
            rel = f"refers to {path_str(first)!r}, {rel}"
            raise error("E3", f"Tied at {path_str(at)!r}{_input(name)}", rel, fix=_FIX_SELF)
        via = [at]
        ref, prefix = self._follow(first, via)
        if ref not in self.nodes and not self._several(prefix):
            if prefix in via:  # views that refer below each other in a loop
                loop = [*via[via.index(prefix) :], prefix]
                names = {p: name if p == at else None for p in loop}
                own = {
                    p: (self._scope(p, nm), dict(self.tied_at[p].refs)[nm].keys)
                    for p, nm in names.items()
                }
                hops = {(p, names[p]): _Hop(r, w, (), r) for p, (r, w) in own.items()}
                deps = {(a, b): (a, names[a]) for a, b in itertools.pairwise(loop)}
                raise _cycle_error(loop, hops, deps)
            raise self._missing(at, name, ref, prefix)
        written_ = dict(t.refs)[name].keys
        self.hops[key] = _Hop(first, written_, tuple((p, self.tied_at[p]) for p in via[1:]), ref)
        # ``via`` lists the views outermost first: the value is via[0](via[1](...(x)))
        transform = chain(*(self.tied_at[p].transform for p in reversed(via[1:])))
        if name is None:
            transform = chain(transform, t.transform)
        self.targets[key] = (ref, transform)
        return self.targets[key]

    def _follow(self, ref: Path, via: list[Path]) -> tuple[Path, Path | None]:
        """Follow ``ref`` through views (added to ``via``): where it stops, and its node prefix."""
        prefix = None
        while ref not in self.nodes:
            above = (ref[:k] for k in range(len(ref) - 1, 0, -1))
            prefix = next((p for p in above if p in self.nodes), None)
            if prefix is None or prefix not in self.tied_at or prefix in via:
                break
            if self._several(prefix):  # below a view of several refs: read from its template
                break
            inner = self._scope(prefix)
            if not inner:  # a view whose own ref is being looked up: not through it
                break
            via.append(prefix)
            ref = inner + ref[len(prefix) :]
        return ref, prefix

    def _lands(self, ref: Path) -> bool:
        """Whether ``ref`` names a node, through views."""
        ref, prefix = self._follow(ref, [])
        return ref in self.nodes or self._several(prefix)

    def _scope(self, at: Path, name: str | None = None) -> Path:
        """One ref of the ``Tied`` at ``at`` from the innermost scope with it (``()`` meanwhile)."""
        key = (at, name)
        if key in self.scoped:
            return self.scoped[key]
        t = self.tied_at[at]
        ref_, self.scoped[key] = dict(t.refs)[name], ()
        ref = ref_.keys
        if ref_.up is not None:  # a ref that climbs: exactly there, no lookup
            if ref_.up > len(at) - 1:
                where = f"Tied at {path_str(at)!r}{_input(name)}: ref {written(ref_)!r}"
                problem = f"climbs {ref_.up} levels above its subtree"
                found = f"{plural(len(at) - 1, 'level')} above it", "climb fewer levels"
                raise error("E163", where, problem, found=found[0], fix=found[1])
            self.scoped[key] = at[: len(at) - 1 - ref_.up] + ref
            return self.scoped[key]

        def has(k: int) -> bool:
            scoped = at[:k] + ref
            return not overlaps(scoped, at) and self._lands(scoped)

        k = next((k for k in range(len(at) - 1, 0, -1) if has(k)), 0)
        # a same-named position further out, outside the subtree the ref is read in: the
        # writer may have meant it (inside, it is that subtree's own name: wrapping a tree
        # in a list puts its refs in such a subtree, and their meaning is unchanged)
        outer = (j for j in range(k - 1, -1, -1) if (at[:j] + ref)[:k] != at[:k] and has(j))
        if k and (far := next(outer, None)) is not None:
            _warn_shadowed(at, ref, k, far)
        self.scoped[key] = at[:k] + ref
        return self.scoped[key]

    def _missing(self, at: Path, name: str | None, ref: Path, prefix: Path | None) -> TieError:
        ref_ = dict(self.tied_at[at].refs)[name]
        head = f"Tied at {path_str(at)!r}{_input(name)}: ref {written(ref_)!r}"
        if ref != ref_.keys:
            head += f" (followed through views to {path_str(ref)!r})"
        joined = "/".join(ref)
        split = next((p for p in self.nodes if "/".join(p) == joined and p != ref), None)
        if prefix in self.buffer_paths and split is None:
            fix = f"refer to {path_str(prefix)!r} itself and select with a transform (st.index)"
            return error("E4", head, f"goes below the leaf {path_str(prefix)!r}", fix=fix)
        empty = [x for x in nodes_at(self.placeholder, ref) if not jtu.tree_leaves(x)]
        if empty:
            fix = "point the ref at a leaf or a subtree that holds arrays"
            return error("E1b", head, f"is {empty[0]!r}, a subtree with no leaves", fix=fix)
        hint = closest(path_str(ref), (path_str(p) for p in self.nodes if p != at))
        if split is not None:  # the same text, but a key of the tree contains '/'
            hint = f"the tree has {split!r}, a key with '/' in it: write the ref as that tuple"
        return error("E1", head, f"does not exist in the tree; {hint}", fix=_FIX_MISSING)

    def _names(self, at: Path) -> tuple[str | None, ...]:
        return tuple(n for n, _ in self.tied_at[at].refs)

    def deps(self, at: Path) -> list[Path]:
        """The ``Tied`` positions whose resolution the ``Tied`` at ``at`` needs first."""
        out: dict[Path, None] = {}
        for name in self._names(at):
            path = self.target(at, name)[0]
            if path in self.memo or path in self.tied_at:  # a leaf (always in memo) or a Tied
                found = [path]
            elif path not in self.nodes:  # below a view of several refs
                found = [next(p for p in self.tied_at if path[: len(p)] == p)]
            else:
                found = [p for p in self.tied_at if p[: len(path)] == path]
            for p in found:
                self.dep_hop.setdefault((at, p), (at, name))
                out[p] = None
        return list(out)

    def resolve(self, start: Path) -> None:
        """Put the template of the ``Tied`` at ``start`` in memo, after every ``Tied`` it needs."""
        if start in self.memo:
            return
        stack: list[tuple[Path, Any]] = [(start, iter(self.deps(start)))]
        on_stack = {start: 0}
        while stack:
            at, pending = stack[-1]
            nxt = next((d for d in pending if d not in self.memo), None)
            if nxt is not None:
                if nxt in on_stack:
                    cycle = [p for p, _ in stack[on_stack[nxt] :]] + [nxt]
                    raise _cycle_error(cycle, self.hops, self.dep_hop)
                on_stack[nxt] = len(stack)
                stack.append((nxt, iter(self.deps(nxt))))
                continue
            stack.pop()
            del on_stack[at]
            self.memo[at] = self.build(at)

    def template(self, at: Path, name: str | None) -> Any:
        """The template one ref of the ``Tied`` at ``at`` reads (its inputs resolved)."""
        path, t = self.target(at, name)
        if path in self.memo:  # a leaf or a resolved Tied
            return _compose(self.memo[path], t)
        if path in self.nodes:
            found = nodes_at(self.placeholder, path)
            if len(found) != 1:
                where = f"path {path_str(path)!r}"
                raise error("E16", where, f"names {len(found)} nodes", expected="one", fix=_FIX_KEY)
            kind = nnx_variable(found[0])
            if kind is not None and self._in_variable(at):  # a Variable copied into another
                value = f"{path_str(path)}/value"
                where = f"the Tied at {path_str(at)!r}"
                problem = f"names the NNX {kind} at {path_str(path)!r}, not its value"
                fix = f"refer to {value!r} (sharetree.nnx.tie writes its refs so)"
                raise error("E321", where, problem, fix=fix)

            def visit(kp: Any, x: Any) -> Any:
                return self.memo[path + keypath_to_path(kp)] if isinstance(x, Tied) else x

            return _compose(jtu.tree_map_with_path(visit, found[0], is_leaf=is_tied), t)
        # below a view of several refs, built already: a part of its template
        view = next(p for p in self.tied_at if path[: len(p)] == p)
        found = nodes_at(self.memo[view], path[len(view) :])
        if len(found) != 1:
            raise self._missing(at, name, path, None)
        return _compose(found[0], t)

    def _in_variable(self, at: Path) -> bool:
        """Whether the ``Tied`` at ``at`` is the value of an NNX Variable."""
        parent = nodes_at(self.placeholder, at[:-1]) if at else []
        return len(parent) == 1 and nnx_variable(parent[0]) is not None

    def build(self, at: Path) -> Any:
        t = self.tied_at[at]
        if t.inputs is None:
            return self.template(at, None)
        inputs = {name: self.template(at, name) for name in t.inputs}
        flat = {n: jtu.tree_flatten_with_path(x) for n, x in inputs.items()}
        kinds = {n: treedef for n, (_, treedef) in flat.items()}
        if len(set(kinds.values())) > 1:
            raise _structures_error(at, t, inputs)
        first = flat[t.inputs[0]][0]
        n = len(self.buffer_paths)
        out = []
        for k, (kp, _) in enumerate(first):
            refs = {name: flat[name][0][k][1] for name in t.inputs}
            ins = tuple((name, Input(r.i, r.transform)) for name, r in refs.items())
            self.joins.append(Join(t.transform, ins, at, at + keypath_to_path(kp)))
            out.append(_Ref(n + len(self.joins) - 1))
        return jtu.tree_unflatten(kinds[t.inputs[0]], out)


_Key = tuple[Path, "str | None"]


def _input(name: str | None) -> str:
    """`` (input 'a')`` for one of several refs, ``""`` for the one ref of a ``Tied``."""
    return "" if name is None else f" (input {name!r})"


def _structures_error(at: Path, t: Tied, inputs: dict[str, Any]) -> TieError:
    """E168: the inputs of a view of several refs are subtrees of different structures."""
    shapes = {}
    for name, x in inputs.items():
        paths = [path_str(keypath_to_path(kp)) for kp, _ in jtu.tree_flatten_with_path(x)[0]]
        n = f"{len(paths)} {'leaf' if len(paths) == 1 else 'leaves'}"
        leaves = f"a subtree of {n} ({short(paths, 60)})"
        shapes[name] = "a leaf" if paths == ["<root>"] else leaves
    refs = dict(t.refs)
    found = "; ".join(f"{n!r} ({written(refs[n])!r}) is {s}" for n, s in shapes.items())
    where = f"Tied at {path_str(at)!r}: {t!r}"
    fix = "refer to leaves, or to subtrees of one structure (the same keys and leaves)"
    return error("E168", where, "reads inputs of different structures", found=found, fix=fix)


def _warn_shadowed(at: Path, ref: Path, near: int, far: int) -> None:
    """Warn that the scoped ref at ``at`` reads ``at[:near] + ref`` past ``at[:far] + ref``."""
    spell = [key_str(ref_str(Ref(ref, len(at) - 1 - k))) for k in (near, far)]
    where = f"Tied at {path_str(at)!r}: ref {path_str(ref)!r}"
    problem = f"reads {path_str(at[:near] + ref)!r}; {path_str(at[:far] + ref)!r} is further out"
    fix = f"write {spell[0]!r} to read the nearer one, {spell[1]!r} to read the other"
    warn("E165", where, problem, fix=fix)


def _parts(v: Any) -> Any:
    """The values inside a piece of aux data: a tuple's, list's, dict's or dataclass's."""
    if isinstance(v, (tuple, list)):
        return v
    if isinstance(v, dict):
        return v.values()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):  # Equinox's flattened fields
        return [getattr(v, f.name, None) for f in dataclasses.fields(v)]
    return ()


def _check_no_static_ties(treedef: Any) -> None:
    """A TieError for a ``Tied`` in a node's aux data (an ``eqx.field(static=True)``)."""
    for node in treedef_nodes(treedef):
        data = node.node_data()
        if data is not None and data[0] is not Tied:
            values, depth = [data[1]], 0
            while values and depth < 8:  # aux data: a few levels of tuples, lists and dicts
                found = next((v for v in values if isinstance(v, Tied)), None)
                if found is not None:
                    held = f"is held in the static data of a {data[0].__qualname__} node"
                    raise error("E83", repr(found), held, fix="make that field a pytree child")
                values = [w for v in values for w in _parts(v)]
                depth += 1


@functools.lru_cache(maxsize=STRUCTURE_CACHE_SIZE)
def structure_of(treedef: Any) -> Structure:
    """Resolve the sharing graph of a canonical treedef (cached).

    Raises:
        TieError: for a dangling ref, a cycle, a self-reference or a ``Tied`` root.
    """
    placeholder = jtu.tree_unflatten(treedef, [_Ref(i) for i in range(treedef.num_leaves)])
    if isinstance(placeholder, Tied):
        where, fix = f"the root of the tree is {placeholder!r}", "pass the tree that holds the tie"
        raise error("E14", where, expected="a Tied inside a tree", fix=fix)
    _check_no_static_ties(treedef)
    res = _Resolver(placeholder)
    for at in res.tied_at:
        res.resolve(at)

    def expand(kp: Any, x: Any) -> Any:
        if isinstance(x, Tied):
            at = keypath_to_path(kp)
            # templates are shared between ties: name the Tied written at this position
            return jtu.tree_map(lambda r: _Ref(r.i, r.transform, at), res.memo[at])
        return x

    expanded = jtu.tree_map_with_path(expand, placeholder, is_leaf=is_tied)
    flat, expanded_treedef = jtu.tree_flatten_with_path(expanded)
    spec = tuple(
        Leaf(x.i, None if x.via is None else x.transform, keypath_to_path(kp), x.via)
        for kp, x in flat
    )
    reads = {at: {n: res.scoped[(at, n)] for n, _ in t.refs} for at, t in res.tied_at.items()}
    return Structure(
        treedef, res.buffer_paths, res.tied_at, expanded_treedef, spec, tuple(res.joins), reads
    )
