"""sharetree.nnx: split/merge with ties against the same NNX model tied by hand (W and W.T)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
from _raises import raises
from flax import nnx

import sharetree as st
import sharetree.nnx as stnnx

TIES = {"dec/kernel": st.Tied("enc/kernel", st.T)}


class AE(nnx.Module):
    def __init__(self, din=6, dh=3, *, rngs):
        self.enc = nnx.Linear(din, dh, rngs=rngs)
        self.dec = nnx.Linear(dh, din, rngs=rngs)

    def __call__(self, x):
        return self.dec(jnp.tanh(self.enc(x)))


def _data(n=16, d=6, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 2))
    return jnp.asarray(z @ rng.standard_normal((2, d)), jnp.float32)


def _leaf_paths(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ["/".join(st._paths.keypath_to_path(kp)) for kp, _ in flat]


def test_split_gives_a_canonical_state_without_a_leaf_for_the_tied_variable():
    model = AE(rngs=nnx.Rngs(0))
    graphdef, state = stnnx.split(model, ties=TIES)
    assert isinstance(graphdef, stnnx.GraphDef) and graphdef.aliases == ()
    assert isinstance(state, nnx.State)
    assert state["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    assert _leaf_paths(state) == ["dec/bias/value", "enc/bias/value", "enc/kernel/value"]
    graph = st.canonicalize(state)
    assert graph.num_unique == 3 and graph.num_views == 1
    assert graph.views["dec/kernel/value"].buffer == "enc/kernel/value"
    # the model itself is untouched; merge gives the tied model
    new = stnnx.merge(graphdef, state)
    np.testing.assert_array_equal(new.dec.kernel[...], model.enc.kernel[...].T)
    np.testing.assert_array_equal(new.enc.kernel[...], model.enc.kernel[...])
    assert not np.array_equal(model.dec.kernel[...], model.enc.kernel[...].T)
    assert type(new.dec.kernel) is nnx.Param
    # "dec/kernel/value" names the same Variable
    _, state2 = stnnx.split(model, ties={"dec/kernel/value": st.Tied("enc/kernel/value", st.T)})
    assert jax.tree.structure(state2) == jax.tree.structure(state)


def _hand_loss(p, x):
    h = jnp.tanh(x @ p["W"] + p["b1"])
    return jnp.mean((h @ p["W"].T + p["b2"] - x) ** 2)


def test_nnx_autoencoder_tied_with_sharetree_equals_hand_written_w_and_w_t():
    """>= 5 adam steps: losses, final W and gradient norms match the hand-tied computation."""
    graphdef, state = stnnx.split(AE(rngs=nnx.Rngs(1)), ties=TIES)
    hand = {
        "W": state["enc"]["kernel"][...],
        "b1": state["enc"]["bias"][...],
        "b2": state["dec"]["bias"][...],
    }
    x = _data()
    tx = optax.adam(5e-2)

    def nnx_loss(s, x):
        return jnp.mean((stnnx.merge(graphdef, s)(x) - x) ** 2)

    def make_step(loss):
        @jax.jit
        def step(params, opt, x):
            value, grads = jax.value_and_grad(loss)(params, x)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, value, optax.tree.norm(grads)

        return step

    step_nnx, step_hand = make_step(nnx_loss), make_step(_hand_loss)
    opt_nnx, opt_hand = tx.init(state), tx.init(hand)
    assert len(jax.tree.leaves(opt_nnx[0].mu)) == 3 == len(jax.tree.leaves(opt_hand[0].mu))
    losses = []
    for _ in range(6):
        state, opt_nnx, l1, n1 = step_nnx(state, opt_nnx, x)
        hand, opt_hand, l2, n2 = step_hand(hand, opt_hand, x)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        np.testing.assert_allclose(n1, n2, rtol=1e-5)
        losses.append(float(l1))
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(state["enc"]["kernel"][...], hand["W"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state["dec"]["bias"][...], hand["b2"], rtol=1e-5, atol=1e-7)
    assert state["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    trained = stnnx.merge(graphdef, state)
    np.testing.assert_allclose(trained.dec.kernel[...], hand["W"].T, rtol=1e-5, atol=1e-7)


class SharedAE(nnx.Module):
    """Ties by object identity, NNX's own idiom: one Param object in two places."""

    def __init__(self, rngs):
        self.enc = nnx.Linear(4, 4, rngs=rngs)
        self.dec = nnx.Linear(4, 4, rngs=rngs)
        self.dec.kernel = self.enc.kernel

    def __call__(self, x):
        return self.dec(jnp.tanh(self.enc(x)))


def test_a_variable_shared_by_the_model_comes_out_as_an_identity_tie():
    model = SharedAE(nnx.Rngs(2))
    graphdef, state = stnnx.split(model)
    # NNX keeps the shared Variable at the first path in its own (sorted) order: dec/kernel
    assert graphdef.aliases == ((0, ("enc", "kernel"), ("dec", "kernel")),)
    assert state["enc"]["kernel"] == st.Tied("dec/kernel")
    assert len(jax.tree.leaves(state)) == 3
    assert st.canonicalize(state).views["enc/kernel/value"].transform == st.identity
    new = stnnx.merge(graphdef, state)
    assert new.dec.kernel is new.enc.kernel
    x = _data(d=4)
    np.testing.assert_allclose(new(x), model(x), rtol=1e-6)

    # the gradient of the shared Param sums both uses: compare with the hand-written W used twice
    def loss(s):
        return jnp.mean(stnnx.merge(graphdef, s)(x) ** 2)

    def hand(w, b1, b2):
        return jnp.mean((jnp.tanh(x @ w + b1) @ w + b2) ** 2)

    g = jax.grad(loss)(state)
    w, b1, b2 = model.enc.kernel[...], model.enc.bias[...], model.dec.bias[...]
    np.testing.assert_allclose(g["dec"]["kernel"][...], jax.grad(hand)(w, b1, b2), rtol=1e-5)
    assert g["enc"]["kernel"] == st.Tied("dec/kernel")
    # a user tie that repeats the identity tie is accepted; a conflicting one is an error
    assert stnnx.split(model, ties={"enc/kernel": "dec/kernel"})[0] == graphdef
    with raises("E181", "'enc/kernel' <- Tied('dec/kernel', T)", "'enc/kernel'", "'dec/kernel'"):
        stnnx.split(model, ties={"enc/kernel": st.Tied("dec/kernel", st.T)})
    with raises("E183", "state 0 at 'enc/kernel'", "Tied('dec/kernel')", "Tied('dec/bias')"):
        wrong = st.tie(st.materialize(state), {"enc/kernel": "dec/bias"}, check=False)
        stnnx.merge(graphdef, wrong)
    # gradients by use: fun gets the materialized state, whose two uses of the one Variable
    # object merge cannot keep apart; the error says so and how to get them (two Variables)
    two = "split(model, ties={'enc/kernel': 'dec/kernel'})"
    with raises("E183", "'enc/kernel'", "a Param", "Tied('dec/kernel')", "two Variables", two):
        st.grad_by_use(loss)(state)


def test_a_shared_submodule_gives_an_identity_tie_per_variable():
    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(3, 3, rngs=rngs)
            self.second = self.first

        def __call__(self, x):
            return self.second(jnp.tanh(self.first(x)))

    model = Twice(nnx.Rngs(3))
    graphdef, state = stnnx.split(model)
    assert state["second"] == {"bias": st.Tied("first/bias"), "kernel": st.Tied("first/kernel")}
    new = stnnx.merge(graphdef, state)
    assert new.first is new.second
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(new(x), model(x), rtol=1e-6)


class Regularised(nnx.Module):
    def __init__(self, rngs):
        self.enc = nnx.Linear(6, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.dec = nnx.Linear(3, 6, rngs=rngs)
        self.dec.kernel = nnx.Param(self.dec.kernel[...], tag="decoder")

    def __call__(self, x):
        return self.dec(self.drop(jnp.tanh(self.enc(x))))


def test_filters_rng_state_and_the_targets_own_metadata():
    model = Regularised(nnx.Rngs(4))
    graphdef, params, rest = stnnx.split(model, nnx.Param, ..., ties=TIES)
    assert graphdef.num_states == 2
    assert params["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    assert "drop" in rest and "drop" not in params

    @jax.jit
    def loss(params, rest, x):
        m = stnnx.merge(graphdef, params, rest)
        return jnp.mean((m(x) - x) ** 2), nnx.state(m, nnx.RngState)

    x = _data()
    (value, new_rest), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, x)
    assert grads["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    assert np.isfinite(float(value))
    count = lambda s: int(jax.tree.leaves(s["drop"]["rngs"]["count"])[0])  # noqa: E731
    assert count(new_rest) == count(rest) + 1  # dropout drew a key inside
    merged = stnnx.merge(graphdef, params, rest)
    assert merged.dec.kernel.get_metadata()["tag"] == "decoder"  # the model's own Variable
    with raises("E182", "sharetree.nnx.merge", "expected 2 state(s)", "found 1"):
        stnnx.merge(graphdef, params)
    with raises("E180", "'drop/rngs/count' <- Tied('enc/bias')", "states [0, 1]"):
        stnnx.split(model, nnx.Param, ..., ties={"drop/rngs/count": "enc/bias"})


def test_update_writes_views_into_an_existing_model():
    model = AE(rngs=nnx.Rngs(5))
    graphdef, state = stnnx.split(model, ties=TIES)
    state = jax.tree.map(lambda v: v + 1.0, state)
    stnnx.update(model, graphdef, state)
    np.testing.assert_array_equal(model.enc.kernel[...], state["enc"]["kernel"][...])
    np.testing.assert_array_equal(model.dec.kernel[...], state["enc"]["kernel"][...].T)
    # merge also takes a plain nnx.GraphDef and a state tied with st.tie
    g, s = nnx.split(AE(rngs=nnx.Rngs(6)))
    m = stnnx.merge(g, st.tie(s, {"dec/kernel": st.Tied("enc/kernel", st.T)}))
    np.testing.assert_array_equal(m.dec.kernel[...], m.enc.kernel[...].T)


def test_tying_a_path_missing_from_the_nnx_state_names_it_and_the_closest_one():
    model = AE(rngs=nnx.Rngs(7))
    with raises("E5", "'dec/kernal'", "NNX state", "'dec/kernel'"):
        stnnx.split(model, ties={"dec/kernal": st.Tied("enc/kernel", st.T)})
    with raises("E1", "'encoder/kernel'", "NNX state", "'enc/kernel'"):
        stnnx.split(model, ties={"dec/kernel": st.Tied("encoder/kernel", st.T)})
    with raises("E7", "re:float32\\[6, 3\\].*float32\\[3, 6\\]", "sharetree.nnx.split"):
        stnnx.split(model, ties={"dec/kernel": "enc/kernel"})


def test_graphdef_is_hashable_for_jit_static_arguments():
    model = AE(rngs=nnx.Rngs(8))
    g1, s1 = stnnx.split(model, ties=TIES)
    g2, _ = stnnx.split(model, ties=TIES)
    assert g1 == g2 and hash(g1) == hash(g2)

    apply = jax.jit(lambda s, x, g=g1: stnnx.merge(g, s)(x))
    x = _data()
    np.testing.assert_allclose(apply(s1, x), stnnx.merge(g1, s1)(x), rtol=1e-6, atol=1e-6)
    static = jax.jit(lambda g, s, x: stnnx.merge(g, s)(x), static_argnums=0)
    np.testing.assert_allclose(static(g1, s1, x), apply(s1, x), rtol=1e-6, atol=1e-6)
    assert "GraphDef" in repr(g1)


def test_optax_labels_and_masks_by_path_on_an_nnx_state():
    _, state = stnnx.split(AE(rngs=nnx.Rngs(9)), ties=TIES)
    labels = st.label_by_path(state, {"enc": "adam", "dec": "sgd"})
    assert labels["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    tx = optax.multi_transform({"adam": optax.adam(0.1), "sgd": optax.sgd(0.5)}, labels)
    grads = jax.tree.map(jnp.ones_like, state)
    updates, _ = tx.update(grads, tx.init(state), state)
    np.testing.assert_allclose(updates["dec"]["bias"][...], -0.5)  # sgd: -lr * g
    np.testing.assert_allclose(updates["enc"]["kernel"][...], -0.1, rtol=1e-4)  # adam's 1st step
    assert updates["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    mask = st.mask_by_path(state, "*/kernel")
    assert jax.tree.leaves(mask) == [False, False, True]  # dec/bias, enc/bias, enc/kernel


def test_check_false_lets_a_view_of_another_shape_through_like_st_tie():
    model = AE(rngs=nnx.Rngs(10))
    tie = "tie 'dec/kernel/value' <- Tied('enc/kernel')"
    with raises("E7", tie, "sharetree.nnx.split", "check=False"):  # split takes check= too
        stnnx.split(model, ties={"dec/kernel": "enc/kernel"})
    graphdef, state = stnnx.split(model, ties={"dec/kernel": "enc/kernel"}, check=False)
    assert state["dec"]["kernel"] == st.Tied("enc/kernel")
    new = stnnx.merge(graphdef, state)
    assert new.dec.kernel.shape == (6, 3) and type(new.dec.kernel) is nnx.Param
    np.testing.assert_array_equal(new.dec.kernel[...], model.enc.kernel[...])


def test_a_module_held_in_an_nnx_data_list_and_an_attribute_gives_identity_ties():
    """``nnx.iter_children`` does not look inside ``nnx.data`` lists; split must."""

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(3, 3, rngs=rngs)
            self.layers = nnx.data([nnx.Linear(3, 3, rngs=rngs), self.first])

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return self.first(x)

    model = Stack(nnx.Rngs(11))
    graphdef, state = stnnx.split(model)
    assert state["layers"][1] == {"bias": st.Tied("first/bias"), "kernel": st.Tied("first/kernel")}
    assert len(jax.tree.leaves(state)) == 4  # first and layers/0: a kernel and a bias each
    new = stnnx.merge(graphdef, state)
    assert new.layers[1] is new.first
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(new(x), model(x), rtol=1e-6)


def test_split_and_merge_reject_what_is_no_mapping_or_state():
    with raises("E69", "ties=", "mapping", "found int 1", cls=st.TieTypeError):
        stnnx.split(AE(rngs=nnx.Rngs(0)), ties=1)
    graphdef, _ = stnnx.split(AE(rngs=nnx.Rngs(0)))
    with raises("E69", "nnx.State", "found NoneType", cls=st.TieTypeError):
        stnnx.merge(graphdef, None)
    with raises("E69", "nnx.State", "found int", cls=st.TieTypeError):
        stnnx.split(1)


def test_split_rejects_a_target_spelled_twice():
    ties = {"dec/kernel": st.Tied("enc/kernel", st.T), ("dec", "kernel"): "enc/kernel"}
    with raises("E6b", "'dec/kernel'", "('dec', 'kernel')"):
        stnnx.split(AE(rngs=nnx.Rngs(0)), ties=ties)


def test_split_takes_nnx_splits_positional_arguments():
    # a drop-in replacement: split(model, *filters) as nnx.split, ties by keyword
    model = AE(rngs=nnx.Rngs(3))
    graphdef, params, rest = stnnx.split(model, nnx.Param, ...)
    g, p, r = nnx.split(model, nnx.Param, ...)
    assert graphdef.graphdef == g and graphdef.num_states == 2
    assert jax.tree.structure(params) == jax.tree.structure(p)
    assert jax.tree.structure(rest) == jax.tree.structure(r)
    (_, only) = stnnx.split(model, nnx.Param)
    assert jax.tree.structure(only) == jax.tree.structure(nnx.split(model, nnx.Param)[1])
    _, tied, _ = stnnx.split(model, nnx.Param, ..., ties=TIES)
    assert tied["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    with raises("E81", "filter", "found dict", "ties={", cls=st.TieTypeError):
        stnnx.split(model, TIES)


def test_a_variable_tied_to_one_of_another_kind_keeps_its_own_kind_through_merge():
    # a BatchStat tied to a Param: the state holds the tie, merge and the documented untie
    # route (nnx.split of the merged model) give the BatchStat back, holding the Param's values
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)

    model = M(nnx.Rngs(0))
    graphdef, state = stnnx.split(model, ties={"bn/mean": st.Tied("lin/bias")})
    assert state["bn"]["mean"] == st.Tied("lin/bias")
    merged = stnnx.merge(graphdef, state)
    assert type(merged.bn.mean) is nnx.BatchStat and type(merged.lin.bias) is nnx.Param
    _, untied = nnx.split(merged)
    assert type(untied["bn"]["mean"]) is nnx.BatchStat
    np.testing.assert_array_equal(untied["bn"]["mean"][...], model.lin.bias[...])


def test_st_tie_of_a_modules_variable_is_refused_and_the_model_is_left_as_it_was():
    model = AE(rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    with raises("E320", "'dec/kernel'", "Param", "sharetree.nnx.tie"):
        st.tie(model, TIES)
    assert isinstance(model.dec.kernel, nnx.Param)  # nothing replaced
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_st_tie_of_the_values_keeps_each_variables_kind_and_metadata_as_nnx_tie_does():
    model = AE(rngs=nnx.Rngs(0))
    model.dec.kernel = nnx.LoRAParam(model.dec.kernel[...], tag="decoder")  # kind, metadata
    by_st = st.tie(model, {"dec/kernel/value": st.Tied("enc/kernel/value", st.T)})
    by_nnx = stnnx.tie(model, {"dec/kernel": st.Tied("enc/kernel", st.T)})
    for tied in (by_st, by_nnx):
        assert type(tied.dec.kernel) is nnx.LoRAParam
        assert tied.dec.kernel.get_metadata()["tag"] == "decoder"
    assert jax.tree.structure(by_st) == jax.tree.structure(by_nnx)
    m = st.materialize(by_st)
    np.testing.assert_array_equal(m.dec.kernel[...], np.asarray(m.enc.kernel[...]).T)


def test_a_tied_inside_a_variable_that_names_a_variable_is_refused_with_its_value_path():
    model = AE(rngs=nnx.Rngs(0))
    model.dec.kernel = nnx.Param(st.Tied("enc/kernel", st.T))
    with raises("E321", "'dec/kernel/value'", "'enc/kernel/value'"):
        st.materialize(model)
    model.dec.kernel = nnx.Param(st.Tied("enc/kernel/value", st.T))  # the fix: its value
    m = st.materialize(model)
    assert type(m.dec.kernel) is nnx.Param and not isinstance(m.dec.kernel[...], nnx.Variable)
    np.testing.assert_array_equal(m.dec.kernel[...], np.asarray(m.enc.kernel[...]).T)
