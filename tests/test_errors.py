"""One test per row of docs/errors.md, in the same order."""

import jax
import jax.numpy as jnp
import pytest

import sharetree as st

W = jnp.ones((2, 3))


def test_01_dangling_ref_names_closest_path():
    tree = {"encoder": {"kernel": W}, "decoder": {"kernel": st.Tied("encoder/kernal", st.T)}}
    with pytest.raises(
        st.TieError, match=r"'decoder/kernel'.*'encoder/kernal'.*closest.*'encoder/kernel'"
    ):
        st.materialize(tree)


def test_02_cycle_shows_whole_cycle():
    tree = {"a": st.Tied("b"), "b": st.Tied("c"), "c": st.Tied("a"), "w": W}
    with pytest.raises(st.TieError, match=r"cycle of ties: 'a' -> 'b' -> 'c' -> 'a'"):
        st.canonicalize(tree)


def test_03_self_reference():
    with pytest.raises(st.TieError, match=r"'a/y' refers to 'a', a subtree that contains it"):
        st.materialize({"a": {"x": W, "y": st.Tied("a")}})
    with pytest.raises(st.TieError, match=r"'a' refers to 'a', itself"):
        st.materialize({"a": st.Tied("a"), "w": W})


def test_04_ref_below_a_leaf():
    with pytest.raises(st.TieError, match=r"'w/0' goes below the leaf 'w'"):
        st.materialize({"w": W, "v": st.Tied("w/0")})


def test_05_tie_target_missing():
    with pytest.raises(st.TieError, match=r"'dec/kernel' does not exist.*'dec/kern'"):
        st.tie({"enc": W, "dec": {"kern": W}}, {"dec/kernel": "enc"})


def test_06_overlapping_targets():
    with pytest.raises(st.TieError, match=r"'dec' and 'dec/w' overlap"):
        st.tie({"enc": {"w": W}, "dec": {"w": W}}, {"dec": "enc", "dec/w": "enc/w"})


def test_07_shape_mismatch_both_shapes():
    with pytest.raises(st.TieError, match=r"view is float32\[3, 2\].*replaces is float32\[2, 3\]"):
        st.tie({"enc": W, "dec": W}, {"dec": st.Tied("enc", st.T)})


def test_08_structure_mismatch():
    with pytest.raises(
        st.TieError,
        match=r"structure differs.*the view is a leaf, the target is a subtree with leaves 'w'",
    ):
        st.tie({"enc": W, "dec": {"w": W}}, {"dec": "enc"})


def test_09_transform_failure():
    tree = {"a": W, "b": st.Tied("a", st.transpose(0, 1, 2))}
    with pytest.raises(
        st.TieError, match=r"view 'b'.*transpose\(0, 1, 2\).*buffer 'a' of float32\[2, 3\]"
    ):
        st.materialize(tree)
    with pytest.raises(st.TieError, match=r"transpose\(0, 1, 2\)"):
        st.canonicalize(tree).views  # noqa: B018


def test_10_restructure_wrong_length():
    _, re = st.destructure({"a": W})
    with pytest.raises(st.TieError, match=r"length 6.*got length 4 \(-2\)"):
        re(jnp.zeros(4))
    with pytest.raises(st.TieError, match="length 6"):
        re.canonical(jnp.zeros(7))


def test_11_restructure_wrong_ndim():
    _, re = st.destructure({"a": W})
    with pytest.raises(st.TieError, match=r"shape \(2, 3\) \(ndim 2\).*vmap"):
        re(jnp.zeros((2, 3)))


def test_12_restructure_wrong_dtype_kind():
    _, re = st.destructure({"a": W})
    with pytest.raises(st.TieError, match="got dtype bool"):
        re(jnp.zeros(6, bool))


def test_13_bad_or_unhashable_transform():
    with pytest.raises(st.TieError, match=r"wrap the function with st.fn"):
        st.Tied("a", lambda x: x)
    with pytest.raises(st.TieError, match="expected a sharetree transform, got list"):
        st.Tied("a", [1, 2])

    class Unhashable:
        __hash__ = None

        def __call__(self, x):
            return x

    with pytest.raises(st.TieError, match="not hashable"):
        st.fn(Unhashable())


def test_14_tied_at_root():
    with pytest.raises(st.TieError, match="root"):
        st.materialize(st.Tied("a"))


def test_15_ref_not_a_path():
    for bad in (1.5, "", "a//b", ("a", 1.5), ("a", True)):
        with pytest.raises(st.TieError):
            st.Tied(bad)


class _Pair:
    """A custom node whose two children have the same key name."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    _Pair,
    lambda p: (((jax.tree_util.GetAttrKey("w"), p.a), (jax.tree_util.DictKey("w"), p.b)), None),
    lambda _, children: _Pair(*children),
)


def test_16_ambiguous_paths():
    with pytest.raises(st.TieError, match="share the path 'p/w'"):
        st.materialize({"p": _Pair(W, W), "v": st.Tied("p/w")})


def test_17_bad_transform_spec():
    with pytest.raises(st.TieError, match="unknown transform name 'flip'.*known"):
        st.transform_from_spec({"name": "flip"})


def test_01b_ref_to_an_empty_subtree():
    with pytest.raises(st.TieError, match=r"ref 'a' is None, a subtree with no leaves"):
        st.materialize({"a": None, "b": st.Tied("a"), "w": W})


def test_13b_bad_transform_arguments():
    for make in (lambda: st.reshape(2.5), lambda: st.transpose("a"), lambda: st.astype("nope")):
        with pytest.raises(st.TieError, match="Fix:"):
            make()


def test_06b_same_target_twice():
    with pytest.raises(st.TieError, match="name the same path"):
        st.tie({"a": W, "b": W, "c": W}, {"b": "a", ("b",): "c"})


def test_12b_restructure_with_changed_offsets():
    flat, re = st.destructure({"a": W, "b": jnp.ones(2), "c": st.Tied("a", st.T)})
    moved = jax.tree.map(lambda o: o + 2, re)
    with pytest.raises(st.TieError, match=r"offset 0 is 2, expected 0\. Fix: do not tree_map"):
        moved(flat)


def test_18_astype_not_a_numeric_dtype():
    for bad in (None, jnp.ones(2), "object"):
        with pytest.raises(st.TieError, match=r"astype\(.*expected a boolean or numeric dtype"):
            st.astype(bad)


def test_19_scale_not_finite():
    for bad in (float("nan"), float("inf"), -float("inf"), 10**400):
        with pytest.raises(st.TieError, match=r"scale\(.*expected a finite number"):
            st.scale(bad)
    with pytest.raises(st.TieError, match="finite Python or NumPy number"):
        st.scale("2")


def test_20_malformed_spec_of_a_known_transform():
    from sharetree._transforms import describe_spec

    with pytest.raises(st.TieError, match=r"\{'name': 'reshape'\}: the field 'shape' is missing"):
        st.transform_from_spec({"name": "reshape"})
    with pytest.raises(st.TieError, match=r"field 'shape' of 'reshape' should be a list of int"):
        describe_spec({"name": "reshape", "shape": "2x3"})
    with pytest.raises(st.TieError, match=r"the field 'order' is not one of its fields"):
        st.transform_from_spec({"name": "reshape", "shape": [6], "order": "F"})


def test_21_fn_spec_function_not_passed_in():
    with pytest.raises(
        st.TieError,
        match=r"'mylib.ops:softcap' is not among the functions passed in.*never imported.*"
        r"functions=\{'mylib.ops:softcap': softcap\}",
    ):
        st.transform_from_spec({"name": "fn", "function": "mylib.ops:softcap"})


def test_22_meaningless_axes_or_sizes():
    with pytest.raises(st.TieError, match=r"transpose\(0, 0\): expected a permutation"):
        st.transpose(0, 0)
    with pytest.raises(st.TieError, match=r"reshape\(-1, -1\): expected sizes >= 0 and at most"):
        st.reshape(-1, -1)


def _foreign_file(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"emb": np.arange(6.0, dtype=np.float32).reshape(3, 2)}, str(path))
    return path


def _load_ties(path, ties):  # st.load(path, ties=ties) once the io module takes ties=
    from sharetree._foreign import load_foreign

    return load_foreign(str(path), ties=ties)


def test_43_load_ties_not_tensor_names(tmp_path):
    path = _foreign_file(tmp_path)
    with pytest.raises(st.TieError, match=r"ties must be a mapping.*all_tied_weights_keys"):
        _load_ties(path, ["lm_head.weight"])
    with pytest.raises(st.TieError, match=r"tie target \('a', 'b'\) is not a tensor name"):
        _load_ties(path, {("a", "b"): "emb"})


def test_44_load_tie_target_and_ref_absent(tmp_path):
    with pytest.raises(st.TieError, match=r"'head' <- 'embb': neither is in the file.*'emb'"):
        _load_ties(_foreign_file(tmp_path), {"head": "embb"})


def test_45_load_tie_buffer_cannot_move(tmp_path):
    with pytest.raises(st.TieError, match=r"holds 'emb' but not 'new'.*no inverse.*other way"):
        _load_ties(_foreign_file(tmp_path), {"emb": st.Tied("new", st.scale(2.0))})


def test_46_load_tied_copies_differ(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": np.arange(4.0), "b": np.arange(4.0) + 0.5}, str(path))
    with pytest.raises(st.TieError, match=r"'b' and 'a' differ by up to 0\.5.*choose which"):
        _load_ties(path, {"b": "a"})


def test_47_directory_not_a_checkpoint(tmp_path):
    with pytest.raises(st.TieError, match=r"neither 'model.safetensors' nor 'model.safetensors"):
        st.load(tmp_path)


def test_48_bad_shard_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "gone.st"}}')
    with pytest.raises(st.TieError, match=r"index.json' names the shard 'gone.st'.*not exist"):
        st.load(tmp_path)
