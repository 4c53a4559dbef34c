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
    raise ImportError(
        "sharetree.flax needs Flax: pip install 'sharetree[flax]' (or pip install flax)."
    ) from e

import jax.tree_util as jtu

from sharetree._errors import TieError, one_line
from sharetree._materialize import leaf_aval, materialize, register_box_renamer
from sharetree._paths import (
    Path,
    TieMap,
    format_aval,
    keypath_to_path,
    leaves_with_paths,
    path_str,
)
from sharetree._resolve import (
    STRUCTURE_CACHE_SIZE,
    Structure,
    ViewLeaf,
    _nodes_at,
    skeleton,
    structure_of,
)
from sharetree._tie import tie, tie_entries
from sharetree._tied import Tied
from sharetree._transforms import Transform, view_axis_names

__all__ = ["TiedModule", "tied"]

COLLECTION = "params"


def _normalize(ties: TieMap) -> tuple[tuple[Path, Tied], ...]:
    if not isinstance(ties, Mapping):
        raise TieError(
            f"tied(module, ties): expected a mapping {{target: ref or Tied}}, got "
            f"{type(ties).__name__}. Fix: tied(model, "
            "{'head/kernel': st.Tied('embed/embedding', st.T)})."
        )
    return tuple(tie_entries(ties).items())


def _box_names(box: Any, t: Transform) -> tuple[Any, ...] | None:
    """Partition names of ``t``'s view of the boxed buffer; ``None`` if its axes are unknown."""
    aval = leaf_aval(box.value)
    return None if aval is None else view_axis_names(t, box.names, aval)


def _boxes(tree: Any) -> dict[Path, Any]:
    """Every partition box of a tree, by path."""
    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    return {p: x for p, x in leaves_with_paths(tree, is_box) if is_box(x)}


def _value_fix(target: Path, t: Tied) -> str:
    return (
        f"Fix: tie the value leaves, {{'{path_str(target)}/value': "
        f"st.Tied('{path_str(t.ref)}/value', {t.transform!r})}}, which keeps the target's own "
        "box and partition names."
    )


def _check_boxes(params: Any, ties: tuple[tuple[Path, Tied], ...], check: bool, where: str) -> None:
    """A tie that names a partition box must give the view the target's own partition names."""
    for target, t in ties:
        box, ref = (next(iter(_nodes_at(params, p)), None) for p in (target, t.ref))
        if not isinstance(box, meta.AxisMetadata) or ref is None:
            continue  # not a box; or a missing ref, which st.tie names with the closest paths
        if not isinstance(box, meta.Partitioned) or type(ref) is not type(box):
            raise TieError(
                f"{where}: the tie {path_str(target)!r} -> {t!r} joins a "
                f"{type(box).__name__} box and a {type(ref).__name__}; a view of a box is "
                f"rebuilt from its buffer's box, so both must be the same kind of partition box. "
                + _value_fix(target, t)
            )
        try:
            names = _box_names(ref, t.transform)
        except Exception as e:  # the view does not fit its buffer
            why = (
                str(e)
                if isinstance(e, TieError)
                else f"{one_line(e)}. Fix: use a transform that fits it"
            )
            raise TieError(
                f"{where}: the view {path_str(target)!r} ({t!r}): {t.transform!r} failed on the "
                f"partition box {path_str(t.ref)!r} of {format_aval(leaf_aval(ref.value))}: {why}"
            ) from e
        if names is None:
            raise TieError(
                f"{where}: the tie {path_str(target)!r} -> {t!r} names partition boxes, but "
                f"{t.transform!r} does not map the axes of {path_str(t.ref)!r} (names "
                f"{tuple(ref.names)}) to axes of the view, so the view's partition names are "
                "unknown. " + _value_fix(target, t)
            )
        own = (tuple(box.names), box.mesh, getattr(box, "rules", None))
        derived = (names, ref.mesh, getattr(ref, "rules", None))
        if check and own != derived:
            raise TieError(
                f"{where}: the view {path_str(target)!r} would carry the partition names "
                f"{names} ({path_str(t.ref)!r}'s {tuple(ref.names)} under {t.transform!r}), "
                f"but its own box has {tuple(box.names)}"
                + ("" if own[1:] == derived[1:] else " and a different mesh or rules")
                + ": the view would be sharded unlike the parameter it replaces. "
                + _value_fix(target, t)
            )


def _check_variables(variables: Any, where: str) -> None:
    if not isinstance(variables, Mapping):
        raise TieError(
            f"{where}: expected the variables, a dict of collections such as "
            f"{{{COLLECTION!r}: params}}, got {type(variables).__name__} {variables!r:.80}. "
            "Fix: pass what init returned (or {'params': canonical_params})."
        )


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
            raise TieError(
                f"{where}: the view {path_str(at)!r} ({structure.ties[leaf.tie]!r} at "
                f"{path_str(leaf.tie)!r}) copies the partition box of "
                f"{path_str(structure.buffer_paths[leaf.buffer][:-1])!r}, but "
                f"{leaf.transform!r} does not map its axes to axes of the view. Fix: tie the "
                "box's 'value' leaf instead, so the view keeps a box of its own."
            )
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
            raise TieError(f"{where}: in the {COLLECTION!r} collection: {e}") from None

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
            raise TieError(
                f"{self._where(method)}: the module created no {COLLECTION!r} collection "
                f"(collections: {sorted(variables)}), so the ties "
                f"{[path_str(p) for p, _ in self.ties]} have nothing to tie. "
                "Fix: initialise with the method that creates the parameters."
            )
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
                buffer = structure.buffer_paths[view.buffer]
                raise TieError(
                    f"{self._where('apply')}: the module wrote a new value to "
                    f"{COLLECTION}/{path_str(view.path)}, a view ({structure.ties[view.tie]!r} at "
                    f"{path_str(view.tie)!r}) of buffer {path_str(buffer)!r}; the "
                    "write would be lost. Fix: write the buffer instead, or untie that parameter."
                )
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
    found = getattr(state, "shape", None)
    found = f"an array of shape {tuple(found)}" if found is not None else type(state).__name__
    raise TieError(
        f"flax.serialization: the state at {serialization.current_path()!r} holds {found} "
        f"where the target holds {target!r}, a view with no values of its own (the state was "
        "saved from an untied tree). Fix: restore into an untied template, then tie it with "
        "st.tie (or sharetree.flax.tied(...).tie)."
    )


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
        raise TieError(
            f"tied(module, ties): expected a flax.linen.Module, got {type(module).__name__}. "
            "Fix: for NNX use sharetree.nnx.split; for other pytrees use st.tie."
        )
    return TiedModule(module, _normalize(ties), check)


register_box_renamer(_rename_boxes)
