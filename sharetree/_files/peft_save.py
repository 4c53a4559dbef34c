"""PEFT's LoRA directories written: :func:`save_adapter` (the names: ``peft``).

Each adapted ``<module>.weight`` of ``add_lora``'s structure becomes PEFT's factors
(a Linear ``lora_A = b``, ``lora_B = a``; an Embedding ``lora_embedding_A = a.T``,
``lora_embedding_B = b.T``), a head tied to an adapted embedding its tied copy
(``lora_A = b``, ``lora_B = a`` of the embedding's adapter), as ``peft`` reads them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from sharetree._adapters import LORA, PARAMS, adapters_of
from sharetree._errors import TieError, check_mapping, error, wrong_type
from sharetree._files.container import write_tensors
from sharetree._files.disk import PathOrStr, text_writer, write_several
from sharetree._files.hf import EMBEDDINGS
from sharetree._files.peft import CONFIG, PREFIX, WEIGHTS, adapter_dir_path
from sharetree._materialize import expanded_by_path
from sharetree._paths import Path, path_str
from sharetree._transforms import identity, parts_of

__all__ = ["save_adapter"]


def _save_error(where: str, problem: str, found: str | None = None, fix: str = "") -> TieError:
    return error("E347", f"save_adapter: {where}", problem, found=found, fix=fix)


def _module(at: Path) -> str:
    """The PEFT module name of a position ``<module>.weight`` of ``params``."""
    name = ".".join(map(str, at[1:]))
    if not name.endswith(".weight"):
        fix = "adapt the weights of a tree st.load gave (its names are the model's)"
        raise _save_error(repr(path_str(at[1:])), "is no '<module>.weight' name", fix=fix)
    return name[: -len(".weight")]


def _alpha(r: int, s: float) -> float | int:
    alpha = s * r
    return int(alpha) if float(alpha).is_integer() else alpha


def save_adapter(
    adapter_dir: PathOrStr,
    tree: Any,
    base_model_name_or_path: str | None = None,
    *,
    embeddings: Iterable[str] | None = None,
    modules_to_save: Iterable[str] = (),
) -> None:
    """Write the adapters of ``tree`` (``add_lora``'s structure) as a PEFT LoRA directory.

    ``adapter_config.json`` and ``adapter_model.safetensors`` are written as
    ``PeftModel.save_pretrained`` writes them, committed together (the config last, a
    replaced file keeps its mode); only the adapters, never the base. Each adapted
    ``<module>.weight`` is a Linear (``lora_A`` / ``lora_B``) or, if its module's last
    name is an embedding's (``embed_tokens``, ``wte``, ``tok_embeddings``,
    ``word_embeddings`` or ``embeddings=``), an Embedding (``lora_embedding_A`` /
    ``_B``); each rank and scale is recorded (``r`` and ``lora_alpha`` the most common,
    ``rank_pattern`` / ``alpha_pattern`` the others). A head tied to an adapted
    embedding (a ``Tied`` of it, as ``st.load`` gives a tied model) is written in PEFT's
    tied convention (``ensure_weight_tying``, the head's factors the embedding's
    transposed), so PEFT applies the one adapter to both.

    Args:
        adapter_dir: the directory (created if missing).
        tree: ``{"params": ..., "lora": ...}`` from ``add_lora`` or ``load_adapter``.
        base_model_name_or_path: the base model's name or path, recorded in the config.
        embeddings: the last names of embedding modules, if not the usual ones.
        modules_to_save: modules trained whole (``"lm_head"``): each ``<module>.weight``,
            a buffer of ``params``, is written whole, as PEFT's ``modules_to_save``
            (``load_adapter`` puts such a tensor in place of its buffer; it is not an
            adapter, so it is written only where named here).

    Raises:
        TieError: E347, a tree PEFT cannot hold (not ``add_lora``'s structure, a stack of
            adapters, a name that is no module's weight, another view of an adapted
            embedding); E346, a bad directory. Nothing is written.

    Example:
        >>> import os, tempfile, jax, numpy as np, sharetree as st
        >>> from safetensors.numpy import load_file
        >>> tree = {"model.embed_tokens.weight": np.zeros((6, 4), np.float32)}
        >>> tree["lm_head.weight"] = st.Tied("model.embed_tokens.weight")
        >>> out = st.add_lora(tree, "model.embed_tokens.weight", rank=2, key=jax.random.key(0))
        >>> d = tempfile.mkdtemp()
        >>> st.save_adapter(d, out, base_model_name_or_path="tiny")
        >>> sorted(os.listdir(d))
        ['adapter_config.json', 'adapter_model.safetensors']
        >>> for k, v in sorted(load_file(os.path.join(d, "adapter_model.safetensors")).items()):
        ...     print(k, v.shape)
        base_model.model.lm_head.lora_A.weight (2, 4)
        base_model.model.lm_head.lora_B.weight (6, 2)
        base_model.model.model.embed_tokens.lora_embedding_A (2, 6)
        base_model.model.model.embed_tokens.lora_embedding_B (4, 2)
    """
    directory = adapter_dir_path(adapter_dir, "save_adapter")
    if base_model_name_or_path is not None and not isinstance(base_model_name_or_path, str):
        raise wrong_type("E347", "save_adapter(base_model_name_or_path=...)", "a str or None",
                         base_model_name_or_path, "pass the model's name")  # fmt: skip
    kinds = set(EMBEDDINGS if embeddings is None else embeddings)
    check_mapping(tree, "E347", "save_adapter", "the dict add_lora returns")
    if set(tree) != {PARAMS, LORA}:
        found = f"keys {sorted(map(str, tree))}"
        raise _save_error("tree", "is not add_lora's structure", found, "pass add_lora's output")
    structure, adapted = adapters_of(tree)
    if not adapted:
        raise _save_error("tree", "holds no adapter", fix="add_lora or load_adapter first")
    values = expanded_by_path(tree)
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, tuple[int, float]] = {}
    tied = False
    for at, t in adapted.items():
        module = _module(at)
        parts = parts_of(t.transform)
        a = np.asarray(values[(LORA, *at[1:], "a")])
        b = np.asarray(values[(LORA, *at[1:], "b")])
        if len(parts) != 1 or a.ndim != 2 or b.ndim != 2:
            found_ = f"{t!r}, a {list(a.shape)}, b {list(b.shape)}"
            fix = "PEFT holds one adapter of a matrix per module: adapt each layer's weight"
            raise _save_error(repr(path_str(at[1:])), "is no single LoRA of a matrix", found_, fix)
        r, s = a.shape[1], float(parts[0].scale)  # type: ignore[attr-defined]
        ranks[module] = (r, s)
        readers = [q for q, named in structure.reads.items() if at in named.values() and q != at]
        if module.rsplit(".", 1)[-1] in kinds:
            tensors[f"{PREFIX}{module}.lora_embedding_A"] = a.T
            tensors[f"{PREFIX}{module}.lora_embedding_B"] = b.T
            for q in readers:
                head = structure.ties[q]
                if structure.reads[q] != {None: at} or head.transform != identity or q[0] != PARAMS:
                    fix = "untie that view (st.untie) or adapt it on its own"
                    problem = f"reads the adapted embedding {path_str(at[1:])!r} as {head!r}"
                    problem += ": PEFT ties only a head equal to the embedding"
                    raise _save_error(repr(path_str(q)), problem, fix=fix)
                head_module = _module(q)
                tensors[f"{PREFIX}{head_module}.lora_A.weight"] = b
                tensors[f"{PREFIX}{head_module}.lora_B.weight"] = a
                tied = True
        else:
            if readers:
                shown = ", ".join(repr(path_str(q)) for q in readers[:3])
                problem = f"is read by the views {shown}, which PEFT cannot tie to a Linear"
                raise _save_error(repr(path_str(at[1:])), problem, fix="st.untie those views")
            tensors[f"{PREFIX}{module}.lora_A.weight"] = b
            tensors[f"{PREFIX}{module}.lora_B.weight"] = a
    saved = [modules_to_save] if isinstance(modules_to_save, str) else list(modules_to_save)
    for module in saved:
        at = (PARAMS, *module.split("."), "weight")
        at = at if at in values else (PARAMS, module + ".weight")
        if at not in values or at in structure.ties or at in adapted:
            fix = "name a module whose weight is a buffer of params, neither a view nor adapted"
            raise _save_error(f"modules_to_save {module!r}", "names no such weight", fix=fix)
        tensors[f"{PREFIX}{module}.weight"] = np.asarray(values[at])
    config = _config_dict(ranks, tied, base_model_name_or_path)
    config["modules_to_save"] = saved or None
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise error("E346", f"save_adapter: {directory!r}", "is a file", fix="give a directory")
    os.makedirs(directory, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    write_several(  # the config last: until it is in, the previous adapter is whole
        directory,
        [
            (
                os.path.join(directory, WEIGHTS),
                lambda tmp: write_tensors(tmp, tensors, {"format": "pt"}),
            ),
            (
                os.path.join(directory, CONFIG),
                text_writer(json.dumps(config, indent=2, sort_keys=True)),
            ),
        ],
    )


def _config_dict(
    ranks: Mapping[str, tuple[int, float]], tied: bool, base: str | None
) -> dict[str, Any]:
    """``adapter_config.json``: the most common rank and alpha, patterns for the others."""
    pairs = [(r, _alpha(r, s)) for r, s in ranks.values()]
    r, alpha = max(set(pairs), key=lambda p: (pairs.count(p), p))
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": alpha,
        "rank_pattern": {m: rm for m, (rm, _) in ranks.items() if rm != r},
        "alpha_pattern": {
            m: _alpha(rm, s) for m, (rm, s) in ranks.items() if _alpha(rm, s) != alpha
        },
        "target_modules": sorted(ranks),
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "ensure_weight_tying": tied,
        "inference_mode": True,
        "init_lora_weights": True,
    }
