"""PEFT LoRA directories both ways, against real ``peft`` and ``transformers`` on CPU.

The reference is PEFT itself: tiny Llama models (tied and untied) with adapters PEFT made
(B not zero), their logits from ``PeftModel``, their merged weights from
``merge_and_unload``, their files read back with ``safetensors``. sharetree's side is a
Llama forward written here in ``jnp`` over the materialized tree.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
optax = pytest.importorskip("optax")

from _raises import raises  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import sharetree as st  # noqa: E402

VOCAB, EMB, HEAD = 64, "model.embed_tokens.weight", "lm_head.weight"
TOKENS = (np.arange(24).reshape(2, 12) * 7 + 3) % VOCAB


def make(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def base_tree(directory, tied: bool) -> dict:
    """The base model's tree as ``st.load`` gives it, the head tied to the embedding if tied."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = dict(st.load(directory))
    if tied and HEAD not in tree:  # save_pretrained omits a tied head
        tree[HEAD] = st.Tied(EMB)
    return tree


def forward(m: dict, config, tokens=TOKENS) -> jax.Array:
    """Llama's logits by hand in jnp: RMSNorm, RoPE, grouped-query causal attention, SwiGLU."""
    d, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd, eps = d // nh, config.rms_norm_eps
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]

    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

    n = tokens.shape[1]
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    freqs = jnp.arange(n, dtype=jnp.float32)[:, None] * inv
    cos, sin = jnp.cos(jnp.concatenate([freqs] * 2, -1)), jnp.sin(jnp.concatenate([freqs] * 2, -1))

    def rope(x):  # (b, heads, n, hd)
        half = jnp.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + half * sin

    x = m[EMB][tokens]
    mask = jnp.tril(jnp.ones((n, n), bool))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, m[p + "input_layernorm.weight"])
        b = h.shape[0]
        q = (h @ m[p + "self_attn.q_proj.weight"].T).reshape(b, n, nh, hd).transpose(0, 2, 1, 3)
        k = (h @ m[p + "self_attn.k_proj.weight"].T).reshape(b, n, nkv, hd).transpose(0, 2, 1, 3)
        v = (h @ m[p + "self_attn.v_proj.weight"].T).reshape(b, n, nkv, hd).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        k, v = jnp.repeat(k, nh // nkv, 1), jnp.repeat(v, nh // nkv, 1)
        s = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(hd), -jnp.inf)
        o = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
        x = x + o @ m[p + "self_attn.o_proj.weight"].T
        h = norm(x, m[p + "post_attention_layernorm.weight"])
        gate = jax.nn.silu(h @ m[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ m[p + "mlp.up_proj.weight"].T)) @ m[p + "mlp.down_proj.weight"].T
    return norm(x, m["model.norm.weight"]) @ m[HEAD].T


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(TOKENS)).logits.numpy()


def close(a, b) -> None:
    """rtol 1e-5, and float32's rounding of the largest logit for values near zero."""
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def lora_config(tied: bool, **kw):
    targets = ["q_proj", "v_proj", "embed_tokens"] + ([] if tied else ["lm_head", "o_proj"])
    kw.setdefault("r", 4)
    kw.setdefault("lora_alpha", 8)
    extra = {"ensure_weight_tying": True} if tied else {}
    return peft.LoraConfig(target_modules=targets, init_lora_weights=False, **extra, **kw)


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tied(request):
    return request.param


def peft_adapter(tmp_path, tied: bool, **kw):
    """A base directory, its tree, and a PEFT adapter (B random) saved beside it."""
    model = make(tied)
    model.save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(model, lora_config(tied, **kw)).eval()
        peft_model.save_pretrained(tmp_path / "adapter")
    return base_tree(tmp_path / "base", tied), peft_model


def from_pretrained(tmp_path, adapter):
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(base, adapter).eval()


# --- PEFT -> sharetree ----------------------------------------------------------------------


PATTERNS = {"use_rslora": True, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"q_proj": 3}}


@pytest.mark.parametrize("options", [{}, PATTERNS], ids=["plain", "patterns"])
def test_a_peft_adapter_loads_and_gives_peft_logits(tmp_path, tied, options) -> None:
    tree, peft_model = peft_adapter(tmp_path, tied, **options)
    out = st.load_adapter(tmp_path / "adapter", tree)
    m = st.materialize(out)["params"]
    close(forward(m, peft_model.config), torch_logits(peft_model))
    assert (
        out["params"]["model.layers.0.self_attn.k_proj.weight"]
        is tree["model.layers.0.self_attn.k_proj.weight"]
    )
    adapted = set(out["lora"])
    if tied:  # one adapter on the shared table, read by the lookup and the head
        assert out["params"][HEAD] == st.Tied(EMB) and HEAD not in adapted
        np.testing.assert_array_equal(m[HEAD], m[EMB])
    assert EMB in adapted and out["lora"][EMB]["a"].shape == (VOCAB, 4)
    assert (HEAD in adapted) == (not tied)
    if options:
        assert out["lora"]["model.layers.1.self_attn.v_proj.weight"]["a"].shape == (16 // 2, 2)


def test_merge_lora_equals_merge_and_unload_untied(tmp_path) -> None:
    tree, peft_model = peft_adapter(tmp_path, False)
    merged = st.merge_lora(st.load_adapter(tmp_path / "adapter", tree))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft_model.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for k, v in reference.items():
        np.testing.assert_allclose(np.asarray(merged[k]), v.numpy(), rtol=1e-6, atol=1e-6)


def test_fan_in_fan_out_gpt2_merges_as_merge_and_unload(tmp_path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32,
                                     vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"],
                           fan_in_fan_out=True, init_lora_weights=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(model, lora)
        peft_model.save_pretrained(tmp_path / "adapter")
        reference = peft_model.merge_and_unload().state_dict()
    tree = base_tree(tmp_path / "base", False)
    out = st.load_adapter(tmp_path / "adapter", tree)
    assert out["lora"]["transformer.h.0.attn.c_attn.weight"]["a"].shape == (16, 2)  # (in, r)
    merged = st.merge_lora(out)
    for k, v in merged.items():
        if not isinstance(v, st.Tied):
            np.testing.assert_allclose(np.asarray(v), reference[k].numpy(), rtol=1e-6, atol=1e-6)


def test_a_tied_adapter_merges_once_as_peft_computes_it_unmerged(tmp_path) -> None:
    tree, peft_model = peft_adapter(tmp_path, True)
    merged = st.merge_lora(st.load_adapter(tmp_path / "adapter", tree))
    assert merged[HEAD] == st.Tied(EMB)  # the tie kept: one table
    layers = peft_model.base_model.model
    emb, head = layers.model.embed_tokens, layers.lm_head
    with torch.no_grad():  # PEFT's per-layer weights, unmerged: base + its delta, once each
        e = (emb.base_layer.weight + emb.get_delta_weight("default")).numpy()
        h = (head.base_layer.weight + head.get_delta_weight("default")).numpy()
    np.testing.assert_allclose(np.asarray(merged[EMB]), e, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged[EMB]), h, rtol=1e-6, atol=1e-6)
    close(forward(st.materialize(merged), peft_model.config), torch_logits(peft_model))


# --- sharetree -> PEFT ----------------------------------------------------------------------


def _train(tree, config, steps: int = 3):
    """add_lora on the embedding and q/v, then optax on the factors only (partition by path)."""
    where = [EMB, "*q_proj.weight", "*v_proj.weight"]
    tuned = st.add_lora(tree, where, rank=4, key=jax.random.key(0), scale=2.0)
    train, frozen = st.partition(tuned, st.mask_by_path(tuned, "lora/*/[ab]"))

    def loss(train):
        m = st.materialize(st.combine(train, frozen))["params"]
        logp = jax.nn.log_softmax(forward(m, config)[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, TOKENS[:, 1:, None], -1))

    opt = optax.adam(5e-2)
    state = opt.init(train)
    for _ in range(steps):
        updates, state = opt.update(jax.grad(loss)(train), state, train)
        train = optax.apply_updates(train, updates)
    tuned = st.combine(train, frozen)
    assert np.abs(np.asarray(tuned["lora"][EMB]["b"])).max() > 0  # trained: B left zero
    return tuned


def test_an_adapter_trained_in_jax_gives_the_same_logits_in_peft(tmp_path, tied) -> None:
    model = make(tied)
    model.save_pretrained(tmp_path / "base")
    tree = base_tree(tmp_path / "base", tied)
    tuned = _train(tree, model.config)
    st.save_adapter(tmp_path / "out", tuned, base_model_name_or_path=str(tmp_path / "base"))
    back = from_pretrained(tmp_path, tmp_path / "out")
    ours = forward(st.materialize(tuned)["params"], model.config)
    assert not np.allclose(ours, torch_logits(model), atol=1e-3)  # the adapter changes them
    close(ours, torch_logits(back))
    written = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert not any("base_layer" in k for k in written)  # only the adapters, never the base
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["ensure_weight_tying"] is tied and config["lora_alpha"] == 8
    layers = back.base_model.model
    if tied:  # PEFT applies the one adapter to the lookup and the head, as one tensor
        a = layers.lm_head.lora_A["default"].weight
        assert a.data_ptr() == layers.model.embed_tokens.lora_embedding_B["default"].data_ptr()


def test_the_round_trip_peft_sharetree_peft_keeps_every_tensor(tmp_path, tied) -> None:
    tree, peft_model = peft_adapter(tmp_path, tied, rank_pattern={"v_proj": 2})
    out = st.load_adapter(tmp_path / "adapter", tree)
    st.save_adapter(tmp_path / "again", out)
    before = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    after = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert set(after) == {k for k in before if ".base_layer." not in k}
    for k, v in after.items():
        assert v.dtype == before[k].dtype and v.tobytes() == before[k].tobytes(), k
    close(torch_logits(from_pretrained(tmp_path, tmp_path / "again")), torch_logits(peft_model))
    config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["rank_pattern"] == {f"model.layers.{i}.self_attn.v_proj": 2 for i in range(2)}


def test_save_adapter_replaces_atomically_and_keeps_the_mode(tmp_path) -> None:
    model = make(False)
    model.save_pretrained(tmp_path / "base")
    tuned = st.add_lora(base_tree(tmp_path / "base", False), "*q_proj.weight", rank=2,
                        key=jax.random.key(1))  # fmt: skip
    st.save_adapter(tmp_path / "out", tuned)
    weights = tmp_path / "out" / "adapter_model.safetensors"
    weights.chmod(0o640)
    tuned["lora"]["model.layers.0.self_attn.q_proj.weight"]["b"] += 1.0
    st.save_adapter(tmp_path / "out", tuned)
    assert weights.stat().st_mode & 0o777 == 0o640
    got = load_file(weights)["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    np.testing.assert_array_equal(got, tuned["lora"]["model.layers.0.self_attn.q_proj.weight"]["b"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


# --- what does not fit: a TieError naming the key and the path, nothing attached -------------


def _edit(tmp_path, *, config=None, tensors=None):
    """The adapter with its config updated and its tensors edited (a dict -> dict function)."""
    directory = tmp_path / "adapter"
    if config is not None:
        path = directory / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        path = directory / "adapter_model.safetensors"
        save_file(tensors(load_file(path)), path, {"format": "pt"})
    return directory


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "config, facts",
    [
        ({"use_dora": True}, ["use_dora = True"]),
        ({"bias": "all"}, ["bias = 'all'"]),
        ({"peft_type": "LOHA"}, ["peft_type 'LOHA'"]),
        ({"layers_to_transform": [0]}, ["layers_to_transform = [0]"]),
        ({"init_lora_weights": "pissa"}, ["init_lora_weights = 'pissa'"]),
        ({"a_future_option": 1}, ["a_future_option = 1"]),
        ({"r": 0}, ["r is not an int"]),
    ],
)
def test_options_it_does_not_apply_are_refused(tmp_path, config, facts) -> None:
    tree, _ = peft_adapter(tmp_path, False)
    with raises("E342", "adapter_config.json", *facts):
        st.load_adapter(_edit(tmp_path, config=config), tree)


def test_a_dora_adapter_made_by_peft_is_refused(tmp_path) -> None:
    tree, _ = peft_adapter(tmp_path, False, use_dora=True)
    with raises("E342", "use_dora = True"):
        st.load_adapter(tmp_path / "adapter", tree)


def test_a_module_absent_from_the_tree_names_the_key_and_the_closest_path(tmp_path) -> None:
    tree, _ = peft_adapter(tmp_path, False)
    del tree["model.layers.1.self_attn.v_proj.weight"]
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    with raises("E343", repr(key), "'model.layers.1.self_attn.v_proj'", "closest"):
        st.load_adapter(tmp_path / "adapter", tree)


def test_keys_of_no_known_kind_and_lone_factors_are_named(tmp_path) -> None:
    tree, _ = peft_adapter(tmp_path, False)
    extra = Q0 + ".lora_magnitude_vector"
    _edit(tmp_path, tensors=lambda t: {**t, extra: np.ones(16, np.float32)})
    with raises("E343", repr(extra), "DoRA"):
        st.load_adapter(tmp_path / "adapter", tree)
    _edit(tmp_path, tensors=lambda t: {k: v for k, v in t.items() if k != extra})
    _edit(tmp_path, tensors=lambda t: {k: v for k, v in t.items() if k != Q0 + ".lora_B.weight"})
    with raises("E343", repr(Q0 + ".lora_A.weight"), repr(Q0 + ".lora_B.weight")):
        st.load_adapter(tmp_path / "adapter", tree)


def test_a_rank_or_shape_that_does_not_fit_names_both(tmp_path) -> None:
    tree, _ = peft_adapter(tmp_path, False)
    _edit(tmp_path, config={"r": 3})
    key_at = r"re:'base_model\.model\.[\w.]+\.lora_A\.weight' at '[\w.]+\.weight'"
    with raises("E344", key_at, "rank 3", "A [4, 16]"):
        st.load_adapter(tmp_path / "adapter", tree)
    _edit(tmp_path, config={"r": 4})
    small = {k: (np.zeros((8, 16), np.float32) if "q_proj" in k else v) for k, v in tree.items()}
    with raises("E344", "'model.layers.0.self_attn.q_proj.weight'", "[8, 16]", "(16, 16)"):
        st.load_adapter(tmp_path / "adapter", small)


def test_a_base_copy_that_differs_from_the_tree_is_named(tmp_path, tied) -> None:
    tree, _ = peft_adapter(tmp_path, tied)
    tree[EMB] = tree[EMB] + 1.0
    with raises("E345", "base_layer.weight", "re:'(model.embed_tokens|lm_head).weight'", "1"):
        st.load_adapter(tmp_path / "adapter", tree)


def test_a_tied_copy_that_differs_from_the_embedding_is_named(tmp_path) -> None:
    tree, _ = peft_adapter(tmp_path, True)
    head_a = "base_model.model.lm_head.lora_A.weight"
    _edit(tmp_path, tensors=lambda t: {**t, head_a: t[head_a] * 2})
    with raises("E345", repr(head_a), "'base_model.model.model.embed_tokens.lora_embedding_A'"):
        st.load_adapter(tmp_path / "adapter", tree)


def test_modules_to_save_replace_their_buffer_and_a_view_is_refused(tmp_path) -> None:
    model = make(False)
    model.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                           modules_to_save=["lm_head"], init_lora_weights=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(model, lora).eval()
        with torch.no_grad():  # as if trained: the saved copy is no longer the base's
            peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.25)
        peft_model.save_pretrained(tmp_path / "adapter")
    tree = base_tree(tmp_path / "base", False)
    out = st.load_adapter(tmp_path / "adapter", tree)
    np.testing.assert_array_equal(out["params"][HEAD], tree[HEAD] + np.float32(0.25))
    close(forward(st.materialize(out)["params"], model.config), torch_logits(peft_model))
    st.save_adapter(tmp_path / "again", out, modules_to_save=["lm_head"])
    back = from_pretrained(tmp_path, tmp_path / "again")
    close(torch_logits(back), torch_logits(peft_model))  # the whole head travels back
    tree[HEAD] = st.Tied(EMB)  # a head that is a view: replacing it would change the lookup
    with raises("E345", "'base_model.model.lm_head.weight'", "'lm_head.weight'", "st.untie"):
        st.load_adapter(tmp_path / "adapter", tree)
