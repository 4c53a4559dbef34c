"""The XLA:CPU split trick is chosen per platform when a program is lowered.

``restructure`` cuts a traced vector at opaque offsets only in code lowered for
CPU (``jax.lax.platform_dependent``), never by the host's default backend: a
program exported for ``cuda`` or ``tpu`` from this CPU host has the plain
split, and a multi-platform export runs here with the same results.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharetree as st


def _tree(layers=12, dim=3):
    k = jax.random.split(jax.random.key(4), layers)
    tree = {
        f"l{i:02d}": {"w": jax.random.normal(k[i], (dim, dim)), "b": jnp.full(dim, 0.1 * i)}
        for i in range(layers)
    }
    for i in range(3, layers, 4):
        tree[f"l{i:02d}"]["w"] = st.Tied(f"l{i - 1:02d}/w", st.T)
    return tree


def _loss_by_hand(tree, v):
    """The loss on a vector cut by hand with NumPy offsets (flatten order: b before w)."""
    out, i = 0.0, 0
    leaves = {}
    for name in sorted(tree):
        for key in ("b", "w"):
            x = tree[name][key]
            if isinstance(x, st.Tied):
                continue
            n = x.size
            leaves[(name, key)] = v[i : i + n].reshape(x.shape)
            i += n
    for name in sorted(tree):
        w = tree[name]["w"]
        w = leaves[(w.ref[0], "w")].T if isinstance(w, st.Tied) else leaves[(name, "w")]
        out = out + jnp.sum(jnp.sin(w)) + jnp.sum(leaves[(name, "b")] ** 2)
    return out


def _loss(re):
    def loss(v):
        m = re(v)
        return sum(jnp.sum(jnp.sin(layer["w"])) + jnp.sum(layer["b"] ** 2) for layer in m.values())

    return loss


def _ops(exported):
    return collections.Counter(re.findall(r"stablehlo\.(\w+)", exported.mlir_module()))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_an_export_for_another_platform_from_a_cpu_host_has_the_plain_split(platform):
    tree = _tree()
    flat, restructure = st.destructure(tree)
    n = len(restructure.sizes)
    for f in (jax.jit(restructure), jax.jit(jax.grad(_loss(restructure)))):
        ops = _ops(jax.export.export(f, platforms=(platform,))(flat))
        assert "dynamic_slice" not in ops and "optimization_barrier" not in ops
        assert ops["slice"] >= n  # every buffer cut at a constant offset
    cpu = _ops(jax.export.export(jax.jit(restructure), platforms=("cpu",))(flat))
    assert cpu["dynamic_slice"] == n and cpu["optimization_barrier"] == 1  # the trick, on CPU


def test_a_multi_platform_export_runs_on_cpu_with_the_same_results():
    tree = _tree()
    flat, restructure = st.destructure(tree)
    flat = flat + 0.01 * jnp.arange(flat.size)  # values the tree did not have
    loss = _loss(restructure)
    for f in (jax.jit(loss), jax.jit(jax.grad(loss)), jax.jit(restructure)):
        exported = jax.export.export(f, platforms=("cpu", "cuda"))(flat)
        assert exported.platforms == ("cpu", "cuda")
        got, want = exported.call(flat), f(flat)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # against the vector cut by hand
    np.testing.assert_allclose(
        jax.export.export(jax.jit(loss), platforms=("cpu", "cuda"))(flat).call(flat),
        _loss_by_hand(tree, flat),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        jax.export.export(jax.jit(jax.grad(loss)), platforms=("cpu", "cuda"))(flat).call(flat),
        jax.grad(lambda v: _loss_by_hand(tree, v))(flat),
        rtol=1e-5,
        atol=1e-6,
    )


def test_an_export_of_a_function_of_a_canonical_tree_serializes_with_its_ties():
    # jax.export's serialization of the input and output trees: a Tied is written as its
    # ref and transform spec, and read back equal (a spec is read, never imported or called)
    tree = {
        "w": jnp.arange(6.0).reshape(2, 3),
        "head": st.Tied("w", st.T >> st.slice(0, 2)),
        "q": st.Tied(("w",), st.index(1) >> st.scale(2.0)),
    }

    def loss(t):
        m = st.materialize(t)
        return jnp.sum(m["head"]) + jnp.sum(m["q"] ** 2)

    exported = jax.export.export(jax.jit(jax.value_and_grad(loss)))(tree)
    back = jax.export.deserialize(exported.serialize())
    assert back.in_tree == exported.in_tree and back.out_tree == exported.out_tree
    value, grad = back.call(tree)
    # by hand: head is w.T[:2] (w's first two columns), q is 2 * w[1]
    w = np.arange(6.0).reshape(2, 3)
    assert float(value) == pytest.approx(w[:, :2].sum() + np.sum((2 * w[1]) ** 2))
    want = np.zeros((2, 3))
    want[:, :2] += 1.0
    want[1] += 8 * w[1]
    np.testing.assert_allclose(grad["w"], want)
    assert grad["head"] == tree["head"] and grad["q"] == tree["q"]
