"""optax chains on canonical trees see each buffer once: equal to the hand-tied model.

The hand-tied reference stores ``W`` once and writes ``W`` and ``W.T`` in the
loss; the canonical tree stores ``enc/w`` and a ``Tied("enc/w", T)`` at ``dec/w``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sharetree as st

STEPS = 6


def _canonical(seed=0):
    rng = np.random.default_rng(seed)
    w, b, c = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((5, 3), (3,), (5,)))
    return {"enc": {"w": w, "b": b}, "dec": {"w": st.Tied("enc/w", st.T), "b": c}}


def _hand(canonical):
    return {"W": canonical["enc"]["w"], "b": canonical["enc"]["b"], "c": canonical["dec"]["b"]}


X = jnp.asarray(np.random.default_rng(1).standard_normal((8, 5)), jnp.float32)


def _forward(enc_w, enc_b, dec_w, dec_b):
    return jnp.mean((jnp.tanh(X @ enc_w + enc_b) @ dec_w + dec_b - X) ** 2)


def loss_canonical(p):
    m = st.materialize(p)
    return _forward(m["enc"]["w"], m["enc"]["b"], m["dec"]["w"], m["dec"]["b"])


def loss_hand(p):
    return _forward(p["W"], p["b"], p["W"].T, p["c"])


def _run(tx, params, loss):
    @jax.jit
    def step(params, opt):
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    opt = tx.init(params)
    losses = []
    for _ in range(STEPS):
        params, opt, value = step(params, opt)
        losses.append(float(value))
    return params, opt, np.array(losses)


def _assert_same_training(tx_canonical, tx_hand):
    canonical = _canonical()
    p1, opt1, l1 = _run(tx_canonical, canonical, loss_canonical)
    p2, opt2, l2 = _run(tx_hand, _hand(canonical), loss_hand)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for name, a in _hand(p1).items():
        np.testing.assert_allclose(a, p2[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert p1["dec"]["w"] == st.Tied("enc/w", st.T)
    assert l1[-1] < l1[0]
    return opt1, opt2


def test_clip_by_global_norm_sees_the_shared_buffer_once():
    g = jax.jit(jax.grad(loss_canonical))(_canonical())
    g_hand = jax.jit(jax.grad(loss_hand))(_hand(_canonical()))
    np.testing.assert_allclose(optax.tree.norm(g), optax.tree.norm(g_hand), rtol=1e-6)
    # the materialized gradient (what an untied copy would see) has a different norm
    untied = lambda m: _forward(m["enc"]["w"], m["enc"]["b"], m["dec"]["w"], m["dec"]["b"])  # noqa: E731
    g_untied = jax.jit(jax.grad(untied))(st.materialize(_canonical()))
    assert not np.isclose(float(optax.tree.norm(g_untied)), float(optax.tree.norm(g)))
    norm = float(optax.tree.norm(g))
    tx = optax.chain(optax.clip_by_global_norm(norm / 4), optax.sgd(0.1))  # clipping is active
    _assert_same_training(tx, tx)


def test_adamw_decays_each_buffer_once_with_a_mask_by_path():
    canonical = _canonical()
    mask = st.mask_by_path(canonical, "*/w")
    tied = st.Tied("enc/w", st.T)
    assert mask == {"enc": {"w": True, "b": False}, "dec": {"w": tied, "b": False}}
    tx_c = optax.adamw(1e-2, weight_decay=0.5, mask=mask)
    tx_h = optax.adamw(1e-2, weight_decay=0.5, mask={"W": True, "b": False, "c": False})
    _assert_same_training(tx_c, tx_h)
    # zero gradient: the update is exactly -lr * wd * W, applied once (not once per use)
    zeros = jax.tree.map(jnp.zeros_like, canonical)
    updates, _ = tx_c.update(zeros, tx_c.init(canonical), canonical)
    np.testing.assert_allclose(updates["enc"]["w"], -1e-2 * 0.5 * canonical["enc"]["w"], rtol=1e-6)
    np.testing.assert_array_equal(updates["enc"]["b"], 0.0)
    # the callable form works too
    tx_fn = optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: st.mask_by_path(p, "*/w"))
    updates_fn, _ = tx_fn.update(zeros, tx_fn.init(canonical), canonical)
    np.testing.assert_array_equal(updates_fn["enc"]["w"], updates["enc"]["w"])


def test_multi_transform_and_partition_with_labels_by_path():
    canonical = _canonical()
    labels = st.label_by_path(canonical, {"enc": "fast", "dec": "slow"})
    assert labels == {
        "enc": {"w": "fast", "b": "fast"},
        "dec": {"w": st.Tied("enc/w", st.T), "b": "slow"},
    }
    hand_labels = {"W": "fast", "b": "fast", "c": "slow"}
    transforms = {"fast": optax.adam(1e-1), "slow": optax.sgd(1e-2)}
    _assert_same_training(
        optax.multi_transform(transforms, labels), optax.multi_transform(transforms, hand_labels)
    )
    by_fn = lambda p: st.label_by_path(p, {"enc": "fast", "dec": "slow"})  # noqa: E731
    _assert_same_training(
        optax.partition(transforms, by_fn), optax.partition(transforms, hand_labels)
    )


def test_multisteps_accumulates_each_buffer_once():
    tx = optax.MultiSteps(optax.adam(5e-2), every_k_schedule=3)
    opt_c, opt_h = _assert_same_training(tx, tx)
    n = st.canonicalize(_canonical()).num_unique
    assert len(jax.tree.leaves(opt_c.acc_grads)) == n == len(jax.tree.leaves(opt_h.acc_grads))
    assert int(opt_c.gradient_step) == STEPS // 3


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adam(1e-2),
        lambda: optax.adamw(1e-2),
        lambda: optax.lion(1e-3),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    ],
)
def test_optimizer_state_holds_one_moment_per_unique_buffer(make):
    canonical = _canonical()
    graph = st.canonicalize(canonical)
    state = make().init(canonical)
    moments = [
        leaf for leaf in jax.tree.leaves(state) if getattr(leaf, "shape", ()) != ()
    ]  # count / step scalars aside
    per_moment = graph.num_unique
    assert len(moments) % per_moment == 0 and len(moments) > 0
    shapes = sorted(tuple(m.shape) for m in moments)
    expected = sorted(tuple(b.shape) for b in graph.buffers) * (len(moments) // per_moment)
    assert shapes == sorted(expected)
    assert all(s != (3, 5) for s in shapes)  # no moment for the view
