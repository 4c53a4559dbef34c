"""Hugging Face checkpoints with the real libraries: tiny GPT-2 and Llama, random init, no hub.

``save_pretrained`` (single file and sharded), ``safetensors.torch.save_model`` and a state
dict holding both copies load with ``ties=`` into the canonical tree, whose materialized
tree equals ``model.state_dict()`` bit for bit; exported back (buffers only, the embedding
is the buffer) the file loads in ``from_pretrained`` with the tie intact and equal logits.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _raises import raises  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file, save_model  # noqa: E402
from test_import_checkpoints import load_ties, save_pt, warns  # noqa: E402

import sharetree as st  # noqa: E402

VOCAB = 100


def tied_weights(model) -> dict[str, str]:
    """``{target: ref}`` of a model: ``all_tied_weights_keys`` (5.x), else shared storage (4.x)."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is not None:
        return dict(keys)
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in first:
            out[name] = first[p.data_ptr()]
        else:
            first[p.data_ptr()] = name
    return out


def quiet_load(path, **kw):
    """``st.load`` of a directory whose config.json says it all: any warning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return st.load(path, **kw)


def assert_same(a: dict, b: dict) -> None:
    """Two flat loaded trees: the same names, the same ties, the same stored bytes."""
    assert set(a) == set(b)
    for k, v in a.items():
        if isinstance(v, st.Tied) or isinstance(b[k], st.Tied):
            assert v == b[k], k
        else:
            assert np.asarray(v).tobytes() == np.asarray(b[k]).tobytes(), k


def make(arch: str, tied: bool):
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "tie_word_embeddings": tied}
    common |= {"bos_token_id": 0, "eos_token_id": 0}
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, **common)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            **common,
        )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def assert_canonical(tree, model) -> None:
    """Independent reference: the materialized tree is the model's own state dict, bit-exactly."""
    m = st.materialize(tree)
    sd = state_dict(model)
    assert set(m) == set(sd)
    for k, v in sd.items():
        a = np.asarray(m[k])
        assert a.dtype == v.dtype and a.tobytes() == v.tobytes(), k


def export_and_reload(tmp_path, tree, model):
    """st.save with {"format": "pt"} + the config -> from_pretrained; tie and logits checked."""
    out = tmp_path / "export"
    out.mkdir()
    save_pt(out / "model.safetensors", tree)
    with safe_open(str(out / "model.safetensors"), "np") as f:
        written = set(f.keys())
    views = {k for k, v in tree.items() if isinstance(v, st.Tied)}
    assert written == set(tree) - views  # views are never written
    model.config.save_pretrained(out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    head, emb = back.get_output_embeddings().weight, back.get_input_embeddings().weight
    assert (head.data_ptr() == emb.data_ptr()) == bool(tied_weights(model))
    assert not any(p.is_meta for p in back.parameters())
    tokens = torch.arange(12).reshape(2, 6) * 7 % VOCAB
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, back(tokens).logits)
    return back


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_save_pretrained_load_export(tmp_path, arch, tied) -> None:
    model = make(arch, tied)
    ties = tied_weights(model)
    assert bool(ties) == tied
    model.save_pretrained(tmp_path / "src")
    with safe_open(str(tmp_path / "src" / "model.safetensors"), "np") as f:
        stored = set(f.keys())
    tree = load_ties(tmp_path / "src", ties=ties)
    assert_same(quiet_load(tmp_path / "src"), tree)  # config.json says it all: one call, no warning
    for target, ref in ties.items():
        assert target not in stored  # save_pretrained omits the head of a tied model
        assert tree[target] == st.Tied(ref) and isinstance(tree[ref], np.ndarray)
    assert_canonical(tree, model)
    export_and_reload(tmp_path, tree, model)


def test_sharded_save_pretrained(tmp_path) -> None:
    model = make("llama", True)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "src" / "model.safetensors.index.json").exists()
    tree = load_ties(tmp_path / "src", ties=tied_weights(model))
    assert_same(quiet_load(tmp_path / "src"), tree)
    assert_canonical(tree, model)
    export_and_reload(tmp_path, tree, model)


def test_save_model_file_restores_its_tie_and_exports_the_embedding(tmp_path) -> None:
    model = make("llama", True)
    save_model(model, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), "np") as f:
        meta, stored = f.metadata(), set(f.keys())
    (dropped, kept), *_ = [(k, v) for k, v in meta.items() if k not in stored]
    with warns("E142", "metadata", f"{dropped!r} <- {kept!r}"):
        tree = load_ties(tmp_path / "m.safetensors")
    assert tree[dropped] == st.Tied(kept)
    assert_canonical(tree, model)
    tree = load_ties(tmp_path / "m.safetensors", ties=tied_weights(model))
    assert tree["lm_head.weight"] == st.Tied("model.embed_tokens.weight")  # moved to the ref
    assert_canonical(tree, model)
    export_and_reload(tmp_path, tree, model)


def test_ties_save_model_records_are_checked_never_ignored(tmp_path) -> None:
    # the file safetensors.torch.save_model wrote, then the same with one tensor taken out
    model = make("llama", True)
    path = str(tmp_path / "m.safetensors")
    save_model(model, path)
    with safe_open(path, "pt") as f:
        meta, sd = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    (dropped, kept), *_ = [(k, v) for k, v in meta.items() if k not in sd]
    twice = st.scale(2.0)
    for ties in ({dropped: st.Tied(kept, twice)}, {kept: st.Tied(dropped, twice)}):
        for atol in (None, 1e9):
            with raises("E261", f"{dropped!r} <- {kept!r}"):
                st.load(path, ties=ties, atol=atol)
    del sd[kept]  # the entry now keeps a tensor the file lacks
    save_file(sd, str(tmp_path / "cut.safetensors"), metadata=meta)
    with raises("E260", f"{dropped!r} <- {kept!r}", "lacks"):
        st.load(str(tmp_path / "cut.safetensors"))


def test_both_copies_are_compared_and_tied_in_transformers_direction(tmp_path) -> None:
    model = make("gpt2", True)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}  # two copies
    save_file(sd, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    tree = load_ties(tmp_path / "m.safetensors", ties=tied_weights(model))
    assert tree["lm_head.weight"] == st.Tied("transformer.wte.weight")
    assert_canonical(tree, model)
    export_and_reload(tmp_path, tree, model)
    sd["lm_head.weight"][3, 4] += 1.0  # a head trained apart: not one tied weight
    save_file(sd, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    with raises("E46", "'lm_head.weight' and 'transformer.wte.weight' differ", "1 of 1600"):
        load_ties(tmp_path / "m.safetensors", ties=tied_weights(model))


def test_gpt2_fused_c_attn_loads_as_one_buffer_with_q_k_v_slice_views(tmp_path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "src")
    sd = state_dict(model)
    n = config.n_embd
    ties: dict[str, object] = dict(tied_weights(model))
    for layer in range(config.n_layer):
        fused = f"transformer.h.{layer}.attn.c_attn.weight"  # Conv1D: (in, 3 * out)
        assert sd[fused].shape == (n, 3 * n)
        for k, name in enumerate("qkv"):
            ties[f"transformer.h.{layer}.attn.{name}.weight"] = st.Tied(
                fused, st.slice(k * n, (k + 1) * n, axis=1)
            )
    tree = load_ties(tmp_path / "src", ties=ties)
    m = st.materialize(tree)
    for layer in range(config.n_layer):
        fused = sd[f"transformer.h.{layer}.attn.c_attn.weight"]
        assert isinstance(tree[f"transformer.h.{layer}.attn.c_attn.weight"], np.ndarray)
        for k, name in enumerate("qkv"):
            view = np.asarray(m[f"transformer.h.{layer}.attn.{name}.weight"])
            columns = fused[:, k * n : (k + 1) * n]  # NumPy, by hand
            assert view.dtype == columns.dtype and view.tobytes() == columns.tobytes()
    assert_canonical(
        {
            k: v
            for k, v in tree.items()
            if ".attn.q." not in k and ".attn.k." not in k and ".attn.v." not in k
        },
        model,
    )
    # saved back (buffers only: c_attn once, no q/k/v), the file loads in from_pretrained
    export_and_reload(tmp_path, tree, model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_inspect_suggests_the_ties_of_a_save_pretrained_directory(tmp_path, arch) -> None:
    from sharetree.__main__ import describe

    model = make(arch, True)
    model.save_pretrained(tmp_path / "m")  # transformers drops the tied head
    text = describe(str(tmp_path / "m"))
    shown = [x.strip().split(": ", 1)[0].split(" <- ") for x in text.splitlines()]
    ties = {t[0]: t[1] for t in shown if len(t) == 2}
    assert ties == tied_weights(model)  # what transformers itself says is tied
    assert "st.load applies these ties unasked" in text
    assert_canonical(quiet_load(tmp_path / "m"), model)
