"""share_blocks against the Relaxed Recursive Transformers formulas written out in NumPy.

Every reference here is computed by hand: the blocks by their definitions (stepwise,
average, lower), pass ``l`` reading block ``l mod K``, the adapters from NumPy's SVD of
each layer's difference to its block, and training against a model that indexes its
``K`` blocks by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _examples import examples
from hypothesis import given, settings
from hypothesis import strategies as hs

import sharetree as st


def _stack(n, seed=0, d=4, cols=5):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((n, d, cols)).astype(np.float32),
        "b": rng.standard_normal((n, cols)).astype(np.float32),
    }


def _by_hand(x, k, init):
    n = x.shape[0]
    if init == "stepwise":
        return np.stack([x[(j * n) // k] for j in range(k)])
    if init == "lower":
        return np.stack([x[j] for j in range(k)])
    return np.stack([np.mean([x[i] for i in range(j, n, k)], axis=0) for j in range(k)])


@settings(max_examples=examples(60), deadline=None)
@given(
    hs.integers(1, 7).flatmap(lambda n: hs.tuples(hs.just(n), hs.integers(1, n))),
    hs.sampled_from(["stepwise", "average", "lower"]),
)
def test_blocks_and_cyclic_passes_equal_the_formulas(nk, init):
    n, k = nk
    layers = _stack(n)
    out = st.share_blocks({"layers": layers}, "layers", k, init=init)
    m = st.materialize(out)
    for name, x in layers.items():
        blocks = _by_hand(x, k, init)
        np.testing.assert_allclose(out["layers_blocks"][name], blocks, rtol=1e-6, atol=1e-6)
        assert out["layers"][name] == st.Tied(
            f"layers_blocks/{name}", st.take([i % k for i in range(n)])
        )
        for i in range(n):  # pass i reads block i mod K
            np.testing.assert_allclose(m["layers"][name][i], blocks[i % k], rtol=1e-6, atol=1e-6)
    if k == n and init in ("stepwise", "lower"):  # one block per layer: the original
        jax.tree.map(np.testing.assert_array_equal, m["layers"], layers)


def _truncated(diff, r):
    u, s, vt = np.linalg.svd(diff.astype(np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


def test_per_pass_lora_is_the_truncated_svd_of_each_layers_difference_to_its_block():
    layers = _stack(6, seed=1)
    rank, scale = 2, 0.5
    out = st.share_blocks(
        {"layers": layers}, "layers", 2, init="average", lora_rank=rank, lora_scale=scale
    )
    blocks = _by_hand(layers["w"], 2, "average")
    ad = out["lora"]["layers"]["w"]
    assert ad["a"].shape == (6, 4, rank) and ad["b"].shape == (6, rank, 5)
    m = st.materialize(out)["params"]["layers"]
    for i in range(6):
        want = blocks[i % 2] + _truncated(layers["w"][i] - blocks[i % 2], rank)
        np.testing.assert_allclose(m["w"][i], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(scale * ad["a"][i] @ ad["b"][i], want - blocks[i % 2], atol=1e-5)
        # biases have no adapter: each pass reads its block's
        np.testing.assert_allclose(m["b"][i], _by_hand(layers["b"], 2, "average")[i % 2], atol=1e-6)


def test_at_full_rank_the_converted_matrices_equal_the_original():
    layers = {"w": _stack(6, seed=2)["w"]}
    for rank in (4, 7):  # min(rows, columns) = 4; a larger rank pads with zeros
        out = st.share_blocks({"layers": layers}, "layers", 3, init="stepwise", lora_rank=rank)
        m = st.materialize(out)["params"]["layers"]
        np.testing.assert_allclose(m["w"], layers["w"], rtol=1e-5, atol=1e-5)


def _run(layers, x):
    def step(h, layer):
        return jnp.tanh(h @ layer["w"] + layer["b"]), None

    return jnp.sum(jax.lax.scan(step, x, layers)[0] ** 2)


def test_converted_model_trains_as_the_model_that_indexes_its_blocks_by_hand():
    layers = _stack(6, seed=3, cols=4)  # square: a scanned stack
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 4)), jnp.float32)
    out = st.share_blocks({"layers": layers}, "layers", 3, init="average")
    blocks = {n: jnp.asarray(_by_hand(v, 3, "average")) for n, v in layers.items()}

    def by_hand(blocks):  # pass l reads blocks[l % 3], written out
        h = x
        for i in range(6):
            h = jnp.tanh(h @ blocks["w"][i % 3] + blocks["b"][i % 3])
        return jnp.sum(h**2)

    opt = optax.adam(1e-2)
    tree, ref = out, blocks
    s_tree, s_ref = opt.init(tree), opt.init(ref)
    for _ in range(3):
        g = jax.grad(lambda t: _run(st.materialize(t)["layers"], x))(tree)
        u, s_tree = opt.update(g, s_tree, tree)
        tree = optax.apply_updates(tree, u)
        g = jax.grad(by_hand)(ref)
        u, s_ref = opt.update(g, s_ref, ref)
        ref = optax.apply_updates(ref, u)
    for n in layers:
        np.testing.assert_allclose(tree["layers_blocks"][n], ref[n], rtol=1e-5, atol=1e-6)
    assert isinstance(tree["layers"]["w"], st.Tied)


def test_blocks_elsewhere_and_a_single_leaf():
    w = _stack(4)["w"]
    out = st.share_blocks(
        {"model": {"w": w}, "shared": {}}, "model/w", 2, blocks="shared/w", init="lower"
    )
    np.testing.assert_array_equal(out["shared"]["w"], w[:2])
    np.testing.assert_array_equal(st.materialize(out)["model"]["w"], w[[0, 1, 0, 1]])


def test_bad_arguments_name_what_was_given():
    from _raises import raises

    tree = {"layers": _stack(4)}
    with raises("E323", "num_blocks", "2.0", cls=st.TieTypeError):
        st.share_blocks(tree, "layers", 2.0)
    with raises("E324", "lora_rank", "0", cls=st.TieTypeError):
        st.share_blocks(tree, "layers", 2, lora_rank=0)
    with raises("E324", "lora_scale", "0.0", cls=st.TieTypeError):
        st.share_blocks(tree, "layers", 2, lora_rank=1, lora_scale=0.0)
    with raises("E324", "'layers/b'", "(4, 3)"):
        st.share_blocks({"layers": {"b": np.ones((4, 3))}}, "layers", 2, lora_rank=1)
    with raises("E322", "'nope'"):
        st.share_blocks(tree, "nope", 2)
    with raises("E322", "'layers/w'", "Tied"):
        st.share_blocks({"x": np.ones(3), "layers": {"w": st.Tied("x")}}, "layers", 1)
