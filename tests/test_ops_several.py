"""Operations on trees holding views of several positions (``Tied({name: ref}, transform)``).

Labels, masks and shardings, ``untie`` / ``untie_state``, ``grad_by_use``, ``tie``,
``tie_identical`` / ``find_ties`` and ``load(ties=)``, each checked against a reference
written without sharetree: the model by hand in jnp (its gradients per use by hand),
NumPy, finite differences, or the expected tree written out.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import sharetree as st
from tests._raises import raises

V, D, R, S = 6, 4, 2, 2.0  # vocabulary, width, adapter rank, adapter scale
IDS = jnp.array([0, 3, 5, 3, 1])
TARGETS = jnp.array([3, 5, 3, 1, 2])


def _rand(seed, *shape, dtype=np.float32):
    return np.asarray(np.random.default_rng(seed).standard_normal(shape) * 0.5, dtype)


def _lora_tree(e=None, a=None, b=None):
    """LoRA on a tied embedding: the lookup and the head read ``E + S * a @ b``."""
    refs = {"base": "lora/embed/base", "a": "lora/embed/a", "b": "lora/embed/b"}
    return {
        "params": {"embed": st.Tied(refs, st.lora(S)), "head": st.Tied("embed", st.T)},
        "lora": {
            "embed": {
                "base": _rand(1, V, D) if e is None else e,
                "a": _rand(2, V, R) if a is None else a,
                "b": _rand(3, R, D) if b is None else b,
            }
        },
    }


def _lm(lookup, head):
    """The LM by hand: the lookup table and the head given apart (the untied model)."""
    h = jnp.tanh(lookup[IDS])
    logits = h @ head
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TARGETS[:, None], -1))


def _loss(m):
    return _lm(m["params"]["embed"], m["params"]["head"])


def _warned(f):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = f()
    return out, [str(w.message) for w in record if "[E161]" in str(w.message)]


# --- 1. labels, masks and shardings: a rule for a view, not its parents, warns --------------


def test_a_mask_rule_for_a_view_of_several_but_not_its_base_warns_naming_view_and_parent():
    tree = _lora_tree()
    mask, msgs = _warned(lambda: st.mask_by_path(tree, ["params/*", "lora/*/[ab]"], strict=False))
    # only the buffers get bits; the views stay
    want = {"base": False, "a": True, "b": True}
    assert mask["lora"]["embed"] == want and mask["params"] == tree["params"]
    (msg,) = msgs
    assert msg.startswith("[E161] mask_by_path: pattern 'params/*'") and "2 views" in msg
    assert "'params/embed' (Tied({'a': 'lora/embed/a'" in msg  # the view of several
    assert "'params/head' (Tied('embed', T) at 'params/head')" in msg  # a view of it
    assert "'lora/embed/base' gets False" in msg  # the parent it disagrees with
    assert "'lora/embed/a' gets" not in msg  # the adapters get True, as the rule says
    # a rule that decides the view as every parent is decided: no warning
    _, msgs = _warned(lambda: st.mask_by_path(tree, ["params/*", "lora/*"], strict=False))
    assert msgs == []
    _, msgs = _warned(lambda: st.mask_by_path(tree, ["*embed*"]))
    assert msgs == []


def test_labels_of_a_view_of_several_warn_for_each_parent_that_differs():
    tree = _lora_tree()
    rules = [("lora/*/base", "frozen"), ("lora/*/a", "adam"), ("params/head", "adam"), ("*", "sgd")]
    labels, msgs = _warned(lambda: st.label_by_path(tree, rules, strict=False))
    assert labels["lora"]["embed"] == {"base": "frozen", "a": "adam", "b": "sgd"}
    (msg,) = msgs
    assert "pattern 'params/head'" in msg and "1 view" in msg and "would get 'adam'" in msg
    assert "'lora/embed/base' gets 'frozen'" in msg and "'lora/embed/b' gets 'sgd'" in msg
    assert "'lora/embed/a' gets" not in msg  # that parent gets 'adam' too
    assert "'params/embed'" not in msg  # "*" decides it, and "*" matches its parents too


def test_shardings_of_a_view_of_several_warn_for_a_parent_that_differs():
    tree = _lora_tree()
    mesh = jax.make_mesh((1,), ("model",))
    rules = {"params/embed": P("model", None), "lora/*/base": P("model", None), "*": P()}
    out, msgs = _warned(lambda: st.shardings_by_path(tree, mesh, rules, strict=False))
    assert out["lora"]["embed"]["base"].spec == P("model", None)
    assert out["lora"]["embed"]["a"].spec == P() and out["params"] == tree["params"]
    (msg,) = msgs
    assert msg.startswith("[E161] shardings_by_path: pattern 'params/embed'")
    assert "'lora/embed/a', 'lora/embed/b' get" in msg
    assert "'lora/embed/base' gets" not in msg  # the same spec as the rule's


def test_an_unused_pattern_inside_a_subtree_view_of_several_names_its_buffers():
    tree = {
        "x": {"p": np.ones(2, np.float32), "q": np.ones(3, np.float32)},
        "y": {"p": np.ones(2, np.float32), "q": np.ones(3, np.float32)},
        "s": st.Tied({"u": "x", "v": "y"}, st.add()),
    }
    with raises("E38", "'s/p' (in Tied({'u': 'x', 'v': 'y'}, add) at 's', a view of 'x/p', 'y/p')"):
        st.mask_by_path(tree, "s/p")


# --- 2. untie and untie_state ----------------------------------------------------------------


def _by_hand(tree):
    lora = tree["lora"]["embed"]
    return np.asarray(lora["base"], np.float64) + S * (
        np.asarray(lora["a"], np.float64) @ np.asarray(lora["b"], np.float64)
    )


def test_untie_makes_a_view_of_several_its_own_buffer_holding_its_value():
    tree = _lora_tree()
    table = _by_hand(tree)
    untied = st.untie(tree)
    assert st.canonicalize(untied).num_views == 0
    np.testing.assert_allclose(untied["params"]["embed"], table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(untied["params"]["head"], table.T, rtol=1e-5, atol=1e-6)
    for name in ("base", "a", "b"):  # the inputs stay buffers, unchanged
        assert untied["lora"]["embed"][name] is tree["lora"]["embed"][name]
    # only the view of several: its reader follows the new buffer, with the same value
    one = st.untie(tree, "params/embed")
    assert one["params"]["head"] == st.Tied("embed", st.T)
    assert len(st.canonicalize(one).buffers) == 4
    np.testing.assert_allclose(st.materialize(one)["params"]["head"], table.T, rtol=1e-5, atol=1e-6)
    # it is a buffer of its own now: changing the adapter no longer changes it
    one["lora"]["embed"]["b"] = np.zeros((R, D), np.float32)
    np.testing.assert_allclose(st.materialize(one)["params"]["head"], table.T, rtol=1e-5)


def _stepped_state(tree, opt):
    """An optimizer state after one step (moments not zero)."""
    state = opt.init(tree)
    grads = jax.grad(lambda t: _loss(st.materialize(t)))(tree)
    _, state = opt.update(grads, state, tree)
    return state


def test_untie_state_refuses_to_derive_moments_for_a_view_of_several():
    tree = _lora_tree()
    state = _stepped_state(tree, optax.adam(1e-2))
    parents = "('lora/embed/a', 'lora/embed/b', 'lora/embed/base')"
    with raises("E25", "the view 'params/embed'", "lora(2.0)", parents, "st.untie"):
        st.untie_state(state, tree)
    with raises("E25", "the view 'params/head'", "'params/embed' through T", parents):
        st.untie_state(state, tree, "params/head")


def test_untie_state_of_a_one_buffer_view_beside_a_view_of_several():
    # the view of several stays tied; the transposed copy of 'w' gets w's moments transposed
    tree = _lora_tree()
    tree["w"] = _rand(4, D, 3)
    tree["w_t"] = st.Tied("w", st.T)

    def loss(t):
        m = st.materialize(t)
        return _loss(m) + jnp.sum(jnp.sin(m["w"]) * 0.3) + jnp.sum(m["w_t"] ** 2)

    opt = optax.adam(1e-2)
    state = opt.init(tree)
    _, state = opt.update(jax.grad(loss)(tree), state, tree)
    new = st.untie_state(state, tree, "w_t")
    mu, nu = state[0].mu, state[0].nu
    np.testing.assert_array_equal(new[0].mu["w_t"], np.asarray(mu["w"]).T)
    np.testing.assert_array_equal(new[0].nu["w_t"], np.asarray(nu["w"]).T)
    assert new[0].mu["params"] == tree["params"]  # the views of several stay Tied
    assert np.abs(np.asarray(mu["w"])).min() > 0  # a real moment, not zeros moved


def test_untie_and_untie_state_of_take_views_move_values_and_moments_alike():
    # two blocks for six layers: each layer's values and moments are its block's
    idx = (0, 1, 1, 0, 1, 0)
    tree = {"blocks": _rand(5, 2, 3, 3), "layers": st.Tied("blocks", st.take(idx))}

    def loss(t):
        layers = st.materialize(t)["layers"]
        h = jnp.ones(3)
        for k in range(len(idx)):
            h = jnp.tanh(h @ layers[k] + 0.1 * k)
        return jnp.sum(h**2)

    opt = optax.adam(1e-2)
    state = opt.init(tree)
    _, state = opt.update(jax.grad(loss)(tree), state, tree)
    blocks, mu, nu = (np.asarray(x["blocks"]) for x in (tree, state[0].mu, state[0].nu))
    untied = st.untie(tree)
    np.testing.assert_array_equal(untied["layers"], blocks[list(idx)])
    new = st.untie_state(state, tree)
    np.testing.assert_array_equal(new[0].mu["layers"], mu[list(idx)])
    np.testing.assert_array_equal(new[0].nu["layers"], nu[list(idx)])
    np.testing.assert_array_equal(new[0].mu["blocks"], mu)
    assert new[0].count == state[0].count
    # the untied state fits the untied tree: optax takes a step with it
    g = jax.grad(lambda t: jnp.sum(t["layers"] ** 2) + jnp.sum(t["blocks"]))(untied)
    opt.update(g, new, untied)


# --- 3. grad_by_use: each use's contribution to each parent buffer ---------------------------


def _uses_by_hand(tree):
    """Each use's contribution to E, a and b, by hand: the VJP of E + S a @ b, written out."""
    e, a, b = (jnp.asarray(tree["lora"]["embed"][k]) for k in ("base", "a", "b"))
    table = e + S * a @ b
    g_lookup, g_head = jax.grad(_lm, argnums=(0, 1))(table, table.T)  # the untied model

    def pull(g):  # d(E + S a @ b) against g, per input
        return {"lora/embed/base": g, "lora/embed/a": S * g @ b.T, "lora/embed/b": S * a.T @ g}

    return pull(g_lookup), pull(g_head.T)


def test_grad_by_use_splits_a_view_of_several_into_each_parent_by_use():
    tree = _lora_tree()
    by_use = st.grad_by_use(lambda m: _loss(m))(tree)
    lookup, head = _uses_by_hand(tree)
    for buffer in ("lora/embed/base", "lora/embed/a", "lora/embed/b"):
        assert set(by_use[buffer]) == {buffer, "params/embed", "params/head"}
        np.testing.assert_allclose(by_use[buffer]["params/embed"], lookup[buffer], atol=1e-6)
        np.testing.assert_allclose(by_use[buffer]["params/head"], head[buffer], atol=1e-6)
        assert not np.any(by_use[buffer][buffer])  # the model never reads the raw buffers
    # the uses sum to the gradient of each buffer: jax.grad, and finite differences
    grads = jax.grad(lambda t: _loss(st.materialize(t)))(tree)
    for name in ("base", "a", "b"):
        total = sum(by_use[f"lora/embed/{name}"].values())
        np.testing.assert_allclose(total, grads["lora"]["embed"][name], rtol=1e-5, atol=1e-6)
    e64, a64, b64 = (np.asarray(tree["lora"]["embed"][k], np.float64) for k in ("base", "a", "b"))
    with jax.enable_x64(True):
        for i, j in ((0, 0), (3, 1), (5, 0)):
            fd = []
            for h in (1e-6, -1e-6):
                moved = a64.copy()
                moved[i, j] += h
                fd.append(float(_loss(st.materialize(_lora_tree(e64, moved, b64)))))
            total = sum(by_use["lora/embed/a"].values())[i, j]
            np.testing.assert_allclose(total, (fd[0] - fd[1]) / 2e-6, rtol=1e-3, atol=1e-5)


def test_grad_by_use_through_a_chain_of_views_of_several_under_jit():
    # a factorized table e @ p, plus a delta, read transposed by the head: a DAG of two joins
    e, p, delta, w = _rand(6, V, 2), _rand(7, 2, D), _rand(8, V, D), _rand(9, D, D)
    tree = {
        "e": e,
        "p": p,
        "delta": delta,
        "w": w,
        "table": st.Tied({"a": "e", "b": "p"}, st.matmul()),
        "tuned": st.Tied({"x": "table", "d": "delta"}, st.add()),
        "head": st.Tied("tuned", st.T),
    }

    def loss(m):
        return _lm(m["table"] @ m["w"], m["head"]) + 0.1 * jnp.sum(m["tuned"] ** 2)

    by_use = jax.jit(st.grad_by_use(loss))(tree)
    # by hand: the untied model's gradient per use, pulled back through x = e @ p (+ delta)
    table = e @ p
    tuned = table + delta
    g_table, g_head, g_tuned, g_w = jax.grad(
        lambda t, h, u, w_: _lm(t @ w_, h) + 0.1 * jnp.sum(u**2), argnums=(0, 1, 2, 3)
    )(table, tuned.T, tuned, w)
    want = {
        "e": {"table": g_table @ p.T, "tuned": g_tuned @ p.T, "head": g_head.T @ p.T},
        "p": {"table": e.T @ g_table, "tuned": e.T @ g_tuned, "head": e.T @ g_head.T},
        "delta": {"tuned": g_tuned, "head": g_head.T},
        "w": {"w": g_w},
    }
    for buffer, uses in want.items():
        assert set(by_use[buffer]) == {buffer, *uses}
        for use, g in uses.items():
            np.testing.assert_allclose(by_use[buffer][use], g, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda t: loss(st.materialize(t)))(tree)
    for buffer in want:
        total = sum(by_use[buffer].values())
        np.testing.assert_allclose(total, grads[buffer], rtol=1e-5, atol=1e-5)


# --- 4. tie with several refs ----------------------------------------------------------------


def test_tie_puts_a_view_of_several_in_place_checking_its_shape_and_values():
    ref = _lora_tree()
    lora = ref["lora"]
    zeros = {"embed": np.zeros((V, D), np.float32), "head": np.zeros((D, V), np.float32)}
    plain = {"params": zeros, "lora": lora}
    ties = {"params/embed": ref["params"]["embed"], "params/head": st.Tied("params/embed", st.T)}
    tied = st.tie(plain, ties)
    table = _by_hand(ref)
    m = st.materialize(tied)
    np.testing.assert_allclose(m["params"]["embed"], table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["params"]["head"], table.T, rtol=1e-5, atol=1e-6)
    # a view of another shape than the value it replaces: E7, naming both
    with raises("E7", "'params/head'", "float32[6, 4]", "float32[4, 6]"):
        st.tie(plain, {"params/head": ref["params"]["embed"]})
    # with atol: the copies compare by value (the view computed from its three buffers)
    held = {"params": {"embed": table.astype(np.float32)}, "lora": lora}
    st.tie(held, {"params/embed": ref["params"]["embed"]}, atol=1e-5)
    held["params"]["embed"] = held["params"]["embed"] + 0.5
    facts = ("'params/embed'", "lora(2.0) of 'lora/embed/a', 'lora/embed/b', 'lora/embed/base'")
    with raises("E46", *facts, "differ by up to 0.5", "no inverse"):
        st.tie(held, {"params/embed": ref["params"]["embed"]}, atol=1e-5)


def test_tie_writes_each_ref_of_several_as_read_from_the_root():
    # 'sub/w' shadows the root's 'w' for a ref written at 'sub/v': tie climbs for that input
    w, a, b, other = _rand(1, 3, 3), _rand(2, 3, 1), _rand(3, 1, 3), _rand(4, 3, 3)
    tree = {"w": w, "a": a, "b": b, "sub": {"w": other, "v": np.zeros((3, 3), np.float32)}}
    tied = st.tie(tree, {"sub/v": st.Tied({"base": "w", "a": "a", "b": "b"}, st.lora())})
    t = tied["sub"]["v"]
    assert dict(t.refs)["base"] == (("w",), 1)  # '../w'
    assert dict(t.refs)["a"] == (("a",), None)
    want = w.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(st.materialize(tied)["sub"]["v"], want, rtol=1e-5, atol=1e-6)


def test_tie_identical_and_find_ties_leave_views_of_several_alone():
    tree = _lora_tree()
    shared = _rand(5, 3, 3)
    tree["x"], tree["y"] = shared, shared  # one array object twice
    tree["z"] = np.asarray(shared).T.copy()  # a transposed copy of it
    tied = st.tie_identical(tree)
    assert tied["y"] == st.Tied("x") and tied["params"] == tree["params"]
    assert st.find_ties(tree) == {"y": st.Tied("x"), "z": st.Tied("x", st.T)}
    assert st.find_ties(tied) == {"z": st.Tied("x", st.T)}


# --- 5. load(ties=) of a file other tools wrote ----------------------------------------------


def test_load_ties_of_several_refs_is_refused_with_the_way_to_add_it(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"embed.weight": _rand(1, V, D), "a": _rand(2, V, R), "b": _rand(3, R, D)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    view = st.Tied({"base": "embed.weight", "a": "a", "b": "b"}, st.lora(S) >> st.T)
    with raises("E169", "'lm_head.weight'", "several positions", "tree['lm_head.weight'] ="):
        st.load(path, ties={"lm_head.weight": view})
    # the fix the message gives: load, then add the view
    with pytest.warns(UserWarning, match=r"\[E142\]"):
        tree = st.load(path)
    tree["lm_head.weight"] = view
    want = tensors["embed.weight"].astype(np.float64) + S * (
        tensors["a"].astype(np.float64) @ tensors["b"].astype(np.float64)
    )
    np.testing.assert_allclose(st.materialize(tree)["lm_head.weight"], want.T, rtol=1e-5, atol=1e-6)
