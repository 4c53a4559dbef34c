"""The built-in transforms of whole arrays: transpose (and T), reshape, astype, scale, fn.

``identity``, the unit of the chain, is in ``protocol``; ``slice`` and ``index``, the views
into part of a buffer, in ``views``. Each built-in is a private registered class and the public
function that makes it: the function is documented (``st.`` names it and the API reference
shows it), the class points to it. A class checks and normalises its arguments in
``__post_init__``, which is also how a spec's fields are read back.
"""

from __future__ import annotations

import cmath
import dataclasses
import math
import pkgutil
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from sharetree._errors import error, found_type, short, wrong_type
from sharetree._transforms.protocol import (
    ArrayFn,
    Names,
    Resolve,
    Transform,
    bad_field,
    canonical_dtype,
    identity,
    is_int,
    is_real,
)

__all__ = ["Moves", "T", "astype", "fn", "reshape", "scale", "set_fields", "transpose"]


def set_fields(obj: Any, **fields: Any) -> None:
    """Normalise fields of a frozen dataclass in ``__post_init__``."""
    for k, v in fields.items():
        object.__setattr__(obj, k, v)


def _args(values: Sequence[Any]) -> tuple[Any, ...]:
    """``values``, or its one list or tuple, as a tuple."""
    if len(values) == 1 and isinstance(values[0], (tuple, list)):
        return tuple(values[0])
    return tuple(values)


def _shown(values: Any) -> str:
    """A tuple of arguments as they were written in the call (bounded in length)."""
    if not isinstance(values, tuple):
        return short(values, 60)
    text = short(list(values), 62)
    return text[1:-1] if text.endswith("]") else text[1:]


def _ints(call: str, values: Any, example: str) -> tuple[int, ...]:
    """``values`` (a tuple) as ints, else the :class:`TieTypeError` (E73) for ``call``."""
    bad = [v for v in values if not is_int(v)] if isinstance(values, tuple) else [values]
    if bad:
        what = "integers" if isinstance(values, tuple) else "a tuple of integers"
        raise wrong_type("E73", call, what, bad[0], f"pass {example}")
    return tuple(int(v) for v in values)


def _reverse(n: int) -> tuple[int, ...]:
    return tuple(range(n - 1, -1, -1))


class Moves(Transform):
    """A transform that only moves or selects entries: optimizer moments move like the values."""

    def state_view(self) -> Transform:
        return self


@dataclasses.dataclass(frozen=True)
class _Transpose(Moves, name="transpose"):
    """The class of :func:`transpose` and :data:`T` (``axes=None``)."""

    axes: tuple[int, ...] | None = None  # None: reverse all axes (T); else a permutation
    field_docs: ClassVar = {"axes": "null (reverse all axes) or a list of integers"}

    def __post_init__(self) -> None:
        if self.axes is None:
            return
        call = f"transpose({_shown(self.axes)})"
        given = _ints(call, self.axes, "integer axes, e.g. transpose(1, 0)")
        n = len(given)
        perm = tuple(a % n if -n <= a < n else a for a in given)
        if sorted(perm) != list(range(n)):
            expected, fix = f"a permutation of 0..{n - 1}", "name every axis once, or use st.T"
            raise error("E22", call, expected=expected, found=str(list(given)), fix=fix)
        set_fields(self, axes=perm or None)  # () is T

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.transpose(x, self.axes)

    def fold(self, after: Transform) -> Transform | None:
        if not isinstance(after, _Transpose):
            return None
        p, q = self.axes, after.axes
        if p is None and q is None:
            return identity  # reversing twice, whatever the rank
        p, q = p or _reverse(len(q or ())), q or _reverse(len(p or ()))  # the other fixes the rank
        if len(p) != len(q):
            return None  # one of them fails on any array; keep the error
        composed = tuple(p[i] for i in q)  # out axis j is input axis p[q[j]]
        return identity if composed == tuple(range(len(composed))) else _Transpose(composed)

    def _perm(self, ndim: int) -> tuple[int, ...] | None:
        axes = self.axes or _reverse(ndim)
        return axes if len(axes) == ndim else None

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        axes = self._perm(len(aval.shape))
        if axes is None:
            return jax.eval_shape(self, aval)  # raises the real error
        dtype = canonical_dtype(aval.dtype)  # as jnp.transpose returns it
        return jax.ShapeDtypeStruct(tuple(aval.shape[a] for a in axes), dtype)

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        axes = self._perm(len(names))
        return None if axes is None else tuple(names[a] for a in axes)

    def inverse(self) -> Transform:
        return self if self.axes is None else _Transpose(tuple(np.argsort(self.axes).tolist()))

    def numpy(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.axes)

    def __repr__(self) -> str:
        return "T" if self.axes is None else super().__repr__()


@dataclasses.dataclass(frozen=True, repr=False)
class _Reshape(Moves, name="reshape"):
    """The class of :func:`reshape`."""

    shape: tuple[int, ...]  # sizes >= 0 and at most one -1
    field_docs: ClassVar = {"shape": "a list of integers"}

    def __post_init__(self) -> None:
        call = f"reshape({_shown(self.shape)})"
        sizes = _ints(call, self.shape, "integer sizes, e.g. reshape(2, 3)")
        if sizes.count(-1) > 1 or any(d < -1 for d in sizes):
            expected, fix = "sizes >= 0 and at most one -1", "give every size but one"
            raise error("E22", call, expected=expected, found=str(list(sizes)), fix=fix)
        set_fields(self, shape=sizes)

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.reshape(jnp.asarray(x), self.shape)

    def fold(self, after: Transform) -> Transform | None:
        if not isinstance(after, _Reshape):
            return None
        if -1 in self.shape:
            return after
        size = math.prod(self.shape)
        if -1 not in after.shape:
            return after if math.prod(after.shape) == size else None  # None: keep the error
        known = math.prod(d for d in after.shape if d != -1)
        if known == 0 or size % known:
            return None  # the second reshape fails; keep the error
        return _Reshape(tuple(size // known if d == -1 else d for d in after.shape))

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        return tuple(names) if self.abstract(aval).shape == tuple(aval.shape) else None

    def numpy(self, x: np.ndarray) -> np.ndarray:
        return np.reshape(x, self.shape)


_DTYPES = "a boolean or numeric dtype: a np.dtype, a scalar type (jnp.bfloat16) or its name"


@dataclasses.dataclass(frozen=True, repr=False)
class _AsType(Transform, name="astype"):
    """The class of :func:`astype`."""

    dtype: Any  # given as any dtype-like, stored as the NumPy name of a boolean or numeric dtype
    field_docs: ClassVar = {"dtype": "a dtype name such as 'bfloat16'"}

    def __post_init__(self) -> None:
        dtype, fix = self.dtype, "pass e.g. st.astype(jnp.bfloat16)"
        if not isinstance(dtype, (np.dtype, type, str)):
            raise wrong_type("E73", f"astype({short(dtype, 40)})", _DTYPES, dtype, fix)
        try:
            d = jnp.dtype(dtype)
        except TypeError as e:
            where, found = f"astype({dtype!r:.60})", f"no dtype ({e})"
            raise error("E13b", where, expected=_DTYPES, found=found, fix=fix) from e
        if not (d == np.dtype(bool) or jnp.issubdtype(d, np.number)):
            found = f"{d}, which JAX cannot compute with"
            raise error("E18", f"astype({dtype!r:.60})", expected=_DTYPES, found=found, fix=fix)
        set_fields(self, dtype=d.name)

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.asarray(x).astype(self.dtype)

    def fold(self, after: Transform) -> Transform | None:
        return self if after == self else None  # a different cast may lose what this kept

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(aval.shape, canonical_dtype(self.dtype))

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names:
        return tuple(names)


@dataclasses.dataclass(frozen=True, repr=False)
class _Scale(Transform, name="scale"):
    """The class of :func:`scale`."""

    c: Any  # given as a Python or NumPy number; stored as a finite float, or complex if given so
    kind: type = dataclasses.field(init=False)  # 2.0 == 2+0j, but scale(2+0j) makes views complex
    field_docs: ClassVar = {"c": "a finite number, or [real, imag] for a complex one"}

    def __post_init__(self) -> None:
        c = self.c
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, complex, np.number)):
            fix = "pass a constant such as 0.5; for a learned scale use a separate buffer"
            raise wrong_type("E73", "scale(c)", "a finite Python or NumPy number", c, fix)
        value: float | complex
        try:
            value = complex(c) if isinstance(c, (complex, np.complexfloating)) else float(c)
        except OverflowError:  # an int beyond the float range
            value = math.inf
        if not cmath.isfinite(value):
            where, fix = f"scale({short(c, 40)})", "pass a finite constant; to mask use st.fn"
            raise error("E19", where, expected="a finite number", found=repr(value), fix=fix)
        set_fields(self, c=value + 0.0, kind=type(value))  # + 0.0 turns -0.0 into 0.0 (equal to it)

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.asarray(x) * self.c

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        c = spec["c"]  # a number, or [real, imag]; anything else as found, for the error
        return cls(
            complex(*c) if isinstance(c, list) and len(c) == 2 and all(map(is_real, c)) else c
        )

    def fold(self, after: Transform) -> Transform | None:
        if not isinstance(after, _Scale):
            return None
        c = self.c * after.c
        return _Scale(c) if cmath.isfinite(c) else None  # None: keep the overflow

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names:
        return tuple(names)


@dataclasses.dataclass(frozen=True)
class _Fn(Transform, name="fn"):
    """The class of :func:`fn`: written by name, read back only from the functions given."""

    function: ArrayFn
    field_docs: ClassVar = {"function": "a 'module:qualname' string such as 'mylib.ops:softcap'"}

    def __post_init__(self) -> None:
        f, fix = self.function, "pass a module-level function, e.g. st.fn(jnp.flipud)"
        if not callable(f):
            raise wrong_type("E73", "fn(f)", "a function from array to array", f, fix)
        try:
            hash(f)
        except TypeError as e:
            raise wrong_type("E13", "fn(f)", "a hashable function", f, fix) from e

    def __call__(self, x: ArrayLike) -> jax.Array:
        out = self.function(jnp.asarray(x))
        if not isinstance(out, (jax.Array, np.ndarray, np.generic)):  # tracers are jax.Arrays
            found, fix = found_type(out, 60), "return one array"
            raise error("E66", f"{self!r}", "returned no array", found=found, fix=fix)
        return out

    def spec(self) -> dict[str, Any]:
        f = self.function
        name = f"{getattr(f, '__module__', None)}:{getattr(f, '__qualname__', None)}"
        try:  # saving only: the function must be found again by its name (reading never imports)
            found = pkgutil.resolve_name(name) is f  # "<locals>", "<lambda>": a ValueError
        except (ImportError, AttributeError, ValueError):
            found = False
        if not found:
            expected = "a function importable by module and name"
            fix = "define the function at module level, or use built-in transforms"
            raise error("E102", f"{self!r}.spec()", expected=expected, found=name, fix=fix)
        return {"name": "fn", "function": name}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        name = spec["function"]
        module, sep, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
        if not sep or not all(p.isidentifier() for p in (*module.split("."), *qualname.split("."))):
            raise bad_field(cls, spec, "function", name)
        return _Fn(resolve(name))

    def traceable(self) -> bool:
        return False

    def __repr__(self) -> str:
        name = getattr(self.function, "__qualname__", None)
        return f"fn({name if isinstance(name, str) else repr(self.function)})"


# --- the public functions: each documents its class ----------------------------------------

T: Transform = _Transpose()
"""Reverse all axes, like ``x.T``, for any number of dimensions (equal to ``transpose()``)."""


def transpose(*axes: int | Sequence[int]) -> Transform:
    """Permute axes like ``jnp.transpose(x, axes)``; no axes reverses them (``T``).

    ``axes`` is a permutation of ``0 .. n-1`` (negative axes count from the end and are
    stored as positive ones, so spellings of one permutation are equal).

    Example:
        >>> import sharetree as st
        >>> st.transpose() == st.T, st.transpose(0, 2, 1), st.transpose(-1, 0)
        (True, transpose(0, 2, 1), transpose(1, 0))
    """
    return _Transpose(_args(axes))  # no axes: equal to T


def reshape(*shape: int | Sequence[int]) -> Transform:
    """Reshape like ``jnp.reshape(x, shape)``: sizes ``>= 0``, at most one ``-1``.

    Example:
        >>> import numpy as np, sharetree as st
        >>> st.reshape(4, -1)(np.zeros(24)).shape, st.reshape(24) >> st.reshape(2, -1)
        ((4, 6), reshape(2, 12))
    """
    return _Reshape(_args(shape))


def astype(dtype: DTypeLike) -> Transform:
    """Cast to ``dtype``, a boolean or numeric dtype (a ``bfloat16`` view of a ``float32`` buffer).

    ``dtype`` is a ``np.dtype``, a scalar type (``jnp.bfloat16``, ``np.float32``) or its name
    (``"float16"``), stored by its NumPy name.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.astype(jnp.bfloat16), st.astype("float16") == st.astype(jnp.float16)
        (astype(bfloat16), True)
    """
    return _AsType(dtype)


def scale(c: complex | np.number[Any]) -> Transform:
    """Multiply by the constant ``c``, a finite real or complex number.

    A real ``c`` is stored as a float (``scale(2) == scale(2.0)``); a complex one stays
    complex and makes the view complex.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.scale(0.5)(jnp.ones(2, jnp.float16)).dtype, st.scale(2.0) >> st.scale(3.0)
        (dtype('float16'), scale(6.0))
    """
    return _Scale(c)


def fn(f: ArrayFn) -> Transform:
    """Wrap a hashable user function (array -> array, pure JAX) as a transform.

    A spec names ``f`` as ``"module:qualname"``; reading one takes the function only from
    the ``functions=`` given, never by importing.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.fn(jnp.flipud)
        fn(flipud)
    """
    return _Fn(f)
