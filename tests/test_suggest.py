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
