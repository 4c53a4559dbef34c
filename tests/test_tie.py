import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _raises import raises

import sharetree as st

A2 = np.ones(2, np.float32)


def _untied():
    return {
        "enc": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)},
        "dec": {"w": jnp.zeros((3, 2)), "b": jnp.ones(2)},
        "copy": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)},
    }


def test_tie_leaf_with_ref_or_tied_and_subtree():
    t = st.tie(_untied(), {"dec/w": st.Tied("enc/w", st.T), "copy": "enc"})
    assert t["dec"]["w"] == st.Tied("enc/w", st.T) and t["copy"] == st.Tied("enc")
    m = st.materialize(t)
    np.testing.assert_array_equal(m["dec"]["w"], t["enc"]["w"].T)
    assert m["copy"]["w"] is t["enc"]["w"]
    assert st.canonicalize(t).num_unique == 3


def test_tuple_targets_and_retie():
    t = st.tie(_untied(), {("dec", "w"): st.Tied(("enc", "w"), st.T)})
    t2 = st.tie(t, {"dec/w": st.Tied("copy/w", st.T)})
    assert t2["dec"]["w"] == st.Tied("copy/w", st.T)


def test_check_shape_mismatch_shows_both_shapes():
    with raises("E7", "'dec/w'", "a view of float32[2, 3]", "float32[3, 2]", "check=False"):
        st.tie(_untied(), {"dec/w": "enc/w"})


def test_check_dtype_mismatch():
    tree = {"a": jnp.ones(3), "b": jnp.ones(3, jnp.bfloat16)}
    with raises("E7", "'b'", "float32[3]", "bfloat16[3]", "st.astype"):
        st.tie(tree, {"b": "a"})
    ok = st.tie(tree, {"b": st.Tied("a", st.astype(jnp.bfloat16))})
    assert st.materialize(ok)["b"].dtype == jnp.bfloat16


def test_check_structure_mismatch():
    with raises("E8", "'dec'", "the view is a leaf", "'b', 'w'"):
        st.tie(_untied(), {"dec": "enc/w"})


@pytest.mark.parametrize(
    "tree, view, target",
    [
        ({"src": {"0": A2, "1": A2}, "dst": [A2, A2]}, "{'0': *, '1': *}", "[*, *]"),  # same paths
        ({"src": [A2, A2], "dst": (A2, A2)}, "[*, *]", "(*, *)"),
        ({"src": {"w": A2, "n": None}, "dst": {"w": A2}}, "{'n': None, 'w': *}", "{'w': *}"),
        ({"src": {"w": A2}, "dst": {"w": A2, "n": None}}, "{'w': *}", "{'n': None, 'w': *}"),
    ],
)
def test_check_structure_mismatch_with_the_same_leaf_paths(tree, view, target):
    # the containers would change under the user's feet: a dict for a list, a None more or less
    with raises("E8", "'dst'", f"the view is PyTreeDef({view}), the target is PyTreeDef({target})"):
        st.tie(tree, {"dst": "src"})
    out = st.tie(tree, {"dst": "src"}, check=False)  # asked for: the view's structure
    assert jax.tree.structure(st.materialize(out)["dst"]) == jax.tree.structure(tree["src"])


def test_check_false_allows_a_different_shape():
    t = st.tie(_untied(), {"dec/w": "enc/w"}, check=False)
    assert st.materialize(t)["dec"]["w"].shape == (2, 3)


def test_missing_target_names_closest():
    with raises("E5", "'dec/ww'", "'dec/w'", "st.load"):
        st.tie(_untied(), {"dec/ww": "enc/w"})


def test_overlapping_targets():
    with raises("E6", "'dec' and 'dec/w'", "keep only 'dec'"):
        st.tie(_untied(), {"dec": "enc", "dec/w": "enc/w"})


def test_equinox_attribute_paths():
    class AE(eqx.Module):
        enc: eqx.nn.Linear
        dec: eqx.nn.Linear

    k1, k2 = jax.random.split(jax.random.key(0))
    ae = AE(eqx.nn.Linear(4, 3, key=k1), eqx.nn.Linear(3, 4, key=k2))
    tied = st.tie(ae, {"dec/weight": st.Tied("enc/weight", st.T)})
    assert isinstance(tied.dec.weight, st.Tied)
    m = st.materialize(tied)
    np.testing.assert_array_equal(m.dec.weight, ae.enc.weight.T)


def test_float64_numpy_buffers_compare_as_jax_computes_them():
    w = np.arange(6.0).reshape(2, 3)  # float64; views are float32 unless x64 is on
    tied = st.tie(
        {"w": w, "v": w.reshape(6), "t": w.T},
        {"v": st.Tied("w", st.reshape(6)), "t": st.Tied("w", st.T)},
    )
    m = st.materialize(tied)
    assert m["v"].dtype == m["t"].dtype == st.canonicalize(tied).views["t"].dtype
    with raises("E7", "'v'", "float32[6]", "float16[6]"):
        st.tie({"w": w, "v": w.reshape(6).astype(np.float16)}, {"v": st.Tied("w", st.reshape(6))})


def test_two_spellings_of_one_target_is_an_error():
    w = jnp.ones(2)
    with raises("E6b", "'b' and ('b',)", "keep one entry"):
        st.tie({"a": w, "c": w, "b": w}, {"b": "a", ("b",): "c"})


def test_integer_targets_and_refs_in_lists():
    out = st.tie([jnp.ones(2), jnp.zeros(2)], {1: 0})
    assert out[1] == st.Tied("0") and st.materialize(out)[1] is out[0]


def test_empty_target_structure_message():
    with raises("E8", "'b'", "the view is a leaf", "the target is empty"):
        st.tie({"a": jnp.ones(2), "b": None}, {"b": "a"})


def test_tie_compares_keys_and_strings_without_numpy_errors():
    keys = jax.random.split(jax.random.key(0), 4).reshape(2, 2)
    tied = st.tie({"a": keys, "b": keys.T}, {"b": st.Tied("a", st.T)}, atol=0.0)  # check=True too
    assert tied["b"] == st.Tied("a", st.T)
    with raises("E46", "'b' and 'a' differ", "of 2 elements"):  # compared by their key data
        st.tie({"a": jax.random.key(0), "b": jax.random.key(1)}, {"b": "a"}, atol=0.0)
    same = st.tie({"a": np.array(["x"]), "b": np.array(["x"])}, {"b": "a"}, atol=0.5)
    assert same["b"] == st.Tied("a")
    with raises("E46", "'b' and 'a' differ by up to inf", "1 of 1 elements"):
        st.tie({"a": np.array(["x"]), "b": np.array(["y"])}, {"b": "a"}, atol=0.5)


def test_tie_atol_on_shape_structs_says_there_are_no_values():
    tree = jax.eval_shape(lambda: {"a": jnp.ones((2, 3)), "b": jnp.ones((3, 2))})
    assert st.tie(tree, {"b": st.Tied("a", st.T)})["b"] == st.Tied("a", st.T)  # shapes suffice
    with raises("E62", "buffer 'a'", "jax.ShapeDtypeStruct float32[2, 3]", "leave atol out"):
        st.tie(tree, {"b": st.Tied("a", st.T)}, atol=0.0)


def test_refs_are_paths_from_the_root_like_the_targets():
    # targets are paths from the root, and so are refs: written so that they name that
    # path even where a subtree holding the tie has the same key (refs are looked up from
    # there first); before, Tied('w') at 'sub/v' silently read 'sub/w'
    w, sw, sv = np.ones(2, np.float32), np.zeros(2, np.float32), np.full(2, 3.0, np.float32)
    tree = {"w": w, "sub": {"w": sw, "v": sv, "x": {"v": sv}}}
    out = st.tie(tree, {"sub/x/v": "sub/w"})  # ref from the root; 'sub/x' has no 'sub'
    np.testing.assert_array_equal(st.materialize(out)["sub"]["x"]["v"], sw)
    # every scoped spelling of 'w' is shadowed by 'sub/w': the ref climbs past it
    climbed = st.tie(tree, {"sub/v": "w"})
    assert climbed["sub"]["v"] == st.Tied("../w")
    assert st.materialize(climbed)["sub"]["v"] is w
    # a ref the root lacks is kept as written: scoped, found in the enclosing 'sub'
    scoped = st.tie({"sub": {"enc": w, "dec": sw}}, {"sub/dec": "enc"})
    assert scoped["sub"]["dec"] == st.Tied("enc")
    np.testing.assert_array_equal(st.materialize(scoped)["sub"]["dec"], w)


def test_a_ref_naming_a_node_that_holds_the_target_is_scoped():
    # '0' from the root holds the target '0/1': not a ref from the root, so it is kept
    # as written and read from the subtree '0' (its own '0'), as untie's inverse needs
    inner = [np.ones(3, np.float32), np.zeros(3, np.float32)]
    out = st.tie([inner], {("0", "1"): st.Tied("0")})
    assert out[0][1] == st.Tied("0")
    np.testing.assert_array_equal(st.materialize(out)[0][1], inner[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, np.float16])
def test_atol_compares_bfloat16_and_float8_copies_by_their_values(dtype):
    a = jnp.ones(4, dtype)
    b = a.at[1].set(jnp.asarray(1.125, dtype))  # 0.125 apart in every one of these dtypes
    assert st.tie({"a": a, "b": b}, {"b": "a"}, atol=0.2)["b"] == st.Tied("a")
    with raises("E46", "differ by up to 0.125", "1 of 4 elements", "atol=0.1"):
        st.tie({"a": a, "b": b}, {"b": "a"}, atol=0.1)
