"""The transform protocol: the base class, the registry of spec names, the chain normal form.

A transform is a frozen dataclass registered under its spec name; ``a >> b`` applies
``a``, then ``b``. Equal transforms hash alike, so as static aux data equal structures
never retrace under ``jit``. docs/ties_and_transforms.md ("Your own transforms") lists
the methods a subclass may override.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import jax
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from sharetree._errors import error, found_type, short, wrong_type

__all__ = [
    "ANY_NAMES",
    "REGISTRY",
    "SPEC_FIX",
    "ArrayFn",
    "Names",
    "Resolve",
    "Transform",
    "bad_field",
    "canonical_dtype",
    "chain",
    "check_inputs",
    "check_transform",
    "field_doc",
    "fields_of",
    "identity",
    "input_names",
    "is_factory",
    "is_int",
    "is_real",
    "parts_of",
    "view_axis_names",
]

PACKAGE = __name__.rpartition(".")[0]
"""``sharetree._transforms``: its modules define the built-in transforms."""

ArrayFn = Callable[[jax.Array], jax.Array]
"""A user function from array to array (what ``st.fn`` wraps)."""

Names = tuple[Any, ...]
"""One name per axis (a Flax partition name, a ``PartitionSpec`` entry, or ``None``)."""

REGISTRY: dict[str, type[Transform]] = {}
"""Spec name -> the transform class that reads it (filled by ``Transform.__init_subclass__``)."""

SPEC_FIX = "build specs with Transform.spec() (a file sharetree wrote with this spec is damaged)"
"""The fix of a malformed spec."""

_COMPLEX = re.compile(r"\bcomplex\b")


class Resolve(Protocol):
    """What :meth:`Transform.from_spec` is given to read a spec's values; nothing is imported."""

    def __call__(self, name: str) -> ArrayFn:
        """The function an ``fn`` spec names as ``"module:qualname"`` (only from those given)."""

    def value(self, v: Any, pairs: bool = False) -> Any:
        """A field's JSON value: lists as tuples, specs as transforms, pairs as complex."""

    def transform(self, spec: Any) -> Transform:
        """The transform of a spec (its name looked up in the registry, its fields checked)."""


def canonical_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """The dtype JAX computes with: float64 is float32 while x64 is off (PRNG keys: unchanged)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype  # type: ignore[return-value]
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _ours(cls: type) -> bool:
    """Whether ``cls`` is defined in this package (a built-in, the chain, a stand-in)."""
    return cls.__module__.startswith(PACKAGE + ".") and cls is not Transform


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
    inputs: ClassVar[tuple[str, ...] | None] = None
    """The input names of a transform of several values (``("base", "a", "b")``, or
    :data:`ANY_NAMES`); ``None`` (the default): a transform of one value. A transform of
    several values is given ``{name: value}`` (to ``__call__``, ``abstract``, ``numpy``,
    ``axis_names``) and comes first in a chain."""
    field_docs: ClassVar[Mapping[str, str]] = {}
    """What each field's spec value should be (error messages quote it; default: its type)."""

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        built_in = next((b for b in cls.__mro__[1:] if _ours(b)), None)
        if built_in is not None and not _ours(cls):  # its fold, inverse, ... assume its __call__
            where, fix = f"transform class {cls.__qualname__}", "subclass st.Transform"
            raise wrong_type("E100", where, "no built-in as base", built_in.__qualname__, fix)
        if name is None:
            return  # an abstract intermediate class: not readable from a spec
        where = f"{cls.__qualname__}(name=...)"
        if not isinstance(name, str) or not name:
            example = f"class {cls.__name__}(st.Transform, name='mylib_{cls.__name__.lower()}')"
            raise wrong_type("E100", where, "a non-empty str", name, example)
        old = REGISTRY.get(name, cls)
        if (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            fix = f"choose another name (prefixed with your package's): {old.__qualname__} has it"
            raise wrong_type("E100", where, "a free name", name, fix)
        cls.spec_name = name
        REGISTRY[name] = cls

    def __call__(self, x: ArrayLike) -> jax.Array:  # pragma: no cover - abstract
        """Compute the view of the buffer ``x`` (``{name: value}`` for several inputs)."""
        raise NotImplementedError

    def __rshift__(self, other: Transform) -> Transform:
        return chain(self, other)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the view of a buffer with shape and dtype ``aval``."""
        return jax.eval_shape(self, aval)

    def spec(self) -> dict[str, Any]:
        """A JSON-able dict of ``"name"`` and each field, read back by ``st.transform_from_spec``.

        Tuples are written as lists, complex numbers as ``[real, imag]``, transforms as specs.

        Example:
            >>> import sharetree as st
            >>> st.slice(0, 5, axis=1).spec()
            {'name': 'slice', 'start': 0, 'stop': 5, 'axis': 1}
        """
        return {
            "name": self.spec_name,
            **{f: _json(getattr(self, f)) for f in fields_of(type(self))},
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        """Rebuild the transform from its spec, whose fields are all present (checked before).

        By default the class is called with each field's JSON value read back by
        ``resolve.value``: lists as tuples, specs as transforms, and ``[real, imag]`` pairs as
        complex numbers in a field whose annotation names ``complex``. The class's
        ``__post_init__`` checks and normalises the values, as it does for a call.
        """
        kinds = {f.name: str(f.type) for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        return cls(
            **{f: resolve.value(spec[f], bool(_COMPLEX.search(k))) for f, k in kinds.items()}
        )

    def fold(self, after: Transform) -> Transform | None:
        """One transform equal to ``self >> after``, or ``None`` when they do not fold."""
        return None

    def state_view(self) -> Transform | None:
        """The transform of a per-element optimizer state (Adam's moments), or ``None``: unknown."""
        return None

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        """The names of the view's axes from the buffer's, or ``None`` if they are not its axes."""
        return None

    def gathers(self, aval: jax.ShapeDtypeStruct) -> tuple[int, tuple[int, ...]] | None:
        """A ``Gather(axis, sources)`` (``take``): ``st.grad_by_use`` gives a use per entry."""

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
        if not _ours(type(self)):  # a user's class that is no dataclass
            return object.__repr__(self)
        args: list[Any] = []
        for f in fields_of(type(self)):
            v = getattr(self, f)
            if f != "axis":
                args += v if isinstance(v, tuple) else [v]
            elif v:  # axis 0 is the default: not shown
                args.append(f"axis={v}")
        return f"{self.spec_name}({', '.join(map(str, args))})" if args else self.spec_name


def fields_of(cls: type[Transform]) -> tuple[str, ...]:
    """The spec fields of a transform class: its dataclass fields set by ``__init__``."""
    if not dataclasses.is_dataclass(cls):
        fix = "decorate it with @dataclasses.dataclass(frozen=True)"
        raise wrong_type("E100", f"transform class {cls.__qualname__}", "a dataclass", cls, fix)
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def field_doc(cls: type[Transform], field: str) -> str:
    """What the spec value of ``field`` should be: its ``field_docs`` entry, else its type."""
    if field in cls.field_docs:
        return cls.field_docs[field]
    kind = next(f.type for f in dataclasses.fields(cls) if f.name == field)  # type: ignore[arg-type]
    return f"a value of type {kind if isinstance(kind, str) else getattr(kind, '__name__', kind)}"


def bad_field(cls: type[Transform], spec: Mapping[str, Any], field: str, found: Any) -> Exception:
    """The error of a spec whose ``field`` holds ``found``, which ``cls`` cannot read."""
    where = f"transform spec {short(spec, 100)}: field {field!r} of {cls.spec_name!r}"
    found = found_type(found, 60)
    return error("E20", where, expected=field_doc(cls, field), found=found, fix=SPEC_FIX)


def _json(v: Any) -> Any:
    """A field as JSON: tuples as lists, complex as [real, imag], transforms as specs."""
    if isinstance(v, tuple):
        return [_json(x) for x in v]
    if isinstance(v, complex):
        return [v.real, v.imag]
    return v.spec() if isinstance(v, Transform) else v


def is_int(v: Any) -> bool:
    """Whether ``v`` is a Python or NumPy integer (not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """Whether ``v`` is a Python or NumPy integer (not a bool) or float."""
    return is_int(v) or isinstance(v, (float, np.floating))


# --- chains ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chain(Transform, name="chain"):
    """``a >> b >> ...``: built only by :func:`chain`, so always in normal form."""

    parts: tuple[Transform, ...]  # normal form: >= 2 parts, no identity, no chain, no folds
    field_docs: ClassVar = {"parts": "a list of transform specs that are not chains"}

    def __call__(self, x: ArrayLike) -> jax.Array:
        return functools.reduce(lambda y, part: part(y), self.parts, x)  # type: ignore[return-value]

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        parts = spec["parts"]
        nested = isinstance(parts, (list, tuple)) and any(
            isinstance(p, Mapping) and p.get("name") == "chain" for p in parts
        )
        if nested or not isinstance(parts, (list, tuple)):  # chains are flat: depth stays bounded
            raise bad_field(cls, spec, "parts", parts)
        return chain(*map(resolve.transform, parts))

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return functools.reduce(lambda a, part: part.abstract(a), self.parts, aval)

    def state_view(self) -> Transform | None:
        views = [p.state_view() for p in self.parts]
        return None if None in views else chain(*views)  # type: ignore[arg-type]

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        out: Names | None = names if isinstance(names, Mapping) else tuple(names)
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


@dataclasses.dataclass(frozen=True, repr=False)
class _Identity(Transform, name="identity"):
    """The class of :data:`identity`, the unit of :func:`chain`."""

    def __call__(self, x: ArrayLike) -> ArrayLike:  # type: ignore[override]
        return x

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], resolve: Resolve) -> Transform:
        return identity

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return aval

    def state_view(self) -> Transform:
        return self

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names:
        return tuple(names)

    def inverse(self) -> Transform:
        return self

    def numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def __reduce__(self) -> str:
        return "identity"  # unpickles to the module's singleton


identity: Transform = _Identity()
"""The identity transform: the view is the buffer itself (the same object); chains drop it."""


ANY_NAMES = ("*",)
"""``Transform.inputs`` of a transform that takes inputs of any names (``st.add``)."""


def input_names(t: Transform) -> tuple[str, ...] | None:
    """The input names ``t`` takes (a chain: its first part's); ``None`` for one value."""
    return t.parts[0].inputs if isinstance(t, _Chain) else t.inputs


def check_inputs(t: Transform, names: tuple[str | None, ...], tied: str) -> None:
    """A :class:`TieError` (E103) unless ``t`` takes inputs of exactly ``names``.

    ``names`` is ``(None,)`` for one ref, else the sorted names of several refs; ``tied``
    shows the refs (``"'w'"``, ``"{'a', 'b'}"``) for the message, built only on an error.
    """
    takes = input_names(t)
    where = f"Tied({tied}, {short(t, 100)})"
    named = isinstance(takes, tuple) and all(isinstance(n, str) for n in takes)
    if takes is not None and not named:
        fix = "declare inputs = ('base', 'a', 'b') on the class, or ANY_NAMES"
        raise wrong_type("E103", f"{type(t).__qualname__}.inputs", "a tuple of str", takes, fix)
    if names == (None,):
        if takes is not None:
            shown = "any names" if takes == ANY_NAMES else ", ".join(map(repr, takes))
            names_ = ("x", "y") if takes == ANY_NAMES else takes
            refs = ", ".join(f"{n!r}: ..." for n in names_)
            fix = f"name each input: Tied({{{refs}}}, {short(t, 100)})"
            problem = f"{short(t, 100)} takes several inputs ({shown})"
            raise error("E103", where, problem, found="one ref", fix=fix)
        return
    if takes is None:
        fix = "use a transform of several inputs (st.add(), st.lora(), st.matmul()) or one ref"
        found = f"{len(names)} named refs"
        raise error("E103", where, f"{short(t, 100)} takes one value", found=found, fix=fix)
    if takes == ANY_NAMES:
        return
    missing = sorted(set(takes) - set(names))
    extra = sorted(set(names) - set(takes))  # type: ignore[type-var]
    if missing or extra:
        said = [f"missing {', '.join(map(repr, missing))}"] * bool(missing)
        found = "; ".join(said + [f"not taken: {', '.join(map(repr, extra))}"] * bool(extra))
        expected = f"the inputs {', '.join(map(repr, takes))}"
        fix = "name the refs as the transform takes them"
        raise error("E103", where, expected=expected, found=found, fix=fix)


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
            if out and t.inputs is not None:
                where = f"{' >> '.join(map(repr, [*out, t]))}"
                fix = f"apply {t!r} first: {t!r} >> ..., then transforms of its one value"
                problem = f"{t!r} takes several inputs but is not first"
                raise error("E104", where, problem, fix=fix)
            while out and t != identity and (folded := out[-1].fold(t)) is not None:
                if not isinstance(folded, Transform) or isinstance(folded, _Chain):
                    where = f"{type(out[-1]).__qualname__}.fold({t!r})"
                    expected, fix = "one transform, no chain", "return None where two do not fold"
                    raise wrong_type("E101", where, expected, folded, fix)
                out.pop()
                t = folded
            if t != identity:
                out.append(t)
    if len(out) < 2:
        return out[0] if out else identity
    return _Chain(tuple(out))


def parts_of(t: Transform) -> tuple[Transform, ...]:
    """The transforms a chain applies, in order; ``(t,)`` for a transform that is not a chain."""
    return t.parts if isinstance(t, _Chain) else (t,)


def view_axis_names(t: Transform, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
    """``t.axis_names(names, aval)``, checked: a tuple of one name per axis of the view, or None."""
    names = names if isinstance(names, Mapping) else tuple(names)
    out = t.axis_names(names, aval)
    if out is None:
        return None
    view = t.abstract(aval)
    if not isinstance(out, (tuple, list)) or len(out) != len(view.shape):
        shape = jax.tree.map(lambda a: tuple(a.shape), aval)
        where = f"{t!r}.axis_names({names}) of a buffer of shape {shape}"
        expected = f"{len(view.shape)} names, one per axis of the view {tuple(view.shape)}, or None"
        fix = "return None where the view's axes are not the buffer's"
        raise error("E101", where, expected=expected, found=short(out, 80), fix=fix)
    return tuple(out)


# --- checking a transform ----------------------------------------------------------------

_FACTORY_EXAMPLES = {
    "transpose": "st.transpose(1, 0)",
    "reshape": "st.reshape(6)",
    "astype": "st.astype(jnp.bfloat16)",
    "scale": "st.scale(2.0)",
    "fn": "st.fn(jnp.flipud)",
    "slice": "st.slice(0, 10)",
    "index": "st.index(0)",
    "take": "st.take((0, 1, 0, 1))",
    "lora": "st.lora(2.0)",
    "add": "st.add()",
    "matmul": "st.matmul()",
    "dequantize": "st.dequantize(4, 64)",
    "fake_quant": "st.fake_quant(4, 64)",
    "chain": "st.chain(st.T, st.scale(2.0))",
    "transform_from_spec": "st.transform_from_spec(st.T.spec())",
}


def is_factory(f: Any) -> bool:
    """Whether ``f`` is one of this package's functions that make a transform (``st.slice``)."""
    return (
        callable(f)
        and not isinstance(f, type)
        and getattr(f, "__module__", "").startswith(PACKAGE + ".")
        and getattr(f, "__annotations__", {}).get("return") in ("Transform", Transform)
    )


def check_transform(t: Any, where: str = "") -> Transform:
    """Return ``t`` if it is a hashable transform, else the :class:`TieTypeError` (E13)."""
    where = f"transform {where}".rstrip()
    if not isinstance(t, Transform):
        fix = f"use one of {', '.join(f'st.{n}' for n in REGISTRY)}"
        fix = "wrap the function with st.fn(...)" if callable(t) else fix
        if isinstance(t, type) and issubclass(t, Transform):
            fix = f"{t.__name__} is a transform class: pass an instance, {t.__name__}(...)"
        elif is_factory(t):
            example = _FACTORY_EXAMPLES.get(t.__name__, f"st.{t.__name__}(...)")
            fix = f"st.{t.__name__} makes a transform: call it, e.g. {example}"
        raise wrong_type("E13", where, "a sharetree transform", t, fix)
    try:
        hash(t)
    except TypeError as e:
        fix = "build it from hashable arguments (tuples, numbers, module-level functions)"
        raise wrong_type("E13", where, "a hashable transform", t, fix) from e
    return t
