"""sharetree._files.container, reads and disk: the header, raw reads, atomic writes."""

from __future__ import annotations

import json
import os
import stat

import ml_dtypes
import numpy as np
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from hypothesis import strategies as hs
from safetensors.numpy import save_file

from sharetree._files import container, disk, reads
from sharetree._files.container import Reader, TensorInfo, atomic_write


def test_reader_header_from_the_library(tmp_path) -> None:
    path = str(tmp_path / "x.safetensors")
    save_file(
        {"a": np.ones((2, 3), np.float32), "b": np.zeros(4, ml_dtypes.bfloat16)},
        path,
        metadata={"k": "v"},
    )
    r = Reader(path)
    assert r.metadata == {"k": "v"}
    assert r.infos == {
        "a": TensorInfo("a", "F32", (2, 3)),
        "b": TensorInfo("b", "BF16", (4,)),
    }
    assert [i.nbytes for i in r.infos.values()] == [24, 8]
    got = dict(r.tensors())
    np.testing.assert_array_equal(got["a"], np.ones((2, 3), np.float32))
    assert got["b"].dtype == ml_dtypes.bfloat16


def test_float8_of_another_tool_is_read_from_its_bytes(tmp_path) -> None:
    path = str(tmp_path / "f8.safetensors")
    x = np.array([0.5, -2.0, 448.0], ml_dtypes.float8_e4m3fn)
    save_file({"x": x}, path)
    got = dict(Reader(path).tensors())["x"]
    assert got.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got.view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("cut", [0, 7, 8, 20, -1])
def test_damaged_files_are_tie_errors_naming_the_file(tmp_path, cut) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"a": np.arange(10.0)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:-1])
    with raises("E120", "inspect: ", "x.safetensors'", "not a readable safetensors file"):
        Reader(str(path), "inspect")


def test_atomic_write_removes_its_temporary_file_on_failure(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "x.safetensors")
    atomic_write(path, {"a": np.ones(1)}, {})
    os.chmod(path, 0o640)
    before = open(path, "rb").read()

    def fail(filename, tensors, metadata):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(container, "write_tensors", fail)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write(path, {"a": np.zeros(2)}, {})
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["x.safetensors"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def _header_file(path, header: bytes, data: bytes) -> None:
    """A safetensors file of the header text ``header`` (written by hand) and ``data``."""
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize(
    "header",
    [
        # one tensor twice, a metadata entry twice: the library keeps the last, silently
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b'{"__metadata__":{"k":"1","k":"2"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    ],
)
def test_a_header_naming_a_key_twice_is_refused(tmp_path, header) -> None:
    path = tmp_path / "x.safetensors"
    _header_file(path, header, b"\0" * 4)
    with raises("E52", "x.safetensors'", "re:names '(a|k)' twice"):
        Reader(str(path))


def test_float8_raw_read_uses_the_header_read_once(tmp_path) -> None:
    path = tmp_path / "f8.safetensors"
    header = b'{"b":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[2,4]},'
    header += b'"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}'
    _header_file(path, header, bytes([0x38, 0x40, 0x44, 0x48]))
    got = dict(Reader(str(path)).tensors())
    assert got["a"].view(np.uint8).tolist() == [0x38, 0x40]
    assert got["b"].view(np.uint8).tolist() == [0x44, 0x48]


def test_a_pipe_or_directory_is_refused_without_reading(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it to read would block until a writer comes
    for path in (fifo, tmp_path):
        with raises("E51", f"inspect: {str(path)!r}", "not a regular file"):
            Reader(str(path), "inspect")


def test_atomic_write_through_a_symlink_keeps_the_link(tmp_path) -> None:
    target, link = tmp_path / "step_1.safetensors", tmp_path / "latest.safetensors"
    atomic_write(str(target), {"a": np.ones(1)}, {})
    link.symlink_to(target.name)
    atomic_write(str(link), {"a": np.zeros(1)}, {})
    assert link.is_symlink() and dict(Reader(str(target)).tensors())["a"].tolist() == [0.0]
    dangling = tmp_path / "dangling.safetensors"
    dangling.symlink_to("new.safetensors")
    atomic_write(str(dangling), {"a": np.ones(1)}, {})
    assert dangling.is_symlink() and (tmp_path / "new.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == [
        "dangling.safetensors", "latest.safetensors", "new.safetensors", "step_1.safetensors"
    ]  # fmt: skip


def test_atomic_write_into_a_missing_directory_names_the_file(tmp_path) -> None:
    path = str(tmp_path / "nope" / "x.safetensors")
    with pytest.raises(FileNotFoundError, match=r"nope/x\.safetensors'"):
        atomic_write(path, {"a": np.ones(1)}, {})


def test_atomic_write_refuses_a_read_only_file_as_open_would(tmp_path, monkeypatch) -> None:
    path = tmp_path / "x.safetensors"
    atomic_write(str(path), {"a": np.ones(1)}, {})
    before = path.read_bytes()
    os.chmod(path, 0o444)
    # root may write any file; act as a user who may not write this one
    monkeypatch.setattr(disk.os, "access", lambda p, mode: p != str(path))
    with pytest.raises(PermissionError, match=r"x\.safetensors'.*read-only"):
        atomic_write(str(path), {"a": np.zeros(1)}, {})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["x.safetensors"]


_READ_DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int4", "bool"]


@settings(max_examples=examples(120), deadline=None)
@given(data=hs.data())
def test_tensor_parts_equal_numpy_slices(tmp_path_factory, data) -> None:
    """``Tensor.read(index)`` of any part, stored or transposed, is NumPy's slice of the array."""
    import jax.numpy as jnp

    from sharetree._files.reads import Tensor

    shape = tuple(data.draw(hs.lists(hs.integers(0, 5), min_size=1, max_size=3), label="shape"))
    dtype = np.dtype(jnp.dtype(data.draw(hs.sampled_from(_READ_DTYPES), label="dtype")))
    full = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 7
    full = full.astype(dtype)
    raw = dtype.name == "int4"  # no safetensors code: st.save stores its bytes as uint8
    path = str(tmp_path_factory.mktemp("parts") / "x.safetensors")
    stored = np.frombuffer(full.tobytes(), np.uint8) if raw else full
    save_file({"x": np.ascontiguousarray(stored)}, path)
    perm = tuple(data.draw(hs.permutations(range(len(shape))), label="axes"))
    view = np.transpose(full, perm)
    axes = None if perm == tuple(range(len(shape))) else perm
    t = Tensor(Reader(path), "x", view.shape, dtype, axes=axes, view=raw)
    index = []
    for n in view.shape:
        a, b = sorted(data.draw(hs.tuples(hs.integers(0, n), hs.integers(0, n)), label="slice"))
        index.append(slice(a, b))
    got = t.read(tuple(index))
    assert got.dtype == dtype and got.flags.writeable
    want = np.ascontiguousarray(view[tuple(index)])
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bits: NaN too
    np.testing.assert_array_equal(
        t.read().view(np.uint8), np.ascontiguousarray(view).view(np.uint8)
    )


def test_a_transposed_tensor_is_read_in_bounded_chunks(tmp_path, monkeypatch) -> None:
    from sharetree._files.reads import Tensor

    path = str(tmp_path / "x.safetensors")
    full = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
    save_file({"x": full}, path)
    monkeypatch.setattr(reads, "_CHUNK", 3 * 40 * 4)  # three rows of the transpose
    reader = Reader(path)
    parts = []
    real = Reader.read
    monkeypatch.setattr(Reader, "read", lambda self, *a: parts.append(a[1]) or real(self, *a))
    got = Tensor(reader, "x", (6, 40), np.dtype("float32"), axes=(1, 0)).read()
    np.testing.assert_array_equal(got, full.T)
    assert [p[1] for p in parts] == [slice(0, 3), slice(3, 6)]  # columns of the stored tensor


def test_a_dtype_code_sharetree_cannot_read_names_the_tensor_and_the_code(tmp_path) -> None:
    path = tmp_path / "x.safetensors"  # float4: a code the library knows, numpy has no dtype
    _header_file(path, b'{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}', b"\0")
    reader = Reader(str(path))
    assert reader.infos["a"].code == "F4"
    with raises("E121", "'a'", "x.safetensors", "'F4'", "F8_E4M3"):
        reader.read("a")


_WRITER_DTYPES = [
    np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, np.float32, np.float64, np.complex64, ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
]  # fmt: skip
_NAMES = hs.text(hs.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=8)


@hs.composite
def _tensors(draw):
    names = draw(hs.lists(_NAMES, max_size=6, unique=True))
    out = {}
    for name in names:
        dtype = np.dtype(draw(hs.sampled_from(_WRITER_DTYPES)))
        shape = tuple(draw(hs.lists(hs.integers(0, 3), max_size=3)))
        raw = draw(hs.binary(min_size=int(np.prod(shape)) * dtype.itemsize,
                             max_size=int(np.prod(shape)) * dtype.itemsize))  # fmt: skip
        out[name] = np.frombuffer(raw, dtype).reshape(shape).copy()
    return out


@given(
    tensors=_tensors(),
    metadata=hs.none()
    | hs.dictionaries(_NAMES, hs.text(max_size=12).filter(lambda s: "\x00" not in s)),
)
@settings(deadline=None)
def test_the_one_writer_is_byte_identical_to_safetensors_save_file(
    tmp_path_factory, tensors, metadata
):
    """``write_tensors`` against ``safetensors.numpy.save_file``, byte for byte.

    Byte for byte up to the order of several metadata entries, which the library writes in
    a random order (a hash map's) and the writer in sorted order (the same every time).
    """
    if not tensors and metadata == {}:
        return  # the library writes a header it cannot read here: the test below
    folder = tmp_path_factory.mktemp("w")
    ours, theirs = str(folder / "ours"), str(folder / "theirs")
    container.write_tensors(ours, tensors, metadata)
    save_file(tensors, theirs, metadata=metadata)
    mine, lib = open(ours, "rb").read(), open(theirs, "rb").read()
    if len(metadata or {}) <= 1:
        assert mine == lib
    else:  # the library keeps metadata in a hash map: its order is random, ours sorted
        n = int.from_bytes(lib[:8], "little")
        assert mine[:8] == lib[:8] and mine[8 + n :] == lib[8 + n :]
        assert json.loads(mine[8 : 8 + n]) == json.loads(lib[8 : 8 + n])
        assert list(json.loads(mine[8 : 8 + n])["__metadata__"]) == sorted(metadata)


def test_no_tensors_and_empty_metadata_is_a_file_that_reads_back(tmp_path) -> None:
    """The one case the writer departs from ``save_file``: the library's file is not readable."""
    from safetensors.numpy import load_file

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    container.write_tensors(ours, {}, {})
    save_file({}, theirs, metadata={})
    assert load_file(ours) == {} and Reader(ours).metadata == {}
    with pytest.raises(Exception, match="JSON"):  # the library's own quirk, not ours
        load_file(theirs)
