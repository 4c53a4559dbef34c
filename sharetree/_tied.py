"""``Tied``: a leafless pytree node that stands where a shared value goes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax

from sharetree._paths import PathLike, path_key, path_str, to_path
from sharetree._transforms import Transform, check_transform, identity, transform_from_spec

__all__ = ["Tied", "is_tied", "DISPLAY"]

# renderers that sharetree._display registers on import, so lower layers never import it
DISPLAY: dict[str, Callable[..., Any]] = {}


class Tied:
    """A view of another position in the same tree: ``transform(value at ref)``.

    An immutable pytree node with **no children** (``ref`` and ``transform``
    are aux data, checked once), so tree maps, ``jax.grad``, optax and
    checkpointers never see a duplicated buffer. :func:`sharetree.materialize`
    computes the value.

    Args:
        ref: the path it refers to, ``"encoder/kernel"`` or ``("encoder", "kernel")``:
            a leaf, a subtree or another ``Tied`` (chains compose), looked up
            from the innermost subtree holding this tie out to the root.
        transform: applied to the referenced value (leaf-wise for a subtree).

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> tree = {"enc": np.ones((2, 3)), "dec": st.Tied("enc", st.T)}
        >>> len(jax.tree.leaves(tree)), st.materialize(tree)["dec"].shape
        (1, (3, 2))
    """

    __slots__ = ("_hash", "ref", "transform")
    ref: tuple[str, ...]
    transform: Transform
    _hash: int

    def __init__(self, ref: PathLike, transform: Transform = identity) -> None:
        path = to_path(ref, "Tied ref")
        check_transform(transform, f"of Tied({path_str(path)!r})")
        object.__setattr__(self, "ref", path)
        object.__setattr__(self, "transform", transform)
        # hashed at every jit cache lookup of a tree holding it
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


# The aux data is the Tied itself: validated when made and immutable, so unflattening (per Tied
# at every tree map) gives it back as it is.
jax.tree_util.register_pytree_node(Tied, lambda t: ((), t), lambda t, _: t)


def _tied_to_bytes(t: Tied) -> bytes:
    return json.dumps({"ref": list(t.ref), "transform": t.transform.spec()}).encode()


def _tied_from_bytes(data: bytes) -> Tied:  # a spec is read back, never imported or called
    node = json.loads(data)
    return Tied(tuple(node["ref"]), transform_from_spec(node["transform"]))


# jax.export.Exported.serialize of a function taking or returning a canonical tree
jax.export.register_pytree_node_serialization(
    Tied,
    serialized_name="sharetree.Tied",
    serialize_auxdata=_tied_to_bytes,
    deserialize_auxdata=_tied_from_bytes,
)
