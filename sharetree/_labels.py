"""Label and mask trees from path patterns, for optax: one per buffer, none per ``Tied``."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu

from sharetree._errors import TieError, error, warn, wrong_type
from sharetree._paths import (
    Path,
    closest,
    flattening,
    keypath_to_path,
    leaves_with_paths,
    node_paths,
    path_str,
    plural,
    prefixes,
)
from sharetree._resolve import Structure, structure_of
from sharetree._tied import is_tied

__all__ = [
    "label_by_path",
    "mask_by_path",
    "partition",
    "combine",
    "Partition",
    "apply_rules",
    "exact_pattern",
    "rule_pairs",
]

_MISSING: Any = object()


def _matches(pattern: str, path: Path) -> bool:
    """Whether ``pattern`` matches ``path`` or a node above it (``a`` covers ``a/b``)."""
    return any(fnmatch.fnmatchcase("/".join(p), pattern) for p in prefixes(path))


def rule_pairs(rules: Any, where: str, value: str, example: str) -> list[tuple[str, Any]]:
    """``{pattern: value}`` or ``[(pattern, value), ...]`` as a list of pairs, checked."""
    want, fix = f"rules {{pattern: {value}}} or (pattern, {value}) pairs", f"write {example}"
    if not isinstance(rules, (Mapping, Iterable)) or isinstance(rules, (str, bytes)):
        raise wrong_type("E64", where, want, rules, fix)
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise wrong_type("E64", where, f"(pattern, {value}) pairs, str patterns", item, fix)
    return items


_NEVER_FIRST = "is never the first rule to match a leaf (each leaf gets its first match)"


def exact_pattern(path: Path) -> str:
    """A pattern matching exactly ``path`` (``[``, ``*`` and ``?`` of its keys escaped)."""
    return "".join(f"[{c}]" if c in "[*?" else c for c in "/".join(path))


def _unused_error(
    pattern: str, pairs: list[tuple[str, Any]], tree: Any, leaf_paths: list[Path], fn: str
) -> TieError:
    hits = [p for p in leaf_paths if _matches(pattern, p)]
    if hits:  # it matches, but an earlier rule matches each of those leaves first
        first = next(q for q, _ in pairs if _matches(q, hits[0]))
        more = f" (and {len(hits) - 1} more of its leaves)" if len(hits) > 1 else ""
        found = f"the earlier pattern {first!r} matches {path_str(hits[0])!r}{more} first"
        fix = "put the narrower rule before the broader one, drop it, or pass strict=False"
        return error("E38", f"{fn}: pattern {pattern!r}", _NEVER_FIRST, found=found, fix=fix)
    try:
        structure = structure_of(jtu.tree_structure(tree))
        ties = [(p, structure.ties[p]) for p in structure.ties]
        inside = [v for v in structure.views if _matches(pattern, v.path)]
    except TieError:  # a bad graph is reported by materialize
        ties, inside = [(p, x) for p, x in leaves_with_paths(tree, is_tied) if is_tied(x)], []
    views = [f"{path_str(p)!r} ({t!r})" for p, t in ties if _matches(pattern, p)]
    views += [
        f"{path_str(v.path)!r} (in {structure.ties[v.tie]!r} at {path_str(v.tie)!r}, a view of "
        f"{_buffers_text(structure, v.buffer)})"
        for v in inside
        if not _matches(pattern, v.tie)
    ][:3]
    nodes = {"/".join(n) for n in node_paths(leaf_paths)} | {path_str(p) for p, _ in ties}
    why = f"it names only tied position(s) {', '.join(views)}" if views else closest(pattern, nodes)
    fix = "write the pattern for the buffer's path, or pass strict=False"
    return error("E38", f"{fn}: pattern {pattern!r}", f"matches no leaf; {why}", fix=fix)


def _buffers_text(structure: Structure, source: int) -> str:
    """The buffer(s) a source reads, for a message: ``'w'``, or ``'a', 'b'`` for a join."""
    return ", ".join(repr(path_str(structure.buffer_paths[b])) for b in structure.parents[source])


def apply_rules(
    tree: Any,
    pairs: list[tuple[str, Any]],
    leaf: Callable[[Path, Any, tuple[str, Any] | None], Any],
    where: str,
    strict: bool,
    credit_all: bool,
    what: str = "label",
) -> Any:
    """Replace each leaf by ``leaf(path, value, first matching rule or None)``.

    With ``strict`` every rule must be some leaf's first match (``credit_all``: any match).
    """
    used = [False] * len(pairs)
    given: dict[Path, Any] = {}  # each leaf's result

    def one(kp: Any, x: Any) -> Any:
        path = keypath_to_path(kp)
        hits = [i for i, (pattern, _) in enumerate(pairs) if _matches(pattern, path)]
        for i in hits if credit_all else hits[:1]:
            used[i] = True
        given[path] = leaf(path, x, pairs[hits[0]] if hits else None)
        return given[path]

    with flattening(tree):
        out = jtu.tree_map_with_path(one, tree)
    unused = [pattern for (pattern, _), ok in zip(pairs, used, strict=True) if not ok]
    if strict and unused:
        raise _unused_error(unused[0], pairs, tree, list(given), where)
    _warn_on_views(tree, pairs, given, where, what)
    return out


def _warn_on_views(
    tree: Any, pairs: list[tuple[str, Any]], given: dict[Path, Any], where: str, what: str
) -> None:
    """Warn for each rule that gives views another value than their buffers' (it has no effect).

    A view shares its buffer's label, mask bit or sharding (nanoGPT's ``"*kernel"``).
    """
    try:
        structure = structure_of(jtu.tree_structure(tree))
    except TieError:
        return  # a bad graph is reported by materialize; labels do not need it
    found: dict[str, tuple[Path, list[str]]] = {}  # by pattern: the first buffer it misses, views
    for view in structure.views:
        pattern, theirs = next(((p, v) for p, v in pairs if _matches(p, view.path)), (None, 0))
        if pattern is None:
            continue
        # a view of several positions (or a view of one) reads several buffers: each counts
        parents = [structure.buffer_paths[b] for b in structure.parents[view.buffer]]
        got = {b: given[b] for b in parents if not _matches(pattern, b) and b in given}
        if what == "sharding":
            got = {b: sharding.spec for b, sharding in got.items()}  # a NamedSharding's
        differ = [(b, ours) for b, ours in got.items() if not _same(ours, theirs)]
        if not differ:
            continue
        tie = structure.ties[view.tie]
        if len(parents) == 1:
            gets = f"its buffer {path_str(differ[0][0])!r} gets {differ[0][1]!r}"
        else:  # the parents that differ, grouped by what they get
            by_value: dict[str, list[str]] = {}
            for b, ours in differ:
                by_value.setdefault(repr(ours), []).append(repr(path_str(b)))
            gets = "of its parent buffers, " + ", ".join(
                f"{', '.join(bs)} {'gets' if len(bs) == 1 else 'get'} {value}"
                for value, bs in by_value.items()
            )
        found.setdefault(pattern, (differ[0][0], []))[1].append(
            f"{path_str(view.path)!r} ({tie!r} at {path_str(view.tie)!r}) would get "
            f"{theirs!r}, but {gets}"
        )
    for pattern, (buffer, views) in found.items():
        shown = "; ".join(views[:3]) + (f"; and {len(views) - 3} more" if len(views) > 3 else "")
        at, n = f"{where}: pattern {pattern!r}", plural(len(views), "view")
        shared = f"a view has no {what} of its own"
        problem = f"matches {n} whose buffer it does not ({shared}): {shown}"
        fix = f"write the rule for the buffer's path ({path_str(buffer)!r}), or narrow the pattern"
        warn("E161", at, problem, fix=fix)


def _same(ours: Any, theirs: Any) -> bool:
    """Whether a buffer's label (or spec) ``ours`` is the rule's ``theirs``."""
    try:
        return ours is theirs or (type(ours) is type(theirs) and bool(ours == theirs))
    except Exception:  # labels that do not compare (arrays): only the same object is the same
        return ours is theirs


def label_by_path(
    tree: Any,
    rules: Mapping[str, Any] | Sequence[tuple[str, Any]],
    *,
    default: Any = _MISSING,
    strict: bool = True,
) -> Any:
    """A tree of labels (for ``optax.multi_transform``): each leaf gets its first matching rule's.

    ``rules`` are ``{pattern: label}`` or ``(pattern, label)`` pairs; patterns are
    ``fnmatch``-style on ``/``-joined paths (``*`` also matches ``/``), and one that
    matches a node covers every leaf below it. ``Tied`` nodes have no leaves and
    stay. A TieError for a leaf no pattern matches (without ``default``), a
    pattern that matches no leaf (with ``strict``), or malformed rules.

    Example:
        >>> import numpy as np, sharetree as st
        >>> params = {"embed": np.ones((5, 2)), "head": st.Tied("embed", st.T), "b": np.zeros(5)}
        >>> st.label_by_path(params, {"embed": "adam", "b": "sgd"})
        {'b': 'sgd', 'embed': 'adam', 'head': Tied('embed', T)}
    """
    pairs = rule_pairs(rules, "label_by_path", "label", "{'embed/*': 'embed', '*bias': 'no_decay'}")

    def label(path: Path, _x: Any, rule: tuple[str, Any] | None) -> Any:
        if rule is None and default is _MISSING:
            where, none = f"label_by_path: leaf {path_str(path)!r}", "matches none of the patterns"
            fix = (
                f"add a pattern for it (e.g. {exact_pattern(path)!r} or '*'), "
                "or pass default=<label>"
            )
            raise error("E38", where, f"{none} {[p for p, _ in pairs]}", fix=fix)
        return default if rule is None else rule[1]

    return apply_rules(tree, pairs, label, "label_by_path", strict, credit_all=False)


def mask_by_path(tree: Any, patterns: str | Iterable[str], *, strict: bool = True) -> Any:
    """A tree of booleans (for ``optax.masked``): ``True`` where a leaf's path matches a pattern.

    Patterns (one or several) are those of :func:`label_by_path`; with ``strict``
    each must match a leaf, else a TieError.

    Example:
        >>> import numpy as np, sharetree as st
        >>> params = {"dense": {"kernel": np.ones((2, 2)), "bias": np.zeros(2)},
        ...           "out": {"kernel": st.Tied("dense/kernel", st.T)}}
        >>> st.mask_by_path(params, "*kernel")
        {'dense': {'bias': False, 'kernel': True}, 'out': {'kernel': Tied('dense/kernel', T)}}
    """
    one = isinstance(patterns, str) or not isinstance(patterns, Iterable)
    given: list[Any] = [patterns] if one else list(patterns)  # a non-str is reported below
    for p in given:
        if not isinstance(p, str):
            want = "str patterns such as 'encoder/*/kernel'"
            raise wrong_type("E64", "mask_by_path", want, p, "write the paths as strings")
    pairs = [(p, True) for p in given]
    hit = lambda _p, _x, rule: rule is not None  # noqa: E731
    return apply_rules(tree, pairs, hit, "mask_by_path", strict, credit_all=True, what="mask bit")


class Partition(NamedTuple):
    """A tree split by a mask: its ``trainable`` leaves, its ``frozen`` ones, ``None`` elsewhere."""

    trainable: Any
    frozen: Any


def partition(tree: Any, mask: Any) -> Partition:
    """Split ``tree`` by ``mask`` (:func:`mask_by_path`): what ``jax.grad`` takes, and the rest.

    ``trainable`` holds the leaves where ``mask`` is ``True`` and ``None`` elsewhere,
    ``frozen`` the others; both keep every ``Tied``. Differentiate a loss of
    ``combine(trainable, frozen)`` with respect to ``trainable`` only: the frozen leaves
    may be integers (a QLoRA tree's packed ``uint32`` tables), which ``jax.grad`` refuses.
    A masked leaf that is not a float array is E341.

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> tree = {"q": np.zeros((2, 2), np.uint32), "a": np.ones(2, np.float32)}
        >>> train, frozen = st.partition(tree, st.mask_by_path(tree, "a"))
        >>> train
        {'a': array([1., 1.], dtype=float32), 'q': None}
        >>> g = jax.grad(lambda t: st.combine(t, frozen)["a"].sum())(train)
        >>> g["a"].tolist(), st.combine(train, frozen)["q"].dtype
        ([1.0, 1.0], dtype('uint32'))
    """
    with flattening(tree):
        kps = jtu.tree_flatten_with_path(tree, is_leaf=is_tied)[0]
        treedef: Any = jtu.tree_structure(tree, is_leaf=is_tied)
    with flattening(mask):
        bits = jtu.tree_leaves(mask, is_leaf=is_tied)
        same = jtu.tree_structure(mask, is_leaf=is_tied) == treedef
    if not same:
        fix = "build the mask from this tree: st.mask_by_path(tree, patterns)"
        raise error("E341", "partition: mask", "is not of the tree's structure", fix=fix)
    train, frozen = [], []
    for (kp, x), bit in zip(kps, bits, strict=True):
        if is_tied(x):
            train.append(x)
            frozen.append(x)
            continue
        if not isinstance(bit, bool):
            where = f"partition: mask at {path_str(keypath_to_path(kp))!r}"
            raise wrong_type("E341", where, "True or False", bit, "use st.mask_by_path")
        dtype = getattr(x, "dtype", None)
        if bit and (dtype is None or not jnp.issubdtype(dtype, jnp.inexact)):
            where = f"partition: {path_str(keypath_to_path(kp))!r}"
            found = type(x).__name__ if dtype is None else f"{dtype}{list(getattr(x, 'shape', ()))}"
            fix = "mask float leaves only (the adapters: 'lora/*/[ab]'); keep the rest frozen"
            raise error("E341", where, expected="a float array to train", found=found, fix=fix)
        train.append(x if bit else None)
        frozen.append(None if bit else x)
    return Partition(jtu.tree_unflatten(treedef, train), jtu.tree_unflatten(treedef, frozen))


def combine(trainable: Any, frozen: Any) -> Any:
    """The tree :func:`partition` split: each leaf from whichever of the two holds it.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"a": np.ones(2), "b": st.Tied("a"), "n": np.arange(2)}
        >>> st.combine(*st.partition(tree, st.mask_by_path(tree, "a")))
        {'a': array([1., 1.]), 'b': Tied('a'), 'n': array([0, 1])}
    """
    pick = lambda t, f: f if t is None else t  # noqa: E731
    with flattening(trainable):
        return jtu.tree_map(pick, trainable, frozen, is_leaf=lambda x: x is None or is_tied(x))
