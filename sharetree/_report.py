"""The sharing graph of a tree: :class:`SharingGraph`, :class:`Buffer`, :class:`View`."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from sharetree._materialize import (
    check_view_value,
    join_error,
    leaf_aval,
    leaves_and_structure,
    transform_error,
)
from sharetree._paths import aval_nbytes, format_aval, path_key, plural
from sharetree._resolve import Leaf, Structure, ViewLeaf
from sharetree._tied import DISPLAY, Tied
from sharetree._transforms import Transform, identity, is_described

__all__ = ["SharingGraph", "Buffer", "View", "ViewInput", "canonicalize"]


class _Shaped:
    """The ``aval`` of a record with ``shape`` and ``dtype`` fields."""

    shape: tuple[int, ...] | None
    dtype: np.dtype | None

    @property
    def aval(self) -> jax.ShapeDtypeStruct | None:
        """Shape and dtype (``None`` for a leaf that is not an array)."""
        return None if self.shape is None else jax.ShapeDtypeStruct(self.shape, self.dtype)


def _shape_fields(a: jax.ShapeDtypeStruct | None) -> tuple[Any, Any, int]:
    """``shape, dtype, nbytes`` of a record (``None, None, 0`` for a leaf that is not an array)."""
    return (None, None, 0) if a is None else (tuple(a.shape), a.dtype, aval_nbytes(a))


@dataclasses.dataclass(frozen=True)
class Buffer(_Shaped):
    """A leaf stored once: its path, shape, dtype, bytes and how many views use it."""

    path: str | tuple[str, ...]  # as every result's key: path_key
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    nbytes: int
    num_views: int

    def __repr__(self) -> str:
        return f"Buffer({self.path!r}, {format_aval(self.aval)}, views={self.num_views})"


@dataclasses.dataclass(frozen=True)
class ViewInput:
    """One input of a view of several positions: ``transform(value at source)``."""

    source: str | tuple[str, ...]  # a buffer's path, or a view of several positions'
    transform: Transform


@dataclasses.dataclass(frozen=True)
class View(_Shaped):
    """A position whose value is ``transform(buffer)``; ``tie`` is the ``Tied`` that made it.

    A view of several positions (``Tied({name: ref}, transform)``) has ``inputs``, each
    input's source and transform, and is its own ``buffer``; a view of it has that view
    as its ``buffer``. ``buffers`` lists every buffer a view reads.
    """

    path: str | tuple[str, ...]  # paths as every result's key: path_key
    buffer: str | tuple[str, ...]
    transform: Transform
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    nbytes: int
    tie: str | tuple[str, ...]
    inputs: dict[str, ViewInput] = dataclasses.field(default_factory=dict)
    buffers: tuple[str | tuple[str, ...], ...] = ()

    def __repr__(self) -> str:
        source = repr(self.buffer)
        if self.inputs:
            named = ", ".join(
                f"{n}: {x.source!r}" + ("" if x.transform == identity else f" >> {x.transform!r}")
                for n, x in self.inputs.items()
            )
            source = f"{{{named}}}"
        return f"View({self.path!r} <- {source}, {self.transform!r}, {format_aval(self.aval)})"


class SharingGraph:
    """The resolved sharing DAG of a canonical tree, built by :func:`canonicalize`.

    Counts are over leaves (``num_*``), parameters (``size_*``) and bytes
    (``nbytes_*``); "unique" counts each buffer once, "expanded" every position
    of the materialized tree.

    Example:
        >>> import numpy as np, sharetree as st
        >>> g = st.canonicalize({"a": np.zeros((2, 3), np.float32), "b": st.Tied("a", st.T)})
        >>> g.num_unique, g.num_expanded, g.nbytes_unique, g.nbytes_expanded
        (1, 2, 24, 48)
        >>> g.views["b"]
        View('b' <- 'a', T, float32[3, 2])
    """

    def __init__(self, structure: Structure, leaves: list[Any]) -> None:
        self.structure = structure
        self._leaves = leaves

    @property
    def num_unique(self) -> int:
        """Number of buffers (leaves of the canonical tree)."""
        return len(self.structure.buffer_paths)

    @property
    def num_expanded(self) -> int:
        """Number of leaves of the materialized tree (buffers plus views)."""
        return len(self.structure.expanded)

    @property
    def num_views(self) -> int:
        """Number of materialized leaves that are views."""
        return len(self.structure.views)

    @functools.cached_property
    def _avals(self) -> list[jax.ShapeDtypeStruct | None]:
        return [leaf_aval(x) for x in self._leaves]

    @functools.cached_property
    def _source_avals(self) -> list[jax.ShapeDtypeStruct | None]:
        """The shape and dtype of every source: the buffers, then each join."""
        out = list(self._avals)
        for j, join in enumerate(self.structure.joins):
            leaf = Leaf(0, None, join.path, join.tie)
            inputs = {
                n: _abstract(self.structure, Leaf(x.source, x.transform, *leaf[2:]), out[x.source])
                for n, x in join.inputs
            }
            if any(a is None for a in inputs.values()) or is_described(join.transform):
                out.append(None)
                continue
            try:
                out.append(check_view_value(join.transform.abstract(inputs), join.transform))  # type: ignore[arg-type]
            except Exception as e:
                raise join_error(self.structure, j, inputs, e) from e
        return out

    @functools.cached_property
    def _view_avals(self) -> list[jax.ShapeDtypeStruct | None]:
        avals = self._source_avals
        return [_abstract(self.structure, v, avals[v.buffer]) for v in self.structure.views]

    @functools.cached_property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every buffer in flatten order (``num_views``: the views that read it)."""
        parents = self.structure.parents
        uses = collections.Counter(b for view in self.structure.views for b in parents[view.buffer])
        return tuple(
            Buffer(path_key(p), *_shape_fields(a), uses[i])
            for i, (p, a) in enumerate(zip(self.structure.buffer_paths, self._avals))
        )

    @functools.cached_property
    def views(self) -> dict[str | tuple[str, ...], View]:
        """Every view: materialized path -> :class:`View` (buffer path, composed transform)."""
        out = {}
        st, n = self.structure, len(self.structure.buffer_paths)
        for v, a in zip(st.views, self._view_avals):
            path, buffer = path_key(v.path), path_key(st.source_path(v.buffer))
            inputs, t = {}, v.transform
            if v.buffer >= n and st.joins[v.buffer - n].path == v.path:  # the join itself
                t = st.joins[v.buffer - n].transform
                inputs = {
                    name: ViewInput(path_key(st.source_path(x.source)), x.transform)
                    for name, x in st.joins[v.buffer - n].inputs
                }
            buffers = tuple(path_key(st.buffer_paths[b]) for b in st.parents[v.buffer])
            shape = _shape_fields(a)
            out[path] = View(path, buffer, t, *shape, path_key(v.tie), inputs, buffers)
        return out

    @property
    def ties(self) -> dict[str | tuple[str, ...], Tied]:
        """The ``Tied`` nodes as written in the canonical tree, by path."""
        return {path_key(p): t for p, t in self.structure.ties.items()}

    @property
    def size_unique(self) -> int:
        """Number of array elements (parameters) over the buffers."""
        return sum(math.prod(a.shape) for a in self._avals if a is not None)

    @property
    def size_expanded(self) -> int:
        """Number of array elements over the materialized tree."""
        return self.size_unique + sum(math.prod(a.shape) for a in self._view_avals if a is not None)

    @property
    def nbytes_unique(self) -> int:
        """Bytes of the buffers: what training, optimizer state and checkpoints hold."""
        return sum(aval_nbytes(a) for a in self._avals)

    @property
    def nbytes_expanded(self) -> int:
        """Bytes the materialized tree would take if every view were a copy."""
        return self.nbytes_unique + sum(aval_nbytes(a) for a in self._view_avals)

    def _repr_html_(self) -> str:
        return DISPLAY["graph_html"](self)

    def to_dot(self, *, include_unshared: bool = False) -> str:
        """Graphviz DOT text of the graph (``dot -Tsvg``); see ``sharetree._display.graph_dot``."""
        return DISPLAY["graph_dot"](self, include_unshared=include_unshared)

    def __repr__(self) -> str:
        counts = f"{plural(self.num_unique, 'buffer')}, {plural(self.num_views, 'view')}"
        return (
            f"SharingGraph({counts}; params {self.size_unique:,} unique / {self.size_expanded:,} "
            f"expanded; bytes {self.nbytes_unique:,} / {self.nbytes_expanded:,})"
        )


def _abstract(
    structure: Structure, leaf: Leaf | ViewLeaf, aval: jax.ShapeDtypeStruct | None
) -> jax.ShapeDtypeStruct | None:
    """The shape and dtype of ``leaf.transform`` of a source's ``aval`` (``None``: unknown)."""
    t = leaf.transform
    # a stand-in for a transform a file names (inspect) is never called: shape unknown
    if aval is None or t is None or is_described(t):
        return None if t is not None and is_described(t) else aval
    try:
        return check_view_value(t.abstract(aval), t)
    except Exception as e:
        raise transform_error(structure, leaf, aval, e) from e


def canonicalize(tree: Any) -> SharingGraph:
    """Resolve every tie of ``tree`` into a :class:`SharingGraph` (cached per treedef).

    Raises:
        TieError: for a dangling ref (naming the closest path), a cycle (the
            whole cycle), a self-reference or a ``Tied`` at the root.

    Example:
        >>> import numpy as np, sharetree as st
        >>> st.canonicalize({"x": np.ones(2), "z": st.Tied("x")}).buffers
        (Buffer('x', float64[2], views=1),)
    """
    leaves, structure = leaves_and_structure(tree)
    return SharingGraph(structure, leaves)
