"""Sharding trees from path patterns (the rules of ``_labels``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharetree._errors import TieError
from sharetree._labels import _apply_rules, _rules
from sharetree._paths import Path, aval_of, path_str

__all__ = ["shardings_by_path"]

_WHERE = "shardings_by_path"
_EXAMPLE = "{'embed/*': P('model', None), '*': P()}"


def _spec_of(value: Any, pattern: str) -> PartitionSpec:
    if isinstance(value, PartitionSpec):
        return value
    if value is None or isinstance(value, (tuple, list)):
        return PartitionSpec(*(value or ()))
    raise TieError(
        f"{_WHERE}: the rule {pattern!r} gives {type(value).__name__} {value!r}; expected a "
        f"jax.sharding.PartitionSpec. Fix: write {_EXAMPLE}."
    )


def _axes(entry: Any) -> tuple[Any, ...]:
    """The mesh axis names of one PartitionSpec entry (``None``, a name or a tuple of names)."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _check(path: Path, shape: tuple[int, ...], spec: PartitionSpec, rule: str, mesh: Any) -> None:
    where = f"{_WHERE}: {path_str(path)!r} (shape {tuple(shape)}, rule {rule!r} -> {spec})"
    if len(spec) > len(shape):
        raise TieError(
            f"{where}: the spec has {len(spec)} entries but the array has {len(shape)} "
            f"dimension(s). Fix: give at most {len(shape)} entries (P() replicates), or write "
            "a more specific pattern before this one."
        )
    sizes = dict(mesh.shape)
    named = [a for entry in spec for a in _axes(entry)]
    twice = sorted({repr(a) for a in named if named.count(a) > 1})
    if twice:
        raise TieError(
            f"{where}: mesh axis {', '.join(twice)} is used for more than one dimension; each "
            "mesh axis can split one dimension only. Fix: name it once (P('data', None), "
            "P(('data', 'model'), None))."
        )
    for dim, axes in enumerate(map(_axes, spec)):
        for axis in axes:
            if axis not in sizes:
                raise TieError(
                    f"{where}: mesh axis {axis!r} does not exist; the mesh has axes "
                    f"{tuple(sizes)} (sizes {tuple(sizes.values())}). Fix: name one of "
                    f"{tuple(sizes)}, or build the mesh with an axis {axis!r}."
                )
        size = math.prod(sizes[a] for a in axes)
        if size > 1 and shape[dim] % size:
            names = axes[0] if len(axes) == 1 else axes
            raise TieError(
                f"{where}: dimension {dim} has size {shape[dim]}, which mesh axis {names!r} of "
                f"size {size} does not divide. Fix: pad the dimension to a multiple of {size}, "
                "shard another dimension, or replicate it (None in the spec)."
            )


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
        raise TieError(
            f"{_WHERE}: expected a jax.sharding.Mesh, got {type(mesh).__name__} {mesh!r}. "
            "Fix: build one with jax.make_mesh((2, 4), ('data', 'model'))."
        )
    pairs = [(p, _spec_of(v, p)) for p, v in _rules(rules, _WHERE, "PartitionSpec", _EXAMPLE)]
    fallback = None if default is None else _spec_of(default, "default")

    def shard(path: Path, x: Any, rule: tuple[str, PartitionSpec] | None) -> NamedSharding:
        aval = aval_of(x)
        if aval is None:
            raise TieError(
                f"{_WHERE}: leaf {path_str(path)!r} is {type(x).__name__} {x!r}, not an array; "
                "only arrays take a sharding. Fix: pass a tree of arrays or "
                "jax.ShapeDtypeStruct (jax.eval_shape(init, key))."
            )
        pattern, spec = rule or ("default", fallback)
        if spec is None:
            raise TieError(
                f"{_WHERE}: leaf {path_str(path)!r} (shape {tuple(np.shape(x))}) matches none "
                f"of the patterns {[p for p, _ in pairs]}. Fix: add a pattern for it (e.g. "
                f"{path_str(path)!r} or '*'), or pass default=P()."
            )
        _check(path, aval.shape, spec, pattern, mesh)
        try:
            return NamedSharding(mesh, spec)
        except (ValueError, TypeError) as e:  # JAX's own checks of a spec against the mesh
            raise TieError(
                f"{_WHERE}: {path_str(path)!r} (rule {pattern!r} -> {spec}): JAX rejects this "
                f"spec on the mesh: {e} Fix: write a spec this mesh accepts for the rule."
            ) from e

    return _apply_rules(tree, pairs, shard, _WHERE, strict, credit_all=True, what="sharding")
