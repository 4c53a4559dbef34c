"""``save_mlx``: a tree of packed layers and their views, written in MLX's layout."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from sharetree._errors import (
    TieError,
    check_mapping,
    error,
    one_line,
    wrong_type,
)
from sharetree._files.container import write_tensors
from sharetree._files.disk import PathOrStr, file_path, text_writer, write_several
from sharetree._files.hf import CONFIG_FILE, EMBEDDINGS, INDEX_FILE, SINGLE_FILE, head_of
from sharetree._files.mlx_config import Quant
from sharetree._materialize import abstract_expanded
from sharetree._tied import Tied
from sharetree._transforms import identity

__all__ = ["save_mlx"]


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
    return embedding if last in EMBEDDINGS and k == head_of(embedding) else None


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
    config_text = json.dumps(dict(sorted(out.items())), indent=4)
    write_several(  # the config last: until it is in, the previous checkpoint is whole
        directory,
        [
            (
                os.path.join(directory, SINGLE_FILE),
                lambda tmp: write_tensors(tmp, tensors, {"format": "mlx"}),
            ),
            (os.path.join(directory, INDEX_FILE), text_writer(json.dumps(index, indent=4))),
            (os.path.join(directory, CONFIG_FILE), text_writer(config_text)),
        ],
    )
