"""``untie`` and ``untie_state``: break ties on purpose, in parameters and optimizer state."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError, error
from sharetree._materialize import BOX_RENAMERS, leaf_view, leaves_and_structure, materialize
from sharetree._paths import (
    Path,
    PathLike,
    check_flattens,
    closest,
    format_aval,
    keypath_to_path,
    leaves_with_paths,
    path_str,
    prefixes,
    to_path,
)
from sharetree._resolve import Structure, ViewLeaf
from sharetree._tied import is_tied
from sharetree._transforms import Transform, identity

__all__ = ["untie", "untie_state"]

_FIX_NOT_A_VIEW = "pass the path of a Tied or of a subtree holding some (buffers are untied)"
_MOVES = "a transform that moves elements (state_view(): transpose, reshape, slice, index)"
_FIX_STATE_VIEW = (
    "untie the tree with st.untie and initialize a fresh optimizer state, untie only views "
    "that move elements, or define state_view() on a transform of your own that only moves them"
)
_FIX_SEVERAL = (
    "untie the tree with st.untie and initialize a fresh optimizer state, or untie only views "
    "of one buffer that move elements"
)
_FIX_FRESH = "initialize a fresh optimizer state for the untied tree"
_FIX_STATE = (
    "pass the canonical tree the state was made for (optimizer.init(tree)), before untying it; "
    f"for a state holding optax.MaskedNode, {_FIX_FRESH}"
)

PyTree = Any


def _renamed(canonical: PyTree, expanded: PyTree, at: set[Path], where: str) -> PyTree:
    """``expanded`` through every registered box renamer; an untied Flax box needs one."""
    meta = sys.modules.get("flax.core.meta")  # a tree holds no Flax boxes unless Flax is loaded
    if meta is not None and not BOX_RENAMERS:
        is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
        for path, x in leaves_with_paths(expanded, is_box):
            if is_box(x) and any(p in at for p in prefixes(path)):
                view = f"{where}: the untied view {path_str(path)!r}"
                problem = "copies a Flax partition box, whose axis names need sharetree.flax"
                raise error("E82", view, problem, fix=f"import it before calling {where}")
    leaves, structure = leaves_and_structure(canonical)
    for rename in BOX_RENAMERS:
        expanded = rename(structure, leaves, expanded, where)
    return expanded


def _selected(structure: Structure, paths: PathLike | Iterable[PathLike] | None) -> set[Path]:
    """The ``Tied`` positions at or under ``paths`` (all of them for ``None``)."""
    ties = list(structure.ties)
    if paths is None:
        return set(ties)
    chosen: set[Path] = set()
    one = isinstance(paths, (str, tuple)) or not isinstance(paths, Iterable)
    for given in [paths] if one else paths:
        p = to_path(given, "untie path")
        under = [q for q in ties if q[: len(p)] == p]
        if not under:
            inside = next((q for q in prefixes(p) if q in structure.ties), None)
            if inside is not None:
                view = f"lies inside the view {path_str(inside)!r} ({structure.ties[inside]!r})"
                fix = f"untie {path_str(inside)!r}, then tie the parts you want shared again"
                raise error("E24b", f"untie: {path_str(p)!r}", view, fix=fix)
            names = [path_str(q) for q in ties]
            hint = closest(path_str(p), names) if ties else "the tree has no ties at all"
            problem = f"is not a view and has no view under it; {hint}"
            raise error("E24", f"untie: {path_str(p)!r}", problem, fix=_FIX_NOT_A_VIEW)
        chosen.update(under)
    return chosen


def _untie_positions(tree: PyTree, at: set[Path], where: str, values: PyTree = None) -> PyTree:
    """``tree`` with the positions ``at`` replaced by their ``values`` (default: materialized)."""
    buffers = {id(x) for x in jtu.tree_leaves(tree) if isinstance(x, (np.ndarray, jax.Array))}
    # an identity view is the buffer object itself: copy it, so that no two
    # positions hold one array (donation, in-place NumPy updates)
    copy = lambda x: x.copy() if id(x) in buffers else x  # noqa: E731

    def replace(kp: Any, x: Any, value: Any) -> Any:
        return jtu.tree_map(copy, value) if keypath_to_path(kp) in at else x

    # the tree, with its ties as leaves, is a prefix of the materialized tree
    values = materialize(tree) if values is None else values
    values = _renamed(tree, values, at, where)
    return jtu.tree_map_with_path(replace, tree, values, is_leaf=is_tied)


def untie(tree: PyTree, paths: PathLike | Iterable[PathLike] | None = None) -> PyTree:
    """Replace ``Tied`` nodes by independent copies of their materialized values.

    ``paths``: ``None`` (every tie), one path (a str or a tuple of keys) or a list
    of paths, each a ``Tied`` position or a subtree holding some. ``st.tie`` with
    the same ``Tied`` nodes is the inverse; :func:`untie_state` carries an
    optimizer state over.

    Raises:
        TieError: a path that is neither a ``Tied`` nor above one, a path
            inside a subtree view, or a bad graph.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"enc": np.arange(6.0).reshape(2, 3), "dec": st.Tied("enc", st.T)}
        >>> untied = st.untie(tree, "dec")
        >>> untied["dec"].shape, st.canonicalize(untied).num_views
        ((3, 2), 0)
        >>> st.tie(untied, {"dec": tree["dec"]})["dec"]
        Tied('enc', T)
    """
    chosen = _selected(leaves_and_structure(tree)[1], paths)
    return _untie_positions(tree, chosen, "untie") if chosen else tree


def _move_state(t: Transform, state: Any) -> Any:
    """A per-element state of a buffer moved to ``t``'s view (views not untied: kept as is)."""
    move = t.state_view()
    return state if move is None else move(state)


def _moved_state(structure: Structure, state: list[Any]) -> list[Any]:
    """Each materialized leaf's state: its buffer's, moved through its view's ``state_view``.

    A view computed from several buffers (a join) has no state to move: its leaf is ``0``,
    never used (``untie_state`` refuses to untie it, E25, and keeps the ``Tied`` otherwise).
    """
    n = len(structure.buffer_paths)
    out = []
    for k, leaf in enumerate(structure.expanded):
        if leaf.buffer >= n:
            out.append(0)
        elif leaf.transform is None or leaf.transform is identity:
            out.append(state[leaf.buffer])
        else:
            out.append(leaf_view(structure, k, leaf.transform, state[leaf.buffer], _move_state))
    return out


def _no_state_view(structure: Structure, leaf: ViewLeaf) -> TieError:
    """E25: the moments of an untied view cannot be derived from its buffer's."""
    where = f"untie_state: the view {path_str(leaf.path)!r}"
    n = len(structure.buffer_paths)
    if leaf.buffer < n:
        problem = f"is {leaf.transform!r} of {path_str(structure.buffer_paths[leaf.buffer])!r}"
        return error("E25", where, problem, expected=_MOVES, fix=_FIX_STATE_VIEW)
    join = structure.joins[leaf.buffer - n]
    parents = [repr(path_str(structure.buffer_paths[b])) for b in structure.parents[leaf.buffer]]
    several = f"{join.transform!r} of several positions ({', '.join(parents)})"
    if join.path == leaf.path:
        problem = f"is {several}"
    else:
        through = "" if leaf.transform is identity else f" through {leaf.transform!r}"
        problem = f"reads the view {path_str(join.path)!r}{through}, {several}"
    problem += ": its moments cannot be derived from theirs (the view is not elementwise)"
    want = "a view of one buffer through a transform that moves elements"
    return error("E25", where, problem, expected=want, fix=_FIX_SEVERAL)


def _top(x: Any) -> Any:
    """``x``'s structure one level deep if its children are named (a plain tuple: ``None``)."""
    children, treedef = jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    named = any(kp and not isinstance(kp[0], jtu.SequenceKey) for kp, _ in children)
    return treedef if named else None


def _first_difference(part: Any, tree: PyTree) -> str:
    """Describe the first position (flatten order) where ``part`` and ``tree`` differ."""

    def entries(t: Any) -> list[tuple[Path, str]]:
        return [
            (p, repr(x) if is_tied(x) else f"a leaf ({format_aval(x)})")
            for p, x in leaves_with_paths(t, is_tied)
        ]

    pairs = itertools.zip_longest(entries(part), entries(tree), fillvalue=(None, "nothing"))
    for (pa, sa), (pb, sb) in pairs:
        if pa == pb and (sa == sb or not (sa.startswith("Tied") or sb.startswith("Tied"))):
            continue
        first = min(p for p in (pa, pb) if p is not None)
        return (
            f"at {path_str(first)!r} the tree has {sb if first == pb else 'nothing'}, "
            f"the state has {sa if first == pa else 'nothing'}"
        )
    return "the node types differ below the top level"


def untie_state(
    opt_state: PyTree, tree: PyTree, paths: PathLike | Iterable[PathLike] | None = None
) -> PyTree:
    """The optimizer state for ``st.untie(tree, paths)``, made from ``opt_state`` for ``tree``.

    Each part of the state shaped like ``tree`` (Adam's ``mu`` and ``nu``) is
    untied like it: a new buffer starts from its buffer's moments moved by the
    transform's :meth:`~sharetree.Transform.state_view` (transposed for ``T``;
    a TieError where there is none, as for ``scale``, and for a view of several
    positions or of one, whose moments no elementwise rule derives from its
    buffers'). Other parts (``count``) are kept. Pass the tree *before* untying.

    Example:
        >>> import jax.numpy as jnp, optax, sharetree as st
        >>> params = {"enc": jnp.ones((2, 3)), "dec": st.Tied("enc", st.T)}
        >>> state = optax.adam(1e-3).init(params)
        >>> new_state = st.untie_state(state, params)
        >>> new_state[0].mu["dec"].shape, new_state[0].count
        ((3, 2), Array(0, dtype=int32))
    """
    leaves, structure = leaves_and_structure(tree)
    at = _selected(structure, paths)
    if not at:
        return opt_state
    n = len(structure.buffer_paths)
    for leaf in structure.views:
        if leaf.tie in at and (leaf.buffer >= n or leaf.transform.state_view() is None):
            raise _no_state_view(structure, leaf)
    treedef, top = structure.treedef, _top(tree)

    def params_like(x: Any) -> bool:
        x_top = None if top is None else _top(x)  # (a treedef does not compare with None)
        return jtu.tree_structure(x) == treedef or (x_top is not None and x_top == top)

    def visit(kp: Any, x: Any) -> Any:
        if not params_like(x):
            return x
        where = jtu.keystr(tuple(kp), simple=True, separator="/") or "<root>"
        if jtu.tree_structure(x) != treedef:
            found = f"the tree's top-level keys but not its structure: {_first_difference(x, tree)}"
            where = f"untie_state: the part {where!r} of the optimizer state"
            raise error("E26", where, "was made for another tree", found=found, fix=_FIX_STATE)
        for path, b, y in zip(structure.buffer_paths, leaves, jtu.tree_leaves(x), strict=True):
            if np.shape(y) != np.shape(b):
                found = f"shape {np.shape(y)} at {path_str(path)!r}"
                want = f"the buffer's shape {np.shape(b)} (an elementwise state, e.g. Adam's mu)"
                part = f"untie_state: the part {where!r} of the optimizer state"
                raise error("E26", part, expected=want, found=found, fix=_FIX_FRESH)
        moved = _moved_state(structure, jtu.tree_leaves(x))
        moved_tree = jtu.tree_unflatten(structure.expanded_treedef, moved)
        return _untie_positions(x, at, "untie_state", moved_tree)

    check_flattens(opt_state)  # too deep, or unsortable dict keys: before a flatten with a callback
    out = jtu.tree_map_with_path(visit, opt_state, is_leaf=params_like)
    found = jtu.tree_leaves(opt_state, is_leaf=params_like)
    if not any(map(params_like, found)):  # nothing to untie: a state for another tree?
        _check_some_part(found, leaves, at)
    return out


def _check_some_part(found: list[Any], leaves: list[Any], at: set[Path]) -> None:
    """E326: a state with buffer-shaped arrays but no part shaped like the tree (silent else)."""
    shapes = {np.shape(b) for b in leaves if np.ndim(b) > 0}
    like = [x for x in found if np.ndim(x) > 0 and np.shape(x) in shapes]
    if like:
        views = ", ".join(repr(path_str(p)) for p in sorted(at)[:4])
        problem = "has no part shaped like the tree, so the views would get no state"
        found_ = f"{len(like)} array(s) of the buffers' shapes in parts of another structure"
        fix = (
            "make the state from the tree with its Tied nodes (optimizer.init(tree)): ties add "
            "no leaves, so put the views in the tree before training and the state fits it"
        )
        raise error("E326", f"untie_state of {views}", problem, found=found_, fix=fix)
