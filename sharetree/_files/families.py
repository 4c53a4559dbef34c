"""Which tensors a Hugging Face directory ties, by its ``config.json``: transformers' own tie map.

transformers ties a model's tensors by its class (``_tied_weights_keys``: ``{target:
ref}``) when its config's ``tie_word_embeddings`` is true (a vision-language model's
``text_config`` may hold it), the default of that config class where the key is absent.
:data:`FAMILIES` is that data for the families users load most, one home for the load,
``inspect`` and the MLX layout: by ``model_type``, the default of the key and, by
architecture (``config.json``'s ``architectures``), the ties. :func:`declared_ties` reads
a config against it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from sharetree._errors import TieError, error
from sharetree._files.disk import read_json
from sharetree._files.hf import CONFIG_FILE, EMBEDDINGS, MAX_CONFIG_BYTES, config_entry, head_of

__all__ = [
    "FAMILIES",
    "TIE_KEY",
    "Declared",
    "Family",
    "Stored",
    "declared_ties",
    "guessed_head",
    "held_ties",
    "read_hf_config",
]

TIE_KEY = "tie_word_embeddings"
"""The config key by which transformers ties a model's output embedding to its input one."""

_LM = {"lm_head.weight": "model.embed_tokens.weight"}  # a decoder-only LM's head and embedding
_T5 = {
    "encoder.embed_tokens.weight": "shared.weight",
    "decoder.embed_tokens.weight": "shared.weight",
}
_BART = {f"{k}.embed_tokens.weight": "shared.weight" for k in ("encoder", "decoder")}


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``model_type``: the default of ``tie_word_embeddings`` and each architecture's ties.

    ``default``: the config class's default where the key is absent; ``ties``: by
    architecture (a class name of ``config.json``'s ``architectures``), ``{target: ref}``
    as the class's ``_tied_weights_keys`` (an architecture with no head: ``{}``), tied when
    the key is true; ``always``: by architecture, the ties whatever the key says (an
    encoder-decoder's embeddings of the shared one, as T5's classes tie them).
    """

    default: bool
    ties: Mapping[str, Mapping[str, str]]
    always: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)


def _causal(prefix: str, default: bool) -> Family:
    """A decoder-only family whose ``<prefix>ForCausalLM`` ties ``lm_head`` to the embedding."""
    return Family(default, {f"{prefix}ForCausalLM": _LM, f"{prefix}Model": {}})


FAMILIES: Mapping[str, Family] = {
    "llama": _causal("Llama", False),
    "mistral": _causal("Mistral", False),
    "qwen2": _causal("Qwen2", False),
    "qwen3": _causal("Qwen3", False),
    "gemma": _causal("Gemma", True),
    "gemma2": _causal("Gemma2", True),
    "gemma3_text": Family(True, {"Gemma3ForCausalLM": _LM, "Gemma3TextModel": {}}),
    "phi3": _causal("Phi3", False),
    "gpt2": Family(
        True, {"GPT2LMHeadModel": {"lm_head.weight": "transformer.wte.weight"}, "GPT2Model": {}}
    ),
    "gpt_neox": Family(
        False,
        {
            "GPTNeoXForCausalLM": {"embed_out.weight": "gpt_neox.embed_in.weight"},
            "GPTNeoXModel": {},
        },
    ),
    "opt": Family(
        True,
        {"OPTForCausalLM": {"lm_head.weight": "model.decoder.embed_tokens.weight"}, "OPTModel": {}},
    ),
    # T5 v1.1 (tie_word_embeddings false) stores its own lm_head: untied, as it was trained
    # (transformers 5's T5Config sets the key true whatever the file says: its issue #48154)
    "t5": Family(
        True,
        {"T5ForConditionalGeneration": {"lm_head.weight": "shared.weight"}, "T5Model": {}},
        {
            "T5ForConditionalGeneration": _T5,
            "T5Model": _T5,
            "T5EncoderModel": {"encoder.embed_tokens.weight": "shared.weight"},
        },
    ),
    "bart": Family(
        True,
        {
            "BartForConditionalGeneration": {"lm_head.weight": "model.shared.weight"}
            | {f"model.{k}": f"model.{v}" for k, v in _BART.items()},
            "BartModel": _BART,
        },
    ),
    "bert": Family(
        True,
        {
            "BertForMaskedLM": {
                "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                "cls.predictions.decoder.bias": "cls.predictions.bias",
            },
            "BertModel": {},
        },
    ),
}
"""transformers' tie map by ``model_type`` (``tests/test_families.py`` checks each against it)."""


@dataclasses.dataclass(frozen=True)
class Declared:
    """The ties a config declares, and on what they rest.

    ``ties``: ``{target: ref}`` (``{}``: none); ``key``: where the decision was read
    (``tie_word_embeddings``, ``text_config.tie_word_embeddings``, or the family's default
    where the key is absent); ``tied``: what it says (``None``: the config does not say and
    the family is not known); ``covered``: whether the architecture is in :data:`FAMILIES`
    (if not, ``ties`` is empty and a tie the config declares is left to ``ties=``).
    """

    ties: Mapping[str, str]
    key: str
    tied: bool | None
    covered: bool
    architecture: str
    keyed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The ties the key decides for this architecture (tied when true), whatever it says."""


def _said(config: Mapping[str, Any]) -> tuple[str, Any]:
    """The config's ``tie_word_embeddings`` (top level, else its ``text_config``'s) and its key."""
    return config_entry(TIE_KEY, config)


def declared_ties(config: Mapping[str, Any]) -> Declared:
    """The ties ``config`` (a ``config.json``'s object) declares, as transformers makes them.

    Example:
        >>> d = declared_ties({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
        >>> dict(d.ties), d.key
        ({'lm_head.weight': 'transformer.wte.weight'}, 'tie_word_embeddings (absent: gpt2 ties)')
        >>> declared_ties({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
        ...                "tie_word_embeddings": False}).ties
        {}
    """
    key, said = _said(config)
    said = said if isinstance(said, bool) else None
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    archs = config.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    architecture = archs[0] if len(archs) == 1 else ", ".join(archs)
    covered = (
        family is not None and len(archs) == 1 and archs[0] in {**family.ties, **family.always}
    )
    tied = said
    if said is None and family is not None:
        tied = family.default
        key = f"{TIE_KEY} (absent: {model_type} {'ties' if tied else 'does not tie'})"
    if family is None or not covered:
        return Declared({}, key, tied, False, architecture)
    keyed = dict(family.ties.get(archs[0], {}))
    ties = {**family.always.get(archs[0], {}), **(keyed if tied else {})}
    return Declared(ties, key, tied, True, architecture, keyed)


# ----------------------------------------------------------------------------- the file against it


@dataclasses.dataclass(frozen=True)
class Stored:
    """The declared ties a file's tensors allow: ``{target: ref}`` to make, copies to drop.

    ``ties``: each declared tie whose ref the file holds (or whose target it holds alone,
    the buffer then stored under the target's name); ``dropped``: targets stored too,
    each equal to its ref within the dtype's rounding (one buffer is kept, the ref).
    """

    ties: Mapping[str, str]
    dropped: frozenset[str]
    problems: tuple[TieError, ...] = ()
    """Each contradiction found (E360, E361), in order: a load raises the first."""


def _differ(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference of two copies beyond their dtype's rounding (0.0: equal)."""
    if a.dtype.kind not in "fc":
        return 0.0 if np.array_equal(a, b) else float(np.max(np.abs(a.astype(np.float64) - b)))
    x, y = a.astype(np.float64), b.astype(np.float64)
    if np.array_equal(x, y, equal_nan=True):
        return 0.0
    info = jnp.finfo(a.dtype)  # one rounding of the larger of the two (bfloat16 too)
    diff = np.abs(x - y)
    tol = np.maximum(
        float(info.eps) * np.maximum(np.abs(x), np.abs(y)), float(info.smallest_subnormal)
    )
    over = diff > tol
    over |= np.isnan(x) != np.isnan(y)
    return float(np.nanmax(np.where(over, diff, 0.0))) if over.any() else 0.0


def _contradiction(
    label: str, declared: Declared, target: str, ref: str, found: str, atol: str
) -> TieError:
    """E360: the config ties ``target`` to ``ref`` and the file stores both, different."""
    where = f"load {label}: {target!r} and {ref!r}"
    problem = f"are stored as two different tensors, but config.json ties them ({declared.key})"
    fix = (
        f"load as stored: st.load(path, ties={{}}); or tied, keeping {ref!r} (as transformers "
        f"loads it): st.load(path, ties={{{target!r}: {ref!r}}}{atol}), or keeping {target!r}: "
        f"ties={{{ref!r}: {target!r}}}{atol}"
    )
    return error("E360", where, problem, found=found, fix=fix)


def held_ties(
    label: str,
    declared: Declared,
    tensors: Mapping[str, Any],
    file_ties: Mapping[str, str],
) -> Stored:
    """The declared ties against the file's tensors (each with ``shape``, ``dtype``, ``read()``).

    A tie whose ref and target are both stored compares them: equal within the dtype's
    rounding is one buffer; else E360 (a shape or dtype of their own too). A tie of the
    file's metadata (``file_ties``, ``{removed: kept}``) on a pair the config leaves untied
    is E361; on a pair it ties, the file's tie serves. Contradictions are returned in
    ``problems``, each with its tie left out of ``ties``.
    """
    ties: dict[str, str] = {}
    dropped: set[str] = set()
    problems: list[TieError] = []
    for removed, kept in file_ties.items():
        pair = {removed, kept}
        if declared.tied is False and any({t, r} == pair for t, r in declared.keyed.items()):
            where = (
                f"load {label}: the tie {removed!r} <- {kept!r} its safetensors metadata records"
            )
            problem = f"contradicts config.json, which leaves them untied ({declared.key}: false)"
            found = f"one tensor stored for both names, {kept!r}"
            fix = (
                f"set {declared.key} to true in config.json if the model is tied, or pass "
                "ties= to choose (ties= replaces what config.json declares)"
            )
            problems.append(error("E361", where, problem, found=found, fix=fix))
    for target, ref in declared.ties.items():
        if target in file_ties and file_ties[target] not in (ref, file_ties.get(ref)):
            kept = file_ties[target]
            where = f"load {label}: the tie {target!r} <- {kept!r} its safetensors metadata records"
            problem = f"contradicts config.json, which ties {target!r} to {ref!r} ({declared.key})"
            fix = f"pass ties= to choose: ties={{{target!r}: {kept!r}}} as the file stores it, "
            fix += f"or ties={{{target!r}: {ref!r}}} as config.json declares it"
            problems.append(error("E361", where, problem, found=f"{kept!r}", fix=fix))
            continue
        if target in file_ties:
            continue  # the file stores one tensor for both: its own tie serves
        if file_ties.get(ref) == target:  # stored under the target's name: moved to the ref
            ties[target] = ref
            continue
        if ref not in tensors and ref not in declared.ties:
            if target in tensors:  # stored under the target's name alone: the ref is its view
                ties[target] = ref
            continue  # neither stored: nothing to tie (the model's head is absent)
        if target in tensors and ref in tensors:
            a, b = tensors[target], tensors[ref]
            if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
                found = f"{target!r} {a.dtype}{list(a.shape)}, {ref!r} {b.dtype}{list(b.shape)}"
                problems.append(_contradiction(label, declared, target, ref, found, ""))
                continue
            if (d := _differ(np.asarray(a.read()), np.asarray(b.read()))) > 0.0:
                found = f"a largest difference of {d:.6g}"
                atol = f", atol={float(f'{d * 1.01:.2g}'):g}"  # the copy it drops: compared
                problems.append(_contradiction(label, declared, target, ref, found, atol))
                continue
            dropped.add(target)
        ties[target] = ref
    return Stored(ties, frozenset(dropped), tuple(problems))


def read_hf_config(directory: str) -> dict[str, Any] | None:
    """The ``config.json`` object of ``directory`` (``None``: it has none; E210 if not JSON)."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.lexists(path):  # not a regular file: read_json says so
        return None
    return read_json(
        path, "E210", "load", MAX_CONFIG_BYTES, "save the config again (save_pretrained)"
    )


def guessed_head(names: Iterable[str]) -> dict[str, str]:
    """``{head: embedding}`` of a file with one input embedding and no head, by MLX's names.

    The guess for a family :data:`FAMILIES` does not cover (``<...>.embed_tokens.weight``
    and ``lm_head.weight`` beside its ``model``), as ``mlx_lm`` names them; ``{}`` when
    the embedding is not one tensor or a head is stored.

    Example:
        >>> guessed_head(["model.embed_tokens.weight", "model.norm.weight"])
        {'lm_head.weight': 'model.embed_tokens.weight'}
    """
    names = list(names)
    weights = [n[: -len(".weight")] for n in names if n.endswith(".weight")]
    embeddings = [n for n in weights if n.rsplit(".", 1)[-1] in EMBEDDINGS]
    if len(embeddings) != 1 or head_of(embeddings[0]) in names:
        return {}
    return {head_of(embeddings[0]): f"{embeddings[0]}.weight"}
