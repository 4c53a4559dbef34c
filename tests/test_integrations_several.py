"""Flax linen and NNX with views of several positions: LoRA on a tied embedding.

Each model is checked against the same model written by hand in ``jnp`` (the adapted table
``E = base + s * a @ b`` written once and read by the lookup and, transposed, by the head):
outputs, gradients of the base and both factors, and a few masked optimizer steps.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
import flax.linen as nn
from _raises import raises
from flax import nnx

import sharetree as st
import sharetree.nnx as stnnx
from sharetree.flax import tied

V, D, R, S = 13, 6, 2, 0.5  # vocabulary, width, adapter rank, adapter scale
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (3, 7)))
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _randn(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 0.5, jnp.float32)


def _hand_logits(base, a, b, w, bias, tokens):
    """The model by hand: the adapted table once, the lookup and the head read it."""
    table = base + S * (a @ b)
    h = jnp.tanh(table[tokens] @ w + bias)
    return h @ table.T


def _hand_loss(p, tokens=TOKENS):
    logits = _hand_logits(p["base"], p["a"], p["b"], p["w"], p["bias"], tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _adam_on(train):
    """Adam on the leaves ``train`` marks; the others frozen (their updates zero)."""
    frozen = jax.tree.map(lambda m: not m, train)
    return optax.chain(
        optax.masked(optax.adam(1e-2), train), optax.masked(optax.set_to_zero(), frozen)
    )


def _close(x, y):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


# --- Flax linen -------------------------------------------------------------------------


class LinenLM(nn.Module):
    """An LM whose embedding (read twice) is tied by sharetree to an adapted table."""

    boxed: bool = False  # the parameters in LogicallyPartitioned boxes

    def _init(self, init, *names):
        return nn.with_logical_partitioning(init, names) if self.boxed else init

    @nn.compact
    def __call__(self, tokens):
        normal = nn.initializers.normal(0.5)
        self.param("lora_base", self._init(normal, "vocab", "embed"), (V, D))
        self.param("lora_a", self._init(normal, "vocab", None), (V, R))
        self.param("lora_b", self._init(normal, None, "embed"), (R, D))
        x = nn.Embed(V, D, embedding_init=self._init(normal, "vocab", "embed"), name="embed")(
            tokens
        )
        x = jnp.tanh(nn.Dense(D, kernel_init=self._init(normal, "embed", "mlp"), name="mid")(x))
        head_init = self._init(normal, "embed", "vocab")
        return nn.Dense(V, use_bias=False, kernel_init=head_init, name="head")(x)


LINEN_TIES = {
    "embed/embedding": st.Tied({"base": "lora_base", "a": "lora_a", "b": "lora_b"}, st.lora(S)),
    "head/kernel": st.Tied("embed/embedding", st.T),
}


def _linen_hand(params):
    """The hand-written model's parameters, read from the linen ones (unboxed)."""
    p = nn.unbox(params)
    return {
        "base": p["lora_base"],
        "a": p["lora_a"],
        "b": p["lora_b"],
        "w": p["mid"]["kernel"],
        "bias": p["mid"]["bias"],
    }


def test_linen_lora_on_a_tied_embedding_equals_the_hand_written_model():
    model = tied(LinenLM(), LINEN_TIES)
    variables = model.init(jax.random.key(0), TOKENS)
    params = variables["params"]
    assert params["embed"]["embedding"] == LINEN_TIES["embed/embedding"]
    assert params["head"]["kernel"] == LINEN_TIES["head/kernel"]
    assert len(jax.tree.leaves(params)) == 5  # base, a, b, the mid kernel and bias
    hand = _linen_hand(params)
    table = hand["base"] + S * hand["a"] @ hand["b"]
    m = model.materialize(variables)["params"]
    _close(m["embed"]["embedding"], table)  # the lookup sees the adapted table
    _close(m["head"]["kernel"], table.T)  # and so does the head
    _close(model.apply(variables, TOKENS), _hand_logits(**hand, tokens=TOKENS))

    def loss(p):
        logits = model.apply({"params": p}, TOKENS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    grads = jax.jit(jax.grad(loss))(params)
    want = jax.grad(_hand_loss)(hand)
    assert grads["embed"]["embedding"] == LINEN_TIES["embed/embedding"]  # no leaf at a view
    for name in ("base", "a", "b"):  # each sums the lookup's and the head's contributions
        _close(grads[f"lora_{name}"], want[name])
    _close(grads["mid"]["kernel"], want["w"])
    # jit(grad) of the whole step: the same numbers
    _close(jax.jit(loss)(params), _hand_loss(hand))


def test_linen_add_lora_on_a_tied_model_trains_the_factors_like_the_hand_written_model():
    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(V, D, name="embed")(tokens)
            x = jnp.tanh(nn.Dense(D, name="mid")(x))
            return nn.Dense(V, use_bias=False, name="head")(x)

    model = tied(LM(), {"head/kernel": st.Tied("embed/embedding", st.T)})
    params = model.init(jax.random.key(1), TOKENS)["params"]
    tuned = st.add_lora(params, "embed/embedding", rank=R, key=jax.random.key(2), scale=S)
    tuned["lora"]["embed"]["embedding"]["b"] = _randn(3, R, D)  # as if trained a little
    frozen_base = params["embed"]["embedding"]

    def loss(t):
        logits = model.apply({"params": st.materialize(t)["params"]}, TOKENS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    lora = tuned["lora"]["embed"]["embedding"]
    hand = {"base": lora["base"], "a": lora["a"], "b": lora["b"]}
    hand |= {"w": params["mid"]["kernel"], "bias": params["mid"]["bias"]}
    _close(loss(tuned), _hand_loss(hand))
    opt = _adam_on(st.mask_by_path(tuned, "lora/*/[ab]"))
    hand_opt = _adam_on({k: k in ("a", "b") for k in hand})
    state, hand_state = opt.init(tuned), hand_opt.init(hand)
    for _ in range(3):
        g, hg = jax.grad(loss)(tuned), jax.grad(_hand_loss)(hand)
        _close(g["lora"]["embed"]["embedding"]["a"], hg["a"])
        _close(g["lora"]["embed"]["embedding"]["b"], hg["b"])
        updates, state = opt.update(g, state, tuned)
        tuned = optax.apply_updates(tuned, updates)
        hand_updates, hand_state = hand_opt.update(hg, hand_state, hand)
        hand = optax.apply_updates(hand, hand_updates)
    lora = tuned["lora"]["embed"]["embedding"]
    _close(lora["a"], hand["a"])
    _close(lora["b"], hand["b"])
    np.testing.assert_array_equal(lora["base"], frozen_base)
    merged = st.merge_lora(tuned)  # one table again, the head still its view
    assert merged["head"]["kernel"] == st.Tied("embed/embedding", st.T)
    _close(model.apply({"params": merged}, TOKENS), _hand_logits(**hand, tokens=TOKENS))


class Writer(LinenLM):
    """The LM that, with ``"params"`` mutable, writes ``target`` (a buffer or the view)."""

    target: str = "lora_base"

    @nn.compact
    def __call__(self, tokens):
        out = super().__call__(tokens)
        if self.is_mutable_collection("params"):
            p = self.get_variable("params", self.target)
            new = 2.0 * p if self.target == "lora_base" else {"embedding": 2.0 * p["embedding"]}
            self.put_variable("params", self.target, new)
        return out


def test_linen_mutable_params_come_back_canonical_and_a_write_to_the_view_names_its_buffers():
    variables = tied(Writer(), LINEN_TIES).init(jax.random.key(0), TOKENS)
    _, new = tied(Writer(), LINEN_TIES).apply(variables, TOKENS, mutable=["params"])
    assert new["params"]["embed"]["embedding"] == LINEN_TIES["embed/embedding"]
    assert new["params"]["head"]["kernel"] == LINEN_TIES["head/kernel"]
    _close(new["params"]["lora_base"], 2.0 * variables["params"]["lora_base"])
    bad = tied(Writer(target="embed"), LINEN_TIES)
    with raises("E185", "'params/embed/embedding'", "'lora_a'", "'lora_b'", "'lora_base'"):
        bad.apply(variables, TOKENS, mutable=["params"])


# --- linen partition boxes ----------------------------------------------------------------

BOXED_TIES = {
    "embed/embedding/value": st.Tied(
        {"base": "lora_base/value", "a": "lora_a/value", "b": "lora_b/value"}, st.lora(S)
    ),
    "head/kernel": st.Tied("embed/embedding", st.T),
}


def _names(tree):
    """The partition names of every box of ``tree``, by path."""
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
    return {jax.tree_util.keystr(p): b.names for p, b in flat if is_box(b)}


def test_linen_boxed_lora_through_the_value_leaves_keeps_every_box_the_untied_models():
    untied = LinenLM(boxed=True).init(jax.random.key(0), TOKENS)["params"]
    model = tied(LinenLM(boxed=True), BOXED_TIES)
    variables = model.init(jax.random.key(0), TOKENS)
    params = variables["params"]
    # the target keeps its own box (holding the view); the head is a view of that box
    assert params["embed"]["embedding"].names == ("vocab", "embed")
    assert params["embed"]["embedding"].value == BOXED_TIES["embed/embedding/value"]
    m = model.materialize(variables)["params"]
    assert _names(m) == _names(untied)  # the head's box: ('embed', 'vocab'), its own
    assert type(m["head"]["kernel"]) is nn.LogicallyPartitioned
    flat, restructure = st.destructure(params)
    assert _names(restructure(flat)) == _names(untied)
    hand = _linen_hand(params)
    table = hand["base"] + S * hand["a"] @ hand["b"]
    _close(m["head"]["kernel"].value, table.T)
    _close(model.apply(variables, TOKENS), _hand_logits(**hand, tokens=TOKENS))


def test_linen_add_lora_on_a_boxed_tied_model_keeps_every_box_the_untied_models():
    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            init = nn.with_logical_partitioning(nn.initializers.normal(0.5), ("vocab", "embed"))
            x = nn.Embed(V, D, embedding_init=init, name="embed")(tokens)
            init = nn.with_logical_partitioning(nn.initializers.normal(0.5), ("embed", "vocab"))
            return nn.Dense(V, use_bias=False, kernel_init=init, name="head")(jnp.tanh(x))

    untied = LM().init(jax.random.key(0), TOKENS)["params"]
    model = tied(LM(), {"head/kernel": st.Tied("embed/embedding", st.T)})
    params = model.init(jax.random.key(0), TOKENS)["params"]
    # the pattern chooses the box's value: the table keeps its box, the factors are arrays
    tuned = st.add_lora(params, "embed/embedding", rank=R, key=jax.random.key(1), scale=S)
    lora = tuned["lora"]["embed"]["embedding"]["value"]
    lora["b"] = _randn(4, R, D)
    m = st.materialize(tuned)["params"]
    assert _names(m) == _names(untied)  # the head's box: ('embed', 'vocab')
    table = lora["base"] + S * lora["a"] @ lora["b"]
    _close(m["head"]["kernel"].value, table.T)
    _close(model.apply({"params": m}, TOKENS), jnp.tanh(table[TOKENS]) @ table.T)


def test_linen_boxes_of_several_inputs_with_other_names_are_an_error_naming_the_value_tie():
    fix = "{'embed/embedding/value': st.Tied({'a': 'lora_a/value', 'b': 'lora_b/value', "
    with raises("E190", "'embed/embedding'", "'a' ('lora_a')", "('vocab', None)", fix):
        tied(LinenLM(boxed=True), LINEN_TIES).init(jax.random.key(0), TOKENS)

    # a boxed target given a view of plain arrays: the same fix, the refs as written
    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.param("table", nn.with_partitioning(nn.initializers.ones, ("x",)), (D,))
            return nn.Dense(D, name="mid")(x)

    ties = {"table": st.Tied({"p": "mid/bias", "q": "mid/bias"}, st.add())}
    value_fix = "{'table/value': st.Tied({'p': 'mid/bias', 'q': 'mid/bias'}, add)}"
    with raises("E190", "'table'", "'p' ('mid/bias') is an array float32[6] (no box)", value_fix):
        tied(Plain(), ties).init(jax.random.key(0), jnp.ones((1, D)))


P = nn.Partitioned


def _box(names, seed, shape=(4, 4)):
    return P(_randn(seed, *shape), names=names)


@dataclasses.dataclass(frozen=True)
class Product(st.Transform):
    """A user's transform of two inputs that declares no axis names."""

    inputs = ("p", "q")

    def __call__(self, x):
        return x["p"] * x["q"]


@dataclasses.dataclass(frozen=True)
class SumT(st.Transform):
    """A user's transform of two inputs, ``(p + q).T``, that says where their axes go."""

    inputs = ("p", "q")

    def __call__(self, x):
        return (x["p"] + x["q"]).T

    def axis_names(self, names, aval):
        return tuple(reversed(names["p"]))


def test_a_view_of_boxes_of_one_name_carries_the_names_its_transform_derives():
    x, y = _box(("rows", "cols"), 0), _box(("rows", "cols"), 1)
    tree = {
        "x": x,
        "y": y,
        "sum": st.Tied({"p": "x", "q": "y"}, st.add()),
        "sum_t": st.Tied("sum", st.T),
        "prod": st.Tied({"a": "x", "b": "y"}, st.matmul()),
        "prod_t": st.Tied("prod", st.T),
        "sum_user": st.Tied({"p": "x", "q": "y"}, SumT()),
        "sum_user_t": st.Tied("sum_user", st.T),
    }
    for m in (st.materialize(tree), st.destructure(tree)[1](st.destructure(tree)[0])):
        assert m["sum"].names == ("rows", "cols")  # add: the inputs' names
        assert m["sum_t"].names == ("cols", "rows")  # T of them
        assert m["prod"].names == ("rows", "cols")  # matmul: a's rows, b's columns
        assert m["prod_t"].names == ("cols", "rows")
        _close(m["sum"].value, x.value + y.value)
        _close(m["prod_t"].value, (x.value @ y.value).T)
        assert m["sum_user"].names == ("cols", "rows")  # the user's axis_names
        assert m["sum_user_t"].names == ("rows", "cols")
        _close(m["sum_user_t"].value, x.value + y.value)


def test_a_view_of_boxes_whose_names_cannot_be_derived_gets_no_box_and_nothing_fails():
    x, y = _box(("rows", "cols"), 0), _box(("rows", "cols"), 1)
    tree = {"x": x, "y": y, "v": st.Tied({"p": "x", "q": "y"}, Product()), "vt": st.Tied("v", st.T)}
    m = st.materialize(tree)
    assert not isinstance(m["v"], nn.Partitioned)  # an array: no names to shard it wrongly by
    assert not isinstance(m["vt"], nn.Partitioned)
    _close(m["v"], x.value * y.value)
    _close(m["vt"], (x.value * y.value).T)
    grads = jax.grad(lambda t: jnp.sum(st.materialize(t)["vt"] ** 2))(tree)
    _close(grads["x"].value, 2 * x.value * y.value**2)  # by hand: d/dx sum((x y)^2)


def test_tied_checks_the_names_a_view_of_boxes_derives_against_the_targets_own():
    class Three(nn.Module):
        target: tuple = ("rows", "cols")

        @nn.compact
        def __call__(self, x):
            for name, names in (("x", ("rows", "cols")), ("y", ("rows", "cols"))):
                self.param(name, nn.with_partitioning(nn.initializers.ones, names), (4, 4))
            self.param("v", nn.with_partitioning(nn.initializers.ones, self.target), (4, 4))
            return x

    ties = {"v": st.Tied({"p": "x", "q": "y"}, st.add())}
    params = tied(Three(), ties).init(jax.random.key(0), 0)["params"]
    assert params["v"] == ties["v"]
    m = st.materialize(params)
    assert m["v"].names == ("rows", "cols")
    with raises("E42", "'v'", "('rows', 'cols')", "('cols', 'rows')", "'v/value'"):
        tied(Three(("cols", "rows")), ties).init(jax.random.key(0), 0)
    tied(Three(("cols", "rows")), ties, check=False).init(jax.random.key(0), 0)
    with raises("E42", "'v'", "Product", "axes"):
        tied(Three(), {"v": st.Tied({"p": "x", "q": "y"}, Product())}).init(jax.random.key(0), 0)


# --- Flax NNX ------------------------------------------------------------------------------


class Adapter(nnx.Module):
    """The parts of an adapted table: the frozen base and two trainable factors."""

    def __init__(self, base, rank, rngs):
        rows, cols = base.shape
        self.base = nnx.Param(base)
        self.a = nnx.LoRAParam(0.5 * jax.random.normal(rngs.params(), (rows, rank)))
        self.b = nnx.LoRAParam(0.5 * jax.random.normal(rngs.params(), (rank, cols)))


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.mid = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        return self.head(jnp.tanh(self.mid(self.embed(tokens))))


NNX_TIES = {
    "embed/embedding": st.Tied({"base": "lora/base", "a": "lora/a", "b": "lora/b"}, st.lora(S)),
    "head/kernel": st.Tied("embed/embedding", st.T),
}


def _adapted(seed=0):
    model = NnxLM(nnx.Rngs(seed))
    model.lora = Adapter(model.embed.embedding[...], R, nnx.Rngs(seed + 1))
    return model


def _nnx_hand(state):
    lora = state["lora"]
    return {
        "base": lora["base"][...],
        "a": lora["a"][...],
        "b": lora["b"][...],
        "w": state["mid"]["kernel"][...],
        "bias": state["mid"]["bias"][...],
    }


def _nnx_loss(graphdef):
    def loss(state):
        logits = stnnx.merge(graphdef, state)(TOKENS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    return loss


def test_nnx_lora_on_a_tied_embedding_equals_the_hand_written_model():
    model = _adapted()
    graphdef, state = stnnx.split(model, ties=NNX_TIES)
    # the view is the target Variable's value: the Param keeps its own kind
    assert type(state["embed"]["embedding"]) is nnx.Param
    assert state["head"]["kernel"] == NNX_TIES["head/kernel"]
    assert len(jax.tree.leaves(state)) == 5
    hand = _nnx_hand(state)
    table = hand["base"] + S * hand["a"] @ hand["b"]
    merged = stnnx.merge(graphdef, state)
    _close(merged.embed.embedding[...], table)
    _close(merged.head.kernel[...], table.T)
    assert type(merged.embed.embedding) is nnx.Param and type(merged.lora.a) is nnx.LoRAParam
    _close(merged(TOKENS), _hand_logits(**hand, tokens=TOKENS))

    loss = _nnx_loss(graphdef)
    grads = jax.jit(jax.grad(loss))(state)
    want = jax.grad(_hand_loss)(hand)
    for name in ("base", "a", "b"):
        _close(grads["lora"][name][...], want[name])
    _close(grads["mid"]["kernel"][...], want["w"])


def test_nnx_masked_adam_steps_with_a_frozen_base_match_the_hand_written_model():
    graphdef, state = stnnx.split(_adapted(1), ties=NNX_TIES)
    hand = _nnx_hand(state)
    loss = _nnx_loss(graphdef)
    opt = _adam_on(st.mask_by_path(state, "lora/[ab]"))
    hand_opt = _adam_on({k: k in ("a", "b") for k in hand})
    opt_state, hand_state = opt.init(state), hand_opt.init(hand)
    base = hand["base"]
    for _ in range(3):
        value, g = jax.value_and_grad(loss)(state)
        hand_value, hg = jax.value_and_grad(_hand_loss)(hand)
        _close(value, hand_value)
        updates, opt_state = opt.update(g, opt_state, state)
        state = optax.apply_updates(state, updates)
        hand_updates, hand_state = hand_opt.update(hg, hand_state, hand)
        hand = optax.apply_updates(hand, hand_updates)
    _close(state["lora"]["a"][...], hand["a"])
    _close(state["lora"]["b"][...], hand["b"])
    np.testing.assert_array_equal(state["lora"]["base"][...], base)
    value_refs = {"a": "lora/a/value", "b": "lora/b/value", "base": "lora/base/value"}
    assert state["embed"]["embedding"].get_raw_value() == st.Tied(value_refs, st.lora(S))


def test_nnx_state_round_trips_through_merge_and_update_writes_the_adapted_table():
    model = _adapted(2)
    graphdef, state = stnnx.split(model, ties=NNX_TIES)
    _, again = stnnx.split(stnnx.merge(graphdef, state), ties=NNX_TIES)
    assert jax.tree.structure(again) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(x, y)
    new = jax.tree.map(lambda x: x + 1.0, state)
    stnnx.update(model, graphdef, new)
    hand = _nnx_hand(new)
    table = hand["base"] + S * hand["a"] @ hand["b"]
    _close(model.embed.embedding[...], table)
    _close(model.head.kernel[...], table.T)
    _close(model.lora.a[...], hand["a"])


def test_nnx_refs_that_climb_read_the_adapters_own_variables():
    # the adapted table is a Variable of the adapter, its refs siblings ("./base"); the
    # embedding and the head are views of it (a DAG: a view of a view of several positions)
    model = _adapted(3)
    model.lora.table = nnx.Param(jnp.zeros((V, D)))
    ties = {
        "lora/table/value": st.Tied({"base": "./base", "a": "./a", "b": "../lora/b"}, st.lora(S)),
        "embed/embedding": "lora/table",
        "head/kernel": st.Tied("lora/table", st.T),
    }
    graphdef, state = stnnx.split(model, ties=ties)
    assert len(jax.tree.leaves(state)) == 5
    hand = _nnx_hand(state)
    table = hand["base"] + S * hand["a"] @ hand["b"]
    merged = stnnx.merge(graphdef, state)
    _close(merged.lora.table[...], table)
    _close(merged.embed.embedding[...], table)
    _close(merged(TOKENS), _hand_logits(**hand, tokens=TOKENS))
    grads = jax.grad(_nnx_loss(graphdef))(state)
    _close(grads["lora"]["a"][...], jax.grad(_hand_loss)(hand)["a"])


def test_nnx_a_dangling_input_a_climb_past_the_root_and_inputs_in_two_states_are_named():
    bad = {
        "embed/embedding": st.Tied({"base": "lora/base", "a": "lora/a", "b": "lora/bb"}, st.lora())
    }
    with raises("E1", "'embed/embedding'", "input 'b'", "'lora/bb'", "'lora/b'"):
        stnnx.split(_adapted(), ties=bad)
    climb = {
        "embed/embedding": st.Tied(
            {"base": "../../../base", "a": "lora/a", "b": "lora/b"}, st.lora()
        )
    }
    with raises("E163", "'embed/embedding'", "input 'base'", "climbs 3"):
        stnnx.split(_adapted(), ties=climb)
    # NNX's own way to train the factors only, a LoRAParam filter, splits the view's inputs
    with raises("E180", "states [0, 1]", "input 'a' 'lora/a' in state 0", "'lora/base' in state 1"):
        stnnx.split(_adapted(), nnx.LoRAParam, ..., ties=NNX_TIES)
