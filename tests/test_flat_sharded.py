"""The flat path at scale (docs/flat.md, "The flat path at scale").

``tests/_flat_sharded_worker.py`` runs on 8 simulated devices (one process) and as 2
processes x 4 devices (``slow``, the multi-process job). Every figure it reports is a
comparison with the same computation on one device: the model tied by hand (plain
``jax.grad`` of ``head = embed.T``) and the same optax / optimistix / lineax run on the
one-device flat vector.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import _multihost_launcher as launcher
import jax
import pytest

WORKER = Path(__file__).with_name("_flat_sharded_worker.py")
ROOT = WORKER.parent.parent
LAYOUTS = ("sharded", "mixed")
CLIENTS = ("optax", "lbfgs", "cg")


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("flat8")
    cmd = [sys.executable, str(WORKER), str(out), "--local-devices", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "flat_0.json").read_text())


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("flat2x4")
    job = launcher.launch([str(out)], worker=WORKER, timeout=launcher.deadline(600))
    assert job.ok, job.report()
    return [json.loads((out / f"flat_{i}.json").read_text()) for i in range(2)]


def _check_layout(facts: dict, processes: int) -> None:
    # the vector spans the 8 devices; each holds one block, each process its share
    assert facts["devices"] == 8
    assert facts["block_lengths"] == [facts["block"]]
    assert facts["addressable_blocks"] == 8 // processes
    assert facts["length"] == 8 * facts["block"] == facts["unique"] + facts["padding"]
    assert facts["mask_sum"] == facts["unique"]
    # values, shardings and gradients equal the model tied by hand on one device
    assert facts["value_error"] <= 1e-6
    assert facts["shardings_kept"]
    assert facts["roundtrip_error"] == 0.0
    assert facts["grad_error"] <= 1e-6 * max(1.0, facts["grad_scale"])
    assert facts["padding_grad"] == 0.0
    # the flat client runs equal the one-device runs, moved the parameters, not the padding
    # every client ran, but lineax where it cannot run on these versions (see _lineax_runs)
    assert set(facts["clients"]) == set(CLIENTS) - ({"cg"} if "cg_unavailable" in facts else set())
    for client in facts["clients"]:
        assert facts[f"{client}_error"] <= 1e-5, client
        assert facts[f"{client}_moved"] > 1e-2, client
        assert facts[f"{client}_padding"] == 0.0, client
    if "cg" in facts["clients"]:
        assert facts["cg_steps"][0] == facts["cg_steps"][1] < 200  # converged, in as many steps


def _check_collectives(facts: dict) -> None:
    plain, flat = facts["plain_collectives"], facts["flat_collectives"]
    replicated = facts["replicated_buffers"]
    if replicated and "to" not in inspect.signature(jax.lax.all_gather).parameters:
        # jax < 0.10: the untyped all_gather, whose gradient reduce-scatters (docs/flat.md)
        pytest.skip("this jax's all_gather has no to=: a replicated buffer's VJP reduce-scatters")
    # restructure: gathers only, one per replicated buffer (one per mesh axis it is gathered
    # over where this jax lowers a gather over two axes as two, as 0.12 does), none in its VJP
    gathers = facts["unpack_collectives"].pop("all-gather", 0)
    assert facts["unpack_collectives"] == {}
    assert replicated <= gathers <= facts["replicated_axes"]
    assert facts["unpack_vjp_collectives"] == {}
    if not replicated:  # every buffer sharded over all devices: the tree program's collectives
        assert flat == plain
    for kind in ("all-reduce", "all-to-all", "reduce-scatter", "collective-permute"):
        assert flat.get(kind, 0) <= plain.get(kind, 0), kind


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_process_eight_devices(one_process: dict, layout: str) -> None:
    _check_layout(one_process["layouts"][layout], processes=1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_collectives_of_flat_grad_against_the_tree_program(one_process: dict, layout: str) -> None:
    _check_collectives(one_process["layouts"][layout])


def test_layouts_cover_replication_padding_and_views(one_process: dict) -> None:
    mixed = one_process["layouts"]["mixed"]
    assert mixed["replicated_buffers"] == 5 and mixed["padding"] == 3
    assert "3 views" in mixed["repr"] and "3 padding" in mixed["repr"]
    assert one_process["layouts"]["sharded"]["padding"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_four_devices_each(two_processes: list[dict], layout: str) -> None:
    for facts in two_processes:
        assert facts["processes"] == 2
        _check_layout(facts["layouts"][layout], processes=2)
        _check_collectives(facts["layouts"][layout])


def test_lineax_cg_ran_where_lineax_runs(one_process: dict) -> None:
    """lineax 0.1.0 (the newest beside jax 0.8.1) fails in its own primitive binding with
    jax 0.8.1 and equinox 0.12.2 (the lowest-versions job), on one device as on eight:
    the CG client is then skipped, never silently passed."""
    for layout in LAYOUTS:
        facts = one_process["layouts"][layout]
        if "cg_unavailable" in facts:
            pytest.skip(facts["cg_unavailable"][:200])
        assert "cg" in facts["clients"]
