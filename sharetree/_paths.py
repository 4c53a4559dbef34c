"""Paths and leaves: the one home of the helpers every module shares.

A sharetree *path* is a tuple of key names (``("encoder", "kernel")``), shown
``/``-joined (``encoder/kernel``). Key names come from ``jax.tree_util`` key
paths: dict keys, sequence indices and attribute names, all as ``str``.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Union

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError

__all__ = [
    "Path",
    "PathLike",
    "TieMap",
    "to_path",
    "path_str",
    "path_key",
    "key_str",
    "key_name",
    "keypath_to_path",
    "leaves_with_paths",
    "flatten_error",
    "check_flattens",
    "flattening",
    "prefixes",
    "node_paths",
    "is_array_leaf",
    "aval_of",
    "format_aval",
    "aval_nbytes",
    "closest",
    "plural",
]

Path = tuple[str, ...]
"""A normalised path: a tuple of key names (dict keys, indices and attribute names as str)."""

PathLike = Union[str, Sequence[Any]]  # noqa: UP007 - a runtime alias
"""A ``/``-joined string (``"encoder/kernel"``) or a tuple of keys (``("encoder", "kernel")``)."""


TieMap = Union[  # noqa: UP007 - a runtime alias
    Mapping[str, Any], Mapping[tuple[str, ...], Any], Mapping[PathLike, Any]
]
"""``{target: ref or Tied}`` keyed by path strings or key tuples (``Mapping`` is invariant in
its keys, so each spelling is listed)."""


def to_path(ref: Any, what: str = "path") -> Path:
    """Normalise ``"a/b/0"`` or ``("a", "b", 0)`` to ``("a", "b", "0")``.

    Raises:
        TieError: for anything that is not a non-empty path (``what`` names it).

    Example:
        >>> from sharetree._paths import to_path
        >>> to_path("layers/0/w"), to_path(("a/b", 1))
        (('layers', '0', 'w'), ('a/b', '1'))
    """
    keys = (ref,) if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool) else ref
    if isinstance(keys, str):
        parts = tuple(keys.split("/"))  # "" gives ("",): an empty key
    elif isinstance(keys, (tuple, list)):
        for k in keys:
            if not isinstance(k, (str, int, np.integer)) or isinstance(k, bool):
                raise TieError(
                    f"{what} {tuple(keys)!r}: keys must be str or int, "
                    f"found {type(k).__name__} {k!r}. Fix: use the key's name or index."
                )
        parts = tuple(k if isinstance(k, str) else str(int(k)) for k in keys)
    else:
        raise TieError(
            f"{what}: expected a '/'-joined string or a tuple of keys, found {type(ref).__name__} "
            f"{ref!r}. Fix: write it as 'encoder/kernel' or ('encoder', 'kernel')."
        )
    if not parts or (isinstance(keys, str) and "" in parts):  # a tuple may name a "" key
        raise TieError(
            f"{what} {ref!r} has an empty key. Fix: name a path below the root, such as "
            "'encoder/kernel' (a tie at or to the root is not allowed)."
        )
    return parts


def path_str(path: Path) -> str:
    """The display form of a path: ``a/b/0``, or a tuple when a key contains ``/``.

    Example:
        >>> from sharetree._paths import path_str
        >>> path_str(("a", "b", "0")), path_str(("a/b", "c")), path_str(())
        ('a/b/0', "('a/b', 'c')", '<root>')
    """
    if not path:
        return "<root>"
    key = path_key(path)
    return key if isinstance(key, str) else repr(key)


def path_key(path: Path) -> str | Path:
    """A path as a result's key: ``/``-joined, or the tuple when a key has ``/`` or is ``""``.

    Example:
        >>> from sharetree._paths import path_key
        >>> path_key(("a", "b", "0")), path_key(("a/b", "c"))
        ('a/b/0', ('a/b', 'c'))
    """
    return path if any("/" in k or not k for k in path) else "/".join(path)


def key_str(key: str | Path) -> str:
    """The display form of a result's key (:func:`path_key`): the string, or the tuple's repr.

    Example:
        >>> from sharetree._paths import key_str
        >>> key_str("a/b"), key_str(("a/b", "c"))
        ('a/b', "('a/b', 'c')")
    """
    return key if isinstance(key, str) else path_str(tuple(key))


def key_name(key: Any) -> str:
    """The name of one ``jax.tree_util`` key entry, as ``jtu.keystr((key,), simple=True)``.

    The three common key classes are read directly (this runs once per leaf
    when a structure is first resolved); any other key goes through ``keystr``.

    Example:
        >>> import jax.tree_util as jtu
        >>> from sharetree._paths import key_name
        >>> key_name(jtu.DictKey("w")), key_name(jtu.SequenceKey(3)), key_name(jtu.GetAttrKey("b"))
        ('w', '3', 'b')
    """
    kind = type(key)
    if kind is jtu.DictKey:
        return str(key.key)
    if kind is jtu.SequenceKey:
        return str(key.idx)
    if kind is jtu.GetAttrKey:
        return str(key.name)
    return jtu.keystr((key,), simple=True, separator="/")


def keypath_to_path(keypath: Sequence[Any]) -> Path:
    """Convert a ``jax.tree_util`` key path to a sharetree path."""
    return tuple(key_name(k) for k in keypath)


def leaves_with_paths(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> list[tuple[Path, Any]]:
    """Every leaf of ``tree`` with its path, in flatten order (``is_leaf`` as in ``jax.tree_util``).

    Example:
        >>> from sharetree._paths import leaves_with_paths
        >>> leaves_with_paths({"a": [1.0, 2.0], "b": None, "c": (3.0,)})
        [(('a', '0'), 1.0), (('a', '1'), 2.0), (('c', '0'), 3.0)]
        >>> leaves_with_paths({"a": (1.0, 2.0)}, is_leaf=lambda x: isinstance(x, tuple))
        [(('a',), (1.0, 2.0))]
    """
    if is_leaf is not None:
        check_flattens(tree)  # first without a callback (see check_flattens)
    return [(keypath_to_path(kp), x) for kp, x in jtu.tree_leaves_with_path(tree, is_leaf)]


def check_flattens(tree: Any) -> None:
    """Raise the :class:`TieError` of :func:`flatten_error` if ``jax.tree_util`` cannot flatten it.

    Call it before a flatten with a Python ``is_leaf`` on a user's tree: JAX's
    flatten of a tree too deep for it raises cleanly without a callback, but
    with one it can leave the interpreter's recursion count exhausted.
    """
    with flattening(tree):
        jtu.tree_structure(tree)


@contextlib.contextmanager
def flattening(tree: Any) -> Iterator[None]:
    """A block in which a failed flatten of ``tree`` becomes :func:`flatten_error`'s TieError.

    The TieError is chained to JAX's error; other errors, a ``TieError`` among
    them, pass as they are.
    """
    try:
        yield
    except (RecursionError, SystemError, ValueError) as e:  # too deep, or unsortable dict keys
        if isinstance(e, TieError) or (err := flatten_error(tree, e)) is None:
            raise
        raise err from e


FLATTEN_DEPTH = 500
"""Nesting depth from which :func:`flatten_error` blames a failed flatten on the depth.

``jax.tree_util`` flattens recursively and fails at about 1,000 levels (Python's
recursion limit)."""


def flatten_error(tree: Any, err: BaseException) -> TieError | None:
    """The :class:`TieError` for a tree that ``jax.tree_util`` failed to flatten with ``err``.

    Walks the tree iteratively (only after a failure) for the two causes JAX
    reports without a path: a dict whose keys cannot be sorted (``0`` and
    ``"0"``, ``None`` and a string) and nesting deeper than JAX can recurse.
    ``None`` when neither is found (the caller re-raises ``err``).

    Example:
        >>> import jax
        >>> from sharetree._paths import flatten_error
        >>> tree = {"a": {0: 1.0, "0": 2.0}}
        >>> print(flatten_error(tree, ValueError("sorting failed")))  # doctest: +ELLIPSIS
        the dict at 'a' has keys that cannot be sorted (0 and '0': int and str)...
    """
    stack: list[tuple[Path, Any]] = [((), tree)]
    while stack:
        path, x = stack.pop()
        if len(path) >= FLATTEN_DEPTH and isinstance(err, (RecursionError, SystemError)):
            shown = path_str(path[:6]) + "/..."
            return TieError(
                f"the tree is nested more than {FLATTEN_DEPTH:,} levels deep (at {shown!r}, "
                f"{len(path):,} keys down), deeper than jax.tree_util can flatten "
                f"({type(err).__name__}). Fix: keep trees shallow: hold many layers in one "
                "list, or stack their arrays along a leading axis (jax.lax.scan over layers)."
            )
        if type(x) in (dict, collections.defaultdict):  # the dicts JAX sorts
            keys = list(x)
            try:
                sorted(keys)
            except TypeError:
                a = next(k for k in keys if type(k) is not type(keys[0]))
                where = f"the dict at {path_str(path)!r}" if path else "the root dict"
                return TieError(
                    f"{where} has keys that cannot be sorted ({keys[0]!r} and "
                    f"{a!r}: {type(keys[0]).__name__} and {type(a).__name__}), so "
                    "jax.tree_util cannot flatten it. Fix: use keys of one type (all str), "
                    "e.g. {str(k): v for k, v in d.items()}."
                )
        try:  # the children, one level down, in flatten order
            kids, _ = jtu.tree_flatten_with_path(x, is_leaf=lambda y, x=x: y is not x)
        except Exception:
            continue
        if len(kids) == 1 and kids[0][1] is x:
            continue  # a leaf
        stack.extend((path + (key_name(kp[0]),), y) for kp, y in reversed(kids))
    return None


def prefixes(path: Path) -> list[Path]:
    """Every node above and at ``path``: ``("a", "b")`` -> ``[("a",), ("a", "b")]``."""
    return [path[:k] for k in range(1, len(path) + 1)]


def node_paths(positions: Iterable[Path]) -> set[Path]:
    """The paths of every node at or above the given positions (the root excluded)."""
    return {p for position in positions for p in prefixes(position)}


def is_array_leaf(x: Any) -> bool:
    """Whether a transform applies to ``x``: arrays, tracers and numbers; not bools or strings.

    Example:
        >>> import numpy as np
        >>> from sharetree._paths import is_array_leaf
        >>> [is_array_leaf(x) for x in (np.ones(2), np.float32(1), 2.0, True, "s", None)]
        [True, True, True, False, False, False]
    """
    if isinstance(x, (bool, np.bool_)):
        return False
    return isinstance(x, (jax.Array, np.ndarray, np.generic, float, int, complex))


def aval_of(x: Any) -> jax.ShapeDtypeStruct | None:
    """Shape and dtype of an array leaf (or of a ``ShapeDtypeStruct``); ``None`` otherwise."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    if is_array_leaf(x):
        return jax.ShapeDtypeStruct((), np.asarray(x).dtype)
    return None


def format_aval(aval: Any) -> str:
    """``float32[2, 3]`` for a shape/dtype (or an array), ``static`` for anything else.

    Example:
        >>> import numpy as np
        >>> from sharetree._paths import format_aval
        >>> format_aval(np.zeros((2, 3), np.float32)), format_aval(None)
        ('float32[2, 3]', 'static')
    """
    aval = aval_of(aval)
    if aval is None:
        return "static"
    return f"{aval.dtype.name}[{', '.join(map(str, aval.shape))}]"


def aval_nbytes(aval: jax.ShapeDtypeStruct | None) -> int:
    """Bytes of an array of shape and dtype ``aval`` (0 for ``None``)."""
    return 0 if aval is None else math.prod(aval.shape) * aval.dtype.itemsize


def closest(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """A ``closest existing path(s): ...`` hint listing the candidates closest to ``name``.

    Example:
        >>> from sharetree._paths import closest
        >>> closest("encoder/kernal", ["encoder/kernel", "decoder/bias"], n=1)
        "closest existing path(s): 'encoder/kernel'"
    """
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.0)
    if not matches:
        return "the tree has no paths at all"
    return "closest existing path(s): " + ", ".join(repr(m) for m in matches)


def plural(n: int, word: str) -> str:
    """``plural(1, "view")`` -> ``'1 view'``, ``plural(2, "view")`` -> ``'2 views'``."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"
