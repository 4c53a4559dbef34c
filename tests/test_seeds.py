"""The three user stories of ../shared/seeds/, translated to JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import sharetree as st


def dense(key, n_in, n_out):
    return {"weight": jax.random.normal(key, (n_out, n_in)), "bias": jnp.zeros(n_out)}


def apply_dense(d, x):
    return d["weight"] @ x + d["bias"]


def test_seed_000_shared_layer_counts_once_and_gradient_accumulates():
    # Flux: Model(d, d); destructure counted 3 params for 2 and failed in the gradient
    d = dense(jax.random.key(0), 1, 1)
    model = {"a": d, "b": st.Tied("a")}
    x = jnp.array([0.7])
    flat, re = st.destructure(model)
    assert flat.shape == (2,)  # weight and bias, once
    assert ravel_pytree(st.materialize(model))[0].shape == (4,)  # what an untied flatten sees

    def loss(m):
        return jnp.sum(apply_dense(m["a"], x) + apply_dense(m["b"], x))

    g = jax.grad(lambda v: loss(re(v)))(flat)
    np.testing.assert_allclose(g, [2.0, 2 * x[0]], rtol=1e-6)  # bias, weight: flatten order
    # the bias is a value-equal immutable zero: never tied by identity on its own
    assert st.tie_identical({"p": 0.0, "q": 0.0}) == {"p": 0.0, "q": 0.0}


def test_seed_001_structural_gradient_of_shared_arrays_is_accumulated_and_identical():
    d1 = dense(jax.random.key(1), 2, 2)
    chain = {"layers": [d1, st.Tied("layers/0")]}
    x = jnp.array([0.3, -0.5])

    def loss(c):
        m = st.materialize(c)
        h = apply_dense(m["layers"][0], x)
        return jnp.sum(apply_dense(m["layers"][1], h))

    g = jax.grad(loss)(chain)
    gm = st.materialize(g)
    assert gm["layers"][1]["weight"] is gm["layers"][0]["weight"]

    # implicit-params style reference: one array per parameter, contributions summed
    def untied(a, b):
        return jnp.sum(apply_dense(b, apply_dense(a, x)))

    ga, gb = jax.grad(untied, argnums=(0, 1))(d1, d1)
    np.testing.assert_allclose(gm["layers"][0]["weight"], ga["weight"] + gb["weight"], rtol=1e-6)
    # memory: the gradient holds each buffer once
    assert len(jax.tree.leaves(g)) == 2


def test_seed_002_transposed_tie_survives_casts_and_device_transfer():
    enc = dense(jax.random.key(2), 2, 3)
    m = {"layers": [enc, {"weight": st.Tied("layers/0/weight", st.T), "bias": jnp.zeros(2)}]}
    with jax.enable_x64(True):
        m64 = jax.tree.map(lambda a: a.astype(jnp.float64), m)  # `m |> f64`
        assert m64["layers"][1]["weight"] == st.Tied("layers/0/weight", st.T)
        mm = st.materialize(m64)
        assert mm["layers"][1]["weight"].dtype == jnp.float64
        np.testing.assert_array_equal(mm["layers"][1]["weight"], mm["layers"][0]["weight"].T)
    dev = jax.device_put(m, jax.devices()[0])  # `m |> gpu`
    assert dev["layers"][1]["weight"] == m["layers"][1]["weight"]
    # an optax step updates the single buffer by the gradient summed over both uses
    # (checked against an untied copy below; that the view is W.T is materialize's job)
    opt = optax.sgd(0.1)
    x = jnp.array([1.0, 2.0])

    def loss(p):
        q = st.materialize(p)
        return jnp.sum(apply_dense(q["layers"][1], jnp.tanh(apply_dense(q["layers"][0], x))) ** 2)

    g = jax.grad(loss)(dev)
    upd, _ = opt.update(g, opt.init(dev))
    new = optax.apply_updates(dev, upd)
    assert new["layers"][1]["weight"] == st.Tied("layers/0/weight", st.T)

    def untied(w_in, w_out):  # the two uses of the weight as separate arrays, by hand
        h = jnp.tanh(w_in @ x + enc["bias"])
        return jnp.sum((w_out @ h + jnp.zeros(2)) ** 2)

    w = enc["weight"]
    g_in, g_out = jax.grad(untied, argnums=(0, 1))(w, w.T)
    want = w - 0.1 * (g_in + g_out.T)
    np.testing.assert_allclose(new["layers"][0]["weight"], want, rtol=1e-6, atol=1e-7)
