"""Transforms: hashable, value-equal, picklable functions from a buffer to a view.

A transform is what a :class:`~sharetree.Tied` applies to the value it refers
to. Two transforms built the same way are equal and hash alike
(``st.T == st.transpose()``), so as static pytree aux data equal structures
never retrace under ``jit``. ``a >> b`` applies ``a`` first, then ``b``. Each
transform is one class registered under its spec name (see :class:`Transform`);
:func:`transform_from_spec` reads specs from that registry only.
"""

from __future__ import annotations

import cmath
import dataclasses
import functools
import math
import pkgutil
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from sharetree._errors import TieError

__all__ = [
    "Transform",
    "identity",
    "T",
    "transpose",
    "reshape",
    "astype",
    "scale",
    "fn",
    "chain",
    "transform_from_spec",
    "describe_spec",
]

ArrayFn = Callable[[jax.Array], jax.Array]
"""A user function from array to array (what :func:`fn` wraps)."""

Resolve = Callable[[str], ArrayFn]
"""How an ``fn`` spec's ``"module:qualname"`` becomes a function while reading a spec."""

_REGISTRY: dict[str, type[Transform]] = {}
"""Spec name -> the transform class that reads it (filled by ``Transform.__init_subclass__``)."""

_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlist, _show.maxdict, _show.maxlevel = 60, 60, 6, 6, 3


def canonical_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """The dtype JAX computes with: float64 is float32 while x64 is off (PRNG keys: unchanged)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype  # type: ignore[return-value]
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


class Transform:
    """Base class of every transform.

    A transform is one frozen dataclass registered by its spec name, which
    implements ``__call__`` (array in, array out, pure JAX), :meth:`spec` (a
    small JSON-able dict whose ``"name"`` is the spec name), the classmethod
    :meth:`from_spec` (its inverse) and, when two of them in a row can be one,
    :meth:`fold`. ``spec_fields`` names the fields of the spec besides
    ``"name"`` and describes their values (error messages quote it)::

        @dataclasses.dataclass(frozen=True)
        class _Flip(Transform, name="flip"):
            axis: int
            spec_fields: ClassVar[dict[str, str]] = {"axis": "an integer"}
            ...

    Example:
        >>> import numpy as np
        >>> import sharetree as st
        >>> t = st.T >> st.scale(2.0)
        >>> t
        T >> scale(2.0)
        >>> t(np.arange(6.0).reshape(2, 3)).shape
        (3, 2)
    """

    spec_name: ClassVar[str]
    spec_fields: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:
            return  # an abstract intermediate class: not readable from a spec
        old = _REGISTRY.get(name, cls)
        if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(
                f"transform spec name {name!r} is already taken by {old.__qualname__}; "
                "choose another name"
            )
        if cls.from_spec.__func__ is Transform.from_spec.__func__:  # type: ignore[attr-defined]
            raise TypeError(f"transform {cls.__qualname__} ({name!r}) must define from_spec")
        cls.spec_name = name
        _REGISTRY[name] = cls

    def __call__(self, x: ArrayLike) -> jax.Array:  # pragma: no cover - abstract
        """Compute the view of the buffer ``x``."""
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """Return a JSON-able description, the inverse of :func:`transform_from_spec`.

        By default ``"name"`` and each of ``spec_fields`` read from the attribute of that
        name, tuples written as lists, complex numbers as ``[real, imag]``, transforms as specs.
        """
        return {"name": self.spec_name, **{f: _json(getattr(self, f)) for f in self.spec_fields}}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        """Rebuild the transform from its spec, whose fields are present (checked before).

        Raise a :class:`TieError` naming the field when its value is wrong.
        ``resolve`` turns a function name into a function; only ``fn`` uses it.
        """
        raise NotImplementedError  # pragma: no cover - abstract

    def fold(self, after: Transform) -> Transform | None:
        """One transform equal to ``self >> after``, or ``None`` when they do not fold.

        :func:`chain` calls it on neighbours only, so a normalised chain never
        has two neighbours that fold.
        """
        return None

    def __rshift__(self, other: Transform) -> Transform:
        return chain(self, other)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the view of a buffer with shape and dtype ``aval``."""
        return jax.eval_shape(self, aval)


@dataclasses.dataclass(frozen=True)
class _Identity(Transform, name="identity"):
    """``identity``: the view is the buffer object itself; vanishes from every chain."""

    # returns its argument itself (a NumPy array stays that very object), not a jax.Array
    def __call__(self, x: ArrayLike) -> ArrayLike:  # type: ignore[override]
        return x

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        return identity

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return aval

    def __repr__(self) -> str:
        return "identity"

    def __reduce__(self) -> str:
        return "identity"  # unpickles to the module's singleton


@dataclasses.dataclass(frozen=True)
class _Transpose(Transform, name="transpose"):
    """``T`` / ``transpose(*axes)``: permute axes; see :func:`transpose`."""

    axes: tuple[int, ...] | None = None  # None: reverse all axes (T); else a permutation
    spec_fields: ClassVar = {"axes": "null (reverse all axes) or a list of integers"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.transpose(x, self.axes)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        axes = _field(spec, "axes", lambda v: v is None or _is_int_list(v))
        return _build(spec, "axes", transpose, *(axes or ()))  # null and [] are T

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

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        axes = self.axes or _reverse(len(aval.shape))
        if sorted(axes) != list(range(len(aval.shape))):
            return jax.eval_shape(self, aval)  # raises the real error
        dtype = canonical_dtype(aval.dtype)  # as jnp.transpose returns it
        return jax.ShapeDtypeStruct(tuple(aval.shape[a] for a in axes), dtype)

    def __repr__(self) -> str:
        return "T" if self.axes is None else f"transpose({', '.join(map(str, self.axes))})"


@dataclasses.dataclass(frozen=True)
class _Reshape(Transform, name="reshape"):
    """``reshape(*shape)``: see :func:`reshape`."""

    shape: tuple[int, ...]  # sizes >= 0 and at most one -1
    spec_fields: ClassVar = {"shape": "a list of integers"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.reshape(jnp.asarray(x), self.shape)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        return _build(spec, "shape", reshape, *_field(spec, "shape", _is_int_list))

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

    def __repr__(self) -> str:
        return f"reshape({', '.join(map(str, self.shape))})"


@dataclasses.dataclass(frozen=True)
class _AsType(Transform, name="astype"):
    """``astype(dtype)``: cast; see :func:`astype`."""

    dtype: str  # the NumPy name of a boolean or numeric dtype
    spec_fields: ClassVar = {"dtype": "a dtype name such as 'bfloat16'"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.asarray(x).astype(self.dtype)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        return _build(spec, "dtype", astype, _field(spec, "dtype", lambda v: isinstance(v, str)))

    def fold(self, after: Transform) -> Transform | None:
        # only the same cast twice: a cast after a different one may lose what it kept
        return self if after == self else None

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(aval.shape, canonical_dtype(self.dtype))

    def __repr__(self) -> str:
        return f"astype({self.dtype})"


@dataclasses.dataclass(frozen=True, eq=False)
class _Scale(Transform, name="scale"):
    """``scale(c)``: multiply by a finite constant; see :func:`scale`."""

    c: float | complex  # finite; complex only when given as complex
    spec_fields: ClassVar = {"c": "a finite number, or [real, imag] for a complex one"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.asarray(x) * self.c

    # 2.0 == 2+0j in Python, but scale(2+0j) makes a view complex: the type is part of the value
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Scale):
            return NotImplemented
        return type(self.c) is type(other.c) and self.c == other.c

    def __hash__(self) -> int:
        return hash((_Scale, type(self.c), self.c))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        pair = isinstance(c := spec["c"], (list, tuple)) and len(c) == 2
        c = _field(spec, "c", lambda v: all(map(_is_real, v)) if pair else _is_real(v))
        return _build(spec, "c", scale, complex(*c) if pair else c)

    def fold(self, after: Transform) -> Transform | None:
        if not isinstance(after, _Scale):
            return None
        c = self.c * after.c
        return _Scale(c + 0.0) if cmath.isfinite(c) else None  # None: keep the overflow

    def __repr__(self) -> str:
        return f"scale({self.c!r})"


@dataclasses.dataclass(frozen=True)
class _Fn(Transform, name="fn"):
    """``fn(f)``: a user function; written by name, read back only from given functions."""

    f: ArrayFn
    spec_fields: ClassVar = {"function": "a 'module:qualname' string such as 'mylib.ops:softcap'"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        out = self.f(jnp.asarray(x))
        if not isinstance(out, (jax.Array, np.ndarray, np.generic)):  # tracers are jax.Arrays
            raise TieError(  # a view is one leaf: None would vanish, a tuple add leaves
                f"{self!r} returned "
                f"{type(out).__name__} {_show.repr(out)}, not an array. Fix: return one array "
                "from the function (a view is one leaf of the materialized tree)."
            )
        return out

    def spec(self) -> dict[str, Any]:
        module = getattr(self.f, "__module__", None)
        qualname = getattr(self.f, "__qualname__", None)
        # Saving checks that the user's own function is found again by its name. This
        # imports the user's module (already imported, since the function exists), at save
        # time only; reading a spec never imports anything (see _Fn.from_spec).
        if not module or not qualname or "<" in qualname or _import(module, qualname) is not self.f:
            raise TieError(
                f"fn({self.f!r}) cannot be written to a file: only functions importable by "
                "module and name can. Fix: define the function at module level, or "
                "express the view with built-in transforms (transpose, reshape, astype, scale)."
            )
        return {"name": "fn", "function": f"{module}:{qualname}"}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        return _Fn(resolve(_field(spec, "function", _is_function_name)))  # resolve checked it

    def __repr__(self) -> str:
        name = getattr(self.f, "__qualname__", None)
        return f"fn({name if isinstance(name, str) else repr(self.f)})"


@dataclasses.dataclass(frozen=True)
class _Chain(Transform, name="chain"):
    """``a >> b >> ...``: built only by :func:`chain`, so always in normal form."""

    parts: tuple[Transform, ...]  # normal form: >= 2 parts, no identity, no chain, no folds
    spec_fields: ClassVar = {"parts": "a list of transform specs that are not chains"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        return functools.reduce(lambda y, part: part(y), self.parts, x)  # type: ignore[return-value]

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        parts = _field(spec, "parts", lambda v: isinstance(v, (list, tuple)))
        for p in parts:
            if isinstance(p, Mapping) and p.get("name") == "chain":
                raise _bad_field(spec, "parts", p)  # chains are flat: depth stays bounded
        return chain(*(_from_spec(p, resolve) for p in parts))

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return functools.reduce(lambda a, part: part.abstract(a), self.parts, aval)

    def __repr__(self) -> str:
        return " >> ".join(map(repr, self.parts))


@dataclasses.dataclass(frozen=True)
class _Unresolved:
    """Stands for an ``fn`` spec's function in :func:`describe_spec`; never called."""

    name: str

    def __call__(self, x: jax.Array) -> jax.Array:
        raise TieError(  # pragma: no cover - describe_spec returns text only
            f"fn({self.name}) was only described, not restored. Fix: restore it with "
            f"transform_from_spec(spec, functions={{{self.name!r}: ...}})."
        )

    def __repr__(self) -> str:
        return self.name


identity: Transform = _Identity()
"""The identity transform: the view is the buffer itself (the same object)."""

T: Transform = _Transpose()
"""Reverse all axes, like ``x.T``, for any number of dimensions (equal to ``transpose()``)."""


def transpose(*axes: int | Sequence[int]) -> Transform:
    """Permute axes like ``jnp.transpose(x, axes)``; no axes reverses them (``T``).

    ``axes`` must be a permutation of ``0 .. n-1`` (negative axes count from
    the end and are stored as their positive equivalents, so spellings of the
    same permutation are equal); the view of a buffer with another number of
    dimensions is an error when it is computed. An explicit identity
    permutation such as ``transpose(0, 1, 2)`` is kept as written (a rank check)
    until it folds with a neighbour. Two transposes in a row compose into one,
    and vanish when they cancel (see :func:`chain`).

    Example:
        >>> import sharetree as st
        >>> st.transpose() == st.T, st.transpose(0, 2, 1), st.transpose(-1, 0)
        (True, transpose(0, 2, 1), transpose(1, 0))
    """
    given = _ints("transpose", axes)
    if not given:
        return T
    n = len(given)
    perm = tuple(a % n if -n <= a < n else a for a in given)
    if sorted(perm) != list(range(n)):
        raise TieError(
            f"transpose({', '.join(map(repr, given))}): expected a permutation of the axes "
            f"0..{n - 1} (each once; negative axes count from the end), found "
            f"{list(given)}. Fix: name every axis once, e.g. transpose(1, 0) for a matrix, "
            "or st.T to reverse all axes."
        )
    return _Transpose(perm)


def _ints(name: str, values: Sequence[Any]) -> tuple[int, ...]:
    """``values`` (or its one list or tuple) as ints, else a TieError for ``name(...)``."""
    if len(values) == 1 and isinstance(values[0], (tuple, list)):
        values = tuple(values[0])
    bad = [v for v in values if not _is_int(v)]
    if bad:
        raise TieError(
            f"{name}({', '.join(map(repr, values))}): expected integers, "
            f"found {type(bad[0]).__name__} {bad[0]!r}. "
            f"Fix: pass integer {'axes' if name == 'transpose' else 'sizes'}, e.g. "
            f"{name}({'1, 0' if name == 'transpose' else '2, 3'})."
        )
    return tuple(int(v) for v in values)


def reshape(*shape: int | Sequence[int]) -> Transform:
    """Reshape like ``jnp.reshape(x, shape)``: sizes ``>= 0``, at most one ``-1``.

    The view of a buffer whose size does not fit ``shape`` is an error when it
    is computed. Two reshapes in a row are the second one (with its ``-1``
    filled in when the first fixes the size).

    Example:
        >>> import numpy as np, sharetree as st
        >>> st.reshape(4, 6)(np.zeros(24)).shape
        (4, 6)
        >>> st.reshape(24) >> st.reshape(2, -1)
        reshape(2, 12)
    """
    sizes = _ints("reshape", shape)
    if sizes.count(-1) > 1 or any(d < -1 for d in sizes):
        raise TieError(
            f"reshape({', '.join(map(repr, sizes))}): expected sizes >= 0 and at most one -1 "
            f"(the size inferred from the others), found {list(sizes)}. "
            "Fix: give every size but one, e.g. reshape(4, -1)."
        )
    return _Reshape(sizes)


def astype(dtype: DTypeLike) -> Transform:
    """Cast to ``dtype`` (e.g. a ``bfloat16`` compute view of a ``float32`` master buffer).

    ``dtype`` is a boolean or numeric dtype given as a ``np.dtype``, a scalar
    type (``jnp.bfloat16``, ``np.float32``, ``float``) or its name
    (``"float16"``); anything else, ``None`` included, is a :class:`TieError`.
    Gradients flow back to the buffer in the buffer's own dtype. A cast is
    never composed with a different cast: ``astype(f16) >> astype(f32)``
    rounds to float16 and stays two steps.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.astype(jnp.bfloat16), st.astype("float16") == st.astype(jnp.float16)
        (astype(bfloat16), True)
    """
    problem = f"is {type(dtype).__name__}"
    if isinstance(dtype, (np.dtype, type, str)):
        try:
            d = jnp.dtype(dtype)
            if d == np.dtype(bool) or jnp.issubdtype(d, np.number):
                return _AsType(d.name)
            problem = f"is {d}, which JAX cannot compute with"
        except TypeError as e:
            problem = f"is not a dtype ({e})"
    raise TieError(
        f"astype({dtype!r}): the dtype argument {problem}; expected a boolean or numeric dtype: "
        "a np.dtype, a scalar type (jnp.bfloat16, np.float32) or its name ('float16'). "
        "Fix: pass e.g. st.astype(jnp.bfloat16)."
    )


def scale(c: complex | np.number[Any]) -> Transform:
    """Multiply by the constant ``c``, a finite real or complex number.

    ``c`` is a Python or NumPy number other than ``bool``; ``nan``, ``inf`` and
    values too large for a float are a :class:`TieError` (``nan`` is not equal
    to itself, so equal trees would get unequal structures). Integers become
    floats (``scale(2) == scale(2.0)``), ``-0.0`` becomes ``0.0``; a complex
    ``c`` stays complex (``scale(2+0j) != scale(2.0)``) and round-trips
    through its spec as ``[real, imag]``.

    The dtype of the view follows JAX's promotion of an array times a Python
    scalar: a real ``c`` keeps a floating or complex buffer's dtype (as JAX
    computes it: float64 is float32 while x64 is off) and turns an integer or
    boolean buffer into the default float dtype; a complex ``c`` makes the
    view complex (complex64 for float32, float16 or bfloat16 buffers). Two
    scales in a row are one, ``scale(a) >> scale(b) == scale(a * b)``, unless
    the product overflows.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> float(st.scale(0.5)(4.0))
        2.0
        >>> st.scale(0.5)(jnp.ones(2, jnp.float16)).dtype, st.scale(0.5)(jnp.ones(2, int)).dtype
        (dtype('float16'), dtype('float32'))
        >>> st.scale(1j)(jnp.ones(2, jnp.bfloat16)).dtype
        dtype('complex64')
        >>> st.scale(2.0) >> st.scale(3.0)
        scale(6.0)
    """
    if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, complex, np.number)):
        raise TieError(
            f"scale(c) takes a finite Python or NumPy number; got {type(c).__name__} {c!r}. "
            "Fix: pass a constant such as 0.5; for a learned scale use a separate buffer."
        )
    value: float | complex
    try:
        value = complex(c) if isinstance(c, (complex, np.complexfloating)) else float(c)
    except OverflowError:  # an int beyond the float range
        value = math.inf
    if not cmath.isfinite(value):
        raise TieError(
            f"scale({_show.repr(c)}): expected a finite number, found {value!r}; a nan or infinite "
            "scale is not equal to itself and cannot be written to a file. Fix: pass a "
            "finite constant; to mask values use st.fn with a module-level function."
        )
    return _Scale(value + 0.0)  # + 0.0 turns -0.0 into 0.0, which compares equal to it


def fn(f: ArrayFn) -> Transform:
    """Wrap a user function (array -> array, pure JAX) as a transform.

    ``f`` is called with a ``jax.Array``. It must be hashable; two ``fn``
    transforms are equal when their functions are. ``fn`` transforms are
    never composed with their neighbours. Use module-level functions (not
    lambdas) so that the transform is picklable and can be saved; loading it
    back needs the function passed in (see :func:`transform_from_spec`).

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.fn(jnp.flipud)
        fn(flipud)
    """
    if not callable(f):
        raise TieError(
            f"fn(f) takes a callable; got {type(f).__name__} {f!r}. "
            "Fix: pass a function from array to array, e.g. st.fn(jnp.flipud)."
        )
    try:
        hash(f)
    except TypeError as e:
        raise TieError(
            f"fn(f): the function {f!r} is not hashable ({e}); transforms are static "
            "pytree aux data and must be hashable. Fix: pass a module-level function "
            "or a functools.partial of hashable arguments."
        ) from None
    return _Fn(f)


def chain(*parts: Transform) -> Transform:
    """Compose transforms left to right (``chain(a, b)`` is ``a >> b``) into a normal form.

    Neighbours that are one transform are folded: two transposes are one
    (nothing when they cancel; ``T >> T`` is ``identity``), two reshapes are
    the second, two scales are their product, the same cast twice is one.
    Identities vanish, nested chains are flattened and a chain of one part is
    that part. Nothing folds across a different cast (``astype(f16) >>
    astype(f32)`` loses precision on purpose) or an ``fn``. The result never
    has more parts than the input, and computes the same view as applying the
    parts one by one wherever that succeeds (scales up to the rounding of
    their product).

    Building left to right in any way (``a >> b >> c``, ``chain(a, b, c)``,
    one part at a time) gives one normal form, and so do other groupings
    (``a >> (b >> c)``) with one exception: a fold drops the rank check of the
    transposes it cancels (``transpose(1, 0, 2) >> transpose(1, 0, 2)`` is
    ``identity`` for buffers of any rank), so where ``T`` meets explicit axes
    or an explicit identity permutation, two groupings can keep different
    rank checks (``T`` or ``transpose(1, 0)``) for the same view. Appending to
    a normal form only looks at its end, so building a chain one part at a
    time takes linear time.

    Example:
        >>> import sharetree as st
        >>> st.chain(st.identity, st.T, st.identity) == st.T
        True
        >>> st.T >> st.T >> st.scale(2.0) >> st.identity >> st.scale(3.0)
        scale(6.0)
        >>> st.transpose(1, 0, 2) >> st.T
        transpose(2, 0, 1)
    """
    out: list[Transform] = []
    for p in parts:
        check_transform(p)
        rest = parts_of(p)
        for i, q in enumerate(rest):
            if _push(out, q) and i + 1 < len(rest):
                out.extend(rest[i + 1 :])  # q was kept as is: its neighbours in p do not fold
                break
    if len(out) < 2:
        return out[0] if out else identity
    return _Chain(tuple(out))


def parts_of(t: Transform) -> tuple[Transform, ...]:
    """The transforms a chain applies, in order; ``(t,)`` for a transform that is not a chain.

    Example:
        >>> import sharetree as st
        >>> from sharetree._transforms import parts_of
        >>> parts_of(st.T >> st.reshape(6)), parts_of(st.T)
        ((T, reshape(6)), (T,))
    """
    return t.parts if isinstance(t, _Chain) else (t,)


def _push(stack: list[Transform], t: Transform) -> bool:
    """Append ``t`` to a normal form, folding it into the end; True if kept unchanged."""
    kept = True
    while t != identity:
        folded = stack[-1].fold(t) if stack else None
        if folded is None:
            stack.append(t)
            return kept
        stack.pop()
        t, kept = folded, False
    return False


def check_transform(t: Any, where: str = "") -> Transform:
    """Return ``t`` if it is a hashable transform, else raise a TieError."""
    where = f" {where}" if where else ""
    if not isinstance(t, Transform):
        names = ", ".join(f"st.{name}" for name in _REGISTRY)
        hint = "wrap the function with st.fn(...)" if callable(t) else f"use one of {names}"
        raise TieError(
            f"transform{where}: expected a sharetree transform, got {type(t).__name__} {t!r}. "
            f"Fix: {hint}."
        )
    try:
        hash(t)
    except TypeError as e:
        raise TieError(
            f"transform{where}: {t!r} is not hashable ({e}); transforms are static aux data. "
            "Fix: build it from hashable arguments (tuples, numbers, module-level functions)."
        ) from None
    return t


def _import(module: str, qualname: str) -> Any:
    """The object ``module:qualname`` of the user's own code (used when saving only)."""
    try:
        return pkgutil.resolve_name(f"{module}:{qualname}")
    except (ImportError, AttributeError, ValueError):
        return None


def _reverse(n: int) -> tuple[int, ...]:
    return tuple(range(n - 1, -1, -1))


def _json(v: Any) -> Any:
    """A field as JSON: tuples as lists, complex as [real, imag], transforms as specs."""
    if isinstance(v, tuple):
        return [_json(x) for x in v]
    if isinstance(v, complex):
        return [v.real, v.imag]
    return v.spec() if isinstance(v, Transform) else v


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return _is_int(v) or isinstance(v, (float, np.floating))


def _is_function_name(name: Any) -> bool:
    module, sep, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    return bool(sep) and all(p.isidentifier() for p in (*module.split("."), *qualname.split(".")))


def _field(spec: Mapping[str, Any], field: str, ok: Callable[[Any], bool]) -> Any:
    """``spec[field]`` if ``ok`` says its type is right, else the TieError naming the field."""
    if not ok(value := spec[field]):
        raise _bad_field(spec, field, value)
    return value


def _is_int_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(map(_is_int, v))


def _bad_field(spec: Mapping[str, Any], field: str, found: Any, why: str = "") -> TieError:
    cls = _REGISTRY[spec["name"]]
    why = f" ({why})" if why else ""
    return TieError(
        f"transform spec {_show.repr(spec)}: field {field!r} of {cls.spec_name!r} should be "
        f"{cls.spec_fields[field]}, found {type(found).__name__} {_show.repr(found)}{why}. "
        f"Fix: {_SPEC_FIX}"
    )


def _build(
    spec: Mapping[str, Any], field: str, factory: Callable[..., Transform], *args: Any
) -> Transform:
    try:
        return factory(*args)
    except TieError as e:
        found = args[0] if len(args) == 1 else list(args)
        raise _bad_field(spec, field, found, str(e).split(" Fix:")[0].rstrip(".")) from None


_SPEC_FIX = (
    "build specs with Transform.spec(), e.g. st.reshape(2, 3).spec(); a file written by "
    "sharetree with this spec is damaged."
)


def _from_spec(spec: object, resolve: Resolve) -> Transform:
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise TieError(
            f"transform spec: expected a dict with a 'name' field, found "
            f"{type(spec).__name__} {_show.repr(spec)}. Fix: {_SPEC_FIX}"
        )
    name = spec["name"]
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise TieError(
            f"transform spec: unknown transform name {_show.repr(name)}; known: "
            f"{', '.join(sorted(_REGISTRY))}. Fix: upgrade sharetree, or check the file "
            "was written by sharetree."
        )
    problems = [f"the field {f!r} is missing" for f in cls.spec_fields if f not in spec] + [
        f"the field {_show.repr(k)} is not one of its fields"
        for k in spec
        if k != "name" and k not in cls.spec_fields
    ]
    if problems:
        fields = ", ".join(f"{f!r} ({d})" for f, d in cls.spec_fields.items()) or "none"
        raise TieError(
            f"transform spec {_show.repr(spec)}: {problems[0]}; the fields of {name!r} besides "
            f"'name' are: {fields}. Fix: {_SPEC_FIX}"
        )
    return cls.from_spec(spec, resolve)


def transform_from_spec(
    spec: object, *, functions: Mapping[str, ArrayFn] | None = None
) -> Transform:
    """Rebuild a transform from :meth:`Transform.spec` output, without running any code.

    Nothing named in ``spec`` is imported or called: an ``fn`` spec names its
    function as ``"module:qualname"`` and is restored only from ``functions``,
    a mapping from those names to the functions themselves. Every bad spec is
    a :class:`TieError`: an unknown name lists the known ones, a bad field of a
    known transform names the field, and a function missing from
    ``functions`` names the function and how to pass it.

    Args:
        spec: a dict as written by :meth:`Transform.spec` (e.g. read from a file).
        functions: ``{"module:qualname": function}`` for the ``fn`` transforms in
            ``spec``; other names in it are ignored.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> t = st.T >> st.reshape(6)
        >>> st.transform_from_spec(t.spec()) == t
        True
        >>> spec = st.fn(jnp.flipud).spec()
        >>> st.transform_from_spec(spec, functions={spec["function"]: jnp.flipud})
        fn(flipud)
    """
    if functions is not None and not isinstance(functions, Mapping):
        raise TieError(
            f"transform_from_spec(functions=...): expected a mapping from 'module:qualname' "
            f"to a function, found {type(functions).__name__}. "
            "Fix: pass e.g. functions={'mylib.ops:softcap': softcap}."
        )

    def resolve(name: str) -> ArrayFn:
        if functions is None or name not in functions:
            last = name.rpartition(":")[2].rpartition(".")[2]
            given = ", ".join(map(repr, list(functions or ())[:5]))
            given = f"the functions given are {given}" if given else "no functions were given"
            raise TieError(
                f"transform spec fn({name}): the function {name!r} is not among the functions "
                f"passed in ({given}); a file's names are never imported or called. Fix: pass "
                f"it yourself, e.g. st.load(path, functions={{{name!r}: {last}}}) or "
                f"st.transform_from_spec(spec, functions={{{name!r}: {last}}})."
            )
        try:
            fn(f := functions[name])  # callable and hashable
        except TieError as e:
            raise TieError(f"transform spec fn({name}): functions[{name!r}]: {e}") from None
        return f

    return _from_spec(spec, resolve)


def describe_spec(spec: object) -> str:
    """Render a transform spec as text without resolving, importing or calling anything.

    The text is the transform's ``repr`` (in normal form), with an ``fn``
    shown by the name its spec stores: ``fn(mylib.ops:softcap)``. A malformed
    spec is a :class:`TieError`, as in :func:`transform_from_spec`.

    Example:
        >>> import sharetree as st
        >>> from sharetree._transforms import describe_spec
        >>> describe_spec({"name": "fn", "function": "mylib.ops:softcap"})
        'fn(mylib.ops:softcap)'
        >>> describe_spec((st.T >> st.scale(2.0)).spec())
        'T >> scale(2.0)'
    """
    return repr(_from_spec(spec, _Unresolved))
