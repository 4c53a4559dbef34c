"""``tie``: put ``Tied`` nodes into an existing tree, checking shapes."""

from __future__ import annotations

import collections
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from sharetree._errors import TieError, TieTypeError, safe_repr
from sharetree._materialize import (
    _transformable,
    abstract_expanded,
    expanded_by_path,
    leaves_and_structure,
    transform_error,
)
from sharetree._paths import (
    Path,
    TieMap,
    aval_of,
    closest,
    format_aval,
    keypath_to_path,
    leaves_with_paths,
    node_paths,
    path_str,
    prefixes,
    to_path,
)
from sharetree._resolve import _nodes_at, ref_to, skeleton, structure_of, treedef_nodes
from sharetree._tied import Tied, is_tied
from sharetree._transforms import canonical_dtype, identity

__all__ = ["tie", "tie_entries", "bit_equal", "check_atol"]


def _shape_of(positions: Mapping[Path, Any]) -> str:
    if not positions:
        return "empty (no leaves, e.g. None)"
    if set(positions) == {()}:
        return "a leaf"
    return "a subtree with leaves " + ", ".join(repr(path_str(p)) for p in sorted(positions))


def _kind(x: Any) -> Any:
    """What ``check=True`` compares: shape and dtype as JAX computes them, else the type."""
    return (x.shape, canonical_dtype(x.dtype)) if isinstance(x, jax.ShapeDtypeStruct) else type(x)


def _describe(x: Any) -> str:
    return format_aval(x) if isinstance(x, jax.ShapeDtypeStruct) else f"{type(x).__name__} {x!r}"


def tie(
    tree: Any,
    ties: TieMap,
    *,
    check: bool = True,
    atol: float | None = None,
) -> Any:
    """Replace the leaf or subtree at each target path with a ``Tied``; the ref's value wins.

    Args:
        tree: a pytree (``Tied`` nodes allowed).
        ties: ``{target: ref}`` or ``{target: Tied(ref, transform)}``; paths are
            ``"a/b/0"`` strings or tuples of keys.
        check: require each view to have the shape and dtype (and, for a
            subtree, the structure) of the value it replaces.
        atol: ``None``: drop the replaced values unseen. A number: require
            ``|replaced value - view| <= atol`` elementwise (``0.0``: equal values;
            ``-0.0`` equals ``0.0``, NaN equals NaN).

    Raises:
        TieError: a missing target, overlapping targets, a bad graph, a
            mismatch (with ``check``), or copies that differ beyond ``atol``.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"enc": {"w": np.ones((2, 3))}, "dec": {"w": np.zeros((3, 2))}}
        >>> st.tie(tree, {"dec/w": st.Tied("enc/w", st.T)})["dec"]
        {'w': Tied('enc/w', T)}
    """
    if not isinstance(ties, Mapping):
        raise TieError(f"tie: expected a mapping {{target: ref}}, got {type(ties).__name__}.")
    if not isinstance(check, (bool, np.bool_)):
        raise TieTypeError(
            f"tie: check must be True or False, found {type(check).__name__} "
            f"{safe_repr(check, 40)}. Fix: leave it out (True: each view must match what it "
            "replaces) or pass check=False."
        )
    if atol is not None:
        atol = check_atol(atol, "tie")
    new = tie_entries(ties)
    for b in new:
        if (a := _under(b[:-1], new)) is not None:
            raise TieError(
                f"tie targets {path_str(a)!r} and {path_str(b)!r} overlap: the second lies "
                "inside the first, which is replaced as a whole. "
                f"Fix: keep only {path_str(a)!r}."
            )

    seen: set[Path] = set()  # every node looked at; a target stops the walk where it is

    def stop(kp: Any, x: Any) -> bool:
        seen.add(path := keypath_to_path(kp))
        return path in new

    new = _from_the_root(tree, new)  # checks first that the tree flattens
    out = jtu.tree_map_with_path(
        lambda kp, x: new.get(keypath_to_path(kp), x), tree, is_leaf=stop, is_leaf_takes_path=True
    )
    missing = [p for p in new if p not in seen]
    if missing:
        raise TieError(
            f"tie target {path_str(missing[0])!r} does not exist in the tree; "
            f"{closest(path_str(missing[0]), {path_str(p) for p in seen if p})}. Fix: use the "
            "path as jax.tree_util key paths name it, '/'-joined (dict keys, indices, attribute "
            "names). If the value is absent on purpose (a checkpoint that omits a tied tensor, "
            "such as a Hugging Face lm_head.weight tied to the input embedding), load the file "
            "with st.load(path, ties={target: ref}), which adds the Tied itself."
        )
    structure_of(jtu.tree_structure(out))  # dangling refs, cycles, self-references
    if check:
        _check(tree, out, new)
    if atol is not None:
        _check_values(tree, out, new, atol)
    return out


def _from_the_root(tree: Any, new: dict[Path, Tied]) -> dict[Path, Tied]:
    """Each ref naming a node from the root, written by ``ref_to`` so that it names it.

    A ref the root lacks, or one naming a node that holds the target, is kept (scoped).
    """
    nodes = node_paths(p for p, _ in leaves_with_paths(tree, is_leaf=is_tied))
    out = {}
    for target, t in new.items():
        from_root = t.ref in nodes and target[: len(t.ref)] != t.ref
        ref = ref_to(t.ref, target, nodes) if from_root else t.ref
        out[target] = t if ref == t.ref else Tied(ref, t.transform)
    return out


def tie_entries(ties: Mapping[Any, Any]) -> dict[Path, Tied]:
    """``{target: ref or Tied}`` as ``{target path: Tied}``; a TieError for two spellings of one."""
    new: dict[Path, Tied] = {}
    for target, ref in ties.items():
        path = to_path(target, "tie target")
        if path in new:
            first = next(k for k in ties if to_path(k) == path)
            raise TieError(
                f"tie targets {first!r} and {target!r} name the same path "
                f"{path_str(path)!r}; one of the two ties would be lost. Fix: keep one entry."
            )
        new[path] = ref if isinstance(ref, Tied) else Tied(ref)
    return new


_CONTAINERS = (dict, list, tuple, type(None), collections.OrderedDict, collections.defaultdict)


def _node_types(subtree: Any) -> list[tuple[type | None, int]]:
    """The containers of ``subtree`` in one order: dict, list, tuple, None; other nodes as one.

    Another node type is no mismatch: a Flax box or an NNX Variable of another kind is
    rebuilt with the target's own (a ``BatchStat`` tied to a ``Param``).
    """
    out = []
    for node in treedef_nodes(jtu.tree_structure(subtree)):
        data = node.node_data()
        kind = None if data is None else data[0] if data[0] in _CONTAINERS else object
        out.append((kind, node.num_nodes))
    return out


def _check(old_tree: Any, new_tree: Any, new: dict[Path, Tied]) -> None:
    old, now = abstract_expanded(old_tree), abstract_expanded(new_tree)
    skeletons = [
        skeleton(leaves_and_structure(x)[1].expanded_treedef) for x in (old_tree, new_tree)
    ]
    for target, t in new.items():
        n = len(target)
        before = {p[n:]: v for p, v in old.items() if p[:n] == target}
        after = {p[n:]: v for p, v in now.items() if p[:n] == target}
        if before.keys() != after.keys():
            raise TieError(
                f"tie {path_str(target)!r} <- {t!r}: the view's structure differs from the value "
                f"it replaces: the view is {_shape_of(after)}, the target is {_shape_of(before)}. "
                "Fix: refer to a subtree of the same structure, or tie leaf by leaf."
            )
        was, view = (_nodes_at(x, target)[0] for x in skeletons)
        if _node_types(was) != _node_types(view):  # other containers: a list for a dict, a None
            raise TieError(
                f"tie {path_str(target)!r} <- {t!r}: the view's structure differs from the value "
                f"it replaces: the view is {safe_repr(jtu.tree_structure(view), 200)}, the target "
                f"is {safe_repr(jtu.tree_structure(was), 200)}. Fix: refer to a subtree of the "
                "same structure (containers and None leaves included), or tie leaf by leaf."
            )
        for rel, b in before.items():
            a = after[rel]
            if _kind(a) != _kind(b):
                where = path_str(target + rel)
                raise TieError(
                    f"tie {where!r} <- {t!r}: the view is {_describe(a)} but the value it "
                    f"replaces is {_describe(b)}. Fix: choose a transform that gives "
                    f"{_describe(b)} (e.g. st.T, st.reshape, st.astype), or pass check=False."
                )


def check_atol(atol: Any, where: str) -> float:
    """``atol`` as a float if it is a real number >= 0 (NumPy's too), else the TieError."""
    if (
        isinstance(atol, (bool, np.bool_))
        or not isinstance(atol, numbers.Real)
        or not float(atol) >= 0
    ):
        raise TieError(
            f"{where}: atol must be a number >= 0, got {type(atol).__name__} "
            f"{safe_repr(atol, 40)}. Fix: pass 0.0 for equal copies or a small tolerance "
            "such as 1e-6."
        )
    return float(atol)


def _under(path: Path, targets: Mapping[Path, Tied]) -> Path | None:
    return next((p for p in prefixes(path) if p in targets), None)


def _concrete(x: Any, where: str) -> np.ndarray:
    why = "a jax.ShapeDtypeStruct, shapes without values"
    try:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)  # typed PRNG keys compare by their key data
        if not isinstance(x, jax.ShapeDtypeStruct):
            return np.asarray(x)
    except Exception as e:  # tracers have no value to compare
        why = type(e).__name__
    raise TieError(
        f"tie {where!r} with atol: the value there is not concrete ({why}); comparing copies "
        "needs real arrays. Fix: call st.tie outside jit/grad, or leave atol=None."
    )


def _abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The elementwise ``|a - b|``, NaN equal to NaN; non-numbers are 0 or inf apart."""
    if not all(x.dtype == np.bool_ or jnp.issubdtype(x.dtype, jnp.number) for x in (a, b)):
        return np.where(a == b, 0.0, np.inf)
    wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    x, y = a.astype(wide), b.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x - y)
    same = (x == y) | (np.isnan(x) & np.isnan(y))  # equal infinities and NaNs count as equal
    return np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))


def bit_equal(a: Any, b: Any) -> bool:
    """Whether two arrays have the same shape, dtype and bytes (one pass, no copies).

    Example:
        >>> import numpy as np
        >>> bit_equal(np.arange(3.0), np.arange(3.0)), bit_equal(np.zeros(2), -np.zeros(2))
        (True, False)
    """
    if a is b:
        return True
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(x.dtype.itemsize)
    if width is None or x.dtype.hasobject:
        return bool(np.array_equal(x, y))
    return bool(np.array_equal(x.view(width), y.view(width)))


def _old_values(old_tree: Any, new: dict[Path, Tied]) -> dict[Path, Any]:
    """The values the ties replace, by path (materialized only if some of them are views)."""
    under = {p: x for p, x in leaves_with_paths(old_tree, is_tied) if _under(p, new) is not None}
    if any(is_tied(x) for x in under.values()):
        with jax.enable_x64(True):  # keep float64 checkpoints in float64 while comparing
            return expanded_by_path(old_tree)
    return under


def _check_values(old_tree: Any, new_tree: Any, new: dict[Path, Tied], atol: float) -> None:
    old = _old_values(old_tree, new)
    leaves, structure = leaves_and_structure(new_tree)
    for leaf in structure.expanded:
        target = _under(leaf.path, new)
        if target is None:
            continue
        where, buffer = path_str(leaf.path), path_str(structure.buffer_paths[leaf.buffer])
        x, before, t = leaves[leaf.buffer], old.get(leaf.path), leaf.transform or identity
        if not (_transformable(x) and _transformable(before)):
            if type(x) is not type(before) or x != before:
                raise TieError(
                    f"tie {where!r} <- {buffer!r}: the copies differ: {where!r} holds "
                    f"{before!r}, {buffer!r} holds {x!r}. Fix: tie without atol to keep "
                    f"{buffer!r}, or the other way round to keep {where!r}."
                )
            continue
        if isinstance(x, jax.ShapeDtypeStruct):
            _concrete(x, buffer)  # raises: shapes without values
        b = _concrete(before, where)
        with jax.enable_x64(True):  # keep float64 checkpoints in float64 while comparing
            try:
                computed = t(x)  # identity(x) is x itself
            except Exception as e:
                raise transform_error(structure, leaf, aval_of(x), e) from e
        view = _concrete(computed, buffer)
        if bit_equal(b, view):
            continue  # the same bits: equal under any atol, no need to look closer
        if view.shape != b.shape:
            raise TieError(
                f"tie {where!r} <- {new[target]!r}: the view of {buffer!r} has shape "
                f"{view.shape} but {where!r} holds shape {b.shape}, so the copies cannot be "
                "compared. Fix: choose a transform that gives the shape of the value it replaces."
            )
        d = _abs_diff(b, view)
        worst = float(d.max()) if d.size else 0.0
        if worst > atol:
            n_bad = int(np.count_nonzero(d > atol))
            seen = repr(buffer) if t == identity else f"{t!r} of {buffer!r}"
            inverse = t.inverse()
            back = (
                f"write the values you want into {buffer!r} ({t!r} has no inverse to tie "
                f"{buffer!r} to {where!r})"
                if inverse is None
                else f"st.tie(tree, {{{buffer!r}: {Tied(where, inverse)!r}}})"
            )
            raise TieError(
                f"tie {where!r} <- {new[target]!r}: the two copies differ: {where!r} and "
                f"{seen} differ by up to {worst:.6g} (max abs difference; {n_bad} of {d.size} "
                f"elements above atol={atol}), so they are not one tied weight. Fix: choose "
                f"which copy wins: without atol, st.tie keeps {buffer!r} and drops {where!r}; "
                f"to keep {where!r} instead, {back}; or raise atol to {worst:.3g} if the "
                "difference is rounding; or leave the two untied."
            )
