"""sharetree.flax: linen ``tied(module, ties)`` against linen's own tying (``nn.Embed.attend``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
import flax.linen as nn
from _raises import raises
from flax.training import train_state

import sharetree as st
from sharetree.flax import TiedModule, tied

VOCAB, DIM, SEQ = 19, 16, 8


class LM(nn.Module):
    """A one-block transformer LM; ``head`` picks the output layer."""

    head: str = "dense"  # "dense": its own kernel (tied by sharetree); "attend": nn.Embed.attend

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, DIM, name="embed")
        x = embed(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[-1], DIM))
        h = nn.SelfAttention(num_heads=2, name="attn")(x, mask=nn.make_causal_mask(tokens))
        x = x + h
        x = x + nn.Dense(DIM, name="mlp_out")(nn.relu(nn.Dense(2 * DIM, name="mlp_in")(x)))
        x = nn.LayerNorm(name="ln_f")(x)
        if self.head == "attend":
            return embed.attend(x)
        return nn.Dense(VOCAB, use_bias=False, name="head")(x)


def _init(model, tokens, seed=0):
    """Trace ``model.init`` (ties included) and fill the shapes with seeded random values.

    (Tracing gives the real canonical structure without compiling the RNG-heavy init.)
    """
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), s.dtype), shapes)


TIES = {"head/kernel": st.Tied("embed/embedding", st.T)}


def _batches(n):
    """Learnable sequences (each token is the previous one plus a per-row step)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        start, step = rng.integers(0, VOCAB, size=(2, 4, 1))
        out.append(jnp.asarray((start + step * np.arange(SEQ + 1)) % VOCAB))
    return out


def _loss_fn(apply_fn):
    def loss(params, batch):
        logits = apply_fn({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return loss


def _train(state, batches):
    loss_fn = _loss_fn(state.apply_fn)

    @jax.jit
    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss, optax.tree.norm(grads)

    losses, norms = [], []
    for batch in batches:
        state, loss, norm = step(state, batch)
        losses.append(float(loss))
        norms.append(float(norm))
    return state, np.array(losses), np.array(norms)


def _tx():
    # (clip_by_global_norm, adamw masks, multi_transform, MultiSteps: tests/test_optax.py)
    return optax.adam(1e-2)


def test_init_ties_params_and_keeps_other_collections():
    model = tied(LM(), TIES)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))
    params = variables["params"]
    assert params["head"] == {"kernel": st.Tied("embed/embedding", st.T)}
    graph = st.canonicalize(params)
    assert graph.num_views == 1
    assert graph.views["head/kernel"].buffer == "embed/embedding"
    assert graph.views["head/kernel"].shape == (DIM, VOCAB)
    # the canonical params are exactly the params of the same LM tied by linen (attend)
    ref = jax.eval_shape(LM(head="attend").init, jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))
    ref = ref["params"]
    ours = {k: v for k, v in params.items() if k != "head"}
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    assert graph.size_unique == sum(np.prod(x.shape) for x in jax.tree.leaves(ref))


def test_linen_lm_tied_with_sharetree_equals_embed_attend():
    """>= 5 optimizer steps: losses, final embedding and gradient norm match nn.Embed.attend."""
    model = tied(LM(), TIES)
    tokens = jnp.zeros((2, SEQ), jnp.int32)
    params = _init(model, tokens, seed=1)["params"]
    ref_params = {k: v for k, v in params.items() if k != "head"}

    tx = _tx()
    ours = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    ref = train_state.TrainState.create(apply_fn=LM(head="attend").apply, params=ref_params, tx=tx)
    batches = _batches(1) * 6  # one batch, six steps: the loss must go down
    ours, our_losses, our_norms = _train(ours, batches)
    ref, ref_losses, ref_norms = _train(ref, batches)

    np.testing.assert_allclose(our_losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(our_norms, ref_norms, rtol=1e-5)
    np.testing.assert_allclose(
        ours.params["embed"]["embedding"], ref.params["embed"]["embedding"], rtol=1e-5, atol=1e-7
    )
    assert our_losses[-1] < our_losses[0]  # it trained
    # apply_gradients kept the tie, and the optimizer holds one moment per unique buffer
    assert ours.params["head"] == {"kernel": st.Tied("embed/embedding", st.T)}
    assert jax.tree.structure(ours.params) == jax.tree.structure(params)
    adam = ours.opt_state[0]
    assert len(jax.tree.leaves(adam.mu)) == st.canonicalize(params).num_unique
    assert len(jax.tree.leaves(adam.mu)) == len(jax.tree.leaves(ref.opt_state[0].mu))


class Bigram(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.tanh(nn.Embed(VOCAB, DIM, name="embed")(tokens))
        return nn.Dense(VOCAB, name="head")(h)


def test_gradient_is_summed_over_uses_and_its_norm_counts_the_table_once():
    model = tied(Bigram(), TIES)
    batch = _batches(1)[0]
    params = _init(model, batch[:, :-1], seed=2)["params"]
    loss = _loss_fn(model.apply)
    grads = jax.jit(jax.grad(loss))(params, batch)
    assert grads["head"] == {"bias": grads["head"]["bias"], "kernel": TIES["head/kernel"]}

    # independent reference: the untied (materialized) gradient, summed back through the view
    def untied_loss(p):
        logits = Bigram().apply({"params": p}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    g_untied = jax.jit(jax.grad(untied_loss))(st.materialize(params))
    expected = g_untied["embed"]["embedding"] + g_untied["head"]["kernel"].T
    np.testing.assert_allclose(grads["embed"]["embedding"], expected, rtol=1e-5, atol=1e-8)
    sq = sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(optax.tree.norm(grads), jnp.sqrt(sq), rtol=1e-6)
    # the materialized gradient would count the table (as two different arrays) twice
    assert not np.isclose(float(optax.tree.norm(g_untied)), float(optax.tree.norm(grads)))


class Tagger(nn.Module):
    """Uses dropout rngs, batch_stats and a second method."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = self.encode(x)
        h = nn.BatchNorm(use_running_average=not train, name="bn")(h)
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(4, name="dec")(h)

    @nn.compact
    def encode(self, x):
        return nn.relu(nn.Dense(3, name="enc")(x))


def test_rngs_mutable_and_method_pass_through():
    model = tied(Tagger(), {"dec/kernel": st.Tied("enc/kernel", st.T)})
    x = jax.random.normal(jax.random.key(3), (5, 4))
    keys = {"params": jax.random.key(4), "dropout": jax.random.key(5)}
    variables = jax.jit(model.init)(keys, x)
    assert set(variables) == {"params", "batch_stats"}
    assert variables["params"]["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    full = dict(variables, params=st.materialize(variables["params"]))

    rngs = {"dropout": jax.random.key(6)}
    out, upd = model.apply(variables, x, rngs=rngs, mutable=["batch_stats"])
    ref_out, ref_upd = Tagger().apply(full, x, rngs=rngs, mutable=["batch_stats"])
    np.testing.assert_array_equal(out, ref_out)
    mean, ref_mean = upd["batch_stats"]["bn"]["mean"], ref_upd["batch_stats"]["bn"]["mean"]
    np.testing.assert_array_equal(mean, ref_mean)
    assert not np.allclose(mean, variables["batch_stats"]["bn"]["mean"])

    enc = model.apply(variables, x, method="encode")
    np.testing.assert_array_equal(enc, Tagger().apply(full, x, method=Tagger.encode))
    ev = model.apply(variables, x, train=False)
    np.testing.assert_array_equal(ev, Tagger().apply(full, x, train=False))

    out2, v2 = jax.eval_shape(model.init_with_output, keys, x)
    assert v2["params"]["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    assert out2.shape == (5, 4)


class Writer(nn.Module):
    target: str = "enc"

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, name="enc")(x)
        y = nn.Dense(4, name="dec")(h)
        if self.is_mutable_collection("params"):
            p = self.get_variable("params", self.target)
            self.put_variable("params", self.target, dict(p, kernel=p["kernel"] * 2.0))
        return y


def test_mutable_params_come_back_canonical_and_writing_a_view_is_an_error():
    x = jnp.ones((2, 4))
    model = tied(Writer(), {"dec/kernel": st.Tied("enc/kernel", st.T)})
    variables = model.init(jax.random.key(0), x)
    _, new = model.apply(variables, x, mutable=["params"])
    assert new["params"]["dec"]["kernel"] == st.Tied("enc/kernel", st.T)
    np.testing.assert_allclose(
        new["params"]["enc"]["kernel"], 2.0 * variables["params"]["enc"]["kernel"]
    )
    bad = tied(Writer(target="dec"), {"dec/kernel": st.Tied("enc/kernel", st.T)})
    with raises("E185", "tied(Writer).apply", "'params/dec/kernel'", "'enc/kernel'"):
        bad.apply(variables, x, mutable=True)


def test_tying_a_missing_path_names_it_and_the_closest_one():
    x = jnp.zeros((2, SEQ), jnp.int32)
    with raises("E5", "'haed/kernel'", "tied(LM).init", "'params'", "'head/kernel'"):
        jax.eval_shape(
            tied(LM(), {"haed/kernel": st.Tied("embed/embedding", st.T)}).init, jax.random.key(0), x
        )
    with raises("E1", "'embed/embeding'", "'embed/embedding'", "'params'"):
        jax.eval_shape(
            tied(LM(), {"head/kernel": st.Tied("embed/embeding", st.T)}).init, jax.random.key(0), x
        )


def test_shape_mismatch_and_bad_arguments():
    x = jnp.zeros((2, SEQ), jnp.int32)
    with raises("E7", "re:float32\\[19, 16\\].*float32\\[16, 19\\]", "'head/kernel'", "'params'"):
        jax.eval_shape(tied(LM(), {"head/kernel": "embed/embedding"}).init, jax.random.key(0), x)
    with raises("E69", "flax.linen.Module", "function", cls=st.TieTypeError):
        tied(lambda x: x, TIES)
    with raises("E69", "mapping", "found list", cls=st.TieTypeError):
        tied(LM(), [("head/kernel", "embed/embedding")])
    # check=False skips the shape check at init
    unchecked = tied(LM(), {"head/kernel": "embed/embedding"}, check=False)
    params = jax.eval_shape(unchecked.init, jax.random.key(0), x)["params"]
    assert params["head"]["kernel"] == st.Tied("embed/embedding")
    # wrapping a wrapper adds its ties
    assert tied(tied(LM(), {}), TIES) == tied(LM(), TIES)


def test_wrapper_is_hashable_static_and_jittable():
    a, b = tied(LM(), TIES), tied(LM(), dict(TIES))
    assert isinstance(a, TiedModule) and a == b and hash(a) == hash(b)
    assert a != tied(LM(), {"head/kernel": "embed/embedding"})
    x = jnp.zeros((2, SEQ), jnp.int32)
    assert jax.jit(a.init).eval_shape(jax.random.key(0), x)["params"]["head"] == {
        "kernel": st.Tied("embed/embedding", st.T)
    }
    small = tied(Bigram(), TIES)
    variables = _init(small, x)
    out = jax.jit(small.apply)(variables, x)
    np.testing.assert_allclose(out, small.apply(variables, x), rtol=1e-6, atol=1e-6)
    # tie() on a full (untied) params tree, e.g. from a checkpoint, drops the target's value
    full = jax.eval_shape(LM().init, jax.random.key(0), x)["params"]
    assert a.tie(full)["head"] == {"kernel": st.Tied("embed/embedding", st.T)}
    assert "tied(LM(" in repr(a) and "head/kernel" in repr(a)


# --- partition boxes: an lm1b-style Transformer declared with nn.with_logical_partitioning -----

EMB, HEADS, MLP_DIM, LAYERS = 16, 2, 32, 2
RULES = (("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("kv", None), ("embed", None))


def _lp(init, *names):
    return nn.with_logical_partitioning(init, names)


class Lm1bBlock(nn.Module):
    """Pre-norm decoder block with every parameter boxed, as in Flax's lm1b example."""

    @nn.compact
    def __call__(self, x, mask):
        ln = {"scale_init": _lp(nn.initializers.ones, "embed")}
        ln["bias_init"] = _lp(nn.initializers.zeros, "embed")
        y = nn.LayerNorm(**ln)(x)
        y = nn.SelfAttention(
            num_heads=HEADS,
            qkv_features=EMB,
            kernel_init=_lp(nn.initializers.xavier_uniform(), "embed", "kv"),
            use_bias=False,
            deterministic=True,
        )(y, mask)
        x = x + y
        z = nn.LayerNorm(**ln)(x)
        z = nn.Dense(MLP_DIM, kernel_init=_lp(nn.initializers.xavier_uniform(), "embed", "mlp"))(z)
        z = nn.Dense(EMB, kernel_init=_lp(nn.initializers.xavier_uniform(), "mlp", "embed"))(
            nn.relu(z)
        )
        return x + z


class Lm1bDecoder(nn.Module):
    logits_via_embedding: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(
            VOCAB, EMB, embedding_init=_lp(nn.initializers.normal(1.0), "vocab", "embed")
        )
        y = embed(tokens)
        mask = nn.make_causal_mask(tokens)
        for i in range(LAYERS):
            y = Lm1bBlock(name=f"encoderdecoderblock_{i}")(y, mask)
        norm = {"scale_init": _lp(nn.initializers.ones, "embed")}
        y = nn.LayerNorm(name="encoderdecoder_norm", **norm)(y)
        if self.logits_via_embedding:  # lm1b's own tie: attend, then divide by sqrt(d)
            return embed.attend(y) / jnp.sqrt(y.shape[-1])
        return nn.Dense(
            VOCAB,
            kernel_init=_lp(nn.initializers.xavier_uniform(), "embed", "vocab"),
            bias_init=_lp(nn.initializers.normal(1e-6), "vocab"),
            name="logitdense",
        )(y)


class Lm1b(nn.Module):
    logits_via_embedding: bool = False

    @nn.compact
    def __call__(self, tokens):
        return Lm1bDecoder(self.logits_via_embedding, name="decoder")(tokens)


def _mesh():
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((1, 1), ("data", "model"), axis_types=(auto, auto))


HEAD_BOX_TIE = {"decoder/logitdense/kernel": st.Tied("decoder/Embed_0/embedding", st.T)}
TOKENS = jnp.arange(2 * SEQ, dtype=jnp.int32).reshape(2, SEQ) % VOCAB


def _num_boxes(tree):
    return sum(
        isinstance(x, nn.Partitioned)
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    )


def test_a_tie_naming_boxes_gives_the_view_the_targets_own_partition_names():
    untied = Lm1b().init(jax.random.key(0), TOKENS)["params"]["decoder"]
    assert untied["logitdense"]["kernel"].names == ("embed", "vocab")  # the target's own names
    model = tied(Lm1b(), HEAD_BOX_TIE)  # check=True
    variables = model.init(jax.random.key(0), TOKENS)
    params = variables["params"]
    assert params["decoder"]["logitdense"]["kernel"] == HEAD_BOX_TIE["decoder/logitdense/kernel"]
    m = model.materialize(variables)["params"]["decoder"]
    emb = params["decoder"]["Embed_0"]["embedding"]
    assert m["logitdense"]["kernel"].names == ("embed", "vocab")  # not the embedding's
    assert type(m["logitdense"]["kernel"]) is nn.LogicallyPartitioned
    np.testing.assert_array_equal(m["logitdense"]["kernel"].value, emb.value.T)
    assert m["Embed_0"]["embedding"].names == ("vocab", "embed")
    # the same box as the untied model's, names and all
    assert _num_boxes(model.materialize(variables)["params"]) == _num_boxes({"decoder": untied})


def test_every_materialized_view_of_a_box_carries_the_untied_models_names():
    # st.materialize, restructure and the tree grad_by_use hands fun: each box copied from a
    # buffer gets the names Flax gives that parameter in the untied model (not the buffer's)
    untied = Lm1b().init(jax.random.key(0), TOKENS)["params"]
    params = tied(Lm1b(), HEAD_BOX_TIE).init(jax.random.key(0), TOKENS)["params"]

    def names(tree):
        is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
        return {jax.tree_util.keystr(p): b.names for p, b in flat if is_box(b)}

    want = names(untied)
    flat, re = st.destructure(params)
    seen = []

    def loss(m):
        seen.append(names(m))
        return sum(jnp.sum(x) for x in jax.tree.leaves(m))

    st.grad_by_use(loss)(params)
    for got in (names(st.materialize(params)), names(re(flat)), seen[0]):
        assert got == want


def test_partition_specs_of_a_tied_boxed_tree_are_one_per_buffer_none_for_views():
    mesh = _mesh()
    params = tied(Lm1b(), HEAD_BOX_TIE).init(jax.random.key(0), TOKENS)["params"]
    specs = nn.get_partition_spec(params)
    assert specs["decoder"]["logitdense"]["kernel"] == HEAD_BOX_TIE["decoder/logitdense/kernel"]
    assert specs["decoder"]["Embed_0"]["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
    assert len(jax.tree.leaves(specs)) == len(jax.tree.leaves(params))  # one per buffer
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    assert jax.tree.structure(shardings) == jax.tree.structure(nn.unbox(params))
    assert shardings["decoder"]["Embed_0"]["embedding"].spec == jax.sharding.PartitionSpec(
        "model", None
    )


def test_the_materialized_view_is_sharded_like_the_parameter_it_replaces():
    mesh = _mesh()
    model = tied(Lm1b(), HEAD_BOX_TIE)
    variables = model.init(jax.random.key(0), TOKENS)
    m = model.materialize(variables)["params"]
    s = nn.logical_to_mesh_sharding(nn.get_partition_spec(m), mesh, RULES)
    # vocab -> model: the (embed, vocab) kernel splits its columns, like the untied one
    assert s["decoder"]["logitdense"]["kernel"].spec == jax.sharding.PartitionSpec(None, "model")
    untied = Lm1b().init(jax.random.key(0), TOKENS)["params"]
    u = nn.logical_to_mesh_sharding(nn.get_partition_spec(untied), mesh, RULES)
    assert s == u  # every sharding of the materialized tree is the untied model's


def test_boxed_tie_matches_lm1b_logits_via_embedding_values_and_gradients():
    # lm1b's own tie (attend / sqrt(d), no head parameters) is the independent reference
    ref_model = Lm1b(logits_via_embedding=True)
    model = tied(
        Lm1b(),
        {
            "decoder/logitdense/kernel": st.Tied(
                "decoder/Embed_0/embedding", st.T >> st.scale(EMB**-0.5)
            )
        },
    )
    variables = jax.jit(model.init)(jax.random.key(1), TOKENS)
    params = variables["params"]
    bias = params["decoder"]["logitdense"]["bias"]
    params["decoder"]["logitdense"]["bias"] = bias.replace(value=jnp.zeros_like(bias.value))
    ref = {"decoder": {k: v for k, v in params["decoder"].items() if k != "logitdense"}}
    mesh = _mesh()
    # placed on the mesh by the boxes' logical names (a prefix tree: one sharding per box)
    params = jax.device_put(
        params, nn.logical_to_mesh_sharding(nn.get_partition_spec(params), mesh, RULES)
    )
    ref = jax.device_put(ref, nn.logical_to_mesh_sharding(nn.get_partition_spec(ref), mesh, RULES))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        out = jax.jit(model.apply)({"params": params}, TOKENS)
        want = jax.jit(ref_model.apply)({"params": ref}, TOKENS)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)

        def loss(apply, p):
            logits = apply({"params": p}, TOKENS)
            return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS).mean()

        g = jax.jit(jax.grad(lambda p: loss(model.apply, p)))(params)
        g_ref = jax.jit(jax.grad(lambda p: loss(ref_model.apply, p)))(ref)
    assert g["decoder"]["logitdense"]["kernel"] == params["decoder"]["logitdense"]["kernel"]
    np.testing.assert_allclose(  # both uses of the table summed into one gradient
        g["decoder"]["Embed_0"]["embedding"].value,
        g_ref["decoder"]["Embed_0"]["embedding"].value,
        rtol=1e-5,
        atol=1e-6,
    )


def test_tying_the_value_leaf_keeps_the_targets_box():
    model = tied(
        Lm1b(),
        {"decoder/logitdense/kernel/value": st.Tied("decoder/Embed_0/embedding/value", st.T)},
    )
    variables = model.init(jax.random.key(0), TOKENS)
    box = variables["params"]["decoder"]["logitdense"]["kernel"]
    assert box.names == ("embed", "vocab")
    assert box.value == st.Tied("decoder/Embed_0/embedding/value", st.T)
    m = model.materialize(variables)["params"]["decoder"]["logitdense"]["kernel"]
    assert m.names == ("embed", "vocab")
    assert model.apply(variables, TOKENS).shape == (2, SEQ, VOCAB)


class TwoDense(nn.Module):
    b_init: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(
            EMB, kernel_init=_lp(nn.initializers.lecun_normal(), "embed", "mlp"), name="a"
        )(x)
        b_init = self.b_init or _lp(nn.initializers.lecun_normal(), "mlp", "embed")
        return nn.Dense(EMB, kernel_init=b_init, name="b")(x)


def test_boxed_ties_that_would_shard_the_view_wrongly_are_errors_naming_the_value_fix():
    x = jnp.ones((1, EMB))
    # identity keeps ('embed', 'mlp'), but b's own kernel is ('mlp', 'embed')
    value_fix = "{'b/kernel/value': st.Tied('a/kernel/value', identity)}"
    with raises("E42", "'b/kernel'", "('embed', 'mlp')", "('mlp', 'embed')", value_fix):
        tied(TwoDense(), {"b/kernel": "a/kernel"}).init(jax.random.key(0), x)
    tied(TwoDense(), {"b/kernel": st.Tied("a/kernel", st.T)}).init(jax.random.key(0), x)
    # a reshape that changes the shape has no axis of the buffer; one to the same shape keeps them
    with raises("E42", "'b/kernel'", "fn(flipud)", "'a/kernel'", "('embed', 'mlp')", "/value"):
        tied(TwoDense(), {"b/kernel": st.Tied("a/kernel", st.fn(jnp.flipud))}).init(
            jax.random.key(0), x
        )
    with raises("E42", "'b/kernel'", "reshape(16, 16)", "('embed', 'mlp')", "('mlp', 'embed')"):
        tied(TwoDense(), {"b/kernel": st.Tied("a/kernel", st.reshape(16, 16))}).init(
            jax.random.key(0), x
        )
    physical = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))
    with raises("E42", "'b/kernel'", "a Partitioned box and a LogicallyPartitioned", "/value"):
        tied(TwoDense(physical), {"b/kernel": st.Tied("a/kernel", st.T)}).init(jax.random.key(0), x)


def test_a_box_tied_by_st_tie_whose_view_drops_the_axes_is_an_error_at_materialize():
    # st.tie (not tied(...)) does not check boxes: the view's names are unknown when it is made
    params = TwoDense().init(jax.random.key(0), jnp.ones((1, EMB)))["params"]
    tied_params = st.tie(params, {"b/kernel": st.Tied("a/kernel", st.fn(jnp.flipud))})
    with raises("E42", "'b/kernel'", "fn(flipud)", "'a/kernel'", "'value' leaf"):
        st.materialize(tied_params)


@pytest.mark.parametrize(
    "t, code, why",
    [
        (st.index(EMB), "E71", (f"index({EMB})", "axis 0", f"size {EMB}")),
        (st.slice(0, EMB + 1) >> st.index(0), "E71", (f"0:{EMB + 1}", "axis 0", f"size {EMB}")),
        (st.reshape(5), "E9", ("reshape(5)", "TypeError: cannot reshape")),
    ],
)
def test_a_view_that_does_not_fit_its_boxed_buffer_is_an_error_naming_the_view(t, code, why):
    # as for unboxed trees: the view's path, the transform, the buffer and the reason
    view = ("tied(TwoDense).init", "'b/kernel'", "partition box 'a/kernel'", f"[{EMB}, {EMB}]")
    with raises(code, *view, *why, "Fix:"):
        tied(TwoDense(), {"b/kernel": st.Tied("a/kernel", t)}).init(
            jax.random.key(0), jnp.ones((1, EMB))
        )


def test_boxed_tied_params_round_trip_through_st_save_with_a_template(tmp_path):
    model = tied(Lm1b(), HEAD_BOX_TIE)
    params = model.init(jax.random.key(0), TOKENS)["params"]
    path = tmp_path / "lm1b.safetensors"
    st.save(path, params)
    like = jax.eval_shape(lambda: model.init(jax.random.key(0), TOKENS))["params"]
    back = st.load(path, like=like)  # the boxes (and their names) come from the template
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert back["decoder"]["Embed_0"]["embedding"].names == ("vocab", "embed")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        model.apply({"params": back}, TOKENS), model.apply({"params": params}, TOKENS)
    )
    with pytest.warns(
        UserWarning,
        match=r"^\[E130\] .*LogicallyPartitioned.*like=jax\.eval_shape",
    ):
        st.load(path)  # without a template the boxes are dicts: the warning says to pass like=


@pytest.mark.parametrize("bad", [None, 1, [1]])
def test_variables_that_are_not_a_dict(bad):
    model = tied(nn.Dense(3), {"bias": st.Tied("kernel", st.reshape(3))})
    found = f"found {type(bad).__name__}"
    with raises("E69", "tied(Dense).apply", "{'params': params}", found, cls=st.TieTypeError):
        model.apply(bad, jnp.ones((1, 1)))
    with raises("E69", "tied(Dense).materialize", "{'params': params}", found, cls=st.TieTypeError):
        model.materialize(bad)


def test_ties_for_a_module_that_makes_no_params_are_an_error_naming_them():
    class Counter(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen = self.variable("stats", "seen", jnp.zeros, ())
            seen.value += 1
            return x

    with raises("E184", "tied(Counter).init", "'params'", "['b']", "['stats']"):
        tied(Counter(), {"b": "a"}).init(jax.random.key(0), jnp.ones(2))
    assert tied(Counter(), {}).init(jax.random.key(0), jnp.ones(2)).keys() == {"stats"}


def test_a_target_spelled_twice_is_an_error_not_a_silent_pick():
    ties = {"bias": st.Tied("kernel", st.reshape((3,))), ("bias",): "kernel"}
    with raises("E6b", "'bias'", "('bias',)"):
        tied(nn.Dense(3), ties)


def test_lazy_init_ties_and_bind_reads_the_views_as_arrays():
    model = tied(LM(), TIES)
    tokens = jnp.zeros((2, SEQ), jnp.int32)
    lazy = model.lazy_init(jax.random.key(0), jax.ShapeDtypeStruct(tokens.shape, jnp.int32))
    assert lazy["params"]["head"]["kernel"] == TIES["head/kernel"]
    variables = _init(model, tokens)
    bound = model.bind(variables)
    # the reference: the untied module bound to the hand-materialized params
    params = variables["params"]
    by_hand = {**params, "head": {"kernel": params["embed"]["embedding"].T}}
    reference = LM().bind({"params": by_hand})
    np.testing.assert_allclose(bound(tokens), reference(tokens), rtol=1e-6)
    head = bound.variables["params"]["head"]["kernel"]
    np.testing.assert_array_equal(head, by_hand["head"]["kernel"])
    with raises("E69", "tied(LM).bind", "{'params': params}", "found list", cls=st.TieTypeError):
        model.bind([1])


def test_flax_serialization_keeps_ties_and_refuses_an_untied_state_for_a_tie():
    from flax import serialization

    model = tied(LM(), TIES)
    tokens = jnp.zeros((2, SEQ), jnp.int32)
    variables = _init(model, tokens)
    data = serialization.to_bytes(variables)
    assert serialization.to_state_dict(variables)["params"]["head"] == {"kernel": {}}
    back = serialization.from_bytes(_init(model, tokens, seed=1), data)
    assert back["params"]["head"]["kernel"] == TIES["head/kernel"]
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(a, b)
    untied = _init(LM(), tokens)
    with raises("E186", "params/head/kernel'", "shape (16, 19)", "Tied('embed/embedding', T)"):
        serialization.from_bytes(variables, serialization.to_bytes(untied))


@dataclasses.dataclass(frozen=True)
class _NamesTooMany(st.Transform, name="test_flax_names_too_many"):
    """A transpose whose axis_names gives one name too many (a user's bug)."""

    def __call__(self, x):
        return jnp.transpose(x)

    def axis_names(self, names, aval):
        return (*reversed(names), "extra")


def test_a_user_axis_names_of_the_wrong_length_is_an_error_naming_it():
    with raises("E101", "'b/kernel'", "('mlp', 'embed', 'extra')", "(16, 16)", "Fix:"):
        tied(TwoDense(), {"b/kernel": st.Tied("a/kernel", _NamesTooMany())}, check=False).init(
            jax.random.key(0), jnp.ones((1, EMB))
        )
