"""``grad_by_use``: the gradient of a shared buffer, split by the position that uses it."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sharetree._errors import error, wrong_type
from sharetree._materialize import expand_leaves, expanded_tree, leaf_aval, leaves_and_structure
from sharetree._paths import Path, format_aval, path_key, path_str
from sharetree._resolve import Leaf, Structure
from sharetree._transforms import Transform, chain, identity, parts_of

__all__ = ["grad_by_use", "join_view", "by_entry", "ByUse"]

_ONE_INT = "one non-negative int, the position of the tied tree among the arguments"
_FIX_ARGNUMS = "pass argnums=0 (or the tree's index); put trees that share buffers in one dict"
_FIX_ARGS = "pass the tied tree positionally, e.g. grad_by_use(loss)(tree, batch)"
_INEXACT = "a floating or complex array (one with a gradient)"
_FIX_LEAF = "keep step counters, strings and PRNG keys in another argument than the parameters"

ByUse = dict[str | Path, dict[str | Path, Any]]
"""``{buffer path: {use path: contribution}}``: what :func:`grad_by_use` returns."""


def grad_by_use(
    fun: Callable[..., Any], argnums: int = 0, *, has_aux: bool = False
) -> Callable[..., Any]:
    """Like ``jax.grad``, but each buffer's gradient comes back split by the use it comes from.

    The returned function takes ``fun``'s arguments (the tied tree at ``argnums``),
    calls ``fun`` with the *materialized* tree and gives ``{buffer: {use:
    contribution}}`` (and ``aux`` with ``has_aux``) for :func:`sharetree.grad_report`.
    The uses of a buffer are its own position and each view, pulled back through
    the view's transform by its VJP; they sum to the buffer's ``jax.grad``. A view
    computed from several buffers (``Tied({name: ref}, st.lora())``, or a view of
    one) is a use of each of them: the VJP of its whole path gives each its part.

    A view that gathers entries (``Tied("blocks", st.take(order))``: the passes of a
    looped model) is one use per pass, keyed ``"layers/w[3]"`` (pass 3), each the
    buffer-shaped contribution of that pass alone; an input of a several-input view
    that reads a buffer another of its inputs reads too is keyed by its name
    (``"v[base]"``). Still one backward pass of ``fun``; then one pull-back per view.

    Raises:
        TieError: bad ``argnums``, too few positional arguments, a leaf with
            no gradient (not floating or complex), or a bad graph.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> tree = {"enc": jnp.array([[1.0, 2.0]]), "dec": st.Tied("enc", st.T)}
        >>> x = jnp.array([3.0, 4.0])
        >>> loss = lambda m, x: (m["enc"] @ x).sum() + (m["dec"] * x[:, None]).sum()
        >>> by_use = st.grad_by_use(loss)(tree, x)
        >>> {use: g.tolist() for use, g in by_use["enc"].items()}
        {'dec': [[3.0, 4.0]], 'enc': [[3.0, 4.0]]}
    """
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise wrong_type("E23", "grad_by_use: argnums", _ONE_INT, argnums, _FIX_ARGNUMS)
    if argnums < 0:
        where, found = "grad_by_use: argnums", str(argnums)
        raise error("E23", where, expected=_ONE_INT, found=found, fix=_FIX_ARGNUMS)
    if not callable(fun):
        raise wrong_type("E23", "grad_by_use: fun", "a function", fun, "pass the loss function")

    @functools.wraps(fun)
    def by_use_fun(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= argnums:
            where, found = f"grad_by_use(argnums={argnums})", f"{len(args)} positional argument(s)"
            want = f"the tree as positional argument {argnums}"
            raise error("E23", where, expected=want, found=found, fix=_FIX_ARGS)
        leaves, structure = leaves_and_structure(args[argnums])

        def on_materialized(flat: list[Any]) -> Any:
            m = expanded_tree(structure, leaves, flat, "grad_by_use")
            return fun(*args[:argnums], m, *args[argnums + 1 :], **kwargs)

        expanded = expand_leaves(structure, leaves)
        for leaf, x in zip(structure.expanded, expanded):
            aval = leaf_aval(x)
            if aval is None or not jax.dtypes.issubdtype(aval.dtype, jax.numpy.inexact):
                where = f"grad_by_use: the leaf {path_str(leaf.path)!r} of the materialized tree"
                found = format_aval(aval) if aval is not None else type(x).__name__
                raise error("E67", where, expected=_INEXACT, found=found, fix=_FIX_LEAF)
        # one gradient w.r.t. every position of the materialized tree (the untied gradient)
        out = jax.grad(on_materialized, has_aux=has_aux)(expanded)
        grads, aux = out if has_aux else (out, None)
        by_use: ByUse = {path_key(p): {} for p in structure.buffer_paths}
        n = len(structure.buffer_paths)
        for leaf, g in zip(structure.expanded, grads, strict=True):
            if leaf.buffer >= n:  # computed from a join: a contribution to each buffer it reads
                parts = _join_uses(structure, leaves, leaf, g)
            else:  # one per pass where the view gathers entries
                pulled = by_entry(leaf.transform, leaves[leaf.buffer], g)
                parts = [(leaf.buffer, _key(path_key(leaf.path), e), gb) for e, gb in pulled]
            for b, key, gb in parts:
                _add(by_use[path_key(structure.buffer_paths[b])], key, gb)
        return (by_use, aux) if has_aux else by_use

    return by_use_fun


def _key(key: str | Path, *labels: str | None) -> str | Path:
    """``key`` with ``[label]`` appended for each label given (the input, the pass)."""
    tail = "".join(f"[{x}]" for x in labels if x is not None)
    if not tail:
        return key
    return f"{key}{tail}" if isinstance(key, str) else (*key[:-1], f"{key[-1]}{tail}")


def _add(uses: dict[str | Path, Any], key: str | Path, g: Any) -> None:
    uses[key] = uses[key] + g if key in uses else g


def by_entry(t: Transform | None, x: Any, g: Any) -> list[tuple[str | None, Any]]:
    """The cotangent ``g`` of the view ``t(x)`` pulled back into ``x``, one part per pass.

    A view with a step that gathers entries (``take``, after a ``reshape`` too) gives
    one part per entry it reads, labelled by its position in the view (``"0"``,
    ``"1"``, ...); any other view one part labelled ``None``. The parts sum to the
    view's VJP.
    """
    if t is None or t == identity:
        return [(None, g)]
    x = jnp.asarray(x)
    parts, y, k = parts_of(t), x, 0
    gather = parts[0].gathers(jax.ShapeDtypeStruct(y.shape, y.dtype))
    while gather is None and k + 1 < len(parts):  # the first step that gathers, its input y
        y, k = parts[k](y), k + 1
        gather = parts[k].gathers(jax.ShapeDtypeStruct(y.shape, y.dtype))
    if gather is None:
        _, vjp = jax.vjp(t, x)
        return [(None, vjp(g)[0])]
    if k + 1 < len(parts):  # back through the steps after the gather, once
        _, vjp_after = jax.vjp(chain(*parts[k + 1 :]), parts[k](y))
        (g,) = vjp_after(g)
    _, vjp_before = jax.vjp(chain(*parts[:k]), x)  # identity when the gather is first
    zero = jnp.zeros_like(y)
    out: list[tuple[str | None, Any]] = []
    axis, sources = gather  # entry e of the view is entry sources[e] of y, along axis
    for e, i in enumerate(sources):
        entry = jax.lax.slice_in_dim(g, e, e + 1, axis=axis).astype(y.dtype)
        placed = jax.lax.dynamic_update_slice_in_dim(zero, entry, i, axis)
        out.append((str(e), placed if k == 0 else vjp_before(placed)[0]))
    return out


def _join_uses(
    structure: Structure, leaves: list[Any], leaf: Leaf, g: Any
) -> list[tuple[int, str | Path, Any]]:
    """``(buffer, use key, contribution)`` of a leaf computed from a join, per input and pass.

    An input that reads a buffer another input of the join reads too is keyed by its
    name (``path[base]``); an input that gathers by pass too (``path[3]``).
    """
    n = len(structure.buffer_paths)
    join = structure.joins[leaf.buffer - n]
    reads = collections.Counter(b for _, x in join.inputs for b in structure.parents[x.source])

    def source_value(src: int, buffers: dict[int, Any]) -> Any:
        return buffers[src] if src < n else join_view(structure, src, identity, buffers)

    every = {b: leaves[b] for b in structure.parents[leaf.buffer]}
    values = {name: x.transform(source_value(x.source, every)) for name, x in join.inputs}
    _, vjp = jax.vjp(lambda v: (leaf.transform or identity)(join.transform(v)), values)
    (cotangents,) = vjp(g)
    out: list[tuple[int, str | Path, Any]] = []
    for name, x in join.inputs:
        label = name if any(reads[b] > 1 for b in structure.parents[x.source]) else None
        key = _key(path_key(leaf.path), label)
        if x.source < n:
            for entry, gb in by_entry(x.transform, leaves[x.source], cotangents[name]):
                out.append((x.source, _key(key, entry), gb))
            continue
        parents = {b: leaves[b] for b in structure.parents[x.source]}
        _, vjp_in = jax.vjp(lambda bs, x=x: x.transform(source_value(x.source, bs)), parents)
        out += [(b, key, gb) for b, gb in vjp_in(cotangents[name])[0].items()]
    return out


def join_view(structure: Structure, source: int, t: Transform, buffers: dict[int, Any]) -> Any:
    """``t`` of the join ``source``, computed from the ``buffers`` it reads (by index).

    Only the joins ``source`` reads are computed (``buffers`` needs only its
    ``structure.parents``); pure JAX, for ``jax.vjp`` by use and for comparing copies.
    """
    n = len(structure.buffer_paths)
    needed: set[int] = set()
    stack = [source]
    while stack:  # the joins ``source`` reads, through other joins
        i = stack.pop()
        if i >= n and i not in needed:
            needed.add(i)
            stack += [x.source for _, x in structure.joins[i - n].inputs]
    values: dict[int, Any] = dict(buffers)
    for i in sorted(needed):  # joins are in dependency order: inputs first
        join = structure.joins[i - n]
        inputs = {name: x.transform(values[x.source]) for name, x in join.inputs}
        values[i] = join.transform(inputs)  # type: ignore[arg-type]  # several: a dict
    return t(values[source])
