"""Upcycling: experts as repeated entries of one feed-forward, untied with their state.

The reference is a mixture of experts initialised by hand: each expert a NumPy copy of
the dense feed-forward, its Adam moments copies of the dense ones, the same noise added
from the same keys; then both train with optax and must stay equal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sharetree as st

D, H, E = 3, 5, 4


def _dense(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "ffn": {
            "w1": jnp.asarray(rng.standard_normal((D, H)), jnp.float32),
            "w2": jnp.asarray(rng.standard_normal((H, D)), jnp.float32),
        },
        "router": jnp.asarray(rng.standard_normal((D, E)) * 0.1, jnp.float32),
    }


def _experts_view(tree):
    """Each expert an entry of one view of the dense feed-forward, repeated E times."""
    return {
        n: st.Tied(f"ffn/{n}", st.reshape(1, *np.shape(w)) >> st.take((0,) * E))
        for n, w in tree["ffn"].items()
    }


def _moe(experts, router, x):
    gates = jax.nn.softmax(x @ router)  # (batch, E): dense gating, each expert weighted
    hidden = jnp.einsum("bd,edh->beh", x, experts["w1"])
    out = jnp.einsum("beh,ehd->bed", jax.nn.gelu(hidden), experts["w2"])
    return jnp.einsum("be,bed->bd", gates, out)


def _loss(m, x, y):
    return jnp.mean((_moe(m["experts"], m["router"], x) - y) ** 2)


def _noise(experts, key, sigma):
    """Symmetry-breaking noise: one key per expert leaf, normal * sigma."""
    keys = jax.random.split(key, len(experts))
    return {
        n: w + sigma * jax.random.normal(k, w.shape, w.dtype)
        for (n, w), k in zip(sorted(experts.items()), keys)
    }


def test_upcycled_experts_and_their_state_equal_a_moe_initialised_by_hand_and_train_alike():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, D)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, D)), jnp.float32)
    opt = optax.adam(1e-2)
    tree = {**_dense(), "experts": _experts_view(_dense())}  # tied: a dense model in effect
    state = opt.init(tree)
    for _ in range(2):  # the dense phase: every expert is the one feed-forward
        g = jax.grad(lambda t: _loss(st.materialize(t), x, y))(tree)
        u, state = opt.update(g, state, tree)
        tree = optax.apply_updates(tree, u)
    untied = st.untie(tree, "experts")
    new_state = st.untie_state(state, tree, "experts")
    # by hand: each expert a copy of the dense feed-forward, its moments copies too
    ffn, mu, nu = tree["ffn"], state[0].mu["ffn"], state[0].nu["ffn"]
    for n in ("w1", "w2"):
        np.testing.assert_array_equal(untied["experts"][n], np.stack([np.asarray(ffn[n])] * E))
        np.testing.assert_array_equal(new_state[0].mu["experts"][n], np.stack([mu[n]] * E))
        np.testing.assert_array_equal(new_state[0].nu["experts"][n], np.stack([nu[n]] * E))
    assert int(new_state[0].count) == 2
    key, sigma = jax.random.key(7), 1e-2
    untied["experts"] = _noise(untied["experts"], key, sigma)
    by_hand = {
        "experts": {n: jnp.stack([ffn[n]] * E) for n in ("w1", "w2")},
        "router": tree["router"],
    }
    keys = jax.random.split(key, 2)
    for n, k in zip(("w1", "w2"), keys):
        by_hand["experts"][n] = by_hand["experts"][n] + sigma * jax.random.normal(
            k, by_hand["experts"][n].shape
        )
    hand_state = opt.init(by_hand)
    hand_state = (
        hand_state[0]._replace(
            count=state[0].count,
            mu={
                "experts": {n: jnp.stack([mu[n]] * E) for n in mu},
                "router": state[0].mu["router"],
            },
            nu={
                "experts": {n: jnp.stack([nu[n]] * E) for n in nu},
                "router": state[0].nu["router"],
            },
        ),
        *hand_state[1:],
    )
    for _ in range(3):  # the experts train apart
        g = jax.grad(lambda t: _loss(st.materialize(t), x, y))(untied)
        u, new_state = opt.update(g, new_state, untied)
        untied = optax.apply_updates(untied, u)
        g = jax.grad(lambda t: _loss(t, x, y))(by_hand)
        u, hand_state = opt.update(g, hand_state, by_hand)
        by_hand = optax.apply_updates(by_hand, u)
    for n in ("w1", "w2"):
        np.testing.assert_allclose(
            untied["experts"][n], by_hand["experts"][n], rtol=1e-5, atol=1e-6
        )
        spread = np.ptp(np.asarray(untied["experts"][n]), axis=0).max()
        assert spread > 1e-3  # the experts moved apart
    np.testing.assert_allclose(untied["router"], by_hand["router"], rtol=1e-5, atol=1e-6)


def test_tied_experts_compute_the_dense_feed_forward():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, D)), jnp.float32)
    tree = {**_dense(), "experts": _experts_view(_dense())}
    m = st.materialize(tree)
    dense = jax.nn.gelu(x @ m["ffn"]["w1"]) @ m["ffn"]["w2"]  # gates sum to 1
    np.testing.assert_allclose(_moe(m["experts"], m["router"], x), dense, rtol=1e-5, atol=1e-5)
