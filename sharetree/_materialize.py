"""Evaluating views: the only place where a ``Tied`` becomes a value."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError, add_context, error, found_type, one_line
from sharetree._paths import Path, aval_of, flattening, format_aval, is_array_leaf, path_str
from sharetree._resolve import Leaf, Structure, ViewLeaf, structure_of
from sharetree._transforms import Transform, identity

__all__ = [
    "materialize",
    "expand_leaves",
    "expanded_by_path",
    "abstract_expanded",
    "leaves_and_structure",
    "leaf_aval",
    "transform_error",
    "check_view_value",
    "join_error",
    "leaf_view",
    "expanded_tree",
    "register_box_renamer",
    "BOX_RENAMERS",
    "EAGER_PROGRAM_CACHE_SIZE",
]

PyTree = Any

BoxRenamer = Callable[[Structure, Sequence[Any], PyTree, str], PyTree]
BOX_RENAMERS: list[BoxRenamer] = []
"""``rename(structure, leaves, materialized, where)``: the materialized tree with each view
that copies a buffer's Flax partition box carrying the view's axis names (``sharetree.flax``
registers one; the core never imports Flax)."""


def register_box_renamer(rename: BoxRenamer) -> None:
    """Register a :data:`BOX_RENAMERS` entry (once)."""
    if rename not in BOX_RENAMERS:
        BOX_RENAMERS.append(rename)


def expanded_tree(
    structure: Structure, leaves: Sequence[Any], values: Sequence[Any], where: str
) -> PyTree:
    """The materialized tree of ``values`` (one per materialized leaf), boxes renamed."""
    out = jtu.tree_unflatten(structure.expanded_treedef, values)
    for rename in BOX_RENAMERS:
        out = rename(structure, leaves, out, where)
    return out


_JIT_VIEWS_MIN = 16  # from this many views on, eager materialize computes them in one call
EAGER_PROGRAM_CACHE_SIZE = 32  # how many structures keep that compiled call (least recent out)


def materialize(tree: PyTree) -> PyTree:
    """Replace every ``Tied`` by its value: ``transform(value at ref)``.

    Pure JAX (``jit``, ``grad``, ``vmap``, ``jvp``): the gradient of a buffer
    accumulates over all of its uses. An identity view of an array is its
    buffer object itself; a tree without ties is returned as it is.

    Raises:
        TieError: for a bad graph (see :func:`canonicalize`) or a transform
            that fails on its buffer (naming the tie, transform and shape).

    Example:
        >>> import numpy as np, sharetree as st
        >>> w = np.arange(6.0).reshape(2, 3)
        >>> m = st.materialize({"enc": w, "dec": st.Tied("enc", st.T), "same": st.Tied("enc")})
        >>> m["dec"].shape, m["same"] is w
        ((3, 2), True)
    """
    leaves, structure = leaves_and_structure(tree)
    if not structure.ties:
        return tree
    return expanded_tree(structure, leaves, expand_leaves(structure, leaves), "materialize")


def leaves_and_structure(tree: PyTree) -> tuple[list[Any], Structure]:
    """Flatten a canonical tree and resolve its structure (cached per treedef)."""
    with flattening(tree):
        leaves, treedef = jtu.tree_flatten(tree)
    return leaves, structure_of(treedef)


def transform_error(
    structure: Structure, leaf: Leaf | ViewLeaf, aval: Any, err: BaseException
) -> TieError:
    """The error of a transform that failed on its buffer, to raise from ``err``.

    Call it while handling ``err``. A :class:`TieError` (a slice outside its buffer) is
    raised again at once with the view named in a note, so its class and code stay; any
    other exception gives the ``E9`` error naming the view, tie, transform and buffer.
    """
    at = leaf.tie or leaf.path
    tie, shown = structure.ties.get(at), format_aval(aval)
    view = f"view {path_str(leaf.path)!r} ({tie!r} at {path_str(at)!r})"
    kind = "buffer" if leaf.buffer < len(structure.buffer_paths) else "view"
    buffer = f"{kind} {path_str(structure.source_path(leaf.buffer))!r} of {shown}"
    if isinstance(err, TieError):
        add_context(err, f"computing the {view} from its {buffer}")
        raise err
    fix = f"use a transform that accepts {shown}"
    if any(c.__name__ == "ShardingTypeError" for c in type(err).__mro__):  # private in JAX
        fix = _FIX_RESHARD
    where = f"the transform {leaf.transform!r} of {view}"
    return error("E9", where, f"failed on {buffer}", found=one_line(err), fix=fix)


_FIX_RESHARD = (
    "reshard the buffer so that the axis the view cuts is not sharded (jax.sharding.reshard("
    "x, P(...)) before tying), or make that mesh axis Auto (jax.make_mesh(..., axis_types=...))"
)


def check_view_value(out: Any, transform: Transform) -> Any:
    """``out`` if it is one view value (an array, number, shape/dtype), else a :class:`TieError`."""
    if is_array_leaf(out) or isinstance(out, jax.ShapeDtypeStruct):
        return out
    found = found_type(out, 60)
    fix = f"return one array from {type(transform).__name__}.__call__; tie each part on its own"
    raise error("E66", repr(transform), "returned no array", found=found, fix=fix)


def _transformable(x: Any) -> bool:
    """Whether a transform applies to ``x`` (an array, number, tracer or shape/dtype)."""
    return is_array_leaf(x) or hasattr(x, "shape")


def _shown(x: Any) -> str:
    """An input in a message: ``float32[2, 3]`` for an array (0-d too), else its type and repr."""
    return found_type(x, 40) if aval_of(x) is None else format_aval(x)


def join_error(
    structure: Structure, j: int, inputs: dict[str, Any], err: BaseException
) -> TieError:
    """The error of a transform of several inputs that failed, to raise from ``err``.

    Call it while handling ``err``; a :class:`TieError` (shapes that do not multiply) is
    raised again at once with the view and its inputs named in a note.
    """
    join = structure.joins[j]
    tie = structure.ties[join.tie]
    shown = ", ".join(
        f"{name} {path_str(structure.source_path(x.source))!r}"
        + ("" if x.transform == identity else f" >> {x.transform!r}")
        + f" {_shown(inputs[name])}"
        for name, x in join.inputs
    )
    view = f"view {path_str(join.path)!r} ({tie!r} at {path_str(join.tie)!r})"
    if isinstance(err, TieError):
        add_context(err, f"computing the {view} from its inputs {shown}")
        raise err
    where = f"the transform {join.transform!r} of {view}"
    fix = "give it inputs of the shapes and dtypes it accepts"
    return error("E9", where, f"failed on its inputs {shown}", found=one_line(err), fix=fix)


class _Plan(NamedTuple):
    """Index lists of a structure for ``expand_leaves`` (built once per structure)."""

    sources: Callable[[Sequence[Any]], Any]  # sources -> the source of every materialized leaf
    views: tuple[tuple[int, Transform], ...]  # position and transform, other than identity
    batched: tuple[tuple[int, Transform], ...]  # the views that one compiled call can compute
    rest: tuple[tuple[int, Transform], ...]  # the views with ``st.fn``, called one by one
    inputs: tuple[int, ...]  # the buffers of the batched views


@functools.lru_cache(maxsize=EAGER_PROGRAM_CACHE_SIZE)
def _plan(structure: Structure) -> _Plan:
    sources = tuple(leaf.buffer for leaf in structure.expanded)
    getter: Callable[[Sequence[Any]], Any]
    if len(sources) > 1:
        getter = operator.itemgetter(*sources)
    else:  # itemgetter of one index returns the item itself, of none it fails
        getter = lambda leaves: [leaves[i] for i in sources]  # noqa: E731
    views = tuple(
        (k, leaf.transform)
        for k, leaf in enumerate(structure.expanded)
        if leaf.transform is not None and leaf.transform is not identity
    )
    n = len(structure.buffer_paths)
    batched = tuple(view for view in views if view[1].traceable() and sources[view[0]] < n)
    rest = tuple(view for view in views if view not in batched)
    inputs = tuple(sorted({sources[k] for k, _ in batched}))
    return _Plan(getter, views, batched, rest, inputs)


@functools.lru_cache(maxsize=EAGER_PROGRAM_CACHE_SIZE)
def _eager_views(structure: Structure) -> Callable[[tuple[Any, ...]], list[Any]]:
    """One compiled function computing the batched views of a structure from its inputs."""
    plan = _plan(structure)
    slot = {i: n for n, i in enumerate(plan.inputs)}

    def compute(buffers: tuple[Any, ...]) -> list[Any]:
        inputs = (buffers[slot[structure.expanded[k].buffer]] for k, _ in plan.batched)
        return [leaf_view(structure, k, t, x) for (k, t), x in zip(plan.batched, inputs)]

    return jax.jit(compute)


def expand_leaves(
    structure: Structure,
    leaves: list[Any],
    apply: Callable[[Transform, Any], Any] | None = None,
) -> list[Any]:
    """The materialized leaves: each buffer, and each view computed from its buffer.

    ``apply(transform, x)`` replaces calling the transform (e.g. abstract
    evaluation). Eagerly, from ``_JIT_VIEWS_MIN`` views on concrete arrays, the
    built-in transforms run in one compiled call; ``st.fn`` views one by one.
    """
    plan = _plan(structure)
    values = _with_joins(structure, leaves, apply) if structure.joins else leaves
    out = list(plan.sources(values))
    todo = plan.views
    if (
        apply is None
        and plan.batched
        and len(structure.views) >= _JIT_VIEWS_MIN
        and all(isinstance(leaves[i], (np.ndarray, np.generic, jax.Array)) for i in plan.inputs)
        and not any(isinstance(leaves[i], jax.core.Tracer) for i in plan.inputs)
    ):
        values = _eager_views(structure)(tuple(leaves[i] for i in plan.inputs))
        for (k, _), value in zip(plan.batched, values):
            out[k] = value
        todo = plan.rest
    for k, t in todo:
        if _transformable(out[k]):
            out[k] = leaf_view(structure, k, t, out[k], apply)
    return out


def _with_joins(
    structure: Structure, leaves: list[Any], apply: Callable[[Transform, Any], Any] | None
) -> list[Any]:
    """The sources: the leaves, then each join computed once from its inputs."""
    values = list(leaves)
    n = len(leaves)
    for j, join in enumerate(structure.joins):
        inputs = {}
        for name, x in join.inputs:
            value = values[x.source]
            if x.transform != identity and _transformable(value):
                leaf = Leaf(x.source, x.transform, join.path, join.tie)
                value = _leaf_value(structure, leaf, x.transform, value, apply)
            inputs[name] = value
        if not any(map(_transformable, inputs.values())):  # static data only (no arrays)
            first = next(iter(inputs.values()))
            if all(v is first or v == first for v in inputs.values()):
                values.append(first)  # static data, equal in every input: kept as it is
                continue
        try:
            t = join.transform
            values.append(check_view_value(t(inputs) if apply is None else apply(t, inputs), t))  # type: ignore[arg-type]
        except Exception as e:
            if apply is None and any(isinstance(v, jax.ShapeDtypeStruct) for v in inputs.values()):
                where = f"view {path_str(join.path)!r}"
                problem = "cannot be computed: an input is a jax.ShapeDtypeStruct (no values)"
                raise error("E70", where, problem, fix=_FIX_SHAPES) from e
            raise join_error(structure, j, inputs, e) from e
    assert len(values) == n + len(structure.joins)
    return values


def leaf_view(
    structure: Structure,
    k: int,
    t: Transform,
    x: Any,
    apply: Callable[[Transform, Any], Any] | None = None,
) -> Any:
    """The materialized leaf ``k``: ``t(x)`` (or ``apply(t, x)``), or the error naming it."""
    return _leaf_value(structure, structure.expanded[k], t, x, apply)


def _leaf_value(
    structure: Structure,
    leaf: Leaf,
    t: Transform,
    x: Any,
    apply: Callable[[Transform, Any], Any] | None = None,
) -> Any:
    """``t(x)`` (or ``apply(t, x)``) for ``leaf``, or the error naming it."""
    try:
        return check_view_value(t(x) if apply is None else apply(t, x), t)
    except Exception as e:
        if apply is None and isinstance(x, jax.ShapeDtypeStruct):  # no value to compute from
            buffer = path_str(structure.source_path(leaf.buffer))
            where = f"view {path_str(leaf.path)!r} of {buffer!r}"
            problem = "cannot be computed: its buffer is a jax.ShapeDtypeStruct (no values)"
            raise error("E70", where, problem, fix=_FIX_SHAPES) from e
        raise transform_error(structure, leaf, aval_of(x), e) from e


_FIX_SHAPES = (
    "for shapes use jax.eval_shape(st.materialize, tree) or st.canonicalize(tree).views; "
    "for values pass arrays"
)


def expanded_by_path(tree: PyTree) -> dict[Path, Any]:
    """Path -> value of every leaf of the materialized tree."""
    leaves, structure = leaves_and_structure(tree)
    return dict(zip((leaf.path for leaf in structure.expanded), expand_leaves(structure, leaves)))


def abstract_expanded(tree: PyTree) -> dict[Path, Any]:
    """Path -> shape/dtype (or the leaf itself when not an array) of the materialized tree."""
    leaves, structure = leaves_and_structure(tree)
    avals = [x if (a := leaf_aval(x)) is None else a for x in leaves]
    values = expand_leaves(structure, avals, apply=lambda t, a: t.abstract(a))
    return dict(zip((leaf.path for leaf in structure.expanded), values))


def leaf_aval(x: Any) -> jax.ShapeDtypeStruct | None:
    """The shape/dtype of an array leaf, tracer or ``ShapeDtypeStruct``; ``None`` otherwise."""
    aval = aval_of(x)
    if aval is None and hasattr(x, "shape") and hasattr(x, "dtype"):
        aval = jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return aval
