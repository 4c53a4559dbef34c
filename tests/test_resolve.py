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


# -- a tied tree nested in a bigger one keeps its ties ------------------------------


def _lm_params(seed=0):
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(5, 3)).astype(np.float32)
    return {"embed": emb, "head": st.Tied("embed", st.T), "b": np.zeros(5, np.float32)}


def test_a_train_state_of_tied_params_and_their_adam_moments_materializes_per_tree(tmp_path):
    optax = pytest.importorskip("optax")
    params = _lm_params()
    state = {"params": params, "opt_state": optax.adam(1e-2).init(params)}
    grads = jax.tree.map(lambda x: np.full(x.shape, 0.5, x.dtype), params)
    _, state["opt_state"] = optax.adam(1e-2).update(grads, state["opt_state"], params)
    m = st.materialize(state)
    mu = state["opt_state"][0].mu
    # each view is its own tree's buffer transposed: the moments' head is the moments' embed.T
    np.testing.assert_array_equal(m["params"]["head"], params["embed"].T)
    np.testing.assert_array_equal(m["opt_state"][0].mu["head"], np.asarray(mu["embed"]).T)
    assert st.canonicalize(state).num_unique == 2 + 2 + 2 + 1  # params, mu, nu, count
    st.save(tmp_path / "state.safetensors", state)
    back = st.load(tmp_path / "state.safetensors", like=state)
    assert back["opt_state"][0].nu["head"] == st.Tied("embed", st.T)
    nu = state["opt_state"][0].nu
    np.testing.assert_array_equal(back["opt_state"][0].nu["embed"], nu["embed"])


def test_flax_style_variables_and_an_equinox_parent_keep_the_ties_of_their_parts():
    variables = {"params": _lm_params(), "batch_stats": {"mean": np.ones(3, np.float32)}}
    flat, re = st.destructure(variables)
    assert flat.shape == (15 + 5 + 3,)
    np.testing.assert_array_equal(re(flat)["params"]["head"], variables["params"]["embed"].T)
    parent = {"ae0": _lm_params(0), "ae1": _lm_params(1)}
    m = st.materialize(parent)
    for k in ("ae0", "ae1"):  # each part's view reads its own buffer
        np.testing.assert_array_equal(m[k]["head"], parent[k]["embed"].T)


def test_a_ref_the_root_has_means_the_root_and_the_innermost_scope_wins_otherwise():
    a, b, c = (np.full((2,), v, np.float32) for v in (1.0, 2.0, 3.0))
    # the root's "enc/w" exists: a ref written from the root (as st.tie writes it) keeps it
    tree = {"enc": {"w": a}, "block": {"enc": {"w": b}, "dec": st.Tied("enc/w")}}
    assert st.materialize(tree)["block"]["dec"] is a
    # absent at the root: the nearest subtree holding the tie that has it
    tree = {"x": {"y": {"w": b, "v": st.Tied("w")}, "w": c}}
    assert st.materialize(tree)["x"]["y"]["v"] is b
    tree = {"x": {"y": {"v": st.Tied("w")}, "w": c}}
    assert st.materialize(tree)["x"]["y"]["v"] is c
    # through a view of the same nested tree
    tree = {"m": {"w": np.ones((2, 3)), "v": st.Tied("w"), "u": st.Tied("v", st.T)}}
    assert st.materialize(tree)["m"]["u"].shape == (3, 2)


def test_a_scope_that_makes_the_tie_its_own_ref_is_skipped_and_a_missing_ref_says_so():
    # at "a/b", ref "b" from the scope "a" would be the tie itself: not a match
    with pytest.raises(st.TieError, match=r"ref 'b' does not exist.*from a subtree that contains"):
        st.materialize({"a": {"b": st.Tied("b"), "c": np.ones(2)}})
    with pytest.raises(st.TieError, match=r"refers to 'a', a subtree that contains it"):
        st.materialize({"a": {"b": st.Tied("a"), "c": np.ones(2)}})
