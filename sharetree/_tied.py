"""``Tied``: a leafless pytree node that stands where a shared value goes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax

from sharetree._paths import PathLike, Ref, path_str, ref_str, to_ref
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
            from the innermost subtree holding this tie out to the root. A ref that
            starts with ``../`` climbs instead: ``"../0"`` is ``0`` one level above
            the subtree holding the tie, past a nearer ``0``; ``"./w"`` is the sibling
            ``w`` exactly. Such a ref moves with its tree.
        transform: applied to the referenced value (leaf-wise for a subtree).
        up: the climb of a ref given as a tuple of keys (``("a/b",), up=1`` is
            ``"../a/b"``, for keys with ``/`` in them; a key named ``".."`` is a key).

    Example:
        >>> import jax, numpy as np, sharetree as st
        >>> tree = {"enc": np.ones((2, 3)), "dec": st.Tied("enc", st.T)}
        >>> len(jax.tree.leaves(tree)), st.materialize(tree)["dec"].shape
        (1, (3, 2))
        >>> w = np.ones(2)
        >>> st.tie_identical((w, (np.ones(2), w)))[1][1]  # '1/0' shadows the root's '0'
        Tied('../0')
    """

    __slots__ = ("_hash", "ref", "transform", "up")
    ref: tuple[str, ...]
    transform: Transform
    up: int | None
    _hash: int

    def __init__(
        self, ref: PathLike, transform: Transform = identity, *, up: int | None = None
    ) -> None:
        path, up = to_ref(ref, up)
        check_transform(transform, f"of Tied({path_str(path)!r})")
        object.__setattr__(self, "ref", path)
        object.__setattr__(self, "transform", transform)
        object.__setattr__(self, "up", up)
        # hashed at every jit cache lookup of a tree holding it
        object.__setattr__(self, "_hash", hash((Tied, path, transform, up)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Tied is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tied):
            return NotImplemented
        return (self.ref, self.up, self.transform) == (other.ref, other.up, other.transform)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.ref, self.transform, self.up))

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Treescope rendering: ref and transform, coloured like the buffer it refers to."""
        return DISPLAY["tied_treescope"](self, path, subtree_renderer)

    def __repr__(self) -> str:
        spelled = ref_str(Ref(self.ref, self.up))
        args = [repr(spelled)]
        if self.transform != identity:
            args.append(repr(self.transform))
        if self.up is not None and not isinstance(spelled, str):  # keys with '/': a tuple
            args.append(f"up={self.up}")
        return f"Tied({', '.join(args)})"


def _rebuild(ref: tuple[str, ...], transform: Transform, up: int | None = None) -> Tied:
    """A pickled ``Tied`` (its keys taken as keys, the climb as ``up``)."""
    return Tied(ref, transform, up=up)


def is_tied(x: Any) -> bool:
    """Whether ``x`` is a :class:`Tied` (an ``is_leaf`` for tree walks that stop at ties)."""
    return isinstance(x, Tied)


# The aux data is the Tied itself: validated when made and immutable, so unflattening (per Tied
# at every tree map) gives it back as it is.
jax.tree_util.register_pytree_node(Tied, lambda t: ((), t), lambda t, _: t)


def _tied_to_bytes(t: Tied) -> bytes:
    up = {} if t.up is None else {"up": t.up}
    return json.dumps({"ref": list(t.ref), **up, "transform": t.transform.spec()}).encode()


def _tied_from_bytes(data: bytes) -> Tied:  # a spec is read back, never imported or called
    node = json.loads(data)
    return Tied(tuple(node["ref"]), transform_from_spec(node["transform"]), up=node.get("up"))


# jax.export.Exported.serialize of a function taking or returning a canonical tree
jax.export.register_pytree_node_serialization(
    Tied,
    serialized_name="sharetree.Tied",
    serialize_auxdata=_tied_to_bytes,
    deserialize_auxdata=_tied_from_bytes,
)
