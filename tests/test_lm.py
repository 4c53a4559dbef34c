"""sharetree._lm: the shared LM, tied by sharetree, against the same model tied by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from _raises import raises

import sharetree as st
from sharetree._lm import HEAD_TIE, TinyLM, block_ties
from sharetree.flax import tied

SIZES = {"vocab": 13, "context": 8, "d_model": 16, "heads": 2, "layers": 2}


def test_tied_head_equals_embed_attend_by_hand():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, 8)), jnp.int32)
    hand = TinyLM(**SIZES, tie_by_hand=True)
    model = tied(TinyLM(**SIZES), HEAD_TIE)
    p_hand = hand.init(jax.random.key(0), tokens)["params"]
    assert "head" not in p_hand
    p_st = model.init(jax.random.key(0), tokens)["params"]
    assert p_st["head"] == {"kernel": st.Tied("embed/embedding", st.T)}
    params = {**p_hand, "head": p_st["head"]}  # the hand-tied values, tied by sharetree
    np.testing.assert_allclose(
        model.apply({"params": params}, tokens),
        hand.apply({"params": p_hand}, tokens),
        rtol=1e-5,
        atol=1e-6,
    )


def test_block_ties_make_one_block_serve_every_layer():
    tokens = jnp.zeros((1, 8), jnp.int32)
    model = tied(TinyLM(**{**SIZES, "layers": 3}), {**HEAD_TIE, **block_ties(3)})
    params = model.init(jax.random.key(1), tokens)["params"]
    assert params["block_1"] == params["block_2"] == st.Tied("block_0")
    m = st.materialize(params)
    for a, b in zip(jax.tree.leaves(m["block_0"]), jax.tree.leaves(m["block_2"]), strict=True):
        assert a is b  # identity views are the buffer itself


def test_a_window_longer_than_the_context_is_an_error():
    model = TinyLM(**SIZES)
    with raises("E187", "TinyLM", "a window of 9", "context=8") as e:
        model.init(jax.random.key(0), jnp.zeros((1, 9), jnp.int32))
    assert isinstance(e.value, ValueError)
