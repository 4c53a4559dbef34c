"""Ties through device_put, jit with in/out shardings and optax on a 4x2 (data, model) mesh.

The checks run in a subprocess (``tests/_sharding_script.py``) because
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax
starts; the script writes one JSON entry per check and the tests below assert
on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_sharding_script.py")


def script_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the script once per test session (sharding and Orbax checks together)."""
    base = tmp_path_factory.getbasetemp()
    out = base / "sharding_script.json"
    if not out.exists():
        work = tmp_path_factory.mktemp("sharding_script")
        env = dict(
            os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
        )
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "all", str(work / "out.json"), str(work)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        (work / "out.json").replace(out)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return script_results(tmp_path_factory)["sharding"]


def test_eight_simulated_devices(result: dict) -> None:
    assert result["num_devices"] == 8


def test_sharding_tree_has_one_sharding_per_buffer(result: dict) -> None:
    # built with tree_map over the canonical tree: the Tied head gets no sharding of its own
    assert result["sharding_tree_keeps_tie"] is True
    assert result["num_shardings"] == 4


def test_device_put_keeps_the_tie_and_one_buffer_per_table(result: dict) -> None:
    assert result["device_put_keeps_tie"] is True
    assert result["num_buffers"] == 4  # embed, w1, b1, w2: the head is no array
    assert result["num_tables"] == 1


def test_tied_table_is_one_buffer_sharded_across_all_devices(result: dict) -> None:
    assert result["embed_spec"] == "P(None, 'model')"
    assert result["embed_num_shards"] == 8
    assert result["embed_devices"] == 8
    assert result["embed_shard_shapes"] == [[64, 8]]  # DIM 16 split over model=2
    assert result["embed_distinct_slices"] == 2
    # 8 shards of half a table: one copy per data replica (4), not two tables (8)
    assert result["table_copies_on_devices"] == 4.0


def test_jit_arguments_hold_each_buffer_once(result: dict) -> None:
    if "argument_bytes" not in result:
        pytest.skip("this XLA backend gives no memory analysis")
    compiled_bytes, expected_bytes = result["argument_bytes"]
    assert compiled_bytes == expected_bytes


def test_gradient_equals_one_device_and_untied_sum(result: dict) -> None:
    assert result["grad_matches_untied_sum"] is True  # independent reference
    assert result["grad_head_is_tied"] is True
    assert result["loss_equal"] is True
    assert result["grads_equal"] is True
    assert result["grad_embed_spec"] == "P(None, 'model')"


def test_adam_step_equals_one_device_and_keeps_ties_and_shardings(result: dict) -> None:
    assert result["opt_state_keeps_tie"] is True
    assert result["opt_state_embed_spec"] == "P(None, 'model')"
    assert result["step_equal"] is True
    assert result["state_equal"] is True
    assert result["second_step_equal"] is True
    assert result["new_params_keep_tie"] is True
    assert result["new_num_buffers"] == 4
    assert result["new_embed_spec"] == "P(None, 'model')"
