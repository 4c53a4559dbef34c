"""``python -m sharetree inspect`` of checkpoints other tools wrote: the ties they show.

Each file is written here from a state dict whose ties are known by construction (a
tensor stored twice, a transposed copy, a part of a fused tensor, a head a config ties);
what ``suggest_ties`` finds is checked against that, and loading with the ``ties=`` it
prints gives back every tensor of the state dict.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _raises import raises
from safetensors.numpy import save_file

import sharetree as st
from sharetree.__main__ import describe
from sharetree._files import container
from sharetree._files.container import Reader
from sharetree._files.suggest import suggest_ties

V, D = 12, 4
RNG = np.random.default_rng(0)


def _state_dict() -> dict[str, np.ndarray]:
    emb = RNG.normal(size=(V, D)).astype(np.float32)
    qkv = RNG.normal(size=(3 * D, D)).astype(np.float32)
    return {
        "model.embed_tokens.weight": emb,
        "model.qkv.weight": qkv,
        "model.q.weight": qkv[D : 2 * D].copy(),  # the second part of the fused tensor
        "model.proj.weight": emb.T.copy(),  # the embedding, transposed
        "lm_head.weight": emb.copy(),  # the embedding, stored twice
        "model.norm.weight": np.ones(D, np.float32),
        "model.other_norm.weight": np.ones(D, np.float32),  # equal, but constant: no tie
        "model.mlp.weight": RNG.normal(size=(D, 7)).astype(np.float32),  # no other (D, 7)
    }


def _ties(found):
    return {s.target: (s.ref, s.transform) for s in found}


def test_equal_transposed_and_fused_copies_are_found_and_load_back(tmp_path):
    sd = _state_dict()
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    found = suggest_ties([Reader(path)], path)
    emb = "model.embed_tokens.weight"
    assert _ties(found) == {
        "lm_head.weight": (emb, st.identity),
        "model.proj.weight": (emb, st.T),
        "model.q.weight": ("model.qkv.weight", st.slice(D, 2 * D, axis=0)),
    }
    text = describe(path)
    line = next(x for x in text.splitlines() if x.startswith("load it tied: "))
    ties = eval(line.split("ties=", 1)[1][:-1], {"st": st})  # the mapping it prints
    with pytest.warns(UserWarning):
        tree = st.load(path, ties=ties)
    assert sum(isinstance(v, st.Tied) for v in tree.values()) == 3
    for name, value in st.materialize(tree).items():
        np.testing.assert_array_equal(value, sd[name])


def test_a_head_the_config_ties_and_the_metadata_records(tmp_path):
    sd = {k: v for k, v in _state_dict().items() if k != "lm_head.weight"}
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    found = suggest_ties([Reader(str(tmp_path / "model.safetensors"))], str(tmp_path))
    assert _ties(found)["lm_head.weight"] == ("model.embed_tokens.weight", st.identity)
    text = describe(str(tmp_path))  # the directory
    assert "'lm_head.weight': 'model.embed_tokens.weight'" in text
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert "lm_head.weight" not in _ties(
        suggest_ties([Reader(str(tmp_path / "model.safetensors"))], str(tmp_path))
    )
    # save_model's record: shown, and restored by load unasked
    recorded = {"format": "pt", "lm_head.weight": "model.embed_tokens.weight"}
    save_file(sd, str(tmp_path / "r.safetensors"), metadata=recorded)
    (rec,) = [
        s
        for s in suggest_ties(
            [Reader(str(tmp_path / "r.safetensors"))], str(tmp_path / "r.safetensors")
        )
        if s.recorded
    ]
    assert (rec.target, rec.ref) == ("lm_head.weight", "model.embed_tokens.weight")


def test_only_tensors_whose_shapes_allow_a_tie_are_read(tmp_path, monkeypatch):
    sd = _state_dict()
    sd["model.big.weight"] = RNG.normal(size=(64, 33)).astype(np.float32)  # no shape like it
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    read: list[str] = []
    real = container.Reader.read

    def spy(self, name, *a, **k):
        read.append(name)
        return real(self, name, *a, **k)

    monkeypatch.setattr(container.Reader, "read", spy)
    suggest_ties([Reader(path)], path)
    assert "model.big.weight" not in read and "model.mlp.weight" not in read
    assert "lm_head.weight" in read


def test_inspect_refuses_a_recorded_tie_it_cannot_honour(tmp_path):
    path = str(tmp_path / "m.safetensors")
    sd = {"model.norm.weight": np.arange(3.0, dtype=np.float32)}
    save_file(sd, path, metadata={"lm_head.weight": "model.embed.weight"})
    with raises("E260", "'lm_head.weight' <- 'model.embed.weight'"):
        describe(path)


def _packed_layer(rng, scale: float) -> dict[str, np.ndarray]:
    """An MLX-style quantized layer: packed words, scales, biases (the words shared below)."""
    return {
        "q": rng.integers(0, 2**32, size=(V, 4), dtype=np.uint32),  # 4 bits, a group of 32
        "scales": np.full((V, 1), scale, np.float32) + rng.random((V, 1), dtype=np.float32),
        "biases": rng.random((V, 1), dtype=np.float32),
    }


def test_a_quantized_head_with_the_embedding_s_words_but_other_scales_is_no_tie(tmp_path):
    rng = np.random.default_rng(1)
    emb = _packed_layer(rng, 1.0)
    head = {"q": emb["q"].copy(), "scales": 2 * emb["scales"], "biases": emb["biases"].copy()}
    parts = {"weight": emb["q"], "scales": emb["scales"], "biases": emb["biases"]}
    sd = {f"model.embed_tokens.{k}": v for k, v in parts.items()}
    sd |= {"lm_head.weight": head["q"], "lm_head.scales": head["scales"],
           "lm_head.biases": head["biases"]}  # fmt: skip
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    # by hand: the float head is 2x the embedding's scales times the same words
    assert not np.array_equal(head["scales"], emb["scales"])
    found = _ties(suggest_ties([Reader(path)], path))
    assert "lm_head.weight" not in found  # the words alone are not the value
    assert {frozenset((t, r)) for t, (r, _) in found.items()} == {
        frozenset(("lm_head.biases", "model.embed_tokens.biases"))  # equal as stored: a tie
    }
    sd["lm_head.scales"] = emb["scales"].copy()  # now all three agree: the same layer
    save_file(sd, path)
    found = _ties(suggest_ties([Reader(path)], path))
    assert found["lm_head.weight"] == ("model.embed_tokens.weight", st.identity)


def test_inspect_of_an_untied_mlx_directory_suggests_only_ties_that_load(tmp_path):
    rng = np.random.default_rng(2)
    emb, head = _packed_layer(rng, 1.0), _packed_layer(rng, 1.0)
    head["biases"] = emb["biases"].copy()  # stored twice: equal tensors, as another tool may
    sd = {f"model.embed_tokens.{n}": emb[k] for k, n in
          (("q", "weight"), ("scales", "scales"), ("biases", "biases"))}  # fmt: skip
    sd |= {f"lm_head.{n}": head[k] for k, n in
           (("q", "weight"), ("scales", "scales"), ("biases", "biases"))}  # fmt: skip
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "mlx"})
    config = {"model_type": "llama", "tie_word_embeddings": False,
              "quantization": {"group_size": 32, "bits": 4}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    text = describe(str(tmp_path))
    lines = [x for x in text.splitlines() if x.startswith("load it tied: ")]
    for line in lines:  # whatever it suggests loads
        st.load(tmp_path, ties=eval(line.split("ties=", 1)[1][:-1], {"st": st}))
    with pytest.warns(UserWarning):  # E142: MLX's layout
        tree = st.load(tmp_path)
    assert "lm_head" in tree and "model.embed_tokens" in tree  # untied: both layers


@pytest.mark.parametrize("bad", ["not json", "a directory"])
def test_a_config_load_refuses_is_refused_by_inspect_alike(tmp_path, bad):
    save_file(_state_dict(), str(tmp_path / "model.safetensors"))
    if bad == "not json":
        (tmp_path / "config.json").write_text("{'tie_word_embeddings': true")
    else:
        (tmp_path / "config.json").mkdir()
    fact = "not valid JSON" if bad == "not json" else "not a regular file"
    with raises("E210", "config.json", fact):
        st.load(tmp_path)
    with raises("E210", "config.json", fact):
        describe(str(tmp_path))


@pytest.mark.parametrize(
    ("config", "tied"),
    [
        ({"model_type": "llava", "text_config": {"tie_word_embeddings": True}}, True),
        ({"model_type": "llava", "text_config": {"tie_word_embeddings": False}}, False),
        ({"model_type": "llama", "tie_word_embeddings": False}, False),
        ({"model_type": "llama"}, True),  # transformers' default
    ],
)
def test_the_head_rule_reads_text_config_as_mlx_loads_it(tmp_path, config, tied):
    sd = _state_dict()
    del sd["lm_head.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = _ties(suggest_ties([Reader(str(tmp_path / "model.safetensors"))], str(tmp_path)))
    assert ("lm_head.weight" in found) is tied
