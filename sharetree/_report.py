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
    leaf_aval,
    leaves_and_structure,
    transform_error,
)
from sharetree._paths import aval_nbytes, format_aval, path_key, plural
from sharetree._resolve import Structure
from sharetree._tied import DISPLAY, Tied
from sharetree._transforms import Transform, is_described

__all__ = ["SharingGraph", "Buffer", "View", "canonicalize"]


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
class View(_Shaped):
    """A position whose value is ``transform(buffer)``; ``tie`` is the ``Tied`` that made it."""

    path: str | tuple[str, ...]  # paths as every result's key: path_key
    buffer: str | tuple[str, ...]
    transform: Transform
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    nbytes: int
    tie: str | tuple[str, ...]

    def __repr__(self) -> str:
        return (
            f"View({self.path!r} <- {self.buffer!r}, {self.transform!r}, {format_aval(self.aval)})"
        )


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
    def _view_avals(self) -> list[jax.ShapeDtypeStruct | None]:
        out: list[jax.ShapeDtypeStruct | None] = []
        for view in self.structure.views:
            # a stand-in for a transform a file names (inspect) is never called: shape unknown
            aval = None if is_described(view.transform) else self._avals[view.buffer]
            try:
                t = view.transform
                out.append(None if aval is None else check_view_value(t.abstract(aval), t))
            except Exception as e:
                raise transform_error(self.structure, view, aval, e) from e
        return out

    @functools.cached_property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every buffer in flatten order."""
        uses = collections.Counter(view.buffer for view in self.structure.views)
        return tuple(
            Buffer(path_key(p), *_shape_fields(a), uses[i])
            for i, (p, a) in enumerate(zip(self.structure.buffer_paths, self._avals))
        )

    @functools.cached_property
    def views(self) -> dict[str | tuple[str, ...], View]:
        """Every view: materialized path -> :class:`View` (buffer path, composed transform)."""
        out = {}
        for v, a in zip(self.structure.views, self._view_avals):
            path, buffer = path_key(v.path), path_key(self.structure.buffer_paths[v.buffer])
            out[path] = View(path, buffer, v.transform, *_shape_fields(a), path_key(v.tie))
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
