"""Paths (tuples of ``jax.tree_util`` key names, as str) and leaves: shared helpers."""

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
"""``{target: ref or Tied}`` keyed by path strings or key tuples (Mapping keys are invariant)."""


def to_path(ref: Any, what: str = "path") -> Path:
    """Normalise ``"a/b/0"`` or ``("a", "b", 0)`` to ``("a", "b", "0")``; else a TieError.

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
    """The display form of a path: ``a/b/0``, a tuple when a key contains ``/``, or ``<root>``."""
    return key_str(path_key(path)) if path else "<root>"


def path_key(path: Path) -> str | Path:
    """A path as a result's key: ``/``-joined, or the tuple when a key has ``/`` or is ``""``."""
    return path if any("/" in k or not k for k in path) else "/".join(path)


def key_str(key: str | Path) -> str:
    """The display form of a result's key (:func:`path_key`): the string, or the tuple's repr."""
    if isinstance(key, str):
        return key
    return repr(tuple(key)) if key else "<root>"


def key_name(key: Any) -> str:
    """The name of one key entry, as ``jtu.keystr((key,), simple=True)`` (common keys read fast)."""
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
    """Every leaf of ``tree`` with its path, in flatten order (``is_leaf`` as in JAX)."""
    if is_leaf is not None:
        check_flattens(tree)  # first without a callback (see check_flattens)
    return [(keypath_to_path(kp), x) for kp, x in jtu.tree_leaves_with_path(tree, is_leaf)]


def check_flattens(tree: Any) -> None:
    """Raise :func:`flatten_error`'s TieError if JAX cannot flatten ``tree``.

    Call it before a flatten with a Python ``is_leaf``, which can exhaust the recursion count.
    """
    with flattening(tree):
        jtu.tree_structure(tree)


@contextlib.contextmanager
def flattening(tree: Any) -> Iterator[None]:
    """A block in which a failed flatten of ``tree`` becomes :func:`flatten_error`'s TieError."""
    try:
        yield
    except (RecursionError, SystemError, ValueError) as e:  # too deep, or unsortable dict keys
        if isinstance(e, TieError) or (err := flatten_error(tree, e)) is None:
            raise
        raise err from e


FLATTEN_DEPTH = 500  # from here a failed flatten is blamed on the depth (JAX fails near 1,000)


def flatten_error(tree: Any, err: BaseException) -> TieError | None:
    """The TieError saying where JAX's ``err`` came from (unsortable keys, depth), or ``None``."""
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
    """Whether a transform applies to ``x``: arrays, tracers and numbers; not bools or strings."""
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
    """``float32[2, 3]`` for a shape/dtype (or an array), ``static`` for anything else."""
    aval = aval_of(aval)
    if aval is None:
        return "static"
    return f"{aval.dtype.name}[{', '.join(map(str, aval.shape))}]"


def aval_nbytes(aval: jax.ShapeDtypeStruct | None) -> int:
    """Bytes of an array of shape and dtype ``aval`` (0 for ``None``)."""
    return 0 if aval is None else math.prod(aval.shape) * aval.dtype.itemsize


def closest(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """A ``closest existing path(s): ...`` hint listing the candidates closest to ``name``."""
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.0)
    if not matches:
        return "the tree has no paths at all"
    return "closest existing path(s): " + ", ".join(repr(m) for m in matches)


def plural(n: int, word: str) -> str:
    """``plural(1, "view")`` -> ``'1 view'``, ``plural(2, "view")`` -> ``'2 views'``."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"
