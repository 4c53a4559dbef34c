"""Comparing two copies of one value: their kinds, their values within ``atol``, one message.

``st.tie(atol=)``, ``find_ties`` and the loader of files other tools wrote compare copies
here. Arrays compare as numbers in float64 (complex128 if complex): ``-0.0`` equals ``0.0``,
NaN equals NaN, equal infinities are equal, bfloat16, float8 and ints compare by value;
arrays of non-numbers (strings) are equal or ``inf`` apart.

>>> import numpy as np
>>> difference(np.array([0.0, np.nan, 1.0]), np.array([-0.0, np.nan, 1.5]), 0.1)
Difference(worst=0.5, bad=1, size=3)
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharetree._errors import FIXES, TieError, error, found_type, short, wrong_type
from sharetree._paths import format_aval, is_array_leaf
from sharetree._tied import Tied
from sharetree._transforms import Transform, canonical_dtype, identity

__all__ = [
    "LEAVE_ATOL_OUT",
    "Copies",
    "Difference",
    "abs_diff",
    "arraylike",
    "bit_equal",
    "check_atol",
    "check_copies",
    "close",
    "concrete",
    "copies_differ",
    "describe",
    "difference",
    "difference_on_devices",
    "kind",
    "kinds_differ",
    "near",
    "wide",
]


LEAVE_ATOL_OUT = f"{FIXES['outside_jit']}, or leave atol out"
"""The fix for copies that have no values to compare (``st.tie(atol=)`` under ``jit``)."""


def kind(x: Any) -> Any:
    """What must agree between two copies: shape and dtype as JAX computes them, else the type."""
    return (x.shape, canonical_dtype(x.dtype)) if isinstance(x, jax.ShapeDtypeStruct) else type(x)


def describe(x: Any) -> str:
    """A :func:`kind` for a message: ``float32[2, 3]``, or the type and repr of another leaf."""
    return format_aval(x) if isinstance(x, jax.ShapeDtypeStruct) else found_type(x, 10**6)


def check_atol(atol: Any, where: str) -> float:
    """``atol`` as a float if it is a real number >= 0 (NumPy's too), else the E55 error.

    >>> check_atol(-1, "tie")
    Traceback (most recent call last):
    sharetree._errors.TieError: [E55] tie(atol=...): expected a number >= 0, found -1. ...
    """
    fix = "pass 0.0 for equal copies or a small tolerance such as 1e-6"
    if isinstance(atol, (bool, np.bool_)) or not isinstance(atol, numbers.Real):
        raise wrong_type("E55", f"{where}(atol=...)", "a number >= 0", atol, fix)
    if not float(atol) >= 0:
        raise error(
            "E55", f"{where}(atol=...)", expected="a number >= 0", found=repr(atol), fix=fix
        )
    return float(atol)


def concrete(x: Any, where: str, fix: str = FIXES["outside_jit"]) -> np.ndarray:
    """``x`` as a NumPy array (a typed PRNG key: its key data), else the E62 error at ``where``.

    Tracers and ``jax.ShapeDtypeStruct`` have no values to compare.
    """
    cause: BaseException | None = None
    if isinstance(x, jax.core.Tracer):
        found = f"a traced {format_aval(x)} (under jit, grad or vmap)"
    elif isinstance(x, jax.ShapeDtypeStruct):
        found = f"a jax.ShapeDtypeStruct {format_aval(x)}, a shape without values"
    else:
        try:
            if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)  # typed PRNG keys compare by their key data
            return np.asarray(x)
        except Exception as e:  # a deleted buffer, one spread over processes
            cause, found = e, f"{type(x).__name__} ({type(e).__name__})"
    raise error("E62", where, "has no values to compare", found=found, fix=fix) from cause


def bit_equal(a: Any, b: Any) -> bool:
    """Whether two arrays have the same shape, dtype and bytes (one pass, no copies).

    Example:
        >>> import numpy as np
        >>> bit_equal(np.arange(3.0), np.arange(3.0)), bit_equal(np.zeros(2), -np.zeros(2))
        (True, False)
    """
    if a is b:
        return True
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(x.dtype.itemsize)
    if width is None or x.dtype.hasobject:
        return bool(np.array_equal(x, y))
    return bool(np.array_equal(x.view(width), y.view(width)))


def _numeric(dtype: Any) -> bool:
    return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))


def wide(a: Any, xp: Any = np) -> Any:
    """``a`` in float64 (complex128 if complex), no copy if it is already: values as numbers."""
    return xp.asarray(a, dtype=xp.complex128 if xp.iscomplexobj(a) else xp.float64)


def abs_diff(a: Any, b: Any, xp: Any = np) -> Any:
    """The elementwise ``|a - b|`` in float64, NaN equal to NaN (``xp``: NumPy or ``jax.numpy``).

    Equal values (``-0.0`` and ``0.0``, equal infinities) and NaNs in the same places are 0
    apart, a NaN and a number ``inf``; arrays of non-numbers are 0 or ``inf`` apart.

    >>> abs_diff(np.array([np.inf, np.nan, 1.0]), np.array([np.inf, 2.0, 0.5]))
    array([0. , inf, 0.5])
    """
    if not (_numeric(a.dtype) and _numeric(b.dtype)):
        return np.where(a == b, 0.0, np.inf)
    x, y = wide(a, xp), wide(b, xp)
    with np.errstate(invalid="ignore", over="ignore"):
        d = xp.abs(x - y)
    same = (x == y) | (xp.isnan(x) & xp.isnan(y))
    return xp.where(same, 0.0, xp.where(xp.isnan(d), xp.inf, d))


def close(x: np.ndarray, y: np.ndarray, atol: float) -> bool:
    """Whether ``x`` and ``y`` are one value: bit for bit when ``atol`` is 0, else within ``atol``.

    ``find_ties``' full comparison (``atol=0.0`` is bit-exact there, unlike ``st.tie``'s).
    """
    if atol == 0.0:
        return bit_equal(x, y)
    return x.shape == y.shape and bool(np.all(abs_diff(x, y) <= atol))


def near(rows: np.ndarray, sample: np.ndarray, atol: float) -> np.ndarray:
    """The indices of the ``rows`` within ``atol`` of ``sample`` everywhere (one vectorized step).

    >>> near(np.array([[0.0, 1.0], [0.0, 3.0]]), np.array([0.0, 1.05]), 0.1)
    array([0])
    """
    return np.flatnonzero(np.all(abs_diff(rows, sample) <= atol, axis=1))


class Difference(NamedTuple):
    """How far two copies are apart: the largest ``|a - b|``, how many elements exceed ``atol``.

    ``size``: how many elements were compared.
    """

    worst: float
    bad: int
    size: int


def difference(a: np.ndarray, b: np.ndarray, atol: float) -> Difference:
    """The :class:`Difference` of two NumPy arrays of one shape, on the host."""
    d = abs_diff(a, b)
    return Difference(float(d.max(initial=0.0)), int(np.count_nonzero(d > atol)), int(d.size))


@functools.partial(jax.jit, static_argnums=2)
def _differ(a: jax.Array, b: jax.Array, atol: float) -> tuple[jax.Array, jax.Array]:
    d = abs_diff(a, b, jnp)
    return d.max(initial=0.0), jnp.sum(d > atol)


def difference_on_devices(a: jax.Array, b: jax.Array, atol: float) -> Difference:
    """The :class:`Difference` of two placed arrays of one shape and sharding, on their devices.

    Every process gets the same answer (the reductions run over all devices).
    """
    with jax.enable_x64(True):  # float64 checkpoints compared in float64, as on the host
        worst, bad = (float(x.addressable_data(0)) for x in _differ(a, b, atol))
    return Difference(worst, int(bad), int(a.size))


class Copies(NamedTuple):
    """Two copies of one value, named for the messages: the target's and the view's.

    ``target`` holds one copy, ``transform`` of ``buffer`` is the other; ``where`` opens a
    message (``"tie 'b' <- Tied('a')"``); ``load``: the fixes are ``st.load``'s.
    """

    where: str
    target: str
    buffer: str | tuple[str, ...]  # several for a view of several positions (``lora`` of them)
    transform: Transform = identity
    load: bool = False


def arraylike(x: Any) -> bool:
    """Whether ``x`` compares as an array (an array, number, tracer or shape/dtype)."""
    return is_array_leaf(x) or hasattr(x, "shape")


def check_copies(c: Copies, held: Any, view: Any, atol: float, *, on_devices: bool = False) -> None:
    """Nothing if ``held`` (the target's copy) equals ``view`` within ``atol``, else E46.

    Arrays compare as numbers (on their devices with ``on_devices``: placed alike), other
    leaves (strings, ``None``) by type and ``==``.
    """
    if on_devices:
        d = difference_on_devices(held, view, atol)
    elif not (arraylike(held) and arraylike(view)):
        if type(held) is not type(view) or held != view:
            raise copies_differ(c, (held, view), atol)
        return
    else:
        a = concrete(held, f"{c.where}: the copy at {c.target!r}", LEAVE_ATOL_OUT)
        b = concrete(view, f"{c.where}: the view of {c.buffer!r}", LEAVE_ATOL_OUT)
        if bit_equal(a, b):
            return  # the same bits: equal under any atol
        if a.shape != b.shape:
            raise kinds_differ(c, format_aval(b), format_aval(a), "leave atol out")
        d = difference(a, b, atol)
    if d.worst > atol:
        raise copies_differ(c, d, atol)


def kinds_differ(c: Copies, view: str, held: str, other: str) -> TieError:
    """The E7 error: the view is of another shape or dtype (``view``) than the copy (``held``).

    ``other``: the fix besides a transform that gives ``held``.
    """
    holder = f"the file holds {c.target!r} as" if c.load else "the value it replaces is"
    fix = (
        f"choose a transform that gives {held} (st.T, st.reshape, st.astype, st.slice), or {other}"
    )
    return error("E7", c.where, f"gives a view of {view}, but {holder} {held}", fix=fix)


def copies_differ(c: Copies, found: Difference | tuple[Any, Any], atol: float) -> TieError:
    """The E46 error: the two copies ``c`` differ by ``found`` (or hold these two leaves)."""
    target, t, several = c.target, c.transform, not isinstance(c.buffer, str)
    shown = ", ".join(map(repr, c.buffer)) if several else repr(c.buffer)
    back = None if several else t.inverse()  # a view of several positions: no way back
    if back is None:
        keep = f"write the values you want into {shown} ({t!r} has no inverse to tie "
        keep += f"{'them' if several else shown} to {target!r})"
    elif c.load:
        keep = "tie the other way round"
    else:
        keep = f"st.tie(tree, {{{c.buffer!r}: {Tied(target, back)!r}}})"
    if isinstance(found, Difference):
        seen = shown if t == identity else f"{t!r} of {shown}"
        problem = f"{target!r} and {seen} differ by up to {found.worst:.6g} ({found.bad} of "
        problem += f"{found.size} elements above atol={atol})"
        keep += f"; or raise atol to {found.worst:.3g} if the difference is rounding"
    else:
        problem = f"{target!r} holds {short(found[0])}, {shown} holds {short(found[1])}"
    first = "" if c.load else f"without atol, st.tie keeps {shown} and drops {target!r}; "
    last = "load without ties" if c.load else "leave the two untied"
    fix = f"choose which copy wins: {first}to keep {target!r} instead, {keep}; or {last}"
    return error("E46", c.where, f"holds two copies that differ: {problem}", fix=fix)
