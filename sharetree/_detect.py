"""Finding ties in trees that were built without ``Tied``: by identity or by content."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharetree._compare import check_atol, close, concrete, near, wide
from sharetree._errors import wrong_type
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


_SAMPLES = 256  # elements compared before any full compare


class _View(NamedTuple):
    """A candidate buffer seen through one transform, with its fingerprint."""

    path: Path
    transform: Transform
    value: np.ndarray
    sample: np.ndarray


def _sample(a: np.ndarray) -> np.ndarray:
    """A fingerprint: the elements at a few evenly spaced flat positions (views included)."""
    if a.size <= _SAMPLES:
        return np.array(a).reshape(-1)
    return a.flat[np.linspace(0, a.size - 1, _SAMPLES).astype(np.intp)]


def _key(a: np.ndarray, sample: np.ndarray, atol: float) -> tuple[Any, ...]:
    """Where views that may equal ``a`` are kept: shape, dtype and, when bit-exact, the sample."""
    return a.shape, a.dtype, sample.tobytes() if atol == 0.0 else None


class _Bucket:
    """The views of one key, their samples stacked: one vectorized compare finds the near ones."""

    def __init__(self) -> None:
        self.views: list[_View] = []
        self.samples: np.ndarray | None = None  # row k: views[k].sample, widened; grows by doubling

    def add(self, view: _View) -> None:
        row = wide(view.sample)
        if self.samples is None or len(self.views) == len(self.samples):
            grown = np.empty((2 * len(self.views) + 1, row.size), row.dtype)
            if self.samples is not None:
                grown[: len(self.views)] = self.samples
            self.samples = grown
        self.samples[len(self.views)] = row
        self.views.append(view)

    def near(self, sample: np.ndarray, atol: float) -> list[_View]:
        """The views whose samples are within ``atol`` of ``sample`` (all, when bit-exact)."""
        if atol == 0.0 or self.samples is None:
            return self.views  # the key holds the sample's bytes
        return [self.views[k] for k in near(self.samples[: len(self.views)], sample, atol)]


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
    seen: dict[tuple[Any, ...], _Bucket] = {}  # the views so far, by _key
    for path, x in leaves_with_paths(tree, is_tied):  # refs from the root, as tie takes them
        if not _comparable(x):
            continue
        a = concrete(x, f"find_ties: the leaf {path_str(path)!r}")
        sample = _sample(a)
        if np.all(sample == sample[0]) and np.all(a == a.flat[0]):
            continue  # equal content means nothing for constant arrays (fresh biases)
        bucket = seen.get(_key(a, sample, atol))
        hits = [] if bucket is None else bucket.near(sample, atol)
        match = next((v for v in hits if close(v.value, a, atol)), None)
        if match is not None:
            found[path] = Tied(match.path, match.transform)
            continue
        for t in transforms:
            try:
                value = t.numpy(a)  # no copy where t has a NumPy view
            except Exception:
                continue  # t does not apply to a
            view = _View(path, t, value, _sample(value))
            seen.setdefault(_key(value, view.sample, atol), _Bucket()).add(view)
    return {path_key(p): t for p, t in found.items()}
