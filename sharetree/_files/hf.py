"""Hugging Face's layout: its file, index and shard names; a directory checked by its index."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from sharetree._errors import error, short
from sharetree._files.container import Reader
from sharetree._files.disk import read_json
from sharetree._files.format import KEY_VERSION

__all__ = [
    "CONFIG_FILE",
    "EMBEDDINGS",
    "INDEX_FILE",
    "MAX_CONFIG_BYTES",
    "SINGLE_FILE",
    "WEIGHTS",
    "checkpoint_readers",
    "config_entry",
    "head_of",
]


SINGLE_FILE = "model.safetensors"
"""The weights file of a ``save_pretrained`` (or ``mlx_lm``) directory."""

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded directory (``weight_map``: tensor -> shard) (``mlx_lm``: always)."""

CONFIG_FILE = "config.json"
"""The model's configuration, where MLX records its quantization."""

WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""The weights files of a directory a sharded save replaces (as ``save_pretrained`` does)."""

_MAX_INDEX_BYTES = 64 << 20  # an index names tensors and files; anything larger is not one

_REWRITE = "write the index again (save_pretrained)"

_RESAVE = "save the checkpoint again"


def checkpoint_readers(path: str, reader: Reader | None = None) -> list[Reader]:
    """The safetensors files of ``path`` (a file, or a ``save_pretrained`` directory), headers read.

    ``reader``: the file's, if open. A directory's file written by ``st.save`` is refused.
    """
    if not os.path.isdir(path):
        return [Reader(path) if reader is None else reader]
    single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
    where = f"load: the directory {path!r}"
    if os.path.isfile(single) and os.path.isfile(index):
        readers = [_single_with_index(where, single, index)]
    else:
        readers = [Reader(single)] if os.path.isfile(single) else _shards(path, index)
    for r in readers:  # as a state dict, a file st.save wrote would lose its tree and ties
        if KEY_VERSION in r.metadata:
            ours = f"holds {os.path.basename(r.path)!r}, written by st.save"
            raise error("E53", where, ours, fix=f"load the file itself: st.load({r.path!r})")
    return readers


def _single_with_index(where: str, single: str, index: str) -> Reader:
    """``model.safetensors`` beside an index that names its tensors exactly, in it (``mlx_lm``).

    ``mlx_lm`` writes the index even for one file; an index that names another file, or
    other tensors, contradicts the file: E47.
    """
    reader, weight_map = Reader(single), _weight_map(index)
    both = f"holds both {SINGLE_FILE!r} and {INDEX_FILE!r}"
    if not isinstance(weight_map, dict):
        found = f"{INDEX_FILE!r} has no 'weight_map' object"
    elif others := sorted({str(v) for v in weight_map.values()} - {SINGLE_FILE}):
        found = f"the index names the shard(s) {short(others, 200)}"
    elif weight_map.keys() != reader.infos.keys():
        only_index = sorted(weight_map.keys() - reader.infos.keys())
        only_file = sorted(reader.infos.keys() - weight_map.keys())
        found = (
            f"tensors only in the index: {short(only_index[:5], 200) if only_index else 'none'}; "
        )
        found += f"only in the file: {short(only_file[:5], 200) if only_file else 'none'}"
    else:
        return reader
    fix = "remove the stale one, or load the file itself"
    raise error("E47", where, f"{both}, which disagree", found=found, fix=fix)


def _shards(path: str, index: str) -> list[Reader]:
    """The shards of the directory ``path``, checked against its ``index`` (tensor -> shard)."""
    if not os.path.isfile(index):
        neither = f"holds neither {SINGLE_FILE!r} nor {INDEX_FILE!r}"
        raise error("E47", f"load: the directory {path!r}", neither, fix=_NOT_PRETRAINED)
    weight_map = _weight_map(index)
    problem = _names_problem(path, weight_map)
    shards = [] if problem else dict.fromkeys(weight_map.values())
    readers = [Reader(os.path.join(path, shard)) for shard in shards]
    if problem := problem or _holdings_problem(readers, weight_map):
        raise error("E48", f"load: {index!r}", problem[0], fix=problem[1])
    return readers


_NOT_PRETRAINED = "restore an Orbax checkpoint with orbax.checkpoint (docs/saving_and_scaling.md);"
_NOT_PRETRAINED += " convert a pytorch_model.bin to safetensors first"


def _weight_map(index: str) -> Any:
    """The ``weight_map`` of the shard index ``index`` (``_names_problem`` checks it)."""
    data = read_json(index, "E48", "load", _MAX_INDEX_BYTES, _REWRITE)
    return data.get("weight_map")


def _names_problem(path: str, weight_map: Any) -> tuple[str, str] | None:
    """What is wrong with the ``weight_map`` of an index (problem, fix), or ``None``.

    Its shard names are file names in ``path``, and those files exist.
    """
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return "has no 'weight_map' object of tensor name -> shard file name", _REWRITE
    for name, shard in weight_map.items():
        if shard in ("", ".", "..") or os.path.basename(shard) != shard or "/" in shard:
            return f"puts {name!r} in {shard!r}, not a file name in its directory", _REWRITE
    for name, shard in weight_map.items():
        if not os.path.isfile(os.path.join(path, shard)):
            missing = f"names the shard {shard!r} (holding {name!r}), which does not exist"
            return missing, "copy the missing shard, or save the checkpoint again"
    return None


def _holdings_problem(readers: list[Reader], weight_map: dict[str, str]) -> tuple[str, str] | None:
    """What is wrong with the tensors the shards hold, against the index, or ``None``."""
    where: dict[str, str] = {}
    for reader in readers:
        shard = os.path.basename(reader.path)
        for name in reader.infos:
            if name in where:
                return f"has {name!r} stored in both {where[name]!r} and {shard!r}", _RESAVE
            where[name] = shard
    for name in {**where, **weight_map}:  # first the tensors of the shards, then the rest
        if name not in where:
            return f"puts {name!r} in {weight_map[name]!r}, but it is in no shard", _RESAVE
        if (listed := weight_map.get(name)) != where[name]:
            said = "does not list it" if listed is None else f"puts it in {listed!r}"
            problem = f"{said}, but the shard {where[name]!r} holds {name!r}"
            return problem, f"{_REWRITE}, or remove the stray shard"
    return None


MAX_CONFIG_BYTES = 16 << 20  # a configuration is small; anything larger is not one

EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
"""The last key of an input embedding's name in the models ``mlx_lm`` knows."""


def head_of(embedding: str) -> str:
    """The head's tensor name for an embedding: ``lm_head.weight`` beside its ``model``."""
    stem = "model." + embedding.rsplit(".", 1)[-1]
    prefix = embedding[: -len(stem)] if embedding.endswith(stem) else ""
    return f"{prefix}lm_head.weight"


def config_entry(name: str, config: Mapping[str, Any]) -> tuple[str, Any]:
    """``config[name]``, else the one in ``text_config`` (a vision-language model's)."""
    if name in config:
        return name, config[name]
    text = config.get("text_config")
    if isinstance(text, dict) and name in text:
        return f"text_config.{name}", text[name]
    return name, None
