import collections
import dataclasses
import pickle

import chex
import equinox as eqx
import flax.struct
import hypothesis.strategies as hs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _raises import raises
from flax.core import FrozenDict
from hypothesis import given

import sharetree as st


def test_leafless_hashable_value_equal_picklable():
    t = st.Tied("enc/kernel", st.T)
    assert jax.tree.leaves(t) == []
    assert t == st.Tied(("enc", "kernel"), st.transpose())
    assert hash(t) == hash(st.Tied(("enc", "kernel"), st.T))
    assert t != st.Tied("enc/kernel")
    assert pickle.loads(pickle.dumps(t)) == t
    assert repr(t) == "Tied('enc/kernel', T)"
    assert repr(st.Tied(("a/b", 0))) == "Tied(('a/b', '0'))"
    with pytest.raises(AttributeError):
        t.ref = ("x",)


def test_tree_ops_pass_ties_through():
    tree = {"w": jnp.ones((2, 3)), "v": st.Tied("w", st.T)}
    calls = []

    def f(x):
        calls.append(x)
        return x * 2

    out = jax.tree.map(f, tree)
    assert len(calls) == 1 and out["v"] == tree["v"]
    assert jax.tree.structure(out) == jax.tree.structure(tree)


Point = collections.namedtuple("Point", "x y")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DC:
    a: object
    b: object


@chex.dataclass
class ChexDC:
    a: object
    b: object


@flax.struct.dataclass
class FlaxStruct:
    a: object
    b: object


class EqxMod(eqx.Module):
    a: object
    b: object


W = np.arange(6.0, dtype=np.float32).reshape(2, 3)


@pytest.mark.parametrize(
    "tree, ref, get",
    [
        ({"p": {"a": W, "b": None}}, "p/a", lambda m: m["p"]["b"]),
        (FrozenDict({"p": {"a": W, "b": None}}), "p/a", lambda m: m["p"]["b"]),
        ([W, None], "0", lambda m: m[1]),
        ((W, None), "0", lambda m: m[1]),
        ({"p": Point(W, None)}, "p/x", lambda m: m["p"].y),
        ({"p": DC(W, None)}, "p/a", lambda m: m["p"].b),
        ({"p": ChexDC(a=W, b=None)}, "p/a", lambda m: m["p"].b),
        ({"p": FlaxStruct(W, None)}, "p/a", lambda m: m["p"].b),
        ({"p": EqxMod(W, None)}, "p/a", lambda m: m["p"].b),
    ],
    ids=["dict", "frozendict", "list", "tuple", "namedtuple", "dataclass", "chex", "flax", "eqx"],
)
def test_paths_through_containers(tree, ref, get):
    def put(x):
        return x.replace(b=st.Tied(ref, st.T)) if hasattr(x, "replace") else x

    # place the Tied where None is, in each container's own way
    if isinstance(tree, list):
        tree = [W, st.Tied(ref, st.T)]
    elif isinstance(tree, tuple):
        tree = (W, st.Tied(ref, st.T))
    elif isinstance(tree["p"], Point):
        tree = {"p": Point(W, st.Tied(ref, st.T))}
    elif isinstance(tree["p"], EqxMod):
        tree = {"p": EqxMod(W, st.Tied(ref, st.T))}
    elif isinstance(tree["p"], DC):
        tree = {"p": DC(W, st.Tied(ref, st.T))}
    elif isinstance(tree["p"], (dict, FrozenDict)):
        inner = dict(tree["p"])
        inner["b"] = st.Tied(ref, st.T)
        tree = type(tree)({"p": inner})
    else:
        tree = {"p": put(tree["p"])}
    m = st.materialize(tree)
    np.testing.assert_array_equal(get(m), W.T)
    assert st.canonicalize(tree).num_unique == 1


def test_tuple_ref_for_keys_containing_slash():
    tree = {"a/b": W, "c": st.Tied(("a/b",), st.T)}
    np.testing.assert_array_equal(st.materialize(tree)["c"], W.T)


def test_ref_to_subtree_and_chains():
    layer = {"w": W, "b": np.ones(3, np.float32)}
    tree = {
        "a": layer,
        "b": st.Tied("a"),
        "c": st.Tied("b/w", st.T),
        "d": st.Tied("c", st.scale(2.0)),
    }
    m = st.materialize(tree)
    assert m["b"]["w"] is W and m["b"]["b"] is layer["b"]
    np.testing.assert_array_equal(m["c"], W.T)
    np.testing.assert_array_equal(m["d"], 2 * W.T)
    g = st.canonicalize(tree)
    assert g.views["d"].buffer == "a/w" and g.views["d"].transform == st.T >> st.scale(2.0)


def test_subtree_transform_maps_over_leaves_and_keeps_static_leaves():
    tree = {"a": {"w": W, "name": "layer", "act": None}, "b": st.Tied("a", st.scale(3.0))}
    m = st.materialize(tree)
    np.testing.assert_allclose(m["b"]["w"], 3 * W)
    assert m["b"]["name"] == "layer"


def test_numpy_integer_keys_are_indices():
    assert st.Tied(np.int64(1)) == st.Tied("1")
    assert st.Tied(("layers", np.int32(2), "w")).ref == ("layers", "2", "w")
    with raises("E15", "('a', ", "str or int keys", "found bool", "True", cls=st.TieTypeError):
        st.Tied(("a", np.bool_(True)))


def test_unflatten_checks_nothing_and_gives_back_the_same_tied(monkeypatch):
    # a Tied is validated once, when it is made: every tree operation after that
    # (jax.tree.map, jit dispatch, an optimizer step) unflattens it without checks
    from sharetree import _tied

    tree = {"w": np.ones((2, 3)), "v": st.Tied("w", st.T), "u": st.Tied(("w",))}

    def fail(*args, **kwargs):
        raise AssertionError("a Tied was validated again")

    monkeypatch.setattr(_tied, "check_transform", fail)
    monkeypatch.setattr(_tied, "to_ref", fail)
    out = jax.tree.map(lambda x: 2 * x, tree)
    assert out["v"] is tree["v"] and out["u"] is tree["u"]
    again = jax.tree.unflatten(jax.tree.structure(tree), jax.tree.leaves(tree))
    assert again["v"] is tree["v"] and again["u"] is tree["u"]
    with pytest.raises(AssertionError, match="validated again"):
        st.Tied("w", st.T)  # making one still validates


# keys as users write them: plain names, indices, keys that read as climbs or hold '/'
_KEYS = hs.sampled_from(["a", "w", "0", "12", "..", ".", "a/b", "", " x", "...", "é"])
_TRANSFORMS = {"identity": st.identity, "T": st.T, "scale(2.0)": st.scale(2.0)}


@hs.composite
def _tieds(draw):
    keys = tuple(draw(hs.lists(_KEYS, min_size=1, max_size=3)))
    if draw(hs.booleans()):  # one ref: as keys, climbing or not
        up = draw(hs.none() | hs.integers(0, 3))
        return st.Tied(keys, draw(hs.sampled_from(list(_TRANSFORMS.values()))), up=up)
    names = draw(hs.lists(hs.sampled_from(["a", "b", "base"]), min_size=1, unique=True))
    more = {n: tuple(draw(hs.lists(_KEYS, min_size=1, max_size=3))) for n in names}
    return st.Tied(more, st.add())


@given(_tieds())
def test_a_tieds_repr_typed_back_is_the_same_tied(t):
    # the namespace a user types in: sharetree's names, with `add` the transform it shows
    namespace = {**vars(st), "add": st.add()}
    again = eval(repr(t), namespace)
    assert again == t and again.refs == t.refs
    for _, ref in t.refs:
        spelled = st.Tied(ref.keys, up=ref.up)
        assert eval(repr(spelled), namespace).refs == spelled.refs


def test_a_key_named_dotdot_is_not_shown_as_a_climb():
    assert repr(st.Tied(("..", "x"))) == "Tied(('..', 'x'))"
    assert repr(st.Tied(("..", "x"), up=1)) == "Tied(('..', 'x'), up=1)"
    assert st.Tied(("..", "x")) != st.Tied("../x")


@pytest.mark.parametrize("ref", ["..//x", "./", "../", "../a//b", "./x/"])
def test_a_bad_ref_is_shown_as_written(ref):
    with raises("E15", repr(ref)):
        st.Tied(ref)
