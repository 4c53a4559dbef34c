"""Flax NNX integration: ``tie`` a module in place, ``split(model, *filters, ties=...)``, ``merge``.

``tie`` puts each ``Tied`` into its Variable (the kind and metadata stay), for graph and
tree mode (``nnx.set_graph_mode(False)``); ``split`` / ``merge`` / ``update`` are graph mode's
``nnx.split`` / ``nnx.merge`` / ``nnx.update`` with ties in the state.

Import it explicitly (``import sharetree`` never needs flax); see
docs/integrations.md, "Flax NNX".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

try:
    from flax import nnx
    from flax.nnx import graph as graphlib  # (flax.nnx.graphlib is flax >= 0.12.5 only)
except ImportError as e:  # pragma: no cover - exercised only without flax
    raise ImportError("sharetree.nnx needs Flax: pip install 'sharetree[flax]'") from e

import jax.tree_util as jtu

from sharetree._errors import TieError, add_context, check_mapping, error, wrong_type
from sharetree._materialize import materialize
from sharetree._paths import (
    Path,
    Ref,
    TieMap,
    closest,
    from_root,
    node_paths,
    path_str,
    prefixes,
)
from sharetree._resolve import nodes_at, structure_of
from sharetree._tie import tie as tie_tree
from sharetree._tie import tie_entries
from sharetree._tied import Tied

__all__ = ["GraphDef", "split", "merge", "update", "tie"]

_TIES_FIX = "split(model, ties={'dec/kernel': st.Tied('enc/kernel', st.T)})"

RawPath = tuple[Any, ...]
"""A path with NNX's own keys (attribute names and list indices as ints)."""


def _str_path(raw: RawPath) -> Path:
    """``raw`` with every key a string, as sharetree paths are."""
    return tuple(str(k) for k in raw)


@dataclasses.dataclass(frozen=True)
class GraphDef:
    """The static part of a tied NNX model: ``nnx.GraphDef`` plus its shared Variables (hashable).

    Attributes:
        graphdef: the ``nnx.GraphDef`` of the model.
        aliases: ``(state index, alias path, owner path)`` for each extra place
            where the model holds the Variable object at ``owner``; the
            canonical state has ``Tied(owner)`` at ``alias``.
        num_states: how many states ``split`` returned (one per filter).

    Example:
        >>> import sharetree as st, sharetree.nnx
        >>> from flax import nnx
        >>> class TwoHeads(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.a = nnx.Linear(4, 2, rngs=rngs)
        ...         self.b = nnx.Linear(4, 2, rngs=rngs)
        ...         self.b.kernel = self.a.kernel  # one Variable object in two places
        >>> st.nnx.split(TwoHeads(nnx.Rngs(0)))[0]
        sharetree.nnx.GraphDef(GraphDef, num_states=1, aliases=['b/kernel' is 'a/kernel'])
    """

    graphdef: Any
    aliases: tuple[tuple[int, Path, Path], ...] = ()
    num_states: int = 1

    def __repr__(self) -> str:
        aliases = ", ".join(f"{path_str(a)!r} is {path_str(o)!r}" for _, a, o in self.aliases)
        return (
            f"sharetree.nnx.GraphDef({type(self.graphdef).__name__}, "
            f"num_states={self.num_states}, aliases=[{aliases}])"
        )


def _variable_positions(model: Any) -> dict[int, list[RawPath]]:
    """Every path (NNX keys) at which the model holds each Variable object, by ``id``.

    ``nnx.iter_graph`` and ``nnx.find_duplicates`` do not enter a shared node
    twice, so this walks the children as ``nnx.split`` does, at every path.
    """
    found: dict[int, list[RawPath]] = {}

    def visit(node: Any, path: RawPath, ancestors: frozenset[int]) -> None:
        impl = graphlib.get_node_impl(node)
        if impl is None:
            return
        for key, child in impl.node_dict(node).items():
            if isinstance(child, nnx.Variable):
                found.setdefault(id(child), []).append((*path, key))
            elif graphlib.is_node(child) and id(child) not in ancestors:
                visit(child, (*path, key), ancestors | {id(child)})

    visit(model, (), frozenset({id(model)}))
    return found


def _flat(state: Any) -> list[tuple[RawPath, Any]]:
    """(NNX path, Variable or Tied) at every Variable position of a state, sorted by path."""
    if not isinstance(state, (nnx.State, Mapping)):
        fix = "pass split the model, and merge the graphdef and states that split returned"
        raise wrong_type("E69", "sharetree.nnx", "an NNX state (nnx.State or a dict)", state, fix)
    return list(nnx.to_flat_state(state if isinstance(state, nnx.State) else nnx.State(state)))


def _strip_value(path: Path, variables: Mapping[Path, Any]) -> Path:
    """``path`` without a last ``"value"`` key after a Variable's path (``"dec/kernel/value"``)."""
    return path[:-1] if len(path) > 1 and path[-1] == "value" and path[:-1] in variables else path


class _StateTie(NamedTuple):
    """A tie of ``split``'s ``ties=`` as written into one state (its paths from the root)."""

    state: int  # the index of the state it is in
    path: Path  # where the Tied goes
    tied: Tied


def _rooted(
    path: Path, t: Tied, where: Mapping[Path, Any], fn: str = "split"
) -> dict[str | None, Path]:
    """Each ref of the tie at ``path`` as a path from the root (``"value"`` stripped), or E163."""
    out = {}
    for name, ref in t.refs:
        rooted = from_root(path, Ref(_strip_value(ref.keys, where), ref.up))
        if rooted is None:  # a climb past the root
            at = f"sharetree.nnx.{fn}: the tie {path_str(path)!r} <- {t!r}"
            at += "" if name is None else f", input {name!r}"
            raise error("E163", at, f"climbs {ref.up} levels", fix="climb fewer levels")
        out[name] = rooted
    return out


def _nnx_tie(
    path: Path,
    t: Tied,
    where: Mapping[Path, int],
    nodes: Collection[Path],
    aliases: Mapping[Path, tuple[int, Path]],
) -> _StateTie | None:
    """The tie at ``path`` with its refs from the root, checked; ``None``: an identity tie already.

    A view of several positions reads the ``value`` leaf of each Variable it names (the
    inputs may be Variables of other kinds, ``Param`` and ``LoRAParam``) and is written at
    the target Variable's ``value``: the target keeps its own kind and metadata.
    """
    refs = _rooted(path, t, where)
    t = t.with_refs({n: Ref(r, None) for n, r in refs.items()})
    named = f"sharetree.nnx.split: the tie {path_str(path)!r} <- {t!r}"
    fix = "write the path as NNX prints the state, naming the Variable ('dec/kernel')"
    if path not in nodes:
        near = closest(path_str(path), map(path_str, nodes))
        raise error("E5", named, f"names {path_str(path)!r}, not in the NNX state; {near}", fix=fix)
    for name, ref in refs.items():
        if ref not in nodes:
            near = closest(path_str(ref), map(path_str, nodes))
            input_ = "" if name is None else f"its input {name!r} "
            what = f"{input_}names {path_str(ref)!r}, not in the NNX state; {near}"
            raise error("E1", named, what, fix=fix)

    def states(r: Path) -> set[int]:
        return {i for p, i in where.items() if p[: len(r)] == r}

    spans = set().union(*map(states, [path, *refs.values()]))
    if len(spans) > 1:
        read = [(f"input {n!r}" if n else "its ref", r) for n, r in refs.items()]
        found = "; ".join(
            f"{label} {path_str(r)!r} in state {', '.join(map(str, sorted(states(r))))}"
            for label, r in [("the view", path), *read]
        )
        fix = "split with one filter and freeze inputs with st.mask_by_path, or change the filters"
        expected = "the view and every input in one state"
        raise error(
            "E180", named, f"spans states {sorted(spans)}", expected=expected, found=found, fix=fix
        )
    if path in aliases and t == Tied(aliases[path][1]):
        return None  # already this identity tie
    for a, (_, owner) in aliases.items():
        if a[: len(path)] == path or path[: len(a)] == a:
            what = f"{path_str(a)!r} is the same Variable object as {path_str(owner)!r}"
            fix = f"tie {path_str(owner)!r} instead, or build the model with two Variables"
            raise error("E181", named, f"meets an identity tie: {what}", fix=fix)
    if t.inputs is not None and path in where:
        value = {n: r + ("value",) if r in where else r for n, r in refs.items()}
        return _StateTie(spans.pop(), path + ("value",), Tied(value, t.transform))  # type: ignore[arg-type]
    return _StateTie(spans.pop(), path, t)


def split(model: Any, *filters: Any, ties: TieMap | None = None, check: bool = True) -> Any:
    """``nnx.split`` with ties: ``(graphdef, state, *more_states)``, each state canonical.

    Args:
        model: an NNX module (or any NNX graph node).
        *filters: NNX filters as for ``nnx.split`` (one state per filter).
        ties: ``{target: ref or Tied(ref, transform)}`` with paths as NNX prints
            them; a target may name a submodule. ``None`` only records shared Variables.
        check: require each view to have the shape and dtype of the Variable it replaces.

    Raises:
        TieError: a target or ref missing from the state, a tie across two
            states, a target that is the same object as another Variable, or
            (with ``check``) a view whose shape or dtype differs.

    Example:
        >>> import jax.numpy as jnp, sharetree as st, sharetree.nnx
        >>> from flax import nnx
        >>> ties = {"bias": st.Tied("kernel", st.index(0))}
        >>> graphdef, state = st.nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), ties=ties)
        >>> state["bias"]
        Tied('kernel', index(0))
        >>> model = st.nnx.merge(graphdef, state)
        >>> bool(jnp.all(model.bias[...] == model.kernel[0]))
        True
    """
    for f in filters:
        if isinstance(f, Mapping):
            at = "sharetree.nnx.split(model, *filters, ties=None): a filter"
            raise wrong_type("E81", at, "an NNX filter, not a mapping", f, _TIES_FIX)
    graphdef, *states = nnx.split(model, *filters)
    flats = [_flat(s) for s in states]
    owner_state = {raw: i for i, flat in enumerate(flats) for raw, _ in flat}

    # Variable objects the model holds in more than one place: identity ties
    alias_entries: list[tuple[int, RawPath, RawPath]] = []
    for raws in _variable_positions(model).values():
        owners = [r for r in raws if r in owner_state]
        if len(owners) == 1:
            (owner,) = owners
            alias_entries += [(owner_state[owner], r, owner) for r in raws if r != owner]
    alias_entries.sort(key=lambda e: _str_path(e[1]))
    graph_aliases = tuple((i, _str_path(a), _str_path(o)) for i, a, o in alias_entries)
    aliases = {a: (i, o) for i, a, o in graph_aliases}

    # str path -> state index of each Variable (owners and aliases)
    where = {_str_path(r): i for r, i in owner_state.items()} | {a: i for i, a, _ in graph_aliases}
    nodes = node_paths(where)

    if ties is not None:
        check_mapping(ties, "E69", "sharetree.nnx.split(ties=...)", "a mapping or None", _TIES_FIX)
    per_state: list[dict[Path, Tied]] = [{} for _ in states]
    for path, t in tie_entries(ties or {}).items():
        found = _nnx_tie(_strip_value(path, where), t, where, nodes, aliases)
        if found is not None:
            per_state[found.state][found.path] = found.tied

    out = []
    for i, (state, flat) in enumerate(zip(states, flats)):
        extra = [(a, Tied(_str_path(o))) for j, a, o in alias_entries if j == i]
        if extra:
            state = nnx.from_flat_state(flat + extra)
        if per_state[i]:
            try:
                state = tie_tree(state, per_state[i], check=check)
            except TieError as e:
                add_context(e, f"in sharetree.nnx.split, state {i}")
                raise
        out.append(state)
    return (GraphDef(graphdef, graph_aliases, len(states)), *out)


def _to_nnx(graphdef: GraphDef | Any, states: tuple[Any, ...]) -> list[Any]:
    """``[nnx.GraphDef, *plain NNX states]`` of canonical states (views in, aliases out)."""
    if not isinstance(graphdef, GraphDef):
        graphdef = GraphDef(graphdef, (), len(states))
    if len(states) != graphdef.num_states:
        fix = "pass every state split returned, in the same order"
        want = f"{graphdef.num_states} state(s), as split returned"
        raise error("E182", "sharetree.nnx.merge", expected=want, found=str(len(states)), fix=fix)
    out = []
    for i, state in enumerate(states):
        structure = structure_of(jtu.tree_structure(state))
        aliases = {a: o for j, a, o in graphdef.aliases if j == i}
        for a, o in aliases.items():
            found = structure.ties.get(a)
            if found != Tied(o):
                held = nodes_at(state, a)
                what = "nothing" if found is None else repr(found)
                if found is None and held:
                    what = f"a {type(held[0]).__name__} (a materialized or untied state?)"
                where = f"sharetree.nnx.merge: state {i} at {path_str(a)!r}"
                two = f"split(model, ties={{{path_str(a)!r}: {path_str(o)!r}}})"
                fix = f"pass the state split returned; for grad_by_use, two Variables and {two}"
                raise error("E183", where, expected=repr(Tied(o)), found=what, fix=fix)
        flat = []
        for raw, x in _flat(materialize(state)):
            path = _str_path(raw)
            if path in aliases:
                continue  # the graphdef already holds the same object there
            if isinstance(x, nnx.Variable) and any(p in structure.ties for p in prefixes(path)):
                x = x.get_raw_value()  # recreated by nnx.merge from the graphdef's own metadata
            flat.append((raw, x))
        out.append(nnx.from_flat_state(flat))
    return [graphdef.graphdef, *out]


def merge(graphdef: GraphDef | Any, *states: Any) -> Any:
    """Rebuild the model from :func:`split`'s output: materialize the views, then ``nnx.merge``.

    Args:
        graphdef: the :class:`GraphDef` from :func:`split` (or a plain
            ``nnx.GraphDef``, for a state tied with :func:`sharetree.tie`).
        *states: the canonical state(s), as :func:`split` returned them.

    Raises:
        TieError: a wrong number of states, a removed identity tie, or a bad graph.

    Example:
        >>> import jax, jax.numpy as jnp, sharetree as st, sharetree.nnx
        >>> from flax import nnx
        >>> ties = {"bias": st.Tied("kernel", st.index(0))}
        >>> graphdef, state = st.nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), ties=ties)
        >>> loss = lambda s: st.nnx.merge(graphdef, s)(jnp.ones((1, 2))).sum()
        >>> jax.grad(loss)(state)["bias"]  # the kernel's gradient counts both uses
        Tied('kernel', index(0))
    """
    return nnx.merge(*_to_nnx(graphdef, states))


def update(model: Any, graphdef: GraphDef, *states: Any) -> None:
    """Write canonical state(s) into ``model`` in place (``nnx.update`` with ties).

    Example:
        >>> import jax, jax.numpy as jnp, sharetree as st, sharetree.nnx
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> graphdef, state = st.nnx.split(model, ties={"bias": st.Tied("kernel", st.index(0))})
        >>> st.nnx.update(model, graphdef, jax.tree.map(jnp.ones_like, state))
        >>> model.bias[...]
        Array([1., 1.], dtype=float32)
    """
    nnx.update(model, *_to_nnx(graphdef, states)[1:])


def _variables_at(model: Any) -> dict[RawPath, Any]:
    """The Variable object at every path (NNX keys) of the model, shared ones at each path."""
    found: dict[RawPath, Any] = {}

    def visit(node: Any, path: RawPath, ancestors: frozenset[int]) -> None:
        impl = graphlib.get_node_impl(node)
        if impl is None:
            return
        for key, child in impl.node_dict(node).items():
            if isinstance(child, nnx.Variable):
                found[(*path, key)] = child
            elif graphlib.is_node(child) and id(child) not in ancestors:
                visit(child, (*path, key), ancestors | {id(child)})

    visit(model, (), frozenset({id(model)}))
    return dict(sorted(found.items(), key=lambda e: _str_path(e[0])))


def _attribute_paths(paths: Collection[Path], limit: int = 8) -> str:
    """The module's Variable paths as a fix lists them: ``'enc/kernel', ... (12 in all)``."""
    shown = sorted(map(path_str, paths))
    more = f", ... ({len(shown)} in all)" if len(shown) > limit else ""
    return ", ".join(map(repr, shown[:limit])) + more


def _in_module(path: Path, what: str, named: str, variables: Collection[Path]) -> None:
    """E241 unless ``path`` names a Variable or a submodule holding Variables."""
    if path in node_paths(variables):
        return
    near = closest(path_str(path), map(path_str, node_paths(variables)))
    fix = f"name a Variable or submodule by its attribute path: {_attribute_paths(variables)}"
    problem = f"{what} {path_str(path)!r}, which is no Variable or submodule of the module; {near}"
    raise error("E241", named, problem, fix=fix)


def _variable_ties(
    target: Path, t: Tied, variables: Mapping[Path, Any], named: str
) -> dict[Path, Tied]:
    """The tie of a Variable or submodule as ties of each Variable's ``value`` leaf."""
    refs = _rooted(target, t, variables, "tie")
    _in_module(target, "names", named, variables)
    for name, ref in refs.items():
        _in_module(ref, "refers to" if name is None else f"has input {name!r} at", named, variables)

    def under(p: Path) -> list[Path]:
        return sorted(v[len(p) :] for v in variables if v[: len(p)] == p)

    inner = under(target)
    for ref in refs.values():
        if (theirs := under(ref)) != inner:
            miss = sorted(set(inner) ^ set(theirs))[0]
            mine, at = (target, ref) if miss in inner else (ref, target)
            what = f"{path_str(mine + miss)!r} has no counterpart {path_str(at + miss)!r}"
            fix = "tie modules of one layout (the same Variable paths below both), or each Variable"
            raise error(
                "E242", named, "ties submodules that hold different Variables", found=what, fix=fix
            )
    out = {}
    for rel in inner:
        value = {n: Ref(r + rel + ("value",), None) for n, r in refs.items()}
        out[target + rel + ("value",)] = t.with_refs(value)
    return out


def tie(model: Any, ties: TieMap, *, check: bool = True, atol: float | None = None) -> Any:
    """Tie Variables of an NNX module in place: each tied Variable keeps its kind and metadata.

    The ``Tied`` goes *into* the Variable (``Param(value=Tied('enc/kernel/value', T))``), so a
    ``Param`` stays a ``Param`` with its own metadata (partition names, ...): ``nnx.state``,
    ``nnx.split`` / ``nnx.merge``, ``wrt=nnx.Param`` filters, ``nnx.Optimizer`` (one state per
    buffer) and Orbax see the tie, in graph mode and in tree mode (``nnx.set_graph_mode(False)``).
    Call :func:`sharetree.materialize` on the module inside the step, before calling it.

    Args:
        model: an NNX module.
        ties: ``{target: ref or Tied(ref, transform)}`` with attribute paths as NNX prints
            them (``"dec/kernel"``; a trailing ``/value`` is accepted). A path naming a
            submodule ties each Variable below it to the one at the same place below the
            ref (``{"block_1": "block_0"}``).
        check: require each view to have the shape and dtype of the Variable's value it
            replaces.
        atol: as for :func:`sharetree.tie`: ``None`` drops the replaced values unseen; a
            number requires them to equal the view within ``atol``.

    Returns:
        ``model`` itself, tied (the same object, for chaining).

    Raises:
        TieError: a path that names no Variable or submodule (E241), submodules of other
            layouts (E242), a target Variable the model holds in several places (E243), or
            what :func:`sharetree.tie` refuses (a shape or dtype that differs, a cycle, ...);
            nothing is changed then.

    Example:
        >>> import jax.numpy as jnp, sharetree as st, sharetree.nnx
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> tied = st.nnx.tie(model, {"bias": st.Tied("kernel", st.index(0))})
        >>> type(tied.bias).__name__, tied.bias.get_raw_value()
        ('Param', Tied('kernel/value', index(0)))
        >>> bool(jnp.all(st.materialize(model).bias[...] == model.kernel[0]))
        True
    """
    if graphlib.get_node_impl(model) is None or isinstance(model, nnx.Variable):
        fix = "pass an NNX module; for an nnx.State or another pytree use st.tie"
        raise wrong_type("E69", "sharetree.nnx.tie(model, ties)", "an NNX module", model, fix)
    check_mapping(ties, "E69", "sharetree.nnx.tie(ties=...)", "a mapping {target: ref}", _TIES_FIX)
    held = _variables_at(model)
    if not held:  # a dict or list of arrays is a graph node to NNX, but holds no Variable
        fix = "pass an NNX module (its Variables are tied in place); for a pytree use st.tie"
        expected = "an NNX module holding Variables"
        raise wrong_type("E69", "sharetree.nnx.tie(model, ties)", expected, model, fix)
    variables = {_str_path(r): v for r, v in held.items()}
    value_ties: dict[Path, Tied] = {}
    for path, t in tie_entries(ties).items():
        target = _strip_value(path, variables)
        named = f"sharetree.nnx.tie: the tie {path_str(target)!r} <- {t!r}"
        value_ties.update(_variable_ties(target, t, variables, named))
    paths_of: dict[int, list[Path]] = {}
    for p, v in variables.items():
        paths_of.setdefault(id(v), []).append(p)
    for p in value_ties:
        if len(others := paths_of[id(variables[p[:-1]])]) > 1:
            named = f"sharetree.nnx.tie: the tie {path_str(p[:-1])!r} <- {value_ties[p]!r}"
            found = "one Variable object at " + ", ".join(repr(path_str(o)) for o in others)
            fix = "build the model with a Variable at each place, then tie them"
            raise error(
                "E243", named, "ties a Variable held in several places", found=found, fix=fix
            )
    state = nnx.from_flat_state(list(held.items()))
    try:
        tied = tie_tree(state, value_ties, check=check, atol=atol)
    except TieError as e:
        add_context(e, "in sharetree.nnx.tie (the module is unchanged)")
        raise
    for p in value_ties:
        (node,) = nodes_at(tied, p)
        variables[p[:-1]].set_raw_value(node)
    return model
