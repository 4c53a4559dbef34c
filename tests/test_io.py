"""st.save / st.load: one safetensors file, each buffer once, ties and structure in the metadata."""

from __future__ import annotations

import builtins
import collections
import dataclasses
import importlib
import json
import os
import re
import stat
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
from hypothesis import given, reject, settings
from hypothesis import strategies as hs
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import sharetree as st
from sharetree import _io, _safetensors
from sharetree.__main__ import describe

# ----------------------------------------------------------------------------- helpers


def read_raw(path: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The file as another safetensors reader sees it: tensors and metadata."""
    with safe_open(str(path), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def assert_same_tree(a: Any, b: Any) -> None:
    """Same structure (so the same Tied nodes), same leaf types, same values and dtypes."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"{ta}\n!=\n{tb}"
    for x, y in zip(la, lb, strict=True):
        if isinstance(y, (jax.Array, np.ndarray, np.generic)):
            assert isinstance(x, (np.ndarray, np.generic))
            assert x.dtype == y.dtype and np.shape(x) == np.shape(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert type(x) is type(y)
            assert x == y or (x != x and y != y)  # NaN


def write_with_metadata(
    path: Any, tensors: dict[str, np.ndarray], metadata: dict[str, str]
) -> None:
    save_file(tensors, str(path), metadata=metadata)


def tampered(tmp_path: Any, tree: Any, edit: Any) -> str:
    """Save ``tree``, then rewrite the file with ``edit(tensors, metadata, structure)`` applied."""
    good = tmp_path / "good.safetensors"
    st.save(good, tree)
    tensors, meta = read_raw(good)
    structure = json.loads(meta["sharetree.tree"])
    edit(tensors, meta, structure)
    meta["sharetree.tree"] = json.dumps(structure)
    bad = tmp_path / "bad.safetensors"
    write_with_metadata(bad, tensors, meta)
    return str(bad)


TIED = {
    "embed": np.arange(12.0, dtype=np.float32).reshape(4, 3),
    "head": st.Tied("embed", st.T),
    "enc": {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)},
    "dec": st.Tied("enc", st.scale(-1.0)),  # a whole subtree
    "flat": st.Tied("head", st.reshape(12)),  # a chain through another tie
    "cast": st.Tied("enc/w", st.T >> st.astype(jnp.bfloat16)),
}

# ----------------------------------------------------------------------------- round trips


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


def test_each_buffer_stored_once(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    g = st.canonicalize(TIED)
    tensors = load_file(str(path))  # safetensors' own reader: no sharetree involved
    assert sorted(tensors) == ["embed", "enc/b", "enc/w"]
    assert len(tensors) == g.num_unique < g.num_expanded
    assert sum(t.nbytes for t in tensors.values()) == g.nbytes_unique
    np.testing.assert_array_equal(tensors["embed"], TIED["embed"])
    # the data section is the unique bytes only (views are not stored)
    header = os.path.getsize(path) - g.nbytes_unique
    assert 0 < header < 4096


def test_metadata_keys_and_version(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    _, meta = read_raw(path)
    assert meta["sharetree.format_version"] == "1" and _io.FORMAT_VERSION == 2
    assert meta["sharetree.library_version"] == st.__version__
    tree = json.loads(meta["sharetree.tree"])
    assert tree["t"] == "dict"
    kids = dict(zip(tree["keys"], tree["children"], strict=True))
    assert kids["head"] == {
        "t": "tied",
        "ref": ["embed"],
        "transform": {"name": "transpose", "axes": None},
    }
    assert kids["embed"]["t"] == "buffer" and kids["embed"]["tensor"] == "embed"


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


def test_bfloat16_is_stored_natively_for_other_readers(tmp_path) -> None:
    a = np.arange(4, dtype=jnp.bfloat16)
    st.save(tmp_path / "b.safetensors", {"a": a, "c": np.ones(2, np.complex128)})
    with open(tmp_path / "b.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert header["a"]["dtype"] == "BF16"  # readable by torch & co as bfloat16
    assert header["c"]["dtype"] == "U8"  # no safetensors code: raw bytes, dtype in metadata


def test_float8_is_stored_natively_so_torch_reads_its_dtype_and_shape(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    a = np.linspace(-2, 2, 6).astype(ml_dtypes.float8_e4m3fn).reshape(2, 3)
    tree = {"a": a, "b": np.ones(3, ml_dtypes.float8_e5m2), "t": st.Tied("a", st.T)}
    tree["fnuz"] = np.ones(2, ml_dtypes.float8_e4m3fnuz)  # no code every safetensors writes
    st.save(tmp_path / "f8.safetensors", tree)
    got = load_file(tmp_path / "f8.safetensors")
    assert (got["a"].dtype, tuple(got["a"].shape)) == (torch.float8_e4m3fn, (2, 3))
    assert (got["b"].dtype, tuple(got["b"].shape)) == (torch.float8_e5m2, (3,))
    assert got["a"].view(torch.uint8).numpy().tobytes() == a.tobytes()
    assert got["fnuz"].dtype == torch.uint8  # its raw bytes; the metadata has the dtype
    back = st.load(tmp_path / "f8.safetensors")
    assert back["a"].dtype == a.dtype and back["a"].tobytes() == a.tobytes()
    assert back["fnuz"].dtype == ml_dtypes.float8_e4m3fnuz and back["t"] == tree["t"]


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


# ----------------------------------------------------------------------------- other node types


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
    with pytest.warns(UserWarning, match=r"AutoEncoder.*like=template"):
        back = st.load(tmp_path / "f.safetensors")
    assert set(back) == {"enc", "dec"} and set(back["enc"]) == {"kernel", "bias"}
    assert back["dec"]["kernel"] == st.Tied("enc/kernel", st.T)  # same paths, same ties
    np.testing.assert_array_equal(st.materialize(back)["dec"]["kernel"], model.enc.kernel.T)


def test_equinox_module_needs_like_for_its_functions(tmp_path) -> None:
    mlp = eqx.nn.MLP(3, 3, 4, 1, key=jax.random.key(0))
    tied = st.tie(mlp, {"layers/1/weight": st.Tied("layers/0/weight", st.T)})
    st.save(tmp_path / "e.safetensors", tied)
    with pytest.raises(st.TieError, match=r"activation.*like=model"):
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
    with pytest.warns(UserWarning, match="Pair"):
        plain = st.load(tmp_path / "n.safetensors")
    assert plain["p"]["right"] == st.Tied("b/value") and plain["b"]["scale"] == 0.5


def test_like_shape_mismatch_names_path(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    like = dict(TIED, embed=np.zeros((5, 3), np.float32))
    with pytest.raises(st.TieError, match=r"at 'embed'.*float32\[4, 3\].*float32\[5, 3\]"):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_dtype_mismatch_names_path(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    like = dict(TIED, enc={"w": np.ones((2, 3), np.float64), "b": np.zeros(3, np.float32)})
    with pytest.raises(st.TieError, match=r"'enc/w'.*float32.*float64"):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_missing_and_extra_paths(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    like = {k: v for k, v in TIED.items() if k != "flat"} | {"extra": np.ones(1)}
    with pytest.raises(
        st.TieError, match=r"only in the file: \['flat'\].*only in the template: \['extra'\]"
    ):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_untied_template_gets_the_fix(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", {"a": np.ones((2, 3)), "b": st.Tied("a", st.T)})
    like = {"a": np.ones((2, 3)), "b": np.ones((3, 2))}
    with pytest.raises(
        st.TieError, match=r"'b'.*Tied\('a', T\).*st\.tie\(template, \{'b': Tied\('a', T\)\}\)"
    ):
        st.load(tmp_path / "m.safetensors", like=like)


def test_like_different_transform(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", {"a": np.ones((2, 2)), "b": st.Tied("a", st.T)})
    with pytest.raises(st.TieError, match=r"'b'.*Tied\('a', T\).*Tied\('a'\)"):
        st.load(tmp_path / "m.safetensors", like={"a": np.ones((2, 2)), "b": st.Tied("a")})


# ----------------------------------------------------------------------------- atomic writes


def test_failed_write_leaves_previous_file_intact(tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()

    def half_then_fail(tensors, filename, metadata):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{partial")  # a torn write
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_safetensors, "_serialize_file", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        st.save(path, {"other": np.zeros(100)})
    assert path.read_bytes() == before
    assert_same_tree(st.load(path), TIED)
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]  # no temporary file left behind


def test_interrupted_write_leaves_previous_file_intact(tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    real = _safetensors._serialize_file

    def write_then_interrupt(tensors, filename, metadata):
        real(tensors, filename, metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(_safetensors, "_serialize_file", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        st.save(path, {"x": np.ones(1000)})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_new_file_and_overwrite_have_normal_permissions(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, {"a": np.ones(2)})
    st.save(path, {"a": np.zeros(3)})  # overwrite by rename
    np.testing.assert_array_equal(st.load(path)["a"], np.zeros(3))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_save_errors_write_nothing(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    with pytest.raises(st.TieError, match=r"'v'.*cannot be written to a file"):
        st.save(path, {"w": np.ones(2), "v": st.Tied("w", st.fn(lambda x: x + 1))})
    with pytest.raises(st.TieError, match=r"key \(1, 2\) of type tuple"):
        st.save(path, {"d": {(1, 2): np.ones(1)}})
    with pytest.raises(st.TieError, match=r"'s'.*dtype <U3"):
        st.save(path, {"s": np.array(["abc"])})
    with pytest.raises(st.TieError, match=r"does not exist.*closest.*'enc'"):
        st.save(path, {"enc": np.ones(2), "dec": st.Tied("encc")})
    assert not path.exists() and os.listdir(tmp_path) == []


def test_save_under_jit_is_an_error(tmp_path) -> None:
    def f(x):
        st.save(tmp_path / "j.safetensors", {"x": x})
        return x

    with pytest.raises(st.TieError, match=r"'x'.*no concrete value.*traced"):
        jax.jit(f)(jnp.ones(2))


# ----------------------------------------------------------------------------- bad files


def test_missing_file_is_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        st.load(tmp_path / "nope.safetensors")


def test_directory_is_tie_error(tmp_path) -> None:
    with pytest.raises(st.TieError, match=r"is a directory.*Orbax"):
        st.load(tmp_path)


def test_empty_file(tmp_path) -> None:
    (tmp_path / "e.safetensors").write_bytes(b"")
    with pytest.raises(st.TieError, match=r"not a readable safetensors file.*empty, truncated"):
        st.load(tmp_path / "e.safetensors")


def test_truncated_file(tmp_path) -> None:
    st.save(tmp_path / "m.safetensors", TIED)
    data = (tmp_path / "m.safetensors").read_bytes()
    for cut in (4, 40, len(data) // 2, len(data) - 1):
        (tmp_path / "t.safetensors").write_bytes(data[:cut])
        with pytest.raises(st.TieError, match="not a readable safetensors file"):
            st.load(tmp_path / "t.safetensors")


def test_garbage_file(tmp_path) -> None:
    rng = np.random.default_rng(0)
    for blob in (b"PK\x03\x04 a zip file" * 20, rng.bytes(5000), b"\xff" * 8 + b"{}"):
        (tmp_path / "g.safetensors").write_bytes(blob)
        with pytest.raises(st.TieError, match="not a readable safetensors file"):
            st.load(tmp_path / "g.safetensors")


def test_foreign_file_loads_as_flat_dict_with_warning(tmp_path) -> None:
    emb = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    save_file({"model.embed.weight": emb, "lm_head.weight": emb.copy()}, str(tmp_path / "f.st"))
    with pytest.warns(UserWarning, match=r"not written by sharetree.*flat dict of 2 arrays"):
        back = st.load(tmp_path / "f.st")
    assert set(back) == {"model.embed.weight", "lm_head.weight"}
    np.testing.assert_array_equal(back["lm_head.weight"], emb)
    with pytest.raises(st.TieError, match=r"not written by sharetree.*without like"):
        st.load(tmp_path / "f.st", like={"a": emb})


def test_foreign_file_with_float8_is_read_raw(tmp_path) -> None:
    # this safetensors' numpy reader cannot make float8 arrays; the raw fallback can
    a = np.linspace(-2, 2, 6).astype(ml_dtypes.float8_e4m3fn).reshape(2, 3)
    save_file({"w": a}, str(tmp_path / "f8.st"))
    with pytest.warns(UserWarning, match="not written by sharetree"):
        back = st.load(tmp_path / "f8.st")
    assert back["w"].dtype == a.dtype and back["w"].tobytes() == a.tobytes()


def test_newer_format_version(tmp_path) -> None:
    def bump(tensors, meta, structure):
        meta["sharetree.format_version"] = "3"
        meta["sharetree.library_version"] = "9.0"

    bad = tampered(tmp_path, TIED, bump)
    with pytest.raises(
        st.TieError, match=r"format version 3, written by sharetree '9\.0'.*up to 2.*upgrade"
    ):
        st.load(bad)


def test_malformed_format_version(tmp_path) -> None:
    for version in ("one", "0", "000"):  # versions start at 1
        edit = lambda t, m, s, v=version: m.update({"sharetree.format_version": v})  # noqa: E731
        bad = tampered(tmp_path, TIED, edit)
        with pytest.raises(st.TieError, match=f"malformed format version '{version}'; expected"):
            st.load(bad)


def test_unknown_transform_name(tmp_path) -> None:
    def rename(tensors, meta, structure):
        i = structure["keys"].index("head")
        structure["children"][i]["transform"] = {"name": "rotate90"}

    bad = tampered(tmp_path, TIED, rename)
    with pytest.raises(st.TieError, match=r"tie at 'head'.*unknown transform name 'rotate90'"):
        st.load(bad)


def test_unimportable_fn_transform(tmp_path) -> None:
    def rename(tensors, meta, structure):
        i = structure["keys"].index("head")
        structure["children"][i]["transform"] = {"name": "fn", "function": "no_such_mod:f"}

    bad = tampered(tmp_path, TIED, rename)
    with pytest.raises(
        st.TieError,
        match=r"bad\.safetensors'.*tie at 'head'.*'no_such_mod:f' is not among the functions.*"
        r"st\.load\(path, functions=\{'no_such_mod:f': f\}\)",
    ):
        st.load(bad)


def test_metadata_not_json(tmp_path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, TIED)
    tensors, meta = read_raw(good)
    meta["sharetree.tree"] = "{not json"
    write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
    with pytest.raises(st.TieError, match="not valid JSON"):
        st.load(tmp_path / "b.safetensors")


def test_metadata_malformed_structure(tmp_path) -> None:
    def drop(tensors, meta, structure):
        i = structure["keys"].index("enc")
        del structure["children"][i]["children"][0]["t"]

    with pytest.raises(st.TieError, match=r"malformed node at 'enc/w': the field 't'.*missing"):
        st.load(tampered(tmp_path, TIED, drop))

    def unknown(tensors, meta, structure):
        structure["t"] = "hypercube"

    with pytest.raises(st.TieError, match="unknown node kind 'hypercube'"):
        st.load(tampered(tmp_path, TIED, unknown))


def test_missing_tensor(tmp_path) -> None:
    bad = tampered(tmp_path, TIED, lambda t, m, s: t.pop("embed"))
    with pytest.raises(st.TieError, match=r"buffer at 'embed' needs the tensor 'embed'"):
        st.load(bad)


def test_extra_tensor(tmp_path) -> None:
    bad = tampered(tmp_path, TIED, lambda t, m, s: t.update(stowaway=np.ones(1)))
    with pytest.raises(st.TieError, match=r"tensors that its tree does not use: \['stowaway'\]"):
        st.load(bad)


def test_tensor_of_wrong_shape(tmp_path) -> None:
    bad = tampered(tmp_path, TIED, lambda t, m, s: t.update(embed=np.ones((3, 4), np.float32)))
    with pytest.raises(st.TieError, match=r"'embed'.*float32\[3, 4\].*float32\[4, 3\]"):
        st.load(bad)


def test_dangling_ref_in_file(tmp_path) -> None:
    def dangle(tensors, meta, structure):
        i = structure["keys"].index("head")
        structure["children"][i]["ref"] = ["embedd"]

    with pytest.raises(st.TieError, match=r"bad sharing graph.*'embedd' does not exist.*'embed'"):
        st.load(tampered(tmp_path, TIED, dangle))


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


# ----------------------------------------------------------------------------- loading runs no code

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
    with pytest.raises(
        st.TieError,
        match=rf"bad\.safetensors'.*tie at 'head'.*{re.escape(name)!s}.*never imported or "
        rf"called.*st\.load\(path, functions=",
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


# ----------------------------------------------------------------------------- describe


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
    monkeypatch.setattr(_safetensors.Reader, "tensors", lambda self: pytest.fail("read data"))
    # the same text as the summary of the tree that was saved
    assert describe(path, max_rows=3).splitlines()[1:] == st.summary(TIED, max_rows=3).splitlines()


def test_describe_a_foreign_file_and_problems(tmp_path) -> None:
    path = tmp_path / "torch.safetensors"
    save_file({"a": np.ones(3), "b": np.zeros((2, 2), np.float32)}, str(path))
    text = describe(path)
    assert "not written by sharetree" in text and "2 tensors, 40 B of tensor data" in text
    assert text.splitlines()[1:] == ["  a  F64[3]", "  b  F32[2, 2]"]
    save_file({"evil\x1b[2J\nname": np.ones(1)}, str(path))
    text = describe(path)  # a name from the file never moves the terminal
    assert text.count("\n") == 1 and "evil\\x1b[2J\\nname" in text and "\x1b" not in text
    for bad, match in [
        (tmp_path / "missing.safetensors", "cannot read"),
        (tmp_path, "is a directory"),
    ]:
        with pytest.raises(st.TieError, match=match) as e:
            describe(bad)
        assert "\n" not in str(e.value)
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 100)
    with pytest.raises(st.TieError, match="not a readable safetensors file") as e:
        describe(tmp_path / "garbage.safetensors")
    assert "\n" not in str(e.value)
    deep = tampered(tmp_path, TIED, lambda t, m, s: s.update(x=[[[[[[[[]]]]]]]]))
    describe(deep)  # an unknown extra field is ignored, like load does
    dangling = tampered(
        tmp_path,
        TIED,
        lambda t, m, s: s["children"][s["keys"].index("head")].update(ref=["embedd"]),
    )
    with pytest.raises(st.TieError, match=r"inspect: .*bad sharing graph.*'embedd'") as e:
        describe(dangling)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- permissions


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_file_follows_umask_and_save_never_changes_it(tmp_path, monkeypatch, umask) -> None:
    old = os.umask(umask)
    try:
        monkeypatch.setattr(os, "umask", lambda *a: pytest.fail("os.umask called"))
        st.save(tmp_path / "m.safetensors", {"a": np.ones(2)})
        monkeypatch.undo()
        assert stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode) == 0o666 & ~umask
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664])
def test_replaced_file_keeps_its_mode(tmp_path, mode) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, {"a": np.ones(2)})
    os.chmod(path, mode)
    st.save(path, {"a": np.zeros(3)})
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    np.testing.assert_array_equal(st.load(path)["a"], np.zeros(3))


# ----------------------------------------------------------------------------- names


def test_reserved_tensor_name_round_trips(tmp_path) -> None:
    tree = {"__metadata__": np.arange(3.0), "a": {"__metadata__": st.Tied("__metadata__")}}
    path = tmp_path / "m.safetensors"
    st.save(path, tree)
    assert_same_tree(st.load(path), tree)
    assert sorted(load_file(str(path))) == ["__metadata__~1"]
    tree = {"\ud800": np.ones(1), "\\ud800": np.zeros(1)}  # a lone surrogate, and its escape
    st.save(path, tree)
    assert_same_tree(st.load(path), tree)
    assert sorted(load_file(str(path))) == ["\\ud800", "\\ud800~1"]


@pytest.mark.parametrize(
    "tree, match",
    [
        (collections.OrderedDict([(0, np.ones(1)), ("0", np.ones(2))]), r"keys 0 and '0'"),
        ({1: np.ones(1), "a": np.ones(2)}, r"jax cannot flatten the tree"),
        ({"a": {"b": np.ones(1)}, "c": [st.Tied("a/c")]}, r"'a/c' does not exist"),
        ({"__metadata__": np.array(["s"])}, r"dtype <U1"),
    ],
)
def test_refused_names_leave_the_old_file_untouched(tmp_path, tree, match) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    with pytest.raises((st.TieError,), match=match):
        st.save(path, tree)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]


_KEYS = hs.one_of(
    hs.sampled_from(
        ["", "/", "a/b", "__metadata__", "<root>", "0", "1", "é", "~1", "a~1", ".", "\ud800"]
    ),
    hs.integers(0, 3),
    hs.text(max_size=4),
)


def _trees(leaf: Any) -> Any:
    return hs.recursive(
        leaf,
        lambda c: hs.one_of(
            hs.dictionaries(_KEYS, c, max_size=4),
            hs.lists(c, max_size=3),
            hs.lists(hs.tuples(_KEYS, c), max_size=3).map(collections.OrderedDict),
        ),
        max_leaves=8,
    )


@settings(max_examples=examples(150), deadline=None)
@given(
    tree=_trees(
        hs.sampled_from([np.float32(1.5), 3, "s", None]).map(
            lambda v: np.arange(2.0) if v is None else v
        )
    )
)
def test_any_tree_save_accepts_loads_back_equal(tmp_path_factory, tree) -> None:
    path = tmp_path_factory.mktemp("names") / "m.safetensors"
    st.save(path, {"keep": np.ones(1)})
    before = path.read_bytes()
    try:
        st.save(path, tree)
    except st.TieError:
        assert path.read_bytes() == before  # refused before the old file was touched
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = st.load(path)
    assert_same_tree(back, tree)
    assert _plain(back) == _plain(tree)  # key types and order kept


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return (type(x).__name__, [(type(k).__name__, k, _plain(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_plain(v) for v in x])
    if isinstance(x, np.ndarray):
        return ("array", x.tolist())
    return (type(x).__name__, x)


# ----------------------------------------------------------------------------- untrusted metadata


def test_deeply_nested_metadata_is_a_tie_error(tmp_path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, TIED)
    tensors, meta = read_raw(good)
    deep = r"b\.safetensors'.*nested deeper than Python recurses.*at most 200 levels"
    lists = '{"t":"list","children":[' * 250 + '{"t":"none"}' + "]}" * 250
    for text, match in [
        ("[" * 100_000 + "]" * 100_000, deep),  # json.loads stops at the recursion limit
        # unterminated: CPython < 3.13's decoder recurses and stops at the limit, 3.13's
        # reaches the end of the text first; either way a TieError naming the file
        ('{"t":"list","children":' + "[" * 5000, rf"{deep}|b\.safetensors'.*not valid JSON"),
        (lists, r"b\.safetensors'.*nested deeper than 200 levels"),  # parsed, refused by depth
        # parsed or not (that depends on the stack), a value echoed in the message
        *[(f'{{"t":"static","type":{"[" * n}{"]" * n}}}', f"{deep}|'type'") for n in (600, 990)],
    ]:
        meta["sharetree.tree"] = text
        write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
        with pytest.raises(st.TieError, match=match):
            st.load(tmp_path / "b.safetensors")
        with pytest.raises(st.TieError, match="nested|'type'"):
            describe(tmp_path / "b.safetensors")
    meta["sharetree.tree"] = '["' + '\\"' * 200_000  # an unterminated string
    write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
    with pytest.raises(st.TieError, match="not valid JSON"):
        st.load(tmp_path / "b.safetensors")


def test_tree_depth_limit_is_the_same_for_save_and_load(tmp_path) -> None:
    tree: Any = np.ones(2)
    for _ in range(_io.MAX_DEPTH - 1):
        tree = [tree]
    ok = {"w": tree, "v": st.Tied(("w",) + ("0",) * (_io.MAX_DEPTH - 1))}  # leaves at depth 200
    st.save(tmp_path / "ok.safetensors", ok)
    assert_same_tree(st.load(tmp_path / "ok.safetensors"), ok)
    with pytest.raises(st.TieError, match=r"nested deeper than 200 levels"):
        st.save(tmp_path / "no.safetensors", {"w": [tree]})
    assert not (tmp_path / "no.safetensors").exists()


def _set(key: str, value: Any, where: str = "enc/w") -> Any:
    """An edit of the saved TIED that sets field ``key`` of the node at ``where``."""

    def edit(tensors, meta, structure):
        node = structure
        for k in where.split("/") if where else []:
            node = node["children"][node["keys"].index(k)]
        if value is _DROP:
            del node[key]
        else:
            node[key] = value

    return edit


_DROP = object()


@pytest.mark.parametrize(
    "edit, where, match",
    [
        (_set("ref", [], "head"), "head", r"empty key"),
        (_set("ref", "embed", "head"), "head", r"field 'ref' should be a non-empty list of keys"),
        (_set("ref", [None], "head"), "head", r"field 'ref'"),
        (_set("transform", "T", "head"), "head", r"field 'transform'.*expected a dict"),
        (_set("transform", {"name": "chain", "parts": 3}, "head"), "head", r"'parts'"),
        (_set("t", 3), "enc/w", r"field 't' should be a node kind"),
        (_set("shape", [2, -3]), "enc/w", r"field 'shape' should be a list of sizes >= 0"),
        (_set("shape", [2.0, 3]), "enc/w", r"field 'shape'"),
        (_set("shape", [True, 3]), "enc/w", r"field 'shape'"),
        (_set("shape", _DROP), "enc/w", r"field 'shape' is missing"),
        (_set("dtype", "object"), "enc/w", r"field 'dtype' should be a numeric dtype name"),
        (_set("dtype", ["f4"]), "enc/w", r"field 'dtype'"),
        (_set("dtype", "float64"), "enc/w", r"'enc/w' is float32\[2, 3\] but the metadata says"),
        (_set("raw", "no"), "enc/w", r"field 'raw' should be true or false"),
        (_set("raw", True), "enc/w", r"should hold the raw bytes of float32\[2, 3\]"),
        (_set("scalar", True), "enc/w", r"field 'scalar'"),
        (_set("tensor", 7), "enc/w", r"needs the tensor 7, which the file does not hold"),
        (_set("tensor", "embed"), "enc/w", r"'embed' is used twice"),
        (_set("key", "threefry2x32"), "enc/w", r"field 'key'"),
        (_set("key", "os.system"), "enc/w", r"field 'key'"),
        (_set("keys", "ab", "enc"), "enc", r"field 'keys' should be a list of str or int keys"),
        (_set("keys", ["w", "w"], "enc"), "enc", r"as many distinct keys as children"),
        (_set("children", {}, "enc"), "enc", r"field 'children' should be a list of nodes"),
        (_set("children", [1, 2], "enc"), "enc/w", r"expected a JSON object, found int"),
    ],
)
def test_every_malformed_field_names_file_and_path(tmp_path, edit, where, match) -> None:
    bad = tampered(tmp_path, TIED, edit)
    with pytest.raises(st.TieError, match=rf"bad\.safetensors'.*'{where}'.*{match}|{match}") as e:
        st.load(bad)
    assert "bad.safetensors" in str(e.value) and f"'{where}'" in str(e.value)


def test_malformed_value_leaves(tmp_path) -> None:
    tree = {"n": 3, "s": "x", "c": 1 + 2j, "w": np.ones(1)}
    for key, value, match in [
        ("n", {"t": "value", "type": "int", "value": "3"}, r"field 'value' should be a int value"),
        ("n", {"t": "value", "type": "module", "value": 3}, r"field 'type' should be bool"),
        ("c", {"t": "value", "type": "complex", "value": [1]}, r"field 'value'"),
        ("s", {"t": "static", "type": 5}, r"field 'type' should be a type name"),
        ("s", {"t": "node", "type": "x.Y", "keys": ["a"], "children": []}, r"distinct keys"),
    ]:

        def edit(tensors, meta, structure, key=key, value=value):
            structure["children"][structure["keys"].index(key)] = value

        with pytest.raises(st.TieError, match=rf"bad\.safetensors'.*'{key}'.*{match}"):
            st.load(tampered(tmp_path, tree, edit))


# ----------------------------------------------------------------------------- PRNG keys


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


def test_key_field_needs_format_version_2(tmp_path) -> None:
    def downgrade(tensors, meta, structure):
        meta["sharetree.format_version"] = "1"

    bad = tampered(tmp_path, {"k": jax.random.key(0)}, downgrade)
    with pytest.raises(st.TieError, match=r"'k'.*field 'key'.*format version 2.*\(version 1\)"):
        st.load(bad)


def test_prng_key_of_unknown_impl_is_refused_before_writing(tmp_path, monkeypatch) -> None:
    path = tmp_path / "k.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    monkeypatch.setattr(_io, "KEY_IMPLS", ("rbg",))
    with pytest.raises(
        st.TieError,
        match=r"PRNG key array at 'k' uses the implementation "
        r"'threefry2x32'",
    ):
        st.save(path, {"k": jax.random.key(0)})
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------- user metadata


def test_user_metadata_round_trip(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED, metadata={"format": "pt", "note": "é"})
    assert _io.read_metadata(path) == {"format": "pt", "note": "é"}
    _, raw = read_raw(path)
    assert raw["format"] == "pt" and raw["sharetree.format_version"] == "1"
    assert_same_tree(st.load(path), TIED)


@pytest.mark.parametrize(
    "metadata, match",
    [
        ({"sharetree.tree": "{}"}, r"'sharetree.tree' starts with 'sharetree.'"),
        ({"format": 1}, r"'format': 1 is str -> int"),
        ({2: "x"}, r"int -> str"),
        ({"a": "\udc00"}, r"not valid UTF-8"),
        ([("format", "pt")], r"must be a dict of str -> str, found list"),
    ],
)
def test_bad_user_metadata_is_refused_before_writing(tmp_path, metadata, match) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    with pytest.raises(st.TieError, match=match):
        st.save(path, {"a": np.ones(1)}, metadata=metadata)
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------- many processes


def test_not_fully_addressable_buffer_needs_gather(tmp_path, monkeypatch) -> None:
    tree = {"w": jnp.arange(4.0), "b": jnp.ones(2), "t": st.Tied("w")}
    monkeypatch.setattr(_io, "_addressable", lambda x: x.shape != (4,))
    path = tmp_path / "m.safetensors"
    with pytest.raises(st.TieError, match=r"buffer at 'w' is sharded.*gather=True"):
        st.save(path, tree)
    assert not path.exists()
    gathered: list[Any] = []
    from jax.experimental import multihost_utils

    real = multihost_utils.process_allgather

    def allgather(x, tiled=False):
        gathered.append((x.shape, tiled))
        return real(x, tiled=tiled)

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    st.save(path, tree, gather=True)
    assert gathered == [((4,), True)]
    assert_same_tree(st.load(path), tree)
    # every process calls save; only process 0 writes
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    st.save(tmp_path / "other.safetensors", tree, gather=True)
    assert not (tmp_path / "other.safetensors").exists()
    assert len(gathered) == 2


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
    with pytest.raises(st.TieError, match=r"buffers without a sharding: \['enc/b'\]"):
        st.load(path, shardings={**shardings, "enc": {"w": s}})
    with pytest.raises(st.TieError, match=r"at 'embed' is str 'cpu', not a jax.sharding"):
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


# ----------------------------------------------------------------------------- adversarial inputs


@pytest.mark.parametrize("path", [3, None, ["m.safetensors"], "", "m\0.safetensors"])
def test_a_path_that_names_no_file_is_a_tie_error(tmp_path, path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, TIED)
    for verb, call in [
        ("save", lambda: st.save(path, TIED)),
        ("load", lambda: st.load(path)),
        ("inspect", lambda: describe(path)),
        ("read_metadata", lambda: _io.read_metadata(path)),
    ]:
        with pytest.raises(st.TieError, match=rf"^{verb}: the path .*(should be a str|is empty)"):
            call()
    assert os.listdir(tmp_path) == ["g.safetensors"]  # save wrote nothing, not even beside cwd
    raw = os.fsencode(good)  # bytes are a path, as for open()
    st.save(raw, TIED)
    assert_same_tree(st.load(raw), TIED)
    assert "sharing graph" in describe(raw)


def test_save_to_a_directory_writes_nothing(tmp_path) -> None:
    for path in (tmp_path, f"{tmp_path}/new/"):
        with pytest.raises(st.TieError, match=r"is a directory; st.save writes one file.*Fix"):
            st.save(path, TIED)
    assert os.listdir(tmp_path) == []


def test_an_int_too_long_for_text_is_refused_before_writing(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    for tree, where in [({"n": 10**5000}, "the leaf at 'n'"), ({10**5000: 1}, "a dict key at")]:
        with pytest.raises(st.TieError, match=rf"save: {where}.*int of 16,610 bits.*Fix"):
            st.save(path, tree)
    assert not path.exists()
    st.save(path, {"n": 10**4000})  # below the limit: round trips
    assert st.load(path) == {"n": 10**4000}


def test_tree_json_naming_a_field_twice_is_refused(tmp_path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, {"w": np.ones(2, np.float32), "v": st.Tied("w")})
    tensors, meta = read_raw(good)
    text = meta["sharetree.tree"]  # a second "children" would silently drop the tie at 'v'
    meta["sharetree.tree"] = (
        text[:-1] + ',"children":[' + json.dumps(json.loads(text)["children"][0]) + "]}"
    )
    write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
    with pytest.raises(st.TieError, match=r"names the field 'children' twice in one object"):
        st.load(tmp_path / "b.safetensors")


def test_file_content_in_messages_is_cut_and_type_names_are_checked(tmp_path) -> None:
    def kind(tensors, meta, structure):
        structure["t"] = "[" * 10_000

    path = tampered(tmp_path, TIED, kind)
    with pytest.raises(st.TieError, match=r"unknown node kind '\[{56}\.\.\. at '<root>'") as e:
        st.load(path)
    assert len(str(e.value).replace(str(path), "")) < 300  # the file's text cut, whatever the path
    bad = tampered(
        tmp_path, TIED, lambda t, m, s: m.update({"sharetree.format_version": "9" * 5000})
    )
    with pytest.raises(st.TieError, match=r"malformed format version '9+\.\.\.; expected") as e:
        st.load(bad)
    assert len(str(e.value).replace(str(bad), "")) < 400

    def escape(tensors, meta, structure):
        structure["children"].append({"t": "static", "type": "\x1b[2J"})
        structure["keys"].append("s")

    with pytest.raises(st.TieError, match=r"at 's': the field 'type' should be a type name"):
        st.load(tampered(tmp_path, TIED, escape))


def test_keywords_of_the_wrong_type_are_tie_errors(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    for gather in ("no", None, 1):
        with pytest.raises(st.TieError, match=r"save: gather must be True or False"):
            st.save(path, TIED, gather=gather)
    assert not path.exists()
    st.save(path, TIED, gather=np.bool_(False))
    with pytest.raises(st.TieError, match=r"load: functions must be a mapping.*found list"):
        st.load(path, functions=["jax.numpy:flipud"])
    for rows in ("3", 0, 2.0):
        with pytest.raises(st.TieError, match=r"inspect: max_rows must be an int >= 1"):
            describe(path, max_rows=rows)


def test_foreign_files_take_shardings_too(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"emb": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)}, str(path))
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.warns(UserWarning, match="not written by sharetree"):
        back = st.load(path, ties={"head": "emb"}, shardings={"emb": s, "b": None, "head": None})
    assert isinstance(back["emb"], jax.Array) and back["emb"].sharding == s
    assert isinstance(back["b"], np.ndarray) and back["head"] == st.Tied("emb")
    with pytest.raises(st.TieError, match=r"shardings= does not match.*without a sharding: \['b'"):
        st.load(path, shardings={"emb": s})  # refused before anything is read: no warning


def test_a_pretrained_directory_holding_a_sharetree_file_is_not_read_flat(tmp_path) -> None:
    st.save(tmp_path / "model.safetensors", TIED)
    with pytest.raises(
        st.TieError, match=r"holds 'model.safetensors', a file written by st.save.*st\.load\('"
    ):
        st.load(tmp_path)
    assert_same_tree(st.load(tmp_path / "model.safetensors"), TIED)


def test_describe_a_foreign_file_shows_the_ties_its_metadata_records(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"emb": np.ones((3, 2), np.float32)}, str(path), metadata={"head": "emb"})
    assert "1 tie(s) in its metadata: head <- emb" in describe(path)
    with pytest.warns(UserWarning, match="restored the ties"):
        assert st.load(path)["head"] == st.Tied("emb")


def test_a_header_too_large_for_readers_is_a_tie_error_before_writing(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(st.TieError, match=r"header too large.*101,000,\d+ bytes of tree JSON.*"):
        st.save(path, {"w": np.ones(1), "s": "a" * 101_000_000})
    assert os.listdir(tmp_path) == []


def test_a_deleted_array_is_a_tie_error_naming_its_path(tmp_path) -> None:
    for x in (jnp.ones(3), jax.random.key(0)):  # as after a jitted call with donate_argnums
        x.delete()
        with pytest.raises(st.TieError, match=r"save: the buffer at 'enc/w' has been deleted"):
            st.save(tmp_path / "m.safetensors", {"enc": {"w": x}})
    assert os.listdir(tmp_path) == []


def test_a_masked_array_is_refused_rather_than_saved_without_its_mask(tmp_path) -> None:
    x = np.ma.array([1.0, 2.0], mask=[False, True])
    with pytest.raises(st.TieError, match=r"at 'x' is a masked array.*without the mask"):
        st.save(tmp_path / "m.safetensors", {"x": x})
    st.save(tmp_path / "m.safetensors", {"x": np.ma.array([1.0, 2.0])})  # no mask: plain data
    assert st.load(tmp_path / "m.safetensors")["x"].tolist() == [1.0, 2.0]


def test_an_abstract_or_foreign_array_leaf_is_refused_rather_than_saved_empty(tmp_path) -> None:
    path = tmp_path / "m.safetensors"

    class Tensor:  # another library's array (a torch.Tensor), not registered with jax
        shape, dtype = (2,), "float32"

    for leaf, kind in [
        (jax.ShapeDtypeStruct((2,), jnp.float32), "ShapeDtypeStruct"),
        (Tensor(), "Tensor"),
    ]:
        with pytest.raises(st.TieError, match=rf"leaf at 'w' is a {kind} of shape \(2,\).*Fix"):
            st.save(path, {"w": leaf, "v": st.Tied("w")})
    assert not path.exists()


def test_atol_without_ties_for_a_foreign_file_is_a_tie_error(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"emb": np.ones((3, 2), np.float32)}, str(path))
    for atol in (1e-6, "x"):
        with pytest.raises(st.TieError, match=r"load: atol=.* without ties=.*nothing is compared"):
            st.load(path, atol=atol)


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
    with pytest.raises(
        st.TieError,
        match=r"tie at 'head'.*unknown transform name 'mylib_rotate'.*Fix: if it is a transform "
        r"of your own, import \(or define\) the class registered as 'mylib_rotate'",
    ):
        st.load(bad)
    text = describe(bad)  # the graph, the spec as it is, nothing called
    row = next(line for line in text.splitlines() if line.split()[:2] == ["head", "embed"])
    assert '{"name":"mylib_rotate","k":3} >> T' in row
    assert "not registered in this process" in text


@dataclasses.dataclass(frozen=True)
class CastTo(st.Transform, name="test_io_cast_to"):
    dtype: object = np.dtype("float16")

    def __call__(self, x):
        return jnp.asarray(x).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Unreadable(st.Transform, name="test_io_unreadable"):
    k: int = 2

    def __call__(self, x):
        return jnp.asarray(x) * self.k

    @classmethod
    def from_spec(cls, spec, resolve):
        raise NotImplementedError("cannot read")


def test_a_user_transform_that_cannot_be_written_or_read_is_a_tie_error(tmp_path) -> None:
    w, path = np.ones((2, 2), np.float32), str(tmp_path / "u.safetensors")
    with pytest.raises(
        st.TieError, match=r"save: the tie at 'v' .*its field 'dtype' holds .*not JSON.*Fix:"
    ):
        st.save(path, {"w": w, "v": st.Tied("w", CastTo())})
    assert not os.path.exists(path)
    with pytest.raises(st.TieError, match=r"save: the tie at 'v' .*would not load.*cannot read"):
        st.save(path, {"w": w, "v": st.Tied("w", Unreadable())})  # what load would refuse
    assert not os.path.exists(path)

    def unreadable(tensors, meta, structure) -> None:  # as another process's class wrote it
        structure["children"][structure["keys"].index("v")]["transform"] = Unreadable().spec()

    path = tampered(tmp_path, {"w": w, "v": st.Tied("w", st.T)}, unreadable)
    with pytest.raises(st.TieError) as e:
        st.load(path)
    msg = str(e.value)
    assert path in msg and "tie at 'v'" in msg and "'name': 'test_io_unreadable'" in msg
    assert "Unreadable.from_spec raised NotImplementedError: cannot read. Fix:" in msg
    assert isinstance(e.value.__cause__, NotImplementedError)


@dataclasses.dataclass(frozen=True)
class HugeInt(st.Transform, name="test_io_huge_int"):
    n: int = 10**5000  # past Python's digit limit: its repr and json.dumps raise ValueError

    def __call__(self, x):
        return x


@dataclasses.dataclass(frozen=True)
class SpecRaises(st.Transform, name="test_io_spec_raises"):
    def __call__(self, x):
        return x

    def spec(self):
        raise AttributeError("no spec here")


def test_a_transform_whose_repr_or_spec_raises_is_a_tie_error_on_save(tmp_path) -> None:
    w, path = np.ones(2, np.float32), str(tmp_path / "h.safetensors")
    with pytest.raises(st.TieError) as e:
        st.save(path, {"w": w, "v": st.Tied("w", HugeInt())})
    msg = str(e.value)
    assert "the tie at 'v' (<Tied whose repr raised ValueError>)" in msg
    assert "its field 'n' holds int <int whose repr raised ValueError>, which is not JSON" in msg
    with pytest.raises(st.TieError) as e:
        st.save(path, {"w": w, "v": st.Tied("w", SpecRaises())})
    assert "its spec() raised AttributeError: no spec here. Fix:" in str(e.value)
    assert not os.path.exists(path)


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
        assert text.startswith(("load: ", "inspect: ")) and "'nope'" in text and "Fix:" in text
