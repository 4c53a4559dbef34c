"""The names and numbers of the sharetree file format (``docs/saving_and_scaling.md``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from sharetree._errors import FIXES
from sharetree._files.container import is_numeric

__all__ = [
    "VALUES",
    "LIBRARY_VERSION",
    "FORMAT_VERSION",
    "PREFIX",
    "KEY_VERSION",
    "KEY_TREE",
    "KEY_LIBRARY",
    "MAX_DEPTH",
    "KEY_IMPLS",
    "RESAVE",
    "Field",
    "BAD",
    "REF_FIELDS",
    "FIELDS",
]


LIBRARY_VERSION = "0.1.0.dev0"  # sharetree.__version__, written into every file

FORMAT_VERSION = 4
"""The newest file format version: ``load`` reads versions up to it."""

PREFIX = "sharetree."  # of sharetree's own metadata keys (refused in save(metadata=))

KEY_VERSION = PREFIX + "format_version"  # marks a file st.save wrote: its format version

KEY_TREE = PREFIX + "tree"  # the JSON structure of the tree

KEY_LIBRARY = PREFIX + "library_version"  # the version of sharetree that wrote the file

MAX_DEPTH = 200
"""The deepest nesting of containers :func:`save` writes and :func:`load` reads (the root is 0)."""

KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
"""The PRNG implementations of typed key arrays (``jax.random.key``) a file may hold."""

RESAVE = FIXES["resave"] + " (its tensors alone: safetensors.numpy.load_file(path))"


class Field(NamedTuple):
    """One field of a node of ``sharetree.tree``.

    ``norm`` gives the value as the walk uses it, or :data:`BAD` for a value of the right
    JSON type that is still not acceptable.
    """

    name: str
    json: tuple[type, ...]  # the types json.loads gives for an acceptable value
    want: str  # what it should be, as a message says
    norm: Callable[[Any], Any] | None = None
    required: bool = True


BAD = object()
"""What a normaliser gives for a value it does not accept."""


def _accept(ok: Callable[[Any], bool]) -> Callable[[Any], Any]:
    """A normaliser that keeps a value ``ok`` accepts."""
    return lambda v: v if ok(v) else BAD


def _dtype(v: str) -> Any:
    """A numeric dtype's name as ``jnp.dtype`` reads it (``"float32"``, never ``"f4"``)."""
    try:  # numpy parses more than names (a SyntaxError for some): identifiers only
        d = np.dtype(jnp.dtype(v)) if v.isidentifier() else None
    except TypeError:
        d = None
    return d if d is not None and d.name == v and is_numeric(d) else BAD


def _sizes(v: list[Any]) -> Any:
    """A shape: sizes >= 0 (json.loads' types: a bool is no int)."""
    return tuple(v) if all(type(d) is int and d >= 0 for d in v) else BAD


_REAL = (int, float)

VALUES: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: type(v) is bool,
    "int": lambda v: type(v) is int,
    "float": lambda v: type(v) in _REAL,
    "str": lambda v: type(v) is str,
    "complex": lambda v: type(v) is list and len(v) == 2 and all(type(x) in _REAL for x in v),
}
"""The Python leaves a ``value`` node holds: its ``type`` and the check of its ``value``."""

_TYPE = Field("type", (str,), "a type name (printable, at most 500 characters)",
              _accept(lambda v: 0 < len(v) <= 500 and v.isprintable()))  # fmt: skip

_KEYS = Field("keys", (list,), "a list of str or int keys",
              _accept(lambda v: all(type(k) in (str, int) for k in v)))  # fmt: skip

_CHILDREN = Field("children", (list,), "a list of nodes")

_KEYS_OF_REF = _accept(lambda v: v and all(type(k) in (str, int) for k in v))

_CLIMB = _accept(lambda v: type(v) is int and 0 <= v <= MAX_DEPTH)

REF_FIELDS: tuple[Field, ...] = (
    Field("ref", (list,), "a non-empty list of str or int keys", _KEYS_OF_REF),
    Field("up", (int,), f"an int from 0 to {MAX_DEPTH}", _CLIMB, required=False),
)
"""The fields of each input of a tie's ``refs`` (a view of several positions, version 4)."""

FIELDS: dict[str, tuple[Field, ...]] = {
    "none": (),
    "list": (_CHILDREN,),
    "tuple": (_CHILDREN,),
    "dict": (_KEYS, _CHILDREN),
    "odict": (_KEYS, _CHILDREN),
    "node": (_TYPE, _KEYS, _CHILDREN),
    "static": (_TYPE,),
    "value": (
        Field("type", (str,), ", ".join(VALUES), _accept(lambda v: v in VALUES)),
        Field("value", (bool, int, float, str, list, dict, type(None)), "a value"),  # see value()
    ),
    "tied": (  # one of ref (with its up) and refs: checked by _Walk.tied
        Field("ref", (list,), "a non-empty list of str or int keys", _KEYS_OF_REF,
              required=False),
        Field("up", (int,), f"an int from 0 to {MAX_DEPTH}, in a file of version 3",
              _CLIMB, required=False),
        Field("refs", (dict,), 'a non-empty object {input name: {"ref": [...]}}, version 4',
              _accept(bool), required=False),
        Field("transform", (dict,), "a transform spec (a JSON object)"),
    ),
    "buffer": (
        Field("tensor", (str,), "a tensor name"),
        Field("dtype", (str,), "a numeric dtype name", _dtype),
        Field("shape", (list,), "a list of sizes >= 0", _sizes),
        Field("raw", (bool,), "true or false"),
        Field("scalar", (bool,), "true or false", required=False),
        Field("key", (str, type(None)), f"one of {', '.join(KEY_IMPLS)}",
              _accept(lambda v: v is None or v in KEY_IMPLS), required=False),
    ),
}  # fmt: skip
"""Each node kind ``t`` and its fields (the table of "The file format"); others are ignored."""
