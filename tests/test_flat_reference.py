"""Every ``restructure`` path against a reference that shares no code with it.

The reference is ``jax.flatten_util.ravel_pytree`` of the buffers (in the
tree's flatten order) and each view written out by hand in ``jnp`` from a plain
recipe (``("T",)``, ``("scale", c)``, ...); gradients, tangents and batches of
the reference come from JAX's own AD and ``vmap`` of that function. sharetree's
transform objects appear only where the canonical tree is built.

Hypothesis draws trees of 1 to ~300 buffers, about a third of the positions
views (tied through every transform, some through another view), so each path
of ``restructure`` is reached with ties:

- plain: eagerly, or under ``jit`` with fewer than ``_OPAQUE_MIN`` buffers, one
  ``lax.split``;
- opaque: under ``jit`` from ``_OPAQUE_MIN`` buffers on (dynamic slices at
  offsets XLA cannot fold), its tangent one split;
- grouped: from ``_GROUPED_MIN`` buffers, the tangent split in ~sqrt(n) groups;
- fused: from ``_FUSED_GROUPS_MIN`` buffers, groups of ``_FUSED_GROUP``.

Each example checks the flat vector, the values (eager, ``jit`` closed over and
with the restructure as an argument, ``vmap`` over a batch of three), the
gradient (``jit(grad)``, closed over and as an argument), ``jvp`` and
``vmap(grad)``, and which path the traced program took. The number of
examples per path is small (10, 5, 2, 1): each example compiles three programs
of up to ~300 buffers with their gradients, tangents and a vmap, a few CPU
seconds each; the small paths get the most examples.
"""

from __future__ import annotations

import collections
import re as re_module

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as hs
from jax.flatten_util import ravel_pytree

import sharetree as st
from sharetree import _flat

SHAPES = [(), (1,), (3,), (2, 3), (3, 2), (2, 2, 2)]
# (recipe, the sharetree transform it builds); a recipe is what the reference computes
RECIPES = [
    ((), st.identity),
    ((("T",),), st.T),
    ((("reshape", -1),), st.reshape(-1)),
    ((("scale", -1.5),), st.scale(-1.5)),
    ((("scale", 0.3),), st.scale(0.3)),
    ((("astype", "float16"),), st.astype(jnp.float16)),
    ((("T",), ("scale", 2.0)), st.T >> st.scale(2.0)),
]
F32_TOL = 1e-5  # float32: sums of a few cotangents may be added in another order
HALF_TOL = 2 * float(jnp.finfo(jnp.float16).eps)  # a float16 rounding placed elsewhere by XLA

# (first buffer count, last buffer count, examples) per path; the bounds come from
# sharetree's own constants so the strategy follows them if they move
PATHS = {
    "plain": (1, _flat._OPAQUE_MIN - 1, 10),
    "opaque": (_flat._OPAQUE_MIN, _flat._GROUPED_MIN - 1, 5),
    "grouped": (_flat._GROUPED_MIN, _flat._GROUPED_MIN + 40, 2),
    "fused": (_flat._FUSED_GROUPS_MIN, _flat._FUSED_GROUPS_MIN + 20, 1),
}


def _by_hand(recipe, x):
    """A view's value written out in jnp, one recipe step at a time."""
    for kind, *arg in recipe:
        if kind == "T":
            x = jnp.transpose(x)
        elif kind == "reshape":
            x = jnp.reshape(x, arg)
        elif kind == "scale":
            x = x * arg[0]
        elif kind == "astype":
            x = x.astype(arg[0])
        else:
            raise AssertionError(kind)
    return x


class Case:
    """A tree of buffers and views, its canonical form and the recipe of every view."""

    def __init__(self, shapes, dtypes, views, seed):
        rng = np.random.default_rng(seed)
        n = len(shapes)
        self.keys = [f"p{i:03d}" for i in range(n + len(views))]  # flatten order = this order
        order = rng.permutation(len(self.keys))  # views interleaved with buffers
        self.buffer_keys = [self.keys[i] for i in sorted(order[:n])]
        view_keys = [self.keys[i] for i in sorted(order[n:])]
        self.buffers = [
            jnp.asarray(rng.normal(size=s), d) for s, d in zip(shapes, dtypes, strict=True)
        ]
        # view key -> (the key it points at, recipe, sharetree transform)
        self.views = {}
        for key, (target, on_view, which) in zip(view_keys, views, strict=True):
            recipe, transform = RECIPES[which]
            ref = self.buffer_keys[target % n]
            earlier = [k for k in self.views if self.views[k][0] in self.buffer_keys]
            if on_view and earlier:  # a view of a view: a chain the resolver composes
                ref = earlier[target % len(earlier)]
            self.views[key] = (ref, recipe, transform)
        self.canonical = {k: b for k, b in zip(self.buffer_keys, self.buffers, strict=True)}
        self.canonical.update({k: st.Tied(r, t) for k, (r, _, t) in self.views.items()})
        self.half = any(b.dtype == jnp.float16 for b in self.buffers) or any(
            step[0] == "astype" for k in self.views for step in self._chain(k)
        )

    def _chain(self, key):
        if key in self.buffer_keys:
            return ()
        ref, recipe, _ = self.views[key]
        return self._chain(ref) + recipe

    def tree_by_hand(self, buffers):
        """The materialized tree from a list of buffers, every view computed by hand."""
        values = dict(zip(self.buffer_keys, buffers, strict=True))

        def value(key):
            if key not in values:
                ref, recipe, _ = self.views[key]
                values[key] = _by_hand(recipe, value(ref))
            return values[key]

        return {k: value(k) for k in self.keys}

    def reference(self, t):
        """``(flat, at)`` from ``ravel_pytree`` of the buffers, every view by hand.

        ``at(v)`` gives the materialized tree at ``v``, the gradient of ``_loss``
        (taken on the list of buffers, then raveled) and its tangent along ``t``.
        """
        flat, unravel = ravel_pytree(self.buffers)

        def loss_of_buffers(buffers):
            return _loss(self.tree_by_hand(buffers))

        def at(v):
            buffers = unravel(v)
            gradient = ravel_pytree(jax.grad(loss_of_buffers)(buffers))[0]
            tangent = jax.jvp(loss_of_buffers, (buffers,), (unravel(t),))[1]
            return self.tree_by_hand(buffers), gradient, tangent

        return flat, at


def _loss(m):
    # every element of every position gets its own weight: a gradient sent to the wrong
    # buffer, or the wrong element of one, shows; one concatenate keeps the program small
    x = jnp.concatenate([m[key].astype(jnp.float32).ravel() for key in sorted(m)])
    return jnp.sum(jnp.sin(x) * jnp.cos(0.37 * jnp.arange(x.size, dtype=jnp.float32)))


@hs.composite
def cases(draw, path):
    lo, hi, _ = PATHS[path]
    n = draw(hs.integers(lo, hi))
    shapes = draw(hs.lists(hs.sampled_from(SHAPES), min_size=n, max_size=n))
    dtypes = [jnp.float16 if draw(hs.integers(0, 19)) == 0 else jnp.float32 for _ in range(n)]
    n_views = draw(hs.integers(1, max(1, n // 4)))
    views = draw(
        hs.lists(
            hs.tuples(hs.integers(0, 10**6), hs.booleans(), hs.integers(0, len(RECIPES) - 1)),
            min_size=n_views,
            max_size=n_views,
        )
    )
    return Case(shapes, dtypes, views, draw(hs.integers(0, 2**32 - 1)))


def _assert_path(path, re, flat):
    """The gradient program lowered for CPU is the one this path builds (the example reached it).

    Counted in the StableHLO for CPU (``platform_dependent`` picks the CPU branch there),
    with a loss of one sum per position (no concatenate of its own).
    """
    n = len(re.sizes)

    def loss(v):
        return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(re(v)))

    text = jax.jit(jax.grad(loss)).trace(flat).lower(lowering_platforms=("cpu",)).as_text()
    ops = collections.Counter(re_module.findall(r"stablehlo\.(\w+)", text))
    if path == "plain":
        assert "dynamic_slice" not in ops and ops["concatenate"] <= 1, (path, n, ops)
        return
    assert ops["dynamic_slice"] == n, (path, n, ops)  # opaque offsets: one slice per buffer
    if path in ("grouped", "fused"):  # the tangent split in groups behind a barrier
        assert ops["concatenate"] > 1 and ops["optimization_barrier"] >= 1, (path, n, ops)


def _close(got, want):
    """Equal trees, values to 4 units in the last place of their dtype.

    The slices are exact; a chain of views may be folded by sharetree's normal form
    (two scales become one product) or computed in float32 and rounded once by XLA
    where the reference rounds at each step.
    """
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        rtol = 4 * float(jnp.finfo(a.dtype).eps)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol)


def _check(case, path):
    event(path)
    flat, re = st.destructure(case.canonical)
    t = jnp.cos(jnp.arange(flat.size, dtype=flat.dtype))
    ref_flat, ref_at = case.reference(t)
    assert re.size == ref_flat.size and len(re.sizes) == len(case.buffers)
    np.testing.assert_array_equal(flat, ref_flat)  # buffers in flatten order, promoted
    v = flat * 1.5 - 0.25  # another point than the tree's own values
    batch = jnp.stack([v, -v, 0.5 * v])
    tol = HALF_TOL if case.half else F32_TOL

    def sharetree_at(r, tangent=True):
        def at(v):
            f = lambda u: _loss(r(u))  # noqa: E731
            values, grad = r(v), jax.grad(f)(v)
            return (values, grad, jax.jvp(f, (v,), (t,))[1]) if tangent else (values, grad)

        return at

    want = jax.jit(ref_at)  # compiled once, called at each point
    want_v = want(v)
    if path == "plain":
        _close(re(v), want_v[0])  # eagerly
    # closed over: values, gradient and tangent at v, values and gradients over a batch;
    # as an argument: values and gradient (one compile each)
    at = sharetree_at(re)
    got, got_batch = jax.jit(lambda v, b: (at(v), jax.vmap(lambda u: at(u)[:2])(b)))(v, batch)
    as_arg = jax.jit(lambda v, r: sharetree_at(r, tangent=False)(v))(v, re)
    for result in (got, as_arg):
        _close(result[0], want_v[0])
        np.testing.assert_allclose(result[1], want_v[1], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[2], want_v[2], rtol=tol, atol=tol)
    for k in range(len(batch)):  # every vector of the batch
        want_k = want(batch[k])
        _close(jax.tree.map(lambda x, k=k: x[k], got_batch[0]), want_k[0])
        np.testing.assert_allclose(got_batch[1][k], want_k[1], rtol=tol, atol=tol)
    _assert_path(path, re, flat)


@settings(max_examples=PATHS["plain"][2], deadline=None)
@given(cases("plain"))
def test_plain_split_equals_ravel_pytree_with_views_by_hand(case):
    _check(case, "plain")


@settings(max_examples=PATHS["opaque"][2], deadline=None)
@given(cases("opaque"))
def test_opaque_offsets_equal_ravel_pytree_with_views_by_hand(case):
    _check(case, "opaque")


@settings(max_examples=PATHS["grouped"][2], deadline=None)
@given(cases("grouped"))
def test_grouped_tangent_equals_ravel_pytree_with_views_by_hand(case):
    _check(case, "grouped")


@settings(max_examples=PATHS["fused"][2], deadline=None)
@given(cases("fused"))
def test_fused_groups_equal_ravel_pytree_with_views_by_hand(case):
    _check(case, "fused")
