"""Finding ties in trees that were built without ``Tied``: by identity or by content."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharetree._compare import check_atol, concrete
from sharetree._errors import wrong_type
from sharetree._match import Matcher, View, constant
from sharetree._paths import Path, leaves_with_paths, path_key, path_str
from sharetree._tie import tie
from sharetree._tied import Tied, is_tied
from sharetree._transforms import T, Transform, check_transform, identity

__all__ = ["tie_identical", "find_ties"]


def tie_identical(tree: Any) -> Any:
    """Tie array objects that appear more than once in ``tree`` (by ``is``).

    Each later position holding the same ``jax.Array`` or ``np.ndarray`` as an
    earlier one becomes ``Tied(first position)``. Scalars, ``None`` and strings
    are never tied (their identity means nothing); call it on parameters built
    with sharing, not on computed values.

    Example:
        >>> import numpy as np, sharetree as st
        >>> w = np.ones(2)
        >>> st.tie_identical({"a": w, "b": w, "c": np.ones(2), "n": 1.0, "m": 1.0})
        {'a': array([1., 1.]), 'b': Tied('a'), 'c': array([1., 1.]), 'm': 1.0, 'n': 1.0}
    """
    first: dict[int, Path] = {}  # each array object's first position
    ties: dict[Path, Tied] = {}  # refs from the root: tie writes each as scoped refs need it
    for path, x in leaves_with_paths(tree, is_tied):
        if isinstance(x, (jax.Array, np.ndarray)) and first.setdefault(id(x), path) != path:
            ties[path] = Tied(first[id(x)])
    return tie(tree, ties, check=False) if ties else tree


def find_ties(
    tree: Any, transforms: Sequence[Transform] = (identity, T), *, atol: float = 0.0
) -> dict[str | Path, Tied]:
    """Find leaves whose content equals ``transform(an earlier leaf)``, for :func:`sharetree.tie`.

    For checkpoints that store a tied weight twice (PyTorch's ``lm_head.weight``):
    gives ``{target path: Tied(buffer path, transform)}``, the buffer being the
    earlier leaf in flatten order. ``transforms`` are tried in order; ``atol=0.0``
    is bit-exact. Only concrete numeric and boolean arrays are compared; constant
    arrays (fresh zero biases) never match.

    Example:
        >>> import numpy as np, sharetree as st
        >>> emb = np.arange(6.0).reshape(3, 2)
        >>> sd = {"embed": emb, "head": emb.T.copy(), "other": np.ones(3)}
        >>> st.find_ties(sd)
        {'head': Tied('embed', T)}
    """
    if isinstance(transforms, Transform) or not isinstance(transforms, Iterable):
        fix = "pass a list or tuple, e.g. transforms=(st.identity, st.T)"
        raise wrong_type(
            "E62", "find_ties(transforms=...)", "a sequence of transforms", transforms, fix
        )
    transforms = tuple(check_transform(t, "in find_ties") for t in transforms)
    atol = check_atol(atol, "find_ties")
    with jax.enable_x64(True):  # keep float64 checkpoints in float64 while comparing
        return _find_ties(tree, transforms, atol)


def _comparable(x: Any) -> bool:
    """Whether ``x`` is a numeric or boolean array of 2+ elements (PRNG keys, strings: no).

    A traced one is, so that :func:`concrete` says it has no values.
    """
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)) or np.size(x) <= 1:
        return False
    traced = isinstance(x, jax.core.Tracer)
    return traced or x.dtype == np.bool_ or bool(jnp.issubdtype(x.dtype, jnp.number))


def _find_ties(tree: Any, transforms: Sequence[Transform], atol: float) -> dict[str | Path, Tied]:
    found: dict[Path, Tied] = {}
    matcher = Matcher(None, atol)  # each view's value kept: a transform computed once
    for path, x in leaves_with_paths(tree, is_tied):  # refs from the root, as tie takes them
        if not _comparable(x):
            continue
        a = concrete(x, f"find_ties: the leaf {path_str(path)!r}")
        if constant(a):
            continue  # equal content means nothing for constant arrays (fresh biases)
        match = matcher.find(a)
        if match is not None:
            found[path] = Tied(match.name, match.transform)  # type: ignore[arg-type]
            continue
        for t in transforms:
            try:
                value = t.numpy(a)  # no copy where t has a NumPy view
            except Exception:
                continue  # t does not apply to a
            matcher.add(View(path, t), value)
    return {path_key(p): t for p, t in found.items()}
