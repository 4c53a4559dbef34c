"""Every ``restructure`` path against a reference that shares no code with it.

The reference is ``jax.flatten_util.ravel_pytree`` of the buffers (in the
tree's flatten order), and in NumPy the vector cut as it lays it out, each view
written out by hand from a plain recipe (``("T",)``, ``("scale", c)``,
``("slice", start, stop, axis)``, ...) and the gradient of the loss pulled back
through each recipe by hand (``test_properties._apply`` and ``_vjp_by_hand``);
the tangent is that gradient times the tangent vector. sharetree's transform
objects appear only where the canonical tree is built.

Hypothesis draws trees with about a quarter of the positions views (tied through
every transform, some through another view), so each path of ``restructure`` is
reached with ties:

- plain: eagerly, or under ``jit`` with fewer than ``_OPAQUE_MIN`` buffers, one
  ``lax.split`` (the split every platform but CPU gets);
- opaque: under ``jit`` from ``_OPAQUE_MIN`` buffers on (dynamic slices at
  offsets XLA cannot fold), its tangent one split;
- grouped: from ``_GROUPED_MIN`` buffers, the tangent split in ~sqrt(n) groups;
- fused: from ``_FUSED_GROUPS_MIN`` buffers, groups of ``_FUSED_GROUP``.

The thresholds are module constants that ``_flat`` reads each time a program is
traced, so each example draws its own (``_thresholds``): trees of 1 to 15
buffers then take every path, 50 examples per path, each under one way drawn
(closed over, as an argument, or ``vmap``); a few examples at sharetree's own
thresholds (up to ~280 buffers) check every way with the values the library
ships with. Each example checks the flat vector, the values (and, for plain,
eagerly), the gradient and the ``jvp``, and in the program lowered for CPU which
path ran, down to the sizes in each group.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import re as re_module

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _examples import examples
from hypothesis import event, given, settings
from hypothesis import strategies as hs
from jax.flatten_util import ravel_pytree
from test_properties import _apply as _by_hand
from test_properties import _fits, _vjp_by_hand

import sharetree as st
from sharetree import _flat

SHAPES = [(), (1,), (3,), (2, 3), (3, 2), (2, 2, 2), (4, 1)]
# (recipe, the sharetree transform it builds); a recipe is what the reference computes
RECIPES = [
    ((), st.identity),
    ((("T",),), st.T),
    ((("reshape", -1),), st.reshape(-1)),
    ((("scale", -1.5),), st.scale(-1.5)),
    ((("scale", 0.3),), st.scale(0.3)),
    ((("astype", "float16"),), st.astype(jnp.float16)),
    ((("T",), ("scale", 2.0)), st.T >> st.scale(2.0)),
    ((("slice", 1, None, 0),), st.slice(1, None)),
    ((("slice", 0, -1, -1),), st.slice(0, -1, axis=-1)),
    ((("index", -1, 0),), st.index(-1)),
    ((("index", 1, -1),), st.index(1, axis=-1)),
    ((("T",), ("slice", 0, 2, 0)), st.T >> st.slice(0, 2)),
    ((("index", 0, 0), ("scale", 3.0)), st.index(0) >> st.scale(3.0)),
]
F32_TOL = 1e-5  # float32: sums of a few cotangents may be added in another order
HALF_TOL = 2 * float(jnp.finfo(jnp.float16).eps)  # a float16 rounding placed elsewhere by XLA
# the small trees compile with fewer XLA:CPU passes (values are the same; a third of the
# compile time); the examples at sharetree's own thresholds compile as users' programs do
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
NAMES = ("_OPAQUE_MIN", "_GROUPED_MIN", "_FUSED_GROUPS_MIN", "_FUSED_GROUP")
OWN = {name: getattr(_flat, name) for name in NAMES}  # sharetree's own thresholds


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
        self.flat_dtype = np.result_type(*[b.dtype for b in self.buffers])  # promoted
        shape = dict(zip(self.buffer_keys, shapes, strict=True))
        # view key -> (the key it points at, recipe, sharetree transform)
        self.views = {}
        for key, (target, on_view, which) in zip(view_keys, views, strict=True):
            ref = self.buffer_keys[target % n]
            earlier = [k for k in self.views if self.views[k][0] in self.buffer_keys]
            if on_view and earlier:  # a view of a view: a chain the resolver composes
                ref = earlier[target % len(earlier)]
            fitting = [r for r in RECIPES if _fits(r[0], shape[ref])]  # identity always fits
            recipe, transform = fitting[which % len(fitting)]
            self.views[key] = (ref, recipe, transform)
            shape[key] = _by_hand(recipe, np.zeros(shape[ref])).shape
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

    def reference(self, u, t):
        """In NumPy: the tree at the vector ``u``, the gradient of ``_loss`` there, its tangent.

        ``u`` is cut as ``ravel_pytree`` lays the buffers out (each raveled, in flatten
        order, in the promoted dtype) and each piece cast back to its buffer's dtype;
        the gradient of ``_loss`` at each position (``cos(x) * w``, cast to the
        position's dtype as the VJP of its cast to float32) is pulled back through the
        recipes by hand and added at its buffer; the tangent along ``t`` is that
        gradient dotted with ``t``.
        """
        u = np.asarray(u)
        cuts = np.cumsum([b.size for b in self.buffers])[:-1]
        buffers = [
            piece.reshape(b.shape).astype(b.dtype)
            for piece, b in zip(np.split(u, cuts), self.buffers, strict=True)
        ]
        tree = self.tree_by_hand(buffers)
        keys = sorted(tree)
        x = np.concatenate([tree[k].astype(np.float64).ravel() for k in keys])
        dx = np.cos(x) * np.cos(0.37 * np.arange(x.size))
        pieces = np.split(dx, np.cumsum([tree[k].size for k in keys])[:-1])
        grads = {k: np.zeros(b.shape, b.dtype) for k, b in zip(self.buffer_keys, buffers)}

        def pull(key, g):  # the cotangent g of position `key`, back to its buffer
            if key in grads:
                grads[key] = grads[key] + g
            else:
                ref, recipe, _ = self.views[key]
                pull(ref, _vjp_by_hand(recipe, tree[ref], g, np))

        for k, piece in zip(keys, pieces, strict=True):
            pull(k, piece.reshape(tree[k].shape).astype(tree[k].dtype))
        gradient = np.concatenate([grads[k].ravel() for k in self.buffer_keys])
        return tree, gradient.astype(u.dtype), np.dot(gradient.astype(np.float64), np.asarray(t))


def _loss(m):
    # every element of every position gets its own weight: a gradient sent to the wrong
    # buffer, or the wrong element of one, shows; one concatenate keeps the program small
    x = jnp.concatenate([m[key].astype(jnp.float32).ravel() for key in sorted(m)])
    return jnp.sum(jnp.sin(x) * jnp.cos(0.37 * jnp.arange(x.size, dtype=jnp.float32)))


@hs.composite
def cases(draw, lo, hi):
    n = draw(hs.integers(lo, hi))
    shapes = draw(hs.lists(hs.sampled_from(SHAPES), min_size=n, max_size=n))
    dtypes = [jnp.float16 if draw(hs.integers(0, 19)) == 0 else jnp.float32 for _ in range(n)]
    n_views = draw(hs.integers(1, max(1, n // 3)))
    views = draw(
        hs.lists(
            hs.tuples(hs.integers(0, 10**6), hs.booleans(), hs.integers(0, len(RECIPES) - 1)),
            min_size=n_views,
            max_size=n_views,
        )
    )
    return Case(shapes, dtypes, views, draw(hs.integers(0, 2**32 - 1)))


@hs.composite
def lowered(draw, path):
    """``(thresholds, case)``: thresholds drawn so that a case of 1 to 15 buffers takes ``path``.

    Plain raises ``_OPAQUE_MIN`` (the split other platforms get at every size), the
    other paths lower what they need; ``_flat`` follows them (``_thresholds``).
    """
    th = dict(OWN)
    if path == "plain":
        n = draw(hs.integers(1, 12))
        th["_OPAQUE_MIN"] = draw(hs.integers(max(2, n + 1), 16))
        return th, draw(cases(n, n))
    th["_OPAQUE_MIN"] = draw(hs.integers(2, 8 if path == "opaque" else 4))
    if path == "opaque":
        return th, draw(cases(th["_OPAQUE_MIN"], th["_OPAQUE_MIN"] + 6))
    th["_GROUPED_MIN"] = draw(hs.integers(4, 9 if path == "grouped" else 8))
    if path == "grouped":
        n = draw(hs.integers(th["_GROUPED_MIN"], th["_GROUPED_MIN"] + 5))
        th["_FUSED_GROUPS_MIN"] = n + 1
        return th, draw(cases(n, n))
    th["_FUSED_GROUPS_MIN"] = draw(hs.integers(max(5, th["_GROUPED_MIN"]), 10))
    th["_FUSED_GROUP"] = draw(hs.integers(2, 4))
    return th, draw(cases(th["_FUSED_GROUPS_MIN"], th["_FUSED_GROUPS_MIN"] + 5))


@contextlib.contextmanager
def _thresholds(th):
    """``_flat``'s path thresholds set to ``th`` while a case is traced, then put back.

    ``_flat`` reads them when a program is traced (``_split``, ``_grouped_split``);
    every program here is a new function, and JAX's caches are cleared on the way
    in and out, so no program traced under other thresholds is reused.
    """
    assert set(th) == set(NAMES)
    try:
        for name, value in th.items():
            setattr(_flat, name, value)
        yield
    finally:
        for name, value in OWN.items():
            setattr(_flat, name, value)


def _path_of(n, th):
    """The path the documented thresholds give ``n`` buffers under ``jit`` on CPU."""
    if n < th["_OPAQUE_MIN"]:
        return "plain"
    if n < th["_GROUPED_MIN"]:
        return "opaque"
    return "grouped" if n < th["_FUSED_GROUPS_MIN"] else "fused"


def _groups(sizes, path, th):
    """The buffer sizes each concatenate of the gradient gathers, as documented per path."""
    n = len(sizes)
    if path in ("plain", "opaque"):  # one split: its transpose, one concatenate
        return [tuple(sizes)] if n > 1 else []
    if path == "grouped":  # ~sqrt(n): the least k with k * k >= n
        per = next(k for k in itertools.count(1) if k * k >= n)
    else:
        per = th["_FUSED_GROUP"]
    groups = [tuple(sizes[i : i + per]) for i in range(0, n, per)]
    return [g for g in groups if len(g) > 1] + [tuple(sum(g) for g in groups)]


def _concatenates(text):
    """The operand sizes of each concatenate in StableHLO ``text``, one list per logical one.

    JAX lowers a concatenate of more than 16 operands as a tree of them: a
    concatenate whose operand is another concatenate's result (in the same function)
    counts as one with that operand's operands in its place.
    """
    found = []
    for body in text.split("func.func")[1:]:
        concats = {}  # result -> [(operand, size)]
        for result, operands, types in re_module.findall(
            r"(%[\w#]+) = stablehlo\.concatenate ([^:\n]*?), dim = \d+ : \(([^)]*)\)", body
        ):
            sizes = [int(s) for s in re_module.findall(r"tensor<(\d+)x", types)]
            concats[result] = list(zip(operands.split(", "), sizes, strict=True))
        used = {o for parts in concats.values() for o, _ in parts}

        def flat(result, concats=concats):
            return [s for o, n in concats[result] for s in (flat(o) if o in concats else [n])]

        found += [tuple(flat(r)) for r in concats if r not in used]
    return found


def _assert_path(path, re, flat, th, pads):
    """The gradient program lowered for CPU is the one this path builds (the example reached it).

    Counted in the StableHLO for CPU (``platform_dependent`` picks the CPU branch there),
    with a loss of one sum per position (no concatenate of its own): dynamic slices for
    opaque offsets, and the operand sizes of every concatenate, which show the groups.
    The gradient is never assembled by padding or by updates in place (``pads``: the
    VJPs of the case's slice and index views are pads of their own).
    """
    n = len(re.sizes)
    assert _path_of(n, th) == path, (n, th)

    def loss(v):
        return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(re(v)))

    text = jax.jit(jax.grad(loss)).trace(flat).lower(lowering_platforms=("cpu",)).as_text()
    ops = collections.Counter(re_module.findall(r"stablehlo\.(\w+)", text))
    concats = collections.Counter(_concatenates(text))
    assert concats == collections.Counter(_groups(re.sizes, path, th)), (path, n, concats)
    barriers = {"plain": 0, "opaque": 1}.get(path, 2)  # the offsets' predicate, the groups
    assert ops["dynamic_slice"] == (0 if path == "plain" else n), (path, n, ops)
    assert ops["optimization_barrier"] == barriers, (path, n, ops)
    assert ops["dynamic_update_slice"] == ops["scatter"] == 0 and (pads or not ops["pad"]), ops


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


def _check(case, path, th, how):
    """The case's restructure against the reference, under ``jit`` and each way in ``how``.

    ``closed``: closed over, at v: values, gradient and tangent; ``argument``: the same
    with the restructure passed to ``jit``; ``vmap``: passed in, under ``vmap`` over a
    batch of three vectors. Plain also checks the values eagerly.
    """
    event(path)
    event(f"under jit: {' + '.join(how)}")
    for _, recipe, _ in case.views.values():
        event(f"view {' >> '.join(step[0] for step in recipe) or 'identity'}")
    flat, re = st.destructure(case.canonical)
    assert re.size == sum(b.size for b in case.buffers) and len(re.sizes) == len(case.buffers)
    assert flat.dtype == case.flat_dtype
    pads = any(step[0] in ("slice", "index") for k in case.views for step in case._chain(k))
    _assert_path(path, re, flat, th, pads)
    # the points and tangent in NumPy, results read back into NumPy: no eager JAX op
    # (each would compile for the shapes of this example)
    t = np.cos(np.arange(flat.size)).astype(flat.dtype)
    v = np.asarray(flat) * 1.5 - 0.25  # another point than the tree's own values
    points = np.stack([v, -v, 0.5 * v, v + 1.0]).astype(flat.dtype)  # v, then a batch of three

    def at(r, u):
        f = lambda w: _loss(r(w))  # noqa: E731
        return r(u), jax.grad(f)(u), jax.jvp(f, (u,), (t,))[1]

    def program(points, r, buffers):  # one program: ravel_pytree of the buffers, each way
        ways = {
            "closed": lambda: at(re, points[0]),
            "argument": lambda: at(r, points[0]),
            "vmap": lambda: jax.vmap(lambda u: at(r, u))(points[1:]),
        }
        return ravel_pytree(buffers)[0], {name: ways[name]() for name in how}

    options = None if th == OWN else FAST_COMPILE
    ref_flat, results = jax.device_get(
        jax.jit(program, compiler_options=options)(points, re, case.buffers)
    )
    assert ref_flat.dtype == flat.dtype
    np.testing.assert_array_equal(flat, ref_flat)  # buffers in flatten order, promoted
    if path == "plain":  # eagerly: the plain split at every size
        _close(re(v), case.reference(v, t)[0])
    tol = HALF_TOL if case.half else F32_TOL
    for name, result in results.items():
        for k in range(1, len(points)) if name == "vmap" else [0]:  # every vector of the batch
            got = jax.tree.map(lambda x, k=k: x[k - 1], result) if name == "vmap" else result
            tree, gradient, tangent = case.reference(points[k], t)
            _close(got[0], tree)
            np.testing.assert_allclose(got[1], gradient, rtol=tol, atol=tol)
            # a float32 dot product: its rounding grows with the sum of the terms' sizes
            atol = tol * max(1.0, float(np.abs(gradient * t).sum()))
            np.testing.assert_allclose(got[2], tangent, rtol=tol, atol=atol)


def _run(path, th, case, how=("closed", "vmap")):
    with _thresholds(th):
        _check(case, path, th, how)


# ~0.7 s of CPU each (a trace and compile of the gradient of up to 15 buffers): 50 per
# path keeps the file within its share of CI; sharetree's own thresholds get a few more
LOWERED_EXAMPLES = 50
HOW = hs.sampled_from([("closed",), ("argument",), ("vmap",)])  # one way per small example


@pytest.mark.parametrize("path", ["plain", "opaque", "grouped", "fused"])
@settings(max_examples=examples(LOWERED_EXAMPLES))
@given(data=hs.data(), how=HOW)
def test_each_path_at_drawn_thresholds_equals_ravel_pytree_with_views_by_hand(path, data, how):
    _run(path, *data.draw(lowered(path), label="thresholds, case"), how)


# sharetree's own thresholds: (first, last buffer count, examples) per path; the bounds
# come from its constants so the strategy follows them if they move
OWN_PATHS = {
    "opaque": (OWN["_OPAQUE_MIN"], OWN["_GROUPED_MIN"] - 1, 2),
    "grouped": (OWN["_GROUPED_MIN"], OWN["_GROUPED_MIN"] + 40, 1),
    "fused": (OWN["_FUSED_GROUPS_MIN"], OWN["_FUSED_GROUPS_MIN"] + 20, 1),
}


@settings(max_examples=OWN_PATHS["opaque"][2])
@given(cases(*OWN_PATHS["opaque"][:2]))
def test_opaque_at_sharetree_own_thresholds(case):
    _run("opaque", OWN, case)


@settings(max_examples=OWN_PATHS["grouped"][2])
@given(cases(*OWN_PATHS["grouped"][:2]))
def test_grouped_at_sharetree_own_thresholds(case):
    _run("grouped", OWN, case)


@settings(max_examples=OWN_PATHS["fused"][2])
@given(cases(*OWN_PATHS["fused"][:2]))
def test_fused_at_sharetree_own_thresholds(case):
    _run("fused", OWN, case)
