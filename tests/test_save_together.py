"""``st.save`` by several processes: one file, each process writing its share (issue 35).

The processes are simulated here by threads of this process (``_processes.ThreadGroup``:
a shared dict for the coordination service's key-value store), with every buffer
treated as spread over processes (``tree_json.addressable`` patched); the plan gives host
buffers to the process with the fewest bytes so far, so both simulated processes write.
``tests/test_multihost.py`` runs the real thing: 2 processes x 4 devices over gloo.
The file is checked against ``safetensors``' own reader and writer, never against ours.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from _processes import run_processes
from _raises import message
from safetensors.numpy import load_file, save_file

import sharetree as st
from sharetree._files import plan, processes, rounds, tree_json
from sharetree._files.container import Slot, byte_runs, header_bytes


@pytest.fixture
def spread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_json, "addressable", lambda x: False)


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "embed": jnp.asarray(rng.standard_normal((6, 4), np.float32)),
        "kernel": rng.standard_normal((4, 5)).astype(np.float64),
        "bias": np.arange(5, dtype=np.int16),
        "scale": jnp.ones((), jnp.bfloat16),
        "head": st.Tied("embed", st.T),
        "first": st.Tied("embed", st.slice(0, 2)),
    }


def _plain(tree: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.items() if not isinstance(v, st.Tied)}


def _temporaries(directory: Any) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def test_byte_runs_place_every_part_where_numpy_puts_it() -> None:
    rng = np.random.default_rng(1)
    for shape in [(), (7,), (6, 4), (4, 6, 3), (2, 3, 4, 5), (5, 0)]:
        a = rng.integers(0, 255, shape, dtype=np.uint8).astype(np.int32)
        out = bytearray(a.nbytes)
        cuts = [sorted({0, n, *rng.integers(0, n + 1, 2).tolist()}) for n in shape]
        grid = np.array(np.meshgrid(*[np.arange(len(c) - 1) for c in cuts], indexing="ij"))
        for cell in grid.reshape(len(shape), -1).T if shape else [()]:
            bounds = tuple((cuts[a_][i], cuts[a_][i + 1]) for a_, i in enumerate(cell))
            part = a[tuple(slice(*b) for b in bounds)]
            runs = byte_runs(shape, a.itemsize, bounds)
            data = part.tobytes()
            for j, offset in enumerate(runs.offsets.tolist()):
                out[offset : offset + runs.length] = data[j * runs.length : (j + 1) * runs.length]
        assert bytes(out) == a.tobytes(), shape


def test_the_header_is_byte_for_byte_safetensors_own(tmp_path) -> None:
    tensors = {
        "b": np.arange(3, dtype=np.uint8),
        "a": np.ones((2, 3), np.float32),
        "c": np.ones((2, 2), np.float64),
        "z": np.zeros((0, 3), np.int16),
        "é": np.ones(1, np.int64),
    }
    codes = {"uint8": "U8", "float32": "F32", "float64": "F64", "int16": "I16", "int64": "I64"}
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"k": "v ü"})
    slots = [Slot(k, codes[v.dtype.name], v.shape, v.nbytes) for k, v in tensors.items()]
    layout = header_bytes(slots, {"k": "v ü"})
    raw = path.read_bytes()
    assert raw[: len(layout.header)] == layout.header and layout.size == len(raw)


def test_two_processes_write_one_file_every_reader_reads(tmp_path, spread) -> None:
    path = tmp_path / "model.safetensors"
    tree = _tree()
    written: list[tuple[int, int]] = []
    real = rounds.write_runs

    def counted(fd, start, part, runs):  # which simulated process wrote how many bytes
        n = real(fd, start, part, runs)
        written.append((threading.current_thread().name, n))
        return n

    rounds.write_runs = counted
    try:
        out = run_processes(2, lambda i: st.save(path, tree, metadata={"format": "pt"}))
    finally:
        rounds.write_runs = real
    assert out == [None, None], out
    assert len({name for name, _ in written}) == 2  # both processes wrote a share
    file = load_file(str(path))  # safetensors' own reader
    want = _plain(tree)
    assert sorted(file) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(file[k], v, err_msg=k)
    back = st.load(path)
    assert back["head"] == st.Tied("embed", st.T) and back["first"] == tree["first"]
    np.testing.assert_array_equal(np.asarray(st.materialize(back)["head"]), want["embed"].T)
    assert _temporaries(tmp_path) == []


def test_a_refused_buffer_on_one_process_is_the_same_error_everywhere(tmp_path, spread) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"old": np.ones(3, np.float32)}, str(path))
    before = path.read_bytes()
    mode = stat.S_IMODE(os.stat(path).st_mode)

    def save(i: int) -> None:
        tree = _tree()
        if i == 1:
            tree["embed"] = jnp.ones((6, 4))
            tree["embed"].delete()  # a bad buffer on process 1 only
        st.save(path, tree)

    out = run_processes(2, save)
    assert all(isinstance(e, st.TieError) and e.code == "E57" for e in out), out
    assert str(out[0]) == str(out[1]) and "'embed'" in str(out[0])
    assert "process 1 of 2" in message(out[0])
    assert path.read_bytes() == before and stat.S_IMODE(os.stat(path).st_mode) == mode
    assert _temporaries(tmp_path) == []


def test_two_processes_failing_differently_raise_the_first_ones_error(tmp_path, spread) -> None:
    path = tmp_path / "model.safetensors"

    def save(i: int) -> None:
        tree = _tree()
        if i == 0:
            tree["embed"] = jnp.ones((6, 4))
            tree["embed"].delete()  # E57 on process 0
        else:
            tree["bias"] = np.ma.masked_array(np.arange(5), mask=[0, 1, 0, 0, 0])  # E58 on 1
        st.save(path, tree)

    out = run_processes(2, save)
    assert [getattr(e, "code", e) for e in out] == ["E57", "E57"], out
    assert str(out[0]) == str(out[1]) and "process 0 of 2" in message(out[1])
    assert not path.exists() and _temporaries(tmp_path) == []


def test_a_disk_that_fills_while_writing_keeps_the_old_file(tmp_path, spread, monkeypatch) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"old": np.ones(3, np.float32)}, str(path))
    os.chmod(path, 0o640)
    before = path.read_bytes()
    real = rounds.write_runs

    def full(fd, start, part, runs):  # process 1 writes half a part, then the disk is full
        if processes.current_group("").me == 1:
            os.pwrite(fd, b"\xff" * 3, start)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, start, part, runs)

    monkeypatch.setattr(rounds, "write_runs", full)
    out = run_processes(2, lambda i: st.save(path, _tree()))
    assert all(isinstance(e, st.TieError) and e.code == "E223" for e in out), out
    assert str(out[0]) == str(out[1]) and "No space left on device" in str(out[0])
    assert path.read_bytes() == before
    assert _temporaries(tmp_path) == []
    # a stale temporary of a save killed earlier: gone after the next successful save
    (tmp_path / ".model.safetensors.0123456789ab.tmp").write_bytes(b"half")
    (tmp_path / ".model.safetensors.0123456789ab.p1").write_bytes(b"")
    monkeypatch.setattr(rounds, "write_runs", real)
    assert run_processes(2, lambda i: st.save(path, _tree())) == [None, None]
    assert _temporaries(tmp_path) == []
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # the replaced file's mode
    np.testing.assert_array_equal(load_file(str(path))["kernel"], _tree()["kernel"])


def test_different_metadata_or_trees_are_named_before_any_write(tmp_path, spread) -> None:
    path = tmp_path / "model.safetensors"

    def save(i: int) -> None:
        st.save(path, _tree(), metadata={"step": str(i)})

    out = run_processes(2, save)
    assert all(isinstance(e, st.TieError) and e.code == "E220" for e in out), out
    assert "metadata=" in str(out[0]) and "process 1" in str(out[0])
    assert not path.exists() and _temporaries(tmp_path) == []

    def other_shape(i: int) -> None:
        tree = _tree()
        if i == 1:
            tree["kernel"] = np.zeros((4, 6))
            tree["bias"] = np.zeros(6, np.int16)
        st.save(path, tree)

    out = run_processes(2, other_shape)
    assert all(isinstance(e, st.TieError) and e.code == "E220" for e in out), out
    assert "'bias'" in str(out[0]) and "'kernel'" in str(out[0])
    assert not path.exists()


def test_a_path_some_process_does_not_see_is_refused(tmp_path, spread, monkeypatch) -> None:
    path = tmp_path / "model.safetensors"
    elsewhere = tmp_path / "local_disk_of_process_1"
    elsewhere.mkdir()
    real = rounds._write_marker

    def local(directory, base, token, me):  # process 1 writes to a disk the others do not see
        return real(str(elsewhere) if me == 1 else directory, base, token, me)

    monkeypatch.setattr(rounds, "_write_marker", local)
    out = run_processes(2, lambda i: st.save(path, _tree()))
    assert all(isinstance(e, st.TieError) and e.code == "E221" for e in out), out
    assert "[1]" in str(out[0]) and str(tmp_path) in str(out[0])
    assert not path.exists()
    assert _temporaries(tmp_path) == [] and _temporaries(elsewhere) == []


def test_a_process_that_never_comes_is_a_timeout_not_a_hang(tmp_path, spread) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"old": np.ones(3, np.float32)}, str(path))
    before = path.read_bytes()
    out = run_processes(2, lambda i: st.save(path, _tree(), timeout=0.5) if i == 0 else None)
    assert isinstance(out[0], st.TieError) and out[0].code == "E224", out
    assert "process 1 of 2" in str(out[0]) and "0.5 s" in str(out[0])
    assert path.read_bytes() == before


def test_parts_must_tile_the_array() -> None:
    with pytest.raises(st.TieError) as info:
        plan.plan_parts("save: 'w'", (4, 4), {((0, 2), (0, 4)): [0]}, [0, 0])
    assert info.value.code == "E222" and "2:4 of axis 0" in str(info.value)
    load = [0, 0, 0]
    owners = plan.plan_parts(
        "w", (4, 2), {((0, 2), (0, 2)): [0, 1, 2], ((2, 4), (0, 2)): [0, 1, 2]}, load
    )
    assert [o for _, o in owners] == [0, 1] and load == [4, 4, 0]  # one writer per replica set


def _hf_tree() -> dict[str, Any]:
    rng = np.random.default_rng(2)
    return {
        "model.embed_tokens.weight": jnp.asarray(rng.standard_normal((64, 8), np.float32)),
        "model.layers.0.mlp.weight": rng.standard_normal((8, 16)).astype(np.float32),
        "model.layers.1.mlp.weight": jnp.asarray(rng.standard_normal((8, 16), np.float32)),
        "model.norm.weight": np.ones(8, np.float16),
        "lm_head.weight": st.Tied("model.embed_tokens.weight"),  # dropped, as save_pretrained
    }


def _check_sharded_directory(out: Any, tree: dict[str, Any], limit: int) -> None:
    import json as json_

    index = json_.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    n = len(files)
    assert n > 1 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    want = _plain(tree)
    assert sorted(index["weight_map"]) == sorted(want)  # each buffer once, the head dropped
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    seen: dict[str, np.ndarray] = {}
    for name in files:
        part = load_file(str(out / name))  # safetensors' own reader, file by file
        assert sum(v.nbytes for v in part.values()) <= limit or len(part) == 1
        assert all(index["weight_map"][k] == name for k in part)
        seen.update(part)
    for k, v in want.items():
        np.testing.assert_array_equal(seen[k], v, err_msg=k)
    with pytest.warns(UserWarning, match="E142"):
        back = st.load(out)  # read as Hugging Face's layout, the tie from the metadata
    assert back["lm_head.weight"] == st.Tied("model.embed_tokens.weight")


def test_sharded_layout_on_one_process(tmp_path) -> None:
    out, tree = tmp_path / "export", _hf_tree()
    st.save(out, tree, max_shard_size=600, metadata={"format": "pt"})
    _check_sharded_directory(out, tree, 600)
    assert _temporaries(out) == []
    # a smaller save in place: the stale shards and index go, other files stay
    (out / "config.json").write_text("{}")
    small = {"model.norm.weight": np.ones(8, np.float16)}
    st.save(out, small, max_shard_size="1MB", metadata={"format": "pt"})
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(load_file(str(out / "model.safetensors"))["model.norm.weight"], 1)


def test_sharded_layout_by_two_processes(tmp_path, spread) -> None:
    out, tree = tmp_path / "export", _hf_tree()
    res = run_processes(2, lambda i: st.save(out, tree, max_shard_size="600B"))
    assert res == [None, None], res
    _check_sharded_directory(out, tree, 600)
    assert _temporaries(out) == []


def test_sharded_layout_refuses_what_a_state_dict_cannot_record(tmp_path) -> None:
    tree = {"embed": np.ones((4, 2), np.float32), "head": st.Tied("embed", st.T)}
    with pytest.raises(st.TieError) as info:
        st.save(tmp_path / "out", tree, max_shard_size="1GB")
    assert info.value.code == "E227" and "'head'" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_sharded_layout_loads_in_transformers(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    tree = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    tree["lm_head.weight"] = st.Tied("model.embed_tokens.weight")
    out = tmp_path / "export"
    st.save(out, tree, max_shard_size="20KB", metadata={"format": "pt"})
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    model.config.save_pretrained(out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    head, emb = back.get_output_embeddings().weight, back.get_input_embeddings().weight
    assert head.data_ptr() == emb.data_ptr()  # the dropped head is tied again
    tokens = torch.arange(12).reshape(2, 6) * 7 % 100
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, back(tokens).logits)
