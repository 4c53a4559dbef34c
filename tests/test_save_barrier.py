"""``st.save(gather=True)`` on several processes ends with a barrier on every process.

Process 0 writes; each process returns only once the file is there, so any
process may read it next. Here the processes are simulated (``jax.process_count``
and ``process_index`` patched, the barrier recorded); tests/test_multihost.py
runs two real processes and reads the file from process 1 right after the save.
"""

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

import sharetree as st


@pytest.fixture
def processes(monkeypatch):
    barriers = []
    monkeypatch.setattr(multihost_utils, "sync_global_devices", barriers.append)
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def as_process(i):
        monkeypatch.setattr(jax, "process_index", lambda: i)

    return as_process, barriers


def _tree():
    return {"emb": np.arange(6.0, dtype=np.float32).reshape(3, 2), "head": st.Tied("emb", st.T)}


def test_every_process_reaches_the_barrier_and_only_process_0_writes(tmp_path, processes):
    as_process, barriers = processes
    path = tmp_path / "model.safetensors"
    as_process(1)
    st.save(path, _tree(), gather=True)
    assert not path.exists() and len(barriers) == 1  # waits for process 0 there
    as_process(0)
    st.save(path, _tree(), gather=True)
    assert path.exists() and len(barriers) == 2 and barriers[0] == barriers[1]
    back = st.load(path)
    assert back["head"] == st.Tied("emb", st.T)
    np.testing.assert_array_equal(back["emb"], _tree()["emb"])


def test_the_barrier_is_reached_when_the_write_fails(tmp_path, processes):
    as_process, barriers = processes
    as_process(0)
    with pytest.raises(OSError):
        st.save(tmp_path / "missing" / "model.safetensors", _tree(), gather=True)
    assert len(barriers) == 1  # the other processes are not left waiting


def test_no_barrier_without_gather_or_on_one_process(tmp_path, processes, monkeypatch):
    as_process, barriers = processes
    as_process(0)
    st.save(tmp_path / "a.safetensors", _tree())
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    st.save(tmp_path / "b.safetensors", _tree(), gather=True)
    assert barriers == []
