"""PEFT's LoRA directories read: :func:`load_adapter` (``peft_save`` writes them).

A PEFT directory holds ``adapter_config.json`` and ``adapter_model.safetensors``, its
tensors named ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` (a Linear:
``W + s * B @ A``, ``W`` of shape ``(out, in)``) and ``<module>.lora_embedding_A`` /
``lora_embedding_B`` (an Embedding: ``W + s * A.T @ B.T``, ``W`` of ``(vocab, dim)``),
``s = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). In ``add_lora``'s terms
(``base + s * a @ b``) a Linear is ``a = B``, ``b = A`` (transposed, ``a = A.T``,
``b = B.T``, where ``fan_in_fan_out`` stores ``W`` as ``(in, out)``), an Embedding
``a = A.T``, ``b = B.T``. PEFT's tied convention (``ensure_weight_tying``) adapts the
embedding and gives the tied head the same factors, transposed: ``lora_A = B_emb.T``,
``lora_B = A_emb.T``; here that is one adapter on the shared table.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, NamedTuple

import jax
import numpy as np

from sharetree._adapters import Adapter, attach
from sharetree._errors import (
    TieError,
    error,
    short,
    wrong_type,
)
from sharetree._files.container import Reader
from sharetree._files.disk import PathOrStr, read_json
from sharetree._files.hf import MAX_CONFIG_BYTES
from sharetree._materialize import abstract_expanded, expanded_by_path, leaves_and_structure
from sharetree._paths import Path, closest, flattening, keypath_to_path, path_str
from sharetree._tied import is_tied
from sharetree._transforms import identity

__all__ = ["load_adapter", "adapter_dir_path", "CONFIG", "WEIGHTS", "PREFIX"]

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
"""PEFT's prefix of every tensor name (the ``PeftModel`` around the model)."""

_FIX_PEFT = "load it in PEFT and merge it (merge_and_unload), then st.load the merged model"

# options whose value is read, and options that change nothing in the weights (training
# settings, where the adapter came from); any other option set is refused, never ignored
_READ = {
    "peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
    "target_modules", "fan_in_fan_out", "modules_to_save", "ensure_weight_tying",
}  # fmt: skip
_INERT = {
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "auto_mapping",
    "peft_version", "lora_dropout", "exclude_modules", "megatron_core", "qalora_group_size",
    "runtime_config", "eva_config", "loftq_config", "lora_ga_config", "init_lora_weights",
    "layers_pattern",
}  # fmt: skip
# options whose value must be one of these (anything else changes what the layer computes)
_DEFAULTS: dict[str, tuple[Any, ...]] = {"bias": ("none",)}
_CHANGES_BASE = ("pissa", "olora", "corda", "loftq", "astra", "lora_ga")  # init rewrites W


class _Pair(NamedTuple):
    """One module's factors as the file names them: ``A``, ``B`` and their keys."""

    kind: str  # "linear" or "embedding"
    tensors: dict[str, np.ndarray]  # "A", "B"
    keys: dict[str, str]


class _Config(NamedTuple):
    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    fan_in_fan_out: bool
    modules_to_save: list[str]
    tied: bool


def _config_error(path: str, problem: str, found: str | None = None, fix: str = "") -> TieError:
    return error("E342", f"load_adapter: {path!r}", problem, found=found, fix=fix or _FIX_PEFT)


def _number(path: str, key: str, v: Any, *, integer: bool) -> Any:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not v > 0 or not math.isfinite(v):
        want = "an int >= 1" if integer else "a number > 0"
        raise _config_error(path, f"{key} is not {want}", short(v, 40))
    return v


def _pattern(path: str, key: str, v: Any, *, integer: bool) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _config_error(path, f"{key} is not an object", short(v, 40))
    return {k: _number(path, f"{key}[{k!r}]", x, integer=integer) for k, x in v.items()}


def _config(path: str) -> _Config:
    """``adapter_config.json`` checked: a LoRA of the options read, nothing else set."""
    data = read_json(path, "E342", "load_adapter", MAX_CONFIG_BYTES, _FIX_PEFT)
    if data.get("peft_type") != "LORA":
        found = f"peft_type {short(data.get('peft_type'), 40)}"
        raise _config_error(path, "is not a LoRA adapter", found, "load a LoRA (peft_type LORA)")
    for key, v in data.items():
        if key in _READ or key in _INERT:
            continue
        fine = _DEFAULTS.get(key, (None, False, {}, []))
        if v not in fine:
            found = f"{key} = {short(v, 60)}"
            problem = "sets an option sharetree does not apply (DoRA, bias training, ...)"
            raise _config_error(path, problem, found)
    init = data.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_CHANGES_BASE):
        found = f"init_lora_weights = {init!r} (it changes the base weights too)"
        raise _config_error(path, "sets an option sharetree does not apply", found)
    flags = {}
    for key in ("use_rslora", "fan_in_fan_out", "ensure_weight_tying"):
        v = data.get(key, False)
        if not isinstance(v, bool):
            raise _config_error(path, f"{key} is not true or false", short(v, 40))
        flags[key] = v
    saved = data.get("modules_to_save") or []
    if not isinstance(saved, list) or not all(isinstance(m, str) for m in saved):
        raise _config_error(path, "modules_to_save is not a list of names", short(saved, 60))
    return _Config(
        r=_number(path, "r", data.get("r"), integer=True),
        alpha=_number(path, "lora_alpha", data.get("lora_alpha"), integer=False),
        rslora=flags["use_rslora"],
        rank_pattern=_pattern(path, "rank_pattern", data.get("rank_pattern") or {}, integer=True),
        alpha_pattern=_pattern(
            path, "alpha_pattern", data.get("alpha_pattern") or {}, integer=False
        ),
        fan_in_fan_out=flags["fan_in_fan_out"],
        modules_to_save=saved,
        tied=flags["ensure_weight_tying"],
    )


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first key that matches the module name's end."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


_SUFFIXES = {
    ".lora_A.weight": ("linear", "A"),
    ".lora_B.weight": ("linear", "B"),
    ".lora_embedding_A": ("embedding", "A"),
    ".lora_embedding_B": ("embedding", "B"),
}


def _key_error(key: str, problem: str, fix: str, found: str | None = None) -> TieError:
    return error("E343", f"load_adapter: the tensor {key!r}", problem, found=found, fix=fix)


def _saved_module(name: str, modules: list[str]) -> bool:
    module = name.rsplit(".", 1)[0]
    return any(module == m or module.endswith("." + m) for m in modules)


class _Read(NamedTuple):
    pairs: dict[str, _Pair]  # module -> its factors
    bases: dict[str, tuple[str, np.ndarray]]  # tensor name in the tree -> (key, base copy)
    saved: dict[str, tuple[str, np.ndarray]]  # tensor name in the tree -> (key, new value)


def _tensors(reader: Reader, config: _Config) -> _Read:
    """The file's tensors sorted by what they are; a key of no known kind is E343."""
    pairs: dict[str, _Pair] = {}
    bases: dict[str, tuple[str, np.ndarray]] = {}
    saved: dict[str, tuple[str, np.ndarray]] = {}
    for key in reader.infos:
        if not key.startswith(PREFIX):
            fix = "save the adapter with PeftModel.save_pretrained"
            raise _key_error(key, f"does not start with PEFT's prefix {PREFIX!r}", fix)
        name = key[len(PREFIX) :]
        kind = next(((s, k) for s, k in _SUFFIXES.items() if name.endswith(s)), None)
        if kind is not None:
            suffix, (layer, which) = kind
            module = name[: -len(suffix)]
            pair = pairs.setdefault(module, _Pair(layer, {}, {}))
            if pair.kind != layer:
                problem = "holds factors of a Linear and of an Embedding for one module"
                raise _key_error(key, problem, "save the adapter again with PEFT")
            pair.tensors[which], pair.keys[which] = reader.read(key), key
        elif name.endswith(".base_layer.weight"):
            bases[name[: -len(".base_layer.weight")] + ".weight"] = (key, reader.read(key))
        elif _saved_module(name, config.modules_to_save):
            saved[name] = (key, reader.read(key))
        else:
            problem = "is no LoRA factor, base copy or modules_to_save entry sharetree reads"
            hint = (
                " (a DoRA magnitude or a trained bias)"
                if "magnitude" in key or "bias" in key
                else ""
            )
            raise _key_error(key, problem + hint, _FIX_PEFT)
    for pair in pairs.values():
        for which in ("A", "B"):
            if which not in pair.tensors:
                other = next(iter(pair.keys.values()))
                missing = other[: -len("A.weight")] if pair.kind == "linear" else other[:-1]
                missing += which + (".weight" if pair.kind == "linear" else "")
                raise _key_error(other, f"has no partner {missing!r}", "save the whole adapter")
    return _Read(pairs, bases, saved)


def _factors(module: str, pair: _Pair, config: _Config, shape: tuple[int, ...], at: str) -> Adapter:
    """The adapter ``base + s * a @ b`` of one module, its rank and shapes checked."""
    A, B = pair.tensors["A"], pair.tensors["B"]
    r = _pattern_value(config.rank_pattern, module, config.r)
    alpha = _pattern_value(config.alpha_pattern, module, config.alpha)
    where = f"load_adapter: {pair.keys['A']!r} at {at!r}"
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != r or B.shape[1] != r:
        found = f"A {list(A.shape)}, B {list(B.shape)}"
        fix = "give the r (or rank_pattern) the adapter was trained with"
        raise error("E344", where, f"has not the rank {r} its config gives", found=found, fix=fix)
    if pair.kind == "embedding":
        a, b = A.T, B.T
    elif config.fan_in_fan_out:
        a, b = A.T, B.T
    else:
        a, b = B, A
    if len(shape) != 2 or (a.shape[0], b.shape[1]) != shape:
        expected = f"a layer of shape {(a.shape[0], b.shape[1])} ({pair.kind})"
        fix = "load the base model the adapter was trained on"
        raise error("E344", where, expected=expected, found=f"{list(shape)} in the tree", fix=fix)
    s = alpha / (math.sqrt(r) if config.rslora else r)
    return Adapter(np.ascontiguousarray(a), np.ascontiguousarray(b), float(s))


def _is_tied_copy(head: _Pair, emb: _Pair) -> bool:
    """Whether a Linear's factors are PEFT's tied copy of an Embedding's (bit for bit)."""
    A, B = head.tensors["A"], head.tensors["B"]
    eA, eB = emb.tensors["A"], emb.tensors["B"]
    return (
        A.shape == eB.T.shape and B.shape == eA.T.shape and (A == eB.T).all() and (B == eA.T).all()
    )


def _tied_to(
    structure: Any,
    at: Path | None,
    pair: _Pair,
    names: dict[str, Path],
    embeddings: dict[str, _Pair],
) -> str | None:
    """The adapted embedding a Linear's position is tied to (PEFT's tied convention), if any.

    A position that is the embedding's view as it is; a position the tree lacks (its
    model reads the head from the embedding) where the factors are the embedding's copy.
    """
    for e, ep in embeddings.items():
        e_at = names.get(e + ".weight")
        if e_at is None:
            continue
        if at is None and _is_tied_copy(pair, ep):
            return e
        if at is not None and structure.reads.get(at) == {None: e_at}:
            if structure.ties[at].transform == identity:
                return e
    return None


def adapter_dir_path(directory: Any, verb: str) -> str:
    """The adapter directory as a str (a TieTypeError E346 for what is no path)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise wrong_type(
            "E346", f"{verb}: adapter_dir", "a directory path", directory, "pass a str"
        )
    return str(os.fspath(directory))


def load_adapter(adapter_dir: PathOrStr, tree: Any) -> dict[str, Any]:
    """Attach a PEFT LoRA directory to ``tree``, its base model: ``add_lora``'s structure.

    Every tensor of ``adapter_model.safetensors`` is used or named in an error: each
    module's ``lora_A`` / ``lora_B`` (Linear) or ``lora_embedding_A`` / ``_B`` (Embedding)
    becomes one adapter on the tree's ``<module>.weight``, with PEFT's scale
    (``lora_alpha / r``, ``rank_pattern`` / ``alpha_pattern``, ``use_rslora``,
    ``fan_in_fan_out``); the base copies PEFT saves beside an embedding adapter must equal
    the tree's; ``modules_to_save`` tensors replace their buffers. PEFT's tied convention
    (``ensure_weight_tying``: the head's factors the embedding's, transposed) is one
    adapter on the shared table, read by the lookup and a head tied to it.

    Args:
        adapter_dir: the directory ``PeftModel.save_pretrained`` wrote.
        tree: the base model's tree (dotted names, as ``st.load`` gives a Hugging Face
            directory; nested trees are matched by their ``.``-joined paths).

    Returns:
        ``{"params": ..., "lora": ...}`` as :func:`sharetree.add_lora` returns it:
        ``st.materialize`` gives the adapted weights, :func:`sharetree.merge_lora` merges.

    Raises:
        TieError: E342 (config: not LoRA, an option not applied), E343 (a tensor of no
            module of the tree, a factor without its partner), E344 (rank or shape),
            E345 (a base copy or tied copy that differs, a modules_to_save of a view),
            E346 (the directory); nothing is attached.

    Example:
        >>> import os, tempfile, numpy as np, sharetree as st
        >>> import jax
        >>> tree = {"embed.weight": np.zeros((6, 4), np.float32)}
        >>> tree["head.weight"] = st.Tied("embed.weight")
        >>> out = st.add_lora(tree, "embed.weight", rank=2, key=jax.random.key(0))
        >>> d = tempfile.mkdtemp()
        >>> st.save_adapter(d, out, embeddings=["embed"])
        >>> back = st.load_adapter(d, tree)
        >>> back["params"]["head.weight"], back["lora"]["embed.weight"]["a"].shape
        (Tied('embed.weight'), (6, 2))
    """
    directory = adapter_dir_path(adapter_dir, "load_adapter")
    config_path, weights_path = os.path.join(directory, CONFIG), os.path.join(directory, WEIGHTS)
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            there = (
                sorted(os.listdir(directory))[:8] if os.path.isdir(directory) else "no directory"
            )
            fix = "save it with PeftModel.save_pretrained (safetensors; .bin pickles are not read)"
            raise error("E346", f"load_adapter: {p!r}", "is missing", found=f"{there}", fix=fix)
    config = _config(config_path)
    read = _tensors(Reader(weights_path, "load_adapter"), config)
    _, structure = leaves_and_structure(tree)
    avals = abstract_expanded(tree)
    names = {".".join(map(str, p)): p for p in avals}
    adapters: dict[Path, Adapter] = {}
    embeddings = {m: p for m, p in read.pairs.items() if p.kind == "embedding"}
    for module, pair in read.pairs.items():
        at = names.get(module + ".weight")
        if pair.kind == "linear" and config.tied:
            tied_to = _tied_to(structure, at, pair, names, embeddings)
            if tied_to is not None:
                if not _is_tied_copy(pair, embeddings[tied_to]):
                    emb_key = embeddings[tied_to].keys["A"]
                    where = f"load_adapter: {pair.keys['A']!r} at {module!r}"
                    problem = f"is not the tied copy of {emb_key!r} (its factors transposed)"
                    fix = "save the adapter again with PEFT (ensure_weight_tying=True)"
                    raise error("E345", where, problem, fix=fix)
                continue  # the tied head's copy: the embedding's adapter is read by the head
        if at is None:
            hint = closest(module + ".weight", names)
            fix = f"load the model it adapts; {hint}"
            problem = f"adapts {module!r}, whose {module + '.weight'!r} is not in the tree"
            raise _key_error(pair.keys["A"], problem, fix)
        adapters[at] = _factors(module, pair, config, tuple(avals[at].shape), path_str(at))
    values = expanded_by_path(tree) if read.bases else {}
    for name, (key, copy) in read.bases.items():
        at = names.get(name)
        if at is None:
            raise _key_error(key, f"is a base copy of {name!r}, not in the tree", _FIX_PEFT)
        mine = np.asarray(values[at])
        if mine.dtype != copy.dtype or mine.shape != copy.shape or not (mine == copy).all():
            where = f"load_adapter: {key!r} at {path_str(at)!r}"
            found = f"{copy.dtype}{list(copy.shape)} in the adapter, {mine.dtype}{list(mine.shape)}"
            if mine.shape == copy.shape and mine.dtype == copy.dtype:
                diff = np.abs(mine.astype(np.float64) - copy.astype(np.float64)).max()
                found = f"values that differ by up to {diff:.3g}"
            problem = "is a base copy that differs from the tree's"
            fix = "load the base model the adapter was trained on"
            raise error("E345", where, problem, found=found, fix=fix)
    replaced: dict[Path, np.ndarray] = {}
    for name, (key, value) in read.saved.items():
        at = names.get(name)
        if at is None or at in structure.ties or at in adapters:
            what = "not in the tree" if at is None else "a view or an adapted position"
            fix = "load the tree of the model it adapts, or untie that position (st.untie)"
            raise error("E345", f"load_adapter: {key!r}", f"replaces {name!r}, {what}", fix=fix)
        aval = avals[at]
        if (tuple(aval.shape), aval.dtype) != (value.shape, value.dtype):
            found = f"{value.dtype}{list(value.shape)}, the tree's {aval.dtype}{list(aval.shape)}"
            raise error(
                "E344", f"load_adapter: {key!r}", "does not fit", found=found, fix=_FIX_PEFT
            )
        replaced[at] = value
    if replaced:
        with flattening(tree):
            tree = jax.tree_util.tree_map_with_path(
                lambda kp, x: replaced.get(keypath_to_path(kp), x), tree, is_leaf=is_tied
            )
    return attach(tree, adapters, "load_adapter")
