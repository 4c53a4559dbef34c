"""``tie``: put ``Tied`` nodes into an existing tree, checking shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.tree_util as jtu

from sharetree._errors import TieError, closest
from sharetree._graph import _fmt, abstract_expanded, structure_of
from sharetree._tied import Path, PathLike, Tied, keypath_to_path, path_str, to_path

__all__ = ["tie"]


def _describe(x: Any) -> str:
    return _fmt(x) if isinstance(x, jax.ShapeDtypeStruct) else f"{type(x).__name__} {x!r}"


def tie(tree: Any, ties: Mapping[PathLike, PathLike | Tied], *, check: bool = True) -> Any:
    """Replace the leaf or subtree at each target path with a ``Tied``.

    Args:
        tree: a pytree (it may already contain ``Tied`` nodes).
        ties: ``{target: ref}`` or ``{target: Tied(ref, transform)}``; paths are
            ``"a/b/0"`` strings or tuples of keys.
        check: also require every view to have exactly the shape and dtype
            (and, for a subtree, the structure) of the value it replaces.

    Returns:
        The canonical tree; the replaced values are dropped (they are now views).

    Raises:
        TieError: a target that does not exist (naming the closest path),
            overlapping targets, a bad graph, or with ``check`` a shape, dtype
            or structure mismatch (showing both).

    Example:
        >>> import numpy as np, sharetree as st
        >>> w = np.ones((2, 3), np.float32)
        >>> tree = {"enc": {"w": w}, "dec": {"w": np.zeros((3, 2), np.float32)}}
        >>> st.tie(tree, {"dec/w": st.Tied("enc/w", st.T)})["dec"]
        {'w': Tied('enc/w', T)}
    """
    if not isinstance(ties, Mapping):
        raise TieError(f"tie: expected a mapping {{target: ref}}, got {type(ties).__name__}.")
    new: dict[Path, Tied] = {}
    for target, ref in ties.items():
        path = to_path(target, "tie target")
        new[path] = ref if isinstance(ref, Tied) else Tied(ref)
    for a in new:
        for b in new:
            if a != b and b[: len(a)] == a:
                raise TieError(
                    f"tie targets {path_str(a)!r} and {path_str(b)!r} overlap: the second lies "
                    f"inside the first, which is replaced as a whole. Fix: keep only {path_str(a)!r}."
                )

    visited: set[Path] = set()
    all_paths: set[str] = set()

    def stop(kp: Any, x: Any) -> bool:
        path = keypath_to_path(kp)
        all_paths.add(path_str(path))
        return path in new

    def replace(kp: Any, x: Any) -> Any:
        path = keypath_to_path(kp)
        if path in new:
            visited.add(path)
            return new[path]
        return x

    out = jtu.tree_map_with_path(replace, tree, is_leaf=stop, is_leaf_takes_path=True)
    missing = [p for p in new if p not in visited]
    if missing:
        all_paths.discard("<root>")
        raise TieError(
            f"tie target {path_str(missing[0])!r} does not exist in the tree; "
            f"{closest(path_str(missing[0]), all_paths)}. Fix: use the path as "
            "jax.tree_util key paths name it, '/'-joined (dict keys, indices, attribute names)."
        )
    structure_of(jtu.tree_structure(out))  # dangling refs, cycles, self-references
    if check:
        _check(tree, out, new)
    return out


def _check(old_tree: Any, new_tree: Any, new: dict[Path, Tied]) -> None:
    old = abstract_expanded(old_tree)
    now = abstract_expanded(new_tree)
    for target, t in new.items():
        n = len(target)
        before = {p[n:]: v for p, v in old.items() if p[:n] == target}
        after = {p[n:]: v for p, v in now.items() if p[:n] == target}
        if before.keys() != after.keys():
            raise TieError(
                f"tie {path_str(target)!r} <- {t!r}: the view's structure differs from the value "
                f"it replaces: view has {sorted(map(path_str, after)) or ['<leaf>']}, "
                f"target has {sorted(map(path_str, before)) or ['<leaf>']}. "
                "Fix: refer to a subtree of the same structure, or tie leaf by leaf."
            )
        for rel, b in before.items():
            a = after[rel]
            same = (
                (a.shape, a.dtype) == (b.shape, b.dtype)
                if isinstance(a, jax.ShapeDtypeStruct) and isinstance(b, jax.ShapeDtypeStruct)
                else type(a) is type(b)
            )
            if not same:
                where = path_str(target + rel)
                raise TieError(
                    f"tie {where!r} <- {t!r}: the view is {_describe(a)} but the value it "
                    f"replaces is {_describe(b)}. Fix: choose a transform that gives "
                    f"{_describe(b)} (e.g. st.T, st.reshape, st.astype), or pass check=False."
                )
