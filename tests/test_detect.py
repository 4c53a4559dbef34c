import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharetree as st


def test_tie_identical_ties_array_objects_only():
    w = jnp.ones((2, 2))
    n = np.zeros(3)
    tree = {"a": w, "b": [w, n], "c": n, "d": 1.0, "e": 1.0, "f": None, "g": "s", "h": "s"}
    out = st.tie_identical(tree)
    assert out["b"][0] == st.Tied("a") and out["c"] == st.Tied("b/1")
    assert out["d"] == 1.0 and out["e"] == 1.0 and out["h"] == "s"
    assert st.canonicalize(out).num_unique == 2 + 4  # w, n, two floats, two strings
    m = st.materialize(out)
    assert m["b"][0] is w and m["c"] is n


def test_tie_identical_leaves_equal_but_distinct_arrays_alone():
    tree = {"a": jnp.ones(2), "b": jnp.ones(2)}
    assert st.tie_identical(tree) is tree


def test_tie_identical_first_in_flatten_order_is_buffer():
    w = jnp.arange(3.0)
    out = st.tie_identical({"z": w, "a": w})
    assert out["z"] == st.Tied("a") and out["a"] is w


def test_find_ties_identity_and_transpose_feed_tie():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(5, 3)).astype(np.float32)
    sd = {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb.copy(),
        "proj.weight": emb.T.copy(),
        "other": rng.normal(size=(5, 3)).astype(np.float32),
        "zeros_a": np.zeros(4),
        "zeros_b": np.zeros(4),
    }
    ties = st.find_ties(sd)
    assert ties == {
        "model.embed_tokens.weight": st.Tied("lm_head.weight"),
        "proj.weight": st.Tied("lm_head.weight", st.T),
    }
    tied = st.tie(sd, ties)
    m = st.materialize(tied)
    for k in sd:
        np.testing.assert_array_equal(m[k], sd[k])
    assert st.canonicalize(tied).num_unique == 4


def test_find_ties_atol():
    a = np.linspace(0, 1, 6).reshape(2, 3)
    sd = {"a": a, "b": a + 1e-7, "c": a.T + 1e-3}
    assert st.find_ties(sd) == {}
    assert st.find_ties(sd, atol=1e-6) == {"b": st.Tied("a")}
    assert st.find_ties(sd, atol=1e-2) == {"b": st.Tied("a"), "c": st.Tied("a", st.T)}


def test_find_ties_custom_transforms_and_slash_keys():
    a = np.arange(6.0)
    sd = {"x/y": a, "z": a.reshape(2, 3) * 1.0}
    ties = st.find_ties(sd, transforms=(st.reshape(2, 3),))
    assert ties == {"z": st.Tied(("x/y",), st.reshape(2, 3))}
    with pytest.raises(st.TieError):
        st.find_ties(sd, transforms=(np.transpose,))


def test_gradients_do_not_get_tied():
    # identical gradient objects mean nothing: grads of distinct params stay distinct positions
    p = {"a": jnp.ones(2), "b": jnp.ones(2)}
    g = jax.grad(lambda t: jnp.sum(t["a"] + t["b"]))(p)
    assert st.canonicalize(g).num_views == 0


def test_find_ties_atol_validated_and_nans_match_in_place():
    a = np.array([np.nan, 1.0, 2.0])
    sd = {"a": a, "b": a.copy()}
    assert st.find_ties(sd) == {"b": st.Tied("a")}
    assert st.find_ties(sd, atol=0.1) == {"b": st.Tied("a")}
    with pytest.raises(st.TieError, match="atol must be a number >= 0"):
        st.find_ties(sd, atol=-1)
