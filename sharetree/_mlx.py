"""MLX's quantized checkpoints, both ways: the tree of a directory ``mlx_lm`` wrote, ``save_mlx``.

MLX's layout (``mlx_lm.convert``, ``mlx_lm.utils.save_model`` / ``save_config``): a
quantized layer ``<name>`` is three tensors, ``<name>.weight`` (uint32, the packed values),
``<name>.scales`` and ``<name>.biases`` (see :func:`sharetree.dequantize`); a linear
layer's own ``<name>.bias`` sits beside them. ``config.json`` holds ``"quantization":
{"group_size", "bits", "mode"}`` (``mlx_lm`` writes the same dict as
``"quantization_config"`` too), where a layer quantized otherwise has an entry of its own
(``"<name>": {"group_size", "bits"}``, or ``false``: not quantized), and
``tie_word_embeddings``: the head is the embedding (``QuantizedEmbedding.as_linear``), and
the file holds no head tensor.

The tree (:func:`mlx_tree`) is the flat dict of the file's tensors with each quantized
layer's triple under ``<name>`` as ``{"q", "scales", "biases"}`` (what
:func:`sharetree.quantize` returns) and its float weight ``<name>.weight`` a
``dequantize`` view of it; a tied head ``lm_head.weight`` is the same view of the
embedding's triple. :func:`save_mlx` writes such a tree back in MLX's layout.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from sharetree._errors import (
    TieError,
    add_context,
    check_mapping,
    error,
    one_line,
    short,
    wrong_type,
)
from sharetree._materialize import abstract_expanded
from sharetree._safetensors import (
    DuplicateKey,
    PathOrStr,
    Pending,
    atomic_write,
    atomic_write_text,
    file_path,
    unique_pairs,
)
from sharetree._tied import Tied
from sharetree._transforms import Transform, chain, dequantize, identity

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "MlxConfig",
    "MlxTree",
    "Quant",
    "mlx_tree",
    "read_config",
    "save_mlx",
]

SINGLE_FILE = "model.safetensors"
"""The weights file of a ``save_pretrained`` (or ``mlx_lm``) directory."""

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded directory (``weight_map``: tensor -> shard) (``mlx_lm``: always)."""

CONFIG_FILE = "config.json"
"""The model's configuration, where MLX records its quantization."""

_MAX_CONFIG_BYTES = 16 << 20  # a configuration is small; anything larger is not one
_PARAMS = ("group_size", "bits", "mode")  # the keys of a quantization that are not layers
_EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
"""The last key of an input embedding's name in the models ``mlx_lm`` knows."""

_NAMES = {"q": "weight", "scales": "scales", "biases": "biases"}
"""The inputs of ``dequantize`` and the names MLX gives them (``<name>.weight`` is ``q``)."""

_CONVERT = "quantize the model again with mlx_lm.convert (or st.save_mlx)"


@dataclasses.dataclass(frozen=True)
class Quant:
    """How one layer is quantized: MLX's ``(bits, group_size, mode)``."""

    bits: int
    group_size: int
    mode: str = "affine"

    def transform(self) -> Transform:
        """The view of the layer's float weight: ``st.dequantize(bits, group_size, mode)``."""
        return dequantize(self.bits, self.group_size, self.mode)

    def entry(self) -> dict[str, Any]:
        """The layer's entry in ``config.json``, as ``mlx_lm`` writes it."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


@dataclasses.dataclass(frozen=True)
class MlxConfig:
    """The quantization of an MLX directory's ``config.json``, checked.

    ``layers``: the entries of layers quantized otherwise than ``quant`` (``False``: not
    quantized, ``True``: as ``quant``); ``tie``: ``tie_word_embeddings`` (``None``: absent).
    """

    path: str
    quant: Quant
    layers: Mapping[str, Quant | bool]
    tie: bool | None

    def of(self, layer: str) -> Quant | None:
        """How ``layer`` is quantized, by the config (``None``: not quantized)."""
        entry = self.layers.get(layer, True)
        return self.quant if entry is True else entry or None


# ----------------------------------------------------------------------------- reading


def _config_error(path: str, problem: str, found: str | None = None, fix: str = "") -> TieError:
    return error("E210", f"load: {path!r}", problem, found=found, fix=fix or _CONVERT)


def _read_json(path: str) -> Any:
    """The JSON object of ``path`` (E210 if too large, not JSON, a key twice)."""
    if os.path.getsize(path) > _MAX_CONFIG_BYTES:
        raise _config_error(path, f"is larger than {_MAX_CONFIG_BYTES >> 20} MiB")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw, object_pairs_hook=unique_pairs)
    except DuplicateKey as e:
        raise _config_error(path, f"names {e.key!r} twice", f"{e.first!r} and {e.second!r}") from e
    except (ValueError, RecursionError) as e:
        raise _config_error(path, "is not valid JSON", one_line(e)[:200]) from e
    if not isinstance(data, dict):
        raise _config_error(path, "is not a JSON object", type(data).__name__)
    return data


def _is_mlx(q: Any) -> bool:
    """Whether a ``quantization(_config)`` entry is MLX's (not another tool's ``quant_method``)."""
    return isinstance(q, dict) and "quant_method" not in q and ("bits" in q or "group_size" in q)


def _int(path: str, key: str, what: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _config_error(path, f"{key}: {what} is not an integer", short(v, 60))
    return v


def _quant(path: str, key: str, entry: dict[str, Any], *, layer: bool) -> Quant:
    """One quantization entry: the default, or a ``layer``'s (its missing sizes MLX's)."""
    extra = sorted(set(entry) - set(_PARAMS)) if layer else []
    if extra:
        problem = f"{key} has keys MLX's affine layers do not take: {', '.join(map(repr, extra))}"
        raise _config_error(path, problem, fix="keep group_size, bits and mode")
    for name in ("bits", "group_size"):
        if not layer and name not in entry:
            raise _config_error(path, f"{key} has no {name!r}", short(entry, 120))
    # a layer's dict is passed to MLX's to_quantized: a missing size is its default (64, 4)
    bits = _int(path, key, "bits", entry.get("bits", 4))
    group_size = _int(path, key, "group_size", entry.get("group_size", 64))
    mode = entry.get("mode", "affine")
    try:
        dequantize(bits, group_size, mode)  # E200 (sizes), E201 (mode), E73 (a mode not a str)
    except TieError as e:
        add_context(e, f"while reading {key} of {path!r}")
        raise
    return Quant(bits, group_size, mode)


def _entry(name: str, config: dict[str, Any]) -> tuple[str, Any]:
    """``config[name]``, else the one in ``text_config`` (a vision-language model's)."""
    if name in config:
        return name, config[name]
    text = config.get("text_config")
    if isinstance(text, dict) and name in text:
        return f"text_config.{name}", text[name]
    return name, None


def read_config(directory: str) -> MlxConfig | None:
    """The quantization of ``directory``'s ``config.json`` if it is MLX's, else ``None``.

    ``None`` too for a directory without ``config.json``, or whose quantization is another
    tool's (a ``quant_method``: those files load as their tensors, as any foreign file).
    """
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    config = _read_json(path)
    (qk, q), (ck, qc) = _entry("quantization", config), _entry("quantization_config", config)
    if not _is_mlx(q) and not _is_mlx(qc):
        if q is not None and not isinstance(q, dict):
            raise _config_error(path, f"{qk} is not an object", short(q, 120))
        return None
    if _is_mlx(q) and qc is not None and qc != q and _is_mlx(qc):
        where = f"load: {path!r}"
        problem = f"its {qk!r} and {ck!r} disagree (MLX reads {qk!r}; mlx_lm writes both alike)"
        found = f"{short(q, 200)} and {short(qc, 200)}"
        fix = f"make {ck!r} a copy of {qk!r}, or delete it"
        raise error("E211", where, problem, found=found, fix=fix)
    key, entry = (qk, q) if _is_mlx(q) else (ck, qc)
    quant = _quant(path, key, {k: entry[k] for k in _PARAMS if k in entry}, layer=False)
    layers: dict[str, Quant | bool] = {}
    for name, v in entry.items():
        if name in _PARAMS:
            continue
        if isinstance(v, bool):
            layers[name] = v
        elif isinstance(v, dict):
            layers[name] = _quant(path, f"{key}[{name!r}]", v, layer=True)
        else:
            problem = f"{key}[{name!r}] is not a layer's entry (a dict of sizes, true or false)"
            raise _config_error(path, problem, short(v, 120))
    tk, tie = _entry("tie_word_embeddings", config)
    if tie is not None and not isinstance(tie, bool):
        raise _config_error(
            path, f"{tk} is not true or false", short(tie, 60), "write true or false"
        )
    return MlxConfig(path, quant, layers, tie)


# ----------------------------------------------------------------------------- the tree


@dataclasses.dataclass(frozen=True)
class MlxTree:
    """The tree of an MLX directory and what was made of it (for the load's warning)."""

    tree: dict[str, Any]
    layers: Mapping[str, Quant]
    ties: Mapping[str, str]


def _triple(layer: str) -> dict[str, tuple[str, str]]:
    """The refs of a layer's packed triple: ``{"q": (layer, "q"), ...}``."""
    return {k: (layer, k) for k in ("q", "scales", "biases")}


def _shape_error(
    label: str, config: MlxConfig, layer: str, quant: Quant, tensors: Mapping[str, Pending]
) -> TieError | None:
    """E212 if the layer's tensors' shapes are not what its bits and group size imply."""
    w, s, b = (tensors[f"{layer}.{k}"] for k in ("weight", "scales", "biases"))
    lead, words = tuple(w.shape[:-1]), (w.shape[-1] if w.shape else 0)
    groups = s.shape[-1] if s.shape else 0
    n = words * 32 // quant.bits
    fine = (
        w.shape
        and s.shape == b.shape
        and tuple(s.shape[:-1]) == lead
        and words * 32 % quant.bits == 0
        and n == groups * quant.group_size
    )
    if fine:
        return None
    found = ", ".join(
        f"{layer}.{k} {tuple(t.shape)}" for k, t in zip(("weight", "scales", "biases"), (w, s, b))
    )
    per = config.layers.get(layer)
    said = f"{config.path!r} gives {layer!r}" + (" its own" if isinstance(per, Quant) else "")
    said += f" bits {quant.bits}, group_size {quant.group_size}"
    if words * 32 % quant.bits == 0 and n % quant.group_size == 0:
        expected = (
            f"scales and biases {(*lead, n // quant.group_size)} for a weight {tuple(w.shape)}"
        )
    else:
        expected = f"a weight of {quant.bits}-bit values in whole groups of {quant.group_size}"
    fits = [
        f"bits {bb}, group_size {g}"
        for bb in (2, 3, 4, 5, 6, 8)
        for g in (32, 64, 128)
        if words * 32 % bb == 0 and words * 32 // bb == groups * g
    ]
    fix = f"the tensors fit {' or '.join(fits)}: correct {CONFIG_FILE}" if fits else _CONVERT
    if fits:
        fix += f' (a layer of its own: "quantization": {{{layer!r}: {{"bits", "group_size"}}}})'
    where = f"load {label}: the quantized layer {layer!r}"
    return error(
        "E212", where, f"does not match its config: {said}", expected=expected, found=found, fix=fix
    )


def _embedding(layers: Mapping[str, Any], names: set[str]) -> list[str]:
    """The layers that may be the input embedding: ``<...>.embed_tokens`` (packed or float)."""
    found = {n for n in layers} | {n[: -len(".weight")] for n in names if n.endswith(".weight")}
    return sorted(n for n in found if n.rsplit(".", 1)[-1] in _EMBEDDINGS)


def _head_of(embedding: str) -> str:
    """The head's tensor name for an embedding: ``lm_head.weight`` beside its ``model``."""
    stem = "model." + embedding.rsplit(".", 1)[-1]
    prefix = embedding[: -len(stem)] if embedding.endswith(stem) else ""
    return f"{prefix}lm_head.weight"


def _config_ties(
    label: str, config: MlxConfig, layers: Mapping[str, Quant], names: set[str]
) -> dict[str, str]:
    """``{head: embedding's weight}`` that ``tie_word_embeddings`` asks for (or implies)."""
    if config.tie is False:
        return {}
    candidates = _embedding(layers, names)
    heads = [h for h in map(_head_of, candidates) if h in names]
    if config.tie is None:  # absent: transformers' default (tied) where the file has no head
        return (
            {_head_of(candidates[0]): f"{candidates[0]}.weight"}
            if len(candidates) == 1 and not heads
            else {}
        )
    where = f"load {label}: {config.path!r} sets tie_word_embeddings"
    if len(candidates) != 1:
        found = ", ".join(map(repr, candidates)) or "no '<...>.embed_tokens.weight'"
        fix = "name the tie: st.load(path, ties={'lm_head.weight': '<embedding>.weight'})"
        raise error("E214", where, "but the input embedding is not one layer", found=found, fix=fix)
    if heads:
        found = f"{heads[0]!r} beside {candidates[0]!r}"
        fix = "pass ties={} to keep the file's head untied, or remove the head tensor"
        raise error(
            "E214",
            where,
            "but the file holds the head too (MLX would drop it)",
            found=found,
            fix=fix,
        )
    return {_head_of(candidates[0]): f"{candidates[0]}.weight"}


def _layers(label: str, tensors: Mapping[str, Pending], config: MlxConfig) -> dict[str, Quant]:
    """The quantized layers of the file and their sizes, each whole and fitting its config.

    A layer is quantized if it has ``<name>.scales`` (as ``mlx_lm`` decides), or if the
    config quantizes a layer whose ``<name>.weight`` the file holds.
    """
    names = set(tensors)
    packed = {n[: -len(".scales")] for n in names if n.endswith(".scales")}
    packed |= {k for k, v in config.layers.items() if v is not False and f"{k}.weight" in names}
    layers: dict[str, Quant] = {}
    for layer in sorted(packed):
        quant, where = config.of(layer), f"load {label}: the quantized layer {layer!r}"
        parts = [f"{layer}.{k}" for k in ("weight", "scales", "biases")]
        if quant is None:
            problem = f"holds {layer}.scales, but {config.path!r} says the layer is not quantized"
            fix = f"remove {layer!r}: false from its quantization"
            raise error("E213", where, problem, found="false", fix=fix)
        if missing := [n for n in parts if n not in names]:
            held = ", ".join(sorted(n for n in names if n.startswith(f"{layer}.")))
            expected = f"{layer}.weight (uint32), {layer}.scales and {layer}.biases (affine)"
            problem = f"lacks {', '.join(missing)}"
            raise error("E213", where, problem, expected=expected, found=held, fix=_CONVERT)
        if layer in names:
            raise error("E213", where, "is also a tensor's name", found=repr(layer), fix=_CONVERT)
        if (e := _shape_error(label, config, layer, quant, tensors)) is not None:
            raise e
        layers[layer] = quant
    for layer, v in config.layers.items():
        if (
            v is not False
            and layer not in layers
            and not any(n.startswith(f"{layer}.") for n in names)
        ):
            where = f"load {label}: {config.path!r}"
            problem = f"quantizes the layer {layer!r}, of which the file holds no tensor"
            raise error("E213", where, problem, found=short(sorted(names), 200), fix=_CONVERT)
    for name in sorted(names):
        stem = name[: -len(".weight")]
        if name.endswith(".weight") and stem not in layers and tensors[name].dtype == np.uint32:
            where = f"load {label}: the tensor {name!r}"
            problem = f"is packed (uint32) but has no {stem}.scales and {stem}.biases"
            expected = "a float weight, or a quantized layer's three tensors"
            raise error("E213", where, problem, expected=expected, found="uint32", fix=_CONVERT)
    return layers


def _tie(
    label: str, tree: dict[str, Any], layers: Mapping[str, Quant], target: str, t: Tied
) -> str:
    """Put the tie ``target <- t`` (one tensor name) into ``tree``; its ref's name."""
    (ref,) = t.ref
    where = f"load {label}: tie {target!r} <- {ref!r}"
    if target in tree:
        fix = "leave it out of ties= (an MLX directory's head is absent when tied)"
        raise error("E214", where, "but the file holds the target", found=repr(target), fix=fix)
    stem = ref[: -len(".weight")] if ref.endswith(".weight") else ""
    if stem in layers:  # the packed layer's view, then the tie's own transform
        tree[target] = Tied(_triple(stem), chain(layers[stem].transform(), t.transform))
    elif ref in tree and not isinstance(tree[ref], (Tied, dict)):
        tree[target] = Tied((ref,), t.transform)
    else:
        fix = "tie to a float tensor or a quantized layer's '<name>.weight'"
        raise error("E214", where, "but the file holds no such weight", found=repr(ref), fix=fix)
    return ref


def mlx_tree(
    label: str,
    tensors: Mapping[str, Pending],
    config: MlxConfig,
    ties: Mapping[str, Tied] | None,
    file_ties: Mapping[str, str],
) -> MlxTree:
    """The canonical flat dict of an MLX directory's tensors (not read yet).

    Each quantized layer ``<name>`` becomes ``tree[<name>] = {"q", "scales", "biases"}``
    and the view ``tree[<name>.weight]``; every other tensor stays as it is. ``ties``:
    ``{target: Tied((name,), transform)}`` (``None``: those of ``tie_word_embeddings``),
    after the file's own ``file_ties`` (``{dropped: kept}`` of its metadata); a ref naming
    a quantized layer's weight is that layer's view.
    """
    layers = _layers(label, tensors, config)
    stored = {f"{layer}.{k}" for layer in layers for k in ("weight", "scales", "biases")}
    tree: dict[str, Any] = {n: t for n, t in tensors.items() if n not in stored}
    for layer, quant in layers.items():
        tree[layer] = {k: tensors[f"{layer}.{n}"] for k, n in _NAMES.items()}
        tree[f"{layer}.weight"] = Tied(_triple(layer), quant.transform())
    if ties is None:
        names = set(tensors)
        ties = {k: Tied((v,)) for k, v in _config_ties(label, config, layers, names).items()}
    wanted = {**{d: Tied((k,)) for d, k in file_ties.items()}, **ties}
    made = {target: _tie(label, tree, layers, target, t) for target, t in wanted.items()}
    try:
        abstract_expanded(tree)  # dtypes of the triples (E202, E203), every view's shape
    except TieError as e:
        add_context(e, f"while loading {label} in MLX's quantized layout ({config.path!r})")
        raise
    return MlxTree(dict(sorted(tree.items())), layers, made)


# ----------------------------------------------------------------------------- saving


def _save_error(where: str, problem: str, found: str | None = None, fix: str = "") -> TieError:
    return error("E215", f"save_mlx: {where}", problem, found=found, fix=fix)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (Tied, Mapping))


def _dequantized(t: Tied, packed: Mapping[str, Any]) -> tuple[str, Quant] | None:
    """``(layer, quant)`` if ``t`` is exactly ``dequantize`` of a packed layer of the tree."""
    if t.inputs != ("biases", "q", "scales"):
        return None
    keys = {name: ref.keys for name, ref in t.refs if ref.up is None}
    layers = {k[0] for k in keys.values() if len(k) == 2}
    if len(keys) != 3 or len(layers) != 1 or (layer := layers.pop()) not in packed:
        return None
    if keys != {k: (layer, k) for k in ("biases", "q", "scales")}:
        return None
    spec = t.transform.spec()
    if spec.get("name") != "dequantize":
        return None
    return layer, Quant(spec["bits"], spec["group_size"], spec["mode"])


def _head_embedding(
    k: str, t: Tied, tree: Mapping[str, Any], packed: Mapping[str, Any], got: Any
) -> str | None:
    """The input embedding the view ``tree[k]`` ties the head to, or ``None``."""
    if got is not None:
        embedding = got[0]
    elif t.inputs is None and t.transform == identity and t.up is None and len(t.ref) == 1:
        name = t.ref[0]
        embedding = name[: -len(".weight")] if name.endswith(".weight") else ""
        ref = tree.get(name)  # a float weight, or a packed layer's view: Tied("<emb>.weight")
        own = isinstance(ref, Tied) and (_dequantized(ref, packed) or ("",))[0] == embedding
        if not (_is_array(ref) or own):
            return None
    else:
        return None
    last = embedding.rsplit(".", 1)[-1]
    return embedding if last in _EMBEDDINGS and k == _head_of(embedding) else None


def _classify(tree: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Quant], str | None]:
    """The packed layers, each layer's quantization (from its view) and the tied head."""
    packed: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            if sorted(v) != ["biases", "q", "scales"] or not all(map(_is_array, v.values())):
                fix = "put a layer's st.quantize(...) dict there, or a float array"
                problem = "is a dict that is not a packed layer {q, scales, biases}"
                raise _save_error(repr(k), problem, f"keys {sorted(map(str, v))}", fix)
            packed[k] = v
        elif not isinstance(v, Tied) and not _is_array(v):
            fix = "keep only arrays, packed layers and views"
            raise _save_error(repr(k), "is not an array", type(v).__name__, fix)
    quants: dict[str, Quant] = {}
    heads: dict[str, str] = {}
    for k, t in tree.items():
        if not isinstance(t, Tied):
            continue
        got = _dequantized(t, packed)
        if got is not None and k == f"{got[0]}.weight":
            quants[got[0]] = got[1]
        elif (embedding := _head_embedding(k, t, tree, packed, got)) is not None:
            heads[k] = embedding
        else:
            fix = "keep it out of the tree (st.untie(tree, [path]) stores its value as an array)"
            problem = "is a view MLX's layout cannot hold (it holds quantized layers' weights "
            problem += "and the head tied to the input embedding as it is)"
            raise _save_error(f"the view {k!r}", problem, repr(t), fix)
    for layer in packed:
        if layer not in quants:
            fix = f"tie its weight: tree[{layer + '.weight'!r}] = st.Tied({{'q': ({layer!r}, "
            fix += "'q'), ...}, st.dequantize(bits, group_size))"
            problem = "has no view '<name>.weight': its bits and group size are unknown"
            raise _save_error(f"the packed layer {layer!r}", problem, None, fix)
    for k, embedding in heads.items():
        got = _dequantized(tree[k], packed)
        if got is not None and got[1] != quants[embedding]:
            found = f"{tree[k]!r}, the embedding's {quants[embedding].transform()!r}"
            problem = "dequantizes its table otherwise than the embedding does"
            raise _save_error(f"the head {k!r}", problem, found, "tie it as the embedding is")
    return packed, quants, next(iter(heads), None)


def _parameters(tensors: Mapping[str, np.ndarray], quants: Mapping[str, Quant]) -> int:
    """The count ``mlx_lm``'s index records: a packed weight's values, no scales and biases."""
    n = 0
    for name, a in tensors.items():
        layer, _, kind = name.rpartition(".")
        if layer in quants and kind in ("scales", "biases"):
            continue
        n += a.size * 32 // quants[layer].bits if layer in quants and kind == "weight" else a.size
    return n


def _numpy(x: Any) -> np.ndarray:
    a = np.asarray(x)
    return a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)


def save_mlx(directory: PathOrStr, tree: Any, *, config: Mapping[str, Any] | None = None) -> None:
    """Write a tree in MLX's quantized layout: a directory ``mlx_lm`` and ``mx.load`` read.

    ``tree`` is the flat dict :func:`sharetree.load` gives for such a directory: each
    quantized layer ``<name>`` a packed dict ``{"q", "scales", "biases"}`` (as
    :func:`sharetree.quantize` returns) whose float weight ``<name>.weight`` is its
    ``st.dequantize(bits, group_size)`` view, other tensors as arrays, and the head,
    ``lm_head.weight``, either an array or the embedding's own view (a tied head). The
    directory gets ``model.safetensors`` (``<name>.weight`` uint32, ``<name>.scales``,
    ``<name>.biases``; the packed table once, no head tensor when tied), the
    ``model.safetensors.index.json`` that ``mlx_lm`` writes beside it, and ``config.json``:
    ``config`` (the model's own configuration) with ``"quantization"`` and
    ``"quantization_config"`` (the most common sizes, a layer quantized otherwise under its
    own name) and ``tie_word_embeddings``. Each file is written atomically (a replaced
    file keeps its mode); every check runs before anything is written.

    Args:
        directory: the directory (created if missing; other ``model*.safetensors`` files in
            it are refused: MLX would load them too).
        tree: the flat dict.
        config: the model's configuration (``config.json`` of the source, read with
            ``json.load``), or ``None`` for only the keys above.

    Raises:
        TieError: a tree MLX's layout cannot hold (a view other than those above, a packed
            layer without its view), a bad directory or ``config``; nothing is written.

    Example:
        >>> import json, os, tempfile, numpy as np, sharetree as st
        >>> emb = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
        >>> refs = {"q": ("model.embed_tokens", "q"), "scales": ("model.embed_tokens", "scales"),
        ...         "biases": ("model.embed_tokens", "biases")}
        >>> tree = {"model.embed_tokens": st.quantize(emb, 4, 64),
        ...         "model.embed_tokens.weight": st.Tied(refs, st.dequantize(4, 64)),
        ...         "lm_head.weight": st.Tied(refs, st.dequantize(4, 64))}
        >>> out = tempfile.mkdtemp()
        >>> st.save_mlx(out, tree)
        >>> sorted(os.listdir(out))
        ['config.json', 'model.safetensors', 'model.safetensors.index.json']
        >>> json.load(open(os.path.join(out, "config.json")))["quantization"]
        {'group_size': 64, 'bits': 4, 'mode': 'affine'}
    """
    directory = file_path(directory, "save_mlx")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise error(
            "E216",
            f"save_mlx: {directory!r}",
            "is a file; MLX's layout is a directory",
            fix="give a directory's path",
        )
    if config is not None:
        check_mapping(
            config,
            "E216",
            "save_mlx: config=",
            "the model's config.json as a dict",
            "pass json.load(open(src/'config.json'))",
        )
        try:
            json.dumps(dict(config), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise error(
                "E216",
                "save_mlx: config=",
                "is not JSON",
                found=one_line(e)[:200],
                fix="pass what json.load gave",
            ) from e
    if not isinstance(tree, dict) or not all(isinstance(k, str) for k in tree):
        raise wrong_type(
            "E215",
            "save_mlx: the tree",
            "a flat dict {tensor name: array, packed layer or view}",
            tree,
            "pass the dict st.load gave for an MLX directory",
        )
    abstract_expanded(tree)  # the graph and every view first
    packed, quants, head = _classify(tree)
    tensors: dict[str, np.ndarray] = {k: _numpy(v) for k, v in tree.items() if _is_array(v)}
    for layer, p in packed.items():
        for key, name in (("q", "weight"), ("scales", "scales"), ("biases", "biases")):
            if (full := f"{layer}.{name}") in tensors:
                raise _save_error(
                    repr(full),
                    f"is both a tensor and part of the packed layer {layer!r}",
                    None,
                    "rename one",
                )
            tensors[full] = _numpy(p[key])
    counts = collections.Counter(quants.values())
    # the most layers' sizes; on a tie MLX's default (4, 64), then the most bits
    default = Quant(4, 64)
    top = max(counts, key=lambda q: (counts[q], q == default, q.bits, q.group_size), default=None)
    others = (
        [
            n
            for n in os.listdir(directory)
            if n.startswith("model") and n.endswith(".safetensors") and n != SINGLE_FILE
        ]
        if os.path.isdir(directory)
        else []
    )
    if others:
        fix = "write to an empty directory, or remove them"
        raise error(
            "E216",
            f"save_mlx: {directory!r}",
            "holds other weight files that MLX would load too",
            found=", ".join(sorted(others)[:5]),
            fix=fix,
        )
    out = dict(config or {})
    if top is not None:
        quantization: dict[str, Any] = top.entry()
        quantization.update({layer: q.entry() for layer, q in sorted(quants.items()) if q != top})
        out["quantization"] = quantization
        out["quantization_config"] = dict(quantization)
    else:
        out.pop("quantization", None)
        out.pop("quantization_config", None)
    out["tie_word_embeddings"] = head is not None
    params = _parameters(tensors, quants)
    index = {
        "metadata": {
            "total_size": sum(a.nbytes for a in tensors.values()),
            "total_parameters": params,
        },
        "weight_map": dict.fromkeys(sorted(tensors), SINGLE_FILE),
    }
    os.makedirs(directory, exist_ok=True)
    atomic_write(os.path.join(directory, SINGLE_FILE), tensors, {"format": "mlx"})
    atomic_write_text(os.path.join(directory, INDEX_FILE), json.dumps(index, indent=4))
    atomic_write_text(
        os.path.join(directory, CONFIG_FILE), json.dumps(dict(sorted(out.items())), indent=4)
    )
