"""Paths (tuples of ``jax.tree_util`` key names, as str) and leaves: shared helpers."""

from __future__ import annotations

import collections
import contextlib
import difflib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Union

import jax
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError, error, short, wrong_type

__all__ = [
    "Path",
    "PathLike",
    "TieMap",
    "to_path",
    "Ref",
    "to_ref",
    "ref_str",
    "from_root",
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
                fix = "use the key's name or index"
                raise wrong_type("E15", f"{what} {short(tuple(keys))}", "str or int keys", k, fix)
        parts = tuple(k if isinstance(k, str) else str(int(k)) for k in keys)
    else:
        want = "a '/'-joined string ('encoder/kernel') or a tuple of keys"
        raise wrong_type("E15", what, want, ref, "write the path as 'encoder/kernel'")
    if not parts or (isinstance(keys, str) and "" in parts):  # a tuple may name a "" key
        fix = "name a path below the root, e.g. 'encoder/kernel'"
        raise error("E15", f"{what} {short(ref)}", "has an empty key", fix=fix)
    return parts


class Ref(NamedTuple):
    """A ref as written: its keys, and how far it climbs (``None``: looked up by scope).

    ``up=None`` is the scoped ref (``"enc/w"``: from the innermost subtree holding the tie
    that has it, out to the root); ``up=0`` names a sibling exactly (``"./w"``); ``up=k``
    climbs ``k`` levels above the tie's own subtree first (``"../w"``, ``"../../w"``).
    """

    keys: Path
    up: int | None


def to_ref(ref: Any, up: Any = None, what: str = "Tied ref") -> Ref:
    """Read a ref: ``"../0"`` climbs one level, ``"./w"`` names a sibling, else scoped.

    In the string form, leading ``.`` and ``..`` steps say where to start; in the tuple
    form every entry is a key (a key named ``".."`` is written ``("..", ...)``) and
    ``up=`` climbs.

    Example:
        >>> to_ref("../0"), to_ref("./w"), to_ref(("..", "w"), up=2)
        (Ref(keys=('0',), up=1), Ref(keys=('w',), up=0), Ref(keys=('..', 'w'), up=2))
    """
    if up is not None and (isinstance(up, (bool, np.bool_)) or not isinstance(up, int)):
        raise wrong_type("E15", f"{what} {short(ref)} (up=...)", "None or an int >= 0", up)
    if up is not None and up < 0:
        raise error("E15", f"{what} {short(ref)}", found=f"up={up}", expected="up >= 0")
    climb: int | None = None
    written, shown = ref, f"{what} {short(ref)}"  # messages show the ref as it was written
    if isinstance(ref, str) and ref.split("/", 1)[0] in (".", ".."):
        steps = ref.split("/")
        if up is not None:
            fix = "write the climb once: in the string or as up="
            raise error("E15", shown, "climbs twice", found=f"up={up}", fix=fix)
        climb = 0 if steps[0] == "." else 1
        steps = steps[1:]
        while steps and steps[0] == ".." and climb:
            climb, steps = climb + 1, steps[1:]
        ref = "/".join(steps)
        if "" in steps or not steps:  # '..//x', './': an empty key after the climb
            fix = "name a key after the climb, e.g. '../encoder/kernel'"
            raise error("E15", shown, "has an empty key", fix=fix)
    keys = to_path(ref, what)
    if isinstance(written, str) and {".", ".."} & set(keys):
        fix = "climb only at the start ('../a/b'); a key named '..' is written as a tuple"
        raise error("E15", shown, "has a '.' or '..' step inside it", fix=fix)
    return Ref(keys, climb if up is None else up)


def from_root(target: Path, ref: Ref) -> Path | None:
    """The path from the root that a ref written at ``target`` names.

    A climbing ref's own; a scoped ref's keys (read from the root, as ``st.tie`` reads
    them); ``None`` for a climb past the root.

    >>> from_root(("1", "1"), to_ref("../0")), from_root(("a",), to_ref("../w"))
    (('0',), None)
    """
    if ref.up is None:
        return ref.keys
    base = len(target) - 1 - ref.up
    return target[:base] + ref.keys if base >= 0 else None


def ref_str(ref: Ref) -> str | tuple[str, ...]:
    """The spelling of a ref that reads back as it: ``"../0"``, ``"enc/w"``, or keys.

    Keys named ``"."`` or ``".."`` are spelled as the tuple: as a string they would climb.

    >>> ref_str(Ref(("..", "x"), None)), ref_str(Ref(("x",), 1)), ref_str(Ref(("a/b",), 0))
    (('..', 'x'), '../x', ('a/b',))
    """
    key = path_key(ref.keys)
    if isinstance(key, str) and {".", ".."} & set(ref.keys):
        key = ref.keys  # a key named '..' written as a string would read as a climb
    if ref.up is None or not isinstance(key, str):
        return key
    return "./" + key if ref.up == 0 else "../" * ref.up + key


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
FIX_DEEP = "stack the layers' arrays along a leading axis (jax.lax.scan over layers)"
FIX_KEYS = "use keys of one type, e.g. {str(k): v for k, v in d.items()}"


def flatten_error(tree: Any, err: BaseException) -> TieError | None:
    """The TieError saying where JAX's ``err`` came from (unsortable keys, depth), or ``None``."""
    stack: list[tuple[Path, Any]] = [((), tree)]
    while stack:
        path, x = stack.pop()
        if len(path) >= FLATTEN_DEPTH and isinstance(err, (RecursionError, SystemError)):
            where = f"the tree at {path_str(path[:6]) + '/...'!r} ({len(path):,} keys down)"
            deep = f"is nested more than {FLATTEN_DEPTH} levels deep ({type(err).__name__})"
            return error("E61", where, deep, fix=FIX_DEEP)
        if type(x) in (dict, collections.defaultdict):  # the dicts JAX sorts
            keys = list(x)
            try:
                sorted(keys)
            except TypeError:
                a = next(k for k in keys if type(k) is not type(keys[0]))
                types = f"{type(keys[0]).__name__} and {type(a).__name__}"
                found = f"{short(keys[0])} and {short(a)} ({types})"
                where = f"the dict at {path_str(path)!r}" if path else "the root dict"
                return error("E61", where, "has unsortable keys", found=found, fix=FIX_KEYS)
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


def nnx_variable(x: Any, base: str = "Variable") -> str | None:
    """The class name of ``x`` if it is a Flax NNX ``Variable`` (``"Param"``), else ``None``.

    ``base="Module"``: the same for an NNX module. Flax is never imported here: a tree
    holds no NNX object unless ``flax.nnx`` is loaded.
    """
    cls = getattr(sys.modules.get("flax.nnx"), base, None)
    return type(x).__name__ if cls is not None and isinstance(x, cls) else None


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
