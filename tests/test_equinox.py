"""Equinox: Tied as a Module field, tie by attribute path, filter_jit / filter_grad / jax.jit.

Reference: the same autoencoder tied with ``eqx.nn.Shared(..., get=lambda m: m.enc.weight.T)``.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

eqx = pytest.importorskip("equinox")

from _raises import raises  # noqa: E402

import sharetree as st  # noqa: E402

TIES = {"dec/weight": st.Tied("enc/weight", st.T)}


class AE(eqx.Module):
    enc: eqx.nn.Linear
    dec: eqx.nn.Linear

    def __init__(self, key, din=6, dh=3):
        k1, k2 = jax.random.split(key)
        self.enc = eqx.nn.Linear(din, dh, key=k1)
        self.dec = eqx.nn.Linear(dh, din, key=k2)

    def __call__(self, x):
        return self.dec(jnp.tanh(self.enc(x)))


def _data(n=16, d=6):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((n, 2)) @ rng.standard_normal((2, d)), jnp.float32)


def _mse(model, x):
    return jnp.mean((jax.vmap(model)(x) - x) ** 2)


def test_tie_by_attribute_path_puts_a_tied_field_in_the_module():
    model = st.tie(AE(jax.random.key(0)), TIES)
    assert isinstance(model, AE) and model.dec.weight == st.Tied("enc/weight", st.T)
    assert model.dec.in_features == 3  # static fields untouched
    assert len(jax.tree.leaves(model)) == 3
    full = st.materialize(model)
    assert isinstance(full.dec, eqx.nn.Linear)
    np.testing.assert_array_equal(full.dec.weight, model.enc.weight.T)
    assert st.canonicalize(model).views["dec/weight"].buffer == "enc/weight"


def test_equinox_autoencoder_tied_with_sharetree_equals_eqx_nn_shared():
    """>= 5 adam steps: losses, final weight and gradient norms match eqx.nn.Shared."""
    base = AE(jax.random.key(1))
    ours = st.tie(base, TIES)
    shared = eqx.nn.Shared(base, where=lambda m: m.dec.weight, get=lambda m: m.enc.weight.T)
    x = _data()
    tx = optax.adam(5e-2)

    def make_step(loss):
        @eqx.filter_jit
        def step(model, opt, x):
            value, grads = eqx.filter_value_and_grad(loss)(model, x)
            params = eqx.filter(model, eqx.is_array)
            updates, opt = tx.update(eqx.filter(grads, eqx.is_array), opt, params)
            norm = optax.tree.norm(eqx.filter(grads, eqx.is_array))
            return eqx.apply_updates(model, updates), opt, value, norm

        return step

    step_ours = make_step(lambda m, x: _mse(st.materialize(m), x))
    step_ref = make_step(lambda s, x: _mse(s(), x))
    opt_ours = tx.init(eqx.filter(ours, eqx.is_array))
    opt_ref = tx.init(eqx.filter(shared, eqx.is_array))
    # one moment per unique buffer, like Shared
    assert len(jax.tree.leaves(opt_ours[0].mu)) == 3 == len(jax.tree.leaves(opt_ref[0].mu))
    losses = []
    for _ in range(6):
        ours, opt_ours, l1, n1 = step_ours(ours, opt_ours, x)
        shared, opt_ref, l2, n2 = step_ref(shared, opt_ref, x)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        np.testing.assert_allclose(n1, n2, rtol=1e-5)
        losses.append(float(l1))
    assert losses[-1] < losses[0]
    ref_model = shared()
    np.testing.assert_allclose(ours.enc.weight, ref_model.enc.weight, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours.dec.bias, ref_model.dec.bias, rtol=1e-5, atol=1e-7)
    assert ours.dec.weight == st.Tied("enc/weight", st.T)


def test_filter_grad_and_plain_jit_agree_and_keep_the_tie():
    model = st.tie(AE(jax.random.key(2)), TIES)
    x = _data()
    loss = lambda m, x: _mse(st.materialize(m), x)  # noqa: E731
    g_filter = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    g_plain = jax.jit(jax.grad(loss))(model, x)  # every leaf is an array
    assert g_filter.dec.weight == g_plain.dec.weight == st.Tied("enc/weight", st.T)
    for a, b in zip(jax.tree.leaves(g_filter), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    # independent reference: the untied gradient summed back through the view
    g_full = jax.grad(_mse)(st.materialize(model), x)
    np.testing.assert_allclose(
        g_plain.enc.weight, g_full.enc.weight + g_full.dec.weight.T, rtol=1e-5, atol=1e-8
    )


class Handmade(eqx.Module):
    """A Tied written directly as a field value."""

    w: jax.Array
    b1: jax.Array
    w_out: Any
    b2: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b1) @ self.w_out + self.b2


def test_tied_as_a_field_value_matches_hand_written_w_and_w_t():
    rng = np.random.default_rng(3)
    w, b1, b2 = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((6, 3), (3,), (6,)))
    model = Handmade(w, b1, st.Tied("w", st.T), b2)
    x = _data()

    def loss(m):
        m = st.materialize(m)
        return jnp.mean((m(x) - x) ** 2)

    def hand(w, b1, b2):
        return jnp.mean((jnp.tanh(x @ w + b1) @ w.T + b2 - x) ** 2)

    def hand2(w_in, w_out):  # the two uses of w as separate arguments
        return jnp.mean((jnp.tanh(x @ w_in + b1) @ w_out.T + b2 - x) ** 2)

    g = jax.jit(jax.grad(loss))(model)
    gw, gb1, gb2 = jax.grad(hand, argnums=(0, 1, 2))(w, b1, b2)
    assert g.w_out == st.Tied("w", st.T)
    # g.w is the sum of the gradients through w and through w.T, which partly cancel:
    # float32 rounding (jit and eager order their sums differently) is relative to the
    # two terms, not to their sum (jax 0.12: 2.5e-5 of the sum at one element, 5e-7 abs)
    through_w = jax.grad(lambda w1: hand2(w1, w))(w)
    through_wt = jax.grad(lambda w2: hand2(w, w2))(w)
    bound = 1e-5 * (np.abs(through_w) + np.abs(through_wt)) + 1e-7
    np.testing.assert_allclose(through_w + through_wt, gw, rtol=1e-5, atol=1e-7)
    assert np.all(np.abs(np.asarray(g.w) - np.asarray(gw)) <= bound), (g.w - gw, bound)
    np.testing.assert_allclose(g.b1, gb1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g.b2, gb2, rtol=1e-5, atol=1e-7)


def test_tying_a_missing_attribute_path_names_the_closest_one():
    with raises("E5", "'dec/wieght'", "'dec/weight'"):
        st.tie(AE(jax.random.key(4)), {"dec/wieght": st.Tied("enc/weight", st.T)})
    with raises("E7", "'dec/weight'", "re:float32\\[3, 6\\].*float32\\[6, 3\\]"):
        st.tie(AE(jax.random.key(4)), {"dec/weight": "enc/weight"})


def test_a_tie_in_a_static_field_is_an_error_not_a_field_that_keeps_the_tie():
    # a static field is aux data: materialize never sees it, so the module would hold the
    # Tied itself where the value belongs
    class Static(eqx.Module):
        w: jax.Array
        v: object = eqx.field(static=True)

    m = Static(jnp.ones(2), st.Tied("w"))
    for call in (st.materialize, st.canonicalize, st.destructure):
        with raises("E83", "Tied('w')", "Static", "pytree child"):
            call(m)
    # nested in a static tuple too
    with raises("E83", "Tied('w')", "Static"):
        st.materialize(Static(jnp.ones(2), ("x", (st.Tied("w"),))))


# --- sharetree.equinox.from_shared: a model built with eqx.nn.Shared, as ties ---------------

steqx = pytest.importorskip("sharetree.equinox")

VOCAB, DIM = 13, 6


class LanguageModel(eqx.Module):
    """Equinox's own example of eqx.nn.Shared: the embedding is the output layer's weight."""

    shared: eqx.nn.Shared
    mid: eqx.nn.Linear

    def __init__(self, key, transposed=False):
        k1, k2, k3 = jax.random.split(key, 3)
        embedding = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        if transposed:  # a head stored the other way around: get transposes, as the docs say
            linear = eqx.nn.Linear(VOCAB, DIM, use_bias=False, key=k2)
            get = lambda pair: jnp.transpose(pair[0].weight)  # noqa: E731
        else:
            linear = eqx.nn.Linear(DIM, VOCAB, key=k2)
            get = lambda pair: pair[0].weight  # noqa: E731
        where = lambda pair: pair[1].weight  # noqa: E731
        self.shared = eqx.nn.Shared((embedding, linear), where, get)
        self.mid = eqx.nn.Linear(DIM, DIM, key=k3)

    def __call__(self, tokens, pair=None):
        embedding, linear = self.shared() if pair is None else pair
        h = jax.vmap(lambda t: jnp.tanh(self.mid(embedding(t))))(tokens)
        if linear.weight.shape == (VOCAB, DIM):
            return jax.vmap(linear)(h)
        return h @ linear.weight  # the transposed head: (DIM, VOCAB) is weight.T of Linear


def _tied_call(model, tokens):
    """The tied model's forward: materialize where the Shared model called shared()."""
    m = st.materialize(model)
    return LanguageModel.__call__(m, tokens, pair=m.shared)


def _lm_loss(call):
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, 10))

    def loss(model):
        logits = call(model, tokens[:-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[1:]).mean()

    return loss


@pytest.mark.parametrize("transposed", [False, True])
def test_from_shared_trains_as_eqx_nn_shared_with_its_own_gradients(transposed):
    """5 adam steps: equal losses, gradients and weights; one moment per buffer."""
    shared_model = LanguageModel(jax.random.key(0), transposed)
    tied = steqx.from_shared(shared_model)
    view = st.Tied("0/weight", st.T if transposed else st.identity)
    assert tied.shared[1].weight == view and isinstance(tied.shared[0], eqx.nn.Embedding)
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    assert len(arrays(tied)) == len(arrays(shared_model)) == (3 if transposed else 4)
    tx = optax.adam(5e-2)

    def make_step(loss):
        @eqx.filter_jit
        def step(model, opt):
            value, grads = eqx.filter_value_and_grad(loss)(model)
            updates, opt = tx.update(grads, opt, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt, value, grads

        return step

    step_tied = make_step(_lm_loss(_tied_call))
    step_ref = make_step(_lm_loss(lambda m, t: m(t)))
    opt_tied = tx.init(eqx.filter(tied, eqx.is_array))
    opt_ref = tx.init(eqx.filter(shared_model, eqx.is_array))
    assert len(jax.tree.leaves(opt_tied)) == len(jax.tree.leaves(opt_ref))
    for _ in range(5):
        tied, opt_tied, l1, g1 = step_tied(tied, opt_tied)
        shared_model, opt_ref, l2, g2 = step_ref(shared_model, opt_ref)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        assert g1.shared[1].weight == view  # the gradient keeps the tie
        # Shared's gradient of the embedding sums both uses, as the buffer's does here
        np.testing.assert_allclose(
            g1.shared[0].weight, g2.shared.pytree[0].weight, rtol=1e-4, atol=1e-7
        )
        np.testing.assert_allclose(g1.mid.weight, g2.mid.weight, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(
        tied.shared[0].weight, shared_model.shared.pytree[0].weight, rtol=1e-5, atol=1e-6
    )
    # and back: Shared of the materialized tree, with where and get, is the same model again
    m = st.materialize(tied)
    again = eqx.nn.Shared(m.shared, shared_model.shared.where, shared_model.shared.get)
    back = eqx.tree_at(lambda x: x.shared, m, again)
    tokens = jnp.arange(7) % VOCAB
    np.testing.assert_allclose(back(tokens), shared_model(tokens), rtol=1e-6, atol=1e-6)


def test_from_shared_reads_transforms_subtrees_and_several_nodes():
    k1, k2 = jax.random.split(jax.random.key(1))
    a, b = eqx.nn.Linear(4, 3, key=k1), eqx.nn.Linear(3, 4, key=k2)
    whole = eqx.nn.Shared((a, eqx.nn.Linear(4, 3, key=k2)), lambda p: p[1], lambda p: p[0])
    assert steqx.from_shared(whole)[1] == st.Tied("0")  # a whole layer: one tie
    both = eqx.nn.Shared(
        (a, eqx.nn.Linear(4, 3, key=k2)),
        lambda p: (p[1].weight, p[1].bias),
        lambda p: (p[0].weight, p[0].bias * 2),
    )
    tied = steqx.from_shared(both)
    assert (tied[1].weight, tied[1].bias) == (st.Tied("0/weight"), st.Tied("0/bias", st.scale(2)))
    np.testing.assert_array_equal(st.materialize(tied)[1].bias, both()[1].bias)
    b16 = eqx.tree_at(lambda m: m.weight, b, b.weight.astype(jnp.float16))
    chained = eqx.nn.Shared(
        (a, b16), lambda p: p[1].weight, lambda p: (p[0].weight.T * 0.5).astype(jnp.float16)
    )
    tied = steqx.from_shared(chained)
    assert tied[1].weight == st.Tied("0/weight", st.T >> st.scale(0.5) >> st.astype(jnp.float16))
    np.testing.assert_array_equal(st.materialize(tied)[1].weight, chained()[1].weight)
    # inside a model, and under filter_jit (no values: the views' shapes are checked)
    model = {"other": jnp.ones(2), "pair": chained}
    assert steqx.from_shared(model)["pair"][1].weight == tied[1].weight
    assert eqx.filter_jit(steqx.from_shared)(chained)[1].weight == tied[1].weight


def test_filter_vmap_over_an_ensemble_of_tied_models_equals_each_model_alone():
    keys = jax.random.split(jax.random.key(2), 3)
    ensemble = eqx.filter_vmap(lambda k: st.tie(AE(k), TIES))(keys)
    assert ensemble.dec.weight == st.Tied("enc/weight", st.T)
    assert ensemble.enc.weight.shape == (3, 3, 6)
    x = _data()

    @eqx.filter_vmap(in_axes=(eqx.if_array(0), None))
    def losses(model, x):  # materialize inside: each member's own view
        return _mse(st.materialize(model), x)

    grads = eqx.filter_jit(eqx.filter_grad(lambda e, x: losses(e, x).sum()))(ensemble, x)
    assert grads.dec.weight == st.Tied("enc/weight", st.T)
    for i, k in enumerate(keys):
        alone = st.tie(AE(k), TIES)
        np.testing.assert_allclose(
            losses(ensemble, x)[i], _mse(st.materialize(alone), x), rtol=1e-5
        )
        g = jax.grad(lambda m: _mse(st.materialize(m), x))(alone)
        np.testing.assert_allclose(grads.enc.weight[i], g.enc.weight, rtol=1e-4, atol=1e-7)
