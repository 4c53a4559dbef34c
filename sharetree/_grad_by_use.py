"""``grad_by_use``: the gradient of a shared buffer, split by the position that uses it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from sharetree._errors import error, wrong_type
from sharetree._materialize import expand_leaves, expanded_tree, leaf_aval, leaves_and_structure
from sharetree._paths import Path, format_aval, path_key, path_str
from sharetree._resolve import Structure
from sharetree._transforms import Transform, identity

__all__ = ["grad_by_use", "join_view", "ByUse"]

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
            t = leaf.transform
            if leaf.buffer >= n:  # computed from a join: a contribution to each buffer it reads
                parents = structure.parents[leaf.buffer]
                use = functools.partial(join_view, structure, leaf.buffer, t or identity)
                _, vjp = jax.vjp(use, {b: leaves[b] for b in parents})
                for b, gb in vjp(g)[0].items():
                    by_use[path_key(structure.buffer_paths[b])][path_key(leaf.path)] = gb
                continue
            if t is not None and t != identity:
                _, vjp = jax.vjp(t, leaves[leaf.buffer])
                (g,) = vjp(g)
            by_use[path_key(structure.buffer_paths[leaf.buffer])][path_key(leaf.path)] = g
        return (by_use, aux) if has_aux else by_use

    return by_use_fun


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
