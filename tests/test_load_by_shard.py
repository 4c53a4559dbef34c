"""``st.load`` reads each tensor once: on the host within 1.1x the file, by shard with shardings.

Each check runs ``tests/_load_script.py`` in a fresh process (memory is
measured as peak ``RssAnon`` growth, sampled on a thread). The two-process
checks are in ``tests/test_multihost.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
EMB, KER, Q = (1024, 2048), (2048, 1024), (512, 1024)


def _run(mode: str, tmp_path: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_load_script.py"), mode, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_shardings_one_pass_within_1_1x_the_file(tmp_path) -> None:
    out = _run("host", tmp_path)
    nbytes = {"embed": 4 * math.prod(EMB), "kernel": 4 * math.prod(KER), "q": math.prod(Q)}
    for name, want in (
        ("own", {**nbytes, "bias": 40}),
        ("hf", {"lm_head.weight": nbytes["embed"], "kernel": nbytes["kernel"]}),
    ):
        got = out[name]
        assert got["equal"] and got["head"] == "Tied('embed', T)"
        assert got["readers"] == 1  # one header parse
        assert got["bytes_read"] == want  # each tensor's bytes once
        size = out["sizes"][name]
        assert got["growth"] <= 1.1 * size, f"{name}: {got['growth'] / size:.2f}x the file"


def test_with_shardings_each_part_is_read_once_and_shards_equal_the_file(tmp_path) -> None:
    out = _run("shards", tmp_path)
    assert out["file_kernel_equal"]
    for name in ("own", "hf"):
        got = out[name]
        assert all(got["shards_equal"].values()), got["shards_equal"]
        assert got["head"] == "Tied('embed', T)"
        # PartitionSpec's repr: "P(...)" on newer jax, "PartitionSpec(...)" on 0.8
        assert got["specs"]["embed"] in (
            "P(('data', 'model'), None)",
            "PartitionSpec(('data', 'model'), None)",
        )
        parts = [(n, tuple(map(tuple, b))) for n, b, _ in got["reads"] if b is not None]
        assert len(parts) == len(set(parts))  # no part read twice (replicas share one read)
        for tensor, shape in (
            ("embed" if name == "own" else "lm_head.weight", EMB),
            ("kernel", KER),
        ):
            sizes = [b for n, _, b in got["reads"] if n == tensor]
            assert sum(sizes) == 4 * math.prod(shape)  # all of it, once, in 8 or 4 parts
            assert max(sizes) < 4 * math.prod(shape)  # never the whole tensor
    assert out["both_head"] == "Tied('emb', T)"  # equal copies: tied
    assert "'head' and T of 'emb' differ by up to 0.5" in out["both_error"]
    assert "1 of 2097152 elements above atol=0.0" in out["both_error"]
    assert "sharding at 'embed' does not fit its buffer of shape (1024, 2048)" in out["rank_error"]
    assert "{'data': 2, 'model': 4}" in out["fit_error"]
    assert "sharding at 'bias' does not fit its buffer of shape (10,)" in out["fit_error"]


if not sys.platform.startswith("linux"):  # RssAnon is Linux's
    pytestmark = pytest.mark.skip("needs /proc/self/status")
