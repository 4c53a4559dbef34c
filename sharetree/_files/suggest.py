"""The ties a checkpoint other tools wrote shows, for ``python -m sharetree inspect``.

A file written by PyTorch or Hugging Face holds no tree and no ties, but it often shows
them: ``safetensors.torch.save_model`` records ``{removed: kept}`` in its metadata, a
state dict may hold one weight twice (as is, transposed, or as a slice of a fused
tensor), and a ``save_pretrained`` directory's ``config.json`` may say
``tie_word_embeddings`` while no head is stored. :func:`suggest_ties` finds these and
gives the ``ties=`` to pass to :func:`sharetree.load`, reading only what it must: a
tensor is read only when another one's shape allows a tie with it, one at a time, and
offered to the one tie matcher of ``find_ties`` (sharetree._match): a fingerprint of its
elements, then a whole comparison, bit for bit; a tensor of one value is never a tie.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from typing import Any

import jax.numpy as jnp
import numpy as np

from sharetree._errors import TieError
from sharetree._files.container import CODES, Reader, TensorInfo
from sharetree._files.disk import read_json
from sharetree._files.families import declared_ties, guessed_head, held_ties
from sharetree._files.foreign import metadata_ties
from sharetree._files.hf import CONFIG_FILE, MAX_CONFIG_BYTES
from sharetree._files.mlx_config import CONVERT, read_config
from sharetree._files.reads import Tensor
from sharetree._match import Matcher, View, constant
from sharetree._transforms import T, Transform, identity
from sharetree._transforms import slice as slice_

__all__ = ["Suggestion", "contradictions", "suggest_ties"]


_HEADS = ("lm_head.weight", "output.weight")
"""How they name the head a ``tie_word_embeddings`` model does not store."""


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One tie a checkpoint shows: ``target`` is ``transform(ref)``, and how it was seen.

    ``recorded``: the file's metadata records it or its ``config.json`` declares it
    (``st.load`` makes it unasked).
    """

    target: str
    ref: str
    transform: Transform
    why: str
    recorded: bool = False
    declared: bool = False
    """``config.json`` declares it: ``st.load`` makes it unless ``ties=`` is given."""

    def code(self) -> str:
        """The ``ties=`` entry as Python: ``'head': 'embed'`` or ``'head': st.Tied(...)``."""
        if self.transform == identity:
            return f"{self.target!r}: {self.ref!r}"
        return f"{self.target!r}: st.Tied({self.ref!r}, st.{self.transform!r})"


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

    Each candidate is read once, in file order, and offered to the tie matcher (which keeps
    its views' fingerprints and reads a tensor again to compare a candidate whole). The
    earlier tensor is the buffer (a head, ``lm_head.weight``, comes last: transformers'
    direction), except that a part is always a view of the fused tensor that holds it.
    """
    owner = {i.name: r for r in readers for i in r.infos.values()}
    # a head is the view of the embedding it equals (transformers' direction), whatever the order
    infos = sorted(
        (i for r in readers for i in r.infos.values()), key=lambda i: i.name.endswith(_HEADS)
    )
    names, parts = _candidates(infos)
    matcher = Matcher(lambda name: owner[name].read(name))
    found: dict[str, Suggestion] = {}
    for info in infos:
        if info.name not in names:
            continue
        a = owner[info.name].read(info.name)
        if constant(a):
            continue
        views = [View(info.name, identity)] + ([View(info.name, T)] if a.ndim == 2 else [])
        for axis, n in sorted(parts.get(info.name, ())):
            views += [
                View(info.name, slice_(i, i + n, axis=axis)) for i in range(0, a.shape[axis], n)
            ]
        # this tensor as a view of an earlier one (as it is, transposed, or one of its parts)
        match = matcher.find(a)
        if match is not None:
            ref = str(match.name)  # a tensor's name
            found[info.name] = Suggestion(info.name, ref, match.transform, match.why())
            continue
        # an earlier tensor as a part of this one
        for view in views[1:]:
            if view.transform != T:
                for earlier in matcher.matches(view.transform.numpy(a)):
                    target = str(earlier.name)
                    if earlier.transform == identity and target not in found:
                        found[target] = Suggestion(target, info.name, view.transform, view.why())
        for view in views:
            matcher.add(view, view.transform.numpy(a))
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


def _tensor(reader: Reader, info: TensorInfo) -> Tensor | None:
    """The tensor of ``info``, not read yet (``None``: a dtype this process does not know)."""
    if info.code not in CODES:
        return None
    return Tensor(reader, info.name, info.shape, np.dtype(jnp.dtype(CODES[info.code])))


def _declared(
    readers: list[Reader], path: str, recorded: dict[str, str]
) -> tuple[list[Suggestion], list[str]]:
    """The ties ``config.json`` declares (``st.load`` makes them), and its contradictions.

    One rule with the load (:func:`sharetree._families.held_ties`); a config of a family
    it does not cover that may tie shows the head ``st.load`` would leave untied.
    """
    config = _config(path)
    if config is None:
        return [], []
    declared = declared_ties(config)
    tensors = {
        name: t
        for r in readers
        for name, info in r.infos.items()
        if (t := _tensor(r, info)) is not None
    }
    held = held_ties(repr(path), declared, tensors, recorded)
    problems = [str(e) for e in held.problems]
    why = f"config.json declares it ({declared.key})"
    out = [Suggestion(t, r, identity, why, True, True) for t, r in held.ties.items()]
    if not declared.covered and declared.tied is not False:
        guess = guessed_head([*tensors, *recorded])
        if _mlx(path):  # MLX's layout ties its head by this rule: st.load makes it
            why = f"config.json declares it ({declared.key}, MLX's layout)"
            out += [Suggestion(t, r, identity, why, True, True) for t, r in guess.items()]
        else:
            why = f"config.json's {declared.key} may tie it ({declared.architecture or '?'} is "
            why += "a family st.load does not know: it loads it untied)"
            out += [Suggestion(t, r, identity, why) for t, r in guess.items()]
    return out, problems


def _mlx(path: str) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` quantizes it in MLX's layout."""
    return os.path.isdir(path) and read_config(path) is not None


def contradictions(readers: list[Reader], path: str) -> list[str]:
    """Each contradiction of the checkpoint with its ``config.json``, as ``st.load`` raises it."""
    names = {name: info for r in readers for name, info in r.infos.items()}
    recorded = {k: v for r in readers for k, v in metadata_ties(r.metadata, names).items()}
    return _declared(readers, path, recorded)[1]


def suggest_ties(readers: list[Reader], path: str) -> list[Suggestion]:
    """Every tie the checkpoint shows: recorded in metadata, equal tensors, a missing head.

    Args:
        readers: the checkpoint's files (headers read).
        path: the file or directory, for its ``config.json``.

    Returns:
        The suggestions, recorded ones first (``recorded=True``: ``st.load`` makes them
        unasked: the metadata's, then those ``config.json`` declares), then tensors equal
        to earlier ones, then a head the config of a family not covered may tie.

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
    recorded = {k: v for r in readers for k, v in metadata_ties(r.metadata, names).items()}
    out = [
        Suggestion(removed, kept, identity, "recorded in its metadata", recorded=True)
        for removed, kept in recorded.items()
    ]
    declared = _declared(readers, path, recorded)[0]
    out += [s for s in declared if s.recorded]
    equal = _equal_ties(readers)
    if _mlx(path):
        # MLX's layout: a quantized layer's tensors are one value (st.load's view of them)
        # and a stored target cannot be tied by ties= (E214): none of these would load
        equal = []
    made = {s.target for s in out}
    out += [s for s in _quantized_alike(equal, readers) if s.target not in made]
    have = set(names) | {s.target for s in out}
    out += [s for s in declared if not s.recorded and s.target not in have]
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
