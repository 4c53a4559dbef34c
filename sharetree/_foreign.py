"""Loading safetensors files that sharetree did not write (e.g. PyTorch state dicts)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from sharetree._errors import TieError
from sharetree._safetensors import Reader

__all__ = ["load_foreign", "KEY_VERSION"]

KEY_VERSION = "sharetree.format_version"
"""The metadata key that marks a file written by :func:`sharetree.save`."""


def load_foreign(path: str, *, like: Any = None) -> dict[str, np.ndarray]:
    """Load a safetensors file without sharetree metadata as a flat dict ``{name: array}``."""
    if os.path.isdir(path):
        raise TieError(
            f"load: {path!r} is a directory, not a safetensors file. If it is an Orbax "
            "checkpoint, restore it with orbax.checkpoint and an abstract canonical tree as "
            "target (see docs/saving_and_scaling.md)."
        )
    reader = Reader(path)
    if like is not None:
        raise TieError(
            f"load: {reader.path!r} was not written by sharetree (no {KEY_VERSION!r} in its "
            "metadata), so it has no tree structure to check against like=. Fix: load it "
            "without like (a flat dict {tensor name: array}), then build your tree from it."
        )
    tensors = dict(reader.tensors())
    warnings.warn(
        f"{reader.path!r} was not written by sharetree (no {KEY_VERSION!r} in its metadata): "
        f"loaded as a flat dict of {len(tensors)} arrays {{tensor name: array}}, without ties. "
        "Recover ties stored twice with st.tie(tree, st.find_ties(tree), atol=0.0).",
        UserWarning,
        stacklevel=3,
    )
    return tensors
