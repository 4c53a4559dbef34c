"""st.save: one safetensors file, each buffer once, every check before anything is written."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import stat
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _examples import examples
from _files import TIED, assert_same_tree, read_raw, tampered
from _raises import message, raises
from hypothesis import given, settings
from hypothesis import strategies as hs
from safetensors.numpy import load_file

import sharetree as st
from sharetree._files import container, tree_json
from sharetree._files.format import FORMAT_VERSION, MAX_DEPTH
from sharetree._files.load import read_metadata

# ----------------------------------------------------------- what a file holds


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
    assert meta["sharetree.format_version"] == "1" and FORMAT_VERSION == 4
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


def test_user_metadata_round_trip(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED, metadata={"format": "pt", "note": "é"})
    assert read_metadata(path) == {"format": "pt", "note": "é"}
    _, raw = read_raw(path)
    assert raw["format"] == "pt" and raw["sharetree.format_version"] == "1"
    assert_same_tree(st.load(path), TIED)


# ----------------------------------------------- atomic writes and permissions


def test_failed_write_leaves_previous_file_intact(tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()

    def half_then_fail(filename, tensors, metadata):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{partial")  # a torn write
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(container, "write_tensors", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        st.save(path, {"other": np.zeros(100)})
    assert path.read_bytes() == before
    assert_same_tree(st.load(path), TIED)
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]  # no temporary file left behind


def test_interrupted_write_leaves_previous_file_intact(tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    real = container.write_tensors

    def write_then_interrupt(filename, tensors, metadata):
        real(filename, tensors, metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(container, "write_tensors", write_then_interrupt)
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


# ----------------------------------------------------------------------- names


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
    "tree, code, facts",
    [
        (
            collections.OrderedDict([(0, np.ones(1)), ("0", np.ones(2))]),
            "E31",
            ["[0, '0']", "one path"],
        ),
        ({1: np.ones(1), "a": np.ones(2)}, "E31", ["str and int keys", "[1, 'a']"]),
        ({"a": {"b": np.ones(1)}, "c": [st.Tied("a/c")]}, "E1", ["'a/c'", "'c/0'"]),
        ({"__metadata__": np.array(["s"])}, "E124", ["'__metadata__'", "<U1"]),
    ],
)
def test_refused_names_leave_the_old_file_untouched(tmp_path, tree, code, facts) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    with raises(code, *facts):
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


# ------------------------------------------ refused before anything is written


def test_save_errors_write_nothing(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    with pytest.raises(st.TieError) as e:  # the transform's own error, the tie as a note
        st.save(path, {"w": np.ones(2), "v": st.Tied("w", st.fn(lambda x: x + 1))})
    assert "save: the tie at 'v'" in message(e.value) and "<lambda>" in message(e.value)
    with raises("E122", "'d'", "str or int", "tuple (1, 2)", cls=st.TieTypeError):
        st.save(path, {"d": {(1, 2): np.ones(1)}})
    with raises("E124", "'s'", "dtype <U3"):
        st.save(path, {"s": np.array(["abc"])})
    with raises("E1", "'encc'", "'dec'", "'enc'"):
        st.save(path, {"enc": np.ones(2), "dec": st.Tied("encc")})
    assert not path.exists() and os.listdir(tmp_path) == []


def test_save_under_jit_is_an_error(tmp_path) -> None:
    def f(x):
        st.save(tmp_path / "j.safetensors", {"x": x})
        return x

    with raises("E123", "'x'", "traced", "outside jit"):
        jax.jit(f)(jnp.ones(2))


def test_tree_depth_limit_is_the_same_for_save_and_load(tmp_path) -> None:
    tree: Any = np.ones(2)
    for _ in range(MAX_DEPTH - 1):
        tree = [tree]
    ok = {"w": tree, "v": st.Tied(("w",) + ("0",) * (MAX_DEPTH - 1))}  # leaves at depth 200
    st.save(tmp_path / "ok.safetensors", ok)
    assert_same_tree(st.load(tmp_path / "ok.safetensors"), ok)
    with raises("E30", "'w/0/0/0/0/0/0/0'/...", "deeper than 200 levels"):
        st.save(tmp_path / "no.safetensors", {"w": [tree]})
    assert not (tmp_path / "no.safetensors").exists()


def test_prng_key_of_unknown_impl_is_refused_before_writing(tmp_path, monkeypatch) -> None:
    path = tmp_path / "k.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    monkeypatch.setattr(tree_json, "KEY_IMPLS", ("rbg",))
    with raises("E33", "'k'", "'threefry2x32'", "expected rbg", "jax.random.key_data"):
        st.save(path, {"k": jax.random.key(0)})
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "metadata, facts",
    [
        ({"sharetree.tree": "{}"}, ["'sharetree.tree'", "prefix 'sharetree.'"]),
        ({"format": 1}, ["'format': 1", "str -> str", "found int 1"]),
        ({2: "x"}, ["2: 'x'", "str -> str", "found int 2"]),
        ({"a": "\udc00"}, ["'a'", "not UTF-8"]),
        ([("format", "pt")], ["metadata=", "str -> str", "found list"]),
    ],
)
def test_bad_user_metadata_is_refused_before_writing(tmp_path, metadata, facts) -> None:
    path = tmp_path / "m.safetensors"
    st.save(path, TIED)
    before = path.read_bytes()
    with raises("E32", *facts):
        st.save(path, {"a": np.ones(1)}, metadata=metadata)
    assert path.read_bytes() == before


def test_not_fully_addressable_buffer_needs_gather(tmp_path, monkeypatch) -> None:
    tree = {"w": jnp.arange(4.0), "b": jnp.ones(2), "t": st.Tied("w")}
    monkeypatch.setattr(tree_json, "addressable", lambda x: x.shape != (4,))
    path = tmp_path / "m.safetensors"
    with raises("E34", "'w'", "several processes", "gather=True"):
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


def test_save_to_a_directory_writes_nothing(tmp_path) -> None:
    for path in (tmp_path, f"{tmp_path}/new/"):
        with raises("E50", str(path), "directory", "model.safetensors"):
            st.save(path, TIED)
    assert os.listdir(tmp_path) == []


def test_an_int_too_long_for_text_is_refused_before_writing(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    for tree, where in [({"n": 10**5000}, "the leaf at 'n'"), ({10**5000: 1}, "a dict key at")]:
        with raises("E54", f"save: {where}", "16,610 bits", "4,300 digits", "a str"):
            st.save(path, tree)
    assert not path.exists()
    st.save(path, {"n": 10**4000})  # below the limit: round trips
    assert st.load(path) == {"n": 10**4000}


def test_a_header_too_large_for_readers_is_a_tie_error_before_writing(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    with raises("E56", "header too large", "re:101,000,\\d+ bytes of tree JSON", "100 MB"):
        st.save(path, {"w": np.ones(1), "s": "a" * 101_000_000})
    assert os.listdir(tmp_path) == []


def test_a_deleted_array_is_a_tie_error_naming_its_path(tmp_path) -> None:
    for x in (jnp.ones(3), jax.random.key(0)):  # as after a jitted call with donate_argnums
        x.delete()
        with raises("E57", "save: the buffer at 'enc/w'", "deleted", "donating call"):
            st.save(tmp_path / "m.safetensors", {"enc": {"w": x}})
    assert os.listdir(tmp_path) == []


def test_a_masked_array_is_refused_rather_than_saved_without_its_mask(tmp_path) -> None:
    x = np.ma.array([1.0, 2.0], mask=[False, True])
    with raises("E58", "'x'", "masked array", "x.filled()"):
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
        with raises("E59", "leaf at 'w'", f"a {kind} of shape (2,)", "np.asarray(x)"):
            st.save(path, {"w": leaf, "v": st.Tied("w")})
    assert not path.exists()


@dataclasses.dataclass(frozen=True)
class CastTo(st.Transform, name="test_save_cast_to"):
    dtype: object = np.dtype("float16")

    def __call__(self, x):
        return jnp.asarray(x).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Unreadable(st.Transform, name="test_save_unreadable"):
    k: int = 2

    def __call__(self, x):
        return jnp.asarray(x) * self.k

    @classmethod
    def from_spec(cls, spec, resolve):
        raise NotImplementedError("cannot read")


def test_a_user_transform_that_cannot_be_written_or_read_is_a_tie_error(tmp_path) -> None:
    w, path = np.ones((2, 2), np.float32), str(tmp_path / "u.safetensors")
    with raises(
        "E125", "save: the tie at 'v'", "field 'dtype' holds Float16DType", "not JSON", "spec()"
    ):
        st.save(path, {"w": w, "v": st.Tied("w", CastTo())})
    assert not os.path.exists(path)
    with raises("E74", "save: the tie at 'v'", "would not load", "cannot read"):
        st.save(path, {"w": w, "v": st.Tied("w", Unreadable())})  # what load would refuse
    assert not os.path.exists(path)

    def unreadable(tensors, meta, structure) -> None:  # as another process's class wrote it
        structure["children"][structure["keys"].index("v")]["transform"] = Unreadable().spec()

    path = tampered(tmp_path, {"w": w, "v": st.Tied("w", st.T)}, unreadable)
    with raises("E74", path, "node 'v'", "'test_save_unreadable'", "NotImplementedError") as e:
        st.load(path)
    assert "cannot read" in message(e.value)
    assert isinstance(e.value.__cause__, NotImplementedError)


@dataclasses.dataclass(frozen=True)
class HugeInt(st.Transform, name="test_save_huge_int"):
    n: int = 10**5000  # past Python's digit limit: its repr and json.dumps raise ValueError

    def __call__(self, x):
        return x


@dataclasses.dataclass(frozen=True)
class SpecRaises(st.Transform, name="test_save_spec_raises"):
    def __call__(self, x):
        return x

    def spec(self):
        raise AttributeError("no spec here")


def test_a_transform_whose_repr_or_spec_raises_is_a_tie_error_on_save(tmp_path) -> None:
    w, path = np.ones(2, np.float32), str(tmp_path / "h.safetensors")
    with raises(
        "E125",
        "the tie at 'v' (<Tied whose repr raised ValueError>)",
        "its field 'n' holds int <int whose repr raised ValueError>, which is not JSON",
    ):
        st.save(path, {"w": w, "v": st.Tied("w", HugeInt())})
    with raises("E125", "'v'", "spec() raised AttributeError: no spec here", "Fix: make"):
        st.save(path, {"w": w, "v": st.Tied("w", SpecRaises())})
    assert not os.path.exists(path)
