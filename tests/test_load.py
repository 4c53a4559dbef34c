"""st.load: a file's canonical tree back, every Tied; files of other tools handed to _foreign."""

from __future__ import annotations

import builtins
import collections
import dataclasses
import importlib
import json
import os
import sys
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _examples import examples
from _files import TIED, assert_same_tree, read_raw, tampered, warns
from _raises import message, raises
from hypothesis import given, reject, settings
from hypothesis import strategies as hs
from safetensors.numpy import load_file, save_file

import sharetree as st
from sharetree.__main__ import describe
from sharetree._files import container
from sharetree._files.load import read_metadata

# ----------------------------------------------------------------- round trips


def test_roundtrip_ties_and_views(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    back = st.load(path)
    assert_same_tree(back, TIED)
    assert back["head"] == st.Tied("embed", st.T)
    assert back["dec"] == st.Tied("enc", st.scale(-1.0))
    # independent reference: the materialized trees agree leaf by leaf
    m_back, m_ref = st.materialize(back), st.materialize(TIED)
    for x, y in zip(jax.tree.leaves(m_back), jax.tree.leaves(m_ref), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_jax_arrays_come_back_as_numpy(tmp_path) -> None:
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "v": st.Tied("w", st.T), "n": jnp.array(3)}
    st.save(tmp_path / "j.safetensors", tree)
    back = st.load(tmp_path / "j.safetensors")
    assert isinstance(back["w"], np.ndarray) and back["w"].dtype == np.float32
    assert back["n"].shape == () and back["n"].dtype == np.int32
    assert back["v"] == tree["v"]
    # and device_put brings them back to JAX, ties intact
    put = jax.device_put(back)
    assert isinstance(put["w"], jax.Array) and put["v"] == tree["v"]


@pytest.mark.parametrize(
    "dtype",
    [
        np.float32,
        np.float64,
        np.float16,
        jnp.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.int4,
        np.complex64,
        np.complex128,
        np.int8,
        np.int32,
        np.int64,
        np.uint16,
        np.uint64,
        np.bool_,
    ],
    ids=lambda d: np.dtype(d).name,
)
def test_dtypes_roundtrip_bit_exact(tmp_path, dtype) -> None:
    rng = np.random.default_rng(0)
    if np.dtype(dtype).kind == "c":
        a = (rng.normal(size=(3, 5)) + 1j * rng.normal(size=(3, 5))).astype(dtype)
    elif np.dtype(dtype).kind == "b":
        a = rng.normal(size=(3, 5)) > 0
    else:
        a = rng.normal(size=(3, 5)).clip(-7, 7).astype(dtype)
    tree = {"a": a, "t": st.Tied("a", st.T), "zero_d": a[0, 0].copy().reshape(())}
    st.save(tmp_path / "d.safetensors", tree)
    back = st.load(tmp_path / "d.safetensors")
    assert back["a"].dtype == np.dtype(dtype)
    assert back["a"].tobytes() == a.tobytes()
    assert back["zero_d"].shape == ()
    assert back["t"] == st.Tied("a", st.T)


def test_python_leaves_and_containers(tmp_path) -> None:
    tree = {
        "lst": [1, 2.5, "text", None, True, 1 + 2j, float("nan"), float("-inf"), 2**70],
        "tup": (np.float32(3.0), np.int64(7), ()),
        "od": collections.OrderedDict([("z", np.ones(2)), ("a", np.zeros(2))]),
        "ints": {0: np.arange(3), 1: st.Tied("ints/0")},
        "empty": {},
        "none": None,
    }
    st.save(tmp_path / "p.safetensors", tree)
    back = st.load(tmp_path / "p.safetensors")
    assert_same_tree(back, tree)
    assert type(back["od"]) is collections.OrderedDict and list(back["od"]) == ["z", "a"]
    assert type(back["tup"][0]) is np.float32 and type(back["tup"][1]) is np.int64
    assert back["lst"][8] == 2**70 and type(back["lst"][5]) is complex


def test_root_leaf_and_empty_tree(tmp_path) -> None:
    st.save(tmp_path / "r.safetensors", np.arange(3.0))
    np.testing.assert_array_equal(st.load(tmp_path / "r.safetensors"), np.arange(3.0))
    st.save(tmp_path / "e.safetensors", {})
    assert st.load(tmp_path / "e.safetensors") == {}


def test_keys_with_slashes_and_dots(tmp_path) -> None:
    tree = {"a/b": np.ones(2), "a": {"b": np.zeros(2)}, "x.y": st.Tied(("a/b",))}
    st.save(tmp_path / "s.safetensors", tree)
    back = st.load(tmp_path / "s.safetensors")
    assert_same_tree(back, tree)
    np.testing.assert_array_equal(st.materialize(back)["x.y"], np.ones(2))
    assert len(load_file(str(tmp_path / "s.safetensors"))) == 2  # distinct tensor names


def test_fn_transform_roundtrip(tmp_path) -> None:
    tree = {"w": np.arange(6.0).reshape(3, 2), "f": st.Tied("w", st.fn(jnp.flipud))}
    st.save(tmp_path / "f.safetensors", tree)
    back = st.load(tmp_path / "f.safetensors", functions={"jax.numpy:flipud": jnp.flipud})
    assert back["f"] == st.Tied("w", st.fn(jnp.flipud))
    np.testing.assert_array_equal(st.materialize(back)["f"], np.flipud(tree["w"]))


def test_gradient_of_loaded_tree_matches_original(tmp_path) -> None:
    st.save(tmp_path / "g.safetensors", TIED)
    back = st.load(tmp_path / "g.safetensors")

    def loss(t):
        m = st.materialize(t)
        return jnp.sum(m["head"] ** 2) + jnp.sum(m["dec"]["w"] * m["flat"].reshape(4, 3)[:2])

    grad = jax.jit(jax.grad(loss))
    g_ref = grad(jax.tree.map(jnp.asarray, TIED))
    g_back = grad(jax.tree.map(jnp.asarray, back))
    for x, y in zip(jax.tree.leaves(g_back), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(x, y)


leaf_arrays = hs.builds(
    lambda shape, seed: np.random.default_rng(seed).normal(size=shape).astype(np.float32),
    hs.lists(hs.integers(1, 3), min_size=0, max_size=2).map(tuple),
    hs.integers(0, 2**16),
)


trees = hs.recursive(
    leaf_arrays | hs.sampled_from([None, 0, 1.5, "s", True]),
    lambda kids: (
        hs.lists(kids, max_size=3)
        | hs.lists(kids, max_size=3).map(tuple)
        | hs.dictionaries(hs.sampled_from(["a", "b", "c.d", "e"]), kids, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=examples(30), deadline=None)
@given(tree=trees, data=hs.data())
def test_roundtrip_property(tmp_path_factory, tree, data) -> None:
    # tie some later array leaves to earlier arrays of the same shape (identity) or
    # to their transpose, as a user would, then save and load
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    arrays = [
        ("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp), x)
        for kp, x in flat
        if isinstance(x, np.ndarray)
    ]
    ties = {}
    for i, (p, x) in enumerate(arrays):
        if i and data.draw(hs.booleans()):
            q, y = arrays[data.draw(hs.integers(0, i - 1))]
            if q in ties:
                continue
            if y.shape == x.shape:
                ties[p] = st.Tied(q)
            elif y.shape == x.shape[::-1]:
                ties[p] = st.Tied(q, st.T)
    try:
        tree = st.tie(tree, ties) if ties else tree
    except st.TieError as e:  # a ref from the root that a subtree holding the tie shadows
        assert "innermost subtree holding the tie" in str(e)
        reject()
    path = tmp_path_factory.mktemp("prop") / "t.safetensors"
    st.save(path, tree)
    back = st.load(path)
    assert_same_tree(back, tree)
    assert len(load_file(str(path))) == st.canonicalize(tree).num_unique - sum(
        not isinstance(x, np.ndarray) for x in jax.tree.leaves(tree)
    )


def test_prng_keys_round_trip(tmp_path) -> None:
    tree = {
        "k": jax.random.key(0),
        "rbg": jax.random.split(jax.random.key(1, impl="rbg"), 3),
        "unsafe": jax.random.key(2, impl="unsafe_rbg"),
        "old": jax.random.PRNGKey(3),  # a plain uint32 array
        "alias": st.Tied("k"),
    }
    st.save(tmp_path / "k.safetensors", tree)
    back = st.load(tmp_path / "k.safetensors")
    for name in ("k", "rbg", "unsafe"):
        assert back[name].dtype == tree[name].dtype and back[name].shape == tree[name].shape
        assert str(jax.random.key_impl(back[name])) == str(jax.random.key_impl(tree[name]))
        np.testing.assert_array_equal(
            jax.random.key_data(back[name]), jax.random.key_data(tree[name])
        )
        # the same random numbers
        np.testing.assert_array_equal(
            jax.random.uniform(jax.random.fold_in(back[name].reshape(-1)[0], 7), (3,)),
            jax.random.uniform(jax.random.fold_in(tree[name].reshape(-1)[0], 7), (3,)),
        )
    _, meta = read_raw(tmp_path / "k.safetensors")
    assert meta["sharetree.format_version"] == "2"  # a version-1 reader would misread the keys
    assert isinstance(back["old"], np.ndarray) and back["old"].dtype == np.uint32
    np.testing.assert_array_equal(back["old"], tree["old"])
    assert back["alias"] == st.Tied("k")
    assert st.materialize(back)["alias"] is back["k"]


# ----------------------------------------------------- other node types: like=


@flax.struct.dataclass
class Dense:
    kernel: Any
    bias: Any
    features: int = flax.struct.field(pytree_node=False, default=0)


@flax.struct.dataclass
class AutoEncoder:
    enc: Dense
    dec: Any


class Pair(NamedTuple):
    left: Any
    right: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Box:
    value: Any
    scale: float


def flax_model() -> AutoEncoder:
    return AutoEncoder(
        enc=Dense(np.arange(6.0, dtype=np.float32).reshape(2, 3), np.zeros(3, np.float32), 3),
        dec=Dense(st.Tied("enc/kernel", st.T), np.ones(2, np.float32), 2),
    )


def test_flax_struct_with_like(tmp_path) -> None:
    model = flax_model()
    st.save(tmp_path / "f.safetensors", model)
    template = jax.eval_shape(lambda: model)  # abstract: ShapeDtypeStructs, same ties
    back = st.load(tmp_path / "f.safetensors", like=template)
    assert type(back) is AutoEncoder and type(back.enc) is Dense
    assert back.dec.kernel == st.Tied("enc/kernel", st.T)
    assert back.enc.features == 3 and back.dec.features == 2  # static fields from the template
    assert_same_tree(back, model)


def test_flax_struct_without_like_is_dicts_with_warning(tmp_path) -> None:
    model = flax_model()
    st.save(tmp_path / "f.safetensors", model)
    with warns("E130", "f.safetensors", "AutoEncoder at '<root>'", "like=template"):
        back = st.load(tmp_path / "f.safetensors")
    assert set(back) == {"enc", "dec"} and set(back["enc"]) == {"kernel", "bias"}
    assert back["dec"]["kernel"] == st.Tied("enc/kernel", st.T)  # same paths, same ties
    np.testing.assert_array_equal(st.materialize(back)["dec"]["kernel"], model.enc.kernel.T)


def test_equinox_module_needs_like_for_its_functions(tmp_path) -> None:
    mlp = eqx.nn.MLP(3, 3, 4, 1, key=jax.random.key(0))
    tied = st.tie(mlp, {"layers/1/weight": st.Tied("layers/0/weight", st.T)})
    st.save(tmp_path / "e.safetensors", tied)
    with raises("E129", "e.safetensors", "activation", "like=model"):
        st.load(tmp_path / "e.safetensors")
    # a template: the same module, other values (as a fresh init would give)
    fresh = jax.tree.map(lambda x: np.zeros_like(x) if eqx.is_array(x) else x, tied)
    back = st.load(tmp_path / "e.safetensors", like=fresh)
    assert type(back) is eqx.nn.MLP and back.activation is fresh.activation
    assert back.layers[1].weight == st.Tied("layers/0/weight", st.T)
    x = jnp.arange(3.0)
    np.testing.assert_allclose(st.materialize(back)(x), st.materialize(tied)(x), rtol=1e-6)


def test_namedtuple_and_dataclass_with_like(tmp_path) -> None:
    tree = {"p": Pair(np.ones((2, 2)), st.Tied("b/value")), "b": Box(np.eye(2), 0.5)}
    st.save(tmp_path / "n.safetensors", tree)
    back = st.load(tmp_path / "n.safetensors", like=tree)
    assert type(back["p"]) is Pair and type(back["b"]) is Box
    assert_same_tree(back, tree)
    with warns("E130", "Pair", "'p'"):
        plain = st.load(tmp_path / "n.safetensors")
    assert plain["p"]["right"] == st.Tied("b/value") and plain["b"]["scale"] == 0.5


def test_like_shape_mismatch_names_path(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    like = dict(TIED, embed=np.zeros((5, 3), np.float32))
    with raises("E128", "at 'embed'", "float32[4, 3] in the file", "float32[5, 3] in the template"):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_dtype_mismatch_names_path(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    like = dict(TIED, enc={"w": np.ones((2, 3), np.float64), "b": np.zeros(3, np.float32)})
    with raises("E128", "'enc/w'", "float32[2, 3] in the file", "float64[2, 3] in the template"):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_missing_and_extra_paths(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    like = {k: v for k, v in TIED.items() if k != "flat"} | {"extra": np.ones(1)}
    with raises("E128", "m.safetensors", "only in the file: ['flat']", "template: ['extra']"):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_untied_template_gets_the_fix(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", {"a": np.ones((2, 3)), "b": st.Tied("a", st.T)})
    like = {"a": np.ones((2, 3)), "b": np.ones((3, 2))}
    with raises("E128", "'b'", "Tied('a', T)", "st.tie(template, {'b': Tied('a', T)})"):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_different_transform(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", {"a": np.ones((2, 2)), "b": st.Tied("a", st.T)})
    with raises("E128", "'b'", "Tied('a', T) in the file", "Tied('a') in the template"):
        st.load(tmp_path / "m.safetensors", like={"a": np.ones((2, 2)), "b": st.Tied("a")})


# -------------------------------- arguments and files that are not sharetree's


@pytest.mark.parametrize("path", [3, None, ["m.safetensors"], "", "m\0.safetensors"])
def test_a_path_that_names_no_file_is_a_tie_error(tmp_path, path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, TIED)
    for verb, call in [
        ("save", lambda: st.save(path, TIED)),
        ("load", lambda: st.load(path)),
        ("inspect", lambda: describe(path)),
        ("read_metadata", lambda: read_metadata(path)),
    ]:
        with raises("E49", f"{verb}: the path", "e.g. 'model.safetensors'"):
            call()
    assert os.listdir(tmp_path) == ["g.safetensors"]  # save wrote nothing, not even beside cwd
    raw = os.fsencode(good)  # bytes are a path, as for open()
    st.save(raw, TIED)
    assert_same_tree(st.load(raw), TIED)
    assert "sharing graph" in describe(raw)


def test_keywords_of_the_wrong_type_are_tie_errors(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    for gather in ("no", None, 1):
        with raises("E55", "save: gather=", "True or False", cls=st.TieTypeError):
            st.save(path, TIED, gather=gather)
    assert not path.exists()
    st.save(path, TIED, gather=np.bool_(False))
    with raises("E55", "load: functions=", "a mapping", "found list", cls=st.TieTypeError):
        st.load(path, functions=["jax.numpy:flipud"])
    for rows in ("3", 0, 2.0):
        with raises("E55", "inspect", "max_rows", ">= 1"):
            describe(path, max_rows=rows)


def test_missing_file_is_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        st.load(tmp_path / "nope.safetensors")


def test_directory_is_tie_error(tmp_path) -> None:
    with raises("E47", str(tmp_path), "model.safetensors", "Orbax"):
        st.load(tmp_path)


def test_empty_file(tmp_path) -> None:
    (tmp_path / "e.safetensors").write_bytes(b"")
    with raises("E120", "e.safetensors", "not a readable safetensors file"):
        st.load(tmp_path / "e.safetensors")


def test_truncated_file(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    data = (tmp_path / "m.safetensors").read_bytes()
    for cut in (4, 40, len(data) // 2, len(data) - 1):
        (tmp_path / "t.safetensors").write_bytes(data[:cut])
        with raises("E120", "t.safetensors", "not a readable safetensors file"):
            st.load(tmp_path / "t.safetensors")


def test_garbage_file(tmp_path) -> None:
    rng = np.random.default_rng(0)
    for blob in (b"PK\x03\x04 a zip file" * 20, rng.bytes(5000), b"\xff" * 8 + b"{}"):
        (tmp_path / "g.safetensors").write_bytes(blob)
        with raises("E120", "g.safetensors", "not a readable safetensors file"):
            st.load(tmp_path / "g.safetensors")


def test_bad_file_never_returns_partial_tree(tmp_path) -> None:
    # every damaged variant raises TieError: the CLI can print one line for each
    good = tmp_path / "m.safetensors"
    st.save(good, TIED)
    data = good.read_bytes()
    outcomes = collections.Counter()
    for i in range(0, len(data), max(1, len(data) // 40)):
        damaged = bytearray(data)
        damaged[i] ^= 0xFF
        (tmp_path / "d.safetensors").write_bytes(bytes(damaged))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = st.load(tmp_path / "d.safetensors")
        except st.TieError:
            outcomes["error"] += 1
            continue
        # a flipped byte inside tensor data is undetectable (no checksum in safetensors),
        # and one in the version key makes a foreign file; either way the tree is whole
        if jax.tree.structure(out) == jax.tree.structure(TIED):
            outcomes["same structure"] += 1
        else:
            assert set(out) == {"embed", "enc/b", "enc/w"}, out
            assert all(isinstance(v, np.ndarray) for v in out.values())
            outcomes["foreign"] += 1
    assert outcomes["error"] > 0 and outcomes["same structure"] > 0


def test_foreign_file_loads_as_flat_dict_with_warning(tmp_path) -> None:
    emb = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    save_file({"model.embed.weight": emb, "lm_head.weight": emb.copy()}, str(tmp_path / "f.st"))
    with warns("E142", "f.st", "sharetree.format_version", "2 arrays"):
        back = st.load(tmp_path / "f.st")
    assert set(back) == {"model.embed.weight", "lm_head.weight"}
    np.testing.assert_array_equal(back["lm_head.weight"], emb)
    with raises("E141", "f.st", "like"):
        st.load(tmp_path / "f.st", like={"a": emb})


def test_foreign_file_with_float8_is_read_raw(tmp_path) -> None:
    # this safetensors' numpy reader cannot make float8 arrays; the raw fallback can
    a = np.linspace(-2, 2, 6).astype(ml_dtypes.float8_e4m3fn).reshape(2, 3)
    save_file({"w": a}, str(tmp_path / "f8.st"))
    with warns("E142", "f8.st"):
        back = st.load(tmp_path / "f8.st")
    assert back["w"].dtype == a.dtype and back["w"].tobytes() == a.tobytes()


def test_foreign_files_take_shardings_too(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"emb": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)}, str(path))
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with warns("E142", "model.safetensors", "'head' <- 'emb'"):
        back = st.load(path, ties={"head": "emb"}, shardings={"emb": s, "b": None, "head": None})
    assert isinstance(back["emb"], jax.Array) and back["emb"].sharding == s
    assert isinstance(back["b"], np.ndarray) and back["head"] == st.Tied("emb")
    with raises("E35", "model.safetensors", "without a sharding: ['b']"):
        st.load(path, shardings={"emb": s})  # refused before anything is read: no warning


def test_a_pretrained_directory_holding_a_sharetree_file_is_not_read_flat(tmp_path) -> None:
    st.save(tmp_path / "model.safetensors", TIED)
    with raises(
        "E53", "'model.safetensors'", "st.save", f"st.load({str(tmp_path / 'model.safetensors')!r})"
    ):
        st.load(tmp_path)
    assert_same_tree(st.load(tmp_path / "model.safetensors"), TIED)


def test_atol_without_ties_for_a_foreign_file_is_a_tie_error(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"emb": np.ones((3, 2), np.float32)}, str(path))
    for atol in (1e-6, "x"):
        with raises("E60", "load: atol=", "without ties=", "ties="):
            st.load(path, atol=atol)


# ----------------------------------------------- ties and transforms of a file


def test_unknown_transform_name(tmp_path) -> None:
    def rename(tensors, meta, structure):
        i = structure["keys"].index("head")
        structure["children"][i]["transform"] = {"name": "rotate90"}

    bad = tampered(tmp_path, TIED, rename)
    with raises("E17", "bad.safetensors", "node 'head', field 'transform'", "'rotate90'"):
        st.load(bad)


def test_unimportable_fn_transform(tmp_path) -> None:
    def rename(tensors, meta, structure):
        i = structure["keys"].index("head")
        structure["children"][i]["transform"] = {"name": "fn", "function": "no_such_mod:f"}

    bad = tampered(tmp_path, TIED, rename)
    with raises(
        "E21",
        "bad.safetensors",
        "node 'head', field 'transform'",
        "'no_such_mod:f'",
        "st.load(path, functions={'no_such_mod:f': f})",
    ):
        st.load(bad)


def test_dangling_ref_in_file(tmp_path) -> None:
    def dangle(tensors, meta, structure):
        i = structure["keys"].index("head")
        structure["children"][i]["ref"] = ["embedd"]

    with raises("E1", "bad.safetensors", "'embedd'", "'head'", "'embed'"):
        st.load(tampered(tmp_path, TIED, dangle))


def test_a_file_with_a_transform_not_registered_here_says_to_import_it_and_inspect_shows_it(
    tmp_path,
) -> None:
    def rename(tensors, meta, structure):
        i = structure["keys"].index("head")
        spec = {"name": "mylib_rotate", "k": 3}
        structure["children"][i]["transform"] = {
            "name": "chain",
            "parts": [spec, {"name": "transpose", "axes": None}],
        }

    bad = tampered(tmp_path, TIED, rename)
    with raises(
        "E17", "node 'head', field 'transform'", "'mylib_rotate'", "import (or define) the class"
    ):
        st.load(bad)
    text = describe(bad)  # the graph, the spec as it is, nothing called
    row = next(line for line in text.splitlines() if line.split()[:2] == ["head", "embed"])
    assert '{"name":"mylib_rotate","k":3} >> T' in row
    assert "not registered in this process" in text


def test_a_files_huge_key_is_not_echoed_whole(tmp_path) -> None:
    # a key of 200,000 characters in a bad graph: the message keeps what failed and the fix
    from sharetree.__main__ import describe

    def edit(tensors, meta, structure) -> None:
        structure["keys"][1] = "A" * 200_000  # the tie at 'v' is renamed...
        structure["children"][1]["ref"] = ["nope"]  # ...and refers to nothing

    bad = tampered(tmp_path, {"k": np.ones(2), "v": st.Tied("k")}, edit)
    for read in (st.load, describe):
        with pytest.raises(st.TieError) as info:
            read(bad)
        text = str(info.value)
        assert len(text) <= 4100 and "characters cut" in text
        assert text.startswith("[E") and "'nope'" in text and "Fix:" in text


# -------------------------------------------------------- loading runs no code


SIDE_EFFECT_MODULE = "sharetree_test_sidefx_mod"


def _fn_file(tmp_path: Any, name: str) -> str:
    """A saved TIED whose 'head' tie names the function ``name``."""

    def edit(tensors, meta, structure):
        i = structure["keys"].index("head")
        structure["children"][i]["transform"] = {"name": "fn", "function": name}

    return tampered(tmp_path, TIED, edit)


@pytest.fixture
def side_effect_module(tmp_path, monkeypatch):
    """A module on sys.path whose import writes a marker file."""
    marker = tmp_path / "imported.marker"
    code = f"open({str(marker)!r}, 'w').write('x')\ndef f(x):\n    return x\n"
    (tmp_path / f"{SIDE_EFFECT_MODULE}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, SIDE_EFFECT_MODULE, raising=False)
    return marker


@pytest.mark.parametrize(
    "name", ["sys:exit", "os:system", "builtins:exec", f"{SIDE_EFFECT_MODULE}:f"]
)
def test_load_never_imports_or_calls_a_named_function(
    tmp_path, monkeypatch, side_effect_module, name
) -> None:
    bad = _fn_file(tmp_path, name)
    imported: list[str] = []
    real_import = builtins.__import__
    real_import_module = importlib.import_module

    def record_import(mod, *args, **kwargs):
        imported.append(mod)
        return real_import(mod, *args, **kwargs)

    def record_import_module(mod, *args, **kwargs):
        imported.append(mod)
        return real_import_module(mod, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", record_import)
    monkeypatch.setattr(importlib, "import_module", record_import_module)
    module = name.partition(":")[0]
    with raises(
        "E21", "bad.safetensors", "node 'head', field 'transform'", f"'{name}'", "functions={"
    ):
        st.load(bad)
    text = describe(bad)  # inspect shows the name, calls nothing
    assert f"fn({name})" in text
    monkeypatch.undo()
    assert SIDE_EFFECT_MODULE not in sys.modules
    assert not side_effect_module.exists()
    assert module not in imported or module in ("sys", "os", "builtins")  # never by our hand
    assert SIDE_EFFECT_MODULE not in imported


def test_load_with_functions_calls_only_the_given_function(tmp_path) -> None:
    calls: list[Any] = []

    def flip(x):
        calls.append(x.shape)
        return jnp.flipud(x)

    bad = _fn_file(tmp_path, "mylib.ops:flip")
    back = st.load(bad, functions={"mylib.ops:flip": flip})
    assert back["head"] == st.Tied("embed", st.fn(flip))
    calls.clear()
    np.testing.assert_array_equal(st.materialize(back)["head"], np.flipud(TIED["embed"]))
    assert calls == [(4, 3), (4, 3)]  # head, and flat (a reshape of head)


# ------------- describe (python -m sharetree inspect) reads with read_contents


def test_describe_a_sharetree_file(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    tree = {
        "w": np.ones((2, 3), np.float32),
        "t": st.Tied("w", st.T),
        "f": st.Tied("w", st.T >> st.fn(jnp.flipud)),
    }
    st.save(path, tree)
    text = describe(path)
    lines = text.splitlines()
    assert (
        lines[0] == f"{path}: {os.path.getsize(path):,} bytes, sharetree format 1 (written by "
        f"sharetree {st.__version__})"
    )
    # the summary of the same graph, independently built from the tree itself (the fn view
    # aside, whose shape describe does not compute)
    expected = st.summary({"w": tree["w"], "t": tree["t"]}).splitlines()
    assert "  w     (2, 3)  float32  24 B   2" in lines
    assert any(ln.split() == ["t", "w", "T", "(3,", "2)", "float32", "24", "B"] for ln in lines)
    assert any(ln.split()[:5] == ["f", "w", "T", ">>", "fn(jax.numpy:flipud)"] for ln in lines)
    assert lines[1] == "sharing graph: 1 buffer, 2 views" and expected[0].startswith("sharing")
    assert "not imported or called" in lines[-1]


def test_describe_reads_no_tensor_data(tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    monkeypatch.setattr(container.Reader, "tensors", lambda self: pytest.fail("read data"))
    # the same text as the summary of the tree that was saved
    assert describe(path, max_rows=3).splitlines()[1:] == st.summary(TIED, max_rows=3).splitlines()


def test_describe_a_foreign_file_and_problems(tmp_path) -> None:
    path = tmp_path / "torch.safetensors"
    save_file({"a": np.ones(3), "b": np.zeros((2, 2), np.float32)}, str(path))
    text = describe(path)
    assert "not written by sharetree" in text and "2 tensors, 40 B of tensor data" in text
    assert text.splitlines()[1:] == ["  a  F64[3]", "  b  F32[2, 2]", "ties it shows: none"]
    save_file({"evil\x1b[2J\nname": np.ones(1)}, str(path))
    text = describe(path)  # a name from the file never moves the terminal
    assert text.count("\n") == 2 and "evil\\x1b[2J\\nname" in text and "\x1b" not in text
    for bad in (tmp_path / "missing.safetensors", tmp_path):  # __main__'s errors
        with pytest.raises(st.TieError) as e:
            describe(bad)
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 100)
    with raises("E120", "garbage.safetensors", "not a readable safetensors file") as e:
        describe(tmp_path / "garbage.safetensors")
    assert "\n" not in str(e.value)
    deep = tampered(tmp_path, TIED, lambda t, m, s: s.update(x=[[[[[[[[]]]]]]]]))
    describe(deep)  # an unknown extra field is ignored, like load does
    dangling = tampered(
        tmp_path,
        TIED,
        lambda t, m, s: s["children"][s["keys"].index("head")].update(ref=["embedd"]),
    )
    with pytest.raises(st.TieError) as e:
        describe(dangling)
    assert "inspect" in message(e.value) and "'embedd'" in message(e.value)
    assert "\n" not in str(e.value)


def test_describe_a_foreign_file_shows_the_ties_its_metadata_records(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"emb": np.ones((3, 2), np.float32)}, str(path), metadata={"head": "emb"})
    assert "  head <- emb: recorded in its metadata" in describe(path).splitlines()
    with warns("E142", "m.safetensors", "'head' <- 'emb'"):
        assert st.load(path)["head"] == st.Tied("emb")


# ------------------------------------------------------------------- shardings


def test_load_with_shardings_places_each_buffer(tmp_path) -> None:
    dev = jax.devices()[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    shardings = jax.tree.map(lambda x: s, TIED)  # Tied positions keep their Tied
    back = st.load(path, shardings=shardings)
    assert isinstance(back["embed"], jax.Array) and back["embed"].sharding == s
    assert back["head"] == TIED["head"]
    assert_same_tree(jax.device_get(back), TIED)
    partial = {**shardings, "enc": {"w": s, "b": None}}  # None: stays on the host
    assert isinstance(st.load(path, shardings=partial)["enc"]["b"], np.ndarray)
    with raises("E35", "m.safetensors", "without a sharding: ['enc/b']", "jax.tree.map"):
        st.load(path, shardings={**shardings, "enc": {"w": s}})
    with raises("E35", "'embed'", "found str 'cpu'", cls=st.TieTypeError):
        st.load(path, shardings={**shardings, "embed": "cpu"})


_SHARDED_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import sharetree as st

mesh = jax.make_mesh((4, 2), ("data", "model"))
specs = {"embed": P("model", None), "mlp": {"w": P(None, "model"), "b": P()}, "head": None}
tree = {
    "embed": jnp.arange(64.0).reshape(16, 4),
    "mlp": {"w": jnp.ones((4, 8)), "b": jnp.zeros(8)},
    "head": st.Tied("embed", st.T),
}
shardings = {
    "embed": NamedSharding(mesh, specs["embed"]),
    "mlp": {"w": NamedSharding(mesh, specs["mlp"]["w"]), "b": NamedSharding(mesh, P())},
    "head": st.Tied("embed", st.T),
}
placed = jax.device_put(tree, shardings)
path = os.path.join(sys.argv[1], "sharded.safetensors")
st.save(path, placed, gather=True)  # one process: process_allgather is a local gather
back = st.load(path, shardings=shardings)
out = {
    "devices": len(jax.devices()),
    "head": repr(back["head"]),
    "same_sharding": [
        back["embed"].sharding == shardings["embed"],
        back["mlp"]["w"].sharding == shardings["mlp"]["w"],
        back["mlp"]["b"].sharding == shardings["mlp"]["b"],
    ],
    "shards_of_embed": len(back["embed"].addressable_shards),
    "equal": bool(np.array_equal(np.asarray(back["embed"]), np.arange(64.0).reshape(16, 4))),
    "head_value": bool(np.array_equal(np.asarray(st.materialize(back)["head"]),
                                      np.arange(64.0).reshape(16, 4).T)),
}
print(json.dumps(out))
"""


def test_sharded_save_and_load_on_8_simulated_devices(tmp_path) -> None:
    import subprocess

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "devices": 8,
        "head": "Tied('embed', T)",
        "same_sharding": [True, True, True],
        "shards_of_embed": 8,
        "equal": True,
        "head_value": True,
    }


def test_a_load_walks_down_the_files_package_once(tmp_path) -> None:
    """``st.load`` of a sharetree file, followed call by call (``sys.setprofile``).

    Every call from one module of ``sharetree/_files`` into another goes down the table of
    the architecture page (to a module above the caller: never back up), ``load`` stops
    at each module it uses once (the path the page draws), and the header is parsed once.
    """
    import pathlib
    import sys

    from test_layout import FILES_ORDER

    package = str(pathlib.Path(st.__file__).parent / "_files") + "/"
    root = str(pathlib.Path(st.__file__).parent) + "/"
    rank = {m: i for i, m in enumerate(FILES_ORDER)}
    path = tmp_path / "m.safetensors"
    tree = {"emb": np.ones((3, 2), np.float32), "head": st.Tied("emb", st.T), "b": [np.zeros(2)]}
    st.save(path, tree)
    calls = []

    def module(frame):
        name = frame.f_code.co_filename
        return name[len(package) : -3] if name.startswith(package) else None

    def profile(frame, event, arg):
        if event != "call" or module(frame) is None:
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(root):
            caller = caller.f_back  # through the standard library and json's hooks
        if caller is not None and module(caller) != module(frame):
            calls.append((module(caller), module(frame), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        back = st.load(path)
    finally:
        sys.setprofile(None)
    assert back["head"] == st.Tied("emb", st.T)
    ups = [c for c in calls if c[0] is not None and rank[c[1]] > rank[c[0]]]
    assert not ups, f"calls back up the files package: {ups}"
    from_load = [(callee, fn) for caller, callee, fn in calls if caller == "load"]
    assert [callee for callee, _ in from_load] == ["disk", "container", "header", "reads"]
    assert [fn for _, fn in from_load] == ["file_path", "__init__", "read_header", "read_tree"]
    assert sum(fn == "__init__" and callee == "container" for _, callee, fn in calls) == 1
