"""Sharding trees from path patterns (the rules of ``_labels``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharetree._errors import error, one_line, wrong_type
from sharetree._labels import apply_rules, exact_pattern, rule_pairs
from sharetree._paths import Path, aval_of, path_str

__all__ = ["shardings_by_path", "check_fits"]

_WHERE = "shardings_by_path"
_EXAMPLE = "{'embed/*': P('model', None), '*': P()}"
_FIT_FIX = "or write a more specific pattern before this one (P() replicates)"
_FIX_SPEC = (
    "write a spec of the mesh's axes, each for one dimension at most (P('data', None), "
    "P(('data', 'model'), None)), or build the mesh with the axis named"
)


def _spec_of(value: Any, pattern: str) -> PartitionSpec:
    if isinstance(value, PartitionSpec):
        return value
    if value is None or isinstance(value, (tuple, list)):
        return PartitionSpec(*(value or ()))
    want = "a jax.sharding.PartitionSpec"
    raise wrong_type("E64", f"{_WHERE}: the rule {pattern!r}", want, value, f"write {_EXAMPLE}")


def _mesh_axes(mesh: Any) -> str:
    """``{'data': 2, 'model': 4}``: a mesh's axis names and sizes, for a message."""
    return "{" + ", ".join(f"{a!r}: {n}" for a, n in dict(mesh.shape).items()) + "}"


def check_fits(
    where: str, shape: tuple[int, ...], sharding: Any, fix: str, *, code: str = "E40"
) -> None:
    """The error ``code`` (``where`` first) unless ``sharding`` splits ``shape`` into equal shards.

    JAX checks it; its reason is quoted, with ``fix`` after the shared one.
    """
    try:
        if (rank := getattr(sharding, "check_compatible_aval", None)) is not None:
            rank(shape)  # more spec entries than the array has axes
        sharding.shard_shape(shape)
        return
    except (ValueError, IndexError) as e:  # IndivisibleError (a ValueError), a rank
        reason = one_line(e)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        on = f"PartitionSpec{tuple(spec)} on the mesh axes {_mesh_axes(mesh)}"
    else:
        on = repr(sharding)
    problem = f"does not fit its buffer of shape {tuple(shape)}: {on}"
    fix = f"shard that dimension over mesh axes whose sizes divide it (or not at all), {fix}"
    raise error(code, where, problem, found=reason, fix=fix)


def shardings_by_path(
    tree: Any,
    mesh: jax.sharding.Mesh,
    rules: Mapping[str, Any] | Sequence[tuple[str, Any]],
    *,
    default: PartitionSpec | None = None,
    strict: bool = True,
) -> Any:
    """A tree of ``NamedSharding`` (for ``jax.jit``, ``device_put``, Orbax): one per buffer.

    Each buffer of ``tree`` (arrays or ``jax.eval_shape(init, key)``) gets
    ``NamedSharding(mesh, spec)`` of its first matching ``{pattern: spec}`` rule
    (or ``default``), patterns and ``strict`` as for :func:`sharetree.label_by_path`;
    each ``Tied`` stays. Every spec is checked against its array.

    Raises:
        TieError: naming the path: no mesh, an unmatched leaf or unused pattern,
            a leaf that is no array, or a spec that does not fit the mesh or array.

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("model",))
        >>> params = {"embed": np.ones((16, 4)), "head": st.Tied("embed", st.T), "b": np.zeros(4)}
        >>> s = st.shardings_by_path(params, mesh, {"embed": P("model", None), "*": P()})
        >>> s["embed"].spec == P("model", None), s["b"].spec == P(), s["head"]
        (True, True, Tied('embed', T))
    """
    if not (hasattr(mesh, "shape") and hasattr(mesh, "axis_names")):
        fix = "build one with jax.make_mesh((2, 4), ('data', 'model'))"
        raise wrong_type("E162", _WHERE, "a jax.sharding.Mesh", mesh, fix)
    pairs = [(p, _spec_of(v, p)) for p, v in rule_pairs(rules, _WHERE, "PartitionSpec", _EXAMPLE)]
    fallback = None if default is None else _spec_of(default, "default")

    def shard(path: Path, x: Any, rule: tuple[str, PartitionSpec] | None) -> NamedSharding:
        aval = aval_of(x)
        if aval is None:
            fix = "pass a tree of arrays or jax.eval_shape(init, key)"
            raise wrong_type("E162", f"{_WHERE}: leaf {path_str(path)!r}", "an array", x, fix)
        pattern, spec = rule or ("default", fallback)
        if spec is None:
            where = f"{_WHERE}: leaf {path_str(path)!r} (shape {tuple(np.shape(x))})"
            none = f"matches none of the patterns {[p for p, _ in pairs]}"
            fix = f"add a pattern for it (e.g. {exact_pattern(path)!r} or '*'), or pass default=P()"
            raise error("E38", where, none, fix=fix)
        where = f"{_WHERE}: the sharding of rule {pattern!r} at {path_str(path)!r}"
        try:
            sharding = NamedSharding(mesh, spec)
        except Exception as e:  # JAX's checks of the spec against the mesh (DuplicateSpecError)
            rejects = f"JAX rejects {spec} on the mesh axes {_mesh_axes(mesh)}"
            where += f" (shape {tuple(aval.shape)})"
            raise error("E39", where, rejects, found=one_line(e), fix=_FIX_SPEC) from e
        check_fits(where, aval.shape, sharding, _FIT_FIX)
        return sharding

    return apply_rules(tree, pairs, shard, _WHERE, strict, credit_all=True, what="sharding")
