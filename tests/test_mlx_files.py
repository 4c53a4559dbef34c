"""MLX's quantized checkpoints both ways: ``st.load(directory)`` and ``st.save_mlx``.

The references are independent of the package: a directory written here by hand from the
format's definition (the values packed bit by bit into uint32 words with NumPy, lowest bits
first, ``w = scale * q + bias`` per group, ``config.json`` as ``mlx_lm``'s ``save_config``
writes it, ``model.safetensors`` beside the index ``mlx_lm``'s ``save_model`` always writes),
and, where ``mlx`` imports, MLX itself: ``mx.quantize`` / ``mx.save_safetensors`` write the
directory, ``mx.dequantize`` and ``mx.quantized_matmul(..., transpose=True)`` (what
``QuantizedEmbedding.as_linear`` computes) give the table and the logits, and an
``mlx.nn`` model quantized by the written config reads the exported file back with
``load_weights(strict=True)``.
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _raises import raises
from safetensors.numpy import load_file, save_file
from test_import_checkpoints import warns

import sharetree as st

EMB, LIN = "model.embed_tokens", "model.layers.0.mlp.up_proj"
VOCAB, HIDDEN, OUT = 32, 128, 16


# --- the format, by hand --------------------------------------------------------------------


def pack_by_hand(values: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words of ``values`` (< 2**bits), each row one bit stream, lowest bits first."""
    v = values.astype(np.uint64)
    stream = (v[..., :, None] >> np.arange(bits, dtype=np.uint64)) & 1  # value i: bits i*b..
    stream = stream.reshape(
        *v.shape[:-1], -1, 32
    )  # bit k of the stream: bit k % 32 of word k // 32
    return (stream << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def dequantize_by_hand(values: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """``scale * value + bias`` for each group of the last axis, in float64."""
    g = values.shape[-1] // scales.shape[-1]
    s, b = (np.repeat(x.astype(np.float64), g, axis=-1) for x in (scales, biases))
    return s * values + b


def layer_by_hand(rng: np.random.Generator, rows: int, cols: int, bits: int, group: int, dtype):
    """A quantized layer: its values, and its tensors ``weight``, ``scales``, ``biases``."""
    values = rng.integers(0, 2**bits, (rows, cols)).astype(np.uint32)
    scales = rng.uniform(0.01, 0.1, (rows, cols // group)).astype(dtype)
    biases = rng.uniform(-1, 1, (rows, cols // group)).astype(dtype)
    return values, {"weight": pack_by_hand(values, bits), "scales": scales, "biases": biases}


QUANTIZATION = {
    "group_size": 64,
    "bits": 4,
    "mode": "affine",
    LIN: {"group_size": 32, "bits": 3, "mode": "affine"},  # a layer of its own (3 bits: a stream)
}


def write_by_hand(folder, *, config=None, index=True, tensors=None) -> dict[str, np.ndarray]:
    """An ``mlx_lm`` directory: a 4-bit tied embedding, a 3-bit linear with a bias, a norm."""
    rng = np.random.default_rng(0)
    emb_values, emb = layer_by_hand(rng, VOCAB, HIDDEN, 4, 64, np.float32)
    lin_values, lin = layer_by_hand(rng, OUT, HIDDEN, 3, 32, ml_dtypes.bfloat16)
    if tensors is None:
        tensors = {
            **{f"{EMB}.{k}": v for k, v in emb.items()},
            **{f"{LIN}.{k}": v for k, v in lin.items()},
            f"{LIN}.bias": rng.standard_normal(OUT).astype(np.float32),
            "model.norm.weight": rng.standard_normal(HIDDEN).astype(np.float32),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    if index:
        weight_map = dict.fromkeys(sorted(tensors), "model.safetensors")
        meta = {"total_size": sum(a.nbytes for a in tensors.values())}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": meta, "weight_map": weight_map}, indent=4)
        )
    if config is None:
        config = {
            "model_type": "llama",
            "quantization": QUANTIZATION,
            "quantization_config": QUANTIZATION,
            "tie_word_embeddings": True,
        }
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    floats = {
        EMB: dequantize_by_hand(emb_values, emb["scales"], emb["biases"]),
        LIN: dequantize_by_hand(lin_values, lin["scales"], lin["biases"]),
    }
    values = {f"{EMB}.values": emb_values, f"{LIN}.values": lin_values}
    return {**tensors, **values, **{f"{k}.float": v for k, v in floats.items()}}


def assert_dequantized(got, scales, values, biases):
    """``got`` is ``scale * value + bias`` up to a rounding of the product and of the sum, in
    the scales' dtype (XLA may fuse them into one multiply-add where MLX rounds twice)."""
    g = values.shape[-1] // scales.shape[-1]
    product = np.repeat(np.float64(scales), g, -1) * values
    want = product + np.repeat(np.float64(biases), g, -1)
    eps = float(ml_dtypes.finfo(scales.dtype).eps)
    step = eps * (np.abs(product) + np.abs(want))
    assert np.asarray(got).dtype == scales.dtype
    assert (np.abs(np.asarray(got, np.float64) - want) <= step).all()


def load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # E142: a foreign file, its summary
        return st.load(path, **kw)


def triple(layer: str) -> dict[str, tuple[str, str]]:
    return {k: (layer, k) for k in ("q", "scales", "biases")}


# --- loading ----------------------------------------------------------------------------------


def test_a_directory_written_by_hand_loads_with_its_tie(tmp_path):
    held = write_by_hand(tmp_path)
    with warnings.catch_warnings():  # loaded as its files and config say: no warning
        warnings.simplefilter("error", UserWarning)
        tree = st.load(tmp_path)  # model.safetensors beside its index, as mlx_lm writes it
    assert sorted(tree) == sorted(
        [EMB, f"{EMB}.weight", LIN, f"{LIN}.weight", f"{LIN}.bias", "lm_head.weight"]
        + ["model.norm.weight"]
    )
    emb = {k: held[f"{EMB}.{k}"] for k in ("scales", "biases")}
    # the packed triples are the file's tensors, untouched
    for layer in (EMB, LIN):
        for key, name in (("q", "weight"), ("scales", "scales"), ("biases", "biases")):
            got, want = tree[layer][key], held[f"{layer}.{name}"]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    # the lookup is a dequantize view of the one packed embedding, the head the lookup's
    # view: what is applied to the embedding as the model uses it reaches the head too
    assert tree["lm_head.weight"] == st.Tied(f"{EMB}.weight")
    assert tree[f"{EMB}.weight"] == st.Tied(triple(EMB), st.dequantize(4, 64))
    assert tree[f"{LIN}.weight"] == st.Tied(triple(LIN), st.dequantize(3, 32))
    graph = st.canonicalize(tree)
    assert graph.nbytes_unique == sum(  # each tensor once: the head is no copy
        a.nbytes for k, a in held.items() if not k.endswith((".float", ".values"))
    )
    m = st.materialize(tree)
    assert_dequantized(m["lm_head.weight"], emb["scales"], held[f"{EMB}.values"], emb["biases"])
    np.testing.assert_array_equal(m[f"{EMB}.weight"], m["lm_head.weight"])
    lin = {k: held[f"{LIN}.{k}"] for k in ("scales", "biases")}
    assert_dequantized(m[f"{LIN}.weight"], lin["scales"], held[f"{LIN}.values"], lin["biases"])
    np.testing.assert_array_equal(m[f"{LIN}.bias"], held[f"{LIN}.bias"])  # kept beside .biases
    # the tied model: a lookup and the head (logits = h @ W.T, as as_linear) from one table
    ids = np.array([3, 0, 31, 3])
    h = m[f"{EMB}.weight"][ids]
    logits = h @ m["lm_head.weight"].T
    np.testing.assert_allclose(
        logits, held[f"{EMB}.float"][ids] @ held[f"{EMB}.float"].T, 1e-5, 1e-4
    )


def test_gradients_of_the_lookup_and_the_head_reach_the_one_table(tmp_path):
    write_by_hand(tmp_path)
    tree = jax.tree.map(jnp.asarray, load(tmp_path))
    ids = jnp.array([1, 2, 2])

    def loss(biases):
        t = {**tree, EMB: {**tree[EMB], "biases": biases}}
        m = st.materialize(t)
        return (m[f"{EMB}.weight"][ids] @ m["lm_head.weight"].T).sum()

    d_biases = jax.grad(loss)(tree[EMB]["biases"])
    # by hand: L = sum_i,j <W[ids_i], W_j>; dL/dW = the lookup's part + the head's part, and
    # a bias shifts its whole group: dL/db = the sum of dL/dW over the group
    table = np.asarray(st.materialize(tree)[f"{EMB}.weight"], np.float64)
    d_table = np.zeros_like(table)
    np.add.at(d_table, np.asarray(ids), np.tile(table.sum(0), (3, 1)))  # through the lookup
    d_table += np.tile(table[np.asarray(ids)].sum(0), (VOCAB, 1))  # through the head
    np.testing.assert_allclose(d_biases, d_table.reshape(VOCAB, -1, 64).sum(-1), rtol=1e-4)


def test_mlx_lm_per_layer_false_and_an_absent_tie(tmp_path):
    """A layer left float by the config's own entry; ``tie_word_embeddings`` absent: tied
    where the file has no head (transformers' default), untied when it says false."""
    rng = np.random.default_rng(1)
    _, emb = layer_by_hand(rng, VOCAB, HIDDEN, 8, 128, np.float16)
    tensors = {f"{EMB}.{k}": v for k, v in emb.items()}
    tensors[f"{LIN}.weight"] = rng.standard_normal((OUT, HIDDEN)).astype(np.float16)
    quant = {"group_size": 128, "bits": 8, LIN: False}
    write_by_hand(tmp_path, config={"quantization_config": quant}, tensors=tensors)
    with warns("E142", "tie_word_embeddings", f"'lm_head.weight' <- '{EMB}.weight'"):
        tree = st.load(tmp_path)  # quantization_config alone (no quant_method): MLX's too
    assert tree["lm_head.weight"] == st.Tied(f"{EMB}.weight")
    assert tree[f"{LIN}.weight"].dtype == np.float16  # float, as the file holds it
    write_by_hand(
        tmp_path, config={"quantization": quant, "tie_word_embeddings": False}, tensors=tensors
    )
    assert "lm_head.weight" not in load(tmp_path)


def test_ties_name_another_head(tmp_path):
    write_by_hand(tmp_path)
    tree = load(tmp_path, ties={"head.kernel": st.Tied(f"{EMB}.weight", st.T)})
    assert tree["head.kernel"] == st.Tied(f"{EMB}.weight", st.T)
    assert "lm_head.weight" not in tree  # ties= replaces the config's tie
    m = st.materialize(tree)
    np.testing.assert_array_equal(m["head.kernel"], m[f"{EMB}.weight"].T)
    with raises("E215", "'head.kernel'", f"Tied('{EMB}.weight', T)"):
        st.save_mlx(tmp_path / "out", tree)  # MLX's layout holds no transposed head
    copy = {**load(tmp_path), "embed.copy": st.Tied(triple(EMB), st.dequantize(4, 64))}
    with raises("E215", "'embed.copy'"):
        st.save_mlx(tmp_path / "out", copy)  # a view MLX would not know where to put
    assert not (tmp_path / "out").exists()


def test_an_index_beside_the_file_must_name_its_tensors(tmp_path):
    write_by_hand(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra"] = "model.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with raises("E47", "which disagree", "only in the index: ['model.extra']"):
        st.load(tmp_path)
    index["weight_map"] = dict.fromkeys(index["weight_map"], "model-00001-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with raises("E47", "model-00001-of-00002.safetensors"):
        st.load(tmp_path)


def test_a_plain_hugging_face_directory_with_its_index_loads_as_before(tmp_path):
    tensors = {"a.weight": np.ones((2, 3), np.float32)}
    write_by_hand(tmp_path, config={"model_type": "bert"}, tensors=tensors)
    tree = load(tmp_path)
    assert list(tree) == ["a.weight"] and tree["a.weight"].shape == (2, 3)


# --- saving -----------------------------------------------------------------------------------


def test_saves_back_byte_for_byte(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    held = write_by_hand(src)
    tree = load(src)
    st.save_mlx(out, tree, config=json.loads((src / "config.json").read_text()))
    # the same file: the same tensors, names, dtypes and bytes, the head absent, MLX's metadata
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config == {**json.loads((src / "config.json").read_text())}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(
        sorted(k for k in held if not k.endswith((".float", ".values"))), "model.safetensors"
    )
    n = VOCAB * HIDDEN + OUT * HIDDEN + OUT + HIDDEN  # mlx_lm counts a packed weight's values
    data = (
        os.path.getsize(out / "model.safetensors")
        - 8
        - int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")
    )  # the bytes after the header: every tensor's data
    assert index["metadata"] == {"total_size": data, "total_parameters": n}
    # and it loads again to the same tree
    again = load(out)
    assert jax.tree.structure(again) == jax.tree.structure(tree)


def test_save_mlx_keeps_a_replaced_file_s_mode_and_writes_nothing_on_a_bad_tree(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    write_by_hand(src)
    tree = load(src)
    st.save_mlx(out, tree)
    os.chmod(out / "model.safetensors", 0o640)
    os.chmod(out / "config.json", 0o600)
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    bad = {**tree, "extra": st.Tied("model.norm.weight", st.scale(2.0))}
    with raises("E215", "'extra'"):
        st.save_mlx(out, bad)
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before  # nothing written
    st.save_mlx(out, tree)
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == 0o640
    assert os.stat(out / "config.json").st_mode & 0o777 == 0o600
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]  # no temporary file left


def test_a_tree_quantized_here_saves_and_loads(tmp_path):
    w = np.random.default_rng(2).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    tree = {
        EMB: st.quantize(w, 4, 32),
        f"{EMB}.weight": st.Tied(triple(EMB), st.dequantize(4, 32)),
        "lm_head.weight": st.Tied(triple(EMB), st.dequantize(4, 32)),
    }
    st.save_mlx(tmp_path, tree)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(stored) == [f"{EMB}.biases", f"{EMB}.scales", f"{EMB}.weight"]  # once, no head
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert (
        config["quantization"]
        == config["quantization_config"]
        == {"group_size": 32, "bits": 4, "mode": "affine"}
    )
    back = load(tmp_path)
    assert back["lm_head.weight"] == st.Tied(f"{EMB}.weight")  # the lookup's view
    m, m_back = st.materialize(tree), st.materialize(back)
    np.testing.assert_array_equal(m_back["lm_head.weight"], m["lm_head.weight"])
    np.testing.assert_array_equal(back[EMB]["q"], tree[EMB]["q"])
    # the head tied to the embedding's view (a chain) is the same tie
    chained = {**tree, "lm_head.weight": st.Tied(f"{EMB}.weight")}
    st.save_mlx(tmp_path / "chained", chained)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "chained" / name).read_bytes() == (tmp_path / name).read_bytes()


# --- against MLX ------------------------------------------------------------------------------


def test_a_directory_mlx_wrote_loads_to_mlx_s_table_and_logits(tmp_path):
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(3)
    table = mx.array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    up = mx.array(rng.standard_normal((OUT, HIDDEN)).astype(np.float32))
    eq, es, eb = mx.quantize(table, group_size=64, bits=4)
    uq, us, ub = mx.quantize(up, group_size=32, bits=8)
    tensors = {
        f"{EMB}.weight": eq,
        f"{EMB}.scales": es,
        f"{EMB}.biases": eb,
        f"{LIN}.weight": uq,
        f"{LIN}.scales": us,
        f"{LIN}.biases": ub,
        f"{LIN}.bias": mx.array(rng.standard_normal(OUT).astype(np.float32)),
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    quant = {"group_size": 64, "bits": 4, "mode": "affine", LIN: {"group_size": 32, "bits": 8}}
    config = {"quantization": quant, "quantization_config": quant, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tree = load(tmp_path)
    m = st.materialize(tree)
    for name, (q, s, b, group, bits) in {
        "lm_head.weight": (eq, es, eb, 64, 4),
        f"{LIN}.weight": (uq, us, ub, 32, 8),
    }.items():
        # against MLX's own table: one rounding apart at most (XLA's multiply-add)
        mlx_table = np.array(mx.dequantize(q, s, b, group, bits))
        values = (mlx_table - np.repeat(np.array(b), group, -1)) / np.repeat(np.array(s), group, -1)
        assert_dequantized(m[name], np.array(s), np.round(values), np.array(b))
        np.testing.assert_allclose(m[name], mlx_table, rtol=0, atol=1e-6)
    h = rng.standard_normal((5, HIDDEN)).astype(np.float32)
    as_linear = mx.quantized_matmul(mx.array(h), eq, es, eb, transpose=True, group_size=64, bits=4)
    np.testing.assert_allclose(h @ m["lm_head.weight"].T, np.array(as_linear), rtol=1e-4, atol=1e-4)
    ids = np.array([4, 9, 4])
    looked_up = mx.dequantize(eq[mx.array(ids)], es[mx.array(ids)], eb[mx.array(ids)], 64, 4)
    lookup = jax.jit(lambda t: st.materialize(t)[f"{EMB}.weight"][ids])(tree)
    np.testing.assert_allclose(lookup, np.array(looked_up), rtol=0, atol=1e-6)


def test_round_trip_to_mlx(tmp_path):
    mx = pytest.importorskip("mlx.core")
    nn = pytest.importorskip("mlx.nn")
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    write_by_hand(src)
    tree = load(src)
    st.save_mlx(out, tree, config=json.loads((src / "config.json").read_text()))
    arrays = mx.load(str(out / "model.safetensors"))
    # mx.load gives the packed arrays as they are in the tree, under MLX's names
    for layer in (EMB, LIN):
        for key, name in (("q", "weight"), ("scales", "scales"), ("biases", "biases")):
            a = arrays[f"{layer}.{name}"]
            want = tree[layer][key]
            got = np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)
            np.testing.assert_array_equal(got, np.asarray(want, got.dtype))
    assert "lm_head.weight" not in arrays

    # an mlx.nn model, quantized as mlx_lm's load_model reads config.json, takes the file as is
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = nn.Linear(HIDDEN, OUT)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp()

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
            self.layers = [Layer()]
            self.norm = nn.RMSNorm(HIDDEN)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    model = Model()
    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]

    def predicate(path, module):  # mlx_lm.utils.load_model's class_predicate
        if path in q:
            return q[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in arrays

    nn.quantize(model, q["group_size"], q["bits"], mode=q["mode"], class_predicate=predicate)
    model.load_weights(list(arrays.items()), strict=True)  # every tensor, no head, shapes fit
    ids = mx.array([[1, 5, 7]])
    h = model.model.embed_tokens(ids)
    logits = model.model.embed_tokens.as_linear(h)
    up = model.model.layers[0].mlp.up_proj(h)
    m = st.materialize(tree)
    ours_h = m[f"{EMB}.weight"][np.array([1, 5, 7])]
    np.testing.assert_allclose(ours_h, np.array(h)[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(
        ours_h @ m["lm_head.weight"].T, np.array(logits)[0], rtol=1e-4, atol=1e-4
    )
    ours_up = ours_h @ np.float32(m[f"{LIN}.weight"]).T + m[f"{LIN}.bias"]
    np.testing.assert_allclose(ours_up, np.array(up.astype(mx.float32))[0], rtol=2e-2, atol=2e-2)


def test_st_save_s_own_file_is_read_by_mlx(tmp_path):
    mx = pytest.importorskip("mlx.core")
    write_by_hand(tmp_path)
    tree = load(tmp_path)
    st.save(tmp_path / "tree.safetensors", tree)  # views as specs, the packed table once
    arrays = mx.load(str(tmp_path / "tree.safetensors"))
    packed = [f"{layer}/{k}" for layer in (EMB, LIN) for k in ("biases", "q", "scales")]
    assert sorted(arrays) == sorted([*packed, f"{LIN}.bias", "model.norm.weight"])
    np.testing.assert_array_equal(np.array(arrays[f"{EMB}/q"]), tree[EMB]["q"])
    back = st.load(tmp_path / "tree.safetensors")
    assert back["lm_head.weight"] == tree["lm_head.weight"]


def test_a_sharded_directory_with_a_float_embedding_and_shardings(tmp_path):
    """Shards beside their index; a float (unquantized) embedding tied as it is; each
    buffer placed by ``shardings=``, the packed triples' arrays too."""
    rng = np.random.default_rng(4)
    emb = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16)
    lin_values, lin = layer_by_hand(rng, OUT, HIDDEN, 2, 128, np.float32)
    shards = {
        "model-00001-of-00002.safetensors": {f"{EMB}.weight": emb},
        "model-00002-of-00002.safetensors": {f"{LIN}.{k}": v for k, v in lin.items()},
    }
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name), metadata={"format": "mlx"})
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {"quantization": {"group_size": 128, "bits": 2}, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = load(tmp_path)
    shardings = jax.tree.map(
        lambda x: None if isinstance(x, st.Tied) else device,
        abstract,
        is_leaf=lambda x: isinstance(x, st.Tied),
    )
    tree = load(tmp_path, shardings=shardings)
    assert tree["lm_head.weight"] == st.Tied((f"{EMB}.weight",))  # a float tie: as it is
    assert isinstance(tree[LIN]["q"], jax.Array) and tree[LIN]["q"].sharding == device
    m = st.materialize(tree)
    np.testing.assert_array_equal(m["lm_head.weight"], emb)
    assert_dequantized(m[f"{LIN}.weight"], lin["scales"], lin_values, lin["biases"])
    out = tmp_path / "out"
    st.save_mlx(out, tree)
    stored = load_file(str(out / "model.safetensors"))
    assert sorted(stored) == sorted(weight_map)  # one file now, the head still absent
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_mlx_s_other_modes_and_other_tools_quantization(tmp_path):
    write_by_hand(tmp_path, config={"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}})
    with raises("E201", "'mxfp4'", "e8m0", "config.json"):  # the note names the file
        st.load(tmp_path)
    write_by_hand(tmp_path, config={"quantization": {"group_size": 4, "bits": 64}})
    with raises("E200", "(4, 64)", "config.json"):
        st.load(tmp_path)
    # AWQ, GPTQ, bitsandbytes: another layout; the directory loads as its tensors
    held = write_by_hand(
        tmp_path, config={"quantization_config": {"quant_method": "awq", "bits": 4}}
    )
    tree = load(tmp_path)
    assert sorted(tree) == sorted(k for k in held if not k.endswith((".float", ".values")))


def test_an_adapter_on_the_embedding_reaches_the_tied_head(tmp_path):
    """Issue 41, item 3: the QLoRA step on a tied MLX directory adapts the head with the lookup."""
    held = write_by_hand(tmp_path)
    tree = load(tmp_path)
    out = st.add_lora(tree, f"{EMB}.weight", rank=2, key=jax.random.key(0))
    lora = out["lora"][f"{EMB}.weight"]
    ids = jnp.array([3, 0, 31])

    def loss(b):
        t = {**out, "lora": {**out["lora"], f"{EMB}.weight": {**lora, "b": b}}}
        m = st.materialize(t)["params"]
        return (m[f"{EMB}.weight"][ids] @ m["lm_head.weight"].T).sum()

    b = lora["b"] - 0.1 * jax.grad(loss)(lora["b"])  # one SGD step on the factor
    assert float(jnp.abs(b).max()) > 0
    stepped = {**out, "lora": {**out["lora"], f"{EMB}.weight": {**lora, "b": b}}}
    m = st.materialize(stepped)["params"]
    # by hand: the table dequantized (as MLX computes it) plus the adapter's a @ b
    table = dequantize_by_hand(
        held[f"{EMB}.values"], held[f"{EMB}.scales"], held[f"{EMB}.biases"]
    ).astype(np.float64)
    want = table + np.asarray(lora["a"], np.float64) @ np.asarray(b, np.float64)
    for name in (f"{EMB}.weight", "lm_head.weight"):  # the lookup and the head: both adapted
        np.testing.assert_allclose(np.asarray(m[name], np.float64), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(m["lm_head.weight"], m[f"{EMB}.weight"])


def test_inspect_shows_the_head_the_mlx_load_ties(tmp_path):
    """One rule for load and inspect: the head MLX's layout ties is declared, not a guess."""
    from sharetree.__main__ import describe

    write_by_hand(tmp_path)
    text = describe(str(tmp_path))
    assert f"lm_head.weight <- {EMB}.weight: config.json declares it" in text
    assert "st.load applies these ties unasked" in text and "load it tied" not in text
    assert "lm_head.weight" in load(tmp_path)  # and the load makes it
