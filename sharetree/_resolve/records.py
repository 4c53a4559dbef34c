"""What a canonical treedef resolves to: its buffers, its views and the joins of several."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from sharetree._paths import Path
from sharetree._tied import Tied
from sharetree._transforms import Transform

__all__ = ["Input", "Join", "Leaf", "Structure", "ViewLeaf"]


class Leaf(NamedTuple):
    """One leaf of the materialized tree, as the resolver sees it."""

    buffer: int  # the source it is computed from: a buffer (canonical leaf) i, or join n + j
    transform: Transform | None  # None at the buffer's own position, else the composed one
    path: Path  # its path in the materialized tree
    tie: Path | None  # the path of the Tied that produced it (None for a buffer)


class ViewLeaf(NamedTuple):
    """A materialized leaf that is a view: :class:`Leaf` with ``transform`` and ``tie`` set."""

    buffer: int
    transform: Transform
    path: Path
    tie: Path


class Input(NamedTuple):
    """One input of a :class:`Join`: ``transform(source)``, a buffer i or a join n + j."""

    source: int
    transform: Transform


class Join(NamedTuple):
    """A value computed from several: ``transform({name: input's value})``, once per call.

    A view of several positions (``Tied({name: ref}, transform)``) is one join per leaf
    of the value it computes; a join's inputs are buffers and earlier joins.
    """

    transform: Transform  # takes several inputs (a chain of it and one-value transforms)
    inputs: tuple[tuple[str, Input], ...]  # by name, sorted
    tie: Path  # the Tied of several refs that computes it
    path: Path  # its leaf of the materialized tree (below ``tie`` for a subtree)


@dataclasses.dataclass(frozen=True, eq=False)  # one object per treedef: identity is equality
class Structure:
    """What a canonical treedef resolves to (cached per treedef by :func:`structure_of`).

    A *source* is a buffer ``i < len(buffer_paths)`` or the join ``joins[i - n]``; each
    materialized leaf is ``transform(source)``.
    """

    treedef: Any  # the canonical tree's structure
    buffer_paths: tuple[Path, ...]  # the path of each canonical leaf (buffer), in flatten order
    ties: dict[Path, Tied]  # each Tied position and the Tied written there, in flatten order
    expanded_treedef: Any  # the materialized tree's structure
    expanded: tuple[Leaf, ...]  # one Leaf per materialized leaf, in flatten order
    joins: tuple[Join, ...] = ()  # the values computed from several, inputs before users
    reads: dict[Path, dict[str | None, Path]] = dataclasses.field(default_factory=dict)
    """For each Tied, the path from the root each of its refs reads (by input name, ``None``
    for one ref), as scoped or climbed, before following views."""

    @functools.cached_property
    def views(self) -> tuple[ViewLeaf, ...]:
        """The materialized leaves that are views (``transform`` is not ``None``)."""
        return tuple(ViewLeaf._make(leaf) for leaf in self.expanded if leaf.transform is not None)

    @functools.cached_property
    def parents(self) -> tuple[tuple[int, ...], ...]:
        """For each source, the buffers it reads (sorted): ``(i,)`` for a buffer."""
        n = len(self.buffer_paths)
        out: list[tuple[int, ...]] = [(i,) for i in range(n)]
        for join in self.joins:
            out.append(tuple(sorted({b for _, x in join.inputs for b in out[x.source]})))
        return tuple(out)

    def source_path(self, i: int) -> Path:
        """Where source ``i`` is: its buffer's path, or its join's materialized leaf."""
        n = len(self.buffer_paths)
        return self.buffer_paths[i] if i < n else self.joins[i - n].path
