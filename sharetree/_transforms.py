"""Transforms: hashable, value-equal, picklable functions from a buffer to a view.

Each transform is a frozen dataclass registered under its spec name; ``a >> b``
applies ``a``, then ``b``. Equal transforms hash alike, so as static aux data
equal structures never retrace under ``jit``. docs/ties_and_transforms.md
describes each transform and how to write your own.
"""

from __future__ import annotations

import builtins
import cmath
import dataclasses
import functools
import json
import math
import pkgutil
import reprlib
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from sharetree._errors import TieError, TieTypeError

__all__ = [
    "Transform",
    "identity",
    "T",
    "transpose",
    "reshape",
    "astype",
    "scale",
    "fn",
    "slice",
    "index",
    "chain",
    "transform_from_spec",
    "describe_spec",
    "describe_transform",
    "is_described",
    "view_axis_names",
]

ArrayFn = Callable[[jax.Array], jax.Array]
"""A user function from array to array (what :func:`fn` wraps)."""

Resolve = Callable[[str], ArrayFn]
"""How an ``fn`` spec's ``"module:qualname"`` becomes a function while reading a spec."""

Names = tuple[Any, ...]
"""One name per axis (a Flax partition name, a ``PartitionSpec`` entry, or ``None``)."""

_REGISTRY: dict[str, type[Transform]] = {}
"""Spec name -> the transform class that reads it (filled by ``Transform.__init_subclass__``)."""

_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlist, _show.maxdict, _show.maxlevel = 40, 60, 6, 6, 3


def canonical_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """The dtype JAX computes with: float64 is float32 while x64 is off (PRNG keys: unchanged)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype  # type: ignore[return-value]
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


class Transform:
    """Base class of every transform: a frozen dataclass registered by ``name=``.

    A subclass defines ``__call__`` (pure JAX) and overrides the other methods
    where it knows better than their defaults; a chain answers each of them part
    by part. docs/ties_and_transforms.md ("Your own transforms") lists them.

    Example:
        >>> import dataclasses, jax.numpy as jnp, sharetree as st
        >>> @dataclasses.dataclass(frozen=True)
        ... class Flip(st.Transform, name="doc_flip"):
        ...     axis: int = 0
        ...     def __call__(self, x):
        ...         return jnp.flip(x, self.axis)
        >>> st.transform_from_spec((st.T >> Flip(1)).spec()), Flip(1).state_view()
        (T >> Flip(axis=1), None)
    """

    spec_name: ClassVar[str]
    field_docs: ClassVar[Mapping[str, str]] = {}
    """What each field's spec value should be (error messages quote it; default: its type)."""

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ != __name__:  # a user's class
            ours = (b for b in cls.__mro__[1:] if b.__module__ == __name__ and b is not Transform)
            built_in = next(ours, None)
            if built_in is not None:  # its fold, state_view, ... would not know the new __call__
                raise TieTypeError(
                    f"transform class {cls.__qualname__} subclasses the built-in "
                    f"{built_in.__qualname__}, whose other methods (fold, inverse, ...) assume "
                    "its own __call__. Fix: subclass st.Transform and define what you need."
                )
        if name is None:
            return  # an abstract intermediate class: not readable from a spec
        if not isinstance(name, str) or not name:
            raise TieTypeError(
                f"transform class {cls.__qualname__}: name= must be a non-empty str, found "
                f"{type(name).__name__} {name!r:.40}. Fix: e.g. class {cls.__name__}"
                f"(st.Transform, name='mylib_{cls.__name__.lower()}')."
            )
        old = _REGISTRY.get(name, cls)
        if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TieTypeError(
                f"transform spec name {name!r} is already taken by {old.__qualname__}. "
                "Fix: choose another name (e.g. prefixed with your package's)."
            )
        cls.spec_name = name
        _REGISTRY[name] = cls

    def __call__(self, x: ArrayLike) -> jax.Array:  # pragma: no cover - abstract
        """Compute the view of the buffer ``x``."""
        raise NotImplementedError

    def __rshift__(self, other: Transform) -> Transform:
        return chain(self, other)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the view of a buffer with shape and dtype ``aval``."""
        return jax.eval_shape(self, aval)

    def spec(self) -> dict[str, Any]:
        """A JSON-able dict of ``"name"`` and each field, read back by :func:`transform_from_spec`.

        Example:
            >>> import sharetree as st
            >>> st.slice(0, 5, axis=1).spec()
            {'name': 'slice', 'start': 0, 'stop': 5, 'axis': 1}
        """
        return {"name": self.spec_name, **{f: _json(getattr(self, f)) for f in _fields(type(self))}}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        """Rebuild the transform from its spec, whose fields are all present (checked before).

        By default each field is read back by its annotation, then the class is called.
        ``resolve`` turns an ``fn`` spec's function name into the function.
        """
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # a name the class's module cannot resolve: keep the strings
            hints = {}
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        kinds = {f.name: hints.get(f.name, f.type) for f in fields if f.init}
        return _construct(cls, spec, {f: _read(spec[f], kinds[f], resolve) for f in kinds})

    def fold(self, after: Transform) -> Transform | None:
        """One transform equal to ``self >> after``, or ``None`` when they do not fold."""
        return None

    def state_view(self) -> Transform | None:
        """The transform of a per-element optimizer state (Adam's moments), or ``None``: unknown."""
        return None

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        """The names of the view's axes from the buffer's, or ``None`` if they are not its axes."""
        return None

    def inverse(self) -> Transform | None:
        """A transform ``u`` with ``u(self(x))`` equal to ``x`` bit for bit, or ``None``."""
        return None

    def numpy(self, x: np.ndarray) -> np.ndarray:
        """The view of a NumPy array, as a NumPy array (a view without a copy where one exists).

        Example:
            >>> import numpy as np, sharetree as st
            >>> a = np.arange(6.0).reshape(2, 3)
            >>> np.shares_memory(a, st.slice(1, 3, axis=1).numpy(a))
            True
        """
        return np.asarray(self(x))

    def traceable(self) -> bool:
        """Whether the view may be computed in one compiled call with others (``fn``: no)."""
        return True

    def __repr__(self) -> str:
        """A built-in transform as the call that makes it, e.g. ``slice(0, 5, axis=1)``."""
        if type(self).__module__ != __name__:  # a user's class that is no dataclass
            return object.__repr__(self)
        args: list[Any] = []
        for f in _fields(type(self)):
            v = getattr(self, f)
            if f != "axis":
                args += v if isinstance(v, tuple) else [v]
            elif v:  # axis 0 is the default: not shown
                args.append(f"axis={v}")
        return f"{self.spec_name}({', '.join(map(str, args))})" if args else self.spec_name


def _fields(cls: type[Transform]) -> tuple[str, ...]:
    """The spec fields of a transform class: its dataclass fields."""
    if not dataclasses.is_dataclass(cls):
        raise TieTypeError(
            f"transform {cls.__qualname__} is not a dataclass, so it has no fields to write "
            "to a spec. Fix: decorate it with @dataclasses.dataclass(frozen=True)."
        )
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def _doc(cls: type[Transform], field: str) -> str:
    if field in cls.field_docs:
        return cls.field_docs[field]
    kind = next(f.type for f in dataclasses.fields(cls) if f.name == field)  # type: ignore[arg-type]
    return f"a value of type {kind if isinstance(kind, str) else getattr(kind, '__name__', kind)}"


def _tuples(v: Any, depth: int = 4) -> Any:
    """A JSON value with its lists as tuples, ``depth`` levels deep (files never recurse deeper)."""
    if isinstance(v, list) and depth:
        return tuple(_tuples(x, depth - 1) for x in v)
    return v


_NOT_READ = object()
_nesting = threading.local()
_MAX_NESTING = 8
"""How deep transform fields may hold transforms in a spec (a file never drives deep recursion)."""


def _read(v: Any, kind: Any, resolve: Resolve) -> Any:
    """A field's spec value read back as its annotation ``kind`` says (inverts ``_json``)."""
    out = _read_as(v, kind, resolve)
    return _tuples(v) if out is _NOT_READ else out


def _read_as(v: Any, kind: Any, resolve: Resolve) -> Any:
    """``v`` read as ``kind`` (complex, a transform, a tuple or union of them), or ``_NOT_READ``."""
    if isinstance(kind, str):  # an annotation that did not resolve: known names only
        kind = {"complex": complex}.get(kind, Transform if kind.endswith("Transform") else None)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is complex:
        pair = isinstance(v, list) and len(v) == 2 and all(map(_is_real, v))
        return complex(*v) if pair else _NOT_READ
    if isinstance(kind, type) and issubclass(kind, Transform):
        return _nested_from_spec(v, resolve) if isinstance(v, Mapping) else _NOT_READ
    if origin is tuple and isinstance(v, list):
        many = len(args) == 2 and args[1] is Ellipsis
        if not many and len(args) != len(v):
            return _NOT_READ
        kinds = [args[0]] * len(v) if many else list(args)
        return tuple(_read(x, k, resolve) for x, k in zip(v, kinds, strict=True))
    if origin in (typing.Union, types.UnionType):
        for member in args:
            if (out := _read_as(v, member, resolve)) is not _NOT_READ:
                return out
    return _NOT_READ


def _nested_from_spec(spec: Mapping[str, Any], resolve: Resolve) -> Transform:
    depth = getattr(_nesting, "depth", 0)
    if depth >= _MAX_NESTING:
        raise TieError(
            f"transform spec {_show.repr(spec)}: transforms nested in transform fields more "
            f"than {_MAX_NESTING} deep. Fix: {_SPEC_FIX}"
        )
    _nesting.depth = depth + 1
    try:
        return _from_spec(spec, resolve)
    finally:
        _nesting.depth = depth


def _construct(cls: type[Transform], spec: Mapping[str, Any], values: dict[str, Any]) -> Transform:
    """``cls(**values)``; what it raises becomes the TieError naming the spec and its fields."""
    try:
        return cls(**values)
    except Exception as e:  # the class's own checks, e.g. in __post_init__
        why = str(e) if isinstance(e, TieError) else f"{type(e).__name__}: {e}"
        why = f" ({why if len(why) <= 200 else why[:197] + '...'})"
        if len(fields := _fields(cls)) == 1:
            raise _bad_field(cls, spec, fields[0], spec[fields[0]], why) from None
        raise TieError(
            f"transform spec {_show.repr(spec)}: the fields of {cls.spec_name!r} do not build a "
            f"transform{why}. Fix: {_SPEC_FIX}"
        ) from None


def _type_error(call: str, expected: str, found: Any, example: str) -> TieTypeError:
    return TieTypeError(
        f"{call}: expected {expected}, found {type(found).__name__} {_show.repr(found)}. "
        f"Fix: pass {example}."
    )


def _check_ints(call: str, values: Any, what: str, example: str) -> tuple[int, ...]:
    """``values`` (a tuple) as ints, else the TieTypeError for ``call``."""
    if not isinstance(values, tuple):
        raise _type_error(call, f"a tuple of {what}", values, example)
    bad = [v for v in values if not _is_int(v)]
    if bad:
        raise _type_error(call, what, bad[0], example)
    return tuple(int(v) for v in values)


def _axis(t: Transform, axis: int, shape: tuple[int, ...]) -> int:
    """``axis`` of a buffer of ``shape`` counted from 0, else the TieError for ``t``."""
    if not shape:
        raise TieError(
            f"{t!r} needs axis {axis}, but the buffer is a scalar (shape (), no axes). Fix: "
            "refer to a buffer that has that axis; a subtree tie views every array and number "
            "leaf of the subtree, so keep scalars out of a subtree tied with an axis transform "
            "(e.g. as a static field, or tie the array leaves one by one)."
        )
    if not -len(shape) <= axis < len(shape):
        raise TieError(
            f"{t!r} needs axis {axis}, but the buffer has shape {tuple(shape)} "
            f"({len(shape)} axes). Fix: pass axis= between {-len(shape)} and {len(shape) - 1}, "
            "or refer to a buffer that has that axis."
        )
    return axis % len(shape)


def _within(n: int, what: str) -> str:
    """The fix for a slice or index outside an axis of size ``n`` (``what``: what fits it)."""
    if n == 0:
        return "refer to a buffer whose axis is not empty: this axis has no entries to view."
    return (
        f"pass {what} (negative indices count from the end), or refer to the buffer this view "
        "was meant for."
    )


def _args_repr(values: Any) -> str:
    """A tuple of arguments as they were written in the call (bounded in length)."""
    text = _show.repr(list(values))[1:-1] if isinstance(values, tuple) else _show.repr(values)
    return text if len(text) <= 60 else text[:57] + "..."


def _set(obj: Any, **fields: Any) -> None:
    """Normalise fields of a frozen dataclass in ``__post_init__``."""
    for k, v in fields.items():
        object.__setattr__(obj, k, v)


class _Moves(Transform):
    """A transform that only moves or selects entries: optimizer moments move like the values."""

    def state_view(self) -> Transform:
        return self


@dataclasses.dataclass(frozen=True, repr=False)
class _Identity(_Moves, name="identity"):
    """``identity``: the view is the buffer object itself; vanishes from every chain."""

    def __call__(self, x: ArrayLike) -> ArrayLike:  # type: ignore[override]
        return x

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        return identity

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return aval

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names:
        return tuple(names)

    def inverse(self) -> Transform:
        return self

    def numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def __reduce__(self) -> str:
        return "identity"  # unpickles to the module's singleton


@dataclasses.dataclass(frozen=True)
class _Transpose(_Moves, name="transpose"):
    """``T`` / ``transpose(*axes)``: permute axes; see :func:`transpose`."""

    axes: tuple[int, ...] | None = None  # None: reverse all axes (T); else a permutation
    field_docs: ClassVar = {"axes": "null (reverse all axes) or a list of integers"}

    def __post_init__(self) -> None:
        if self.axes is None:
            return
        call = f"transpose({_args_repr(self.axes)})"
        given = _check_ints(call, self.axes, "integers", "integer axes, e.g. transpose(1, 0)")
        n = len(given)
        perm = tuple(a % n if -n <= a < n else a for a in given)
        if sorted(perm) != list(range(n)):
            raise TieError(
                f"{call}: expected a permutation of the axes 0..{n - 1} (each once; negative "
                f"axes count from the end), found {list(given)}. Fix: name every axis once, "
                "e.g. transpose(1, 0) for a matrix, or st.T to reverse all axes."
            )
        _set(self, axes=perm or None)  # () is T

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
class _Reshape(_Moves, name="reshape"):
    """``reshape(*shape)``: see :func:`reshape`."""

    shape: tuple[int, ...]  # sizes >= 0 and at most one -1
    field_docs: ClassVar = {"shape": "a list of integers"}

    def __post_init__(self) -> None:
        shown = _args_repr(self.shape)
        sizes = _check_ints(
            f"reshape({shown})", self.shape, "integers", "integer sizes, e.g. reshape(2, 3)"
        )
        if sizes.count(-1) > 1 or any(d < -1 for d in sizes):
            raise TieError(
                f"reshape({shown}): expected sizes >= 0 and at most one -1 "
                f"(the size inferred from the others), found {list(sizes)}. "
                "Fix: give every size but one, e.g. reshape(4, -1)."
            )
        _set(self, shape=sizes)

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


@dataclasses.dataclass(frozen=True, repr=False)
class _AsType(Transform, name="astype"):
    """``astype(dtype)``: cast; see :func:`astype`."""

    dtype: Any  # given as any dtype-like, stored as the NumPy name of a boolean or numeric dtype
    field_docs: ClassVar = {"dtype": "a dtype name such as 'bfloat16'"}

    def __post_init__(self) -> None:
        dtype = self.dtype
        fix = "Fix: pass e.g. st.astype(jnp.bfloat16)."
        expected = (
            "expected a boolean or numeric dtype: a np.dtype, a scalar type (jnp.bfloat16, "
            "np.float32) or its name ('float16')"
        )
        if not isinstance(dtype, (np.dtype, type, str)):
            raise TieTypeError(
                f"astype({_show.repr(dtype)}): the dtype argument is {type(dtype).__name__}; "
                f"{expected}. {fix}"
            )
        try:
            d = jnp.dtype(dtype)
        except TypeError as e:
            problem = f"is not a dtype ({e})"
        else:
            if d == np.dtype(bool) or jnp.issubdtype(d, np.number):
                _set(self, dtype=d.name)
                return
            problem = f"is {d}, which JAX cannot compute with"
        raise TieError(f"astype({dtype!r}): the dtype argument {problem}; {expected}. {fix}")

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
    """``scale(c)``: multiply by a finite constant; see :func:`scale`."""

    c: Any  # given as a Python or NumPy number; stored as a finite float, or complex if given so
    kind: type = dataclasses.field(init=False)  # 2.0 == 2+0j, but scale(2+0j) makes views complex
    field_docs: ClassVar = {"c": "a finite number, or [real, imag] for a complex one"}

    def __post_init__(self) -> None:
        c = self.c
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, complex, np.number)):
            raise TieTypeError(
                f"scale(c) takes a finite Python or NumPy number; got {type(c).__name__} "
                f"{_show.repr(c)}. Fix: pass a constant such as 0.5; for a learned scale use a "
                "separate buffer."
            )
        value: float | complex
        try:
            value = complex(c) if isinstance(c, (complex, np.complexfloating)) else float(c)
        except OverflowError:  # an int beyond the float range
            value = math.inf
        if not cmath.isfinite(value):
            raise TieError(
                f"scale({_show.repr(c)}): expected a finite number, found {value!r}; a nan or "
                "infinite scale is not equal to itself and cannot be written to a file. Fix: "
                "pass a finite constant; to mask values use st.fn with a module-level function."
            )
        _set(self, c=value + 0.0, kind=type(value))  # + 0.0 turns -0.0 into 0.0 (equal to it)

    def __call__(self, x: ArrayLike) -> jax.Array:
        return jnp.asarray(x) * self.c

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        c = _read_as(spec["c"], complex, resolve)  # [real, imag]; else as found, for the error
        return _construct(cls, spec, {"c": spec["c"] if c is _NOT_READ else c})

    def fold(self, after: Transform) -> Transform | None:
        if not isinstance(after, _Scale):
            return None
        c = self.c * after.c
        return _Scale(c) if cmath.isfinite(c) else None  # None: keep the overflow

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names:
        return tuple(names)


@dataclasses.dataclass(frozen=True)
class _Fn(Transform, name="fn"):
    """``fn(f)``: a user function; written by name, read back only from given functions."""

    function: ArrayFn
    field_docs: ClassVar = {"function": "a 'module:qualname' string such as 'mylib.ops:softcap'"}

    def __post_init__(self) -> None:
        f = self.function
        if not callable(f):
            raise TieTypeError(
                f"fn(f) takes a callable; got {type(f).__name__} {_show.repr(f)}. "
                "Fix: pass a function from array to array, e.g. st.fn(jnp.flipud)."
            )
        try:
            hash(f)
        except TypeError as e:
            raise TieTypeError(
                f"fn(f): the function {f!r} is not hashable ({e}); transforms are static "
                "pytree aux data and must be hashable. Fix: pass a module-level function "
                "or a functools.partial of hashable arguments."
            ) from None

    def __call__(self, x: ArrayLike) -> jax.Array:
        out = self.function(jnp.asarray(x))
        if not isinstance(out, (jax.Array, np.ndarray, np.generic)):  # tracers are jax.Arrays
            raise TieError(  # a view is one leaf: None would vanish, a tuple add leaves
                f"{self!r} returned "
                f"{type(out).__name__} {_show.repr(out)}, not an array. Fix: return one array "
                "from the function (a view is one leaf of the materialized tree)."
            )
        return out

    def spec(self) -> dict[str, Any]:
        f = self.function
        name = f"{getattr(f, '__module__', None)}:{getattr(f, '__qualname__', None)}"
        try:  # saving only: the function must be found again by its name (reading never imports)
            found = pkgutil.resolve_name(name) is f  # "<locals>", "<lambda>": a ValueError
        except (ImportError, AttributeError, ValueError):
            found = False
        if not found:
            raise TieError(
                f"fn({f!r}) cannot be written to a file: only functions importable by "
                "module and name can. Fix: define the function at module level, or "
                "express the view with built-in transforms (transpose, reshape, astype, scale)."
            )
        return {"name": "fn", "function": name}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        name = spec["function"]
        module, sep, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
        if not sep or not all(p.isidentifier() for p in (*module.split("."), *qualname.split("."))):
            raise _bad_field(cls, spec, "function", name)
        return _Fn(resolve(name))  # resolve checked it

    def traceable(self) -> bool:
        return False

    def __repr__(self) -> str:
        name = getattr(self.function, "__qualname__", None)
        return f"fn({name if isinstance(name, str) else repr(self.function)})"


def _nonempty(start: int, stop: int) -> str:
    """A ``st.slice`` call near the empty ``start:stop`` that is not empty for a large buffer."""
    if stop < start:  # reversed: the other way round (both counted from one end)
        return f"st.slice({stop}, {start})"
    if start < 0 and (stop == 0 or start + 1 == 0):  # from the end: to the end
        return f"st.slice({start}, None)"
    return f"st.slice({start}, {start + 1})"  # one entry


@dataclasses.dataclass(frozen=True, repr=False)
class _Slice(_Moves, name="slice"):
    """``slice(start, stop, axis)``: the entries ``start:stop`` of one axis; see :func:`slice`."""

    start: int
    stop: int | None = None  # None: to the end
    axis: int = 0
    field_docs: ClassVar = {
        "start": "an integer",
        "stop": "an integer or null (to the end)",
        "axis": "an integer",
    }

    def __post_init__(self) -> None:
        call = f"st.slice({self.start!r}, {self.stop!r}, axis={self.axis!r})"
        example = "integers, e.g. st.slice(0, 10) or st.slice(-2, None, axis=1)"
        for what, v in (("start", self.start), ("stop", self.stop), ("axis", self.axis)):
            if not _is_int(v) and not (what == "stop" and v is None):
                raise _type_error(call, f"an integer {what}", v, example)
        start, stop = int(self.start), None if self.stop is None else int(self.stop)
        # empty for every size: both counted from one end and stop <= start, or a
        # negative start (from the end) with the stop at 0 (the very beginning)
        if stop is not None and (((start < 0) == (stop < 0) and stop <= start) or stop == 0):
            raise TieError(
                f"{call}: the range {start}:{stop} is empty or reversed for every buffer, so the "
                "view would hold nothing; a slice keeps at least one entry, in the buffer's "
                f"order. Fix: pass a range that is not empty, e.g. {_nonempty(start, stop)}."
            )
        _set(self, start=start, stop=stop, axis=int(self.axis))

    def _bounds(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(axis, start, stop)`` counted from 0 for a buffer of ``shape``, else a TieError."""
        axis = _axis(self, self.axis, shape)
        n = shape[axis]
        start = self.start + n if self.start < 0 else self.start
        stop = n if self.stop is None else self.stop + n if self.stop < 0 else self.stop
        if not 0 <= start < stop <= n:
            raise TieError(
                f"{self!r} of a buffer of shape {tuple(shape)}: the range {self.start}:"
                f"{'' if self.stop is None else self.stop} of axis {axis} (size {n}) is "
                f"{'empty' if 0 <= start and stop <= n else 'outside it'}; a view never pads "
                f"or clips. Fix: {_within(n, f'a range within 0:{n}')}"
            )
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
class _Index(_Moves, name="index"):
    """``index(i, axis)``: entry ``i`` of one axis, which the view drops; see :func:`index`."""

    i: int
    axis: int = 0
    field_docs: ClassVar = {"i": "an integer", "axis": "an integer"}

    def __post_init__(self) -> None:
        call = f"st.index({self.i!r}, axis={self.axis!r})"
        for what, v in (("i", self.i), ("axis", self.axis)):
            if not _is_int(v):
                raise _type_error(call, f"an integer {what}", v, "integers, e.g. st.index(3)")
        _set(self, i=int(self.i), axis=int(self.axis))

    def _where(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(axis, i)`` counted from 0 for a buffer of ``shape``, else a TieError."""
        axis = _axis(self, self.axis, shape)
        n = shape[axis]
        if not -n <= self.i < n:
            raise TieError(
                f"{self!r} of a buffer of shape {tuple(shape)}: entry {self.i} is outside axis "
                f"{axis} (size {n}). Fix: {_within(n, f'an index between {-n} and {n - 1}')}"
            )
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


@dataclasses.dataclass(frozen=True)
class _Chain(Transform, name="chain"):
    """``a >> b >> ...``: built only by :func:`chain`, so always in normal form."""

    parts: tuple[Transform, ...]  # normal form: >= 2 parts, no identity, no chain, no folds
    field_docs: ClassVar = {"parts": "a list of transform specs that are not chains"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        return functools.reduce(lambda y, part: part(y), self.parts, x)  # type: ignore[return-value]

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        if not isinstance(parts := spec["parts"], (list, tuple)):
            raise _bad_field(cls, spec, "parts", parts)
        for p in parts:
            if isinstance(p, Mapping) and p.get("name") == "chain":
                raise _bad_field(cls, spec, "parts", p)  # chains are flat: depth stays bounded
        return chain(*(_from_spec(p, resolve) for p in parts))

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return functools.reduce(lambda a, part: part.abstract(a), self.parts, aval)

    def state_view(self) -> Transform | None:
        views = [p.state_view() for p in self.parts]
        return None if None in views else chain(*views)  # type: ignore[arg-type]

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        out: Names | None = tuple(names)
        for part in self.parts:
            if out is None:
                return None
            out, aval = part.axis_names(out, aval), part.abstract(aval)
        return out

    def inverse(self) -> Transform | None:
        back = [p.inverse() for p in reversed(self.parts)]
        return None if None in back else chain(*back)  # type: ignore[arg-type]

    def numpy(self, x: np.ndarray) -> np.ndarray:
        return functools.reduce(lambda y, part: part.numpy(y), self.parts, x)

    def traceable(self) -> bool:
        return all(p.traceable() for p in self.parts)

    def __repr__(self) -> str:
        return " >> ".join(map(repr, self.parts))


@dataclasses.dataclass(frozen=True)
class _Described(Transform):
    """Stands for an unregistered transform, or an ``fn``'s function, when describing a file."""

    text: str  # the spec as compact JSON, or the function's "module:qualname"

    def __call__(self, x: ArrayLike) -> jax.Array:
        raise TieError(  # pragma: no cover - describing never computes a view
            f"{self.text} was only described, not restored. Fix: load the file, passing "
            "functions= for its st.fn functions, after importing your own transform classes."
        )

    def __repr__(self) -> str:
        return self.text


def is_described(t: Transform) -> bool:
    """Whether ``t`` (a chain part by part) holds a stand-in that describes without computing."""
    return any(isinstance(getattr(p, "function", p), _Described) for p in parts_of(t))


def describe_transform(spec: object) -> Transform:
    """A transform for ``spec``; an ``fn`` or an unregistered class is a stand-in, never called."""
    return _from_spec(spec, _Described)  # an fn's function becomes a stand-in


identity: Transform = _Identity()
"""The identity transform: the view is the buffer itself (the same object)."""

T: Transform = _Transpose()
"""Reverse all axes, like ``x.T``, for any number of dimensions (equal to ``transpose()``)."""


def _args(values: Sequence[Any]) -> tuple[Any, ...]:
    """``values``, or its one list or tuple, as a tuple."""
    if len(values) == 1 and isinstance(values[0], (tuple, list)):
        return tuple(values[0])
    return tuple(values)


def transpose(*axes: int | Sequence[int]) -> Transform:
    """Permute axes like ``jnp.transpose(x, axes)``; no axes reverses them (``T``).

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

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.astype(jnp.bfloat16), st.astype("float16") == st.astype(jnp.float16)
        (astype(bfloat16), True)
    """
    return _AsType(dtype)


def scale(c: complex | np.number[Any]) -> Transform:
    """Multiply by the constant ``c``, a finite real or complex number.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.scale(0.5)(jnp.ones(2, jnp.float16)).dtype, st.scale(2.0) >> st.scale(3.0)
        (dtype('float16'), scale(6.0))
    """
    return _Scale(c)


def fn(f: ArrayFn) -> Transform:
    """Wrap a hashable user function (array -> array, pure JAX) as a transform.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.fn(jnp.flipud)
        fn(flipud)
    """
    return _Fn(f)


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


def chain(*parts: Transform) -> Transform:
    """Compose transforms left to right (``chain(a, b)`` is ``a >> b``) into a normal form.

    Example:
        >>> import sharetree as st
        >>> st.T >> st.T >> st.scale(2.0) >> st.identity >> st.scale(3.0)
        scale(6.0)
        >>> st.transpose(1, 0, 2) >> st.T
        transpose(2, 0, 1)
    """
    out: list[Transform] = []
    for p in parts:
        for t in parts_of(check_transform(p)):
            while out and t != identity and (folded := out[-1].fold(t)) is not None:
                if not isinstance(folded, Transform) or isinstance(folded, _Chain):
                    raise TieTypeError(
                        f"{type(out[-1]).__qualname__}.fold({t!r}) returned "
                        f"{type(folded).__name__} {_show.repr(folded)}; fold gives one transform "
                        "that is not a chain, or None. Fix: return None where the two do not "
                        "fold into one."
                    )
                out.pop()
                t = check_transform(folded, "returned by fold")
            if t != identity:
                out.append(t)
    if len(out) < 2:
        return out[0] if out else identity
    return _Chain(tuple(out))


def view_axis_names(t: Transform, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
    """``t.axis_names(names, aval)``, checked: a tuple of one name per axis of the view, or None."""
    out = t.axis_names(tuple(names), aval)
    if out is None:
        return None
    view = t.abstract(aval)
    if not isinstance(out, (tuple, list)) or len(out) != len(view.shape):
        raise TieError(
            f"{t!r}.axis_names gave {_show.repr(out)} for a view of shape {tuple(view.shape)} "
            f"of a buffer of shape {tuple(aval.shape)} named {tuple(names)}; it gives one "
            "name per axis of the view, or None. Fix: return a tuple of len(view.shape) names, "
            "or None where the view's axes are not the buffer's."
        )
    return tuple(out)


def parts_of(t: Transform) -> tuple[Transform, ...]:
    """The transforms a chain applies, in order; ``(t,)`` for a transform that is not a chain."""
    return t.parts if isinstance(t, _Chain) else (t,)


_FACTORY_EXAMPLES = {
    "transpose": "st.transpose(1, 0)",
    "reshape": "st.reshape(6)",
    "astype": "st.astype(jnp.bfloat16)",
    "scale": "st.scale(2.0)",
    "fn": "st.fn(jnp.flipud)",
    "slice": "st.slice(0, 10)",
    "index": "st.index(0)",
    "chain": "st.chain(st.T, st.scale(2.0))",
    "transform_from_spec": "st.transform_from_spec(st.T.spec())",
}


def _is_factory(f: Any) -> bool:
    """Whether ``f`` is one of this module's functions that make a transform (``st.slice``)."""
    return (
        callable(f)
        and getattr(f, "__module__", None) == __name__
        and getattr(f, "__annotations__", {}).get("return") in ("Transform", Transform)
    )


def check_transform(t: Any, where: str = "") -> Transform:
    """Return ``t`` if it is a hashable transform, else raise a TieError."""
    where = f" {where}" if where else ""
    if not isinstance(t, Transform):
        names = ", ".join(f"st.{name}" for name in _REGISTRY)
        hint = "wrap the function with st.fn(...)" if callable(t) else f"use one of {names}"
        if isinstance(t, type) and issubclass(t, Transform):
            hint = f"{t.__name__} is a transform class: pass an instance, {t.__name__}(...)"
        elif _is_factory(t):
            example = _FACTORY_EXAMPLES.get(t.__name__, f"st.{t.__name__}(...)")
            hint = f"st.{t.__name__} makes a transform: call it, e.g. {example}"
        raise TieTypeError(
            f"transform{where}: expected a sharetree transform, got {type(t).__name__} {t!r}. "
            f"Fix: {hint}."
        )
    try:
        hash(t)
    except TypeError as e:
        raise TieTypeError(
            f"transform{where}: {t!r} is not hashable ({e}); transforms are static aux data. "
            "Fix: build it from hashable arguments (tuples, numbers, module-level functions)."
        ) from None
    return t


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


def _bad_field(
    cls: type[Transform], spec: Mapping[str, Any], field: str, found: Any, why: str = ""
) -> TieError:
    """The TieError for a spec whose ``field`` holds ``found``; ``why`` is what the class said."""
    return TieError(
        f"transform spec {_show.repr(spec)}: field {field!r} of {cls.spec_name!r} should be "
        f"{_doc(cls, field)}, found {type(found).__name__} {_show.repr(found)}{why}. "
        f"Fix: {_SPEC_FIX}"
    )


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
    if cls is None and isinstance(name, str) and resolve is _Described:
        try:
            text = json.dumps(spec, separators=(",", ":"))
        except (TypeError, ValueError):
            text = repr(spec)
        return _Described(text if len(text) <= 80 else text[:77] + "...")
    if cls is None:
        own = (
            f" if it is a transform of your own, import (or define) the class registered as "
            f"{name!r} (class ...(st.Transform, name={name!r})) before loading; else"
            if isinstance(name, str) and name.isidentifier()
            else ""
        )
        raise TieError(
            f"transform spec: unknown transform name {_show.repr(name)}; known in this "
            f"process: {', '.join(sorted(_REGISTRY))}. Fix:{own} upgrade sharetree if the "
            "file was written by a newer one, or check the file was written by sharetree."
        )
    names = _fields(cls)
    problems = [f"the field {f!r} is missing" for f in names if f not in spec] + [
        f"the field {_show.repr(k)} is not one of its fields"
        for k in spec
        if k != "name" and k not in names
    ]
    if problems:
        fields = ", ".join(f"{f!r} ({_doc(cls, f)})" for f in names) or "none"
        raise TieError(
            f"transform spec {_show.repr(spec)}: {problems[0]}; the fields of {name!r} besides "
            f"'name' are: {fields}. Fix: {_SPEC_FIX}"
        )
    try:
        return cls.from_spec(spec, resolve)
    except TieError:
        raise
    except Exception as e:  # a user transform's own from_spec: named, with the spec and a fix
        raise TieError(
            f"transform spec {_show.repr(spec)}: {cls.__qualname__}.from_spec raised "
            f"{type(e).__name__}: {e}. Fix: make from_spec read what spec() writes (or drop "
            "the override: the default reads each field by its annotation), or save the tree "
            "again."
        ) from e


def transform_from_spec(
    spec: object, *, functions: Mapping[str, ArrayFn] | None = None
) -> Transform:
    """Rebuild a transform from :meth:`Transform.spec` output; a bad spec is a :class:`TieError`.

    Nothing named in ``spec`` is imported or called.

    Args:
        spec: a dict as written by :meth:`Transform.spec` (e.g. read from a file).
        functions: ``{"module:qualname": function}``, the only source of the
            functions of ``fn`` transforms in ``spec``; other names are ignored.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
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
    """The ``repr`` of the transform ``spec`` describes, an ``fn`` by its stored name; runs nothing.

    Example:
        >>> from sharetree._transforms import describe_spec
        >>> describe_spec({"name": "fn", "function": "mylib.ops:softcap"})
        'fn(mylib.ops:softcap)'
    """
    return repr(describe_transform(spec))
