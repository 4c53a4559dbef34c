"""Resolving ties: a canonical treedef becomes a :class:`Structure` of buffers and views.

The resolution depends only on the tree's structure (the treedef carries each
``Tied``'s ref and transform), so it is computed once per treedef and cached.
It is pure Python: no array is touched. Resolution is iterative, so a chain
of 10,000 ties (or a cycle of them) never hits Python's recursion limit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax.tree_util as jtu

from sharetree._errors import TieError
from sharetree._paths import Path, closest, keypath_to_path, node_paths, path_str
from sharetree._tied import Tied, is_tied
from sharetree._transforms import Transform, chain, identity

__all__ = ["Leaf", "ViewLeaf", "Structure", "structure_of", "STRUCTURE_CACHE_SIZE"]

STRUCTURE_CACHE_SIZE = 512
"""How many resolved treedefs :func:`structure_of` keeps (least recently used first out)."""


class Leaf(NamedTuple):
    """One leaf of the materialized tree, as the resolver sees it.

    Attributes:
        buffer: index of the canonical leaf (the buffer) it is computed from.
        transform: ``None`` at the buffer's own position, else the composed transform.
        path: its path in the materialized tree.
        tie: the path of the ``Tied`` that produced it (``None`` for a buffer).
    """

    buffer: int
    transform: Transform | None
    path: Path
    tie: Path | None


class ViewLeaf(NamedTuple):
    """A materialized leaf that is a view: :class:`Leaf` with ``transform`` and ``tie`` set."""

    buffer: int
    transform: Transform
    path: Path
    tie: Path


@dataclasses.dataclass(frozen=True, eq=False)  # one object per treedef: identity is equality
class Structure:
    """What a canonical treedef resolves to (cached per treedef by :func:`structure_of`).

    Attributes:
        treedef: the canonical tree's structure.
        buffer_paths: path of each canonical leaf (each buffer), in flatten order.
        ties: each ``Tied`` position and the ``Tied`` written there, in flatten order.
        expanded_treedef: the materialized tree's structure.
        expanded: one :class:`Leaf` per materialized leaf, in flatten order.
    """

    treedef: Any
    buffer_paths: tuple[Path, ...]
    ties: dict[Path, Tied]
    expanded_treedef: Any
    expanded: tuple[Leaf, ...]

    @functools.cached_property
    def sources(self) -> tuple[int, ...]:
        """The buffer index of each materialized leaf."""
        return tuple(leaf.buffer for leaf in self.expanded)

    @functools.cached_property
    def views(self) -> tuple[ViewLeaf, ...]:
        """The materialized leaves that are views (``transform`` is not ``None``)."""
        out = []
        for leaf in self.expanded:
            if leaf.transform is not None:
                assert leaf.tie is not None  # set by the resolver on every view
                out.append(ViewLeaf(leaf.buffer, leaf.transform, leaf.path, leaf.tie))
        return tuple(out)


class _Slot:
    """Placeholder for canonical leaf ``i`` while resolving a structure (a pytree leaf)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Ref:
    """Placeholder for ``transform(canonical leaf i)`` in a view made by the ``Tied`` at ``via``."""

    __slots__ = ("i", "transform", "via")

    def __init__(self, i: int, transform: Transform, via: Path | None = None) -> None:
        self.i, self.transform, self.via = i, transform, via


class _Target(NamedTuple):
    """Where a ref lands after following views: a leaf, a ``Tied`` or a subtree."""

    kind: str  # "leaf" | "tied" | "node"
    path: Path
    transform: Transform  # applied to the value found at ``path``


def _compose(template: Any, t: Transform) -> Any:
    if t == identity:
        return template
    return jtu.tree_map(lambda r: _Ref(r.i, chain(r.transform, t)), template)


def _cycle_error(cycle: list[Path]) -> TieError:
    shown = cycle if len(cycle) <= 9 else [*cycle[:4], None, *cycle[-4:]]
    text = " -> ".join("..." if p is None else repr(path_str(p)) for p in shown)
    return TieError(
        f"cycle of ties: {text} ({len(cycle) - 1} ties, starting at {path_str(cycle[0])!r}). "
        "Each Tied refers to the next, so no buffer holds the value. "
        "Fix: put the array at one of these paths and tie the others to it."
    )


class _Resolver:
    def __init__(self, placeholder: Any) -> None:
        self.placeholder = placeholder
        flat, _ = jtu.tree_flatten_with_path(placeholder, is_leaf=is_tied)
        self.order: list[Path] = []
        self.slot_of: dict[Path, int] = {}
        self.tied_at: dict[Path, Tied] = {}
        for kp, x in flat:
            path = keypath_to_path(kp)
            if path in self.slot_of or path in self.tied_at:
                raise TieError(
                    f"two positions share the path {path_str(path)!r} (keys that differ only in "
                    "type, such as 0 and '0'). Fix: rename one key so that paths are unambiguous."
                )
            self.order.append(path)
            if isinstance(x, Tied):
                self.tied_at[path] = x
            else:
                self.slot_of[path] = x.i
        self.nodes = node_paths(self.order)
        self.memo: dict[Path, Any] = {}
        self.targets: dict[Path, _Target] = {}

    # -- where a ref lands -------------------------------------------------

    def target(self, at: Path) -> _Target:
        """Follow the ref of the ``Tied`` at ``at`` through any views it passes (iteratively)."""
        if at in self.targets:
            return self.targets[at]
        t = self.tied_at[at]
        if t.ref[: len(at)] == at or at[: len(t.ref)] == t.ref:
            if t.ref == at:
                rel = "itself"
            elif len(t.ref) > len(at):
                rel = "a path inside itself"
            else:
                rel = "a subtree that contains it"
            raise TieError(
                f"Tied at {path_str(at)!r} refers to {path_str(t.ref)!r}, {rel}: a view cannot "
                "be its own buffer. Fix: refer to a path outside it that holds the array."
            )
        ref, post, seen = t.ref, [t.transform], [at]
        while True:
            if ref in self.slot_of:
                kind = "leaf"
            elif ref in self.tied_at:
                kind = "tied"
            elif ref in self.nodes:
                kind = "node"
            else:
                prefix = next(
                    (
                        ref[:k]
                        for k in range(len(ref) - 1, 0, -1)
                        if ref[:k] in self.nodes
                        or ref[:k] in self.slot_of
                        or ref[:k] in self.tied_at
                    ),
                    None,
                )
                if prefix is not None and prefix in self.tied_at:
                    # a path through a view: look it up in that view's buffer
                    if prefix in seen:
                        raise _cycle_error([*seen[seen.index(prefix) :], prefix])
                    seen.append(prefix)
                    inner = self.tied_at[prefix]
                    post.append(inner.transform)
                    ref = inner.ref + ref[len(prefix) :]
                    continue
                raise self._missing(at, t, ref, prefix)
            break
        # ``post`` lists transforms outermost first: the value is post[0](post[1](...(x)))
        target = _Target(kind, ref, chain(*reversed(post)))
        self.targets[at] = target
        return target

    def _missing(self, at: Path, t: Tied, ref: Path, prefix: Path | None) -> TieError:
        written = f"ref {path_str(t.ref)!r}"
        if ref != t.ref:
            written += f" (followed through views to {path_str(ref)!r})"
        if prefix is not None and prefix in self.slot_of:
            return TieError(
                f"Tied at {path_str(at)!r}: {written} goes below the leaf "
                f"{path_str(prefix)!r}, which has no children. Fix: refer to "
                f"{path_str(prefix)!r} itself and select with a transform (st.fn)."
            )
        empty = [x for x in _nodes_at(self.placeholder, ref) if not jtu.tree_leaves(x)]
        if empty:
            return TieError(
                f"Tied at {path_str(at)!r}: {written} is {empty[0]!r}, a subtree "
                "with no leaves: there is no value to share. Fix: point the ref at a leaf or "
                "a subtree that holds arrays."
            )
        candidates = [path_str(p) for p in self.nodes if p != at]
        return TieError(
            f"Tied at {path_str(at)!r}: {written} does not exist in the tree; "
            f"{closest(path_str(ref), candidates)}. Fix: point the ref at an existing "
            "leaf or subtree (paths are '/'-joined dict keys, indices and attribute names)."
        )

    # -- resolving, depth first with an explicit stack ---------------------

    def deps(self, at: Path) -> list[Path]:
        """The ``Tied`` positions whose resolution the ``Tied`` at ``at`` needs first."""
        target = self.target(at)
        if target.kind == "tied":
            return [target.path]
        if target.kind == "node":
            n = len(target.path)
            return [p for p in self.tied_at if p[:n] == target.path]
        return []

    def resolve(self, start: Path) -> Any:
        """The template (a ``_Ref`` or a subtree of them) of the ``Tied`` at ``start``."""
        if start in self.memo:
            return self.memo[start]
        stack: list[tuple[Path, Any]] = [(start, iter(self.deps(start)))]
        on_stack = {start: 0}
        while stack:
            at, pending = stack[-1]
            nxt = next((d for d in pending if d not in self.memo), None)
            if nxt is not None:
                if nxt in on_stack:
                    raise _cycle_error([p for p, _ in stack[on_stack[nxt] :]] + [nxt])
                on_stack[nxt] = len(stack)
                stack.append((nxt, iter(self.deps(nxt))))
                continue
            stack.pop()
            del on_stack[at]
            self.memo[at] = self.build(at)
        return self.memo[start]

    def build(self, at: Path) -> Any:
        target = self.target(at)
        if target.kind == "leaf":
            return _Ref(self.slot_of[target.path], target.transform)
        if target.kind == "tied":
            return _compose(self.memo[target.path], target.transform)
        found = _nodes_at(self.placeholder, target.path)
        if len(found) != 1:
            raise TieError(
                f"path {path_str(target.path)!r} is ambiguous: {len(found)} nodes have that "
                "name. Fix: rename one of the keys so that every path names one node."
            )
        n = target.path

        def visit(kp: Any, x: Any) -> Any:
            if isinstance(x, Tied):
                return self.memo[n + keypath_to_path(kp)]
            return _Ref(x.i, identity)

        return _compose(jtu.tree_map_with_path(visit, found[0], is_leaf=is_tied), target.transform)


def _nodes_at(tree: Any, path: Path) -> list[Any]:
    """Every node of ``tree`` whose path is ``path`` (empty ones such as ``None`` included)."""
    n = len(path)

    def stop(kp: Any, _x: Any) -> bool:
        return len(kp) >= n and keypath_to_path(kp[:n]) == path

    flat, _ = jtu.tree_flatten_with_path(tree, is_leaf=stop, is_leaf_takes_path=True)
    return [x for kp, x in flat if len(kp) == n and keypath_to_path(kp) == path]


@functools.lru_cache(maxsize=STRUCTURE_CACHE_SIZE)
def structure_of(treedef: Any) -> Structure:
    """Resolve the sharing graph of a canonical treedef (cached).

    Raises:
        TieError: for a dangling ref, a cycle, a self-reference or a ``Tied`` root.

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> from sharetree._resolve import structure_of
        >>> s = structure_of(jax.tree.structure({"a": np.ones(2), "b": st.Tied("a", st.T)}))
        >>> s.buffer_paths, s.views
        ((('a',),), (ViewLeaf(buffer=0, transform=T, path=('b',), tie=('b',)),))
    """
    n = treedef.num_leaves
    placeholder = jtu.tree_unflatten(treedef, [_Slot(i) for i in range(n)])
    if isinstance(placeholder, Tied):
        raise TieError(
            f"the root of the tree is {placeholder!r}: a tie must sit inside a tree, "
            "next to the buffer it refers to. Fix: call materialize on the enclosing tree."
        )
    res = _Resolver(placeholder)
    buffer_paths: list[Path] = [()] * n
    for path, i in res.slot_of.items():
        buffer_paths[i] = path
    if not res.tied_at:
        leaves = tuple(Leaf(i, None, buffer_paths[i], None) for i in range(n))
        return Structure(treedef, tuple(buffer_paths), {}, treedef, leaves)
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
    spec = [
        Leaf(x.i, None, path, None) if isinstance(x, _Slot) else Leaf(x.i, x.transform, path, x.via)
        for path, x in ((keypath_to_path(kp), x) for kp, x in flat)
    ]
    return Structure(treedef, tuple(buffer_paths), dict(res.tied_at), expanded_treedef, tuple(spec))
