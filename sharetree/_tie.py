"""``tie``: put ``Tied`` nodes into an existing tree, checking shapes."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import jax
import jax.tree_util as jtu

from sharetree._compare import (
    LEAVE_ATOL_OUT,
    Copies,
    arraylike,
    bit_equal,
    check_atol,
    check_copies,
    concrete,
    describe,
    kind,
    kinds_differ,
)
from sharetree._errors import TieError, check_bool, check_mapping, error, short
from sharetree._grad_by_use import join_view
from sharetree._materialize import (
    abstract_expanded,
    expanded_by_path,
    leaves_and_structure,
    transform_error,
)
from sharetree._paths import (
    Path,
    Ref,
    TieMap,
    aval_of,
    closest,
    keypath_to_path,
    leaves_with_paths,
    nnx_variable,
    node_paths,
    path_str,
    prefixes,
    to_path,
)
from sharetree._resolve import (
    Leaf,
    Structure,
    nodes_at,
    ref_to,
    skeleton,
    structure_of,
    treedef_nodes,
    written,
)
from sharetree._tied import Tied, is_tied
from sharetree._transforms import chain, identity

__all__ = ["tie", "tie_entries", "bit_equal", "check_atol"]  # the last two: from _compare


def _shape_of(positions: Mapping[Path, Any]) -> str:
    if not positions:
        return "empty (no leaves, e.g. None)"
    if set(positions) == {()}:
        return "a leaf"
    return "a subtree with leaves " + ", ".join(repr(path_str(p)) for p in sorted(positions))


def tie(
    tree: Any,
    ties: TieMap,
    *,
    check: bool = True,
    atol: float | None = None,
) -> Any:
    """Replace the leaf or subtree at each target path with a ``Tied``; the ref's value wins.

    Args:
        tree: a pytree (``Tied`` nodes allowed).
        ties: ``{target: ref}`` or ``{target: Tied(ref, transform)}``; paths are
            ``"a/b/0"`` strings or tuples of keys.
        check: require each view to have the shape and dtype (and, for a
            subtree, the structure) of the value it replaces.
        atol: ``None``: drop the replaced values unseen. A number: require
            ``|replaced value - view| <= atol`` elementwise (``0.0``: equal values;
            ``-0.0`` equals ``0.0``, NaN equals NaN).

    Raises:
        TieError: a missing target, overlapping targets, a bad graph, a
            mismatch (with ``check``), or copies that differ beyond ``atol``.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"enc": {"w": np.ones((2, 3))}, "dec": {"w": np.zeros((3, 2))}}
        >>> st.tie(tree, {"dec/w": st.Tied("enc/w", st.T)})["dec"]
        {'w': Tied('enc/w', T)}
    """
    check_mapping(ties, "E140", "tie: ties", "a mapping {target: ref}", _EXAMPLE)
    check = check_bool(check, "E55", "tie(check=...)")
    if atol is not None:
        atol = check_atol(atol, "tie")
    new = tie_entries(ties)
    for b in new:
        if (a := _under(b[:-1], new)) is not None:
            where = f"tie targets {path_str(a)!r} and {path_str(b)!r}"
            raise error("E6", where, "overlap", fix=f"keep only {path_str(a)!r}")

    seen: set[Path] = set()  # every node looked at; a target stops the walk where it is
    modules: set[Path] = set()  # NNX modules (graph mode): their Variables keep their kind
    variables: dict[Path, str] = {}  # targets that are Variables of a module: their kinds

    def stop(kp: Any, x: Any) -> bool:
        seen.add(path := keypath_to_path(kp))
        if nnx_variable(x, "Module") is not None:
            modules.add(path)
        kind_ = nnx_variable(x) if path in new else None
        if kind_ is not None and any(p in modules for p in [(), *prefixes(path)]):
            variables[path] = kind_
        return path in new

    new = _from_the_root(tree, new)  # checks first that the tree flattens
    out = jtu.tree_map_with_path(
        lambda kp, x: new.get(keypath_to_path(kp), x), tree, is_leaf=stop, is_leaf_takes_path=True
    )
    if missing := [path_str(p) for p in new if p not in seen]:
        hint = closest(missing[0], {path_str(p) for p in seen if p})
        gone = f"does not exist in the tree; {hint}"
        raise error("E5", f"tie target {missing[0]!r}", gone, fix=_MISSING)
    if variables:
        raise _variable_target(variables, new)
    structure_of(jtu.tree_structure(out))  # dangling refs, cycles, self-references
    if check:
        _check(tree, out, new)
    if atol is not None:
        _check_values(tree, out, new, atol)
    return out


def _variable_target(variables: dict[Path, str], new: dict[Path, Tied]) -> TieError:
    """E320: targets that are NNX Variables, which a bare ``Tied`` would replace."""
    target, kind_ = next(iter(variables.items()))
    plain = lambda t: t.inputs is None and t.transform == identity  # noqa: E731
    ties = {path_str(p): written(t) if plain(t := new[p]) else t for p in variables}
    values = {f"{t}/value": f"{r}/value" for t, r in ties.items() if isinstance(r, str)}
    problem = f"is an NNX {kind_}: a bare Tied in its place would drop its kind and metadata"
    fix = f"sharetree.nnx.tie(model, {ties!r}) keeps each Variable and ties its value"
    fix += f" (st.tie of the values, {values!r}, does the same)" if values else ""
    fix += "; for an nnx.State, sharetree.nnx.split(model, ties=...)"
    return error("E320", f"tie target {path_str(target)!r}", problem, fix=fix)


def _from_the_root(tree: Any, new: dict[Path, Tied]) -> dict[Path, Tied]:
    """Each ref naming a node from the root, written by ``ref_to`` so that it names it.

    A ref the root lacks, one naming a node that holds the target, or one that climbs
    (``"../w"``, exact already) is kept.
    """
    nodes = node_paths(p for p, _ in leaves_with_paths(tree, is_leaf=is_tied))

    def written(target: Path, ref: Ref) -> Ref:
        from_root = ref.up is None and ref.keys in nodes and target[: len(ref.keys)] != ref.keys
        return ref_to(ref.keys, target, nodes) if from_root else ref

    out = {}
    for target, t in new.items():  # a view of several positions: each of its refs
        refs = {name: written(target, ref) for name, ref in t.refs}
        out[target] = t if refs == dict(t.refs) else t.with_refs(refs)
    return out


def tie_entries(ties: Mapping[Any, Any]) -> dict[Path, Tied]:
    """``{target: ref or Tied}`` as ``{target path: Tied}``; a TieError for two spellings of one."""
    new: dict[Path, Tied] = {}
    for target, ref in ties.items():
        path = to_path(target, "tie target")
        if path in new:
            first = next(k for k in ties if to_path(k) == path)
            same = f"name the same path {path_str(path)!r}"
            raise error("E6b", f"tie targets {first!r} and {target!r}", same, fix="keep one entry")
        new[path] = ref if isinstance(ref, Tied) else Tied(ref)
    return new


_EXAMPLE = 'pass e.g. {"dec/w": st.Tied("enc/w", st.T)}'
_MISSING = "write the path as key paths name it ('/'-joined); for a tensor that a checkpoint "
_MISSING += "omits, st.load(path, ties={target: ref})"
_STRUCTURE = (
    "refer to a subtree of the same structure (containers, None leaves), or tie leaf by leaf"
)

_CONTAINERS = (dict, list, tuple, type(None), collections.OrderedDict, collections.defaultdict)


def _node_types(subtree: Any) -> list[tuple[type | None, int]]:
    """The containers of ``subtree`` in one order: dict, list, tuple, None; other nodes as one.

    Another node type is no mismatch: a Flax box or an NNX Variable of another kind is
    rebuilt with the target's own (a ``BatchStat`` tied to a ``Param``).
    """
    out = []
    for node in treedef_nodes(jtu.tree_structure(subtree)):
        data = node.node_data()
        container = None if data is None else data[0] if data[0] in _CONTAINERS else object
        out.append((container, node.num_nodes))
    return out


def _check(old_tree: Any, new_tree: Any, new: dict[Path, Tied]) -> None:
    old, now = abstract_expanded(old_tree), abstract_expanded(new_tree)
    skeletons = [
        skeleton(leaves_and_structure(x)[1].expanded_treedef) for x in (old_tree, new_tree)
    ]
    for target, t in new.items():
        n = len(target)
        before = {p[n:]: v for p, v in old.items() if p[:n] == target}
        after = {p[n:]: v for p, v in now.items() if p[:n] == target}
        if shown := _structures_differ(before, after, [nodes_at(x, target) for x in skeletons]):
            where = f"tie {path_str(target)!r} <- {t!r}"
            problem = f"gives a view whose structure differs: {shown}"
            raise error("E8", where, problem, fix=_STRUCTURE)
        for rel, b in before.items():
            if kind(a := after[rel]) != kind(b):
                c = Copies(f"tie {path_str(target + rel)!r} <- {t!r}", path_str(target + rel), "")
                raise kinds_differ(c, describe(a), describe(b), "pass check=False")


def _structures_differ(before: Mapping, after: Mapping, nodes: list[Any]) -> str:
    """How the view's structure differs from the target's, or ``""``.

    ``before``, ``after``: their leaves by path; ``nodes``: ``nodes_at`` the target in the
    skeletons of the tree and of the tied tree.
    """
    if before.keys() != after.keys():
        return f"the view is {_shape_of(after)}, the target is {_shape_of(before)}"
    was, view = (found[0] for found in nodes)
    if _node_types(was) == _node_types(view):  # other containers: a list for a dict, a None
        return ""
    shown = [short(jtu.tree_structure(x), 200) for x in (view, was)]
    return f"the view is {shown[0]}, the target is {shown[1]}"


def _under(path: Path, targets: Mapping[Path, Tied]) -> Path | None:
    return next((p for p in prefixes(path) if p in targets), None)


def _old_values(old_tree: Any, new: dict[Path, Tied]) -> dict[Path, Any]:
    """The values the ties replace, by path (materialized only if some of them are views)."""
    under = {p: x for p, x in leaves_with_paths(old_tree, is_tied) if _under(p, new) is not None}
    if any(is_tied(x) for x in under.values()):
        with jax.enable_x64(True):  # keep float64 checkpoints in float64 while comparing
            return expanded_by_path(old_tree)
    return under


def _check_values(old_tree: Any, new_tree: Any, new: dict[Path, Tied], atol: float) -> None:
    old = _old_values(old_tree, new)
    leaves, structure = leaves_and_structure(new_tree)
    n = len(structure.buffer_paths)
    for leaf in structure.expanded:
        target = _under(leaf.path, new)
        if target is None:
            continue
        where, before = path_str(leaf.path), old.get(leaf.path)
        if leaf.buffer >= n:  # computed from several buffers: compare the whole view's value
            c = _join_copies(structure, leaf, f"tie {where!r} <- {new[target]!r}")
            bufs = {b: leaves[b] for b in structure.parents[leaf.buffer]}
            for b, x in bufs.items():  # no values: say so before computing
                if isinstance(x, jax.ShapeDtypeStruct):
                    buffer = path_str(structure.buffer_paths[b])
                    concrete(x, f"{c.where}: the buffer {buffer!r}", LEAVE_ATOL_OUT)
            with jax.enable_x64(True):  # keep float64 checkpoints in float64 while comparing
                x = join_view(structure, leaf.buffer, leaf.transform or identity, bufs)
            check_copies(c, before, x, atol)
            continue
        buffer = path_str(structure.buffer_paths[leaf.buffer])
        x, t = leaves[leaf.buffer], leaf.transform or identity
        c = Copies(f"tie {where!r} <- {new[target]!r}", where, buffer, t)
        if arraylike(x) and arraylike(before):
            if isinstance(x, jax.ShapeDtypeStruct):  # no values: say so before computing
                concrete(x, f"{c.where}: the buffer {buffer!r}", LEAVE_ATOL_OUT)
            with jax.enable_x64(True):  # keep float64 checkpoints in float64 while comparing
                try:
                    x = t(x)  # identity(x) is x itself
                except Exception as e:
                    raise transform_error(structure, leaf, aval_of(x), e) from e
        check_copies(c, before, x, atol)


def _join_copies(structure: Structure, leaf: Leaf, where: str) -> Copies:
    """The two copies of a view computed from several buffers: their paths and the transform."""
    join = structure.joins[leaf.buffer - len(structure.buffer_paths)]
    buffers = tuple(path_str(structure.buffer_paths[b]) for b in structure.parents[leaf.buffer])
    t = chain(join.transform, leaf.transform or identity)
    return Copies(where, path_str(leaf.path), buffers, t)
