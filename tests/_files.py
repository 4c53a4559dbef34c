"""Helpers of the save/load tests: a file as other readers see it, damaged copies of a file."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import sharetree as st


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
    """Write a safetensors file as another tool would (no sharetree checks)."""
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


@contextlib.contextmanager
def warns(code: str, *facts: str) -> Iterator[Any]:
    """Expect a ``UserWarning`` of ``code`` (its text starts ``[code]``) naming every fact."""
    with pytest.warns(UserWarning) as record:
        yield record
    texts = [str(w.message) for w in record]
    assert any(t.startswith(f"[{code}]") and all(f in t for f in facts) for t in texts), texts
