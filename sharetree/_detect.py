"""Finding ties in trees that were built without ``Tied``: by identity or by content."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError
from sharetree._paths import Path, keypath_to_path, path_str
from sharetree._tie import tie
from sharetree._tied import Tied, is_tied
from sharetree._transforms import T, Transform, check_transform, identity

__all__ = ["tie_identical", "find_ties"]


def _positions(tree: Any) -> list[tuple[Path, Any]]:
    flat, _ = jtu.tree_flatten_with_path(tree, is_leaf=is_tied)
    return [(keypath_to_path(kp), x) for kp, x in flat]


def tie_identical(tree: Any) -> Any:
    """Tie array objects that appear more than once in ``tree`` (by ``is``).

    The first position in flatten order becomes the buffer; every later
    position holding the same ``jax.Array`` or ``np.ndarray`` object becomes
    ``Tied(first)``. Python scalars, ``None`` and strings are never tied: their
    identity means nothing (equal immutables may or may not be one object).
    A 0-d ``np.ndarray`` used twice is an array object and is tied.
    Nor do gradients that happen to be the same object: call this on
    parameters you built with sharing, not on computed values.

    Example:
        >>> import numpy as np, sharetree as st
        >>> w = np.ones((2, 2))
        >>> st.tie_identical({"a": w, "b": w, "c": np.ones((2, 2)), "n": 1.0, "m": 1.0})
        {'a': array([[1., 1.],
               [1., 1.]]), 'b': Tied('a'), 'c': array([[1., 1.],
               [1., 1.]]), 'm': 1.0, 'n': 1.0}
    """
    first: dict[int, Path] = {}
    ties: dict[Path, Tied] = {}
    for path, x in _positions(tree):
        if isinstance(x, (jax.Array, np.ndarray)):
            if id(x) in first:
                ties[path] = Tied(first[id(x)])
            else:
                first[id(x)] = path
    return tie(tree, ties, check=False) if ties else tree


def _digest(a: np.ndarray) -> tuple[Any, ...]:
    a = np.ascontiguousarray(a)
    return (a.shape, a.dtype.str, hashlib.sha1(a.tobytes()).hexdigest())


def find_ties(
    tree: Any, transforms: Sequence[Transform] = (identity, T), *, atol: float = 0.0
) -> dict[str | Path, Tied]:
    """Find leaves whose content equals ``transform(an earlier leaf)``.

    For checkpoints imported from frameworks that store a tied weight twice
    (a PyTorch ``lm_head.weight`` equal to ``embed_tokens.weight``). The result
    feeds :func:`sharetree.tie` directly. The earlier leaf in flatten order is
    the buffer; a leaf equal to several earlier ones is tied to the first.

    Constant arrays (all elements equal, e.g. freshly initialised zero biases)
    are never reported: equal content means nothing there, so tie them
    explicitly if they really are shared.

    Args:
        tree: a pytree of arrays (may already contain ``Tied`` nodes, kept as is).
        transforms: the candidate transforms, tried in order.
        atol: absolute tolerance; ``0.0`` means bit-exact equality.

    Returns:
        ``{target path: Tied(buffer path, transform)}``; a target is a ``/``-joined
        string, or a tuple of keys when a key itself contains ``/``.

    Example:
        >>> import numpy as np, sharetree as st
        >>> emb = np.arange(6.0).reshape(3, 2)
        >>> sd = {"embed": emb, "head": emb.T.copy(), "other": np.ones(3)}
        >>> st.find_ties(sd)
        {'head': Tied('embed', T)}
    """
    for t in transforms:
        check_transform(t, "in find_ties")
    if not isinstance(atol, (int, float)) or isinstance(atol, bool) or not atol >= 0:
        raise TieError(
            f"find_ties: atol must be a number >= 0, got {atol!r}. Fix: pass 0.0 for "
            "bit-exact matches or a small tolerance such as 1e-6."
        )
    with jax.enable_x64(True):  # keep float64 checkpoints in float64 while comparing
        return _find_ties(tree, transforms, atol)


def _view(t: Transform, a: np.ndarray) -> np.ndarray | None:
    try:
        return np.asarray(t(a))
    except Exception:
        return None


def _find_ties(tree: Any, transforms: Sequence[Transform], atol: float) -> dict[str | Path, Tied]:
    candidates = [
        (path, np.asarray(x))
        for path, x in _positions(tree)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) and np.size(x) > 1
    ]
    candidates = [(p, a) for p, a in candidates if not np.all(a == a.flat[0])]
    found: dict[Path, Tied] = {}
    if atol == 0.0:
        index: dict[tuple[Any, ...], tuple[Path, Transform]] = {}
        for path, a in candidates:
            hit = index.get(_digest(a))
            if hit is not None:
                found[path] = Tied(hit[0], hit[1])
                continue
            for t in transforms:
                view = _view(t, a)
                if view is not None:
                    index.setdefault(_digest(view), (path, t))
    else:
        buffers: list[tuple[Path, np.ndarray]] = []
        for path, a in candidates:
            match = None
            for bpath, b in buffers:
                for t in transforms:
                    view = _view(t, b)
                    if (
                        view is not None
                        and view.shape == a.shape
                        and view.dtype == a.dtype
                        and np.allclose(view, a, rtol=0.0, atol=atol, equal_nan=True)
                    ):
                        match = Tied(bpath, t)
                        break
                if match is not None:
                    break
            if match is not None:
                found[path] = match
            else:
                buffers.append((path, a))
    return {(p if any("/" in k for k in p) else path_str(p)): t for p, t in found.items()}
