"""One tie matcher: which arrays equal a view of an earlier one (as it is, transposed, a part).

``find_ties`` (leaves of a tree) and ``inspect``'s suggestions (tensors of a checkpoint)
both ask it: each array is offered in order, its views are kept by a fingerprint (shape,
dtype and a sample of its elements), and a later array whose fingerprint meets a view's is
compared with it whole, read again through ``read`` (a file's tensor is not kept in memory
meanwhile). One view record (:class:`View`), one rule for constant arrays
(:func:`constant`: a fresh bias or a norm's ones is never evidence of a tie), one
comparison (bit for bit at ``atol=0``, else within ``atol``) and one way to say what was
seen (:meth:`View.why`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import numpy as np

from sharetree._compare import close, near, wide
from sharetree._transforms import T, Transform, identity

__all__ = ["SAMPLES", "Matcher", "View", "constant"]

SAMPLES = 256
"""Elements of each view compared before any whole comparison."""


class View(NamedTuple):
    """A way a tie may see an earlier array: ``transform(array named name)``."""

    name: Hashable  # a path of a tree, a tensor's name
    transform: Transform

    def why(self) -> str:
        """What a match through this view shows: ``"equal"``, ``"equal to its transpose"``...

        >>> View("w", T).why(), View("w", identity).why()
        ('equal to its transpose', 'equal')
        """
        if self.transform == identity:
            return "equal"
        if self.transform == T:
            return "equal to its transpose"
        return f"equal to {self.transform!r} of it (a part)"


def constant(a: np.ndarray) -> bool:
    """Whether ``a`` holds one value (or fewer than two elements): never evidence of a tie.

    >>> constant(np.zeros(3)), constant(np.ones(1)), constant(np.arange(2))
    (True, True, False)
    """
    flat = np.reshape(a, -1)
    return flat.size < 2 or bool((flat == flat[0]).all())


def _sample(a: np.ndarray) -> np.ndarray:
    """A fingerprint: the elements at a few evenly spaced flat positions (views included)."""
    if a.size <= SAMPLES:
        return np.array(a).reshape(-1)
    return a.flat[np.linspace(0, a.size - 1, SAMPLES).astype(np.intp)]


class _Bucket:
    """The views of one key, their samples stacked: one vectorized compare finds the near ones."""

    def __init__(self) -> None:
        self.views: list[View] = []
        self.samples: np.ndarray | None = None  # row k: views[k]'s sample, widened; doubles

    def add(self, view: View, sample: np.ndarray) -> None:
        row = wide(sample)
        if self.samples is None or len(self.views) == len(self.samples):
            grown = np.empty((2 * len(self.views) + 1, row.size), row.dtype)
            if self.samples is not None:
                grown[: len(self.views)] = self.samples
            self.samples = grown
        self.samples[len(self.views)] = row
        self.views.append(view)

    def near(self, sample: np.ndarray, atol: float) -> list[View]:
        """The views whose samples are within ``atol`` of ``sample`` (all, when bit-exact)."""
        if atol == 0.0 or self.samples is None:
            return self.views  # the key holds the sample's bytes
        return [self.views[k] for k in near(self.samples[: len(self.views)], sample, atol)]


class Matcher:
    """The views of the arrays offered so far, and the earlier views a new array equals.

    Args:
        read: the array of a name, read again to compare a candidate whole (a file's
            tensors are not kept); ``None`` keeps each view's value instead, so that a
            transform is computed once per array.
        atol: ``0.0`` for bit-exact copies, else the largest difference of equal elements.

    Example:
        >>> m = Matcher({"emb": np.arange(6.0).reshape(2, 3)}.__getitem__)
        >>> m.add(View("emb", T), np.arange(6.0).reshape(2, 3).T)
        >>> m.find(np.arange(6.0).reshape(2, 3).T.copy())
        View(name='emb', transform=T)
    """

    def __init__(self, read: Callable[[Any], np.ndarray] | None, atol: float = 0.0) -> None:
        self.read, self.atol = read, atol
        self._seen: dict[tuple[Any, ...], _Bucket] = {}
        self._kept: dict[View, np.ndarray] = {}  # without read: each view's value

    def _key(self, a: np.ndarray, sample: np.ndarray) -> tuple[Any, ...]:
        return a.shape, a.dtype, sample.tobytes() if self.atol == 0.0 else None

    def add(self, view: View, value: np.ndarray) -> None:
        """Keep ``view``, whose value (``view.transform`` of its array) is ``value``."""
        sample = _sample(value)
        self._seen.setdefault(self._key(value, sample), _Bucket()).add(view, sample)
        if self.read is None:
            self._kept[view] = value

    def matches(self, a: np.ndarray) -> Iterator[View]:
        """The earlier views ``a`` equals, each compared whole, in the order they were added."""
        sample = _sample(a)
        bucket = self._seen.get(self._key(a, sample))
        for view in [] if bucket is None else bucket.near(sample, self.atol):
            if close(self._value(view), a, self.atol):
                yield view

    def _value(self, view: View) -> np.ndarray:
        if self.read is None:
            return self._kept[view]
        return view.transform.numpy(self.read(view.name))

    def find(self, a: np.ndarray) -> View | None:
        """The first earlier view ``a`` equals, or ``None``."""
        return next(self.matches(a), None)
