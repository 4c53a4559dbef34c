"""Positions in a tree: the nodes at a path, the ref that reads a path, a treedef's nodes."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import jax.tree_util as jtu

from sharetree._paths import Path, Ref, key_str, keypath_to_path, ref_str
from sharetree._tied import Tied

__all__ = ["nodes_at", "overlaps", "ref_to", "skeleton", "treedef_nodes", "written"]


def ref_to(buffer: Path, target: Path, nodes: Collection[Path]) -> Ref:
    """The ref to write at ``target`` that reads ``buffer`` (a path from the root).

    The path from the root, unless a subtree holding ``target`` has the same path; then
    the shortest scoped ref that no other scope has, nearer or further out; else the ref
    that climbs from ``target`` to the subtree holding both (``"../w"``), which reads
    exactly there. ``nodes``: ``node_paths`` of the tree's leaf and ``Tied`` positions.

    Example:
        >>> from sharetree._paths import node_paths
        >>> from sharetree._resolve import ref_to
        >>> nodes = node_paths([("w",), ("sub", "w"), ("sub", "v")])
        >>> ref_to(("w",), ("m", "v"), nodes).keys, ref_to(("sub", "w"), ("sub", "v"), nodes).keys
        (('w',), ('sub', 'w'))
        >>> ref_to(("x", "w"), ("x", "y", "v"), node_paths([("x", "w"), ("x", "y", "x", "w")]))
        Ref(keys=('w',), up=None)
        >>> ref_to(("0",), ("1", "1"), node_paths([("0",), ("1", "0"), ("1", "1")]))
        Ref(keys=('0',), up=1)
    """
    common = 0  # keys shared by buffer and target, below which a scope can hold both
    while common < min(len(target), len(buffer)) - 1 and target[common] == buffer[common]:
        common += 1
    for j in range(common + 1):  # from the root form (as written by hand) to the shortest
        ref = buffer[j:]
        others = (target[:k] + ref for k in range(len(target) - 1, -1, -1) if k != j)
        if not any(p in nodes and not overlaps(p, target) for p in others):
            return Ref(ref, None)
    return Ref(buffer[common:], len(target) - 1 - common)


def written(ref: Tied | Ref) -> str:
    """A ref as its user spells it (``'../0'``, ``'enc/w'``, a tuple's repr); a ``Tied``'s one."""
    return key_str(ref_str(Ref(ref.ref, ref.up) if isinstance(ref, Tied) else ref))


def overlaps(a: Path, b: Path) -> bool:
    """Whether one of two paths is a prefix of the other (the same node or one inside)."""
    return a[: len(b)] == b or b[: len(a)] == a


def nodes_at(tree: Any, path: Path) -> list[Any]:
    """Every node of ``tree`` whose path is ``path`` (empty ones such as ``None`` included)."""
    n = len(path)

    def stop(kp: Any, _x: Any) -> bool:
        return len(kp) >= n and keypath_to_path(kp[:n]) == path

    flat, _ = jtu.tree_flatten_with_path(tree, is_leaf=stop, is_leaf_takes_path=True)
    return [x for kp, x in flat if len(kp) == n and keypath_to_path(kp) == path]


def treedef_nodes(treedef: Any) -> Iterator[Any]:
    """Every node of ``treedef`` in one fixed order, without recursion (deep trees are fine).

    Each is a PyTreeDef (``node_data`` and ``children`` are untyped in jaxlib).
    """
    nodes: list[Any] = [treedef]
    while nodes:
        node = nodes.pop()
        yield node
        nodes += node.children()


def skeleton(treedef: Any) -> Any:
    """The tree of ``treedef`` with ``0`` at every leaf (its nodes, aux data and key paths)."""
    return jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
