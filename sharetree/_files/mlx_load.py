"""The tree of an MLX directory: each packed layer and its ``dequantize`` view, the tied head."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from sharetree._errors import (
    TieError,
    add_context,
    error,
    short,
)
from sharetree._files.hf import CONFIG_FILE, EMBEDDINGS, head_of
from sharetree._files.mlx_config import (
    CONVERT,
    NAMES,
    MlxConfig,
    Quant,
)
from sharetree._files.reads import Pending
from sharetree._materialize import abstract_expanded
from sharetree._tied import Tied
from sharetree._transforms import chain

__all__ = ["MlxTree", "mlx_tree"]


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
    fix = f"the tensors fit {' or '.join(fits)}: correct {CONFIG_FILE}" if fits else CONVERT
    if fits:
        fix += f' (a layer of its own: "quantization": {{{layer!r}: {{"bits", "group_size"}}}})'
    where = f"load {label}: the quantized layer {layer!r}"
    return error(
        "E212", where, f"does not match its config: {said}", expected=expected, found=found, fix=fix
    )


def _embedding(layers: Mapping[str, Any], names: set[str]) -> list[str]:
    """The layers that may be the input embedding: ``<...>.embed_tokens`` (packed or float)."""
    found = {n for n in layers} | {n[: -len(".weight")] for n in names if n.endswith(".weight")}
    return sorted(n for n in found if n.rsplit(".", 1)[-1] in EMBEDDINGS)


def _config_ties(
    label: str, config: MlxConfig, layers: Mapping[str, Quant], names: set[str]
) -> dict[str, str]:
    """``{head: embedding's weight}`` that ``tie_word_embeddings`` asks for (or implies)."""
    if config.tie is False:
        return {}
    candidates = _embedding(layers, names)
    heads = [h for h in map(head_of, candidates) if h in names]
    if config.tie is None:  # absent: transformers' default (tied) where the file has no head
        return (
            {head_of(candidates[0]): f"{candidates[0]}.weight"}
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
    return {head_of(candidates[0]): f"{candidates[0]}.weight"}


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
            raise error("E213", where, problem, expected=expected, found=held, fix=CONVERT)
        if layer in names:
            raise error("E213", where, "is also a tensor's name", found=repr(layer), fix=CONVERT)
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
            raise error("E213", where, problem, found=short(sorted(names), 200), fix=CONVERT)
    for name in sorted(names):
        stem = name[: -len(".weight")]
        if name.endswith(".weight") and stem not in layers and tensors[name].dtype == np.uint32:
            where = f"load {label}: the tensor {name!r}"
            problem = f"is packed (uint32) but has no {stem}.scales and {stem}.biases"
            expected = "a float weight, or a quantized layer's three tensors"
            raise error("E213", where, problem, expected=expected, found="uint32", fix=CONVERT)
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
        tree[layer] = {k: tensors[f"{layer}.{n}"] for k, n in NAMES.items()}
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
