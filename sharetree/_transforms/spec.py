"""Reading transform specs, which may come from an untrusted file, and describing them.

A spec's name is looked up among the registered classes and an ``fn``'s function among the
functions given: nothing named in a spec is imported or called, and nesting is bounded.
Describing (``python -m sharetree inspect``) reads a spec without those: an ``fn``'s function
and an unregistered class become stand-ins that show the spec and are never called.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
from jax.typing import ArrayLike

from sharetree._errors import (
    FIXES,
    TieError,
    add_context,
    check_mapping,
    error,
    found_type,
    one_line,
    short,
)
from sharetree._transforms.builtins import fn
from sharetree._transforms.protocol import (
    ANY_NAMES,
    REGISTRY,
    SPEC_FIX,
    ArrayFn,
    Transform,
    chain,
    field_doc,
    fields_of,
    is_real,
    parts_of,
)

__all__ = [
    "MAX_NESTING",
    "describe_several",
    "describe_spec",
    "describe_transform",
    "is_described",
    "transform_from_spec",
]

MAX_NESTING = 8
"""How deep a spec may nest transforms in transform fields (and lists in lists)."""


_OWN = frozenset({"E17", "E20", "E21", "E74"})
"""The codes of the errors the reader raises: they name their spec themselves."""


def _fields_text(cls: type[Transform]) -> str:
    """What each field of ``cls`` should hold in a spec, for a message."""
    docs = [f"{f!r} ({field_doc(cls, f)})" for f in fields_of(cls)]
    return f"the fields of {cls.spec_name!r}: {', '.join(docs) or 'none besides name'}"


class _Reader:
    """Reads one spec for :meth:`Transform.from_spec` (the ``resolve`` it is given)."""

    def __init__(self, functions: Mapping[str, ArrayFn] | None, describe: bool = False) -> None:
        self.functions, self.describe, self.depth = functions, describe, 0
        self.noted: list[BaseException] = []  # errors that already name their spec

    def __call__(self, name: str) -> ArrayFn:
        """The function an ``fn`` spec names: one of ``functions``, never imported."""
        if self.describe:
            return _Described(name)
        if self.functions is None or name not in self.functions:
            given = ", ".join(map(repr, list(self.functions or ())[:5])) or "none"
            last = name.rpartition(":")[2].rpartition(".")[2]
            fix = f"pass it, e.g. st.load(path, functions={{{name!r}: {last}}})"
            problem = f"names a function not passed in; the functions given are {given}"
            raise error("E21", f"transform spec fn({name})", problem, fix=fix)
        try:
            fn(f := self.functions[name])  # callable and hashable
        except TieError as e:
            self.noted.append(add_context(e, f"functions[{name!r}], for the spec fn({name})"))
            raise
        return f

    def value(self, v: Any, pairs: bool = False, depth: int = 0) -> Any:
        """A field's JSON value: lists as tuples, specs as transforms, pairs as complex."""
        if isinstance(v, Mapping):
            if self.depth >= MAX_NESTING:
                problem = f"nests transforms in fields more than {MAX_NESTING} deep"
                raise error("E17", f"transform spec {short(v, 100)}", problem, fix=SPEC_FIX)
            self.depth += 1
            try:
                return self.transform(v)
            finally:
                self.depth -= 1
        if not isinstance(v, (list, tuple)):
            return v
        if pairs and len(v) == 2 and all(map(is_real, v)):
            return complex(*v)
        if depth >= MAX_NESTING:
            problem = f"nests lists more than {MAX_NESTING} deep"
            raise error("E17", f"transform field {short(v, 100)}", problem, fix=SPEC_FIX)
        return tuple(self.value(x, pairs, depth + 1) for x in v)

    def transform(self, spec: Any) -> Transform:
        """The transform of ``spec``, its class looked up by name and its fields checked."""
        if not isinstance(spec, Mapping) or "name" not in spec:
            found = found_type(spec, 100)
            expected = "a dict with a 'name' field"
            raise error("E17", "transform spec", expected=expected, found=found, fix=SPEC_FIX)
        name = spec["name"]
        cls = REGISTRY.get(name) if isinstance(name, str) else None
        if cls is None and self.describe and isinstance(name, str):
            return _Described.of(spec)
        if cls is None:
            own = f"import (or define) the class registered as {name!r}, or "
            own = own if isinstance(name, str) and name.isidentifier() else ""
            problem = f"has the unknown transform name {short(name, 60)}"
            known = f"a name known in this process: {', '.join(sorted(REGISTRY))}"
            fix = f"{own}upgrade sharetree if a newer one wrote the file"
            raise error("E17", "transform spec", problem, expected=known, fix=fix)
        names = fields_of(cls)
        missing = [f for f in names if f not in spec]
        extra = [k for k in spec if k != "name" and k not in names]
        if missing or extra:
            problem = f"misses the field {missing[0]!r}" if missing else ""
            problem = problem or f"has the field {short(extra[0], 40)}, not one of its fields"
            where = f"transform spec {short(spec, 100)}"
            raise error("E20", where, problem, expected=_fields_text(cls), fix=SPEC_FIX)
        try:
            return cls.from_spec(spec, self)
        except TieError as e:  # the class's own checks: the spec and its fields named in a note
            if e.code not in _OWN and not any(e is n for n in self.noted):
                context = f"reading transform spec {short(spec, 100)}; {_fields_text(cls)}"
                self.noted.append(add_context(e, context))
            raise
        except Exception as e:  # a class of your own whose __post_init__ or from_spec raised
            where, problem = f"transform spec {short(spec, 100)}", f"raised {one_line(e)}"[:300]
            fix = "make the class read what its spec() writes, or save the tree again"
            raise error("E74", where, problem, expected=_fields_text(cls), fix=fix) from e


@dataclasses.dataclass(frozen=True)
class _Described(Transform):
    """Stands for an unregistered transform, or an ``fn``'s function, when describing a file."""

    text: str  # the spec as compact JSON, or the function's "module:qualname"

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> _Described:
        """The stand-in of an unregistered transform's spec: the spec as compact JSON."""
        try:
            text = json.dumps(spec, separators=(",", ":"))
        except (TypeError, ValueError):
            text = repr(spec)
        return cls(text if len(text) <= 80 else text[:77] + "...")

    def __call__(self, x: ArrayLike) -> jax.Array:  # pragma: no cover - describing never computes
        fix = "load the file with functions= for its st.fn, after importing your transform classes"
        raise error("E21", self.text, "was only described, not read", fix=fix)

    def __repr__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True, repr=False)
class _DescribedSeveral(_Described):
    """Stands for an unregistered transform of several inputs (a file's view of several refs)."""

    inputs: ClassVar = ANY_NAMES  # the file's names: what the class takes is not known here


def describe_several(t: Transform) -> Transform:
    """``t`` taking inputs of any names where it starts with a stand-in; others as they are.

    A file's view of several positions whose transform is not registered in this process
    is described by a stand-in that cannot know the names its class takes: it takes the
    names the file gives (only describing, never computing, reads it).

    Example:
        >>> import sharetree as st
        >>> from sharetree._transforms import describe_several, describe_transform
        >>> t = describe_several(describe_transform({"name": "mylib_mix", "w": 2}))
        >>> t, st.Tied({"x": "a", "y": "b"}, t).inputs
        ({"name":"mylib_mix","w":2}, ('x', 'y'))
    """
    first, *rest = parts_of(t)
    if type(first) is not _Described:
        return t
    return chain(_DescribedSeveral(first.text), *rest)


def is_described(t: Transform) -> bool:
    """Whether ``t`` (a chain part by part) holds a stand-in that describes without computing."""
    return any(isinstance(getattr(p, "function", p), _Described) for p in parts_of(t))


def describe_transform(spec: object) -> Transform:
    """A transform for ``spec``; an ``fn`` or an unregistered class is a stand-in, never called."""
    return _Reader(None, describe=True).transform(spec)


def describe_spec(spec: object) -> str:
    """The ``repr`` of the transform ``spec`` describes, an ``fn`` by its stored name; runs nothing.

    Example:
        >>> from sharetree._transforms import describe_spec
        >>> describe_spec({"name": "fn", "function": "mylib.ops:softcap"})
        'fn(mylib.ops:softcap)'
    """
    return repr(describe_transform(spec))


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
    if functions is not None:
        expected = "a mapping {'module:qualname': function}"
        check_mapping(
            functions, "E55", "transform_from_spec(functions=...)", expected, FIXES["functions"]
        )
    return _Reader(functions).transform(spec)
