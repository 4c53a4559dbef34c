"""Issue 41: a Hugging Face directory loads tied in one call, and no contradiction is silent.

Each family's tiny random model is built with real ``transformers`` and saved once
(``save_pretrained``: tied, untied, sharded); the reference for every tie is transformers'
own ``all_tied_weights_keys`` and ``model.state_dict()``, and for the head the logits
transformers computes. The contradicting checkpoints are those files, edited.
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _raises import message, raises  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from safetensors.torch import save_model  # noqa: E402

import sharetree as st  # noqa: E402
from sharetree._files.families import FAMILIES, declared_ties  # noqa: E402

T = transformers
VOCAB = 64
_DEC = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
_DEC |= {"num_attention_heads": 2, "num_key_value_heads": 2}
_SEQ = {"d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 32}
_SEQ |= {"decoder_ffn_dim": 32, "encoder_attention_heads": 2, "decoder_attention_heads": 2}
# model_type: (config class, model class, tiny config)
BUILDS = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, _DEC),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, _DEC),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, _DEC),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, _DEC | {"head_dim": 8}),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, _DEC | {"head_dim": 8}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, _DEC | {"head_dim": 8}),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, _DEC | {"head_dim": 8}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, _DEC | {"pad_token_id": 0}),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {"n_embd": 16, "n_layer": 1, "n_head": 2}),
    "gpt_neox": (
        T.GPTNeoXConfig,
        T.GPTNeoXForCausalLM,
        {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
        | {"num_attention_heads": 2},
    ),
    "opt": (
        T.OPTConfig,
        T.OPTForCausalLM,
        {"hidden_size": 16, "ffn_dim": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
        | {"word_embed_proj_dim": 16},
    ),
    "t5": (
        T.T5Config,
        T.T5ForConditionalGeneration,
        {"d_model": 16, "d_ff": 32, "d_kv": 8, "num_layers": 1, "num_heads": 2},
    ),
    "bart": (T.BartConfig, T.BartForConditionalGeneration, _SEQ),
    "bert": (
        T.BertConfig,
        T.BertForMaskedLM,
        {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
        | {"num_attention_heads": 2},
    ),
}
SMALL = {"vocab_size": VOCAB, "max_position_embeddings": 32, "n_positions": 32}
UNTIED = ("llama", "gpt2", "bart", "gemma")  # saved untied too


def build(model_type: str, **kw):
    cls, model_cls, tiny = BUILDS[model_type]
    torch.manual_seed(0)
    names = set(cls().to_dict())  # only the keys the config takes
    extra = {k: v for k, v in SMALL.items() if k in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(cls(**tiny, **extra, **kw)).eval()


def tied_keys(model) -> dict[str, str]:
    """transformers' own tie map of ``model``: ``{tied name: the name it reads}``.

    transformers 5 keeps it as ``all_tied_weights_keys``; transformers 4 ties by making one
    ``Parameter`` serve every name, so there the map is read off the shared parameters
    (each later name reads the first, in ``named_parameters`` order).
    """
    if hasattr(model, "all_tied_weights_keys"):
        return dict(model.all_tied_weights_keys)
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def quiet_load(path, **kw):
    """``st.load`` that must not warn: the directory says all it ties."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return st.load(path, **kw)


ON_DISK = {"gpt_neox": {"lm_head.weight": "embed_out.weight"}}
"""transformers 5 renames these on save (its conversion_mapping's WeightRenaming)."""


def disk(model_type: str, names: dict[str, str]) -> dict[str, str]:
    """A map of transformers' parameter names in the names its files hold."""
    rename = ON_DISK.get(model_type, {})
    return {rename.get(k, k): rename.get(v, v) for k, v in names.items()}


def ties_of(tree) -> dict[str, str]:
    """``{target: ref}`` of a loaded flat tree (every tie a plain one-name view)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, st.Tied):
            assert v.transform == st.identity and len(v.ref) == 1, (k, v)
            out[k] = v.ref[0]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every family saved once: ``{(model_type, tied): (model, directory)}``."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for model_type in BUILDS:
        for tied in (True, False) if model_type in UNTIED else (True,):
            model = build(model_type, tie_word_embeddings=tied)
            path = root / f"{model_type}-{tied}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.save_pretrained(path)
            out[(model_type, tied)] = model, path
    return out


def edited(tmp_path, src, **config) -> object:
    """A copy of the directory ``src`` with its config.json changed (``None``: key removed)."""
    dst = tmp_path / f"{src.name}-edited"
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    for k, v in config.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    (dst / "config.json").write_text(json.dumps(data))
    return dst


# ----------------------------------------------------------------------------- the table


def skip_where_transformers_4_differs(model_type: str) -> None:
    """The table is transformers 5's tie map. transformers 4 (4.57, the floor) ties an
    encoder-decoder's or BERT's embeddings differently when the config says false (T5 keeps
    its own head, BART shares none), so there the two majors disagree and 5 is the reference."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5 and model_type in ("bart", "bert", "t5"):
        pytest.skip(f"{model_type}: transformers {transformers.__version__} ties it as 4.x does")


@pytest.mark.parametrize("model_type", sorted(BUILDS))
def test_the_table_is_transformers_own_tie_map(model_type) -> None:
    skip_where_transformers_4_differs(model_type)
    cls, model_cls, _ = BUILDS[model_type]
    family = FAMILIES[model_type]
    for tied in (True, False):
        model = build(model_type, tie_word_embeddings=tied)
        config = {"model_type": model_type, "architectures": [model_cls.__name__]}
        declared = declared_ties({**config, "tie_word_embeddings": tied})
        assert declared.covered
        want = disk(model_type, dict(tied_keys(model)))
        if model_type == "t5" and not tied:
            # T5 v1.1 (false) stores its own head: transformers 5 ties it anyway (its T5Config
            # sets the key true whatever the file says); sharetree keeps the file's head
            assert model.config.tie_word_embeddings is True
            want.pop("lm_head.weight")
        assert dict(declared.ties) == want, (model_type, tied)
    if model_type != "t5":  # the default where config.json has no key: the class's default
        assert family.default is cls().tie_word_embeddings


# ----------------------------------------------------------------------------- loads


@pytest.mark.parametrize("model_type", sorted(BUILDS))
def test_st_load_alone_gives_transformers_tie_map_and_state_dict(saved, model_type) -> None:
    skip_where_transformers_4_differs(model_type)
    for (kind, tied), (model, path) in saved.items():
        if kind != model_type:
            continue
        tree = quiet_load(path)  # nothing guessed: no warning
        assert ties_of(tree) == disk(model_type, tied_keys(model)), (model_type, tied)
        m = st.materialize(tree)
        rename = ON_DISK.get(model_type, {})
        sd = {rename.get(k, k): v for k, v in state(model).items()}
        assert set(sd) <= set(m), set(sd) - set(m)
        for k, v in sd.items():
            a = np.asarray(m[k])
            assert a.dtype == v.dtype and a.tobytes() == v.tobytes(), k


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "opt"])
def test_logits_from_the_loaded_head_equal_transformers(saved, model_type) -> None:
    model, path = saved[(model_type, True)]  # the head a view of the embedding
    m = st.materialize(quiet_load(path))
    head = model.get_output_embeddings()
    name = next(k for k, p in model.named_parameters(remove_duplicate=False) if p is head.weight)
    name = ON_DISK.get(model_type, {}).get(name, name)
    tokens = torch.arange(10).reshape(2, 5) * 7 % VOCAB
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
    hidden = out.hidden_states[-1].numpy()  # after the final norm, as the head reads it
    logits = hidden @ np.asarray(m[name]).T  # the head written from the loaded tree
    np.testing.assert_allclose(logits, out.logits.numpy(), rtol=1e-5, atol=1e-5)


def test_sharded_and_absent_key_and_text_config(saved, tmp_path) -> None:
    model, _ = saved[("gpt2", True)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "sharded", max_shard_size="3KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    want = dict(tied_keys(model))
    assert ties_of(quiet_load(tmp_path / "sharded")) == want
    # GPT-2's config on the Hub has no tie_word_embeddings: transformers' default ties it
    absent = edited(tmp_path, tmp_path / "sharded", tie_word_embeddings=None)
    assert ties_of(quiet_load(absent)) == want
    # Llama's default is untied: its stored head stays its own
    _, path = saved[("llama", False)]
    assert ties_of(quiet_load(edited(tmp_path, path, tie_word_embeddings=None))) == {}
    # a vision-language config holds the key in text_config
    gemma, path = saved[("gemma3_text", True)]
    moved = edited(tmp_path, path, tie_word_embeddings=None, text_config={})
    data = json.loads((moved / "config.json").read_text())
    data["text_config"] = {"tie_word_embeddings": True}
    (moved / "config.json").write_text(json.dumps(data))
    assert ties_of(quiet_load(moved)) == dict(tied_keys(gemma))
    data["text_config"] = {"tie_word_embeddings": False}  # the head is absent: nothing to tie
    (moved / "config.json").write_text(json.dumps(data))
    assert "lm_head.weight" not in quiet_load(moved)


def test_a_stored_head_equal_to_the_embedding_is_one_buffer(saved, tmp_path) -> None:
    for model_type in ("llama", "t5"):
        model, path = saved[(model_type, True)] if model_type == "t5" else saved[("gemma", True)]
        sd = state(model)  # every name, the tied ones as copies
        dst = tmp_path / model_type
        dst.mkdir()
        shutil.copy(path / "config.json", dst / "config.json")
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
        tree = quiet_load(dst)
        assert ties_of(tree) == dict(tied_keys(model))
        graph = st.canonicalize(tree)
        assert graph.num_unique == len(sd) - len(tied_keys(model))


def test_ties_given_override_the_config_and_empty_ties_load_as_stored(saved) -> None:
    _, path = saved[("gpt2", True)]
    stored = quiet_load(path, ties={})
    assert ties_of(stored) == {} and "lm_head.weight" not in stored
    assert set(stored) == set(load_file(str(path / "model.safetensors")))


# ----------------------------------------------------------------------------- contradictions


def _head_apart(tmp_path, saved, delta=1.0, dtype=None):
    """Gemma's tied directory, its head stored too and trained apart by ``delta`` at one entry."""
    model, path = saved[("gemma", True)]
    sd = state(model)
    head = sd["model.embed_tokens.weight"].copy()
    head[3, 4] += delta
    sd["lm_head.weight"] = head if dtype is None else head.astype(dtype)
    dst = tmp_path / "apart"
    dst.mkdir(exist_ok=True)
    shutil.copy(path / "config.json", dst / "config.json")
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, sd


def test_a_stored_head_that_differs_is_an_error_naming_both_and_both_ways(saved, tmp_path):
    path, sd = _head_apart(tmp_path, saved, 0.5)
    head, emb = "'lm_head.weight'", "'model.embed_tokens.weight'"
    with raises("E360", head, emb, "tie_word_embeddings", "0.5", "ties={}") as e:
        st.load(path)
    assert "ties={'lm_head.weight': 'model.embed_tokens.weight'}" in message(e.value)
    # the two ways it names: as stored, and tied keeping either tensor
    assert ties_of(quiet_load(path, ties={})) == {}
    assert "atol=0.51" in message(e.value)  # the atol that takes either copy
    kept = quiet_load(path, ties={"lm_head.weight": "model.embed_tokens.weight"}, atol=0.51)
    np.testing.assert_array_equal(
        np.asarray(st.materialize(kept)["lm_head.weight"]), sd["model.embed_tokens.weight"]
    )
    kept = quiet_load(path, ties={"model.embed_tokens.weight": "lm_head.weight"}, atol=0.51)
    np.testing.assert_array_equal(
        np.asarray(st.materialize(kept)["model.embed_tokens.weight"]), sd["lm_head.weight"]
    )
    # within one rounding of the dtype (each value one ulp away): the same weight
    near, _ = _head_apart(tmp_path, saved, 0.0)
    sd = load_file(str(near / "model.safetensors"))
    sd["lm_head.weight"] = np.nextafter(sd["lm_head.weight"], np.float32(np.inf))
    save_file(sd, str(near / "model.safetensors"))
    assert ties_of(quiet_load(near))["lm_head.weight"] == "model.embed_tokens.weight"


def test_a_stored_head_of_another_dtype_is_a_contradiction(saved, tmp_path) -> None:
    path, _ = _head_apart(tmp_path, saved, 0.0, np.float16)
    with raises("E360", "'lm_head.weight'", "float16", "float32"):
        st.load(path)


def test_metadata_ties_against_the_config(saved, tmp_path) -> None:
    model, path = saved[("gemma", True)]
    dst = tmp_path / "recorded"
    dst.mkdir()
    shutil.copy(path / "config.json", dst / "config.json")
    save_model(model, str(dst / "model.safetensors"))  # records {removed: kept}
    assert ties_of(quiet_load(dst)) == dict(tied_keys(model))  # they agree
    untied = edited(tmp_path, dst, tie_word_embeddings=False)
    with raises("E361", "'lm_head.weight'", "'model.embed_tokens.weight'", "false"):
        st.load(untied)


def test_inspect_prints_the_contradiction(saved, tmp_path) -> None:
    from sharetree.__main__ import describe

    path, _ = _head_apart(tmp_path, saved, 0.5)
    text = describe(str(path))
    assert "contradicts itself (1)" in text and "[E360]" in text and "0.5" in text


# ----------------------------------------------------------------------------- guesses


def test_a_family_not_covered_loads_as_stored_and_warns_at_the_callers_line(
    saved, tmp_path
) -> None:
    _, path = saved[("llama", True)]
    other = edited(tmp_path, path, model_type="mystery", architectures=["MysteryForCausalLM"])
    with pytest.warns(UserWarning) as caught:
        tree = st.load(other)
    (w,) = caught
    text = str(w.message)
    assert text.startswith("[E362]") and "tie_word_embeddings" in text
    assert "ties={'lm_head.weight': 'model.embed_tokens.weight'}" in text
    assert w.filename == __file__  # at the caller's line
    assert "lm_head.weight" not in tree
    assert ties_of(quiet_load(other, ties={})) == {}  # ties={}: as stored, nothing guessed


def test_an_adapter_on_the_embedding_reaches_the_loaded_head(saved) -> None:
    """Issue 41, item 3 for Hugging Face: the head is the embedding, so LoRA on it adapts both."""
    import jax
    import jax.numpy as jnp

    model, path = saved[("gemma", True)]
    emb = "model.embed_tokens.weight"
    out = st.add_lora(quiet_load(path), emb, rank=2, key=jax.random.key(0))
    lora = out["lora"][emb]
    ids = jnp.array([3, 0, 31])

    def loss(b):
        m = st.materialize({**out, "lora": {**out["lora"], emb: {**lora, "b": b}}})["params"]
        return (m[emb][ids] @ m["lm_head.weight"].T).sum()

    b = lora["b"] - 0.1 * jax.grad(loss)(lora["b"])  # one SGD step on the factor
    m = st.materialize({**out, "lora": {**out["lora"], emb: {**lora, "b": b}}})["params"]
    want = state(model)[emb] + np.asarray(lora["a"]) @ np.asarray(b)  # by hand
    assert float(np.abs(np.asarray(lora["a"]) @ np.asarray(b)).max()) > 0
    np.testing.assert_allclose(np.asarray(m["lm_head.weight"]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(m["lm_head.weight"]), np.asarray(m[emb]))
