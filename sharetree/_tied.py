"""``Tied``: a leafless pytree node that stands where a shared value goes; key paths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import jax
import jax.tree_util as jtu

from sharetree._errors import TieError
from sharetree._transforms import Transform, check_transform, identity

__all__ = ["Tied", "Path", "PathLike", "to_path", "path_str", "key_name", "keypath_to_path"]

Path = tuple[str, ...]
"""A normalised path: a tuple of key names (dict keys, indices and attribute names as str)."""

PathLike = Union[str, Sequence[Any]]  # noqa: UP007 - a runtime alias
"""A ``/``-joined string (``"encoder/kernel"``) or a tuple of keys (``("encoder", "kernel")``)."""


def to_path(ref: Any, what: str = "path") -> Path:
    """Normalise ``"a/b/0"`` or ``("a", "b", 0)`` to ``("a", "b", "0")``.

    Example:
        >>> from sharetree._tied import to_path
        >>> to_path("layers/0/w"), to_path(("a/b", 1))
        (('layers', '0', 'w'), ('a/b', '1'))
    """
    if isinstance(ref, int) and not isinstance(ref, bool):
        ref = (ref,)
    if isinstance(ref, str):
        parts = tuple(ref.split("/")) if ref else ()
    elif isinstance(ref, (tuple, list)):
        for k in ref:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TieError(
                    f"{what} {tuple(ref)!r}: keys must be str or int, "
                    f"found {type(k).__name__} {k!r}. Fix: use the key's name or index."
                )
        parts = tuple(k if isinstance(k, str) else str(k) for k in ref)
    else:
        raise TieError(
            f"{what}: expected a '/'-joined string or a tuple of keys, found "
            f"{type(ref).__name__} {ref!r}. "
            "Fix: write it as 'encoder/kernel' or ('encoder', 'kernel')."
        )
    if not parts or any(p == "" for p in parts):
        raise TieError(
            f"{what} {ref!r} has an empty key. Fix: name a path below the root, such as "
            "'encoder/kernel' (a tie at or to the root is not allowed)."
        )
    return parts


def path_str(path: Path) -> str:
    """The display form of a path: ``a/b/0``, or a tuple when a key contains ``/``."""
    if not path:
        return "<root>"
    if any("/" in k for k in path):
        return repr(path)
    return "/".join(path)


def key_name(key: Any) -> str:
    """The name of one ``jax.tree_util`` key entry, as used in sharetree paths."""
    if isinstance(key, jtu.DictKey):
        return str(key.key)
    if isinstance(key, jtu.SequenceKey):
        return str(key.idx)
    if isinstance(key, jtu.GetAttrKey):
        return key.name
    if isinstance(key, jtu.FlattenedIndexKey):
        return str(key.key)
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def keypath_to_path(keypath: Sequence[Any]) -> Path:
    """Convert a ``jax.tree_util`` key path to a sharetree path."""
    return tuple(key_name(k) for k in keypath)


class Tied:
    """A view of another position in the same tree: ``transform(value at ref)``.

    ``Tied`` is a pytree node with **no children**: ``ref`` and ``transform``
    are static aux data. ``jax.tree.map``, ``jax.grad``, optax, ``device_put``
    and checkpointers therefore never see a duplicated buffer, and pass the
    tie through unchanged. :func:`sharetree.materialize` computes the value.

    Args:
        ref: the path it refers to, ``"encoder/kernel"`` or ``("encoder", "kernel")``.
            It may point at a leaf, a whole subtree, or another ``Tied``
            (chains compose their transforms).
        transform: a sharetree transform applied to the referenced value
            (leaf-wise for a subtree). Defaults to ``identity``.

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> tree = {"enc": np.ones((2, 3)), "dec": st.Tied("enc", st.T)}
        >>> tree["dec"]
        Tied('enc', T)
        >>> jax.tree.leaves(tree)[0].shape, len(jax.tree.leaves(tree))
        ((2, 3), 1)
        >>> st.materialize(tree)["dec"].shape
        (3, 2)
    """

    __slots__ = ("ref", "transform")
    ref: Path
    transform: Transform

    def __init__(self, ref: PathLike, transform: Transform = identity) -> None:
        path = ref if _is_path(ref) else to_path(ref, "Tied ref")
        check_transform(transform, f"of Tied({path_str(path)!r})")
        object.__setattr__(self, "ref", path)
        object.__setattr__(self, "transform", transform)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Tied is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tied):
            return NotImplemented
        return self.ref == other.ref and self.transform == other.transform

    def __hash__(self) -> int:
        return hash((Tied, self.ref, self.transform))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Tied, (self.ref, self.transform))

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Treescope rendering: ref and transform, coloured like the buffer it refers to."""
        from sharetree._display import tied_treescope_repr

        return tied_treescope_repr(self, path, subtree_renderer)

    def __repr__(self) -> str:
        ref = repr(path_str(self.ref)) if not any("/" in k for k in self.ref) else repr(self.ref)
        if self.transform == identity:
            return f"Tied({ref})"
        return f"Tied({ref}, {self.transform!r})"


def _is_path(ref: Any) -> bool:
    return isinstance(ref, tuple) and bool(ref) and all(isinstance(k, str) and k for k in ref)


jax.tree_util.register_pytree_with_keys(
    Tied,
    lambda t: ((), (t.ref, t.transform)),
    lambda aux, children: Tied(*aux),
    flatten_func=lambda t: ((), (t.ref, t.transform)),
)
