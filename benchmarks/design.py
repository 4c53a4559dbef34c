"""Why the flat path compiles as it does: XLA:CPU compile time follows *distinct* kernels.

Four small programs over the same unique buffers of the tied MLP, each
returning every buffer times two (so that each output is a real kernel):

* ``leaves``: the buffers passed as separate arguments. Kernels of equal
  shape are identical, and XLA:CPU compiles identical kernels once.
* ``lax.split``: the buffers cut out of one flat vector with static offsets
  (what ``restructure`` and ``ravel_pytree``'s unravel do). Every slice has its
  own constant offset, so every kernel is distinct and compiled separately.
* ``dynamic_slice, runtime offsets``: the same cuts with the offsets passed
  as runtime arguments. The kernels are identical again and compile like
  ``leaves``. Offsets closed over, even as ``jax.Array`` or through an
  optimization barrier, become HLO constants that XLA folds back into
  distinct slices.
* ``dynamic_slice, offsets from a cond``: the same cuts, the offsets closed
  over but returned by a ``lax.cond`` whose predicate XLA cannot evaluate
  (both branches return the same offsets): what ``restructure`` does under
  ``jit`` on CPU. The kernels are identical, as with runtime arguments.
* ``flat[a:b] per leaf, under grad``: naive static slicing differentiated by
  JAX: each slice transposes to a full-size pad, summed: a quadratic backward
  (compare its run time with ``lax.split``'s, whose transpose is one concatenate).
* ``restructure``, closed over: a ``jax.custom_jvp`` split whose primal cuts
  the buffers with ``dynamic_slice`` at the cond's offsets (identical
  kernels, compiled once per shape) and whose tangent is a static split
  (linear, so reverse mode transposes it into concatenates, never a
  per-buffer pad, and ``jvp`` keeps working; from 64 buffers on, two levels
  behind an optimization barrier: groups of about sqrt(n) buffers, of 8 from
  256 buffers on), against the static ``lax.split`` it replaces.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import sharetree as st
from benchmarks import models as M
from benchmarks.suite import Section
from benchmarks.timing import compile_times, interleaved


def design_section(model: M.TiedMLP, compile_repeats: int, rounds: int) -> Section:
    """Compile times of the programs above; compile and run of the gradient designs."""
    sec = Section(model.n_leaves, "design: distinct kernels")
    flat, re = st.destructure(model.canonical)
    leaves = jax.tree.leaves(model.canonical)
    sizes, shapes = list(re.sizes), list(re.shapes)
    offsets = [int(o) for o in np.concatenate([[0], np.cumsum(sizes)[:-1]])]
    runtime_offsets = tuple(jnp.asarray(o, jnp.int32) for o in offsets)

    def by_leaves(ls: list[Any]) -> list[Any]:
        return [x * 2 for x in ls]

    def by_split(v: Any) -> list[Any]:
        return [p.reshape(s) * 2 for p, s in zip(lax.split(v, sizes), shapes)]

    def by_cond(v: Any) -> list[Any]:
        consts = tuple(np.int32(o) for o in offsets)
        pred = lax.slice(v, (0,), (1,))[0] != 0
        return by_dynamic(v, lax.cond(pred, lambda: consts, lambda: consts))

    def by_dynamic(v: Any, offs: tuple[Any, ...]) -> list[Any]:
        parts = [
            lax.dynamic_slice(v, (o,), (n,)).reshape(s) for o, n, s in zip(offs, sizes, shapes)
        ]
        return [p * 2 for p in parts]

    names = {
        "leaves": "separate leaves (identical kernels)",
        "split": "lax.split, static offsets (distinct kernels)",
        "dynamic": "dynamic_slice, runtime offsets (identical kernels)",
        "cond": "dynamic_slice, offsets from a cond (identical kernels)",
    }
    make = {
        names["leaves"]: lambda: by_leaves,
        names["split"]: lambda: by_split,
        names["dynamic"]: lambda: by_dynamic,
        names["cond"]: lambda: by_cond,
    }
    args = {
        names["leaves"]: (leaves,),
        names["split"]: (flat,),
        names["dynamic"]: (flat, runtime_offsets),
        names["cond"]: (flat,),
    }
    _, compile_s, compiled, _ = compile_times(make, args, compile_repeats)
    want = [np.asarray(x) * 2 for x in leaves]
    for name in make:
        got = compiled[name](*args[name])
        ok = len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
        sec.check(f"{name}: outputs == 2 x buffers", ok)
    sec.add_rows("compile (N outputs)", compile_s, names["leaves"])

    # Naive per-leaf slicing under grad vs lax.split: same values, quadratic backward.
    def naive(v: Any, x: Any) -> Any:
        parts = [v[o : o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]
        return M.loss(st.materialize(jax.tree_util.tree_unflatten(re.structure.treedef, parts)), x)

    def split(v: Any, x: Any) -> Any:  # the static split restructure used before
        parts = [p.reshape(s) for p, s in zip(lax.split(v, sizes), shapes)]
        return M.loss(st.materialize(jax.tree_util.tree_unflatten(re.structure.treedef, parts)), x)

    base = "static lax.split (transpose: one concatenate), grad"
    proto = "restructure, closed over (offsets from a cond), grad"
    gmake = {
        base: lambda: jax.grad(split),
        "flat[a:b] per leaf, grad": lambda: jax.grad(naive),
        proto: lambda: jax.grad(lambda v, x: M.loss(re(v), x)),
    }
    gargs = {k: (flat, model.x) for k in gmake}
    _, gcompile, gcompiled, _ = compile_times(gmake, gargs, compile_repeats)
    g = {k: np.asarray(c(*gargs[k])) for k, c in gcompiled.items()}
    ref = g[base]
    for name in ("flat[a:b] per leaf, grad", proto):
        err = float(np.max(np.abs(g[name] - ref)))
        sec.check(
            f"{name}: gradient == the static split's",
            err <= 1e-4 * float(np.max(np.abs(ref))),
            f"max |diff| {err:.3g}",
        )
    tangent = jnp.ones_like(flat)
    jvp_jit = jax.jit(lambda v, t: jax.jvp(lambda u: M.loss(re(u), model.x), (v,), (t,)))
    _, t_proto = jvp_jit(flat, tangent)
    _, t_ref = jax.jvp(lambda v: split(v, model.x), (flat,), (tangent,))
    sec.check(
        f"{proto}: jvp == the static split's",
        abs(float(t_proto) - float(t_ref)) <= 1e-4 * abs(float(t_ref)) + 1e-6,
        f"{float(t_proto)!r} vs {float(t_ref)!r}",
    )
    runs = interleaved({k: (lambda c=c, k=k: c(*gargs[k])) for k, c in gcompiled.items()}, rounds)
    sec.add_rows("grad compile", gcompile, base)
    sec.add_rows("grad run", runs, base)
    return sec
