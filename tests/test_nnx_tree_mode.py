"""sharetree.nnx.tie and Flax NNX tree mode: a tied module trains as NNX's shared Variables do.

Reference: the same LM in graph mode, tied the NNX way (one Variable object in two places,
``nnx.Embed.attend`` for the transposed head), and loops written by hand for ``nnx.scan``.
Tree mode (``nnx.set_graph_mode(False)``, ``graph=False``) is flax >= 0.12.6: those tests
are skipped below it; ``sharetree.nnx.tie`` itself works in graph mode on every flax.
"""

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

tree_mode = pytest.mark.skipif(
    not hasattr(nnx, "set_graph_mode"), reason="NNX tree mode needs flax >= 0.12.6"
)

V, D = 11, 8
TIES = {"head/kernel": st.Tied("embed/embedding", st.T), "block_1": "block_0"}


class LM(nnx.Module):
    """Embedding, two blocks, a head; ``by_hand``: tied the NNX way (graph mode only)."""

    def __init__(self, rngs, by_hand=False):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.block_0 = nnx.Linear(D, D, rngs=rngs)
        self.block_1 = nnx.Linear(D, D, rngs=rngs)
        self.by_hand = by_hand
        if by_hand:  # one Variable object in two places, the head as Embed.attend
            self.block_1.kernel = self.block_0.kernel
            self.block_1.bias = self.block_0.bias
        else:
            self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = jnp.tanh(self.block_1(jnp.tanh(self.block_0(x))))
        return self.embed.attend(x) if self.by_hand else self.head(x)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (3, 9)))


def _loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], TOKENS[:, 1:]).mean()


def _params(model):
    """The trained values by name, read from the model (views materialized)."""
    m = st.materialize(model)
    return {
        "embed": m.embed.embedding[...],
        "w0": m.block_0.kernel[...],
        "b0": m.block_0.bias[...],
        "w1": m.block_1.kernel[...],
        "b1": m.block_1.bias[...],
        "head": m.embed.embedding[...].T if m.by_hand else m.head.kernel[...],
    }


def test_tie_keeps_each_variable_kind_and_metadata_and_ties_a_submodule_variable_by_variable():
    model = LM(nnx.Rngs(0))
    model.head.kernel.set_metadata(tag="head")
    before = model.head.kernel
    out = stnnx.tie(model, TIES)
    assert out is model and model.head.kernel is before  # in place: the same Variable objects
    assert (
        type(model.head.kernel) is nnx.Param and model.head.kernel.get_metadata()["tag"] == "head"
    )
    assert model.head.kernel.get_raw_value() == st.Tied("embed/embedding/value", st.T)
    assert model.block_1.kernel.get_raw_value() == st.Tied("block_0/kernel/value")
    assert model.block_1.bias.get_raw_value() == st.Tied("block_0/bias/value")
    # the Param filter sees the tied positions as Params without leaves
    params = nnx.state(model, nnx.Param)
    assert params["head"]["kernel"].get_raw_value() == st.Tied("embed/embedding/value", st.T)
    assert len(jax.tree.leaves(params)) == 3  # embed, block_0 kernel and bias
    m = st.materialize(model)
    assert type(m.head.kernel) is nnx.Param and m.head.kernel.get_metadata()["tag"] == "head"
    np.testing.assert_array_equal(m.head.kernel[...], model.embed.embedding[...].T)
    np.testing.assert_array_equal(m.block_1.kernel[...], model.block_0.kernel[...])
    # graph mode keeps working: the graph-mode split and merge, nnx.jit and nnx.grad
    graphdef, state = stnnx.split(model)
    np.testing.assert_array_equal(stnnx.merge(graphdef, state)(TOKENS), m(TOKENS))
    grads = nnx.jit(nnx.grad(lambda mod: _loss(st.materialize(mod)(TOKENS))))(model)
    assert grads.head.kernel.get_raw_value() == st.Tied("embed/embedding/value", st.T)


def test_tie_checks_everything_before_changing_the_module():
    model = LM(nnx.Rngs(1))
    with raises("E7", "head/kernel/value", "sharetree.nnx.tie", "unchanged"):
        stnnx.tie(model, {"block_1/bias": "block_0/bias", "head/kernel": "embed/embedding"})
    assert isinstance(model.block_1.bias.get_raw_value(), jax.Array)  # the first tie not made
    w = model.embed.embedding[...]
    with raises("E46", "head/kernel/value", "unchanged"):  # the head's values differ from embed.T
        stnnx.tie(model, {"head/kernel": st.Tied("embed/embedding", st.T)}, atol=0.0)
    model.head.kernel[...] = w.T
    stnnx.tie(model, {"head/kernel": st.Tied("embed/embedding", st.T)}, atol=0.0)
    assert model.head.kernel.get_raw_value() == st.Tied("embed/embedding/value", st.T)


def _train_reference(steps):
    ref = LM(nnx.Rngs(2), by_hand=True)
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param, graph=True)

    @nnx.jit(graph=True)
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: _loss(m(TOKENS)), graph=True)(model)
        opt.update(model, grads)
        return loss

    return ref, opt, [(float(step(ref, opt)), _params(ref)) for _ in range(steps)]


@tree_mode
@pytest.mark.parametrize("how", ["set_graph_mode", "graph=False"])
def test_tree_mode_training_equals_the_graph_mode_model_with_shared_variables(how):
    """5 adam steps: equal losses and parameters step for step, one optimizer state per buffer."""
    _, ref_opt, expected = _train_reference(5)
    model = stnnx.tie(LM(nnx.Rngs(2)), TIES)  # the same seed: the same embed and block_0
    fresh = LM(nnx.Rngs(2), by_hand=True)
    np.testing.assert_array_equal(model.block_0.kernel[...], fresh.block_0.kernel[...])

    def train(graph):
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, graph=graph)

        @nnx.jit(graph=graph)
        def step(model, opt):
            def loss_fn(m):
                return _loss(st.materialize(m)(TOKENS))

            loss, grads = nnx.value_and_grad(loss_fn, graph=graph)(model)
            assert grads.head.kernel.get_raw_value() == st.Tied("embed/embedding/value", st.T)
            opt.update(model, grads)
            return loss

        return opt, [(float(step(model, opt)), _params(model)) for _ in range(5)]

    if how == "set_graph_mode":
        with nnx.set_graph_mode(False):
            opt, got = train(None)
    else:
        opt, got = train(False)
    # one Adam moment per buffer, as the shared-Variable model has
    assert len(jax.tree.leaves(opt.opt_state)) == len(jax.tree.leaves(ref_opt.opt_state)) == 7
    for (l1, p1), (l2, p2) in zip(got, expected, strict=True):
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        for k in p2:
            np.testing.assert_allclose(p1[k], p2[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert got[-1][0] < got[0][0]
    assert model.head.kernel.get_raw_value() == st.Tied("embed/embedding/value", st.T)


@tree_mode
def test_state_split_merge_and_checkpoints_keep_the_ties_in_tree_mode(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    with nnx.set_graph_mode(False):
        model = stnnx.tie(LM(nnx.Rngs(3)), TIES)
        state = nnx.state(model)
        assert state["head"]["kernel"].get_raw_value() == st.Tied("embed/embedding/value", st.T)
        graphdef, split = nnx.split(model)
        merged = nnx.merge(graphdef, split)
        assert type(merged.head.kernel) is nnx.Param
        np.testing.assert_array_equal(st.materialize(merged)(TOKENS), st.materialize(model)(TOKENS))
        # the target of a restore: the abstract model, tied the same way
        abstract = nnx.state(nnx.eval_shape(lambda: stnnx.tie(LM(nnx.Rngs(4)), TIES)))
        st.save(tmp_path / "lm.safetensors", state)
        loaded = st.load(tmp_path / "lm.safetensors", like=abstract)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp_path / "orbax", state)
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(tmp_path / "orbax", abstract)
        for back in (loaded, restored):
            assert jax.tree.structure(back) == jax.tree.structure(state)
            for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
                np.testing.assert_array_equal(a, b)
            fresh = stnnx.tie(LM(nnx.Rngs(5)), TIES)
            nnx.update(fresh, back)
            np.testing.assert_array_equal(
                st.materialize(fresh)(TOKENS), st.materialize(model)(TOKENS)
            )
        # the file holds each buffer once (3 of the 6 Params are views)
        assert len(st.canonicalize(loaded).buffers) == 3


class Block(nnx.Module):
    """A tied autoencoder layer: ``down`` is ``up`` transposed."""

    def __init__(self, rngs, d=6, h=4):
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


BLOCK_TIES = {"down/kernel": st.Tied("up/kernel", st.T)}


@tree_mode
def test_scan_and_vmap_over_a_stack_of_tied_layers_equal_the_loop_by_hand():
    layers, x = 3, jnp.asarray(np.random.default_rng(1).standard_normal((5, 6)), jnp.float32)
    with nnx.set_graph_mode(False):

        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key):  # tie each layer inside the vmap: the view is one layer's up.T
            return stnnx.tie(Block(nnx.Rngs(key)), BLOCK_TIES)

        blocks = make(jax.random.split(jax.random.key(0), layers))
        assert blocks.down.kernel.get_raw_value() == st.Tied("up/kernel/value", st.T)
        assert blocks.up.kernel.shape == (layers, 6, 4)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, block):
            return jnp.tanh(st.materialize(block)(h))  # materialize inside the body

        def loss(blocks):
            return jnp.mean(forward(x, blocks) ** 2)

        each = nnx.vmap(lambda b, x: st.materialize(b)(x), in_axes=(0, None))(blocks, x)
        value, grads = nnx.jit(nnx.value_and_grad(loss))(blocks)

    w, bu, bd = blocks.up.kernel[...], blocks.up.bias[...], blocks.down.bias[...]

    def by_hand(w, bu, bd):
        h = x
        for i in range(layers):
            h = jnp.tanh(jnp.tanh(h @ w[i] + bu[i]) @ w[i].T + bd[i])
        return jnp.mean(h**2)

    np.testing.assert_allclose(value, by_hand(w, bu, bd), rtol=1e-5)
    gw, gbu, gbd = jax.grad(by_hand, argnums=(0, 1, 2))(w, bu, bd)
    np.testing.assert_allclose(grads.up.kernel[...], gw, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(grads.up.bias[...], gbu, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(grads.down.bias[...], gbd, rtol=1e-4, atol=1e-7)
    assert grads.down.kernel.get_raw_value() == st.Tied("up/kernel/value", st.T)
    for i in range(layers):
        one = jnp.tanh(x @ w[i] + bu[i]) @ w[i].T + bd[i]
        np.testing.assert_allclose(each[i], one, rtol=1e-5, atol=1e-6)


@tree_mode
def test_partition_metadata_of_a_tied_param_is_its_own():
    mesh = jax.make_mesh((1, 1), ("vocab", "embed"))

    class Boxed(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal()
            self.embed = nnx.Embed(
                V, D, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs
            )
            self.head = nnx.Linear(
                D, V, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "vocab")),
                rngs=rngs,
            )  # fmt: skip

    with nnx.set_graph_mode(False), jax.set_mesh(mesh):
        model = stnnx.tie(Boxed(nnx.Rngs(0)), {"head/kernel": st.Tied("embed/embedding", st.T)})
        state = nnx.state(model)
        specs = nnx.get_partition_spec(state)
        assert specs["head"]["kernel"].get_raw_value() == jax.P("embed", "vocab")
        out = jax.jit(lambda s: jax.lax.with_sharding_constraint(s, specs))(state)
        assert out["head"]["kernel"].get_raw_value() == st.Tied("embed/embedding/value", st.T)
        view = st.materialize(model).head.kernel
        assert view.get_metadata()["out_sharding"] == ("embed", "vocab")
        assert view.shape == (D, V)


@tree_mode
def test_a_tied_module_called_without_materialize_says_to_materialize():
    with nnx.set_graph_mode(False):
        model = stnnx.tie(LM(nnx.Rngs(6)), TIES)
        with raises("E240", "Tied('block_0/kernel/value')", "st.materialize"):
            nnx.jit(lambda m: _loss(m(TOKENS)))(model)


def test_tie_takes_climbing_refs_and_views_of_several_positions():
    class Adapted(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.base = nnx.Param(jnp.ones((V, D)))
            self.a = nnx.LoRAParam(jnp.full((V, 2), 0.5))
            self.b = nnx.LoRAParam(jnp.full((2, D), 0.25))
            self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    model = stnnx.tie(
        Adapted(nnx.Rngs(7)),
        {
            "embed/embedding": st.Tied({"base": "base", "a": "a", "b": "b"}, st.lora(2.0)),
            "head/kernel": st.Tied("../embed/embedding", st.T),
        },
    )
    assert type(model.embed.embedding) is nnx.Param and type(model.a) is nnx.LoRAParam
    m = st.materialize(model)
    table = 1.0 + 2.0 * 0.5 * 0.25 * 2  # base + scale * (a @ b), by hand
    np.testing.assert_allclose(m.embed.embedding[...], np.full((V, D), table))
    np.testing.assert_allclose(m.head.kernel[...], np.full((D, V), table))
    # the LoRA factors alone, as NNX filters them: the base and the views are no LoRAParam
    assert len(jax.tree.leaves(nnx.state(model, nnx.LoRAParam))) == 2
