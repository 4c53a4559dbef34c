"""``Tied``: a leafless pytree node that stands where a shared value goes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import jax

from sharetree._paths import PathLike, path_key, path_str, to_path
from sharetree._transforms import Transform, check_transform, identity

__all__ = ["Tied", "is_tied", "DISPLAY"]

DISPLAY: dict[str, Callable[..., Any]] = {}
"""Renderers that ``sharetree._display`` registers when it is imported (``import sharetree``
imports it): ``"tied_treescope"``, ``"graph_html"``, ``"graph_dot"``. Lower layers look their
display up here and never import the display layer."""


class Tied:
    """A view of another position in the same tree: ``transform(value at ref)``.

    ``Tied`` is a pytree node with **no children**: ``ref`` and ``transform``
    are static aux data, checked once when the ``Tied`` is made (it is
    immutable: unflattening a tree gives back the very same ``Tied`` objects,
    with nothing checked or built again). ``jax.tree.map``, ``jax.grad``, optax,
    ``device_put`` and checkpointers therefore never see a duplicated buffer, and pass the
    tie through unchanged. :func:`sharetree.materialize` computes the value.

    Args:
        ref: the path it refers to, ``"encoder/kernel"`` or ``("encoder", "kernel")``,
            lexically scoped: looked up from the innermost subtree that holds
            this tie and has the path, then each enclosing one, out to the root.
            So a tied tree means the same standing alone or nested in a bigger
            one (a train state, a bigger model), whatever keys that one has.
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

    __slots__ = ("_hash", "ref", "transform")
    ref: tuple[str, ...]
    transform: Transform
    _hash: int

    def __init__(self, ref: PathLike, transform: Transform = identity) -> None:
        path = ref if _is_path(ref) else to_path(ref, "Tied ref")
        check_transform(transform, f"of Tied({path_str(path)!r})")
        object.__setattr__(self, "ref", path)
        object.__setattr__(self, "transform", transform)
        # hashed at every jit cache lookup of a tree holding it (its treedef's aux data)
        object.__setattr__(self, "_hash", hash((Tied, path, transform)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Tied is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tied):
            return NotImplemented
        return self.ref == other.ref and self.transform == other.transform

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (Tied, (self.ref, self.transform))

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Treescope rendering: ref and transform, coloured like the buffer it refers to."""
        return DISPLAY["tied_treescope"](self, path, subtree_renderer)

    def __repr__(self) -> str:
        ref = repr(path_key(self.ref))
        return f"Tied({ref})" if self.transform == identity else f"Tied({ref}, {self.transform!r})"


def is_tied(x: Any) -> bool:
    """Whether ``x`` is a :class:`Tied` (an ``is_leaf`` for tree walks that stop at ties)."""
    return isinstance(x, Tied)


def _is_path(ref: Any) -> TypeGuard[tuple[str, ...]]:
    return isinstance(ref, tuple) and bool(ref) and all(isinstance(k, str) and k for k in ref)


def _flatten(t: Tied) -> tuple[tuple[()], Tied]:
    return (), t  # the aux data is the (immutable) Tied itself


def _unflatten(t: Tied, children: Any) -> Tied:
    # The Tied was validated when it was made and cannot change: give it back as it is.
    # Every jax.tree.map, jit dispatch and optimizer step over a tied tree runs this per
    # Tied, so it checks and builds nothing.
    return t


jax.tree_util.register_pytree_node(Tied, _flatten, _unflatten)
