"""Mixed precision: a bfloat16 view of a float32 master buffer; gradients land on the buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _raises import raises

import sharetree as st

BF16 = jnp.bfloat16
X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 6)), jnp.float32)


def _params():
    rng = np.random.default_rng(1)
    return {
        "master": {"w": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)},
        "compute": {"w": st.Tied("master/w", st.astype(BF16))},
        "b": jnp.zeros(4, jnp.float32),
    }


def _forward(w16, b):
    return jnp.mean(jnp.tanh((X.astype(BF16) @ w16).astype(jnp.float32) + b) ** 2)


def loss(p):
    m = st.materialize(p)
    assert m["compute"]["w"].dtype == BF16 and m["master"]["w"].dtype == jnp.float32
    return _forward(m["compute"]["w"], m["b"])


def hand(w, b):
    return _forward(w.astype(BF16), b)


def test_materialized_view_is_bfloat16_and_the_graph_counts_bytes():
    p = _params()
    assert st.materialize(p)["compute"]["w"].dtype == BF16
    g = st.canonicalize(p)
    assert g.views["compute/w"].dtype == np.dtype(BF16)
    assert g.nbytes_unique == 6 * 4 * 4 + 4 * 4
    assert g.nbytes_expanded == g.nbytes_unique + 6 * 4 * 2


def test_gradient_lands_on_the_float32_buffer():
    p = _params()
    g = jax.jit(jax.grad(loss))(p)
    assert g["compute"]["w"] == st.Tied("master/w", st.astype(BF16))
    assert g["master"]["w"].dtype == jnp.float32
    gw, gb = jax.jit(jax.grad(hand, argnums=(0, 1)))(p["master"]["w"], p["b"])
    assert gw.dtype == jnp.float32
    np.testing.assert_allclose(g["master"]["w"], gw, rtol=1e-5)
    np.testing.assert_allclose(g["b"], gb, rtol=1e-5)


def test_adam_keeps_a_float32_master_and_matches_the_hand_written_cast():
    tx = optax.adam(1e-2)
    p = _params()
    h = {"w": p["master"]["w"], "b": p["b"]}

    @jax.jit
    def step(p, opt, h, opt_h):
        l1, g1 = jax.value_and_grad(loss)(p)
        u1, opt = tx.update(g1, opt, p)
        l2, g2 = jax.value_and_grad(lambda q: hand(q["w"], q["b"]))(h)
        u2, opt_h = tx.update(g2, opt_h, h)
        return optax.apply_updates(p, u1), opt, l1, optax.apply_updates(h, u2), opt_h, l2

    opt, opt_h = tx.init(p), tx.init(h)
    assert {x.dtype for x in jax.tree.leaves(opt[0].mu)} == {jnp.dtype(jnp.float32)}
    for _ in range(5):
        p, opt, l1, h, opt_h, l2 = step(p, opt, h, opt_h)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
    assert p["master"]["w"].dtype == jnp.float32
    np.testing.assert_allclose(p["master"]["w"], h["w"], rtol=1e-5, atol=1e-7)
    assert p["compute"]["w"] == st.Tied("master/w", st.astype(BF16))


def test_linen_bfloat16_head_tied_to_a_float32_embedding():
    nn = pytest.importorskip("flax.linen")
    from sharetree.flax import tied

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            h = nn.Embed(11, 8, name="embed")(tokens)
            return nn.Dense(11, use_bias=False, dtype=BF16, param_dtype=BF16, name="head")(h)

    model = tied(LM(), {"head/kernel": st.Tied("embed/embedding", st.T >> st.astype(BF16))})
    tokens = jnp.arange(6).reshape(2, 3)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    assert shapes["head"]["kernel"] == st.Tied("embed/embedding", st.T >> st.astype(BF16))
    emb = jnp.asarray(np.random.default_rng(2).standard_normal((11, 8)), jnp.float32)
    params = {"embed": {"embedding": emb}, "head": shapes["head"]}

    def loss(p):
        return jnp.mean(model.apply({"params": p}, tokens).astype(jnp.float32) ** 2)

    def hand(e):
        logits = jnp.dot(e[tokens].astype(BF16), e.astype(BF16).T)
        return jnp.mean(logits.astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss))(params)
    assert g["embed"]["embedding"].dtype == jnp.float32
    want = jax.jit(jax.grad(hand))(emb)
    # both uses go through a bfloat16 cast and a bfloat16 dot, whose products are summed
    # and rounded in bfloat16: XLA may round at another step (jax 0.12 does: 40 of 88
    # values one bfloat16 ulp apart). The error is one bfloat16 eps of the largest
    # partial sums, so it is bounded by eps times the gradient's largest value, not
    # relative to each (small) element.
    atol = float(jnp.finfo(BF16).eps) * float(np.abs(want).max())
    np.testing.assert_allclose(g["embed"]["embedding"], want, rtol=0, atol=atol)
    with raises("E7", "'head/kernel'", "float32[8, 11]", "bfloat16[8, 11]"):
        jax.eval_shape(
            tied(LM(), {"head/kernel": st.Tied("embed/embedding", st.T)}).init,
            jax.random.key(0),
            tokens,
        )
