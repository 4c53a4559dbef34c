"""Transforms: hashable, value-equal, picklable functions from a buffer to a view.

A transform is what a :class:`~sharetree.Tied` applies to the value it refers
to. Transforms are small frozen dataclasses, so two transforms built the same
way are equal and hash alike (``st.T == st.transpose()``), which keeps them
usable as static pytree aux data: equal structures never retrace under ``jit``.
``a >> b`` composes: apply ``a`` first, then ``b``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
]


def canonical_dtype(dtype: Any) -> np.dtype:
    """The dtype JAX computes with: float64 is float32 while x64 is off."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


class Transform:
    """Base class of every transform.

    Subclasses are frozen dataclasses that implement ``__call__`` (array in,
    array out, pure JAX) and ``spec`` (a small JSON-able dict).

    Example:
        >>> import numpy as np
        >>> import sharetree as st
        >>> t = st.T >> st.scale(2.0)
        >>> t
        T >> scale(2.0)
        >>> t(np.arange(6.0).reshape(2, 3)).shape
        (3, 2)
    """

    def __call__(self, x: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:  # pragma: no cover - abstract
        """Return a JSON-able description, the inverse of :func:`transform_from_spec`."""
        raise NotImplementedError

    def __rshift__(self, other: Transform) -> Transform:
        return chain(self, other)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the view of a buffer with shape and dtype ``aval``."""
        return jax.eval_shape(self, aval)


@dataclasses.dataclass(frozen=True)
class _Identity(Transform):
    def __call__(self, x: Any) -> Any:
        return x

    def spec(self) -> dict[str, Any]:
        return {"name": "identity"}

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return aval

    def __repr__(self) -> str:
        return "identity"

    def __reduce__(self) -> str:
        return "identity"  # unpickles to the module's singleton


@dataclasses.dataclass(frozen=True)
class _Transpose(Transform):
    axes: tuple[int, ...] | None = None

    def __call__(self, x: Any) -> Any:
        return jnp.transpose(x, self.axes)

    def spec(self) -> dict[str, Any]:
        return {"name": "transpose", "axes": None if self.axes is None else list(self.axes)}

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        axes = self.axes if self.axes is not None else tuple(reversed(range(len(aval.shape))))
        if sorted(axes) != list(range(len(aval.shape))):
            return jax.eval_shape(self, aval)  # raises the real error
        dtype = canonical_dtype(aval.dtype)  # as jnp.transpose returns it
        return jax.ShapeDtypeStruct(tuple(aval.shape[a] for a in axes), dtype)

    def __repr__(self) -> str:
        if self.axes is None:
            return "T"
        return f"transpose({', '.join(map(str, self.axes))})"


@dataclasses.dataclass(frozen=True)
class _Reshape(Transform):
    shape: tuple[int, ...]

    def __call__(self, x: Any) -> Any:
        return jnp.reshape(jnp.asarray(x), self.shape)

    def spec(self) -> dict[str, Any]:
        return {"name": "reshape", "shape": list(self.shape)}

    def __repr__(self) -> str:
        return f"reshape({', '.join(map(str, self.shape))})"


@dataclasses.dataclass(frozen=True)
class _AsType(Transform):
    dtype: str

    def __call__(self, x: Any) -> Any:
        return jnp.asarray(x).astype(self.dtype)

    def spec(self) -> dict[str, Any]:
        return {"name": "astype", "dtype": self.dtype}

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(aval.shape, canonical_dtype(self.dtype))

    def __repr__(self) -> str:
        return f"astype({self.dtype})"


@dataclasses.dataclass(frozen=True)
class _Scale(Transform):
    c: float | complex

    def __call__(self, x: Any) -> Any:
        return jnp.asarray(x) * self.c

    def spec(self) -> dict[str, Any]:
        if isinstance(self.c, complex):
            return {"name": "scale", "c": [self.c.real, self.c.imag]}
        return {"name": "scale", "c": self.c}

    def __repr__(self) -> str:
        return f"scale({self.c!r})"


@dataclasses.dataclass(frozen=True)
class _Fn(Transform):
    f: Callable[[Any], Any]

    def __call__(self, x: Any) -> Any:
        return self.f(x)

    def spec(self) -> dict[str, Any]:
        module = getattr(self.f, "__module__", None)
        qualname = getattr(self.f, "__qualname__", None)
        if not module or not qualname or "<" in qualname or _import(module, qualname) is not self.f:
            raise TieError(
                f"fn({self.f!r}) cannot be written to a file: only functions importable by "
                "module and name can. Fix: define the function at module level, or "
                "express the view with built-in transforms (transpose, reshape, astype, scale)."
            )
        return {"name": "fn", "function": f"{module}:{qualname}"}

    def __repr__(self) -> str:
        return f"fn({getattr(self.f, '__qualname__', repr(self.f))})"


@dataclasses.dataclass(frozen=True)
class _Chain(Transform):
    parts: tuple[Transform, ...]

    def __call__(self, x: Any) -> Any:
        for part in self.parts:
            x = part(x)
        return x

    def spec(self) -> dict[str, Any]:
        return {"name": "chain", "parts": [p.spec() for p in self.parts]}

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        for part in self.parts:
            aval = part.abstract(aval)
        return aval

    def __repr__(self) -> str:
        return " >> ".join(map(repr, self.parts))


identity: Transform = _Identity()
"""The identity transform: the view is the buffer itself (the same object)."""

T: Transform = _Transpose()
"""Reverse all axes, like ``x.T`` (equal to ``transpose()``)."""


def transpose(*axes: int) -> Transform:
    """Permute axes like ``jnp.transpose(x, axes)``; no axes reverses them (``T``).

    Example:
        >>> import sharetree as st
        >>> st.transpose() == st.T, st.transpose(0, 2, 1)
        (True, transpose(0, 2, 1))
    """
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    return _Transpose(_ints("transpose", axes) if axes else None)


def _ints(name: str, values: tuple[Any, ...]) -> tuple[int, ...]:
    bad = [v for v in values if not isinstance(v, (int, np.integer)) or isinstance(v, bool)]
    if bad:
        raise TieError(
            f"{name}({', '.join(map(repr, values))}): expected integers, "
            f"found {type(bad[0]).__name__} {bad[0]!r}. "
            f"Fix: pass integer axes or sizes, e.g. {name}(1, 0)."
        )
    return tuple(int(v) for v in values)


def reshape(*shape: int) -> Transform:
    """Reshape like ``jnp.reshape(x, shape)`` (one ``-1`` allowed).

    Example:
        >>> import numpy as np, sharetree as st
        >>> st.reshape(4, 6)(np.zeros(24)).shape
        (4, 6)
    """
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return _Reshape(_ints("reshape", shape))


def astype(dtype: Any) -> Transform:
    """Cast to ``dtype`` (e.g. a ``bfloat16`` compute view of a ``float32`` master buffer).

    Gradients flow back to the buffer in the buffer's own dtype.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> st.astype(jnp.bfloat16)
        astype(bfloat16)
    """
    try:
        return _AsType(jnp.dtype(dtype).name)
    except TypeError as e:
        raise TieError(
            f"astype({dtype!r}): not a dtype ({e}). Fix: pass a NumPy/JAX dtype such as "
            "jnp.bfloat16, np.float32 or 'float16'."
        ) from None


def scale(c: float | complex) -> Transform:
    """Multiply by the constant ``c`` (keeps the buffer's dtype).

    Example:
        >>> import sharetree as st
        >>> float(st.scale(0.5)(4.0))
        2.0
    """
    if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, complex, np.number)):
        raise TieError(
            f"scale(c) takes a Python or NumPy number; got {type(c).__name__} {c!r}. "
            "Fix: pass a constant such as 0.5; for a learned scale use a separate buffer."
        )
    c = complex(c) if np.iscomplexobj(c) else float(c)
    return _Scale(c)


def fn(f: Callable[[Any], Any]) -> Transform:
    """Wrap a user function (array -> array, pure JAX) as a transform.

    The function must be hashable; two ``fn`` transforms are equal when their
    functions are. Use module-level functions (not lambdas) so that the
    transform is picklable and can be saved in a checkpoint.

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
    """Compose transforms left to right (``chain(a, b)`` is ``a >> b``).

    Identities are dropped and nested chains flattened, so equal compositions
    compare equal.

    Example:
        >>> import sharetree as st
        >>> st.chain(st.identity, st.T, st.identity) == st.T
        True
    """
    flat: list[Transform] = []
    for p in parts:
        check_transform(p)
        if isinstance(p, _Chain):
            flat.extend(p.parts)
        elif p != identity:
            flat.append(p)
    if not flat:
        return identity
    if len(flat) == 1:
        return flat[0]
    return _Chain(tuple(flat))


def check_transform(t: Any, where: str = "") -> Transform:
    """Return ``t`` if it is a hashable transform, else raise a TieError."""
    where = f" {where}" if where else ""
    if not isinstance(t, Transform):
        hint = (
            "wrap the function with st.fn(...)"
            if callable(t)
            else "use st.identity, st.T, st.transpose, st.reshape, st.astype, st.scale or st.fn"
        )
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
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        return None


def transform_from_spec(spec: Any) -> Transform:
    """Rebuild a transform from :meth:`Transform.spec` output.

    Example:
        >>> import sharetree as st
        >>> t = st.T >> st.reshape(6)
        >>> st.transform_from_spec(t.spec()) == t
        True
    """
    if not isinstance(spec, dict) or "name" not in spec:
        raise TieError(
            f"transform spec: expected a dict with a 'name', got {spec!r}. "
            "Fix: build specs with Transform.spec(), e.g. st.T.spec()."
        )
    name = spec["name"]
    try:
        if name == "identity":
            return identity
        if name == "transpose":
            axes = spec.get("axes")
            return T if axes is None else transpose(*axes)
        if name == "reshape":
            return reshape(*spec["shape"])
        if name == "astype":
            return astype(spec["dtype"])
        if name == "scale":
            c = spec["c"]
            return scale(complex(*c) if isinstance(c, list) else c)
        if name == "chain":
            return chain(*(transform_from_spec(p) for p in spec["parts"]))
        if name == "fn":
            module, _, qualname = spec["function"].partition(":")
            f = _import(module, qualname)
            if f is None:
                raise TieError(
                    f"transform spec {spec!r}: cannot import {spec['function']!r}. "
                    "Fix: import the module that defines it, or make it importable."
                )
            return fn(f)
    except (KeyError, TypeError, ValueError) as e:
        raise TieError(
            f"transform spec {spec!r} is malformed ({e!r}). Fix: build specs with "
            "Transform.spec(), e.g. st.reshape(2, 3).spec()."
        ) from None
    known = "identity, transpose, reshape, astype, scale, fn, chain"
    raise TieError(
        f"transform spec: unknown transform name {name!r}; known: {known}. "
        "Fix: upgrade sharetree, or check the file was written by sharetree."
    )
