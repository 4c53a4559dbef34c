"""sharetree.flax: linen ``tied(module, ties)`` against linen's own tying (``nn.Embed.attend``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
import flax.linen as nn
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
    with pytest.raises(st.TieError, match=r"params/dec/kernel.*view.*enc/kernel"):
        bad.apply(variables, x, mutable=True)


def test_tying_a_missing_path_names_it_and_the_closest_one():
    x = jnp.zeros((2, SEQ), jnp.int32)
    with pytest.raises(st.TieError) as e:
        jax.eval_shape(
            tied(LM(), {"haed/kernel": st.Tied("embed/embedding", st.T)}).init, jax.random.key(0), x
        )
    msg = str(e.value)
    assert "'haed/kernel'" in msg and "'params'" in msg and "'head/kernel'" in msg
    with pytest.raises(st.TieError) as e:
        jax.eval_shape(
            tied(LM(), {"head/kernel": st.Tied("embed/embeding", st.T)}).init, jax.random.key(0), x
        )
    assert "'embed/embeding'" in str(e.value) and "'embed/embedding'" in str(e.value)


def test_shape_mismatch_and_bad_arguments():
    x = jnp.zeros((2, SEQ), jnp.int32)
    with pytest.raises(st.TieError, match=r"float32\[19, 16\].*float32\[16, 19\]"):
        jax.eval_shape(tied(LM(), {"head/kernel": "embed/embedding"}).init, jax.random.key(0), x)
    with pytest.raises(st.TieError, match=r"linen\.Module"):
        tied(lambda x: x, TIES)
    with pytest.raises(st.TieError, match="mapping"):
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
