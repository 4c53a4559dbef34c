import math
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _raises import raises
from jax.flatten_util import ravel_pytree

import sharetree as st
from sharetree import _flat


def _warned(record, code, *facts):
    """Whether one warning of ``record`` is of ``code`` and names every fact."""
    texts = [str(w.message) for w in record if str(w.message).startswith(f"[{code}]")]
    return any(all(f in text for f in facts) for text in texts)


def _ref_tree():
    return {"x": jnp.array([7.0, 7.0]), "y": jnp.array([3.0, 4.0]), "z": st.Tied("x")}


def test_optimisers_jl_reference_cases():
    flat, re = st.destructure(_ref_tree())
    np.testing.assert_array_equal(flat, [7, 7, 3, 4])
    m = re(jnp.array([1.0, 10.0, 100.0, 1000.0]))
    np.testing.assert_array_equal(m["x"], [1, 10])
    assert m["z"] is m["x"]
    g1 = jax.grad(lambda v: 3 * re(v)["x"].sum() + 13 * re(v)["z"].sum())(jnp.zeros(4))
    np.testing.assert_array_equal(g1, [16, 16, 0, 0])
    g2 = jax.grad(lambda v: 4 * (re(v)["x"].sum() + re(v)["y"].sum()) + 13 * re(v)["z"].sum())(
        jnp.zeros(4)
    )
    np.testing.assert_array_equal(g2, [17, 17, 4, 4])


def _tied_model():
    k = jax.random.split(jax.random.key(1), 4)
    return {
        "emb": jax.random.normal(k[0], (5, 3)),
        "mid": {"w": jax.random.normal(k[1], (3, 3)).astype(jnp.float16), "n": jnp.int32(2)},
        "head": st.Tied("emb", st.T),
        "act": "tanh",
        "half": st.Tied("mid/w", st.astype(jnp.float32) >> st.scale(0.5)),
    }


def _loss(m):
    h = jnp.tanh(jnp.ones(5) @ m["emb"]) @ m["mid"]["w"].astype(jnp.float32) @ m["half"]
    return jnp.sum(jnp.sin(h @ m["head"])) * m["mid"]["n"]


def test_layout_dtypes_and_statics():
    tree = _tied_model()
    flat, re = st.destructure(tree)
    assert flat.dtype == jnp.float32 and flat.shape == (15 + 9,)
    np.testing.assert_array_equal(flat[:15], tree["emb"].ravel())
    m = re(flat)
    assert m["mid"]["w"].dtype == jnp.float16 and m["act"] == "tanh" and int(m["mid"]["n"]) == 2
    np.testing.assert_array_equal(m["head"], tree["emb"].T)
    c = re.canonical(flat)
    assert c["head"] == st.Tied("emb", st.T)
    assert jax.tree.structure(c) == jax.tree.structure(tree)
    expected_leaves, _ = ravel_pytree([tree["emb"], tree["mid"]["w"]])
    np.testing.assert_array_equal(flat, expected_leaves)


def test_gradient_equals_materialize_gradient():
    tree = _tied_model()
    flat, re = st.destructure(tree)
    g_flat = jax.grad(lambda v: _loss(re(v)))(flat)
    arrays, static = _split(tree)
    g_tree = jax.grad(lambda a: _loss(st.materialize(_join(a, static))))(arrays)
    expected = jnp.concatenate(
        [g_tree["emb"].ravel(), g_tree["mid"]["w"].ravel().astype(jnp.float32)]
    )
    _assert_gradient_close(g_flat, expected)


def _assert_gradient_close(got, want):
    """``_tied_model``'s flat gradient: float32 for ``emb``, a float16 rounding for ``mid/w``.

    The float16 buffer's cotangent is rounded to float16 (JAX's VJP of its cast), and
    jit may round it at another step: one float16 ulp apart.
    """
    np.testing.assert_allclose(got[:15], want[:15], rtol=1e-5, atol=1e-6)
    half = 2 * float(jnp.finfo(jnp.float16).eps)
    np.testing.assert_allclose(got[15:], want[15:], rtol=half, atol=half * np.abs(want).max())


def _split(tree):
    arrays = {"emb": tree["emb"], "mid": {"w": tree["mid"]["w"]}}
    return arrays, tree


def _join(arrays, tree):
    return dict(tree, emb=arrays["emb"], mid=dict(tree["mid"], w=arrays["mid"]["w"]))


def test_forward_mode_and_vmap():
    tree = {"a": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": st.Tied("a", st.T), "c": jnp.ones(2)}
    flat, re = st.destructure(tree)

    def f(v):
        m = re(v)
        return jnp.sum(m["a"] @ m["b"] @ m["c"] ** 2)

    g = jax.grad(f)(flat)
    _, jv = jax.jvp(f, (flat,), (jnp.ones_like(flat),))
    np.testing.assert_allclose(jv, g.sum(), rtol=1e-5)
    np.testing.assert_allclose(jax.jacfwd(f)(flat), g, rtol=1e-5)
    np.testing.assert_allclose(jax.hessian(f)(flat), jax.jacfwd(jax.jacrev(f))(flat), rtol=1e-5)
    batch = jnp.stack([flat, 2 * flat, -flat])
    np.testing.assert_allclose(jax.vmap(f)(batch), jnp.array([f(v) for v in batch]), rtol=1e-5)


def test_restructure_is_hashable_and_does_not_retrace():
    traces = []

    def run(re, v):
        traces.append(1)
        return re(v)["x"].sum()

    jitted = jax.jit(run, static_argnums=0)
    f1, re1 = st.destructure(_ref_tree())
    f2, re2 = st.destructure(jax.tree.map(np.asarray, _ref_tree()))  # NumPy leaves: a new layout
    assert re1 == re2 and hash(re1) == hash(re2) and re1 is not re2
    jitted(re1, f1)
    jitted(re2, f2)
    assert len(traces) == 1
    other = {
        "x": jnp.array([7.0, 7.0]),
        "y": jnp.array([3.0, 4.0]),
        "z": st.Tied("x", st.scale(2.0)),
    }
    assert st.destructure(other)[1] != re1


@pytest.mark.filterwarnings("ignore:destructure. the static leaf 'n'")
def test_static_arrays_compare_by_identity_and_python_values_by_value():
    # never by their contents (which would be read on every call): the same array
    # object is the same static leaf, an equal copy is another one
    n = np.arange(3)
    _, r1 = st.destructure({"a": jnp.ones(2), "n": n})
    _, r2 = st.destructure({"a": jnp.ones(2), "n": n})
    _, r3 = st.destructure({"a": jnp.ones(2), "n": np.arange(3)})
    assert r1 == r2 and hash(r1) == hash(r2) and r1 != r3
    _, r4 = st.destructure({"a": jnp.ones(2), "n": 3})
    _, r5 = st.destructure({"a": jnp.ones(2), "n": 3})
    _, r6 = st.destructure({"a": jnp.ones(2), "n": 4})
    assert r4 == r5 and r4 != r6


def test_works_under_jit_on_traced_trees():
    tree = {k: v for k, v in _tied_model().items() if k != "act"}

    @jax.jit
    def f(t):
        flat, re = st.destructure(t)
        return re(flat * 2)["head"]

    np.testing.assert_allclose(f(tree), 2 * tree["emb"].T, rtol=1e-6)


def test_bad_flat_inputs():
    _, re = st.destructure(_ref_tree())
    with raises("E10", "expected length 4", "length 5 (+1)"):
        re(jnp.zeros(5))
    with raises("E11", "1-D", "shape (2, 2) (ndim 2)", "jax.vmap(restructure)"):
        re(jnp.zeros((2, 2)))
    with raises("E12", "floating or complex", "int32"):
        re(jnp.zeros(4, jnp.int32))
    with raises("E11", "1-D", "found list", cls=st.TieTypeError):
        re([0.0, 1.0, 2.0, 3.0])


def test_empty_and_no_inexact():
    flat, re = st.destructure({"n": np.int32(1), "s": "x"})
    assert flat.shape == (0,)
    assert re(flat) == {"n": np.int32(1), "s": "x"}


def test_complex_and_real_buffers_share_one_complex_vector():
    tree = {"c": jnp.array([1 + 2j, 3 - 1j], jnp.complex64), "r": jnp.array([1.0, 2.0])}
    flat, re = st.destructure(tree)
    assert flat.dtype == jnp.complex64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = re(flat)
        g = jax.grad(lambda v: jnp.sum(re(v)["r"] ** 2))(flat)
    assert m["r"].dtype == jnp.float32
    np.testing.assert_allclose(g, [0, 0, 2, 4])


_NO_PADDING = {"pad", "dynamic_update_slice", "scatter-add", "scatter_add"}


def _sub_jaxprs(params):
    """The jaxprs in an equation's params (``jax.extend.core.jaxprs_in_params``, jax >= 0.10)."""
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def _primitives(jaxpr):
    """Every primitive name in a jaxpr, sub-jaxprs (custom_jvp, pjit, cond) included."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for sub in _sub_jaxprs(eqn.params):
            out.extend(_primitives(sub))
    return out


def _tied_layers(layers: int, seed: int, dim: int = 2) -> dict:
    """Small layers, every 4th weight the transpose of the previous one."""
    k = jax.random.split(jax.random.key(seed), layers)
    tree = {
        f"l{i:03d}": {"w": jax.random.normal(k[i], (dim, dim)), "b": jnp.full((dim,), 0.1 * i)}
        for i in range(layers)
    }
    for i in range(3, layers, 4):
        tree[f"l{i:03d}"]["w"] = st.Tied(f"l{i - 1:03d}/w", st.T)
    return tree


def _by_hand(tree):
    """An independent restructure of a dict tree whose ties are ``Tied(leaf, T)`` or ``Tied(leaf)``.

    ``ravel_pytree`` of the buffers in JAX's flatten order (``Tied`` nodes have no
    leaves), then each view written out by hand: no sharetree layout or materialize.
    """
    found = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [tuple(k.key for k in kp) for kp, _ in found]
    unravel = ravel_pytree([x for _, x in found])[1]

    def rebuild(v):
        values = dict(zip(paths, unravel(v), strict=True))

        def build(node, path):
            if isinstance(node, dict):
                return {k: build(c, (*path, k)) for k, c in node.items()}
            if isinstance(node, st.Tied):
                x = values[node.ref]
                if node.transform == st.T:
                    return jnp.transpose(x)
                assert node.transform == st.identity, node
                return x
            return values[path]

        return build(tree, ())

    return rebuild


def _sum_of_sines(tree):
    return sum(jnp.sum(jnp.sin((j + 1) * x) * x) for j, x in enumerate(jax.tree.leaves(tree)))


def test_few_buffers_or_eager_use_one_static_split_and_one_concatenate():
    # below _OPAQUE_MIN buffers (and eagerly) the cut is one lax.split: its
    # transpose is one concatenate, no per-view full-size padding
    tree = {f"l{i}": {"w": jnp.ones((3, 3)), "b": jnp.ones(3)} for i in range(3)}
    tree["l2"]["w"] = st.Tied("l1/w", st.T)
    flat, re = st.destructure(tree)
    assert len(re.sizes) < _flat._OPAQUE_MIN
    loss = lambda v: sum(jnp.sum(jnp.tanh(x)) for x in jax.tree.leaves(re(v)))  # noqa: E731
    prims = _primitives(jax.make_jaxpr(jax.grad(loss))(flat).jaxpr)
    assert prims.count("split") == 1 and prims.count("concatenate") == 1
    assert "cond" not in prims and "dynamic_slice" not in prims
    assert not _NO_PADDING & set(prims)


def test_traced_cut_has_opaque_offsets_and_concatenate_gradient():
    # from _OPAQUE_MIN buffers on, a traced vector is cut by dynamic slices whose
    # offsets come out of a cond on a predicate behind an optimization barrier (XLA
    # cannot fold them into constant slices); the gradient is still concatenates,
    # with no padding
    tree = _tied_layers(20, seed=2)
    flat, re = st.destructure(tree)
    n = len(re.sizes)
    assert _flat._OPAQUE_MIN <= n < _flat._GROUPED_MIN
    loss = lambda v: _sum_of_sines(re(v))  # noqa: E731
    ops = _lowered_ops(jax.jit(jax.grad(loss)), flat, "cpu")
    assert ops["dynamic_slice"] == n and ops["optimization_barrier"] == 1
    assert ops["slice"] == 0 and not {"pad", "dynamic_update_slice"} & set(ops)
    # compiled: no slice was folded back into a static one
    hlo = jax.jit(jax.grad(loss)).lower(flat).compile().as_text()
    assert hlo.count(" slice(") == 0 and hlo.count("dynamic-slice(") >= n
    g = jax.jit(jax.grad(loss))(flat)
    want = jax.grad(lambda v: _sum_of_sines(_by_hand(tree)(v)))(flat)
    np.testing.assert_allclose(
        g, want, **_sum_tolerance(flat.dtype, len(jax.tree.leaves(st.materialize(tree))))
    )


def _sum_tolerance(dtype, terms: int) -> dict:
    """``rtol`` and ``atol`` for two float computations of a sum of ``terms`` terms.

    Each term may round by a few ulps of its own size in either order of evaluation
    (XLA may fuse or reorder them differently from one release to the next), so the two
    agree within about ``terms`` ulps of the dtype, relative to the values' scale.
    """
    eps = float(np.finfo(dtype).eps)
    return {"rtol": 4 * terms * eps, "atol": 4 * terms * eps}


def _lowered_ops(f, x, platform):
    """How many of each StableHLO op ``f(x)`` has when lowered for ``platform``."""
    import collections
    import re

    text = f.trace(x).lower(lowering_platforms=(platform,)).as_text()
    return collections.Counter(re.findall(r"stablehlo\.(\w+)", text))


def test_opaque_offsets_only_when_lowered_for_cpu():
    # the cond exists for XLA:CPU's compile; chosen per platform when the program is
    # lowered, so other platforms get the static split even from this CPU host
    flat, re = st.destructure(_tied_layers(20, seed=2))
    n = len(re.sizes)
    for platform in ("cuda", "tpu"):
        ops = _lowered_ops(jax.jit(re), flat, platform)
        assert ops["slice"] == n and "dynamic_slice" not in ops
        assert "optimization_barrier" not in ops


def test_opaque_offsets_do_not_depend_on_the_values():
    # the values (nan and inf included) never change where the vector is cut
    tree = _tied_layers(12, seed=5)
    flat, re = st.destructure(tree)
    heads = jax.jit(lambda v: jax.tree.leaves(re(v)))
    for first in (0.0, -3.0, jnp.nan, jnp.inf):
        v = flat.at[0].set(first)
        for got, want in zip(heads(v), jax.tree.leaves(_by_hand(tree)(v))):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n_layers", [3, 12, 40])
def test_restructure_is_linear_for_linear_transpose_at_every_size(n_layers):
    # jax.linear_transpose (gmres, custom_linear_solve, lineax) needs the split to be
    # linear in the vector with offsets that are not: at 8 or more buffers the opaque
    # offsets once came from the vector itself and linear_transpose failed inside JAX
    tree = _tied_layers(n_layers, seed=7)
    flat, re = st.destructure(tree)
    cot = jax.tree.map(lambda x: jnp.cos(x), re(flat))
    got = jax.linear_transpose(re, flat)(cot)[0]
    want = jax.vjp(_by_hand(tree), flat)[1](cot)[0]  # the transpose of the by-hand split
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    got_jit = jax.jit(lambda c: jax.linear_transpose(re, flat)(c)[0])(cot)
    np.testing.assert_allclose(got_jit, want, rtol=1e-6, atol=1e-6)


def test_restructure_passed_to_jit_gives_the_same_values_and_gradients():
    tree = _tied_model()
    flat, re = st.destructure(tree)
    arrays, static = _split(tree)
    g_tree = jax.grad(lambda a: _loss(st.materialize(_join(a, static))))(arrays)
    expected = jnp.concatenate(
        [g_tree["emb"].ravel(), g_tree["mid"]["w"].ravel().astype(jnp.float32)]
    )
    g_arg = jax.jit(jax.grad(lambda v, r: _loss(r(v))))(flat, re)
    _assert_gradient_close(g_arg, expected)
    heads = jax.jit(lambda v, r: (r(v)["head"], r(v)["half"], r.canonical(v)["mid"]["w"]))
    head, half, w = heads(flat, re)
    np.testing.assert_array_equal(head, tree["emb"].T)
    np.testing.assert_array_equal(half, 0.5 * tree["mid"]["w"].astype(jnp.float32))
    assert w.dtype == jnp.float16
    np.testing.assert_array_equal(w, tree["mid"]["w"])


def test_restructure_is_a_pytree_node_without_leaves():
    # nothing for tree_map, an optimizer or vmap to touch: no in_axes=None needed
    tree = _tied_layers(12, seed=6)
    flat, re = st.destructure(tree)
    assert jax.tree.leaves(re) == []
    doubled, same = jax.tree.map(lambda x: 2 * x, (flat, re))
    assert same is re
    np.testing.assert_array_equal(doubled, 2 * flat)
    batch = jnp.stack([flat, -flat])
    f = lambda v, r: r(v)["l005"]["b"]  # noqa: E731
    np.testing.assert_array_equal(jax.vmap(f)(batch, re), jax.vmap(f, (0, None))(batch, re))
    np.testing.assert_array_equal(jax.jit(jax.vmap(f))(batch, re)[1], -tree["l005"]["b"])
    traces = []

    def g(v, r):
        traces.append(1)
        return r(v)["l003"]["w"]

    jitted = jax.jit(g)
    np.testing.assert_array_equal(jitted(flat, re), tree["l002"]["w"].T)
    jitted(2 * flat, st.destructure(tree)[1])  # an equal restructure: no retrace
    assert len(traces) == 1


def test_restructure_under_optax():
    optax = pytest.importorskip("optax")
    tree = _tied_layers(12, seed=7)
    flat, re = st.destructure(tree)
    params = (flat, re)
    opt = optax.adam(0.1)
    state = opt.init(params)
    grads = jax.grad(lambda p: _sum_of_sines(p[1](p[0])))(params)
    assert grads[1] is re
    updates, state = opt.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert new[1] == re and new[0].shape == flat.shape


def test_restructure_under_equinox_filter_jit():
    eqx = pytest.importorskip("equinox")
    tree = _tied_model()
    flat, re = st.destructure(tree)
    traced = []

    @eqx.filter_jit
    def head(v, r):
        traced.append(1)
        return r(v)["head"]

    np.testing.assert_array_equal(head(flat, re), tree["emb"].T)
    np.testing.assert_array_equal(head(2 * flat, st.destructure(tree)[1]), 2 * tree["emb"].T)
    assert traced == [1]


def _reference_checks(tree, f_tree, rtol, forward=True):
    """grad (and jvp, hvp, vmap(grad)) of the jitted flat path against independent ones."""
    flat, re = st.destructure(tree)
    f = lambda v: f_tree(re(v))  # noqa: E731
    ref = lambda v: f_tree(_by_hand(tree)(v))  # noqa: E731
    g = jax.jit(jax.grad(f))(flat)
    canonical = jax.grad(lambda t: f_tree(st.materialize(t)))(tree)  # the canonical gradient
    np.testing.assert_allclose(g, ravel_pytree(jax.tree.leaves(canonical))[0], rtol=rtol, atol=rtol)
    np.testing.assert_allclose(g, jax.jit(jax.grad(ref))(flat), rtol=rtol, atol=rtol)
    if not forward:
        return flat, re
    tangent = jnp.linspace(-1.0, 1.0, flat.size)
    jvp = lambda h: jax.jit(lambda v, t: jax.jvp(h, (v,), (t,))[1])(flat, tangent)  # noqa: E731
    np.testing.assert_allclose(jvp(f), jvp(ref), rtol=rtol, atol=rtol)
    hvp = lambda h: jax.jvp(jax.grad(h), (flat,), (tangent,))[1]  # noqa: E731
    np.testing.assert_allclose(jax.jit(lambda: hvp(f))(), hvp(ref), rtol=rtol, atol=rtol)
    batch = jnp.stack([flat, 0.5 * flat])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(f)))(batch), jax.vmap(jax.grad(ref))(batch), rtol=rtol, atol=rtol
    )
    return flat, re


def test_forward_mode_and_hessian_under_jit():
    tree = {"a": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": st.Tied("a", st.T), "c": jnp.ones(2)}
    tree.update({f"x{i}": jnp.full((2,), 0.5 + i) for i in range(8)})
    flat, re = st.destructure(tree)
    assert len(re.sizes) >= _flat._OPAQUE_MIN

    def f_tree(m):
        extra = sum(jnp.sum(m[f"x{i}"] ** 3) for i in range(8))
        return jnp.sum(m["a"] @ m["b"] @ m["c"] ** 2) + extra

    f = lambda v: f_tree(re(v))  # noqa: E731
    ref = lambda v: f_tree(_by_hand(tree)(v))  # noqa: E731
    np.testing.assert_allclose(jax.jit(jax.hessian(f))(flat), jax.hessian(ref)(flat), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(f))(flat), jax.grad(ref)(flat), rtol=1e-5)


def test_many_buffers_gradient_is_assembled_in_two_levels():
    # from 64 buffers on, the gradient is ~sqrt(n) group concatenates behind an
    # optimization barrier, then one; values as the by-hand restructure's
    flat, re = _reference_checks(_tied_layers(40, seed=3), _sum_of_sines, rtol=1e-5)
    n = len(re.sizes)
    assert _flat._GROUPED_MIN <= n < _flat._FUSED_GROUPS_MIN
    prims = _primitives(jax.make_jaxpr(jax.grad(lambda v: _sum_of_sines(re(v))))(flat).jaxpr)
    groups = -(-n // (math.isqrt(n - 1) + 1))
    # the jaxpr holds both platforms' branches: this path's groups + 1 concatenates for
    # XLA:CPU, and the plain split's one (its transpose) for every other platform
    assert prims.count("concatenate") == groups + 1 + 1 and "optimization_barrier" in prims
    assert not _NO_PADDING & set(prims)


def test_vmap_of_restructure_compiles_to_dynamic_slices_not_gathers():
    tree = _tied_layers(20, seed=8, dim=3)
    flat, re = st.destructure(tree)
    batch = flat[None] * jnp.arange(1.0, 5.0)[:, None]
    hlo = jax.jit(jax.vmap(re)).lower(batch).compile().as_text()
    assert " gather(" not in hlo and "dynamic-slice(" in hlo
    out = jax.jit(jax.vmap(re))(batch)
    for k in range(len(batch)):  # every vector of the batch
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(_by_hand(tree)(batch[k]))):
            np.testing.assert_array_equal(got[k], want)


def test_inside_scan_and_checkpoint():
    tree = _tied_layers(12, seed=9)
    flat, re = st.destructure(tree)

    def step(v, _):
        g = jax.grad(jax.checkpoint(lambda u: _sum_of_sines(re(u))))(v)
        return v - 0.01 * g, None

    out, _ = jax.jit(lambda v: jax.lax.scan(step, v, length=3))(flat)

    def ref_step(v, _):
        return v - 0.01 * jax.grad(lambda u: _sum_of_sines(_by_hand(tree)(u)))(v), None

    want, _ = jax.lax.scan(ref_step, flat, length=3)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_host_vector_is_a_private_copy_in_the_promoted_dtype():
    # NumPy leaves go through one host concatenate adopted by the device without a
    # second copy: the vector must never alias the caller's arrays
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([0.5, 1.5], dtype=np.float16)
    c = np.array([2.0], dtype=jnp.bfloat16)
    tree = {"a": a, "b": b, "c": c, "aT": st.Tied("a", st.T)}
    flat, re = st.destructure(tree)
    expected = np.concatenate([a.ravel(), b.astype(np.float32), c.astype(np.float32)])
    assert flat.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(flat), expected)
    a[...] = -1.0
    b[...] = -1.0
    np.testing.assert_array_equal(np.asarray(flat), expected)  # unchanged
    out = re(flat)
    assert out["b"].dtype == jnp.float16 and out["c"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["aT"]), expected[:6].reshape(2, 3).T)


def _host_reference(tree):
    """The flat vector by hand: every inexact leaf of the canonical tree, in flatten order."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    inexact = [x for x in leaves if np.issubdtype(x.dtype, np.inexact)]
    return np.concatenate([x.ravel().astype(np.float32) for x in inexact])


@pytest.mark.filterwarnings("ignore:destructure. the static leaf 'k'")
def test_repeated_destructure_follows_values_shapes_dtypes_and_statics():
    # the layout is reused per structure (the first call on the host, later ones
    # through a jitted concatenate): every call must still read the tree it is given
    def tree(scale, n=3, dtype=jnp.float32, k=2):
        t = {
            f"l{i}": {
                "w": scale * jnp.arange(n * n, dtype=dtype).reshape(n, n) + i,
                "b": jnp.full((n,), scale * i, dtype),
            }
            for i in range(4)
        }
        t["l3"]["w"] = st.Tied("l2/w", st.T)
        t["k"] = np.int32(k)
        return t

    cases = [
        tree(1.0),
        tree(2.0),
        tree(-1.0),
        tree(3.0, n=2),
        tree(3.0, n=2),
        tree(0.5, dtype=jnp.float16),
        tree(0.5, dtype=jnp.float16),
        tree(1.0, k=5),
        tree(4.0),
        tree(4.0),
    ]
    for t in cases:
        flat, re = st.destructure(t)
        np.testing.assert_array_equal(np.asarray(flat), _host_reference(t))
        assert re.statics[0][1].value == t["k"]
        m = re(flat)
        np.testing.assert_array_equal(m["l3"]["w"], t["l2"]["w"].T)
        assert m["l0"]["w"].dtype == t["l0"]["w"].dtype and m["l0"]["w"].shape == t["l0"]["w"].shape
    layout = _flat._LAYOUTS[_flat.leaves_and_structure(cases[-1])[1]]
    assert layout.jitted is not None  # the last calls went through the jitted concatenate


def test_repeated_destructure_mixes_numpy_and_jax_leaves():
    base = _tied_layers(12, seed=11)
    as_numpy = jax.tree.map(np.asarray, base)
    mixed = dict(base, l000=as_numpy["l000"])
    for t in (base, base, as_numpy, mixed, base, mixed, as_numpy):
        flat, re = st.destructure(t)
        np.testing.assert_array_equal(np.asarray(flat), _host_reference(t))
        for got, want in zip(jax.tree.leaves(re(flat)), jax.tree.leaves(st.materialize(t))):
            np.testing.assert_array_equal(got, want)


def test_prng_keys_stay_static_and_pass_through():
    key = jax.random.key(0)
    old = jax.random.PRNGKey(1)  # old-style uint32[2] key
    tree = {"w": jnp.ones((2, 3)), "wT": st.Tied("w", st.T), "key": key, "old": old}
    flat, re = st.destructure(tree)
    assert flat.shape == (6,)
    back = re(flat)
    assert back["key"] is key and back["old"] is old
    np.testing.assert_array_equal(back["wT"], jnp.ones((3, 2)))
    assert st.materialize(tree)["key"] is key
    assert "key<fry>" in st.summary(tree)
    # the same key object gives an equal restructure; another key (even an equal one) does not
    assert st.destructure(dict(tree))[1] == re
    with pytest.warns(UserWarning, match=r"^\[E160\]") as record:
        assert st.destructure(dict(tree, key=jax.random.key(0)))[1] != re
    assert _warned(record, "E160", "static leaf 'key'", "another array object")
    g = jax.jit(jax.grad(lambda v, r: jnp.sum(r(v)["wT"] ** 2)))(flat, re)
    np.testing.assert_allclose(g, 2 * np.ones(6))


def test_complex_vector_for_an_all_real_tree_is_an_error():
    flat, re = st.destructure({"w": jnp.ones(3), "v": st.Tied("w")})
    with raises("E12c", "real vector (float32)", "complex64", "imaginary"):
        re(flat.astype(jnp.complex64) * 1j)
    # a genuinely mixed tree keeps the documented behaviour: real buffers take the real part
    flat, re = st.destructure({"w": jnp.ones(2), "z": jnp.ones(2, jnp.complex64)})
    assert re(flat * (1 + 1j))["w"].dtype == jnp.float32


def test_a_changing_static_leaf_warns_once_naming_it():
    import warnings

    def tree(step):
        return {"w": jnp.ones(3), "v": st.Tied("w"), "step": jnp.int32(step), "tag": "x"}

    st.destructure(tree(0))
    with pytest.warns(UserWarning, match=r"^\[E160\]") as record:
        st.destructure(tree(1))
    assert _warned(record, "E160", "leaf 'step' (int32[])", "another array", "retraces")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.destructure(tree(2))  # once per leaf
        st.destructure(tree(2))  # unchanged


def test_kept_layouts_are_bounded_and_live_outside_the_structure():
    for n in range(_flat.LAYOUT_CACHE_SIZE + 5):
        tree = {f"w{n}": jnp.ones(3), "v": st.Tied(f"w{n}")}
        st.destructure(tree)
        st.destructure(tree)  # the second call compiles the layout's concatenate
        structure = _flat.leaves_and_structure(tree)[1]
        assert "_flat_layout" not in structure.__dict__
    assert len(_flat._LAYOUTS) == _flat.LAYOUT_CACHE_SIZE


def test_restructure_rejects_shape_structs_and_key_vectors():
    flat, re = st.destructure({"a": jnp.ones(3), "b": st.Tied("a")})
    with raises("E11", "ShapeDtypeStruct", "jax.eval_shape(restructure", cls=st.TieTypeError):
        re(jax.ShapeDtypeStruct(flat.shape, flat.dtype))
    assert jax.eval_shape(re, flat)["b"].shape == (3,)
    with raises("E12", "dtype key<fry>"):
        re.canonical(jax.random.split(jax.random.key(0), 3))


def test_float8_buffers_next_to_other_floats_share_a_float32_vector():
    # JAX never promotes 8-bit floats implicitly; their values are exact in float32
    tree = {"a": jnp.arange(3, dtype=jnp.float8_e4m3fn), "b": jnp.ones(2), "c": st.Tied("a")}
    flat, re = st.destructure(tree)
    assert flat.dtype == jnp.float32 and flat.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0]
    assert re(flat)["c"].dtype == jnp.float8_e4m3fn
    assert st.destructure({"a": tree["a"]})[0].dtype == jnp.float8_e4m3fn


def test_a_python_float_traced_by_jit_is_named_when_the_vector_lengths_differ():
    # outside jit 0.1 is static; passed through jit it is a float32 tracer, so a parameter
    tree = {"lr": 0.1, "w": jnp.ones(2)}
    inside = jax.jit(lambda t: st.destructure(t)[0])(tree)
    assert inside.shape == (3,) and st.destructure(tree)[0].shape == (2,)
    _, re = st.destructure(tree)
    with raises("E10", "length 3 (+1)", "1 Python float/complex leaf"):
        re(inside)
    with raises("E10", "length 4 (+2)", "same structure and shapes") as info:
        re(jnp.ones(4))  # more than the Python floats explain: no such hint
    assert "Python float" not in str(info.value)
