"""Importing checkpoints that store a tied weight twice (PyTorch / Hugging Face state dicts).

``find_ties`` discovers the duplicates, ``tie(..., atol=...)`` ties them and
refuses copies that differ, naming both paths, the largest difference and how
to choose which copy wins.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import sharetree as st

V, D, H = 32, 8, 16


def hf_state_dict(seed: int = 0, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """A LLaMA-like state dict as PyTorch saves it: lm_head.weight is a second copy."""
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(V, D)).astype(dtype)
    sd = {
        "model.embed_tokens.weight": emb,
        "model.layers.0.mlp.up_proj.weight": rng.normal(size=(H, D)).astype(dtype),
        "model.layers.0.mlp.down_proj.weight": rng.normal(size=(D, H)).astype(dtype),
        "model.layers.0.input_layernorm.weight": np.ones(D, dtype),
        "model.norm.weight": np.ones(D, dtype),  # equal to the layernorm, but not a tie
        "lm_head.weight": emb.copy(),  # (V, D), as nn.Linear(D, V) stores it
    }
    return sd


def forward(sd: dict, tokens: jax.Array) -> jax.Array:
    """A materialized state dict -> logits (the framework's own idiom: plain arrays)."""
    x = sd["model.embed_tokens.weight"][tokens] * sd["model.layers.0.input_layernorm.weight"]
    h = jax.nn.gelu(x @ sd["model.layers.0.mlp.up_proj.weight"].T)
    x = (x + h @ sd["model.layers.0.mlp.down_proj.weight"].T) * sd["model.norm.weight"]
    return x @ sd["lm_head.weight"].T


def test_find_ties_and_tie_recover_the_tie() -> None:
    sd = hf_state_dict()
    found = st.find_ties(sd)
    # the first copy in flatten order (sorted keys: 'lm_head...' < 'model...') is the buffer
    assert found == {"model.embed_tokens.weight": st.Tied("lm_head.weight")}
    tied = st.tie(sd, found, atol=0.0)
    assert tied["model.embed_tokens.weight"] == st.Tied("lm_head.weight")
    g = st.canonicalize(tied)
    assert g.num_unique == 5 and g.num_expanded == 6
    assert g.nbytes_expanded - g.nbytes_unique == V * D * 4
    # independent reference: the materialized tree is the original state dict
    m = st.materialize(tied)
    assert set(m) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(np.asarray(m[k]), sd[k])


def test_transposed_copy_is_found_and_tied() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    sd = {"encoder.weight": w, "decoder.weight": np.ascontiguousarray(w.T), "b": np.arange(3.0)}
    found = st.find_ties(sd)
    assert found == {"encoder.weight": st.Tied("decoder.weight", st.T)}
    tied = st.tie(sd, found, atol=0.0)
    np.testing.assert_array_equal(np.asarray(st.materialize(tied)["encoder.weight"]), w)
    # the other direction, chosen by the caller, is just as exact
    other = st.tie(sd, {"decoder.weight": st.Tied("encoder.weight", st.T)}, atol=0.0)
    np.testing.assert_array_equal(np.asarray(st.materialize(other)["decoder.weight"]), w.T)


def test_gradient_of_imported_tie_is_sum_over_the_copies() -> None:
    sd = hf_state_dict()
    tied = st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=0.0)
    tokens = jnp.arange(10) % V

    def loss_untied(p):
        return jnp.mean(forward(p, tokens) ** 2)

    g_tied = jax.jit(jax.grad(lambda p: loss_untied(st.materialize(p))))(tied)
    g_untied = jax.jit(jax.grad(loss_untied))(sd)  # the two copies as independent parameters
    assert g_tied["lm_head.weight"] == st.Tied("model.embed_tokens.weight")
    np.testing.assert_allclose(
        g_tied["model.embed_tokens.weight"],
        g_untied["model.embed_tokens.weight"] + g_untied["lm_head.weight"],
        rtol=1e-5,
        atol=1e-6,
    )


def test_file_roundtrip_stores_the_tied_table_once(tmp_path) -> None:
    sd = hf_state_dict()
    torch_file = tmp_path / "pytorch_model.safetensors"
    save_file(sd, str(torch_file))  # both copies, as torch.save of a state dict keeps them
    with pytest.warns(UserWarning, match="not written by sharetree"):
        imported = st.load(torch_file)
    tied = st.tie(imported, st.find_ties(imported), atol=0.0)
    ours = tmp_path / "model.safetensors"
    st.save(ours, tied)
    assert set(load_file(str(ours))) == set(sd) - {"model.embed_tokens.weight"}
    assert os.path.getsize(torch_file) - os.path.getsize(ours) > V * D * 4 - 1024
    back = st.load(ours)
    assert back["model.embed_tokens.weight"] == st.Tied("lm_head.weight")
    np.testing.assert_array_equal(
        np.asarray(st.materialize(back)["model.embed_tokens.weight"]),
        sd["model.embed_tokens.weight"],
    )


def test_differing_copies_are_an_error_naming_both_paths() -> None:
    sd = hf_state_dict()
    sd["lm_head.weight"] = sd["lm_head.weight"].copy()
    sd["lm_head.weight"][3, 2] += 0.25
    sd["lm_head.weight"][5, 1] -= 0.125
    with pytest.raises(st.TieError) as err:
        st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=0.0)
    msg = str(err.value)
    assert "'lm_head.weight'" in msg and "'model.embed_tokens.weight'" in msg
    assert "differ by up to 0.25" in msg and "2 of 256 elements" in msg
    assert "choose which copy wins" in msg
    assert "st.tie(tree, {'model.embed_tokens.weight': Tied('lm_head.weight')})" in msg
    # find_ties does not propose the differing pair at all
    assert st.find_ties(sd) == {}


def test_caller_chooses_which_copy_wins() -> None:
    sd = hf_state_dict()
    head = sd["lm_head.weight"] = sd["lm_head.weight"] + 0.5
    emb = sd["model.embed_tokens.weight"]
    # without atol the ref wins (the documented default, as for a fresh model)
    keep_emb = st.materialize(st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}))
    np.testing.assert_array_equal(np.asarray(keep_emb["lm_head.weight"]), emb)
    # tied the other way round, the head's copy wins
    keep_head = st.materialize(st.tie(sd, {"model.embed_tokens.weight": "lm_head.weight"}))
    np.testing.assert_array_equal(np.asarray(keep_head["model.embed_tokens.weight"]), head)


def test_tolerance_and_float64_precision() -> None:
    sd = hf_state_dict(dtype=np.float64)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1e-12  # lost if compared in float32
    with pytest.raises(st.TieError, match=r"differ by up to 1\.0+\d*e-12"):
        st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=0.0)
    tied = st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=1e-9)
    assert tied["lm_head.weight"] == st.Tied("model.embed_tokens.weight")
    with pytest.raises(st.TieError, match=re.escape("raise atol to 1e-12")):
        st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=1e-13)


def test_nans_in_the_same_places_are_equal() -> None:
    a = np.array([[1.0, np.nan], [np.inf, -2.0]])
    assert st.tie({"a": a, "b": a.copy()}, {"b": "a"}, atol=0.0)["b"] == st.Tied("a")
    b = a.copy()
    b[0, 0] = np.nan
    with pytest.raises(st.TieError, match="differ by up to inf"):
        st.tie({"a": a, "b": b}, {"b": "a"}, atol=1.0)


def test_transformed_view_is_compared() -> None:
    w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    tree = {"w": w, "v": w.T * np.float32(2.0)}
    tied = st.tie(tree, {"v": st.Tied("w", st.T >> st.scale(2.0))}, atol=0.0)
    assert tied["v"] == st.Tied("w", st.T >> st.scale(2.0))
    with pytest.raises(st.TieError, match=r"T >> scale\(3\.0\) of 'w'.*inverse of T >> scale"):
        st.tie(tree, {"v": st.Tied("w", st.T >> st.scale(3.0))}, atol=0.0)


def test_subtree_tie_names_the_differing_leaf() -> None:
    rng = np.random.default_rng(2)
    enc = {"kernel": rng.normal(size=(3, 3)), "bias": rng.normal(size=3)}
    dec = {"kernel": enc["kernel"].copy(), "bias": enc["bias"] + 1e-3}
    with pytest.raises(st.TieError, match=r"'dec/bias'.*'enc/bias'.*0\.001"):
        st.tie({"enc": enc, "dec": dec}, {"dec": "enc"}, atol=0.0)
    dec["bias"] = enc["bias"].copy()
    assert st.tie({"enc": enc, "dec": dec}, {"dec": "enc"}, atol=0.0)["dec"] == st.Tied("enc")


def test_non_array_leaves_are_compared_too() -> None:
    tree = {"a": {"w": np.ones(2), "act": "gelu"}, "b": {"w": np.ones(2), "act": "relu"}}
    with pytest.raises(st.TieError, match=r"'b/act' holds 'relu', 'a/act' holds 'gelu'"):
        st.tie(tree, {"b": "a"}, atol=0.0)


def test_default_tie_of_fresh_init_does_not_compare_values() -> None:
    rng = np.random.default_rng(0)
    fresh = {"enc": rng.normal(size=(4, 3)), "dec": rng.normal(size=(3, 4))}
    tied = st.tie(fresh, {"dec": st.Tied("enc", st.T)})  # values differ: fine by default
    assert tied["dec"] == st.Tied("enc", st.T)
    assert st.tie(fresh, {"dec": st.Tied("enc", st.T)}, atol=None)["dec"] == tied["dec"]


def test_atol_must_be_a_nonnegative_number() -> None:
    sd = {"a": np.ones(2), "b": np.ones(2)}
    for bad in (-1.0, float("nan"), "0", True):
        with pytest.raises(st.TieError, match="atol must be a number >= 0"):
            st.tie(sd, {"b": "a"}, atol=bad)


def test_atol_needs_concrete_values() -> None:
    @jax.jit
    def f(a, b):
        return st.tie({"a": a, "b": b}, {"b": "a"}, atol=0.0)

    with pytest.raises(st.TieError, match=r"not concrete.*outside jit"):
        f(jnp.ones(2), jnp.ones(2))


def test_shape_mismatch_with_check_off_is_still_caught_by_atol() -> None:
    sd = {"a": np.ones((2, 3)), "b": np.ones((3, 2))}
    with pytest.raises(st.TieError, match=r"shape \(2, 3\).*shape \(3, 2\)"):
        st.tie(sd, {"b": "a"}, check=False, atol=0.0)
