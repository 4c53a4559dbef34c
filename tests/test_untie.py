"""untie and untie_state: ties broken on purpose, nothing lost; optimizer moments carried over.

References are built by hand: the untied model is written out with its own
copies, and its Adam state is assembled from the shared moments with NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from hypothesis import strategies as hs
from test_properties import _assert_trees_equal, _get, _names, _reference, _set, tied_trees

import sharetree as st


def _ties(tree):
    return {
        _names(kp): x
        for kp, x in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: isinstance(x, st.Tied)
        )
        if isinstance(x, st.Tied)
    }


@settings(max_examples=examples(120), deadline=None)
@given(tied_trees(), hs.data())
def test_untie_then_tie_is_the_identity(case, data):
    tree, canonical, table = case
    ties = _ties(canonical)
    assert set(ties) == set(table)
    chosen = data.draw(hs.lists(hs.sampled_from(sorted(ties)), unique=True)) if ties else []
    untied = st.untie(canonical, ["/".join(p) for p in chosen] if chosen else None)
    if not chosen:  # None: every tie
        chosen = list(ties)
    left = _ties(untied)
    assert set(left) == set(ties) - set(chosen) and all(left[p] == ties[p] for p in left)
    # the untied tree by hand: each chosen tie replaced by a copy of its value computed
    # in NumPy from the generated table; every other position as it was
    expected, views = _reference(tree, table)
    by_hand = canonical
    for target in chosen:
        by_hand = _set(by_hand, target, _get(expected, target))
    _assert_trees_equal(untied, by_hand)
    _assert_trees_equal(st.materialize(untied), expected)
    # copies: no untied position holds a buffer object (an identity view included)
    buffers = {id(x) for x in jax.tree.leaves(canonical)}
    for target in chosen:
        assert not any(id(x) in buffers for x in jax.tree.leaves(_get(untied, target)))
    new_buffers = [t for t, _, _ in views if any(t[: len(p)] == p for p in chosen)]
    g = st.canonicalize(untied)
    assert g.num_unique == len(jax.tree.leaves(canonical)) + len(new_buffers)
    assert g.num_expanded == st.canonicalize(canonical).num_expanded
    back = st.tie(untied, {p: ties[p] for p in chosen})
    assert jax.tree.structure(back) == jax.tree.structure(canonical)
    _assert_trees_equal(back, canonical)


def test_untie_every_tie_gives_the_materialized_tree_with_copies():
    w = jnp.arange(6.0).reshape(2, 3)
    layer = {"w": w, "b": np.zeros(3, np.float32)}
    tree = {"a": layer, "b": st.Tied("a"), "t": st.Tied("a/w", st.T)}
    untied = st.untie(tree)
    assert jax.tree.structure(untied) == jax.tree.structure(st.materialize(tree))
    assert st.canonicalize(untied).num_views == 0 and st.canonicalize(untied).num_unique == 5
    np.testing.assert_array_equal(untied["t"], w.T)
    np.testing.assert_array_equal(untied["b"]["w"], w)
    # independent copies, never the buffer object itself (donation, in-place NumPy updates)
    assert untied["b"]["w"] is not w and untied["b"]["b"] is not layer["b"]
    untied["b"]["b"][0] = 7.0
    assert layer["b"][0] == 0.0
    assert "views:\n  (none: nothing is shared)" in st.summary(untied)


def test_untie_some_paths_keeps_the_others_and_chains_follow_the_new_buffer():
    w = jnp.arange(6.0).reshape(2, 3)
    tree = {"a": w, "b": st.Tied("a", st.T), "c": st.Tied("b", st.scale(2.0)), "d": st.Tied("a")}
    untied = st.untie(tree, ["b"])
    assert untied["c"] == st.Tied("b", st.scale(2.0)) and untied["d"] == st.Tied("a")
    g = st.canonicalize(untied)
    assert [b.path for b in g.buffers] == ["a", "b"]
    assert g.views["c"].buffer == "b" and g.views["d"].buffer == "a"
    np.testing.assert_array_equal(untied["b"], np.asarray(w).T)  # a copy, built by hand
    by_hand = {"a": w, "b": np.asarray(w).T, "c": 2.0 * np.asarray(w).T, "d": w}
    _assert_trees_equal(st.materialize(untied), by_hand)
    # a subtree path unties every Tied under it
    nested = {"enc": {"w": w}, "dec": {"w": st.Tied("enc/w", st.T), "v": st.Tied("enc/w")}}
    assert st.canonicalize(st.untie(nested, "dec")).num_views == 0
    plain = {"a": w}
    assert st.untie(plain) is plain  # no ties: nothing to do


def test_untie_works_under_jit():
    w = jnp.arange(6.0).reshape(2, 3)
    tree = {"a": w, "b": st.Tied("a", st.T)}
    out = jax.jit(lambda t: st.untie(t, "b"))(tree)
    np.testing.assert_array_equal(out["b"], w.T)


def test_untie_errors_name_the_path_and_close_matches():
    w = jnp.ones((2, 3))
    tree = {"enc": {"w": w}, "dec": {"w": st.Tied("enc/w", st.T)}, "sub": st.Tied("enc")}
    with raises("E24", "untie: 'enc/w'", "closest existing path(s): 'dec/w'"):
        st.untie(tree, "enc/w")
    with raises("E24", "untie: 'dec/ww'", "closest existing path(s): 'dec/w'"):
        st.untie(tree, ["dec/ww"])
    with raises("E24b", "untie: 'sub/w'", "view 'sub' (Tied('enc'))", "Fix: untie 'sub'"):
        st.untie(tree, "sub/w")
    with raises("E24", "untie: 'a'", "no ties at all"):
        st.untie({"a": w}, "a")


# ---------------------------------------------------------------------------
# untie_state


def _lm(key):
    k1, k2 = jax.random.split(key)
    params = {
        "embed": jax.random.normal(k1, (7, 4)),
        "mid": jax.random.normal(k2, (4, 4)),
        "head": st.Tied("embed", st.T),
        "bias": jnp.zeros(7),
    }

    def loss(m, tokens):
        h = jnp.tanh(m["embed"][tokens] @ m["mid"])
        logits = h @ m["head"] + m["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, (tokens + 1) % 7).mean()

    return params, loss


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adam(1e-2),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    ],
    ids=["adam", "clip+adamw"],
)
def test_first_step_after_untie_equals_an_untied_model_with_moments_copied_by_hand(make):
    opt = make()
    params, loss = _lm(jax.random.key(0))
    tokens = jnp.arange(12) % 7
    state = opt.init(params)
    for _ in range(3):  # some training while tied: moments that are not zero
        g = jax.grad(lambda p: loss(st.materialize(p), tokens))(params)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)

    new_params = st.untie(params, "head")
    new_state = st.untie_state(state, params, "head")

    # by hand: the untied model, and its Adam moments assembled from the shared ones
    hand = {k: params[k] for k in ("embed", "mid", "bias")}
    hand["head"] = params["embed"].T

    def hand_moments(m):
        return {**{k: m[k] for k in ("embed", "mid", "bias")}, "head": np.asarray(m["embed"]).T}

    adam = [
        s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")
    ]
    assert len(adam) == 1
    hand_adam = adam[0]._replace(mu=hand_moments(adam[0].mu), nu=hand_moments(adam[0].nu))
    hand_state = jax.tree.map(
        lambda s: hand_adam if s is adam[0] else s, state, is_leaf=lambda s: s is adam[0]
    )

    assert jax.tree.structure(new_params) == jax.tree.structure(hand)
    assert jax.tree.structure(new_state) == jax.tree.structure(hand_state)
    g_new = jax.grad(loss)(new_params, tokens)
    up, _ = opt.update(g_new, new_state, new_params)
    up_hand, _ = opt.update(jax.grad(loss)(hand, tokens), hand_state, hand)
    for k in hand:
        np.testing.assert_allclose(up[k], up_hand[k], rtol=1e-6, atol=1e-8)
    assert float(jnp.abs(up["head"]).max()) > 0


def test_untie_state_carries_reshape_views_and_keeps_other_parts():
    w = jnp.arange(6.0).reshape(2, 3)
    params = {"w": w, "flat": st.Tied("w", st.T >> st.reshape(6))}
    state = optax.sgd(0.1, momentum=0.9).init(params)
    state = jax.tree.map(lambda x: x + jnp.arange(x.size).reshape(x.shape), state)
    new = st.untie_state(state, params)
    np.testing.assert_array_equal(new[0].trace["flat"], np.asarray(state[0].trace["w"]).T.ravel())
    plain = optax.sgd(0.1).init(params)  # no parameter-shaped part: unchanged
    same = st.untie_state(plain, params)
    assert jax.tree.structure(same) == jax.tree.structure(plain)
    assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(plain), strict=True))


def test_untie_state_refuses_views_that_change_values():
    for t in (st.scale(2.0), st.astype(jnp.float16), st.fn(jnp.tanh), st.T >> st.scale(-1.0)):
        params = {"w": jnp.ones((2, 2)), "v": st.Tied("w", t)}
        state = optax.adam(1e-3).init(params)
        with raises("E25", "the view 'v'", f"is {t!r} of 'w'", "state_view()"):
            st.untie_state(state, params)
        assert st.untie(params)["v"].shape == (2, 2)  # the tree itself unties fine


def test_untie_state_of_a_state_that_does_not_match_the_tree():
    params, _ = _lm(jax.random.key(0))
    wrong = optax.adam(1e-3).init(st.materialize(params))  # made for the untied tree
    has = "at 'head' the tree has Tied('embed', T)"
    with raises("E26", "part '0/mu'", has, "the state has a leaf"):
        st.untie_state(wrong, params)
    bad = {"mu": {**jax.tree.map(jnp.zeros_like, params), "mid": jnp.zeros(3)}}
    with raises("E26", "part 'mu'", "shape (3,) at 'mid'", "shape (4, 4)"):
        st.untie_state(bad, params)


def test_untie_state_of_tuple_params_and_a_chained_state():
    # a plain tuple of states must not be mistaken for a tuple of parameters
    params = (jnp.ones((2, 3)), st.Tied("0", st.T))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    state = opt.init(params)
    state = jax.tree.map(lambda x: x + 1.0 if x.ndim else x, state)
    new = st.untie_state(state, params)
    np.testing.assert_array_equal(new[1][0].mu[1], np.asarray(state[1][0].mu[0]).T)


def test_many_views_take_the_batched_eager_path():
    w = jnp.arange(6.0).reshape(2, 3)
    tree = {"w": w, **{f"v{i:02d}": st.Tied("w", st.T >> st.scale(float(i))) for i in range(20)}}
    untied = st.untie(tree)
    for i in range(20):
        np.testing.assert_allclose(untied[f"v{i:02d}"], i * w.T)
    uses = st.grad_by_use(lambda m: sum(jnp.sum(x**2) for x in jax.tree.leaves(m)))(tree)["w"]
    for i in range(20):
        np.testing.assert_allclose(uses[f"v{i:02d}"], i * 2 * (i * w), rtol=1e-6)


def test_untie_path_that_is_one_int_or_float():
    tree = [jnp.ones(2), st.Tied("0")]
    assert st.untie(tree, 1)[1].shape == (2,)
    with raises("E15", "untie path", "'/'-joined string", "found float 1.5", cls=st.TieTypeError):
        st.untie(tree, 1.5)


def _boxed_params():
    """Flax params with whole partition boxes tied: a transposed head and an index row."""
    flax_nn = pytest.importorskip("flax.linen")
    from sharetree.flax import tied

    def boxed(*names):
        return flax_nn.with_partitioning(flax_nn.initializers.normal(1.0), names)

    class LM(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, tok):
            emb = self.param("embed", boxed("vocab", "embed"), (16, 4))
            head = self.param("head", boxed("embed", "vocab"), (4, 10))
            row = self.param("row", boxed("vocab"), (16,))
            return emb[tok] @ head + row[:10]

    ties = {
        "head": st.Tied("embed", st.slice(0, 10) >> st.T),
        "row": st.Tied("embed", st.index(-1, axis=1)),
    }
    return tied(LM(), ties).init(jax.random.key(0), jnp.array([1, 2]))["params"]


def test_untied_partition_boxes_carry_the_views_names():
    p = _boxed_params()
    emb = np.asarray(p["embed"].value)
    u = st.untie(p)
    # names by hand: the head is embed^T ('embed', 'vocab'), the row drops 'embed'
    assert u["head"].names == ("embed", "vocab") and u["row"].names == ("vocab",)
    np.testing.assert_array_equal(u["head"].value, emb[:10].T)
    np.testing.assert_array_equal(u["row"].value, emb[:, -1])
    assert u["embed"].names == ("vocab", "embed")
    s = st.untie_state(optax.adam(1e-3).init(p), p)
    for moment in (s[0].mu, s[0].nu):
        assert moment["head"].names == ("embed", "vocab") and moment["row"].names == ("vocab",)
        assert moment["head"].value.shape == (4, 10) and moment["row"].value.shape == (16,)


def test_untie_of_a_box_view_whose_transform_names_no_axes_is_refused():
    p = _boxed_params()
    p = {**p, "row": st.Tied("embed", st.fn(lambda x: x[:, -1]))}
    with raises("E42", "the view 'row'", "'embed'", "'value'"):
        st.untie(p)
