"""The resolver: iterative, linear, and its errors name what the user wrote."""

import hypothesis
import hypothesis.strategies as st_h
import jax
import numpy as np
import pytest
from _examples import examples
from _raises import raises

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
    with raises("E2", r"re:'c0000' -> .*\.\.\..*-> 'c0000' ", "1,000 ties", "starting at 'c0000'"):
        st.canonicalize(tree)


def test_cycle_through_a_subtree_and_a_view():
    tree = {"a": {"x": st.Tied("b/x")}, "b": st.Tied("a"), "w": np.ones(2)}
    with raises("E2", "'a/x' -> 'b/x' (via Tied('a') at 'b') -> 'a/x'"):
        st.materialize(tree)


def test_ref_through_views_below_a_leaf_names_the_ref_as_written():
    # "dec" is a view of "enc"; "head" refers below "dec/w", i.e. below the leaf "enc/w"
    tree = {
        "enc": {"w": np.ones((2, 2))},
        "dec": st.Tied("enc"),
        "head": st.Tied("dec/w/0"),
    }
    # the tie, the ref as the user wrote it, what it was rewritten to, the leaf
    with raises("E4", "Tied at 'head'", "ref 'dec/w/0'", "'enc/w/0'", "below the leaf 'enc/w'"):
        st.materialize(tree)


def test_dangling_ref_through_a_view_names_both_spellings():
    tree = {"enc": {"w": np.ones(2)}, "dec": st.Tied("enc"), "head": st.Tied("dec/q")}
    with raises("E1", "ref 'dec/q' (followed through views to 'enc/q')", "closest", "'enc/w'"):
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
    with raises("E1", "('a', 'b/c')", "'/'"):
        st.materialize(tree)
    # also beside a leaf 'a', below which the string would otherwise point
    tree = {"a": np.ones(2), "a/b": np.ones(2), "c": st.Tied("a/b")}
    with raises("E1", "('a/b',)", "'/'") as e:
        st.materialize(tree)
    assert "st.index" not in str(e.value)  # not "below the leaf 'a'" (E4)


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


def test_the_innermost_subtree_that_has_the_ref_wins_and_the_root_comes_last():
    a, b, c = (np.full((2,), v, np.float32) for v in (1.0, 2.0, 3.0))
    # lexical scope: "block" standing alone means its own enc/w, so it does inside a bigger tree
    tree = {"enc": {"w": a}, "block": {"enc": {"w": b}, "dec": st.Tied("enc/w")}}
    assert st.materialize(tree)["block"]["dec"] is b
    assert st.materialize(tree["block"])["dec"] is b
    tree = {"x": {"y": {"w": b, "v": st.Tied("w")}, "w": c}, "w": a}
    assert st.materialize(tree)["x"]["y"]["v"] is b
    tree = {"x": {"y": {"v": st.Tied("w")}, "w": c}, "w": a}
    assert st.materialize(tree)["x"]["y"]["v"] is c
    tree = {"x": {"y": {"v": st.Tied("w")}}, "w": a}
    assert st.materialize(tree)["x"]["y"]["v"] is a
    # through a view of the same nested tree
    tree = {"m": {"w": np.ones((2, 3)), "v": st.Tied("w"), "u": st.Tied("v", st.T)}}
    assert st.materialize(tree)["m"]["u"].shape == (3, 2)


def test_a_scope_that_makes_the_tie_its_own_ref_is_skipped_and_a_missing_ref_says_so():
    # at "a/b", ref "b" from the scope "a" would be the tie itself: not a match
    with raises("E1", "Tied at 'a/b'", "ref 'b'", "'a/c'"):
        st.materialize({"a": {"b": st.Tied("b"), "c": np.ones(2)}})
    with raises("E3", "Tied at 'a/b'", "'a', a subtree that contains it"):
        st.materialize({"a": {"b": st.Tied("a"), "c": np.ones(2)}})


# -- refs are lexically scoped: wrapping a tree never changes what its ties mean ---

_KEYS = ["a", "b", "enc", "w"]


@st_h.composite
def _tied_trees(draw):
    """A dict of leaves and sub-dicts (distinct values), some leaves replaced by ties."""
    counter = iter(range(1, 1_000))
    tree = {}
    for k in draw(st_h.lists(st_h.sampled_from(_KEYS), min_size=2, max_size=4, unique=True)):
        if draw(st_h.booleans()):
            sub = draw(st_h.lists(st_h.sampled_from(_KEYS), min_size=1, max_size=3, unique=True))
            tree[k] = {j: np.full(2, next(counter), np.float32) for j in sub}
        else:
            tree[k] = np.full(2, next(counter), np.float32)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    paths = [tuple(str(getattr(e, "key", e)) for e in p) for p in paths]
    targets = draw(st_h.lists(st_h.sampled_from(paths), max_size=len(paths) - 1, unique=True))
    sources = [p for p in paths if p not in targets]
    for target in targets:
        ref = draw(st_h.sampled_from(sources))
        # written from the tree's root, or from the target's own subtree when it has it
        if len(target) == 2 and ref[0] == target[0] and draw(st_h.booleans()):
            ref = ref[1:]
        t = st.Tied("/".join(ref), draw(st_h.sampled_from([st.identity, st.scale(2.0)])))
        node = tree
        for k in target[:-1]:
            node = node[k]
        node[target[-1]] = t
    return tree


def _shifted(tree, by):
    """The materialized tree with other values: the colliding keys of a bigger tree."""
    return jax.tree.map(lambda x: x + by, st.materialize(tree))


@hypothesis.given(
    _tied_trees(), st_h.sampled_from(_KEYS + ["params"]), st_h.sampled_from(_KEYS + ["state"])
)
@hypothesis.settings(max_examples=examples(150), deadline=None)
def test_wrapping_a_tied_tree_in_a_dict_with_colliding_keys_never_changes_its_ties(
    tree, key, outer_key
):
    try:
        alone = st.materialize(tree)
    except st.TieError:  # a tie to another tie's buffer path that is itself a target, etc.
        hypothesis.assume(False)
    inner_copy = _shifted(tree, 100.0)
    # the bigger tree has every key of the tree (and of its subtrees) next to it, with
    # other values, and the whole thing again one level up (a train state, a bigger model)
    wrapped = {k: v for k, v in inner_copy.items() if k != key}
    wrapped[key] = tree
    for sub in (v for v in inner_copy.values() if isinstance(v, dict)):
        for k, v in sub.items():
            wrapped.setdefault(k, v + 1_000.0)
    twice = {k: v for k, v in _shifted(wrapped, 10_000.0).items() if k != outer_key}
    twice[outer_key] = wrapped
    for big, get in ((wrapped, lambda m: m[key]), (twice, lambda m: m[outer_key][key])):
        got = get(st.materialize(big))
        assert jax.tree.structure(got) == jax.tree.structure(alone)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_tie_inside_a_bigger_tree_reads_its_own_tree_not_the_bigger_trees_path():
    # the case: the outer "enc" must not capture the inner tree's ref "enc"
    inner = {"enc": np.ones((2, 3), np.float32), "dec": st.Tied("enc", st.T)}
    m = st.materialize({"enc": np.full((2, 3), 7.0, np.float32), "model": inner})
    np.testing.assert_array_equal(m["model"]["dec"], np.ones((3, 2), np.float32))
    assert st.materialize({"model": inner})["model"]["dec"].shape == (3, 2)


# -- cycle errors show the chain as the user wrote it ----------------------------


@pytest.mark.parametrize(
    ("tree", "chain", "count"),
    [
        (  # through a view: the ref as written, the view it passes, where it lands
            {"a": {"x": st.Tied("b/x"), "y": np.ones(2)}, "b": st.Tied("a")},
            "'a/x' -> 'b/x' (via Tied('a') at 'b') -> 'a/x'",
            "2 ties",
        ),
        (  # through a subtree tie: the subtree it lands on holds the next tie
            {"a": {"x": st.Tied("b"), "y": np.ones(2)}, "b": st.Tied("a")},
            "'a/x' -> 'b' -> 'a' (holding the tie 'a/x')",
            "2 ties",
        ),
        (  # refs written from a subtree: the path found and the ref as written
            {"m": {"a": st.Tied("b"), "b": st.Tied("a")}, "w": np.ones(2)},
            "'m/a' -> 'm/b' (written 'b') -> 'm/a' (written 'a')",
            "2 ties",
        ),
        (  # views that refer below each other
            {"a": st.Tied("b/y"), "b": st.Tied("a/x"), "w": np.ones(2)},
            "'a' -> 'b/y' (through the view 'b') -> 'a/x' (through the view 'a')",
            "2 ties",
        ),
        ({"a": st.Tied("a2"), "a2": st.Tied("a"), "w": np.ones(2)}, "'a' -> 'a2' -> 'a'", "2 ties"),
    ],
)
def test_cycle_errors_show_each_ref_as_written_with_the_views_it_passes(tree, chain, count):
    with raises("E2", f"{chain} ({count}, starting at") as info:
        st.materialize(tree)
    assert "1 ties" not in str(info.value)


def test_ties_found_by_position_are_written_so_that_the_scoped_lookup_finds_their_buffer():
    x, y, z = np.arange(2.0), np.arange(2.0) + 5, np.arange(2.0) + 9
    # "m/w" is the same object as "m/v": the ref from the root, "m/v", would be looked up
    # as "m/m/v" first (the subtree "m" has its own "m/v"): the ref from "m" is written
    tree = {"m": {"m": {"v": z}, "v": x, "w": x}, "w": y}
    tied = st.tie_identical(tree)
    assert st.materialize(tied)["m"]["w"] is x and tied["m"]["w"] == st.Tied("v")
    copied = {"m": {"m": {"v": z}, "v": x, "w": x.copy()}, "w": y}
    found = st.find_ties(copied)  # refs from the root, as tie's targets; tie scopes them
    assert found == {"m/w": st.Tied("m/v")}
    out = st.tie(copied, found)
    assert out["m"]["w"] == st.Tied("v") and st.materialize(out)["m"]["w"] is x
    # no scoped spelling names the root's "a" from inside "sub", which has its own "a":
    # the ref climbs past it
    climbed = st.tie_identical({"a": x, "sub": {"a": y, "v": x}})
    assert climbed["sub"]["v"] == st.Tied("../a") and st.materialize(climbed)["sub"]["v"] is x
