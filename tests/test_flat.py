import math
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import sharetree as st


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
    np.testing.assert_allclose(g_flat, expected, rtol=2e-3, atol=1e-3)


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
    f2, re2 = st.destructure(_ref_tree())
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


def test_static_int_arrays_compare_by_value():
    _, r1 = st.destructure({"a": jnp.ones(2), "n": np.arange(3)})
    _, r2 = st.destructure({"a": jnp.ones(2), "n": np.arange(3)})
    _, r3 = st.destructure({"a": jnp.ones(2), "n": np.arange(3) + 1})
    assert r1 == r2 and r1 != r3


def test_works_under_jit_on_traced_trees():
    tree = {k: v for k, v in _tied_model().items() if k != "act"}

    @jax.jit
    def f(t):
        flat, re = st.destructure(t)
        return re(flat * 2)["head"]

    np.testing.assert_allclose(f(tree), 2 * tree["emb"].T, rtol=1e-6)


def test_bad_flat_inputs():
    _, re = st.destructure(_ref_tree())
    with pytest.raises(st.TieError, match=r"length 4.*got length 5 \(\+1\)"):
        re(jnp.zeros(5))
    with pytest.raises(st.TieError, match=r"1-D.*shape \(2, 2\)"):
        re(jnp.zeros((2, 2)))
    with pytest.raises(st.TieError, match="floating or complex.*int32"):
        re(jnp.zeros(4, jnp.int32))
    with pytest.raises(st.TieError, match="1-D array"):
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


def test_gradient_is_one_split_and_one_concatenate_with_no_padding():
    # the cotangent is assembled in one pass: no per-view full-size zero padding
    tree = {f"l{i}": {"w": jnp.ones((3, 3)), "b": jnp.ones(3)} for i in range(50)}
    for i in range(3, 50, 4):
        tree[f"l{i}"]["w"] = st.Tied(f"l{i - 1}/w", st.T)
    flat, re = st.destructure(tree)
    loss = lambda v: sum(jnp.sum(jnp.tanh(x)) for x in jax.tree.leaves(re(v)))  # noqa: E731
    prims = [e.primitive.name for e in jax.make_jaxpr(jax.grad(loss))(flat).jaxpr.eqns]
    assert prims.count("split") == 1 and prims.count("concatenate") == 1
    assert not {"pad", "dynamic_update_slice", "scatter-add", "scatter_add"} & set(prims)


def _sub_jaxprs(params):
    """The jaxprs in an equation's params (``jax.extend.core.jaxprs_in_params``, jax >= 0.10)."""
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def _primitives(jaxpr):
    """Every primitive name in a jaxpr, sub-jaxprs (custom_jvp, pjit) included."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for sub in _sub_jaxprs(eqn.params):
            out.extend(_primitives(sub))
    return out


def test_restructure_passed_to_jit_gives_the_same_values_and_gradients():
    tree = _tied_model()
    flat, re = st.destructure(tree)
    arrays, static = _split(tree)
    g_tree = jax.grad(lambda a: _loss(st.materialize(_join(a, static))))(arrays)
    expected = jnp.concatenate(
        [g_tree["emb"].ravel(), g_tree["mid"]["w"].ravel().astype(jnp.float32)]
    )
    g_arg = jax.jit(jax.grad(lambda v, r: _loss(r(v))))(flat, re)
    np.testing.assert_allclose(g_arg, expected, rtol=2e-3, atol=1e-3)
    heads = jax.jit(lambda v, r: (r(v)["head"], r(v)["half"], r.canonical(v)["mid"]["w"]))
    head, half, w = heads(flat, re)
    np.testing.assert_array_equal(head, tree["emb"].T)
    np.testing.assert_array_equal(half, 0.5 * tree["mid"]["w"].astype(jnp.float32))
    assert w.dtype == jnp.float16
    np.testing.assert_array_equal(w, tree["mid"]["w"])


def test_restructure_argument_supports_jvp_hessian_and_vmap():
    tree = {"a": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": st.Tied("a", st.T), "c": jnp.ones(2)}
    flat, re = st.destructure(tree)

    def f(v, r):
        m = r(v)
        return jnp.sum(m["a"] @ m["b"] @ m["c"] ** 2)

    closed = lambda v: f(v, re)  # noqa: E731 (static offsets: the reference)
    jvp = jax.jit(lambda v, t, r: jax.jvp(lambda u: f(u, r), (v,), (t,)))
    tangent = jnp.arange(flat.size, dtype=flat.dtype)
    np.testing.assert_allclose(
        jvp(flat, tangent, re), jax.jvp(closed, (flat,), (tangent,)), rtol=1e-6
    )
    hess = jax.jit(jax.hessian(f))(flat, re)
    np.testing.assert_allclose(hess, jax.hessian(closed)(flat), rtol=1e-6)
    batch = jnp.stack([flat, 2 * flat, -flat])
    batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(batch, re)
    np.testing.assert_allclose(batched, jnp.array([closed(v) for v in batch]), rtol=1e-6)


def test_restructure_argument_lowers_to_dynamic_slices_and_one_concatenate():
    tree = {f"l{i}": {"w": jnp.ones((3, 3)), "b": jnp.ones(3)} for i in range(20)}
    for i in range(3, 20, 4):
        tree[f"l{i}"]["w"] = st.Tied(f"l{i - 1}/w", st.T)
    flat, re = st.destructure(tree)
    n = len(jax.tree.leaves(tree))
    loss = lambda v, r: sum(jnp.sum(jnp.tanh(x)) for x in jax.tree.leaves(r(v)))  # noqa: E731
    prims = _primitives(jax.make_jaxpr(jax.jit(jax.grad(loss)))(flat, re).jaxpr)
    assert prims.count("dynamic_slice") == n
    assert prims.count("concatenate") == 1 and "slice" not in prims
    assert not {"pad", "dynamic_update_slice", "scatter-add", "scatter_add"} & set(prims)
    # closed over, the offsets are constants: static split, no dynamic slices
    closed = _primitives(jax.make_jaxpr(jax.jit(jax.grad(lambda v: loss(v, re))))(flat).jaxpr)
    assert "dynamic_slice" not in closed and closed.count("split") == 1
    # compiled: no static slice left in the forward pass
    hlo = jax.jit(jax.grad(loss)).lower(flat, re).compile().as_text()
    assert " slice(" not in hlo and "dynamic-slice(" in hlo


def test_restructure_is_a_pytree_of_its_offsets():
    tree = _tied_model()
    flat, re = st.destructure(tree)
    leaves, treedef = jax.tree.flatten(re)
    assert [int(x) for x in leaves] == [0, 15] == list(re.offsets)
    again = jax.tree.unflatten(treedef, leaves)
    assert again == re and hash(again) == hash(re)
    np.testing.assert_array_equal(again(flat)["head"], tree["emb"].T)
    # nested jit: the traced offsets travel on, values unchanged
    inner = jax.jit(lambda v, r: r(v)["head"])
    np.testing.assert_array_equal(jax.jit(lambda v, r: inner(v, r))(flat, re), tree["emb"].T)
    # one buffer: nothing to offset, no leaves
    assert jax.tree.leaves(st.destructure({"a": jnp.ones(3), "b": st.Tied("a")})[1]) == []


def test_changed_offsets_are_an_error_not_a_wrong_tree():
    flat, re = st.destructure(_tied_model())
    moved = jax.tree.map(lambda o: o + 1, re)
    with pytest.raises(st.TieError, match=r"offset 0 is 1, expected 0.*do not tree_map"):
        moved(flat)
    second = jax.tree.map(lambda o: o if o == 0 else o + 1, re)
    with pytest.raises(st.TieError, match="offset 1 is 16, expected 15"):
        second.canonical(flat)


def test_restructure_argument_under_equinox_filter_jit():
    eqx = pytest.importorskip("equinox")
    tree = _tied_model()
    flat, re = st.destructure(tree)
    traced = []

    @eqx.filter_jit
    def head(v, r):
        traced.append(any(isinstance(o, jax.core.Tracer) for o in jax.tree.leaves(r)))
        return r(v)["head"]

    np.testing.assert_array_equal(head(flat, re), tree["emb"].T)
    assert traced == [True]  # filter_jit traces the offsets: the runtime-offset path


def _tied_layers(layers: int, seed: int) -> dict:
    """Small 2x2 layers, every 4th weight the transpose of the previous one."""
    k = jax.random.split(jax.random.key(seed), layers)
    tree = {
        f"l{i:03d}": {"w": jax.random.normal(k[i], (2, 2)), "b": jnp.full((2,), 0.1 * i)}
        for i in range(layers)
    }
    for i in range(3, layers, 4):
        tree[f"l{i:03d}"]["w"] = st.Tied(f"l{i - 1:03d}/w", st.T)
    return tree


def test_many_buffers_gradient_is_assembled_in_two_levels():
    # from 64 buffers on, the runtime-offset gradient is ~sqrt(n) group concatenates
    # behind an optimization barrier, then one: same values as the closed-over split
    flat, re = st.destructure(_tied_layers(40, seed=3))
    n = len(re.sizes)
    assert n >= 64

    def f(v, r):
        leaves = jax.tree.leaves(r(v))
        return sum(jnp.sum(jnp.sin((j + 1) * x) * x) for j, x in enumerate(leaves))

    closed = lambda v: f(v, re)  # noqa: E731
    g = jax.jit(jax.grad(f))(flat, re)
    np.testing.assert_allclose(g, jax.jit(jax.grad(closed))(flat), rtol=1e-6, atol=1e-7)
    prims = _primitives(jax.make_jaxpr(jax.jit(jax.grad(f)))(flat, re).jaxpr)
    groups = -(-n // (math.isqrt(n - 1) + 1))
    assert prims.count("concatenate") == groups + 1 and "optimization_barrier" in prims
    assert not {"pad", "dynamic_update_slice", "scatter-add", "scatter_add"} & set(prims)
    tangent = jnp.linspace(-1.0, 1.0, flat.size)
    jvp = jax.jit(lambda v, t, r: jax.jvp(lambda u: f(u, r), (v,), (t,))[1])
    np.testing.assert_allclose(
        jvp(flat, tangent, re),
        jax.jit(lambda v, t: jax.jvp(closed, (v,), (t,))[1])(flat, tangent),
        rtol=1e-5,
    )
    hvp = jax.jit(lambda v, t, r: jax.jvp(lambda u: jax.grad(f)(u, r), (v,), (t,))[1])
    hvp_closed = jax.jit(lambda v, t: jax.jvp(jax.grad(closed), (v,), (t,))[1])
    np.testing.assert_allclose(
        hvp(flat, tangent, re), hvp_closed(flat, tangent), rtol=1e-5, atol=1e-6
    )
    batch = jnp.stack([flat, 0.5 * flat])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(f), in_axes=(0, None)))(batch, re),
        jax.jit(jax.vmap(jax.grad(closed)))(batch),
        rtol=1e-5,
        atol=1e-6,
    )


def test_hundreds_of_buffers_gradient_is_assembled_in_groups_of_8():
    # from 256 buffers on the first level groups 8 buffers (XLA:CPU fuses such a
    # concatenate with its producers); the gradient equals the canonical tree's
    tree = _tied_layers(148, seed=4)
    flat, re = st.destructure(tree)
    n = len(re.sizes)
    assert n >= 256

    def f_tree(materialized):
        return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(materialized))

    g = jax.jit(jax.grad(lambda v, r: f_tree(r(v))))(flat, re)
    ref = jax.jit(jax.grad(lambda t: f_tree(st.materialize(t))))(tree)  # canonical gradient
    np.testing.assert_allclose(g, st.destructure(ref)[0], rtol=1e-6, atol=1e-7)
    prims = _primitives(jax.make_jaxpr(jax.grad(lambda v, r: f_tree(r(v))))(flat, re).jaxpr)
    assert prims.count("concatenate") == -(-n // 8) + 1 and "optimization_barrier" in prims
    assert not {"pad", "dynamic_update_slice", "scatter-add", "scatter_add"} & set(prims)


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
    # equal keys give equal restructures; another key does not
    assert st.destructure(dict(tree, key=jax.random.key(0)))[1] == re
    with pytest.warns(UserWarning, match="static leaf 'key'"):
        assert st.destructure(dict(tree, key=jax.random.key(2)))[1] != re
    g = jax.jit(jax.grad(lambda v, r: jnp.sum(r(v)["wT"] ** 2)))(flat, re)
    np.testing.assert_allclose(g, 2 * np.ones(6))


def test_complex_vector_for_an_all_real_tree_is_an_error():
    flat, re = st.destructure({"w": jnp.ones(3), "v": st.Tied("w")})
    with pytest.raises(st.TieError, match=r"real vector \(float32\).*complex64.*imaginary"):
        re(flat.astype(jnp.complex64) * 1j)
    # a genuinely mixed tree keeps the documented behaviour: real buffers take the real part
    flat, re = st.destructure({"w": jnp.ones(2), "z": jnp.ones(2, jnp.complex64)})
    assert re(flat * (1 + 1j))["w"].dtype == jnp.float32


def test_a_changing_static_leaf_warns_once_naming_it():
    import warnings

    def tree(step):
        return {"w": jnp.ones(3), "v": st.Tied("w"), "step": jnp.int32(step), "tag": "x"}

    st.destructure(tree(0))
    with pytest.warns(UserWarning, match=r"static leaf 'step' \(int32\[\]\) changed.*retraces"):
        st.destructure(tree(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.destructure(tree(2))  # once per leaf
        st.destructure(tree(2))  # unchanged
