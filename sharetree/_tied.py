"""``Tied``: a leafless pytree node that stands where a shared value goes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import jax

from sharetree._errors import error, short, wrong_type
from sharetree._paths import PathLike, Ref, path_str, ref_str, to_ref
from sharetree._transforms import (
    Transform,
    check_inputs,
    check_transform,
    identity,
    transform_from_spec,
)

__all__ = ["Tied", "is_tied", "DISPLAY"]

# renderers that sharetree._display registers on import, so lower layers never import it
DISPLAY: dict[str, Callable[..., Any]] = {}


class Tied:
    """A view of other positions in the same tree: ``transform(value at ref)``.

    An immutable pytree node with **no children** (its refs and transform are
    aux data, checked once), so tree maps, ``jax.grad``, optax and
    checkpointers never see a duplicated buffer. :func:`sharetree.materialize`
    computes the value.

    Args:
        ref: the path it refers to, ``"encoder/kernel"`` or ``("encoder", "kernel")``:
            a leaf, a subtree or another ``Tied`` (chains compose), looked up
            from the innermost subtree holding this tie out to the root. A ref that
            starts with ``../`` climbs instead: ``"../0"`` is ``0`` one level above
            the subtree holding the tie, past a nearer ``0``; ``"./w"`` is the sibling
            ``w`` exactly. Such a ref moves with its tree. A dict ``{name: ref}``
            makes a view of several positions: the transform (one that takes several
            inputs, such as :func:`sharetree.lora`) receives ``{name: value}``, leaf by
            leaf where the inputs are subtrees of one structure.
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
        >>> st.Tied({"a": "x", "b": "y"}, st.add())
        Tied({'a': 'x', 'b': 'y'}, add)
    """

    __slots__ = ("_hash", "refs", "transform")
    refs: tuple[tuple[str | None, Ref], ...]
    """Each input's name and ref: ``((None, ref),)`` for one ref, sorted by name for several."""
    transform: Transform
    _hash: int

    def __init__(
        self,
        ref: PathLike | Mapping[str, PathLike],
        transform: Transform = identity,
        *,
        up: int | None = None,
    ) -> None:
        refs: tuple[tuple[str | None, Ref], ...]
        if isinstance(ref, Mapping):
            refs = _named_refs(ref, up)
            shown = f"{{{', '.join(repr(n) for n, _ in refs)}}}"
        else:
            refs = ((None, to_ref(ref, up)),)
            shown = repr(path_str(refs[0][1].keys))
        check_transform(transform, f"of Tied({shown})")
        check_inputs(transform, tuple(n for n, _ in refs), shown)
        object.__setattr__(self, "refs", refs)
        object.__setattr__(self, "transform", transform)
        # hashed at every jit cache lookup of a tree holding it
        object.__setattr__(self, "_hash", hash((Tied, refs, transform)))

    @property
    def inputs(self) -> tuple[str, ...] | None:
        """The input names of a view of several positions; ``None`` for one ref.

        Code that reads the refs iterates :attr:`refs` (one ref is the input named
        ``None``) and rewrites them with :meth:`with_refs`, without asking which it is.
        """
        names = tuple(n for n, _ in self.refs)
        return None if names == (None,) else names  # type: ignore[return-value]

    def with_refs(self, refs: Mapping[str | None, Ref]) -> Tied:
        """This view, its transform unchanged, reading ``refs`` ``{name: Ref}`` instead.

        The names are this view's (``None`` for its one ref), so one ref stays one ref.

        >>> import sharetree as st
        >>> from sharetree._paths import Ref
        >>> t = st.Tied("w", st.T)
        >>> t.with_refs({n: Ref(("enc", *r.keys), None) for n, r in t.refs})
        Tied('enc/w', T)
        """
        if set(refs) != {n for n, _ in self.refs}:
            names = sorted(map(str, refs))
            fix = "name each input as the view does (its refs' names)"
            raise error(
                "E167", repr(self), "rewritten with other inputs", found=str(names), fix=fix
            )
        return _from_refs(tuple(sorted(refs.items(), key=_by_name)), self.transform)

    @property
    def ref(self) -> tuple[str, ...]:
        """The keys of the one ref (a view of several positions has :attr:`refs` instead)."""
        return self._one().keys

    @property
    def up(self) -> int | None:
        """How far the one ref climbs (``None``: looked up by scope)."""
        return self._one().up

    def _one(self) -> Ref:
        (name, ref), *more = self.refs
        if name is not None or more:
            fix = "read t.refs, its (name, ref) pairs"
            raise wrong_type("E166", "Tied.ref", "a Tied of one ref", self, fix)
        return ref

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Tied is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tied):
            return NotImplemented
        return (self.refs, self.transform) == (other.refs, other.transform)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (_from_refs, (self.refs, self.transform))

    def _not_a_value(self, use: str) -> Any:
        """E240: a ``Tied`` reached code that wanted its value (a layer, ``jnp``, NumPy)."""
        problem = f"was {use}, but a Tied stands for a value it does not hold"
        fix = (
            "call st.materialize(tree) on the model or tree (inside the step, under "
            "jit/grad/scan) and pass what it returns to the layer"
        )
        raise error("E240", f"{self!r}", problem, expected="an array", found="a Tied", fix=fix)

    def __getitem__(self, index: Any) -> Any:
        return self._not_a_value("indexed")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._not_a_value("converted to a NumPy array")

    def __jax_array__(self) -> Any:
        return self._not_a_value("converted to a JAX array")

    def _operand(self, other: Any) -> Any:
        return self._not_a_value("an operand of an array operation")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _operand
    __matmul__ = __rmatmul__ = __truediv__ = __rtruediv__ = __pow__ = __rpow__ = _operand

    def __neg__(self) -> Any:
        return self._not_a_value("an operand of an array operation")

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Treescope rendering: ref and transform, coloured like the buffer it refers to."""
        return DISPLAY["tied_treescope"](self, path, subtree_renderer)

    def __repr__(self) -> str:
        named = {n: ref_str(r) for n, r in self.refs}
        args = [repr(named.pop(None)) if None in named else repr(named)]
        if self.transform != identity:
            args.append(repr(self.transform))
        args += [
            f"up={r.up}" for _, r in self.refs if r.up is not None and isinstance(ref_str(r), tuple)
        ]
        return f"Tied({', '.join(args)})"


def _named_refs(refs: Mapping[Any, Any], up: Any) -> tuple[tuple[str | None, Ref], ...]:
    """The ``(name, Ref)`` pairs of a dict of refs, sorted by name, each checked."""
    where = f"Tied({short(dict(refs), 80)})"
    if up is not None:
        fix = "climb in each ref's string ('../w'); up= is for one ref"
        raise error("E167", where, "has up= and several refs", found=f"up={up}", fix=fix)
    if not refs:
        fix = "name at least one input: Tied({'base': 'w', ...}, transform)"
        raise error("E167", where, "has no refs", expected="a dict {name: ref}", fix=fix)
    bad = next((n for n in refs if not isinstance(n, str) or not n.isidentifier()), None)
    if bad is not None:
        fix = "name each input with the name its transform takes ('base', 'a', 'b')"
        raise wrong_type("E167", f"{where}: input name", "a str identifier", bad, fix)

    def read(name: str) -> Ref:
        r, what = refs[name], f"Tied ref {name!r}"
        return to_ref(r.keys, r.up, what) if isinstance(r, Ref) else to_ref(r, None, what)

    return tuple((n, read(n)) for n in sorted(refs))


def _by_name(item: tuple[str | None, Ref]) -> str:
    return "" if item[0] is None else item[0]


def _from_refs(refs: tuple[tuple[str | None, Ref], ...], transform: Transform) -> Tied:
    """The ``Tied`` of ``(name, Ref)`` pairs (a pickle's, a file's): each ref's keys as keys."""
    ((name, ref), *more) = refs
    if name is None and not more:
        return Tied(tuple(ref.keys), transform, up=ref.up)
    return Tied({str(n): Ref(*r) for n, r in refs}, transform)


def _rebuild(ref: tuple[str, ...], transform: Transform, up: int | None = None) -> Tied:
    """A ``Tied`` pickled by an earlier version (its keys taken as keys, the climb as ``up``)."""
    return Tied(ref, transform, up=up)


def _rebuild_named(refs: tuple[tuple[str, Ref], ...], transform: Transform) -> Tied:
    """A ``Tied`` of several refs pickled by an earlier version."""
    return _from_refs(refs, transform)


def is_tied(x: Any) -> bool:
    """Whether ``x`` is a :class:`Tied` (an ``is_leaf`` for tree walks that stop at ties)."""
    return isinstance(x, Tied)


# The aux data is the Tied itself: validated when made and immutable, so unflattening (per Tied
# at every tree map) gives it back as it is.
jax.tree_util.register_pytree_node(Tied, lambda t: ((), t), lambda t, _: t)


def _tied_to_bytes(t: Tied) -> bytes:
    refs = [[n, list(r.keys), r.up] for n, r in t.refs]
    return json.dumps({"refs": refs, "transform": t.transform.spec()}).encode()


def _tied_from_bytes(data: bytes) -> Tied:  # a spec is read back, never imported or called
    node = json.loads(data)
    transform = transform_from_spec(node["transform"])
    if "ref" in node:  # written before views of several positions
        return Tied(tuple(node["ref"]), transform, up=node.get("up"))
    return _from_refs(tuple((n, Ref(tuple(k), u)) for n, k, u in node["refs"]), transform)


# jax.export.Exported.serialize of a function taking or returning a canonical tree
jax.export.register_pytree_node_serialization(
    Tied,
    serialized_name="sharetree.Tied",
    serialize_auxdata=_tied_to_bytes,
    deserialize_auxdata=_tied_from_bytes,
)
