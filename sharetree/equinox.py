"""Equinox integration: ``from_shared`` turns a model built with ``eqx.nn.Shared`` into ties.

A ``Tied`` is already a field value Equinox accepts (a pytree node with no leaves), so
:func:`sharetree.tie` and :func:`sharetree.materialize` work on ``eqx.Module`` as on any
pytree, under ``eqx.filter_jit`` / ``filter_grad`` / ``filter_vmap``. This module adds the
way over from ``eqx.nn.Shared``. Import it explicitly (``import sharetree`` never needs
Equinox); see docs/integrations.md, "Equinox".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

try:
    import equinox as eqx
except ImportError as e:  # pragma: no cover - exercised only without equinox
    raise ImportError("sharetree.equinox needs Equinox: pip install equinox") from e

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError, add_context, error, wrong_type
from sharetree._paths import Path, keypath_to_path, leaves_with_paths, path_str
from sharetree._tie import tie
from sharetree._tied import Tied
from sharetree._transforms import T, Transform, astype, chain, identity, reshape, scale, transpose

__all__ = ["from_shared"]

_FIX_GET = (
    "write get as a path into the pytree, optionally through jnp.transpose, .T, "
    "reshape, astype or a product with a number (get=lambda p: p[0].weight.T); "
    "or build the tree with st.tie yourself"
)


class _Source(NamedTuple):
    """Where a value ``get`` returns comes from: an array of the pytree and the transform."""

    leaf: int  # the index of the array among the pytree's arrays (flatten order)
    transform: Transform


def _literal(v: Any) -> Any:
    """The value of a jaxpr literal (or ``None`` for a variable)."""
    return getattr(v, "val", None) if type(v).__name__ == "Literal" else None


def _step(eqn: Any, where: str) -> tuple[Any, Transform]:
    """The input variable of one equation of ``get``'s program and the transform it applies."""
    name, params = eqn.primitive.name, eqn.params
    variables = [v for v in eqn.invars if _literal(v) is None]
    if len(variables) != 1:
        found = f"{name} of {len(variables)} arrays of the pytree"
        raise error("E251", where, "is no view of one array", found=found, fix=_FIX_GET)
    (var,) = variables
    ndim = len(var.aval.shape)
    if name == "transpose":
        perm = tuple(params["permutation"])
        return var, T if perm == tuple(range(ndim))[::-1] else transpose(perm)
    if name == "reshape" and params.get("dimensions") is None:
        return var, reshape(tuple(params["new_sizes"]))
    if name == "convert_element_type":
        return var, astype(np.dtype(params["new_dtype"]))
    if name == "mul":
        (constant,) = [_literal(v) for v in eqn.invars if _literal(v) is not None] or [None]
        if constant is not None and np.ndim(constant) == 0:
            return var, scale(np.asarray(constant).item())
    if name in ("pjit", "jit", "closed_call"):
        inner = params.get("jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        if inner is not None and len(inner.outvars) == 1:
            position = list(eqn.invars).index(var)
            traced = _trace(inner, inner.outvars[0], where)
            if traced is not None and traced[0] is inner.invars[position]:
                return var, traced[1]
    shown = name + (f" {dict(params)}" if name in ("reshape", "mul") else "")
    raise error("E251", where, "is no view of one array", found=f"{shown} in get", fix=_FIX_GET)


def _trace(jaxpr: Any, var: Any, where: str) -> tuple[Any, Transform] | None:
    """The input variable ``var`` is computed from, and the composed transform; None: a constant."""
    producers = {id(o): e for e in jaxpr.eqns for o in e.outvars}
    steps: list[Transform] = []
    while id(var) in producers:
        var, t = _step(producers[id(var)], where)
        steps.append(t)
    if not any(var is v for v in jaxpr.invars):
        return None  # a constant get closes over: no array of the pytree
    return var, chain(*reversed(steps)) if steps else identity


def _sources(get_: Any, pytree: Any, where: str) -> tuple[Any, list[_Source | None]]:
    """``get(pytree)`` and, for each of its array leaves, the array of the pytree and transform."""
    arrays, static = eqx.partition(pytree, eqx.is_array)

    def arrays_of_get(arrays: Any) -> Any:
        return eqx.filter(get_(eqx.combine(arrays, static)), eqx.is_array)

    closed = jax.make_jaxpr(arrays_of_get)(arrays)
    jaxpr = closed.jaxpr
    out: list[_Source | None] = []
    for var in jaxpr.outvars:
        found = _trace(jaxpr, var, where) if _literal(var) is None else None
        if found is None:
            fix = "tie arrays of the pytree; keep constants out of get"
            raise error("E251", where, "returns an array that is no array of the pytree", fix=fix)
        out.append(_Source(list(jaxpr.invars).index(found[0]), found[1]))
    return get_(pytree), out


def _path_of(tree: Any, node: Any) -> Path | None:
    """The path of the node ``node`` (by identity) in ``tree``, or ``None``."""
    for kp, x in jtu.tree_leaves_with_path(tree, is_leaf=lambda x: x is node):
        if x is node:
            return keypath_to_path(kp)
    return None


def _as_list(x: Any, n: int | None) -> list[Any]:
    return list(x) if n is not None else [x]


def _from_one(shared: Any) -> Any:
    """The tied tree of one ``eqx.nn.Shared``."""
    pytree = shared.pytree
    placeholders = shared.where(pytree)
    many = isinstance(placeholders, Sequence) and not isinstance(placeholders, str)
    n = len(placeholders) if many else None
    targets = [_path_of(pytree, p) or () for p in _as_list(placeholders, n)]
    shown = ", ".join(repr(path_str(p)) for p in targets)
    where = (
        f"sharetree.equinox.from_shared: the eqx.nn.Shared of {type(pytree).__name__} at {shown}"
    )
    values, sources = _sources(shared.get, pytree, where + ", its get")
    arrays = [p for p, _ in leaves_with_paths(eqx.filter(pytree, eqx.is_array))]
    full = shared()  # the model with a copy at each target: what the ties must reproduce
    ties: dict[Path, Tied] = {}
    k = 0  # the next array leaf of get's value
    for target, value in zip(targets, _as_list(values, n), strict=True):
        node = _path_of(pytree, value)
        count = len(jax.tree.leaves(eqx.filter(value, eqx.is_array)))
        if node is not None:  # get returned a node of the pytree itself: one tie, no transform
            ties[target] = Tied(node)
        else:
            array_paths = [p for p, x in leaves_with_paths(value) if eqx.is_array(x)]
            for rel, source in zip(array_paths, sources[k : k + count], strict=True):
                assert source is not None
                ties[target + rel] = Tied(arrays[source.leaf], source.transform)
        k += count
    concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(full))
    try:  # each view checked against get's own value: shape and dtype, and bits when concrete
        return tie(full, ties, atol=0.0 if concrete else None)
    except TieError as e:
        add_context(e, f"in {where}: the ties read from its where and get")
        raise


def from_shared(tree: Any) -> Any:
    """Replace each ``eqx.nn.Shared`` in ``tree`` by its pytree with ties: one buffer, views.

    ``eqx.nn.Shared(pytree, where, get)`` removes the nodes at ``where`` and puts
    ``get(pytree)`` back at every call. The tied tree holds at each ``where`` node a
    ``Tied`` naming the array ``get`` reads, with the transform ``get`` applies (``.T`` or
    ``jnp.transpose``, ``reshape``, ``astype``, a product with a number, and chains of
    them), so :func:`sharetree.materialize` gives what ``shared()`` gives, bit for bit
    (checked here). Gradients, optax and ``eqx.filter_*`` see each buffer once, as with
    ``Shared``. Back: ``eqx.nn.Shared(st.materialize(tied), where, get)``.

    Args:
        tree: an ``eqx.nn.Shared``, or any pytree (a model) holding some.

    Returns:
        ``tree`` with each ``Shared`` replaced by its pytree, tied (call
        ``st.materialize`` where the model called ``shared()``).

    Raises:
        TieTypeError: ``tree`` holds no ``eqx.nn.Shared`` (E250).
        TieError: a ``get`` that is no view of one array of the pytree (E251).

    Example:
        >>> import equinox as eqx, jax, sharetree as st, sharetree.equinox
        >>> embed = eqx.nn.Embedding(10, 4, key=jax.random.key(0))
        >>> head = eqx.nn.Linear(4, 10, key=jax.random.key(1))
        >>> shared = eqx.nn.Shared((embed, head), lambda p: p[1].weight, lambda p: p[0].weight)
        >>> st.equinox.from_shared(shared)[1].weight
        Tied('0/weight')
    """
    is_shared = lambda x: isinstance(x, eqx.nn.Shared)  # noqa: E731
    if is_shared(tree):
        return _from_one(tree)
    if not any(is_shared(x) for x in jax.tree.leaves(tree, is_leaf=is_shared)):
        fix = "pass a model holding eqx.nn.Shared; for other trees use st.tie"
        raise wrong_type("E250", "sharetree.equinox.from_shared", "an eqx.nn.Shared", tree, fix)
    return jax.tree.map(lambda x: _from_one(x) if is_shared(x) else x, tree, is_leaf=is_shared)
