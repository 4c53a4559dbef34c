"""Flax linen integration: ``tied(module, ties)`` ties parameters of any linen module.

Importing it registers ``Tied`` with ``flax.serialization``. Import it explicitly
(``import sharetree`` never needs flax); see docs/integrations.md, "Flax linen".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

try:
    import flax.linen as nn
    from flax import serialization
    from flax.core import FrozenDict, meta
except ImportError as e:  # pragma: no cover - exercised only without flax
    raise ImportError("sharetree.flax needs Flax: pip install 'sharetree[flax]'") from e

import jax.tree_util as jtu

from sharetree._errors import TieError, add_context, check_mapping, error, one_line, wrong_type
from sharetree._materialize import leaf_aval, materialize, register_box_renamer
from sharetree._paths import (
    Path,
    Ref,
    TieMap,
    format_aval,
    from_root,
    keypath_to_path,
    leaves_with_paths,
    path_str,
    ref_str,
)
from sharetree._resolve import (
    STRUCTURE_CACHE_SIZE,
    Structure,
    ViewLeaf,
    nodes_at,
    skeleton,
    structure_of,
)
from sharetree._tie import tie, tie_entries
from sharetree._tied import Tied
from sharetree._transforms import view_axis_names

__all__ = ["TiedModule", "tied"]

COLLECTION = "params"


_TIES_FIX = "tied(model, {'head/kernel': st.Tied('embed/embedding', st.T)})"


def _normalize(ties: TieMap) -> tuple[tuple[Path, Tied], ...]:
    ties = check_mapping(ties, "E69", "tied(module, ties)", "a mapping {target: ref}", _TIES_FIX)
    return tuple(tie_entries(ties).items())


def _boxes(tree: Any) -> dict[Path, Any]:
    """Every partition box of a tree, by path."""
    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    return {p: x for p, x in leaves_with_paths(tree, is_box) if is_box(x)}


def _value_fix(target: Path, t: Tied) -> str:
    target_value, ref_value = f"{path_str(target)}/value", f"{path_str(t.ref)}/value"
    return f"tie the value leaves, {{{target_value!r}: st.Tied({ref_value!r}, {t.transform!r})}}"


def _view_names(t: Tied, names: Any, aval: Any, where: str, what: str) -> tuple[Any, ...] | None:
    """The partition names of ``t``'s view of boxes (``what``); ``None`` if its axes are unknown.

    ``names`` and ``aval`` are one box's, or ``{input: ...}`` for a view of several positions.
    """
    try:
        return view_axis_names(t.transform, names, aval)
    except TieError as e:
        add_context(e, f"{where}: on {what}")
        raise
    except Exception as e:  # the view does not fit its buffer
        raise error(
            "E9", where, f"fails on {what}", found=one_line(e), fix="use a transform that fits it"
        ) from e


def _box_of(x: Any) -> Any:
    """What makes a box one structure with another: its kind, names, mesh and rules."""
    if not isinstance(x, meta.AxisMetadata):
        return None
    return (
        type(x),
        tuple(getattr(x, "names", ())),
        getattr(x, "mesh", None),
        getattr(x, "rules", None),
    )


def _shown_node(x: Any) -> str:
    """An input as the E190 message shows it: ``a LogicallyPartitioned box ('vocab', None) ...``."""
    if not isinstance(x, meta.AxisMetadata):
        return f"an array {format_aval(leaf_aval(x))} (no box)"
    aval = leaf_aval(getattr(x, "value", None))
    return f"a {type(x).__name__} box {tuple(getattr(x, 'names', ()))} of {format_aval(aval)}"


def _joined_value_fix(target: Path, t: Tied, boxed: Collection[str], target_boxed: bool) -> str:
    """The tie that reads (and, at a box, writes) the boxes' ``value`` leaves instead."""
    at = target + ("value",) if target_boxed else target
    refs = {
        n: ref_str(Ref(r.keys + ("value",), r.up)) if n in boxed else ref_str(r) for n, r in t.refs
    }
    named = ", ".join(f"{n!r}: {r!r}" for n, r in refs.items())
    return f"tie the value leaves, {{{path_str(at)!r}: st.Tied({{{named}}}, {t.transform!r})}}"


def _check_joined_boxes(params: Any, target: Path, t: Tied, check: bool, where: str) -> None:
    """The boxes of a view of several positions: inputs of one kind and names, the target's own."""
    inputs: dict[str, Any] = {}
    for name, ref in t.refs:
        path = from_root(target, ref)
        found = None if path is None else next(iter(nodes_at(params, path)), None)
        if found is None:
            return  # a climb past the root or a missing ref, which st.tie names
        inputs[str(name)] = found
    box = next(iter(nodes_at(params, target)), None)
    target_boxed = isinstance(box, meta.AxisMetadata)
    boxed = [n for n, x in inputs.items() if isinstance(x, meta.AxisMetadata)]
    if not boxed and not target_boxed:
        return
    view = f"{where}: the view {path_str(target)!r} ({t!r})"
    fix = _joined_value_fix(target, t, boxed, target_boxed)
    kinds = [_box_of(x) for x in inputs.values()]
    if any(k != kinds[0] for k in kinds) or not boxed:
        refs = dict(t.refs)
        found = "; ".join(
            f"{n!r} ({ref_str(refs[n])!r}) is {_shown_node(x)}" for n, x in inputs.items()
        )
        if not boxed:
            what = f"puts a view of arrays in the partition box {path_str(target)!r}"
        elif len(boxed) < len(inputs):
            what = "reads partition boxes and arrays (it maps over inputs of one structure)"
        else:
            what = "reads partition boxes of different names or kinds (it maps over inputs of one"
            what += " structure)"
        raise error("E190", view, what, found=found, fix=fix)
    if not target_boxed:
        return  # the view is a copy of its inputs' box, named by the renamer
    first = inputs[boxed[0]]
    if not isinstance(box, meta.Partitioned) or type(first) is not type(box):
        kinds_ = f"a {type(box).__name__} box and {type(first).__name__} inputs"
        raise error("E42", view, f"joins {kinds_}", expected="one kind of box", fix=fix)
    names_in = {n: tuple(x.names) for n, x in inputs.items()}
    avals = {n: leaf_aval(x.value) for n, x in inputs.items()}
    if any(a is None for a in avals.values()):
        return  # no arrays (st.tie names what it finds)
    shown = ", ".join(f"{n!r} {names_in[n]} of {format_aval(avals[n])}" for n in names_in)
    names = _view_names(t, names_in, avals, view, f"the partition boxes {shown}")
    if names is None:
        what = f"{t.transform!r} does not map the axes of its inputs ({shown})"
        raise error("E42", view, what, expected="axes the view keeps", fix=fix)
    own = (tuple(box.names), box.mesh, getattr(box, "rules", None))
    if check and own != (names, first.mesh, getattr(first, "rules", None)):
        mesh = "" if own[1:] == (first.mesh, getattr(first, "rules", None)) else ", another mesh"
        what = f"would carry the partition names {names} (from its inputs {shown})"
        raise error("E42", view, what, expected=f"its own box's {own[0]}{mesh}", fix=fix)


def _check_boxes(params: Any, ties: tuple[tuple[Path, Tied], ...], check: bool, where: str) -> None:
    """A tie that names a partition box must give the view the target's own partition names."""
    for target, t in ties:
        if t.inputs is not None:
            _check_joined_boxes(params, target, t, check, where)
            continue
        if (ref_path := from_root(target, Ref(t.ref, t.up))) is None:
            continue  # a climb past the root, which st.tie names
        box, ref = (next(iter(nodes_at(params, p)), None) for p in (target, ref_path))
        if not isinstance(box, meta.AxisMetadata) or ref is None:
            continue  # not a box; or a missing ref, which st.tie names with the closest paths
        view, fix = f"{where}: the view {path_str(target)!r} ({t!r})", _value_fix(target, t)
        ref_names = tuple(ref.names)
        if not isinstance(box, meta.Partitioned) or type(ref) is not type(box):
            kinds = f"a {type(box).__name__} box and a {type(ref).__name__}"
            raise error("E42", view, f"joins {kinds}", expected="one kind of box", fix=fix)
        aval = leaf_aval(ref.value)
        what = f"the partition box {path_str(t.ref)!r} of {format_aval(aval)}"
        names = None if aval is None else _view_names(t, ref.names, aval, view, what)
        if names is None:
            what = f"{t.transform!r} does not map the axes of {path_str(t.ref)!r} {ref_names}"
            raise error("E42", view, what, expected="axes the view keeps", fix=fix)
        own = (tuple(box.names), box.mesh, getattr(box, "rules", None))
        if check and own != (names, ref.mesh, getattr(ref, "rules", None)):
            mesh = "" if own[1:] == (ref.mesh, getattr(ref, "rules", None)) else ", another mesh"
            what = f"would carry the partition names {names} (from {path_str(t.ref)!r} {ref_names})"
            raise error("E42", view, what, expected=f"its own box's {own[0]}{mesh}", fix=fix)


def _check_variables(variables: Any, where: str) -> None:
    expected = "the variables, a dict of collections such as {'params': params}"
    check_mapping(variables, "E69", where, expected, "pass what init returned")


def _with_params(variables: Any, params: Any) -> Any:
    """``variables`` with ``params`` as its ``"params"`` collection (a ``FrozenDict`` stays one)."""
    out = {**variables, COLLECTION: params}
    return FrozenDict(out) if isinstance(variables, FrozenDict) else out


class _Copied(NamedTuple):
    """A view whose box is copied from its source's: from a buffer's box, or a join's inputs'."""

    at: Path  # the box's path in the materialized tree
    leaf: ViewLeaf  # the view's leaf (its source: a buffer or a join)


class _BoxPlan(NamedTuple):
    """The boxes of a structure (from its treedefs: a box's names are static)."""

    own: dict[Path, Any]  # each box of the canonical tree, by path
    copied: tuple[_Copied, ...]  # each box of the materialized tree copied into a view


@functools.lru_cache(maxsize=STRUCTURE_CACHE_SIZE)
def _box_plan(structure: Structure) -> _BoxPlan:
    """The boxes that views copy, once per structure; a box holding a ``Tied`` keeps its names."""
    own = _boxes(skeleton(structure.treedef))
    if not own:
        return _BoxPlan(own, ())
    copied = _boxes(skeleton(structure.expanded_treedef))
    n = len(structure.buffer_paths)
    out = []
    for leaf in structure.views:
        at = leaf.path[:-1]
        if at in own or at not in copied:
            continue
        if leaf.buffer >= n or structure.buffer_paths[leaf.buffer][:-1] in own:
            out.append(_Copied(at, leaf))
    return _BoxPlan(own, tuple(out))


class _Named(NamedTuple):
    """A source's partition names (``None``: no box, or names not derived) and shape."""

    names: tuple[Any, ...] | None
    aval: Any


def _source_names(
    structure: Structure, own: dict[Path, Any], leaves: Any, source: int, memo: dict[int, _Named]
) -> _Named:
    """The names of a source's box: its own box's, else derived from a join's inputs' boxes.

    A join's names are its transform's ``axis_names({input: names}, {input: aval})``; an
    input with no box, or a transform that declares no names, gives ``None``.
    """
    if source in memo:
        return memo[source]
    n = len(structure.buffer_paths)
    box = own.get(structure.source_path(source)[:-1])
    if source < n:
        memo[source] = _Named(None if box is None else tuple(box.names), leaf_aval(leaves[source]))
        return memo[source]
    join = structure.joins[source - n]
    names: dict[str, Any] = {}
    avals: dict[str, Any] = {}
    for name, x in join.inputs:
        got = _source_names(structure, own, leaves, x.source, memo)
        if got.aval is None:
            memo[source] = _Named(None, None)
            return memo[source]
        names[name] = (
            None if got.names is None else view_axis_names(x.transform, got.names, got.aval)
        )
        avals[name] = x.transform.abstract(got.aval)
    aval = join.transform.abstract(avals)  # type: ignore[arg-type]
    if box is not None:  # the join is the value of a box that holds the Tied: its own names
        memo[source] = _Named(tuple(box.names), aval)
    elif any(v is None for v in names.values()):
        memo[source] = _Named(None, aval)
    else:
        joined = view_axis_names(join.transform, names, avals)  # type: ignore[arg-type]
        memo[source] = _Named(joined, aval)
    return memo[source]


def _rename_boxes(structure: Structure, leaves: Any, materialized: Any, where: str) -> Any:
    """``materialized`` with each box copied from a buffer given the view's axis names.

    A box copied from the inputs of a view of several positions gets the names its
    transform derives from theirs; where none can be derived, the view has no box.
    Registered with the core: ``st.materialize``, ``restructure``, ``grad_by_use`` and
    ``st.untie`` all call it.
    """
    plan = _box_plan(structure)
    fixed: dict[Path, Any] = {}
    memo: dict[int, _Named] = {}
    n = len(structure.buffer_paths)
    for at, leaf in plan.copied:
        source = _source_names(structure, plan.own, leaves, leaf.buffer, memo)
        if source.names is None and leaf.buffer >= n:
            fixed[at] = None  # a join whose names cannot be derived: no box
            continue
        names = None
        if source.names is not None and source.aval is not None:
            names = view_axis_names(leaf.transform, source.names, source.aval)
        if names is None:
            view = f"{where}: the view {path_str(at)!r} ({structure.ties[leaf.tie]!r} at "
            src = path_str(structure.source_path(leaf.buffer)[:-1])
            what = f"copies the partition box of {src!r}; {leaf.transform!r} drops its axes"
            fix = "tie the box's 'value' leaf instead"
            raise error("E42", f"{view}{path_str(leaf.tie)!r})", what, fix=fix)
        fixed[at] = names
    if not fixed:
        return materialized

    def rename(kp: Any, x: Any) -> Any:
        if (p := keypath_to_path(kp)) not in fixed:
            return x
        return x.value if fixed[p] is None else x.replace(names=fixed[p])

    return jtu.tree_map_with_path(
        rename, materialized, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)
    )


@dataclasses.dataclass(frozen=True)
class TiedModule:
    """A linen module whose ``"params"`` collection is tied (made by :func:`tied`).

    Attributes:
        module: the wrapped linen module.
        ties: ``(target path, Tied)`` pairs; paths are inside ``"params"``.
        check: whether each view must have the shape and dtype of the parameter it replaces.

    Example:
        >>> import numpy as np, flax.linen as nn, sharetree as st
        >>> from sharetree.flax import tied
        >>> model = tied(nn.Dense(3), {"bias": st.Tied("kernel", st.reshape((3,)))})
        >>> params = {"kernel": np.ones((1, 3), np.float32), "bias": np.zeros(3, np.float32)}
        >>> variables = {"params": model.tie(params)}  # e.g. untied weights from a checkpoint
        >>> variables["params"]["bias"]
        Tied('kernel', reshape(3))
        >>> model.materialize(variables)["params"]["bias"]
        Array([1., 1., 1.], dtype=float32)
    """

    module: nn.Module
    ties: tuple[tuple[Path, Tied], ...]
    check: bool = True

    def _where(self, method: str) -> str:
        return f"tied({type(self.module).__name__}).{method}"

    def tie(self, params: Any) -> Any:
        """Tie a ``"params"`` tree of the wrapped module; the values at the targets are dropped.

        Raises:
            TieError: as :func:`tied` at ``init``.
        """
        return self._tie(params, "tie")

    def _tie(self, params: Any, method: str) -> Any:
        where = self._where(method)
        _check_boxes(params, self.ties, self.check, where)
        try:
            return tie(params, dict(self.ties), check=self.check)
        except TieError as e:
            add_context(e, f"{where}: in the {COLLECTION!r} collection")
            raise

    def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
        """``module.init``, with the ``"params"`` collection tied (canonical)."""
        return self._tie_variables(self.module.init(rngs, *args, **kwargs), "init")

    def init_with_output(self, rngs: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``module.init_with_output``, with the ``"params"`` collection tied."""
        out, variables = self.module.init_with_output(rngs, *args, **kwargs)
        return out, self._tie_variables(variables, "init_with_output")

    def lazy_init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
        """``module.lazy_init``, with the ``"params"`` collection tied."""
        return self._tie_variables(self.module.lazy_init(rngs, *args, **kwargs), "lazy_init")

    def bind(self, variables: Any, *args: Any, **kwargs: Any) -> nn.Module:
        """``module.bind`` to the materialized variables (nothing is written back)."""
        _check_variables(variables, self._where("bind"))
        return self.module.bind(self.materialize(variables), *args, **kwargs)

    def _tie_variables(self, variables: Any, method: str) -> Any:
        if not self.ties:
            return variables
        if COLLECTION not in variables:
            ties = [path_str(p) for p, _ in self.ties]
            what = f"made no {COLLECTION!r} collection for the ties {ties}"
            fix = "initialise with the method that creates the parameters"
            raise error("E184", self._where(method), what, found=str(sorted(variables)), fix=fix)
        return _with_params(variables, self._tie(variables[COLLECTION], method))

    def materialize(self, variables: Any) -> Any:
        """The variables with ``"params"`` materialized; a boxed view gets the view's names."""
        where = self._where("materialize")
        _check_variables(variables, where)
        if COLLECTION not in variables:
            return variables
        return _with_params(variables, materialize(variables[COLLECTION]))

    def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        """Materialize ``variables["params"]`` and call ``module.apply``.

        With ``"params"`` mutable, the returned ``"params"`` are canonical again.

        Raises:
            TieError: with ``"params"`` mutable, the module wrote to a view.
        """
        _check_variables(variables, self._where("apply"))
        if COLLECTION not in variables:
            return self.module.apply(variables, *args, **kwargs)
        materialized = self.materialize(variables)
        result = self.module.apply(materialized, *args, **kwargs)
        if kwargs.get("mutable", False) is False or COLLECTION not in result[1]:
            return result  # (linen returns (out, updated) exactly when mutable is not False)
        out, updated = result
        passed, returned = materialized[COLLECTION], updated[COLLECTION]
        structure = structure_of(jtu.tree_structure(variables[COLLECTION]))
        before, after = dict(leaves_with_paths(passed)), dict(leaves_with_paths(returned))
        for view in structure.views:
            if after.get(view.path) is not before.get(view.path):
                at = f"{COLLECTION}/{path_str(view.path)}"
                what = f"the view {structure.ties[view.tie]!r} at {path_str(view.tie)!r}"
                reads = [
                    path_str(structure.buffer_paths[b]) for b in structure.parents[view.buffer]
                ]
                buffers = f"the buffer {reads[0]!r}" if len(reads) == 1 else f"the buffers {reads}"
                fix = f"write {buffers} instead, or untie that parameter"
                raise error("E185", self._where("apply"), f"wrote to {at!r}, {what}", fix=fix)
        return out, _with_params(updated, tie(returned, structure.ties, check=False))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("module", "ties"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        ties = ", ".join(f"{path_str(p)!r}: {t!r}" for p, t in self.ties)
        return f"tied({self.module!r}, {{{ties}}})"


def _restore_tied(target: Tied, state: Any) -> Tied:
    """The target's ``Tied`` back from ``flax.serialization.from_state_dict``."""
    if isinstance(state, Mapping) and not state:
        return target
    shape = getattr(state, "shape", None)
    found = type(state).__name__ if shape is None else f"an array of shape {tuple(shape)}"
    where = f"flax.serialization: the state at {serialization.current_path()!r}"
    fix = "restore into an untied template, then tie it with st.tie"
    raise error("E186", where, expected=f"no values (a view, {target!r})", found=found, fix=fix)


# a Tied stores nothing and comes back from the target (as Orbax restores it)
serialization.register_serialization_state(Tied, lambda t: {}, _restore_tied, override=True)


def tied(module: nn.Module, ties: TieMap, *, check: bool = True) -> TiedModule:
    """Wrap a linen module so that its ``"params"`` collection is tied.

    Args:
        module: any ``flax.linen.Module``.
        ties: ``{target: ref or Tied(ref, transform)}``, paths inside ``"params"``.
        check: require each view to have the shape and dtype of the parameter it replaces.

    Raises:
        TieError: (at ``init``) a target or ref missing from ``"params"``, or a
            view whose shape or dtype differs from the parameter it replaces.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, sharetree as st
        >>> from sharetree.flax import tied
        >>> model = tied(nn.Dense(3), {"bias": st.Tied("kernel", st.reshape((3,)))})
        >>> variables = model.init(jax.random.key(0), jnp.ones((1, 1)))
        >>> variables["params"]["bias"]
        Tied('kernel', reshape(3))
        >>> model.apply(variables, jnp.ones((1, 1))).shape
        (1, 3)
    """
    if isinstance(module, TiedModule):
        return TiedModule(module.module, module.ties + _normalize(ties), check and module.check)
    if not isinstance(module, nn.Module):
        fix = "for NNX use sharetree.nnx.split; for other pytrees use st.tie"
        raise wrong_type("E69", "tied(module, ties)", "a flax.linen.Module", module, fix)
    return TiedModule(module, _normalize(ties), check)


register_box_renamer(_rename_boxes)
