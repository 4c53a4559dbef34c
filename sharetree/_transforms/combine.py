"""Transforms of several values: ``lora``, ``add`` and ``matmul``.

A view of several positions, ``Tied({name: ref, ...}, transform)``, gives its transform
``{name: value}``; each class here declares the names it takes in ``inputs``. Like the
other built-ins, each is a private registered class and the public function that makes it,
documented once (on the function). Shapes are never guessed: inputs that do not multiply
or add to the view's shape are an error (E106) naming each input's shape.
"""

from __future__ import annotations

import cmath
import dataclasses
import functools
import operator
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sharetree._errors import error, wrong_type
from sharetree._transforms.builtins import set_fields
from sharetree._transforms.protocol import ANY_NAMES, Names, Transform, canonical_dtype, is_real

__all__ = ["add", "lora", "matmul"]

Inputs = Mapping[str, Any]
"""``{name: value}``: arrays, tracers or ``jax.ShapeDtypeStruct``."""


def _shapes(t: Transform, x: Inputs) -> dict[str, tuple[int, ...]]:
    """Each input's shape; a :class:`TieError` (E106) for an input that is not an array."""
    out = {}
    for name in sorted(x):
        v = x[name]
        shape = getattr(v, "shape", None)
        if shape is None and isinstance(v, (int, float, complex)) and not isinstance(v, bool):
            shape = ()  # a Python number
        if shape is None:
            found = f"{type(v).__name__} at input {name!r}"
            raise error("E106", repr(t), "takes arrays", found=found, fix="tie arrays only")
        out[name] = tuple(shape)
    return out


def _shown(shapes: Mapping[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{n} {s}" for n, s in shapes.items())


def _matmul_shape(
    t: Transform, a: tuple[int, ...], b: tuple[int, ...], names: tuple[str, str], fix: str
) -> tuple[int, ...]:
    """The shape of ``a @ b`` (``jnp.matmul`` over leading axes), else E106."""
    shown = _shown(dict(zip(names, (a, b))))
    if len(a) < 2 or len(b) < 2:
        raise error("E106", repr(t), "multiplies matrices", found=shown, fix=fix)
    if a[-1] != b[-2]:
        problem = f"the inner sizes disagree: {names[0]} has {a[-1]} columns, {names[1]}"
        problem += f" {b[-2]} rows"
        raise error("E106", repr(t), problem, found=shown, fix=fix)
    try:
        lead = np.broadcast_shapes(a[:-2], b[:-2])
    except ValueError:
        problem = "the leading (stacked) axes do not broadcast"
        raise error("E106", repr(t), problem, found=shown, fix=fix) from None
    return (*lead, a[-2], b[-1])


@dataclasses.dataclass(frozen=True, repr=False)
class _LoRA(Transform, name="lora"):
    """The class of :func:`lora`."""

    scale: float = 1.0
    inputs: ClassVar = ("a", "b", "base")
    field_docs: ClassVar = {"scale": "a finite number"}

    def __post_init__(self) -> None:
        c = self.scale
        if not is_real(c):
            fix = "pass a constant such as alpha / rank"
            raise wrong_type("E73", "lora(scale)", "a finite Python or NumPy number", c, fix)
        if not cmath.isfinite(float(c)):
            raise error("E19", f"lora({c!r})", expected="a finite number", found=repr(c))
        set_fields(self, scale=float(c) + 0.0)

    def _check(self, x: Inputs) -> tuple[int, ...]:
        s = _shapes(self, x)
        fix = "give a the shape (..., rows, rank) and b (..., rank, columns) of the base"
        ab = _matmul_shape(self, s["a"], s["b"], ("a", "b"), fix)
        try:
            out = np.broadcast_shapes(s["base"], ab)
        except ValueError:
            out = None
        if out != s["base"]:
            problem = f"a @ b is {ab}, which does not add to the base {s['base']}"
            raise error("E106", repr(self), problem, found=_shown(s), fix=fix)
        return s["base"]

    def __call__(self, x: Inputs) -> jax.Array:  # type: ignore[override]
        self._check(x)
        base = jnp.asarray(x["base"])
        delta = jnp.matmul(x["a"], x["b"])
        return base + (delta * self.scale).astype(base.dtype)

    def abstract(self, aval: Inputs) -> jax.ShapeDtypeStruct:  # type: ignore[override]
        return jax.ShapeDtypeStruct(self._check(aval), canonical_dtype(aval["base"].dtype))

    def axis_names(self, names: Mapping[str, Names], aval: Inputs) -> Names | None:  # type: ignore[override]
        return tuple(names["base"])

    def __repr__(self) -> str:
        return "lora" if self.scale == 1.0 else f"lora({self.scale})"


@dataclasses.dataclass(frozen=True, repr=False)
class _Add(Transform, name="add"):
    """The class of :func:`add`."""

    inputs: ClassVar = ANY_NAMES

    def _check(self, x: Inputs) -> tuple[int, ...]:
        s = _shapes(self, x)
        if len(set(s.values())) > 1:
            fix = "give every input the view's shape"
            raise error("E106", repr(self), "adds arrays of one shape", found=_shown(s), fix=fix)
        return next(iter(s.values()))

    def __call__(self, x: Inputs) -> jax.Array:  # type: ignore[override]
        self._check(x)
        return functools.reduce(operator.add, (jnp.asarray(x[n]) for n in sorted(x)))

    def abstract(self, aval: Inputs) -> jax.ShapeDtypeStruct:  # type: ignore[override]
        shape = self._check(aval)
        dtype = jnp.result_type(*(aval[n].dtype for n in sorted(aval)))
        return jax.ShapeDtypeStruct(shape, canonical_dtype(dtype))

    def axis_names(self, names: Mapping[str, Names], aval: Inputs) -> Names | None:  # type: ignore[override]
        given = {tuple(v) for v in names.values()}
        return given.pop() if len(given) == 1 else None


@dataclasses.dataclass(frozen=True, repr=False)
class _MatMul(Transform, name="matmul"):
    """The class of :func:`matmul`."""

    inputs: ClassVar = ("a", "b")

    def _check(self, x: Inputs) -> tuple[int, ...]:
        s = _shapes(self, x)
        fix = "give a the shape (..., rows, k) and b (..., k, columns)"
        return _matmul_shape(self, s["a"], s["b"], ("a", "b"), fix)

    def __call__(self, x: Inputs) -> jax.Array:  # type: ignore[override]
        self._check(x)
        return jnp.matmul(x["a"], x["b"])

    def abstract(self, aval: Inputs) -> jax.ShapeDtypeStruct:  # type: ignore[override]
        dtype = jnp.result_type(aval["a"].dtype, aval["b"].dtype)
        return jax.ShapeDtypeStruct(self._check(aval), canonical_dtype(dtype))

    def axis_names(self, names: Mapping[str, Names], aval: Inputs) -> Names | None:  # type: ignore[override]
        a, b = tuple(names["a"]), tuple(names["b"])
        return (a[0], b[1]) if len(a) == len(b) == 2 else None


# --- the public functions: each documents its class ----------------------------------------


def lora(scale: float = 1.0) -> Transform:
    """A low-rank adapter: inputs ``base``, ``a``, ``b`` give ``base + scale * (a @ b)``.

    ``a @ b`` is ``jnp.matmul`` over leading axes, so a stack of adapters ``a`` of shape
    ``(L, rows, rank)`` and ``b`` of ``(L, rank, columns)`` adapts a stack of ``L`` layers.
    The view has the base's shape and dtype. Follow it with transforms of one value:
    ``st.lora() >> st.T``. :func:`sharetree.add_lora` puts adapters on a tree for you.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"w": np.ones((4, 3)), "a": np.ones((4, 2)), "b": np.ones((2, 3)),
        ...         "adapted": st.Tied({"base": "w", "a": "a", "b": "b"}, st.lora(0.5))}
        >>> st.materialize(tree)["adapted"][0]
        Array([2., 2., 2.], dtype=float32)
    """
    return _LoRA(scale)


def add() -> Transform:
    """The sum of inputs of any names and one shape (a delta parametrization).

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"w": np.ones(3), "delta": np.arange(3.0),
        ...         "tuned": st.Tied({"base": "w", "delta": "delta"}, st.add())}
        >>> st.materialize(tree)["tuned"]
        Array([1., 2., 3.], dtype=float32)
    """
    return _Add()


def matmul() -> Transform:
    """Inputs ``a`` and ``b`` give ``a @ b`` (``jnp.matmul``): a factorized embedding.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"e": np.ones((10, 2)), "p": np.ones((2, 4)),
        ...         "head": st.Tied({"a": "e", "b": "p"}, st.matmul() >> st.T)}
        >>> st.materialize(tree)["head"].shape
        (4, 10)
    """
    return _MatMul()
