"""Adapters on tied weights, each against the same model written by hand in jnp.

The hand-written models never call sharetree: they hold the embedding once and write
``E + s * a @ b`` (or the block a layer uses) where the model needs it. sharetree's
models read the materialized tree of ``st.add_lora``'s output. Gradients, optax steps
and merges must agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import sharetree as st
from tests._raises import raises

V, D, R, S = 11, 6, 3, 0.5  # vocabulary, width, adapter rank, adapter scale
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (4, 7)))


def _rand(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 0.5, jnp.float32)


def _lm(embed, w, head, tokens=TOKENS):
    """A tied LM by hand: lookup, one tanh layer, the head, next-token cross entropy."""
    h = jnp.tanh(embed[tokens[:, :-1]] @ w)
    logits = h @ head
    target = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], -1))


def _params():
    return {"embed": _rand(1, V, D), "w": _rand(2, D, D), "head": st.Tied("embed", st.T)}


def _lm_tree(m):
    return _lm(m["embed"], m["w"], m["head"])


def _adapted(where, b_seed=3):
    """``add_lora`` on ``where``, with ``b`` set non-zero (at zero, a's gradient is zero)."""
    out = st.add_lora(_params(), where, rank=R, key=jax.random.key(0), scale=S)
    name = where.replace("/", "_")
    ab = out["lora"][name]
    ab["b"] = _rand(b_seed, *ab["b"].shape)
    return out


def _loss_st(adapted):
    return _lm_tree(st.materialize(adapted)["params"])


# --- one adapter on the tied embedding: the lookup and the head see E + s a @ b ------------


def _loss_hand_embed(e, w, a, b):
    adapted = e + S * a @ b  # written once, read by the lookup and (transposed) the head
    return _lm(adapted, w, adapted.T)


def test_add_lora_on_the_tied_embedding_moves_the_base_and_keeps_the_head_a_view():
    out = _adapted("embed")
    assert out["params"]["head"] == st.Tied("embed", st.T)  # untouched: it reads the view
    lora = out["lora"]["embed"]
    assert lora["a"].shape == (V, R) and lora["b"].shape == (R, D)
    assert lora["base"] is _params()["embed"] or np.array_equal(lora["base"], _params()["embed"])
    m = st.materialize(out)["params"]
    expected = np.asarray(lora["base"]) + S * np.asarray(lora["a"]) @ np.asarray(lora["b"])
    np.testing.assert_allclose(m["embed"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m["head"], expected.T, rtol=1e-6, atol=1e-6)


def test_a_fresh_adapter_computes_what_the_model_did():
    params = _params()
    out = st.add_lora(params, "embed", rank=R, key=jax.random.key(1), scale=S)
    assert not np.any(out["lora"]["embed"]["b"])  # b at zero, as LoRA starts
    bound = 1 / np.sqrt(V)
    assert np.all(np.abs(out["lora"]["embed"]["a"]) <= bound) and np.any(out["lora"]["embed"]["a"])
    np.testing.assert_allclose(_loss_st(out), _lm_tree(st.materialize(params)), rtol=1e-6)


def test_gradients_of_a_and_b_equal_the_hand_written_model_and_finite_differences():
    out = _adapted("embed")
    lora = out["lora"]["embed"]
    args = (lora["base"], out["params"]["w"], lora["a"], lora["b"])
    hand = jax.grad(_loss_hand_embed, argnums=(0, 1, 2, 3))(*args)
    g = jax.grad(_loss_st)(out)
    got = (
        g["lora"]["embed"]["base"],
        g["params"]["w"],
        g["lora"]["embed"]["a"],
        g["lora"]["embed"]["b"],
    )
    for x, y in zip(got, hand, strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
    # finite differences of the hand-free loss along a random direction of a and of b
    for k, name in ((2, "a"), (3, "b")):
        direction = _rand(10 + k, *args[k].shape)
        eps = 1e-2

        def moved(t, k=k, name=name, direction=direction):
            tree = jax.tree.map(lambda x: x, out)
            tree["lora"]["embed"][name] = args[k] + t * direction
            return _loss_st(tree)

        fd = (moved(eps) - moved(-eps)) / (2 * eps)
        np.testing.assert_allclose(fd, jnp.vdot(got[k], direction), rtol=2e-2, atol=1e-4)


def test_frozen_base_with_mask_by_path_and_optax_matches_the_hand_model_step_for_step():
    out = _adapted("embed")
    mask = st.mask_by_path(out, "lora/*/[ab]")
    assert mask["lora"]["embed"] == {"a": True, "b": True, "base": False}
    assert mask["params"]["w"] is False
    frozen = jax.tree.map(lambda m: not m, mask)
    opt = optax.chain(
        optax.masked(optax.adam(0.05), mask), optax.masked(optax.set_to_zero(), frozen)
    )
    state = opt.init(out)
    hand_opt = optax.adam(0.05)
    lora = out["lora"]["embed"]
    ab = {"a": lora["a"], "b": lora["b"]}
    hand_state = hand_opt.init(ab)
    base, w = lora["base"], out["params"]["w"]
    for _ in range(4):
        loss, g = jax.value_and_grad(_loss_st)(out)
        updates, state = opt.update(g, state, out)
        out = optax.apply_updates(out, updates)
        hand_loss, hg = jax.value_and_grad(lambda p: _loss_hand_embed(base, w, p["a"], p["b"]))(ab)
        hand_updates, hand_state = hand_opt.update(hg, hand_state, ab)
        ab = optax.apply_updates(ab, hand_updates)
        np.testing.assert_allclose(loss, hand_loss, rtol=1e-5)
        for name in "ab":
            np.testing.assert_allclose(out["lora"]["embed"][name], ab[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out["lora"]["embed"]["base"], base)  # frozen
        np.testing.assert_array_equal(out["params"]["w"], w)
        assert out["params"]["head"] == st.Tied("embed", st.T)  # the tie survives optax


def test_merge_gives_one_tensor_and_the_tie():
    out = _adapted("embed")
    merged = st.merge_lora(out)
    assert set(merged) == {"embed", "w", "head"}
    assert merged["head"] == st.Tied("embed", st.T)
    lora = out["lora"]["embed"]
    by_hand = np.asarray(lora["base"]) + S * np.asarray(lora["a"]) @ np.asarray(lora["b"])
    np.testing.assert_allclose(merged["embed"], by_hand, rtol=1e-6, atol=1e-6)
    assert len(jax.tree.leaves(merged)) == 2  # embed and w: the head is no copy
    hand = _loss_hand_embed(lora["base"], out["params"]["w"], lora["a"], lora["b"])
    np.testing.assert_allclose(_lm_tree(st.materialize(merged)), hand, rtol=1e-6)


def test_the_adapted_table_is_computed_once_however_many_views_read_it():
    out = _adapted("embed")
    text = jax.jit(st.materialize).lower(out).as_text()
    assert text.count("dot_general") == 1  # embed and head read one a @ b
    # and in a training step: one forward a @ b (the backward has its own products)
    fwd = jax.jit(_loss_st).lower(out).as_text()
    assert fwd.count("dot_general") == 1 + 2  # a @ b, the layer's h @ w, the head's h @ E'.T


# --- an adapter on the head view only: the lookup unadapted --------------------------------


def test_an_adapter_on_the_head_view_only_leaves_the_lookup_alone():
    out = _adapted("head")
    assert out["params"]["embed"] is _params()["embed"] or not isinstance(
        out["params"]["embed"], st.Tied
    )
    lora = out["lora"]["head"]
    assert (
        isinstance(lora["base"], st.Tied)
        and lora["a"].shape == (D, R)
        and lora["b"].shape == (R, V)
    )
    e, w = out["params"]["embed"], out["params"]["w"]

    def hand(e, w, a, b):
        return _lm(e, w, e.T + S * a @ b)

    want = jax.grad(hand, argnums=(0, 1, 2, 3))(e, w, lora["a"], lora["b"])
    g = jax.grad(_loss_st)(out)
    got = (g["params"]["embed"], g["params"]["w"], g["lora"]["head"]["a"], g["lora"]["head"]["b"])
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
    merged = st.merge_lora(out)
    assert not isinstance(merged["head"], st.Tied)  # its own buffer: the lookup never saw a @ b
    np.testing.assert_allclose(
        merged["head"], e.T + S * lora["a"] @ lora["b"], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_array_equal(merged["embed"], e)


# --- shared blocks for a scanned stack, each layer with its own adapter ---------------------

K, L = 2, 6
IDX = (0, 1, 0, 1, 0, 1)
X0 = _rand(20, 5, D)


def _scan(stack):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jnp.sum(jax.lax.scan(layer, X0, stack)[0] ** 2)


def _stack_tree():
    tree = {"blocks": _rand(21, K, D, D), "stack": st.Tied("blocks", st.take(IDX))}
    out = st.add_lora(tree, "stack", rank=R, key=jax.random.key(2), scale=S)
    out["lora"]["stack"]["b"] = _rand(22, L, R, D)
    return out


def test_shared_blocks_for_a_scanned_stack_with_per_layer_adapters():
    out = _stack_tree()
    lora = out["lora"]["stack"]
    assert lora["a"].shape == (L, D, R) and lora["b"].shape == (L, R, D)
    blocks, a, b = out["params"]["blocks"], lora["a"], lora["b"]

    def per_layer(ws, a, b):  # six untied layers: the reference for the sums
        return _scan(jnp.stack([ws[i] + S * a[i] @ b[i] for i in range(L)]))

    untied = jnp.stack([blocks[i] for i in IDX])
    g_layers, g_a, g_b = jax.grad(per_layer, argnums=(0, 1, 2))(untied, a, b)
    g = jax.grad(lambda t: _scan(st.materialize(t)["params"]["stack"]))(out)
    for k in range(K):  # each block's gradient: the sum over the layers that use it
        want = sum(g_layers[i] for i in range(L) if IDX[i] == k)
        np.testing.assert_allclose(g["params"]["blocks"][k], want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(g["lora"]["stack"]["a"], g_a, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(g["lora"]["stack"]["b"], g_b, rtol=2e-5, atol=1e-6)
    merged = st.merge_lora(out)  # an adapted view: its own buffer of six layers
    np.testing.assert_allclose(
        merged["stack"],
        jnp.stack([blocks[IDX[i]] + S * a[i] @ b[i] for i in range(L)]),
        rtol=1e-5,
        atol=1e-6,
    )


# --- a factorized head (E @ P).T ---------------------------------------------------------


def test_a_factorized_embedding_and_head_against_the_hand_model():
    e, p, w = _rand(30, V, 2), _rand(31, 2, D), _rand(32, D, D)
    tree = {
        "e": e,
        "p": p,
        "w": w,
        "embed": st.Tied({"a": "e", "b": "p"}, st.matmul()),
        "head": st.Tied("embed", st.T),
    }

    def loss(t):
        m = st.materialize(t)
        return _lm(m["embed"], m["w"], m["head"])

    def hand(e, p, w):
        table = e @ p
        return _lm(table, w, table.T)

    want = jax.grad(hand, argnums=(0, 1, 2))(e, p, w)
    g = jax.grad(loss)(tree)
    for x, y in zip((g["e"], g["p"], g["w"]), want, strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
    assert len(jax.tree.leaves(tree)) == 3


# --- the flat path against ravel_pytree and the views by hand --------------------------------


def _hand_flat():
    """The LoRA-on-tied LM by hand on ravel_pytree's vector of (a, b, base, w)."""
    out = _adapted("embed")
    lora = out["lora"]["embed"]
    hand_params = {"a": lora["a"], "b": lora["b"], "base": lora["base"], "w": out["params"]["w"]}
    vec, unravel = ravel_pytree(hand_params)

    def loss(v):
        p = unravel(v)
        return _loss_hand_embed(p["base"], p["w"], p["a"], p["b"])

    return out, vec, loss


def test_the_flat_path_equals_ravel_pytree_with_the_views_by_hand():
    out, vec, hand_loss = _hand_flat()
    flat, restructure = st.destructure(out)
    assert flat.shape == vec.shape  # a, b, base and w once each; no view is a copy
    # the flat order is the canonical flatten order: lora/embed/{a,b,base}, params/w
    np.testing.assert_array_equal(flat, vec)

    def loss_closed(v):
        return _lm_tree(restructure(v)["params"])

    def loss_arg(v, r):
        return _lm_tree(r(v)["params"])

    g_hand = jax.grad(hand_loss)(vec)
    np.testing.assert_allclose(jax.jit(jax.grad(loss_closed))(flat), g_hand, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss_arg), static_argnums=1)(flat, restructure),
        g_hand,
        rtol=2e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss_arg))(flat, restructure), g_hand, rtol=2e-5, atol=1e-6
    )
    t = _rand(40, *vec.shape)
    _, jvp_st = jax.jvp(loss_closed, (flat,), (t,))
    _, jvp_hand = jax.jvp(hand_loss, (vec,), (t,))
    np.testing.assert_allclose(jvp_st, jvp_hand, rtol=2e-5, atol=1e-6)
    batch = jnp.stack([flat, flat * 0.5, flat + 0.1])
    np.testing.assert_allclose(jax.vmap(loss_closed)(batch), jax.vmap(hand_loss)(batch), rtol=1e-5)
    hvp_st = jax.jvp(jax.grad(loss_closed), (flat,), (t,))[1]
    hvp_hand = jax.jvp(jax.grad(hand_loss), (vec,), (t,))[1]
    np.testing.assert_allclose(hvp_st, hvp_hand, rtol=1e-4, atol=1e-5)


# --- bad input ---------------------------------------------------------------------------


def test_add_lora_refuses_what_it_cannot_adapt():
    params = {
        "embed": _rand(1, V, D),
        "bias": _rand(2, D),
        "dec": st.Tied("sub"),
        "sub": {"w": _rand(3, D, D)},
    }
    key = jax.random.key(0)
    with raises("E173", "'embd'", "'embed'"):
        st.add_lora(params, "embd", rank=2, key=key)
    with raises("E173", "'dec/w'", "'dec'"):  # one leaf of a subtree view
        st.add_lora(params, "dec/w", rank=2, key=key)
    with raises("E174", "'bias'", "float32[6]"):
        st.add_lora(params, "bias", rank=2, key=key)
    with raises("E174", "rank", cls=st.TieTypeError):
        st.add_lora(params, "embed", rank=0, key=key)
    with raises("E175", "'params'", "'lora'"):
        st.merge_lora(params)


def test_merge_refuses_a_tree_whose_other_ties_read_the_adapters():
    out = _adapted("embed")
    out["params"]["extra"] = st.Tied("lora/embed/a")
    with raises("E175", "'params/extra'", "'lora/embed/a'"):
        st.merge_lora(out)


@pytest.mark.parametrize("where", ["embed", "head", "w"])
def test_add_lora_on_each_position_keeps_the_models_value(where):
    params = _params()
    out = st.add_lora(params, where, rank=2, key=jax.random.key(3))
    np.testing.assert_allclose(_loss_st(out), _lm_tree(st.materialize(params)), rtol=1e-6)
    back = st.merge_lora(out)
    np.testing.assert_allclose(
        _lm_tree(st.materialize(back)), _lm_tree(st.materialize(params)), rtol=1e-6
    )


# --- QLoRA: an adapter on a packed tied table (st.dequantize), merged to floats or packed -----

G = 32  # the group size of the packed tables below (4 bits: 8 values per uint32 word)


def _dequantize_by_hand(q, scales, biases):
    """MLX's 4-bit affine layout unpacked with NumPy: 8 values a word, lowest bits first."""
    q = np.asarray(q)
    values = (q[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    values = values.reshape(*q.shape[:-1], -1, G).astype(np.float32)
    return (values * np.asarray(scales)[..., None] + np.asarray(biases)[..., None]).reshape(
        *q.shape[:-1], -1
    )


def _packed_tree():
    """A tied LM whose lookup and head read one 4-bit table: no float copy is a buffer."""
    packed = st.quantize(_rand(1, V, 2 * G), 4, G)
    refs = {n: f"packed/{n}" for n in ("q", "scales", "biases")}
    return {
        "packed": packed,
        "embed": st.Tied(refs, st.dequantize(4, G)),
        "w": _rand(2, 2 * G, 2 * G),
        "head": st.Tied("embed", st.T),
    }


def _qlora():
    out = st.add_lora(_packed_tree(), "embed", rank=R, key=jax.random.key(0), scale=S)
    out["lora"]["embed"]["b"] = _rand(3, R, 2 * G)
    return out


def _with_factors(out, ab):
    """``out`` with the adapter's factors replaced: the packed base stays out of the gradient."""
    lora = {"embed": {**out["lora"]["embed"], **ab}}
    return {"params": out["params"], "lora": lora}


def test_qlora_on_a_packed_tied_table_matches_the_hand_model_and_its_gradients():
    out = _qlora()
    packed, w = out["params"]["packed"], out["params"]["w"]
    assert out["lora"]["embed"]["base"].transform == st.dequantize(4, G)
    assert out["params"]["head"] == st.Tied("embed", st.T)
    ab = {k: out["lora"]["embed"][k] for k in "ab"}
    table = jnp.asarray(_dequantize_by_hand(packed["q"], packed["scales"], packed["biases"]))

    def hand(ab):
        adapted = table + S * ab["a"] @ ab["b"]  # one adapted table, lookup and head
        return _lm(adapted, w, adapted.T)

    loss, g = jax.value_and_grad(lambda ab: _loss_st(_with_factors(out, ab)))(ab)
    hand_loss, hand_g = jax.value_and_grad(hand)(ab)
    np.testing.assert_allclose(loss, hand_loss, rtol=1e-5)
    for k in "ab":
        np.testing.assert_allclose(g[k], hand_g[k], rtol=1e-4, atol=1e-6)
    m = st.materialize(out)["params"]
    np.testing.assert_array_equal(m["head"], m["embed"].T)


def test_qlora_merged_to_floats_keeps_the_tie_and_the_packed_table():
    out = _qlora()
    packed, lora = out["params"]["packed"], out["lora"]["embed"]
    merged = st.merge_lora(out)
    table = _dequantize_by_hand(packed["q"], packed["scales"], packed["biases"])
    np.testing.assert_allclose(merged["embed"], table + S * lora["a"] @ lora["b"], atol=1e-5)
    assert merged["head"] == st.Tied("embed", st.T)
    np.testing.assert_array_equal(merged["packed"]["q"], packed["q"])  # nothing dropped


def test_qlora_merged_and_requantized_is_one_packed_table_again():
    out = _qlora()
    packed, lora = out["params"]["packed"], out["lora"]["embed"]
    table = _dequantize_by_hand(packed["q"], packed["scales"], packed["biases"])
    by_hand = np.asarray(table + S * lora["a"] @ lora["b"])
    merged = st.merge_lora(out, requantize=True)
    assert merged["head"] == st.Tied("embed", st.T)
    assert merged["embed"].transform == st.dequantize(4, G)
    new = merged["packed"]
    assert new["q"].dtype == np.uint32 and new["q"].shape == packed["q"].shape
    assert not np.array_equal(new["q"], packed["q"])  # the adapter reached the packed table
    m = st.materialize(merged)
    by_words = _dequantize_by_hand(new["q"], new["scales"], new["biases"])
    np.testing.assert_array_equal(m["embed"], by_words)
    np.testing.assert_array_equal(m["head"], m["embed"].T)
    # each value within a step of the merged table (MLX's rule makes zero exact, which may
    # move the far end of a group by half a step more than rounding does), mostly within half
    step = np.repeat(np.abs(np.asarray(new["scales"])), G, axis=-1)
    error = np.abs(m["embed"] - by_hand)
    assert (error <= step + 1e-5).all() and (error <= step / 2 + 1e-5).mean() > 0.95
    mx = pytest.importorskip("mlx.core")
    wq, scales, biases = mx.quantize(mx.array(by_hand), group_size=G, bits=4)
    # MLX's rounding of the merged floats (computed here in float32 by hand) gives the same words
    np.testing.assert_array_equal(np.asarray(new["q"]), np.array(wq))
    np.testing.assert_allclose(np.asarray(new["scales"]), np.array(scales), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new["biases"]), np.array(biases), rtol=1e-6)


def test_requantize_refuses_a_float_base_and_a_table_other_views_read():
    float_base = st.add_lora(_params(), "embed", rank=R, key=jax.random.key(0))
    with raises("E208", "'embed'", "float buffer"):
        st.merge_lora(float_base, requantize=True)
    out = st.add_lora(_packed_tree(), "embed", rank=R, key=jax.random.key(0))
    out["params"]["probe"] = st.Tied(  # another view of the packed table, tied after add_lora
        {n: f"packed/{n}" for n in ("q", "scales", "biases")}, st.dequantize(4, G) >> st.T
    )
    with raises("E208", "'embed'", "'params/probe'"):
        st.merge_lora(out, requantize=True)
    with raises("E208", "requantize="):
        st.merge_lora(out, requantize="yes")


# --- the documented recipe on a packed table; adapting a view never unties in silence -------


def test_the_documented_recipe_trains_a_qlora_tree_holding_packed_uint32_tables():
    out = _qlora()
    packed, w = out["params"]["packed"], out["params"]["w"]
    with pytest.raises(TypeError):  # what the recipe avoids: grad of the whole tree
        jax.grad(_loss_st)(out)
    # the recipe of docs/adapters.md, as written
    train, frozen = st.partition(out, st.mask_by_path(out, "lora/*/[ab]"))
    opt = optax.adam(1e-2)
    state = opt.init(train)
    for _ in range(3):
        grads = jax.grad(lambda t: _loss_st(st.combine(t, frozen)))(train)
        updates, state = opt.update(grads, state, train)
        train = optax.apply_updates(train, updates)
    tuned = st.combine(train, frozen)
    # by hand: the dequantized table in NumPy, optax on the two factors alone
    table = jnp.asarray(_dequantize_by_hand(packed["q"], packed["scales"], packed["biases"]))

    def hand(ab):
        adapted = table + S * ab["a"] @ ab["b"]
        return _lm(adapted, w, adapted.T)

    ab = {k: out["lora"]["embed"][k] for k in "ab"}
    hand_state = opt.init(ab)
    for _ in range(3):
        updates, hand_state = opt.update(jax.grad(hand)(ab), hand_state, ab)
        ab = optax.apply_updates(ab, updates)
    for k in "ab":
        np.testing.assert_allclose(tuned["lora"]["embed"][k], ab[k], rtol=1e-4, atol=1e-6)
    assert tuned["params"]["packed"]["q"] is packed["q"] and packed["q"].dtype == np.uint32
    assert tuned["params"]["head"] == st.Tied("embed", st.T)


def _two_views_of_one_table():
    packed = st.quantize(_rand(1, V, 2 * G), 4, G)
    refs = {n: f"packed/{n}" for n in ("q", "scales", "biases")}
    return {
        "packed": packed,
        "embed": st.Tied(refs, st.dequantize(4, G)),
        "head": st.Tied(refs, st.dequantize(4, G) >> st.T),  # reads the table, not 'embed'
    }


def test_adapting_a_view_whose_table_another_view_reads_is_refused_naming_it():
    with raises("E340", "'embed'", "'packed/q'", "'head'"):
        st.add_lora(_two_views_of_one_table(), "embed", rank=R, key=jax.random.key(0))
    # the fix it names: tie the head to the adapted view, and the adapter reaches both
    tree = {**_two_views_of_one_table(), "head": st.Tied("embed", st.T)}
    out = st.add_lora(tree, "embed", rank=R, key=jax.random.key(0))
    out["lora"]["embed"]["b"] = _rand(3, R, 2 * G)
    m = st.materialize(out)["params"]
    np.testing.assert_array_equal(m["head"], m["embed"].T)
    # or untie the head first: then the view alone is adapted, as asked
    tree = st.untie(_two_views_of_one_table(), ["head"])
    out = st.add_lora(tree, "embed", rank=R, key=jax.random.key(0))
    assert not isinstance(out["params"]["head"], st.Tied)


def test_adapting_both_views_of_one_table_separately_is_refused_too():
    with raises("E340", "'embed'", "'head'"):
        st.add_lora(_two_views_of_one_table(), ["embed", "head"], rank=R, key=jax.random.key(0))
