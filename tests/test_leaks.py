"""Nothing traced outlives its trace: every public entry point under jit, grad, vmap and jvp.

Each case runs under ``jax.checking_leaks()``, which fails when a tracer is
still referenced once its trace has ended (a module-level cache holding a
traced integer leaf is such a reference).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharetree as st


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "emb": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "head": st.Tied("emb", st.T),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
        "half": st.Tied("b", st.scale(0.5)),
    }


def _with_step(seed=0):
    return dict(_tree(seed), step=jnp.int32(3))


def _loss(m):
    # the tree as it is materialized by hand: head = emb.T, half = b / 2
    return jnp.sum(jnp.sin(m["head"] @ m["emb"])) + jnp.sum(m["half"] * m["b"])


def _by_hand(tree):
    return dict(tree, head=tree["emb"].T, half=0.5 * tree["b"])


def _destructure_sum(t):
    flat, re = st.destructure(t)
    return flat.sum() + re(flat)["head"].sum()


def _restructure_sum(t):
    flat, re = st.destructure(t)
    return _loss(re(flat * 2.0))


def _materialize_loss(t):
    return _loss(st.materialize(t))


def _canonicalize_count(t):
    g = st.canonicalize(t)
    return g.num_views * jnp.sum(t["b"]) + g.nbytes_unique


def _grad_by_use_sum(t):
    by_use = st.grad_by_use(_loss)(t)
    return sum(jnp.sum(g) for uses in by_use.values() for g in uses.values())


_FUNCTIONS = {
    "destructure": _destructure_sum,
    "restructure": _restructure_sum,
    "materialize": _materialize_loss,
    "canonicalize": _canonicalize_count,
    "grad_by_use": _grad_by_use_sum,
}


def _reference(name, t):
    """The same quantity computed from the tree tied by hand (no sharetree)."""
    m = _by_hand(t)
    if name == "destructure":
        return t["emb"].sum() + t["b"].sum() + m["head"].sum()
    if name == "restructure":
        return _loss(_by_hand({"emb": 2 * t["emb"], "b": 2 * t["b"]}))
    if name == "materialize":
        return _loss(m)
    if name == "canonicalize":  # two views; emb, b (and step) stored once
        return 2 * t["b"].sum() + 4 * (12 + 4 + ("step" in t))
    # grad_by_use: every use's contribution, summed = the gradient of the untied loss, summed
    g = jax.grad(_loss)(m)
    return g["emb"].sum() + g["head"].sum() + g["b"].sum() + 0.5 * g["half"].sum()


@pytest.mark.parametrize("name", list(_FUNCTIONS))
def test_no_tracer_leaks_under_jit_with_a_traced_integer_leaf(name):
    f = _FUNCTIONS[name]
    t = _with_step(1) if name in ("destructure", "restructure", "canonicalize") else _tree(1)
    with jax.checking_leaks():
        for _ in range(2):  # a second trace of a new function object: nothing kept from the first
            got = jax.jit(lambda t, f=f: f(t))(t)
    want = _reference(name, t)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("name", list(_FUNCTIONS))
def test_no_tracer_leaks_under_vmap(name):
    f = _FUNCTIONS[name]
    # with a batched (so traced) integer leaf where the function accepts one
    make = _with_step if name in ("destructure", "restructure", "canonicalize") else _tree
    batch = [make(s) for s in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batch)
    with jax.checking_leaks():
        got = jax.vmap(f)(stacked)
    want = [_reference(name, t) for t in batch]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("name", list(_FUNCTIONS))
def test_no_tracer_leaks_under_grad(name):
    f = _FUNCTIONS[name]
    t = _tree(2)
    with jax.checking_leaks():
        g = jax.grad(f)(t)
        g_jit = jax.jit(jax.grad(f))(t)
    ref = jax.grad(lambda t: _reference(name, t))(t)
    for got in (g, g_jit):
        assert got["head"] == st.Tied("emb", st.T)
        np.testing.assert_allclose(got["emb"], ref["emb"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["b"], ref["b"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(_FUNCTIONS))
def test_no_tracer_leaks_under_jvp(name):
    f = _FUNCTIONS[name]
    t = _tree(3)
    tangent = jax.tree.map(jnp.ones_like, t)
    with jax.checking_leaks():
        _, dt = jax.jvp(f, (t,), (tangent,))
    _, want = jax.jvp(lambda t: _reference(name, t), (t,), (tangent,))
    np.testing.assert_allclose(dt, want, rtol=1e-5)


def test_a_traced_integer_leaf_keeps_no_layout_and_never_warns():
    # the reported case: an int leaf traced by jit was stored in the layout cache, and
    # each retrace warned that the static leaf "changed"
    import warnings

    from sharetree import _flat

    t = {"w": jnp.ones(3), "step": jnp.int32(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.checking_leaks():
            for _ in range(3):
                assert jax.jit(lambda t: st.destructure(t)[0].sum())(t) == 3.0
    structure = _flat.leaves_and_structure(t)[1]
    layout = _flat._LAYOUTS.get(structure)
    assert layout is None or not any(
        isinstance(s.value, jax.core.Tracer) for _, s in layout.restructure.statics
    )
