"""The ties a checkpoint other tools wrote shows, for ``python -m sharetree inspect``.

A file written by PyTorch or Hugging Face holds no tree and no ties, but it often shows
them: ``safetensors.torch.save_model`` records ``{removed: kept}`` in its metadata, a
state dict may hold one weight twice (as is, transposed, or as a slice of a fused
tensor), and a ``save_pretrained`` directory's ``config.json`` may say
``tie_word_embeddings`` while no head is stored. :func:`suggest_ties` finds these and
gives the ``ties=`` to pass to :func:`sharetree.load`, reading only what it must: a
tensor is read only when another one's shape allows a tie with it, one at a time, and
compared by a digest of its bytes (equal digests are then compared whole).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from sharetree._errors import TieError
from sharetree._files.container import CODES, Reader, TensorInfo
from sharetree._files.disk import read_json
from sharetree._files.foreign import metadata_ties
from sharetree._files.hf import (
    CONFIG_FILE,
    EMBEDDINGS,
    MAX_CONFIG_BYTES,
    head_of,
    ties_word_embeddings,
)
from sharetree._files.mlx_config import CONVERT, read_config
from sharetree._transforms import T, Transform, identity
from sharetree._transforms import slice as slice_

__all__ = ["Suggestion", "suggest_ties"]


_HEADS = ("lm_head.weight", "output.weight")
"""How they name the head a ``tie_word_embeddings`` model does not store."""


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One tie a checkpoint shows: ``target`` is ``transform(ref)``, and how it was seen.

    ``recorded``: the file's metadata records it (``st.load`` restores it unasked).
    """

    target: str
    ref: str
    transform: Transform
    why: str
    recorded: bool = False

    def code(self) -> str:
        """The ``ties=`` entry as Python: ``'head': 'embed'`` or ``'head': st.Tied(...)``."""
        if self.transform == identity:
            return f"{self.target!r}: {self.ref!r}"
        return f"{self.target!r}: st.Tied({self.ref!r}, st.{self.transform!r})"


@dataclasses.dataclass(frozen=True)
class _View:
    """A way a tie may see a tensor: as it is, transposed, or a part of one axis."""

    name: str
    transform: Transform
    axis: int = -1  # a part: its axis, first index and length
    start: int = 0
    length: int = 0

    def of(self, a: np.ndarray) -> np.ndarray:
        if self.transform == identity:
            return a
        if self.transform == T:
            return a.T
        return np.take(a, np.arange(self.start, self.start + self.length), axis=self.axis)


def _digest(a: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest()


def _constant(a: np.ndarray) -> bool:
    """A tensor of one value (a fresh bias, a norm's ones): never evidence of a tie."""
    flat = a.reshape(-1)
    return flat.size < 2 or bool((flat == flat[0]).all())


def _candidates(infos: list[TensorInfo]) -> tuple[set[str], dict[str, set[tuple[int, int]]]]:
    """Names whose shape allows a tie with another tensor, and the parts to try.

    Two tensors of one dtype may be tied when they have one shape, or two axes swapped (a
    transpose), or one shape but on one axis, which the larger divides into whole parts (a
    slice of a fused tensor): ``{name of the larger: {(axis, part length)}}``.
    """
    shapes: dict[tuple[str, tuple[int, ...]], list[str]] = defaultdict(list)
    for info in infos:
        if info.code in CODES and info.shape and 0 not in info.shape:
            shapes[(info.code, info.shape)].append(info.name)
    names: set[str] = set()
    parts: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for (code, shape), held in shapes.items():
        if len(held) > 1 or (len(shape) == 2 and (code, shape[::-1]) in shapes):
            names.update(held)
        for (other_code, other), smaller in shapes.items():
            if other_code != code or len(other) != len(shape):
                continue
            axes = [k for k in range(len(shape)) if other[k] != shape[k]]
            if len(axes) == 1 and other[axes[0]] < shape[axes[0]]:
                if shape[axes[0]] % other[axes[0]] == 0:
                    names.update(held + smaller)
                    for name in held:
                        parts[name].add((axes[0], other[axes[0]]))
    return names, parts


def _equal_ties(readers: list[Reader]) -> list[Suggestion]:
    """Tensors equal to another: as they are, transposed, or as a part of a fused one.

    Each candidate is read once, in file order, and its views' digests kept; a digest met
    again is confirmed by comparing the two tensors whole. The earlier tensor is the
    buffer (a head, ``lm_head.weight``, comes last: transformers' direction), except that a
    part is always a view of the fused tensor that holds it.
    """
    owner = {i.name: r for r in readers for i in r.infos.values()}
    # a head is the view of the embedding it equals (transformers' direction), whatever the order
    infos = sorted(
        (i for r in readers for i in r.infos.values()), key=lambda i: i.name.endswith(_HEADS)
    )
    names, parts = _candidates(infos)
    seen: dict[bytes, list[_View]] = defaultdict(list)
    found: dict[str, Suggestion] = {}

    def same(view: _View, value: np.ndarray) -> bool:
        return np.array_equal(view.of(owner[view.name].read(view.name)), value)

    for info in infos:
        if info.name not in names:
            continue
        a = owner[info.name].read(info.name)
        if _constant(a):
            continue
        views = [_View(info.name, identity)] + ([_View(info.name, T)] if a.ndim == 2 else [])
        for axis, n in sorted(parts.get(info.name, ())):
            views += [
                _View(info.name, slice_(i, i + n, axis=axis), axis, i, n)
                for i in range(0, a.shape[axis], n)
            ]
        digests = [_digest(v.of(a)) for v in views]
        # this tensor as a view of an earlier one (as it is, transposed, or one of its parts)
        match = next((v for v in seen.get(digests[0], ()) if same(v, a)), None)
        if match is not None:
            why = {identity: "equal", T: "equal to its transpose"}.get(match.transform, "a part")
            found[info.name] = Suggestion(info.name, match.name, match.transform, why)
            continue
        # an earlier tensor as a part of this one
        for view, digest in zip(views, digests, strict=True):
            if view.length:
                for earlier in seen.get(digest, ()):
                    if earlier.transform == identity and earlier.name not in found:
                        if same(earlier, view.of(a)):
                            why = "a part"
                            found[earlier.name] = Suggestion(
                                earlier.name, info.name, view.transform, why
                            )
        for view, digest in zip(views, digests, strict=True):
            seen[digest].append(view)
    return list(found.values())


def _config(path: str) -> dict[str, Any] | None:
    """The ``config.json`` in the directory ``path`` (or beside the file ``path``), if any.

    In a directory it is read as ``st.load`` reads it: a config that is not a regular
    file, not JSON or names a key twice is load's E210 here too. Beside a file (which
    ``st.load`` reads without it) an unreadable config is no config.
    """
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    file = os.path.join(folder, CONFIG_FILE)
    if not os.path.lexists(file):
        return None
    try:
        return read_json(file, "E210", "inspect", MAX_CONFIG_BYTES, CONVERT)
    except TieError:
        if os.path.isdir(path):
            raise
        return None


def _head_tie(names: Iterable[str], config: dict[str, object] | None) -> list[Suggestion]:
    """The head a config's ``tie_word_embeddings`` leaves out, read from the one embedding."""
    if config is None:
        return []
    said = ties_word_embeddings(config)
    if said is None:  # transformers' default (PretrainedConfig) ties when the config does not say
        said = "model_type" in config
    if said is not True:
        return []
    names = list(names)
    if any(n.endswith(h) for n in names for h in _HEADS):
        return []
    weights = [n[: -len(".weight")] for n in names if n.endswith(".weight")]
    embeddings = [n for n in weights if n.rsplit(".", 1)[-1] in EMBEDDINGS]
    if len(embeddings) != 1:
        return []
    (embed,) = embeddings
    head = head_of(embed)
    why = "config.json ties word embeddings (tie_word_embeddings) and no head is stored"
    return [Suggestion(head, f"{embed}.weight", identity, why)]


def suggest_ties(readers: list[Reader], path: str) -> list[Suggestion]:
    """Every tie the checkpoint shows: recorded in metadata, equal tensors, a missing head.

    Args:
        readers: the checkpoint's files (headers read).
        path: the file or directory, for its ``config.json``.

    Returns:
        The suggestions, recorded ones first (``recorded=True``: ``st.load`` restores
        them unasked), then tensors equal to earlier ones, then a head the config ties.

    Example:
        >>> import os, tempfile, numpy as np
        >>> from safetensors.numpy import save_file
        >>> from sharetree._files.container import Reader
        >>> from sharetree._files.suggest import suggest_ties
        >>> emb = np.arange(6.0, dtype=np.float32).reshape(3, 2)
        >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save_file({"emb": emb, "head": emb.T.copy()}, path)
        >>> [s.code() for s in suggest_ties([Reader(path)], path)]
        ["'head': st.Tied('emb', st.T)"]
    """
    names = {name: info for r in readers for name, info in r.infos.items()}
    out = [
        Suggestion(removed, kept, identity, "recorded in its metadata", recorded=True)
        for r in readers
        for removed, kept in metadata_ties(r.metadata, names).items()
    ]
    config = _config(path)
    equal = _equal_ties(readers)
    if os.path.isdir(path) and read_config(path) is not None:
        # MLX's layout: a quantized layer's tensors are one value (st.load's view of them)
        # and a stored target cannot be tied by ties= (E214): none of these would load
        equal = []
    out += _quantized_alike(equal, readers)
    have = set(names) | {s.target for s in out}
    out += [s for s in _head_tie(names, config) if s.target not in have]
    return out


def _quantized_alike(found: list[Suggestion], readers: list[Reader]) -> list[Suggestion]:
    """``found`` less the packed words of two quantized layers whose scales or biases differ.

    A quantized layer is ``<name>.weight`` (packed) beside ``<name>.scales`` and
    ``<name>.biases`` (MLX's names): two layers are equal only when all three are.
    """
    owner = {name: r for r in readers for name in r.infos}

    def triple(weight: str) -> tuple[str, str] | None:
        stem = weight[: -len(".weight")] if weight.endswith(".weight") else None
        parts = (f"{stem}.scales", f"{stem}.biases")
        return parts if stem and all(p in owner for p in parts) else None

    def equal(a: str, b: str) -> bool:
        return np.array_equal(owner[a].read(a), owner[b].read(b))

    out = []
    for s in found:
        mine, theirs = triple(s.target), triple(s.ref)
        if mine and theirs and s.transform == identity:
            if not all(equal(a, b) for a, b in zip(mine, theirs, strict=True)):
                continue  # the same packed words, other values: not a tie
        out.append(s)
    return out
