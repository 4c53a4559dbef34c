import collections
import dataclasses
import pickle

import chex
import equinox as eqx
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _raises import raises
from flax.core import FrozenDict

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
