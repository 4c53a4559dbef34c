"""Low-rank adapters on a (tied) tree: :func:`add_lora` and :func:`merge_lora`.

``add_lora`` moves each adapted position's value to ``lora/<path>/base``, next to its two
factors ``a`` and ``b``, and puts a view of the three at the position:
``Tied({"base": ..., "a": ..., "b": ...}, st.lora(scale))``. Every view that read the
position reads the adapted value, so a tied lookup and head see one adapted table.
``merge_lora`` computes each adapted value once and puts it back at its position.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import check_bool, check_mapping, error, short, wrong_type
from sharetree._materialize import expanded_by_path, leaves_and_structure
from sharetree._paths import (
    Path,
    closest,
    flattening,
    keypath_to_path,
    node_paths,
    path_str,
    prefixes,
)
from sharetree._resolve import Structure, ref_to
from sharetree._tied import Tied, is_tied
from sharetree._transforms import dequantize, input_names, lora, parts_of, quantize

__all__ = ["add_lora", "merge_lora", "attach", "adapters_of", "Adapter", "PARAMS", "LORA"]

PARAMS, LORA = "params", "lora"
"""The keys of the tree :func:`add_lora` returns: the adapted tree, and the adapters."""

_TAKES = ("a", "b", "base")
_LORA = type(lora())  # the views add_lora writes start with it
_DEQUANTIZE = type(dequantize(4, 64))  # the base requantize= writes back


class Adapter(NamedTuple):
    """One adapter: its factors ``a`` and ``b`` and its scale, ``base + scale * a @ b``."""

    a: Any
    b: Any
    scale: float


def _matches(pattern: str, path: Path) -> bool:
    """Whether ``pattern`` matches ``path`` or a node above it (as ``label_by_path`` reads it)."""
    return any(fnmatch.fnmatchcase("/".join(p), pattern) for p in prefixes(path))


def _positions(structure: Structure, patterns: list[str]) -> list[Path]:
    """The materialized paths the patterns choose, each one array: a buffer or a whole view."""
    paths = [leaf.path for leaf in structure.expanded]
    chosen = [p for p in paths if any(_matches(q, p) for q in patterns)]
    for q in patterns:
        if not any(_matches(q, p) for p in paths):
            hint = closest(q, [path_str(p) for p in paths])
            where = f"add_lora: pattern {q!r}"
            raise error("E173", where, f"matches no leaf; {hint}", fix="name a leaf's path")
    for p in chosen:
        leaf = structure.expanded[paths.index(p)]
        if leaf.tie is not None and leaf.tie != p:  # a leaf inside a view of a subtree
            where = f"add_lora: {path_str(p)!r}"
            problem = f"is one leaf of the view {path_str(leaf.tie)!r} of a subtree"
            fix = "adapt the buffer it reads, or tie that leaf on its own (st.Tied per leaf)"
            raise error("E173", where, problem, fix=fix)
    return chosen


def add_lora(
    tree: Any,
    where: str | Iterable[str],
    *,
    rank: int,
    key: jax.Array,
    scale: float = 1.0,
) -> dict[str, Any]:
    """Put low-rank adapters on the positions ``where`` chooses; ties kept.

    Each chosen position (a buffer, or a view that is one array) of shape
    ``(..., rows, columns)`` becomes ``base + scale * a @ b``: its value moves to
    ``lora/<path>/base``, ``a`` of shape ``(..., rows, rank)`` starts uniform in
    ``±1/sqrt(rows)`` and ``b`` of ``(..., rank, columns)`` at zero (as LoRA does), so the
    adapted tree computes what the tree did. Every view of an adapted buffer (a tied head)
    sees the adapted value. An adapted view moves to its base; where other views read
    its buffers, neither through it nor as its input, they would not see the adapter,
    so that is E340 (tie them to the view, adapt the buffer, or ``st.untie`` them first).
    Leading axes are a stack: one adapter per layer of a stacked buffer.

    Args:
        tree: a canonical tree (``Tied`` nodes allowed).
        where: path patterns, as :func:`sharetree.label_by_path` reads them, each
            matching at least one leaf of the materialized tree.
        rank: the rank of each adapter (an int >= 1).
        key: a ``jax.random`` key for the ``a`` factors.
        scale: the adapter's scale (LoRA's ``alpha / rank``).

    Returns:
        ``{"params": adapted tree, "lora": {path...: {"base", "a", "b"}}}``: pass
        ``st.materialize(out)["params"]`` to the model, freeze the bases with
        ``st.mask_by_path(out, "lora/*/[ab]")`` (the trainable factors), and merge with
        :func:`merge_lora`.

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> params = {"embed": np.ones((10, 4), np.float32), "head": st.Tied("embed", st.T)}
        >>> out = st.add_lora(params, "embed", rank=2, key=jax.random.key(0))
        >>> out["params"]["embed"]
        Tied({'a': 'lora/embed/a', 'b': 'lora/embed/b', 'base': 'lora/embed/base'}, lora)
        >>> m = st.materialize(out)["params"]
        >>> bool((m["head"] == m["embed"].T).all()), out["lora"]["embed"]["a"].shape
        (True, (10, 2))
    """
    many = isinstance(where, Iterable) and not isinstance(where, (bytes, dict))
    patterns = [where] if isinstance(where, str) else list(where) if many else []
    if not patterns or not all(isinstance(p, str) for p in patterns):
        fix = "pass 'embed' or ['embed', '*/kernel']"
        raise wrong_type("E173", "add_lora(where=...)", "path patterns (str)", where, fix)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise wrong_type("E174", "add_lora(rank=...)", "an int >= 1", rank, "pass rank=8")
    _check_key(key)
    leaves, structure = leaves_and_structure(tree)
    chosen = _positions(structure, patterns)
    check_untie(structure, chosen, "add_lora")
    values = expanded_by_path(tree)
    buffers = dict(zip(structure.buffer_paths, leaves, strict=True))
    adapters: dict[Path, dict[str, Any]] = {}
    keys = jax.random.split(key, len(chosen))
    for k, p in zip(keys, chosen, strict=True):
        value = values[p]
        shape, dtype = tuple(np.shape(value)), getattr(value, "dtype", None)
        if len(shape) < 2 or dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            where_ = f"add_lora {path_str(p)!r}"
            found = f"{short(value, 40)}" if dtype is None else f"{dtype}{list(shape)}"
            fix = "choose matrices (or stacks of them) of floats; narrow the pattern"
            expected = "a float array of 2 or more axes"
            raise error("E174", where_, expected=expected, found=found, fix=fix)
        *lead, rows, cols = shape
        if not rows or not cols:
            where_ = f"add_lora {path_str(p)!r}"
            fix = "adapt a matrix with rows and columns; narrow the pattern"
            found = f"{dtype}{list(shape)}"
            expected = "a matrix of at least one row and one column"
            raise error("E174", where_, "is empty", expected=expected, found=found, fix=fix)
        bound = 1.0 / math.sqrt(rows)
        a = jax.random.uniform(k, (*lead, rows, rank), dtype, -bound, bound)
        b = jnp.zeros((*lead, rank, cols), dtype)
        # a buffer moves; an adapted view moves with its refs rewritten
        adapters[p] = {"a": a, "b": b, "base": structure.ties.get(p, buffers.get(p))}
    return _assemble(tree, structure, adapters, dict.fromkeys(adapters, scale))


def attach(tree: Any, adapters: dict[Path, Adapter], where: str) -> dict[str, Any]:
    """``add_lora``'s structure with the given adapters at their positions (a loaded adapter).

    Each position must be one array of the materialized tree (a buffer or a whole view);
    the factors' shapes are checked by the caller, the ties by :func:`check_untie`.
    """
    leaves, structure = leaves_and_structure(tree)
    check_untie(structure, list(adapters), where)
    buffers = dict(zip(structure.buffer_paths, leaves, strict=True))
    moved = {
        p: {"a": f.a, "b": f.b, "base": structure.ties.get(p, buffers.get(p))}
        for p, f in adapters.items()
    }
    return _assemble(tree, structure, moved, {p: f.scale for p, f in adapters.items()})


def _bases(structure: Structure, at: Path) -> tuple[set[Path], set[Path]]:
    """The buffers the view ``at`` reads (through views) and the views it reads on the way."""
    buffers: set[Path] = set()
    views: set[Path] = set()
    todo = list(structure.reads[at].values())
    while todo:
        r = todo.pop()
        if r in structure.ties:
            if r not in views:
                views.add(r)
                todo.extend(structure.reads[r].values())
            continue
        buffers.update(b for b in structure.buffer_paths if b[: len(r)] == r)
    return buffers, views


def check_untie(structure: Structure, chosen: list[Path], where: str) -> None:
    """E340 where adapting a view would untie it from another view of the same buffers.

    An adapted view moves to its base; a view that reads the same buffers, but neither
    through the adapted one nor as its input, would not see the adapter: a silent untie.
    """
    for p in chosen:
        if p not in structure.ties:
            continue
        mine, inputs = _bases(structure, p)
        others = []
        for q in structure.ties:
            if q == p or q in inputs:
                continue
            theirs, through = _bases(structure, q)
            if p not in through and theirs & mine:
                others.append(q)
        if others:
            shown = ", ".join(repr(path_str(q)) for q in others[:4])
            read = ", ".join(repr(path_str(b)) for b in sorted(mine)[:3])
            problem = f"is a view of {read}, which the views {shown} read too"
            problem += "; adapting it alone would untie them from it"
            fix = f"tie them to {path_str(p)!r} (st.Tied({path_str(p)!r}, ...)) so they read the "
            fix += (
                "adapted value, adapt the buffer, or st.untie them first to adapt this view alone"
            )
            raise error("E340", f"{where}: {path_str(p)!r}", problem, fix=fix)


def _check_key(key: Any) -> None:
    """E290 unless ``key`` is a JAX PRNG key: typed (``jax.random.key``) or raw uint32[2]."""
    if isinstance(key, (jax.Array, np.ndarray)):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return
        if key.dtype == np.uint32 and key.shape == (2,):
            return  # jax.random.PRNGKey's raw form
    found = f"{key.dtype}{list(key.shape)}" if hasattr(key, "dtype") else None
    fix = "pass key=jax.random.key(0) (one key; add_lora splits it per position)"
    raise wrong_type("E290", "add_lora(key=...)", "one JAX PRNG key", key, fix, found=found)


def _assemble(
    tree: Any,
    structure: Structure,
    adapters: dict[Path, dict[str, Any]],
    scales: dict[Path, float],
) -> dict[str, Any]:
    """``{"params": tree with the views, "lora": the adapters}``, refs written for their place."""
    new_paths = {p: (PARAMS, *p) for p in adapters}
    lora_paths = {p: {n: (LORA, *p, n) for n in _TAKES} for p in adapters}
    positions = [(PARAMS, *p) for p in structure.buffer_paths if p not in adapters]
    positions += [(PARAMS, *p) for p in structure.ties]
    positions += [q for named in lora_paths.values() for q in named.values()]
    nodes = node_paths(positions)

    def moved(old: Path, at: Path, t: Tied) -> Tied:
        """The view ``t`` that was at ``old`` in ``tree``, written for ``at`` instead."""
        reads = structure.reads[old]
        return t.with_refs({n: ref_to((PARAMS, *reads[n]), at, nodes) for n, _ in t.refs})

    def visit(kp: Any, x: Any) -> Any:
        p = keypath_to_path(kp)
        if p in adapters:
            refs = {n: ref_to(q, new_paths[p], nodes) for n, q in lora_paths[p].items()}
            return Tied(refs, lora(scales[p]))
        return x

    with flattening(tree):
        params = jtu.tree_map_with_path(visit, tree, is_leaf=is_tied)
    nested: dict[str, Any] = {}
    for p, named in adapters.items():
        node = nested
        for key in p:
            node = node.setdefault(key, {})
        for n, v in named.items():
            node[n] = moved(p, (LORA, *p, n), v) if isinstance(v, Tied) else v
    return {PARAMS: params, LORA: nested}


def _adapted(structure: Structure) -> dict[Path, Tied]:
    """The positions (under ``params``) that are ``add_lora``'s views of their own adapter."""
    merged: dict[Path, Tied] = {}
    for at, t in structure.ties.items():
        if at[0] != PARAMS or input_names(t.transform) != _TAKES:
            continue
        if type(parts_of(t.transform)[0]) is not _LORA or structure.reads[at] != {
            n: (LORA, *at[1:], n) for n in _TAKES
        }:
            continue
        merged[at] = t
    return merged


def adapters_of(adapted: Any) -> tuple[Structure, dict[Path, Tied]]:
    """The structure of ``add_lora``'s output and its adapted positions (under ``params``)."""
    _, structure = leaves_and_structure(adapted)
    return structure, _adapted(structure)


def merge_lora(adapted: Any, *, requantize: bool = False) -> Any:
    """The tree :func:`add_lora` adapted, each adapter merged: ties kept, one tensor per buffer.

    Each adapted position gets its adapted value, computed once (``base + scale * a @ b``,
    as the model saw it): an adapted buffer is that tensor again and every view of it
    reads it; an adapted view becomes a buffer holding its value (its buffer's other
    readers never saw its adapter).

    With ``requantize=True``, every adapted position must be a quantized table (QLoRA):
    a ``st.dequantize(bits, group_size)`` view of a packed ``q``, ``scales``, ``biases``
    that nothing else reads. Its merged value is quantized again with the same sizes
    (:func:`sharetree.quantize`) into those three buffers, and the position stays their
    ``dequantize`` view, so the tree keeps one packed table (its views, a tied head, read
    the re-quantized table). Anything else is E208.

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> params = {"embed": np.ones((10, 4), np.float32), "head": st.Tied("embed", st.T)}
        >>> merged = st.merge_lora(st.add_lora(params, "embed", rank=2, key=jax.random.key(0)))
        >>> merged["head"], merged["embed"].shape
        (Tied('embed', T), (10, 4))
    """
    check_mapping(adapted, "E175", "merge_lora", "the dict add_lora returns")
    if set(adapted) != {PARAMS, LORA}:
        found = f"keys {sorted(map(str, adapted))}"
        fix = "pass what add_lora returned, {'params': ..., 'lora': ...}"
        raise error("E175", "merge_lora", expected="keys ['lora', 'params']", found=found, fix=fix)
    _, structure = leaves_and_structure(adapted)
    merged = _adapted(structure)
    used = [
        (at, path_str(r))
        for at, named in structure.reads.items()
        if at not in merged
        for r in named.values()
        if r[0] == LORA
    ]
    if used:
        at, r = used[0]
        where = f"merge_lora: Tied at {path_str(at)!r}"
        fix = "merge before tying other positions to the adapters, or untie those first"
        raise error("E175", where, f"reads {r!r}, which merging removes", fix=fix)
    values = expanded_by_path(adapted)
    if check_bool(requantize, "E208", "merge_lora(requantize=...)"):
        packed = _requantized(adapted, structure, merged, values)
    else:
        packed = {}

    def visit(kp: Any, x: Any) -> Any:
        p = (PARAMS, *keypath_to_path(kp))
        if p in packed:
            return packed[p]
        return values[p] if p in merged else x

    with flattening(adapted[PARAMS]):
        return jtu.tree_map_with_path(visit, adapted[PARAMS], is_leaf=is_tied)


def _requantized(
    adapted: Any, structure: Structure, merged: dict[Path, Tied], values: dict[Path, Any]
) -> dict[Path, Any]:
    """``merge_lora(requantize=True)``: path -> new value of each packed buffer and position.

    Each adapted position's base must be a ``dequantize`` view of buffers no other view
    reads; its merged value is quantized with the same sizes into those buffers, and the
    position becomes the view again, its refs written for where it stands.
    """
    with flattening(adapted[PARAMS]):
        kps = jtu.tree_flatten_with_path(adapted[PARAMS], is_leaf=is_tied)[0]
    nodes = node_paths([keypath_to_path(kp) for kp, _ in kps])
    out: dict[Path, Any] = {}
    fix = "merge to floats (requantize=False), or adapt dequantize views of their own tables"
    for at in merged:
        base_at = (LORA, *at[1:], "base")
        base = structure.ties.get(base_at)
        where = f"merge_lora(requantize=True): {path_str(at[1:])!r}"
        if base is None or type(base.transform) is not _DEQUANTIZE:
            found = "a float buffer" if base is None else repr(base)
            expected = "a base st.Tied({'q': ..., 'scales': ..., 'biases': ...}, st.dequantize())"
            problem = "has no quantized base"
            raise error("E208", where, problem, expected=expected, found=found, fix=fix)
        reads = structure.reads[base_at]
        readers = [
            path_str(other)
            for other, named in structure.reads.items()
            if other != base_at and any(r in reads.values() for r in named.values())
        ]
        if readers:
            shown = ", ".join(repr(r) for r in readers[:3])
            problem = f"reads a packed table that {shown} also read{'s' * (len(readers) == 1)}"
            problem += ": re-quantizing it would change what they compute"
            raise error("E208", where, problem, fix=fix)
        t = base.transform
        table = quantize(values[at], t.bits, t.group_size)  # type: ignore[attr-defined]
        refs: dict[str | None, Any] = {}
        for name, path in reads.items():
            out[path] = table[name]  # type: ignore[literal-required]
            refs[name] = ref_to(path[1:], at[1:], nodes)
        out[at] = Tied(refs, t)  # type: ignore[arg-type]
    return out
