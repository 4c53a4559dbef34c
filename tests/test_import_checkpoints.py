"""Importing checkpoints that store a tied weight twice (PyTorch / Hugging Face state dicts).

``find_ties`` discovers the duplicates, ``tie(..., atol=...)`` ties them and
refuses copies that differ, naming both paths, the largest difference and how
to choose which copy wins.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _raises import raises
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


@contextlib.contextmanager
def warns(code: str, *facts: str) -> Iterator[pytest.WarningsRecorder]:
    """Expect the warning of ``code`` (a file sharetree did not write) naming every fact."""
    with pytest.warns(UserWarning) as caught:
        yield caught
    text = "\n".join(str(w.message) for w in caught if str(w.message).startswith(f"[{code}]"))
    assert text, [str(w.message) for w in caught]
    for fact in facts:
        assert fact in text, f"{fact!r} not in: {text}"


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
    with warns("E142", "'sharetree.format_version'", "6 arrays"):
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
    with raises(
        "E46",
        "'lm_head.weight' and 'model.embed_tokens.weight' differ by up to 0.25",
        "2 of 256 elements",
        "st.tie(tree, {'model.embed_tokens.weight': Tied('lm_head.weight')})",
    ):
        st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=0.0)
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
    with raises("E46", r"re:differ by up to 1\.0+\d*e-12"):
        st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=0.0)
    tied = st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=1e-9)
    assert tied["lm_head.weight"] == st.Tied("model.embed_tokens.weight")
    with raises("E46", "raise atol to 1e-12"):
        st.tie(sd, {"lm_head.weight": "model.embed_tokens.weight"}, atol=1e-13)


def test_nans_in_the_same_places_are_equal() -> None:
    a = np.array([[1.0, np.nan], [np.inf, -2.0]])
    assert st.tie({"a": a, "b": a.copy()}, {"b": "a"}, atol=0.0)["b"] == st.Tied("a")
    b = a.copy()
    b[0, 0] = np.nan
    with raises("E46", "'b' and 'a' differ by up to inf", "1 of 4 elements"):
        st.tie({"a": a, "b": b}, {"b": "a"}, atol=1.0)


def test_transformed_view_is_compared() -> None:
    w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    tree = {"w": w, "v": w.T * np.float32(2.0)}
    tied = st.tie(tree, {"v": st.Tied("w", st.T >> st.scale(2.0))}, atol=0.0)
    assert tied["v"] == st.Tied("w", st.T >> st.scale(2.0))
    with raises("E46", "'v' and T >> scale(3.0) of 'w'", "T >> scale(3.0) has no inverse"):
        st.tie(tree, {"v": st.Tied("w", st.T >> st.scale(3.0))}, atol=0.0)


def test_subtree_tie_names_the_differing_leaf() -> None:
    rng = np.random.default_rng(2)
    enc = {"kernel": rng.normal(size=(3, 3)), "bias": rng.normal(size=3)}
    dec = {"kernel": enc["kernel"].copy(), "bias": enc["bias"] + 1e-3}
    with raises("E46", "'dec/bias' and 'enc/bias' differ by up to 0.001"):
        st.tie({"enc": enc, "dec": dec}, {"dec": "enc"}, atol=0.0)
    dec["bias"] = enc["bias"].copy()
    assert st.tie({"enc": enc, "dec": dec}, {"dec": "enc"}, atol=0.0)["dec"] == st.Tied("enc")


def test_non_array_leaves_are_compared_too() -> None:
    tree = {"a": {"w": np.ones(2), "act": "gelu"}, "b": {"w": np.ones(2), "act": "relu"}}
    with raises("E46", "'b/act' holds 'relu', 'a/act' holds 'gelu'"):
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
        with raises("E55", "tie: atol=", "a number >= 0"):
            st.tie(sd, {"b": "a"}, atol=bad)


def test_atol_needs_concrete_values() -> None:
    @jax.jit
    def f(a, b):
        return st.tie({"a": a, "b": b}, {"b": "a"}, atol=0.0)

    with raises("E62", "the copy at 'b'", "traced float32[2]", "outside jit"):
        f(jnp.ones(2), jnp.ones(2))


def test_shape_mismatch_with_check_off_is_still_caught_by_atol() -> None:
    sd = {"a": np.ones((2, 3)), "b": np.ones((3, 2))}
    with raises("E7", "the view is float64[2, 3]", "float64[3, 2]", "leave atol out"):
        st.tie(sd, {"b": "a"}, check=False, atol=0.0)


# ----------------------------------------------------------------------------- load with ties
# Files sharetree did not write: st.load(path, ties=...) -> the canonical tree in one call.
# The two helpers below are the final API's shape; until st.save takes metadata= and st.load
# takes ties= (the io module), they fall back to safetensors and load_foreign.


def save_pt(path, tree) -> None:
    """A file PyTorch loaders accept."""
    st.save(path, tree, metadata={"format": "pt"})


def load_ties(path, ties=None, **kw):
    """A file or directory sharetree did not write, tied in one call."""
    return st.load(path, ties=ties, **kw)


HEAD, EMB = "lm_head.weight", "model.embed_tokens.weight"


def _without_head(seed: int = 0) -> dict[str, np.ndarray]:
    sd = hf_state_dict(seed)
    del sd[HEAD]  # as save_pretrained of a tied model writes it
    return sd


def _assert_materializes_to(tree, reference) -> None:
    m = st.materialize(tree)
    assert set(m) == set(reference)
    for k, v in reference.items():
        assert np.asarray(m[k]).dtype == v.dtype, k
        np.testing.assert_array_equal(np.asarray(m[k]), v, err_msg=k)


def test_absent_head_becomes_a_tie(tmp_path) -> None:
    sd = _without_head()
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with warns("E142", "ties=", "'lm_head.weight' <- 'model.embed_tokens.weight'"):
        tree = load_ties(tmp_path / "model.safetensors", ties={HEAD: EMB})
    assert tree[HEAD] == st.Tied((EMB,)) == st.Tied(EMB)
    _assert_materializes_to(tree, {**sd, HEAD: sd[EMB]})  # independent reference: the table
    assert list(tree) == sorted(tree)


def test_absent_head_with_a_transposed_tie(tmp_path) -> None:
    sd = _without_head()
    save_file(sd, str(tmp_path / "m.safetensors"))
    with pytest.warns(UserWarning):
        tree = load_ties(tmp_path / "m.safetensors", ties={HEAD: st.Tied(EMB, st.T)})
    assert tree[HEAD] == st.Tied(EMB, st.T)
    np.testing.assert_array_equal(np.asarray(st.materialize(tree)[HEAD]), sd[EMB].T)


def test_without_ties_the_warning_points_to_ties(tmp_path) -> None:
    save_file(_without_head(), str(tmp_path / "m.safetensors"))
    with warns("E142", "st.load(path, ties=", "ties=model.all_tied_weights_keys"):
        tree = load_ties(tmp_path / "m.safetensors")
    assert HEAD not in tree and not any(isinstance(v, st.Tied) for v in tree.values())


def test_save_model_metadata_is_honoured_without_asking(tmp_path) -> None:
    # safetensors.torch.save_model keeps one copy and records {dropped: kept}
    sd = hf_state_dict()
    kept = {k: v for k, v in sd.items() if k != EMB}
    save_file(kept, str(tmp_path / "m.safetensors"), metadata={EMB: HEAD, "format": "pt"})
    with warns("E142", "metadata", "'model.embed_tokens.weight' <- 'lm_head.weight'"):
        tree = load_ties(tmp_path / "m.safetensors")
    assert tree[EMB] == st.Tied(HEAD)
    _assert_materializes_to(tree, sd)
    # asked for transformers' direction, the buffer moves to the ref side
    with warns("E142", "ties=", "'lm_head.weight' <- 'model.embed_tokens.weight'"):
        tree = load_ties(tmp_path / "m.safetensors", ties={HEAD: EMB})
    assert tree[HEAD] == st.Tied(EMB) and isinstance(tree[EMB], np.ndarray)
    _assert_materializes_to(tree, sd)


def test_the_format_entry_is_no_tie_even_beside_a_tensor_of_that_name(tmp_path) -> None:
    # {"format": "pt"} names the framework; a tensor named "pt" does not make it a tie
    sd = {"pt": np.zeros(2, np.float32), "w": np.ones(2, np.float32)}
    save_file(sd, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning) as caught:
        tree = load_ties(tmp_path / "m.safetensors")
    assert sorted(tree) == ["pt", "w"] and "restored the ties" not in str(caught[0].message)


def test_only_the_target_stored_moves_the_buffer_through_the_inverse(tmp_path) -> None:
    w = np.random.default_rng(3).normal(size=(4, 3, 2)).astype(np.float32)
    save_file({"dec": w}, str(tmp_path / "m.safetensors"))
    for t in (st.T, st.transpose(1, 2, 0)):
        with pytest.warns(UserWarning):
            tree = load_ties(tmp_path / "m.safetensors", ties={"dec": st.Tied("enc", t)})
        assert tree["dec"] == st.Tied("enc", t) and tree["enc"].dtype == np.float32
        np.testing.assert_array_equal(np.asarray(st.materialize(tree)["dec"]), w)


def test_both_copies_equal_are_tied_the_asked_way(tmp_path) -> None:
    sd = hf_state_dict()
    save_file(sd, str(tmp_path / "m.safetensors"))
    with pytest.warns(UserWarning):
        tree = load_ties(tmp_path / "m.safetensors", ties={HEAD: EMB})
    assert tree[HEAD] == st.Tied(EMB)  # transformers' direction: the embedding is the buffer
    _assert_materializes_to(tree, sd)
    assert st.canonicalize(tree).num_unique == len(sd) - 1


def test_both_copies_differing_is_an_error_naming_both(tmp_path) -> None:
    sd = hf_state_dict()
    sd[HEAD] = sd[HEAD].copy()
    sd[HEAD][1, 1] += 1e-6
    save_file(sd, str(tmp_path / "m.safetensors"))
    with raises("E46", "'lm_head.weight' and 'model.embed_tokens.weight' differ", "1 of 256"):
        load_ties(tmp_path / "m.safetensors", ties={HEAD: EMB})
    with pytest.warns(UserWarning):
        tree = load_ties(tmp_path / "m.safetensors", ties={HEAD: EMB}, atol=1e-5)
    assert tree[HEAD] == st.Tied(EMB)


def test_zero_and_minus_zero_are_equal_copies(tmp_path) -> None:
    a = np.array([0.0, 1.0, np.nan], np.float32)
    save_file({"a": a, "b": np.array([-0.0, 1.0, np.nan], np.float32)}, str(tmp_path / "m"))
    with pytest.warns(UserWarning):
        assert load_ties(tmp_path / "m", ties={"b": "a"})["b"] == st.Tied("a")


def test_names_with_slashes_are_one_key(tmp_path) -> None:
    emb = np.arange(6.0).reshape(3, 2)
    save_file({"enc/emb": emb}, str(tmp_path / "m.safetensors"))
    for ref in ("enc/emb", ("enc/emb",), st.Tied("enc/emb"), st.Tied(("enc/emb",))):
        with pytest.warns(UserWarning):
            tree = load_ties(tmp_path / "m.safetensors", ties={"dec/head": ref})
        assert tree["dec/head"] == st.Tied(("enc/emb",))
        assert set(st.materialize(tree)) == {"enc/emb", "dec/head"}
        np.testing.assert_array_equal(np.asarray(st.materialize(tree)["dec/head"]), emb)


def test_export_writes_buffers_only(tmp_path) -> None:
    sd = _without_head()
    save_file(sd, str(tmp_path / "in.safetensors"))
    with pytest.warns(UserWarning):
        tree = load_ties(tmp_path / "in.safetensors", ties={HEAD: EMB})
    save_pt(tmp_path / "out.safetensors", tree)
    back = load_file(str(tmp_path / "out.safetensors"))
    assert set(back) == set(sd)  # the head is a view: not written
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out.safetensors"), "np") as f:
        assert f.metadata()["format"] == "pt"


def _sharded(tmp_path, sd, groups, index=None):
    d = tmp_path / "ckpt"
    d.mkdir()
    weight_map = {}
    for i, names in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: sd[k] for k in names}, str(d / shard), metadata={"format": "pt"})
        weight_map |= {k: shard for k in names}
    text = index if index is not None else json.dumps({"metadata": {}, "weight_map": weight_map})
    (d / "model.safetensors.index.json").write_text(text)
    return d, weight_map


def test_save_pretrained_directories(tmp_path, monkeypatch) -> None:
    from sharetree._files import container

    sd = _without_head()
    names = sorted(sd)
    single = tmp_path / "single"
    single.mkdir()
    save_file(sd, str(single / "model.safetensors"), metadata={"format": "pt"})
    reads: list[str] = []
    real = container.Reader.read

    def counting(self, name, index=None, view=None):
        reads.append(name)
        return real(self, name, index, view)

    monkeypatch.setattr(container.Reader, "read", counting)
    d, _ = _sharded(tmp_path, sd, [names[:2], names[2:4], names[4:]])
    for where in (single, d):
        reads.clear()
        with warns("E142", "from 3 files" if where == d else "from one file"):
            tree = load_ties(where, ties={HEAD: EMB})
        assert sorted(reads) == names  # every tensor read once
        _assert_materializes_to(tree, {**sd, HEAD: sd[EMB]})


S1, S2 = "'model-00001-of-00002.safetensors'", "'model-00002-of-00002.safetensors'"


@pytest.mark.parametrize(
    "case, facts",
    [
        ("missing shard", [f"names the shard {S2}", "does not exist", "copy the missing shard"]),
        ("listed twice", ["names 'model.norm.weight' twice"]),
        ("in no shard", [f"puts 'extra.weight' in {S1}", "in no shard"]),
        ("not listed", ["does not list it", f"the shard {S2} holds 'model.norm.weight'"]),
        ("stored twice", [f"'model.norm.weight' stored in both {S1} and {S2}"]),
        ("outside", ["puts 'x' in '../evil.safetensors'", "not a file name"]),
        ("not json", ["not valid JSON", "RecursionError"]),
        ("no weight map", ["no 'weight_map' object"]),
    ],
)
def test_bad_shard_index_names_the_file(tmp_path, case, facts) -> None:
    sd = _without_head()
    names = sorted(sd)
    s1 = "model-00001-of-00002.safetensors"
    s2 = "model-00002-of-00002.safetensors"
    wm = {k: s1 if i < 2 else s2 for i, k in enumerate(names)}
    index = None
    if case == "listed twice":
        body = ", ".join(f'"{k}": "{v}"' for k, v in wm.items())
        index = '{"weight_map": {' + body + ', "model.norm.weight": "' + s1 + '"}}'
    elif case == "in no shard":
        index = json.dumps({"weight_map": {**wm, "extra.weight": s1}})
    elif case == "not listed":
        wm.pop("model.norm.weight")
        index = json.dumps({"weight_map": wm})
    elif case == "outside":
        index = json.dumps({"weight_map": {**wm, "x": "../evil.safetensors"}})
    elif case == "not json":
        index = "[" * 100_000
    elif case == "no weight map":
        index = json.dumps({"weight_map": ["a"]})
    groups = [names[:2], names[2:]]
    if case == "stored twice":
        groups = [names[:2] + ["model.norm.weight"], names[2:]]
    d, _ = _sharded(tmp_path, sd, groups, index)
    if case == "missing shard":
        os.unlink(d / s2)
    with raises("E48", f"load: '{d / 'model.safetensors.index.json'}'", *facts):
        load_ties(d)


def test_directory_without_a_checkpoint_or_with_two(tmp_path) -> None:
    with raises("E47", f"'{tmp_path}'", "'model.safetensors'", "'model.safetensors.index.json'"):
        load_ties(tmp_path)
    sd = _without_head()
    d, _ = _sharded(tmp_path, sd, [sorted(sd)])
    save_file(sd, str(d / "model.safetensors"))
    with raises("E47", "both 'model.safetensors' and 'model.safetensors.index.json'"):
        load_ties(d)


def test_bad_ties_are_errors(tmp_path) -> None:
    save_file(_without_head(), str(tmp_path / "m"))
    path = tmp_path / "m"
    with raises("E43", "{target: ref}", "list", "all_tied_weights_keys", cls=st.TieTypeError):
        load_ties(path, ties=[HEAD])  # transformers 4.x's _tied_weights_keys is a list
    with raises("E43", "the tie target ('a', 'b')", "not a tensor name"):
        load_ties(path, ties={("a", "b"): EMB})
    with raises("E43", "target 'x'", "twice"):
        load_ties(path, ties={"x": EMB, ("x",): EMB})
    with raises("E44", "'lm_head.weight' <- 'model.embed_token'", "'model.embed_tokens.weight'"):
        load_ties(path, ties={HEAD: "model.embed_token"})
    with raises("E45", "'model.norm.weight' but not 'new'", "scale(2.0) has no inverse"):
        load_ties(path, ties={"model.norm.weight": st.Tied("new", st.scale(2.0))})
    with raises(
        "E7",
        "the view is float32[8, 32]",
        "holds 'model.layers.0.mlp.up_proj.weight' as float32[16, 8]",
        "load without this tie",
    ):
        load_ties(path, ties={"model.layers.0.mlp.up_proj.weight": st.Tied(EMB, st.T)})
    with raises("E141", "'sharetree.format_version'", "like="):
        load_ties(path, like={})


def test_ties_refer_to_a_moved_buffer_in_any_order(tmp_path) -> None:
    sd = hf_state_dict()
    save_file({HEAD: sd[HEAD]}, str(tmp_path / "m"))
    # the first tie's ref exists only once the second tie has moved the head's buffer to EMB
    with pytest.warns(UserWarning):
        tree = load_ties(tmp_path / "m", ties={"proj.weight": st.Tied(EMB, st.T), HEAD: EMB})
    assert tree == {EMB: tree[EMB], HEAD: st.Tied(EMB), "proj.weight": st.Tied(EMB, st.T)}
    np.testing.assert_array_equal(tree[EMB], sd[HEAD])


def test_file_tie_chains_onto_an_asked_tie(tmp_path) -> None:
    # save_model dropped EMB (= HEAD); ties= says HEAD is the transpose of a third tensor
    w = np.random.default_rng(4).normal(size=(D, V)).astype(np.float32)
    save_file({HEAD: np.ascontiguousarray(w.T), "w": w}, str(tmp_path / "m"), metadata={EMB: HEAD})
    with warns("E142", "metadata", "'model.embed_tokens.weight' <- 'lm_head.weight'"):
        tree = load_ties(tmp_path / "m", ties={HEAD: st.Tied("w", st.T)})
    assert tree[HEAD] == st.Tied("w", st.T) and tree[EMB] == st.Tied(HEAD)
    assert st.canonicalize(tree).num_unique == 1  # nothing stored twice
    _assert_materializes_to(tree, {"w": w, HEAD: w.T, EMB: w.T})


def test_a_foreign_tie_through_a_transform_without_inverse_suggests_only_what_is_possible(
    tmp_path,
):
    import warnings

    fused = np.random.RandomState(0).randn(4, 6).astype(np.float32)
    both, only = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    save_file({"fused": fused, "q": fused[:, :2] + 1}, both)
    save_file({"q": fused[:, :2].copy()}, only)
    ties = {"q": st.Tied("fused", st.slice(0, 2, axis=1))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for f in (both, only):
            with pytest.raises(st.TieError) as e:
                st.load(f, ties=ties)
            fix = str(e.value)[str(e.value).index("Fix:") :]
            assert "<inverse>" not in fix and "with the inverse of" not in fix
            assert "tie the other way round" not in fix
        assert "has no inverse" in str(e.value) and "load without this tie" in fix


# --- ties the file records (save_model's {removed: kept}): honoured or refused, never ignored --


def _recorded(tmp_path, sd, metadata):
    path = tmp_path / "m.safetensors"
    save_file(sd, str(path), metadata={"format": "pt", **metadata})
    return path


def test_a_recorded_tie_whose_kept_tensor_is_missing_is_refused(tmp_path) -> None:
    sd = {k: v for k, v in hf_state_dict().items() if k not in (EMB, HEAD)}
    path = _recorded(tmp_path, sd, {HEAD: EMB})
    with raises("E260", f"{HEAD!r} <- {EMB!r}", "lacks", EMB):
        st.load(str(path))


def test_a_recorded_tie_whose_removed_name_is_stored_too_is_refused(tmp_path) -> None:
    sd = hf_state_dict()
    sd[HEAD] = sd[HEAD][:, :4].copy()  # another shape under the removed name
    path = _recorded(tmp_path, sd, {HEAD: EMB})
    with raises("E260", repr(HEAD), f"float32[{V}, 4]", f"float32[{V}, {D}]"):
        st.load(str(path))


def test_recorded_ties_in_a_cycle_are_refused_and_a_chain_is_followed(tmp_path) -> None:
    sd = {k: v for k, v in hf_state_dict().items() if k not in (EMB, HEAD)}
    cycle = {"model.a.weight": "model.b.weight", "model.b.weight": "model.a.weight"}
    with raises("E260", "cycle", "'model.a.weight' <- 'model.b.weight' <- 'model.a.weight'"):
        st.load(str(_recorded(tmp_path, sd, cycle)))
    full = hf_state_dict()
    stored = {k: v for k, v in full.items() if k != HEAD}
    chain = {HEAD: "model.copy.weight", "model.copy.weight": EMB}
    with pytest.warns(UserWarning):
        tree = st.load(str(_recorded(tmp_path, stored, chain)))
    assert tree[HEAD] == st.Tied(EMB) and tree["model.copy.weight"] == st.Tied(EMB)
    np.testing.assert_array_equal(st.materialize(tree)[HEAD], full[EMB])


def test_plain_metadata_beside_tensor_names_is_no_tie(tmp_path) -> None:
    sd = hf_state_dict()
    plain = {"modelspec.title": "a tied model", "author": "me", "model.note": "two words"}
    with pytest.warns(UserWarning) as caught:
        tree = st.load(str(_recorded(tmp_path, sd, plain)))
    assert sorted(tree) == sorted(sd) and "restored the ties" not in str(caught[0].message)


def test_ties_that_contradict_the_files_recorded_tie_are_refused_whatever_atol(tmp_path) -> None:
    sd = hf_state_dict()
    path = _recorded(tmp_path, {k: v for k, v in sd.items() if k != HEAD}, {HEAD: EMB})
    other = [k for k in sd if k not in (HEAD, EMB) and sd[k].shape == sd[EMB].shape]
    contradictions = [{HEAD: st.Tied(EMB, st.scale(2.0))}, {EMB: st.Tied(HEAD, st.scale(2.0))}]
    contradictions += [{HEAD: k} for k in other[:1]]
    for ties in contradictions:
        for atol in (None, 1e9):
            with raises("E261", f"{HEAD!r} <- {EMB!r}"):
                st.load(str(path), ties=ties, atol=atol)
    with pytest.warns(UserWarning):  # the file's tie, said again either way: accepted
        assert st.load(str(path), ties={HEAD: EMB})[HEAD] == st.Tied(EMB)
        assert st.load(str(path), ties={EMB: HEAD})[EMB] == st.Tied(HEAD)


class _CountingTensors(dict):
    """A file's tensors by name that counts how often a name is looked up in it."""

    lookups = 0

    def __contains__(self, name):
        type(self).lookups += 1
        return super().__contains__(name)


@pytest.mark.parametrize("n", [300, 3000])
def test_a_recorded_chain_is_followed_in_lookups_linear_in_its_entries(tmp_path, n) -> None:
    from sharetree._files.foreign import metadata_ties

    names = [f"model.copy{i}.weight" for i in range(n)]
    chain = {names[i]: names[i + 1] for i in range(n - 1)} | {names[-1]: EMB}
    _CountingTensors.lookups = 0
    tensors = _CountingTensors({EMB: np.zeros((V, D), np.float32)})
    got = metadata_ties(chain, tensors)
    assert got == dict.fromkeys(names, EMB)  # every name of the chain ends at the one stored
    assert _CountingTensors.lookups <= 10 * n  # a quadratic walk makes ~n * n / 2 of them
    if n == 3000:  # the whole load of such a file: each name a view of the one tensor
        path = _recorded(tmp_path, {EMB: hf_state_dict()[EMB]}, chain)
        with pytest.warns(UserWarning):
            tree = st.load(str(path))
        assert tree[names[0]] == tree[names[-1]] == st.Tied(EMB) and len(tree) == n + 1


def test_metadata_that_names_no_tensor_is_not_a_tie(tmp_path) -> None:
    sd = hf_state_dict()
    notes = {"notes": EMB, "source": "https://huggingface.co", "model.x": "see " + EMB}
    with pytest.warns(UserWarning):
        tree = st.load(str(_recorded(tmp_path, sd, notes)))
    assert sorted(tree) == sorted(sd)  # no parameter 'notes', 'source' or 'model.x'
