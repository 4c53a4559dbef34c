"""The sharing graph: resolve every ``Tied`` of a canonical tree into buffers and views.

The resolution depends only on the tree's structure (the treedef carries each
``Tied``'s ref and transform), so it is computed once per treedef and cached;
eager calls on a canonical tree then cost little more than a flatten.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError, closest
from sharetree._tied import Path, Tied, keypath_to_path, path_str
from sharetree._transforms import Transform, chain, identity

__all__ = ["SharingGraph", "Buffer", "View", "canonicalize", "structure_of", "Structure"]


class _Slot:
    """Placeholder for canonical leaf ``i`` while resolving a structure."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Ref:
    """Placeholder for ``transform(canonical leaf i)`` inside a resolved view."""

    __slots__ = ("i", "transform", "via")

    def __init__(self, i: int, transform: Transform, via: Path) -> None:
        self.i, self.transform, self.via = i, transform, via


def _is_tied(x: Any) -> bool:
    return isinstance(x, Tied)


@dataclasses.dataclass(frozen=True)
class Structure:
    """What a canonical treedef resolves to (cached per treedef).

    Attributes:
        treedef: the canonical tree's structure.
        buffer_paths: path of each canonical leaf (each buffer), in flatten order.
        ties: each ``Tied`` position and the ``Tied`` written there, in flatten order.
        expanded_treedef: the materialized tree's structure.
        expanded: for each materialized leaf, ``(buffer index, transform or None, path, tie)``;
            ``None`` marks the buffer's own position, ``tie`` the path of the ``Tied``
            that produced a view.
    """

    treedef: Any
    buffer_paths: tuple[Path, ...]
    ties: dict[Path, Tied]
    expanded_treedef: Any
    expanded: tuple[tuple[int, Transform | None, Path, Path | None], ...]

    @functools.cached_property
    def sources(self) -> tuple[int, ...]:
        """The buffer index of each materialized leaf."""
        return tuple(i for i, *_ in self.expanded)

    @functools.cached_property
    def views(self) -> tuple[tuple[int, Transform, Path, Path], ...]:
        return tuple((i, t, p, v) for i, t, p, v in self.expanded if t is not None)  # type: ignore[misc]


def _node_paths(positions: list[Path]) -> set[Path]:
    nodes: set[Path] = set()
    for p in positions:
        for k in range(1, len(p) + 1):
            nodes.add(p[:k])
    return nodes


def _nodes_at(tree: Any, path: Path) -> list[Any]:
    """Every node of ``tree`` whose path is ``path`` (empty ones such as ``None`` included)."""
    n = len(path)

    def stop(kp: Any, _x: Any) -> bool:
        return len(kp) >= n and keypath_to_path(kp[:n]) == path

    flat, _ = jtu.tree_flatten_with_path(tree, is_leaf=stop, is_leaf_takes_path=True)
    return [x for kp, x in flat if len(kp) == n and keypath_to_path(kp) == path]


def _subtree(tree: Any, path: Path) -> Any:
    """The subtree of ``tree`` at ``path`` (a node that has positions below it)."""
    found = _nodes_at(tree, path)
    if len(found) != 1:
        raise TieError(
            f"path {path_str(path)!r} is ambiguous: {len(found)} nodes have that name. "
            "Fix: rename one of the keys so that every path names one node."
        )
    return found[0]


class _Resolver:
    def __init__(self, placeholder: Any) -> None:
        self.placeholder = placeholder
        flat, _ = jtu.tree_flatten_with_path(placeholder, is_leaf=_is_tied)
        self.slot_of: dict[Path, int] = {}
        self.tied_at: dict[Path, Tied] = {}
        seen: set[Path] = set()
        for kp, x in flat:
            path = keypath_to_path(kp)
            if path in seen:
                raise TieError(
                    f"two positions share the path {path_str(path)!r} (keys that differ only in "
                    "type, such as 0 and '0'). Fix: rename one key so that paths are unambiguous."
                )
            seen.add(path)
            if isinstance(x, Tied):
                self.tied_at[path] = x
            else:
                self.slot_of[path] = x.i
        self.nodes = _node_paths(list(seen))
        self.memo: dict[Path, Any] = {}

    def all_paths(self) -> list[str]:
        return [path_str(p) for p in self.nodes]

    def tied(self, at: Path, stack: tuple[Path, ...]) -> Any:
        if at in self.memo:
            return self.memo[at]
        if at in stack:
            cycle = stack[stack.index(at) :] + (at,)
            raise TieError(
                "cycle of ties: "
                + " -> ".join(repr(path_str(p)) for p in cycle)
                + ". Each Tied refers to the next, so no buffer holds the value. "
                "Fix: put the array at one of these paths and tie the others to it."
            )
        t = self.tied_at[at]
        if t.ref[: len(at)] == at or at[: len(t.ref)] == t.ref:
            rel = (
                "itself"
                if t.ref == at
                else (
                    "a path inside itself" if len(t.ref) > len(at) else "a subtree that contains it"
                )
            )
            raise TieError(
                f"Tied at {path_str(at)!r} refers to {path_str(t.ref)!r}, {rel}: a view cannot "
                "be its own buffer. Fix: refer to a path outside it that holds the array."
            )
        inner = self.ref(t.ref, stack + (at,), at)
        value = _compose(inner, t.transform)
        self.memo[at] = value
        return value

    def ref(self, ref: Path, stack: tuple[Path, ...], origin: Path) -> Any:
        if ref in self.slot_of:
            return _Ref(self.slot_of[ref], identity, origin)
        if ref in self.tied_at:
            return self.tied(ref, stack)
        if ref in self.nodes:
            sub = _subtree(self.placeholder, ref)

            def visit(kp: Any, x: Any) -> Any:
                if isinstance(x, Tied):
                    return self.tied(ref + keypath_to_path(kp), stack)
                return _Ref(x.i, identity, origin)

            return jtu.tree_map_with_path(visit, sub, is_leaf=_is_tied)
        for k in range(len(ref) - 1, 0, -1):
            prefix = ref[:k]
            if prefix in self.tied_at:  # a path through a view: resolve it in the view's buffer
                t = self.tied_at[prefix]
                if prefix in stack:
                    self.tied(prefix, stack)  # raises the cycle error
                inner = self.ref(t.ref + ref[k:], stack + (prefix,), origin)
                return _compose(inner, t.transform)
            if prefix in self.slot_of:
                raise TieError(
                    f"Tied at {path_str(origin)!r}: ref {path_str(ref)!r} goes below the leaf "
                    f"{path_str(prefix)!r}, which has no children. Fix: refer to "
                    f"{path_str(prefix)!r} itself and select with a transform (st.fn)."
                )
        empty = _empty_node(self.placeholder, ref)
        if empty:
            raise TieError(
                f"Tied at {path_str(origin)!r}: ref {path_str(ref)!r} is {empty[0]!r}, a subtree "
                "with no leaves: there is no value to share. Fix: point the ref at a leaf or "
                "a subtree that holds arrays."
            )
        candidates = [p for p in self.all_paths() if p != path_str(origin)]
        raise TieError(
            f"Tied at {path_str(origin)!r}: ref {path_str(ref)!r} does not exist in the tree; "
            f"{closest(path_str(ref), candidates)}. Fix: point the ref at an existing "
            "leaf or subtree (paths are '/'-joined dict keys, indices and attribute names)."
        )


def _empty_node(tree: Any, path: Path) -> tuple[Any, ...]:
    """``(node,)`` if ``path`` names a node without leaves (``None``, ``{}``), else ``()``."""
    return tuple(x for x in _nodes_at(tree, path) if not jtu.tree_leaves(x))[:1]


def _compose(template: Any, t: Transform) -> Any:
    if t == identity:
        return template
    return jax.tree.map(lambda r: _Ref(r.i, chain(r.transform, t), r.via), template)


@functools.lru_cache(maxsize=512)
def structure_of(treedef: Any) -> Structure:
    """Resolve the sharing graph of a canonical treedef (cached).

    Raises:
        TieError: for a dangling ref, a cycle, a self-reference or a ``Tied`` root.
    """
    n = treedef.num_leaves
    placeholder = jtu.tree_unflatten(treedef, [_Slot(i) for i in range(n)])
    if isinstance(placeholder, Tied):
        raise TieError(
            f"the root of the tree is {placeholder!r}: a tie must sit inside a tree, "
            "next to the buffer it refers to. Fix: call materialize on the enclosing tree."
        )
    res = _Resolver(placeholder)
    buffer_paths = [()] * n
    for path, i in res.slot_of.items():
        buffer_paths[i] = path
    if not res.tied_at:
        leaves = tuple((i, None, buffer_paths[i], None) for i in range(n))
        return Structure(treedef, tuple(buffer_paths), {}, treedef, leaves)

    def expand(kp: Any, x: Any) -> Any:
        if isinstance(x, Tied):
            at = keypath_to_path(kp)
            # resolutions are memoised across ties: name the Tied written at this position
            return jax.tree.map(lambda r: _Ref(r.i, r.transform, at), res.tied(at, ()))
        return x

    expanded = jtu.tree_map_with_path(expand, placeholder, is_leaf=_is_tied)
    flat, expanded_treedef = jtu.tree_flatten_with_path(expanded)
    spec = []
    for kp, x in flat:
        path = keypath_to_path(kp)
        if isinstance(x, _Slot):
            spec.append((x.i, None, path, None))
        else:
            spec.append((x.i, x.transform, path, x.via))
    return Structure(treedef, tuple(buffer_paths), dict(res.tied_at), expanded_treedef, tuple(spec))


def is_array(x: Any) -> bool:
    """Whether a transform applies to ``x`` (arrays and numbers; not strings, None, functions)."""
    return isinstance(
        x, (jax.Array, np.ndarray, np.generic, float, int, complex)
    ) and not isinstance(x, bool)


def _aval(x: Any) -> jax.ShapeDtypeStruct | None:
    if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    if is_array(x):
        return jax.ShapeDtypeStruct((), np.asarray(x).dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # tracers
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return None


def _nbytes(aval: jax.ShapeDtypeStruct | None) -> int:
    return 0 if aval is None else math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _fmt(aval: jax.ShapeDtypeStruct | None) -> str:
    if aval is None:
        return "static"
    return f"{np.dtype(aval.dtype).name}[{', '.join(map(str, aval.shape))}]"


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A leaf stored once: its path, shape, dtype, bytes and how many views use it."""

    path: str
    shape: tuple[int, ...] | None
    dtype: Any
    nbytes: int
    num_views: int

    def __repr__(self) -> str:
        aval = None if self.shape is None else jax.ShapeDtypeStruct(self.shape, self.dtype)
        return f"Buffer({self.path!r}, {_fmt(aval)}, views={self.num_views})"


@dataclasses.dataclass(frozen=True)
class View:
    """A position whose value is ``transform(buffer)``; ``tie`` is the ``Tied`` that made it."""

    path: str
    buffer: str
    transform: Transform
    shape: tuple[int, ...] | None
    dtype: Any
    nbytes: int
    tie: str

    def __repr__(self) -> str:
        aval = None if self.shape is None else jax.ShapeDtypeStruct(self.shape, self.dtype)
        return f"View({self.path!r} <- {self.buffer!r}, {self.transform!r}, {_fmt(aval)})"


class SharingGraph:
    """The resolved sharing DAG of a canonical tree: unique buffers plus views.

    Built by :func:`canonicalize`. Counts are over leaves (``num_*``), array
    elements (``size_*``, i.e. parameters) and bytes (``nbytes_*``); "unique"
    counts each buffer once, "expanded" counts every position of the
    materialized tree. Per-buffer details are computed lazily on first access.

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
        return [_aval(x) for x in self._leaves]

    @functools.cached_property
    def _view_avals(self) -> list[jax.ShapeDtypeStruct | None]:
        out = []
        for i, t, path, via in self.structure.views:
            aval = self._avals[i]
            if aval is None or (
                not is_array(self._leaves[i]) and not hasattr(self._leaves[i], "shape")
            ):
                out.append(aval)
                continue
            try:
                out.append(t.abstract(aval))
            except Exception as e:
                raise transform_error(self.structure, i, t, path, via, aval, e) from None
        return out

    @functools.cached_property
    def buffers(self) -> tuple[Buffer, ...]:
        """Every buffer in flatten order."""
        uses = [0] * self.num_unique
        for i, *_ in self.structure.views:
            uses[i] += 1
        return tuple(
            Buffer(
                path_str(p),
                None if a is None else tuple(a.shape),
                None if a is None else np.dtype(a.dtype),
                _nbytes(a),
                uses[i],
            )
            for i, (p, a) in enumerate(zip(self.structure.buffer_paths, self._avals))
        )

    @functools.cached_property
    def views(self) -> dict[str, View]:
        """Every view: materialized path -> :class:`View` (buffer path, composed transform)."""
        paths = self.structure.buffer_paths
        return {
            path_str(p): View(
                path_str(p),
                path_str(paths[i]),
                t,
                None if a is None else tuple(a.shape),
                None if a is None else np.dtype(a.dtype),
                _nbytes(a),
                path_str(via),
            )
            for (i, t, p, via), a in zip(self.structure.views, self._view_avals)
        }

    @property
    def ties(self) -> dict[str, Tied]:
        """The ``Tied`` nodes as written in the canonical tree, by path."""
        return {path_str(p): t for p, t in self.structure.ties.items()}

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
        return sum(_nbytes(a) for a in self._avals)

    @property
    def nbytes_expanded(self) -> int:
        """Bytes the materialized tree would take if every view were a copy."""
        return self.nbytes_unique + sum(_nbytes(a) for a in self._view_avals)

    def _repr_html_(self) -> str:
        """HTML for Jupyter: totals, buffer and view tables, and an SVG drawing."""
        from sharetree._display import graph_html

        return graph_html(self)

    def to_dot(self, *, include_unshared: bool = False) -> str:
        """Graphviz DOT text of the graph (``dot -Tsvg``); see ``sharetree._display.graph_dot``."""
        from sharetree._display import graph_dot

        return graph_dot(self, include_unshared=include_unshared)

    def __repr__(self) -> str:
        return (
            f"SharingGraph({_plural(self.num_unique, 'buffer')}, "
            f"{_plural(self.num_views, 'view')}; "
            f"params {self.size_unique:,} unique / {self.size_expanded:,} expanded; "
            f"bytes {self.nbytes_unique:,} / {self.nbytes_expanded:,})"
        )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def transform_error(
    structure: Structure,
    i: int,
    t: Transform,
    path: Path,
    via: Path | None,
    aval: jax.ShapeDtypeStruct | None,
    err: Exception,
) -> TieError:
    """The TieError for a transform that failed on its input."""
    tie = structure.ties.get(via) if via is not None else None
    return TieError(
        f"view {path_str(path)!r} (from {tie!r} at {path_str(via or path)!r}): transform {t!r} "
        f"failed on buffer {path_str(structure.buffer_paths[i])!r} of {_fmt(aval)}: "
        f"{type(err).__name__}: {err}. Fix: use a transform that accepts {_fmt(aval)}."
    )


def canonicalize(tree: Any) -> SharingGraph:
    """Resolve every tie of ``tree`` into a :class:`SharingGraph`.

    The structural part is cached per treedef; a second call on a tree of the
    same structure costs one flatten.

    Args:
        tree: a canonical tree (may contain ``Tied`` nodes).

    Returns:
        The sharing graph: ``buffers``, ``views``, counts and bytes.

    Raises:
        TieError: for a dangling ref (naming the closest path), a cycle (the
            whole cycle), a self-reference or a ``Tied`` at the root.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"x": np.array([7.0, 7.0]), "y": np.array([3.0, 4.0]), "z": st.Tied("x")}
        >>> g = st.canonicalize(tree)
        >>> [b.path for b in g.buffers], list(g.views)
        (['x', 'y'], ['z'])
    """
    leaves, treedef = jtu.tree_flatten(tree)
    return SharingGraph(structure_of(treedef), leaves)


def leaves_and_structure(tree: Any) -> tuple[list[Any], Structure]:
    """Flatten a canonical tree and resolve its structure."""
    leaves, treedef = jtu.tree_flatten(tree)
    return leaves, structure_of(treedef)


_JIT_VIEWS_MIN = 16
"""From this many computed views on, eager ``materialize`` runs them as one jitted call."""


def _eager_views(structure: Structure) -> Callable[[tuple[Any, ...]], list[Any]]:
    """One jitted function computing every non-identity view (cached per structure)."""
    fn = structure.__dict__.get("_eager_views_fn")
    if fn is None:
        views = [(k, i, t, p, v) for k, (i, t, p, v) in enumerate(structure.expanded)]
        views = [(k, i, t, p, v) for k, i, t, p, v in views if t is not None and t is not identity]
        inputs = sorted({i for _, i, *_ in views})
        slot = {i: n for n, i in enumerate(inputs)}

        def compute(buffers: tuple[Any, ...]) -> list[Any]:
            out = []
            for _, i, t, path, via in views:
                x = buffers[slot[i]]
                try:
                    out.append(t(x))
                except Exception as e:
                    raise transform_error(structure, i, t, path, via, _aval(x), e) from None
            return out

        fn = (jax.jit(compute), tuple(inputs), tuple(k for k, *_ in views))
        structure.__dict__["_eager_views_fn"] = fn
    return fn


def _concrete_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    )


def expand_leaves(
    structure: Structure, leaves: list[Any], apply: Callable[[Transform, Any], Any] | None = None
) -> list[Any]:
    """The materialized leaves: each buffer, and each view computed from its buffer.

    Eager calls with many views on concrete arrays run all views in one jitted
    call (compiled once per structure and shapes) instead of one dispatch each;
    transforms that cannot be traced (NumPy inside ``st.fn``) fall back to
    one call per view, so results never depend on the number of views.
    """
    jit_failed = False
    if (
        apply is None
        and len(structure.views) >= _JIT_VIEWS_MIN
        and structure.__dict__.get("_eager_views_ok", True)
    ):
        fn, inputs, positions = _eager_views(structure)
        if positions and all(_concrete_array(leaves[i]) for i in inputs):
            try:
                values = fn(tuple(leaves[i] for i in inputs))
            except Exception:
                jit_failed = True  # e.g. NumPy inside st.fn: compute view by view below
            else:
                out = [leaves[i] for i in structure.sources]
                for k, value in zip(positions, values):
                    out[k] = value
                return out
    out = []
    for i, t, path, via in structure.expanded:
        x = leaves[i]
        if t is None or t is identity or (not is_array(x) and not hasattr(x, "shape")):
            out.append(x)
            continue
        try:
            out.append(t(x) if apply is None else apply(t, x))
        except Exception as e:
            raise transform_error(structure, i, t, path, via, _aval(x), e) from None
    if jit_failed:  # the views work one by one but not under jit: stop trying jit
        structure.__dict__["_eager_views_ok"] = False
    return out


def _by_path(structure: Structure, values: list[Any]) -> dict[Path, Any]:
    return {path: x for (_, _, path, _), x in zip(structure.expanded, values)}


def expanded_by_path(tree: Any) -> dict[Path, Any]:
    """Path -> value of every leaf of the materialized tree."""
    leaves, structure = leaves_and_structure(tree)
    return _by_path(structure, expand_leaves(structure, leaves))


def abstract_expanded(tree: Any) -> dict[Path, Any]:
    """Path -> shape/dtype (or the leaf itself when not an array) of the materialized tree."""
    leaves, structure = leaves_and_structure(tree)
    avals = [(_aval(x) if is_array(x) or hasattr(x, "shape") else x) for x in leaves]
    return _by_path(structure, expand_leaves(structure, avals, apply=lambda t, a: t.abstract(a)))
