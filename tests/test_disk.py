"""sharetree._files.disk: a save of several files commits them as one set, or not at all.

A sharded directory (``max_shard_size=``) and ``save_mlx`` write several files; a rename
that fails part-way puts the renamed files back, so the previous checkpoint stays whole
and loadable (checked by loading it with ``safetensors`` itself, and by ``st.load``);
where even that fails, E270 names the files that changed.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
from _raises import raises
from safetensors.numpy import load_file

import sharetree as st
from sharetree._files import disk


def _tree(scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer{i}.weight": scale * rng.standard_normal((8, 8)).astype(np.float32)
            for i in range(4)}  # fmt: skip


def _files(folder) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


def _fail_on_rename(monkeypatch, nth: int, also_put_back: bool = False) -> None:
    """``os.replace`` in ``disk`` fails at its ``nth`` call (and, if asked, every later one)."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == nth or (also_put_back and len(calls) > nth):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(disk.os, "replace", replace)


@pytest.mark.parametrize("nth", [1, 2, 4, 5])
def test_a_sharded_save_that_fails_part_way_leaves_the_previous_directory_whole(
    tmp_path, monkeypatch, nth
):
    out = tmp_path / "out"
    st.save(out, _tree(1.0), max_shard_size=300, metadata={"format": "pt"})
    before = _files(out)
    assert len(before) == 5  # four shards and the index
    _fail_on_rename(monkeypatch, nth)
    with pytest.raises(OSError, match="Input/output error"):
        st.save(out, _tree(2.0), max_shard_size=300, metadata={"format": "pt"})
    monkeypatch.undo()
    assert _files(out) == before  # byte for byte, no temporary or backup file left
    with pytest.warns(UserWarning):  # E142: a flat dict, as Hugging Face wrote it
        loaded = st.load(out)
    for name, w in _tree(1.0).items():
        np.testing.assert_array_equal(loaded[name], w)


def test_a_save_mlx_that_fails_at_its_config_leaves_the_previous_checkpoint_loadable(
    tmp_path, monkeypatch
):
    w = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    emb = "model.embed_tokens"
    triple = {k: (emb, k) for k in ("q", "scales", "biases")}
    tied = {emb: st.quantize(w, 4, 32), f"{emb}.weight": st.Tied(triple, st.dequantize(4, 32)),
            "lm_head.weight": st.Tied(triple, st.dequantize(4, 32))}  # fmt: skip
    untied = {emb: st.quantize(w, 8, 32), f"{emb}.weight": st.Tied(triple, st.dequantize(8, 32))}
    st.save_mlx(tmp_path, tied)
    before = _files(tmp_path)
    _fail_on_rename(monkeypatch, 3)  # weights, index, then the config fails
    with pytest.raises(OSError, match="Input/output error"):
        st.save_mlx(tmp_path, untied)
    monkeypatch.undo()
    assert _files(tmp_path) == before
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    assert sorted(load_file(str(tmp_path / "model.safetensors"))) == sorted(
        f"{emb}.{k}" for k in ("weight", "scales", "biases")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loaded as its config declares: nothing guessed
        back = st.load(tmp_path)
    assert back["lm_head.weight"] == st.Tied(f"{emb}.weight")  # the old tied head, as it was
    np.testing.assert_array_equal(back[emb]["q"], tied[emb]["q"])


def test_when_the_previous_files_cannot_be_put_back_the_error_names_what_changed(
    tmp_path, monkeypatch
):
    out = tmp_path / "out"
    st.save(out, _tree(1.0), max_shard_size=300, metadata={"format": "pt"})
    _fail_on_rename(monkeypatch, 3, also_put_back=True)  # two shards in, then nothing moves
    with raises("E270", "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                "Input/output error"):  # fmt: skip
        st.save(out, _tree(2.0), max_shard_size=300, metadata={"format": "pt"})
