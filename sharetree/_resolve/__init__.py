"""Resolving ties: a canonical treedef becomes a :class:`Structure`, cached per treedef.

``records`` holds what it resolves to (buffers, views, joins); ``refs`` the positions in a
tree (the nodes at a path, the ref that reads a path); ``resolver`` the lookup of every
``Tied``'s refs, its cycles and errors, and :func:`structure_of`.
"""

from sharetree._resolve.records import Input, Join, Leaf, Structure, ViewLeaf
from sharetree._resolve.refs import nodes_at, ref_to, skeleton, treedef_nodes, written
from sharetree._resolve.resolver import STRUCTURE_CACHE_SIZE, structure_of

__all__ = [
    "Input",
    "Join",
    "Leaf",
    "ViewLeaf",
    "Structure",
    "structure_of",
    "nodes_at",
    "ref_to",
    "skeleton",
    "treedef_nodes",
    "written",
    "STRUCTURE_CACHE_SIZE",
]
