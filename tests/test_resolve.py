"""The resolver: iterative, linear, and its errors name what the user wrote."""

import jax
import numpy as np
import pytest

import sharetree as st
from sharetree._resolve import Leaf, ViewLeaf, structure_of


def _chain(n, transform=st.identity):
    """``n`` ties in a chain whose buffer comes last in flatten order: t0 -> t1 -> ... -> w."""
    width = len(str(n))
    names = [f"t{i:0{width}d}" for i in range(n)]
    tree = {name: st.Tied(nxt, transform) for name, nxt in zip(names, names[1:] + ["w"])}
    tree["w"] = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    return tree, names


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_long_chain_resolves_without_recursion(n):
    tree, names = _chain(n)
    s = structure_of(jax.tree.structure(tree))
    assert s.buffer_paths == (("w",),)
    assert all(leaf.buffer == 0 and leaf.transform == st.identity for leaf in s.views)
    assert {leaf.tie for leaf in s.views} == {(name,) for name in names}
    m = st.materialize(tree)
    assert m[names[0]] is tree["w"]


def test_chain_of_transposes_materializes_to_the_reference():
    tree, names = _chain(1_001, st.T)
    m = st.materialize(tree)
    w = tree["w"]
    # t_k is T applied (1001 - k) times: odd counts give w.T, even give w
    for k in (0, 1, 500, 1000):
        expected = w.T if (1_001 - k) % 2 else w
        np.testing.assert_array_equal(np.asarray(m[names[k]]), expected)


def test_long_cycle_is_a_tie_error_with_start_and_length():
    n = 1_000
    names = [f"c{i:04d}" for i in range(n)]
    tree = {name: st.Tied(nxt) for name, nxt in zip(names, names[1:] + names[:1])}
    tree["w"] = np.ones(2)
    with pytest.raises(
        st.TieError,
        match=r"cycle of ties: 'c0000' -> .*\.\.\..*-> 'c0000' "
        r"\(1000 ties, starting at 'c0000'\)",
    ):
        st.canonicalize(tree)


def test_cycle_through_a_subtree_and_a_view():
    tree = {"a": {"x": st.Tied("b/x")}, "b": st.Tied("a"), "w": np.ones(2)}
    with pytest.raises(st.TieError, match="cycle of ties"):
        st.materialize(tree)


def test_ref_through_views_below_a_leaf_names_the_ref_as_written():
    # "dec" is a view of "enc"; "head" refers below "dec/w", i.e. below the leaf "enc/w"
    tree = {
        "enc": {"w": np.ones((2, 2))},
        "dec": st.Tied("enc"),
        "head": st.Tied("dec/w/0"),
    }
    with pytest.raises(st.TieError) as info:
        st.materialize(tree)
    msg = str(info.value)
    assert "Tied at 'head'" in msg
    assert "ref 'dec/w/0'" in msg  # as the user wrote it
    assert "'enc/w/0'" in msg  # what it was rewritten to
    assert "below the leaf 'enc/w'" in msg


def test_dangling_ref_through_a_view_names_both_spellings():
    tree = {"enc": {"w": np.ones(2)}, "dec": st.Tied("enc"), "head": st.Tied("dec/q")}
    with pytest.raises(
        st.TieError,
        match=r"ref 'dec/q' \(followed through views to 'enc/q'\) "
        r"does not exist.*'enc/w'",
    ):
        st.materialize(tree)


def test_records_are_named():
    s = structure_of(jax.tree.structure({"a": np.ones(2), "b": st.Tied("a", st.T)}))
    (view,) = s.views
    assert isinstance(view, ViewLeaf)
    assert (view.buffer, view.transform, view.path, view.tie) == (0, st.T, ("b",), ("b",))
    assert s.expanded[0] == Leaf(0, None, ("a",), None)


def test_subtree_refs_with_ties_inside_and_views_of_views():
    w = np.arange(6.0).reshape(2, 3)
    tree = {
        "enc": {"w": w, "wt": st.Tied("enc/w", st.T)},
        "dec": st.Tied("enc", st.scale(2.0)),
        "head": st.Tied("dec/wt", st.T),
    }
    m = st.materialize(tree)
    np.testing.assert_allclose(m["dec"]["w"], 2 * w)
    np.testing.assert_allclose(m["dec"]["wt"], 2 * w.T)
    np.testing.assert_allclose(m["head"], 2 * w)
    s = structure_of(jax.tree.structure(tree))
    assert {leaf.tie for leaf in s.views} == {("enc", "wt"), ("dec",), ("head",)}


def test_a_string_ref_to_a_key_with_a_slash_names_the_tuple():
    tree = {"a": {"b/c": np.ones(2)}, "d": st.Tied("a/b/c")}
    with pytest.raises(st.TieError, match=r"the tree has \('a', 'b/c'\), a key with '/' in it"):
        st.materialize(tree)
