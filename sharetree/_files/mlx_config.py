"""The quantization an MLX directory's ``config.json`` records, and MLX's names.

See the package's docstring for the layout.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from sharetree._errors import (
    TieError,
    add_context,
    error,
    short,
)
from sharetree._files.disk import read_json
from sharetree._files.hf import CONFIG_FILE, MAX_CONFIG_BYTES, config_entry
from sharetree._transforms import Transform, dequantize

__all__ = [
    "NAMES",
    "CONVERT",
    "Quant",
    "MlxConfig",
    "read_config",
]


_PARAMS = ("group_size", "bits", "mode")  # the keys of a quantization that are not layers

NAMES = {"q": "weight", "scales": "scales", "biases": "biases"}
"""The inputs of ``dequantize`` and the names MLX gives them (``<name>.weight`` is ``q``)."""

CONVERT = "quantize the model again with mlx_lm.convert (or st.save_mlx)"


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


def _config_error(path: str, problem: str, found: str | None = None, fix: str = "") -> TieError:
    return error("E210", f"load: {path!r}", problem, found=found, fix=fix or CONVERT)


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


def read_config(directory: str) -> MlxConfig | None:
    """The quantization of ``directory``'s ``config.json`` if it is MLX's, else ``None``.

    ``None`` too for a directory without ``config.json``, or whose quantization is another
    tool's (a ``quant_method``: those files load as their tensors, as any foreign file).
    """
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.lexists(path):  # not a regular file: read_json says so
        return None
    config = read_json(path, "E210", "load", MAX_CONFIG_BYTES, CONVERT)
    (qk, q), (ck, qc) = (
        config_entry("quantization", config),
        config_entry("quantization_config", config),
    )
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
    tk, tie = config_entry("tie_word_embeddings", config)
    if tie is not None and not isinstance(tie, bool):
        raise _config_error(
            path, f"{tk} is not true or false", short(tie, 60), "write true or false"
        )
    return MlxConfig(path, quant, layers, tie)
