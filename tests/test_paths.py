"""The path and leaf helpers every module shares."""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from _raises import raises

import sharetree as st
from sharetree import _paths
from sharetree._tied import is_tied


def test_key_names_match_jax_simple_keystr_for_every_container():
    tree = {"d": {"k": 1.0}, "i": {3: 2.0}, "l": [1.0, (2.0,)]}
    flat, _ = jtu.tree_flatten_with_path(tree)
    got = ["/".join(_paths.keypath_to_path(kp)) for kp, _ in flat]
    assert got == [jtu.keystr(kp, simple=True, separator="/") for kp, _ in flat]
    assert got == ["d/k", "i/3", "l/0", "l/1/0"]


def test_is_array_leaf_is_one_rule():
    yes = [np.ones(2), np.float32(1.0), np.int8(3), jnp.ones(2), 1, 2.0, 1j]
    no = [True, np.bool_(True), "s", None, jax.ShapeDtypeStruct((2,), jnp.float32), st.Tied("a")]
    assert all(_paths.is_array_leaf(x) for x in yes)
    assert not any(_paths.is_array_leaf(x) for x in no)


def test_format_aval_and_nbytes():
    assert _paths.format_aval(np.zeros((2, 3), np.float16)) == "float16[2, 3]"
    assert _paths.format_aval(jax.ShapeDtypeStruct((), jnp.int32)) == "int32[]"
    assert _paths.format_aval("text") == "static"
    assert _paths.aval_nbytes(_paths.aval_of(np.zeros((2, 3), np.float16))) == 12


def test_prefixes_and_nodes():
    assert _paths.prefixes(("a", "b", "c")) == [("a",), ("a", "b"), ("a", "b", "c")]
    assert _paths.node_paths([("a", "b"), ("a", "c")]) == {("a",), ("a", "b"), ("a", "c")}


@pytest.mark.parametrize(
    ("bad", "shown", "cls"),
    [
        (1.5, "float 1.5", st.TieTypeError),
        ("", "''", st.TieError),
        ("a//b", "'a//b'", st.TieError),
        (("a", True), "bool True", st.TieTypeError),
        (None, "NoneType None", st.TieTypeError),
    ],
)
def test_to_path_rejects_what_is_not_a_path(bad, shown, cls):
    with raises("E15", shown, "Fix:", cls=cls) as info:
        _paths.to_path(bad)
    assert isinstance(info.value, TypeError) == (cls is st.TieTypeError)


def test_closest_and_plural():
    assert "'enc/w'" in _paths.closest("enc/v", ["enc/w", "zzz"], n=1)
    assert _paths.closest("x", []) == "the tree has no paths at all"
    assert (_paths.plural(1, "view"), _paths.plural(2_000, "view")) == ("1 view", "2,000 views")


def test_leaves_with_paths_keeps_flatten_order_and_stops_at_is_leaf():
    tie = st.Tied("a")
    tree = {"b": [1.0, tie], "a": "s", "n": None}
    flat, _ = jtu.tree_flatten_with_path(tree, is_leaf=is_tied)
    got = _paths.leaves_with_paths(tree, is_leaf=is_tied)
    assert got == [(_paths.keypath_to_path(kp), x) for kp, x in flat]
    assert got == [(("a",), "s"), (("b", "0"), 1.0), (("b", "1"), tie)]
    assert [p for p, _ in _paths.leaves_with_paths(tree)] == [("a",), ("b", "0")]


def test_path_key_is_the_string_path_str_shows_unless_a_key_has_a_slash():
    assert _paths.path_key(("a", "0")) == _paths.path_str(("a", "0")) == "a/0"
    assert _paths.path_key(("a/b", "c")) == ("a/b", "c")
    assert _paths.path_str(("a/b", "c")) == repr(("a/b", "c"))


def _nested(depth, leaf):
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


def jax_flattens(tree) -> bool:
    """Whether this jax's tree_util flattens ``tree`` (older ones recurse and give up)."""
    try:
        jax.tree_util.tree_flatten(tree)
    except (RecursionError, SystemError):
        return False
    return True


def test_a_tree_deeper_than_jax_recurses_materializes_where_jax_flattens_it():
    deep = {"x": _nested(3000, jnp.arange(2.0)), "b": st.Tied("x", st.scale(2.0))}
    if not jax_flattens(deep):
        pytest.skip(f"jax {jax.__version__} cannot flatten 3,000 levels (the TieError is tested)")
    leaf = st.materialize(deep)["b"]
    for _ in range(3000):
        leaf = leaf["a"]
    np.testing.assert_array_equal(leaf, [0.0, 2.0])


def _untie_state_of(state):
    return st.untie_state(state, {"a": jnp.ones(2), "b": st.Tied("a")})


@pytest.mark.parametrize(
    "call",
    [
        st.materialize,
        st.destructure,
        st.find_ties,
        st.tie_identical,
        lambda t: st.tie(t, {"b": "x"}),
        lambda t: st.label_by_path(t, {"*": 1}),
        _untie_state_of,
    ],
)
def test_trees_jax_cannot_flatten_are_tie_errors(call):
    # 3,000 levels: too deep for the jax.tree_util of jax <= 0.10 (it recurses): there a
    # TieError naming the branch, and the interpreter still works afterwards (a flatten
    # with a callback is never attempted). A jax that flattens it (0.12 does) gets no
    # error from sharetree either: the limit is jax's, not sharetree's.
    deep = {"x": _nested(3000, jnp.ones(2)), "b": st.Tied("x")}
    if jax_flattens(deep) and call is _untie_state_of:
        # flattened, this state holds no part shaped like the tree: E326 (not a flatten error)
        with raises("E326", "'b'"):
            call(deep)
    elif jax_flattens(deep):
        call(deep)
    else:
        with raises("E61", "500", "'x/a/a/a/a/a/...'"):
            call(deep)
    # dict keys of two types: JAX cannot sort them
    with raises("E61", "dict at 'm'", "0 and '0'", "int and str"):
        call({"m": {0: jnp.ones(2), "0": jnp.ones(2)}, "b": 1.0})
    assert st.materialize({"a": jnp.ones(2), "b": st.Tied("a")})["b"].shape == (2,)


def test_an_empty_key_is_named_by_a_tuple():
    w = np.ones(2)
    tree = {"": w, "x": {"": w}, "b": st.Tied(("",)), "c": st.Tied(("x", ""), st.T)}
    assert st.materialize(tree)["b"] is w
    assert _paths.path_str(("x", "")) == "('x', '')"  # never shown as 'x/'
    assert st.find_ties({"": np.arange(3.0), "b": np.arange(3.0)}) == {"b": st.Tied(("",))}
    with raises("E15", "'x/'", "empty key"):
        st.Tied("x/")  # as a string, an empty key is a typo
