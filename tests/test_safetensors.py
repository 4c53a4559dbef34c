"""sharetree._safetensors: the header read by the library, raw reads, atomic writes."""

from __future__ import annotations

import os
import stat

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import sharetree as st
from sharetree import _safetensors
from sharetree._safetensors import Reader, TensorInfo, atomic_write


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
    with pytest.raises(st.TieError, match=r"x\.safetensors' is not a readable safetensors file"):
        Reader(str(path), "inspect")


def test_atomic_write_removes_its_temporary_file_on_failure(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "x.safetensors")
    atomic_write(path, {"a": np.ones(1)}, {})
    os.chmod(path, 0o640)
    before = open(path, "rb").read()

    def fail(tensors, filename, metadata):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(_safetensors, "_serialize_file", fail)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write(path, {"a": np.zeros(2)}, {})
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["x.safetensors"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
