"""Flax linen integration: ``tied(module, ties)`` ties parameters of any linen module.

Importing it registers ``Tied`` with ``flax.serialization``. Import it explicitly
(``import sharetree`` never needs flax); see docs/integrations.md, "Flax linen".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

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


def _view_names(ref: Any, t: Tied, where: str) -> tuple[Any, ...] | None:
    """The partition names of ``t``'s view of the box ``ref``; ``None`` if its axes are unknown."""
    aval = leaf_aval(ref.value)
    try:
        return None if aval is None else view_axis_names(t.transform, ref.names, aval)
    except TieError as e:
        add_context(e, f"{where}: on the partition box {path_str(t.ref)!r} of {format_aval(aval)}")
        raise
    except Exception as e:  # the view does not fit its buffer
        what = f"fails on the partition box {path_str(t.ref)!r} of {format_aval(aval)}"
        raise error("E9", where, what, found=one_line(e), fix="use a transform that fits it") from e


def _check_boxes(params: Any, ties: tuple[tuple[Path, Tied], ...], check: bool, where: str) -> None:
    """A tie that names a partition box must give the view the target's own partition names."""
    for target, t in ties:
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
        names = _view_names(ref, t, view)
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


@functools.lru_cache(maxsize=STRUCTURE_CACHE_SIZE)
def _copied_boxes(structure: Structure) -> tuple[tuple[Path, Any, ViewLeaf], ...]:
    """``(where, buffer's box, view)`` of each view that copies its buffer's partition box.

    From the treedefs alone (a box's names are static), so once per structure; a box that
    holds a ``Tied`` value keeps its own names.
    """
    own = _boxes(skeleton(structure.treedef))
    if not own:
        return ()
    copied = _boxes(skeleton(structure.expanded_treedef))
    out = []
    for leaf in structure.views:
        at, source = leaf.path[:-1], structure.buffer_paths[leaf.buffer][:-1]
        if at not in own and at in copied and source in own:
            out.append((at, own[source], leaf))
    return tuple(out)


def _rename_boxes(structure: Structure, leaves: Any, materialized: Any, where: str) -> Any:
    """``materialized`` with each box copied from a buffer given the view's axis names.

    Registered with the core: ``st.materialize``, ``restructure``, ``grad_by_use`` and
    ``st.untie`` all call it.
    """
    fixed: dict[Path, Any] = {}
    for at, box, leaf in _copied_boxes(structure):
        aval = leaf_aval(leaves[leaf.buffer])
        names = None if aval is None else view_axis_names(leaf.transform, box.names, aval)
        if names is None:
            view = f"{where}: the view {path_str(at)!r} ({structure.ties[leaf.tie]!r} at "
            source = path_str(structure.buffer_paths[leaf.buffer][:-1])
            what = f"copies the partition box of {source!r}; {leaf.transform!r} drops its axes"
            fix = "tie the box's 'value' leaf instead"
            raise error("E42", f"{view}{path_str(leaf.tie)!r})", what, fix=fix)
        fixed[at] = names
    if not fixed:
        return materialized
    return jtu.tree_map_with_path(
        lambda kp, x: x.replace(names=fixed[p]) if (p := keypath_to_path(kp)) in fixed else x,
        materialized,
        is_leaf=lambda x: isinstance(x, meta.AxisMetadata),
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
                buffer = path_str(structure.buffer_paths[view.buffer])
                fix = f"write the buffer {buffer!r} instead, or untie that parameter"
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
