"""Views into part of a buffer: ``slice``, ``index`` and ``take`` of one axis.

``slice`` is a range, ``index`` one entry, ``take`` entries in any order, repeated.
Like the other built-ins, each is a private registered class and the public function that
makes it, documented once (on the function). A view never clips: a range or entry outside
the buffer is an error when the view is computed, a range empty for every buffer one when it
is built.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from sharetree._errors import error, short, wrong_type
from sharetree._transforms.builtins import Moves, set_fields
from sharetree._transforms.protocol import Names, Transform, canonical_dtype, is_int

__all__ = ["index", "slice", "take", "Gather"]


class Gather(NamedTuple):
    """Entry ``l`` of a view along ``axis`` is entry ``sources[l]`` of its buffer.

    What :meth:`~sharetree.Transform.gathers` returns (the axis counted from 0).
    """

    axis: int
    sources: tuple[int, ...]


def _axis(t: Transform, axis: int, shape: tuple[int, ...]) -> int:
    """``axis`` of a buffer of ``shape`` counted from 0, else the :class:`TieError` (E71)."""
    if not -len(shape) <= axis < len(shape):
        fix = f"pass axis= between {-len(shape)} and {len(shape) - 1}"
        found = f"shape {tuple(shape)} ({len(shape)} axes)"
        if not shape:
            fix, found = (
                "keep scalars out of a subtree tied with it",
                "a scalar (shape (), no axes)",
            )
        raise error("E71", f"{t!r}", f"needs axis {axis}", found=found, fix=fix)
    return axis % len(shape)


def _within(n: int, what: str) -> str:
    """The fix for a slice or index outside an axis of size ``n`` (``what``: what fits it)."""
    return f"pass {what}" if n else "refer to a buffer whose axis is not empty"


def _nonempty(start: int, stop: int) -> str:
    """A ``st.slice`` call near the empty ``start:stop`` that is not empty for a large buffer."""
    if stop < start:  # reversed: the other way round (both counted from one end)
        return f"st.slice({stop}, {start})"
    if start < 0 and (stop == 0 or start + 1 == 0):  # from the end: to the end
        return f"st.slice({start}, None)"
    return f"st.slice({start}, {start + 1})"  # one entry


@dataclasses.dataclass(frozen=True, repr=False)
class _Slice(Moves, name="slice"):
    """The class of :func:`slice`."""

    start: int
    stop: int | None = None  # None: to the end
    axis: int = 0
    field_docs: ClassVar = {
        "start": "an integer",
        "stop": "an integer or null",
        "axis": "an integer",
    }

    def __post_init__(self) -> None:
        call = f"st.slice({self.start!r:.20}, {self.stop!r:.20}, axis={self.axis!r:.20})"
        for what, v in (("start", self.start), ("stop", self.stop), ("axis", self.axis)):
            if not is_int(v) and not (what == "stop" and v is None):
                fix = "pass integers, e.g. st.slice(0, 10) or st.slice(-2, None, axis=1)"
                raise wrong_type("E73", f"{call}: {what}", "an integer", v, fix)
        start, stop = int(self.start), None if self.stop is None else int(self.stop)
        # empty for every size: both counted from one end and stop <= start, or a
        # negative start (from the end) with the stop at 0 (the very beginning)
        if stop is not None and (((start < 0) == (stop < 0) and stop <= start) or stop == 0):
            problem = f"takes the range {start}:{stop}, empty or reversed for every buffer"
            fix = f"pass a range that is not empty, e.g. {_nonempty(start, stop)}"
            raise error("E72", call, problem, fix=fix)
        set_fields(self, start=start, stop=stop, axis=int(self.axis))

    def _bounds(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(axis, start, stop)`` counted from 0 for a buffer of ``shape``, else E71."""
        axis = _axis(self, self.axis, shape)
        n = shape[axis]
        start = self.start + n if self.start < 0 else self.start
        stop = n if self.stop is None else self.stop + n if self.stop < 0 else self.stop
        if not 0 <= start < stop <= n:
            what = "empty" if 0 <= start and stop <= n else "outside it"
            stop_ = "" if self.stop is None else self.stop
            problem = f"the range {self.start}:{stop_} of axis {axis} (size {n}) is {what}"
            where = f"{self!r} of a buffer of shape {tuple(shape)}"
            raise error("E71", where, problem, fix=_within(n, f"a range within 0:{n}"))
        return axis, start, stop

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        axis, start, stop = self._bounds(x.shape)
        return jax.lax.slice_in_dim(x, start, stop, axis=axis)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        axis, start, stop = self._bounds(tuple(aval.shape))
        shape = (*aval.shape[:axis], stop - start, *aval.shape[axis + 1 :])
        return jax.ShapeDtypeStruct(shape, canonical_dtype(aval.dtype))

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        return tuple(names) if len(names) == len(aval.shape) else None

    def numpy(self, x: np.ndarray) -> np.ndarray:
        axis, start, stop = self._bounds(np.shape(x))
        return x[(builtins.slice(None),) * axis + (builtins.slice(start, stop),)]


@dataclasses.dataclass(frozen=True, repr=False)
class _Index(Moves, name="index"):
    """The class of :func:`index`."""

    i: int
    axis: int = 0
    field_docs: ClassVar = {"i": "an integer", "axis": "an integer"}

    def __post_init__(self) -> None:
        call = f"st.index({self.i!r:.20}, axis={self.axis!r:.20})"
        for what, v in (("i", self.i), ("axis", self.axis)):
            if not is_int(v):
                fix = "pass integers, e.g. st.index(3)"
                raise wrong_type("E73", f"{call}: {what}", "an integer", v, fix)
        set_fields(self, i=int(self.i), axis=int(self.axis))

    def _where(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(axis, i)`` counted from 0 for a buffer of ``shape``, else E71."""
        axis = _axis(self, self.axis, shape)
        n = shape[axis]
        if not -n <= self.i < n:
            where = f"{self!r} of a buffer of shape {tuple(shape)}"
            problem = f"entry {self.i} is outside axis {axis} (size {n})"
            fix = _within(n, f"an index between {-n} and {n - 1}")
            raise error("E71", where, problem, fix=fix)
        return axis, self.i % n

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        axis, i = self._where(x.shape)
        return jax.lax.index_in_dim(x, i, axis, keepdims=False)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        axis, _ = self._where(tuple(aval.shape))
        shape = (*aval.shape[:axis], *aval.shape[axis + 1 :])
        return jax.ShapeDtypeStruct(shape, canonical_dtype(aval.dtype))

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        if len(names) != len(aval.shape):
            return None
        axis, _ = self._where(tuple(aval.shape))
        return (*names[:axis], *names[axis + 1 :])

    def numpy(self, x: np.ndarray) -> np.ndarray:
        axis, i = self._where(np.shape(x))
        return np.asarray(x[(builtins.slice(None),) * axis + (i,)])


@dataclasses.dataclass(frozen=True, repr=False)
class _Take(Moves, name="take"):
    """The class of :func:`take`."""

    indices: tuple[int, ...]
    axis: int = 0
    field_docs: ClassVar = {"indices": "a non-empty list of integers", "axis": "an integer"}

    def __post_init__(self) -> None:
        call = f"st.take({short(self.indices, 40)}, axis={self.axis!r:.20})"
        given = self.indices
        if not isinstance(given, (tuple, list)) or not all(map(is_int, given)):
            fix = "pass a tuple of integers, e.g. st.take((0, 1, 0, 1))"
            raise wrong_type("E73", f"{call}: indices", "a tuple of integers", given, fix)
        if not is_int(self.axis):
            raise wrong_type("E73", f"{call}: axis", "an integer", self.axis, "pass axis=0")
        if not given:
            raise error("E72", call, "takes no entries", fix="pass at least one index")
        set_fields(self, indices=tuple(int(i) for i in given), axis=int(self.axis))

    def _where(self, shape: tuple[int, ...]) -> tuple[int, np.ndarray]:
        """``(axis, indices)`` counted from 0 for a buffer of ``shape``, else E71."""
        axis = _axis(self, self.axis, shape)
        n = shape[axis]
        bad = [i for i in self.indices if not -n <= i < n]
        if bad:
            where = f"{self!r} of a buffer of shape {tuple(shape)}"
            problem = f"takes {short(bad, 40)}, outside axis {axis} (size {n})"
            raise error("E71", where, problem, fix=_within(n, f"indices between {-n} and {n - 1}"))
        return axis, np.asarray([i % n for i in self.indices], np.int32)

    def __call__(self, x: ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        axis, where = self._where(x.shape)
        return jnp.take(x, where, axis=axis, unique_indices=False, indices_are_sorted=False)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        axis, where = self._where(tuple(aval.shape))
        shape = (*aval.shape[:axis], len(where), *aval.shape[axis + 1 :])
        return jax.ShapeDtypeStruct(shape, canonical_dtype(aval.dtype))

    def fold(self, after: Transform) -> Transform | None:
        if not isinstance(after, _Take) or after.axis != self.axis or self.axis < 0:
            return None
        n = len(self.indices)
        if not all(-n <= j < n for j in after.indices):
            return None  # keep the error
        return _Take(tuple(self.indices[j] for j in after.indices), self.axis)

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        return tuple(names) if len(names) == len(aval.shape) else None

    def gathers(self, aval: jax.ShapeDtypeStruct) -> Gather:
        axis, where = self._where(tuple(aval.shape))
        return Gather(axis, tuple(int(i) for i in where))

    def numpy(self, x: np.ndarray) -> np.ndarray:
        axis, where = self._where(np.shape(x))
        return np.take(x, where, axis=axis)

    def __repr__(self) -> str:
        axis = f", axis={self.axis}" if self.axis else ""
        return f"take({self.indices}{axis})"


# --- the public functions: each documents its class ----------------------------------------


def slice(start: int, stop: int | None = None, axis: int = 0) -> Transform:
    """The entries ``start:stop`` of one axis (``x[start:stop]`` for ``axis=0``), never clipped.

    Example:
        >>> import numpy as np, sharetree as st
        >>> head = st.slice(0, 4) >> st.T
        >>> head, head(np.zeros((6, 2))).shape
        (slice(0, 4) >> T, (2, 4))
    """
    return _Slice(start, stop, axis)


def index(i: int, axis: int = 0) -> Transform:
    """Entry ``i`` of one axis, which the view drops (``x[i]`` for ``axis=0``).

    Example:
        >>> import numpy as np, sharetree as st
        >>> stack = np.zeros((4, 3, 2))
        >>> st.index(-1)(stack).shape, st.index(1, axis=2)(stack).shape
        ((3, 2), (4, 3))
    """
    return _Index(i, axis)


def take(indices: Sequence[int], axis: int = 0) -> Transform:
    """The entries ``indices`` of one axis, in that order, repeats allowed (``x[indices]``).

    A static tuple of integers: ``L`` layers drawn from ``K`` stacked blocks. The
    gradient of a block sums the layers that use it (JAX's scatter-add). Never clipped:
    an index outside the axis is an error.

    Example:
        >>> import numpy as np, sharetree as st
        >>> blocks = np.arange(2.0)[:, None] * np.ones((2, 3))  # two blocks of 3
        >>> st.take((0, 1, 0, 1, 0, 1))(blocks)[:, 0]
        Array([0., 1., 0., 1., 0., 1.], dtype=float32)
    """
    return _Take(indices, axis)  # type: ignore[arg-type]
