"""Ties on JAX's multi-controller runtime: 2 processes x 4 CPU devices, gloo over 127.0.0.1.

``tests/_multihost_launcher.py`` starts the worker ``tests/_multihost_worker.py``
(the "Many hosts" recipe of docs/saving_and_scaling.md) as two processes of one
job on a free loopback port, with one deadline, and kills every process it
started when one fails. The module runs three jobs, once:

1. ``train``: first ``st.load`` by shard of the checkpoints
   :func:`write_load_checkpoints` wrote (``load_<i>.json``); then the tied LM
   trained on the global (2, 4) mesh, an Orbax save after 3 steps;
2. ``resume``: a fresh pair restores that checkpoint and trains on; then it
   starts another save and process 1 is killed during the write (held first at
   a known point of Orbax's background save: its share written, the temporary
   directory there, before the barrier the commit needs; no timing involved);
3. ``single``: one process with 8 devices: the same model, the same model
   tied by hand (``W`` and ``W.T``; a block called twice), and a restore of
   the latest checkpoint left by the interrupted save.

The tests compare what each job wrote (JSON facts and NumPy arrays). A fourth job,
``save`` (issue 35), has both processes write one safetensors file together (each its
share), reads it back, writes Hugging Face's sharded layout, then runs the faults: a
buffer deleted on one process, different ``metadata=``, a path the processes see as
two directories, a full disk, and last process 1 killed while writing (process 0 times
out on its own: the launcher does not stop it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("optax")

sys.path.insert(0, str(Path(__file__).parent))
import _multihost_launcher as launcher

RTOL, ATOL = 1e-5, 1e-6
pytestmark = pytest.mark.slow  # two clusters of 2 processes and one of 8 devices


class Run:
    """The outputs of the three jobs."""

    def need_resume(self) -> None:
        """Skip, naming the versions, where the resume job hung (see ``resume_hung``)."""
        if self.resume_hung:
            import jax
            import orbax.checkpoint as ocp

            pytest.skip(
                f"the Orbax resume job hung past its deadline (jax {jax.__version__}, "
                f"orbax-checkpoint {ocp.__version__}): {self.resume.report()[-300:]}"
            )

    def __init__(self, work: Path) -> None:
        self.work = work
        self.seconds: dict[str, float] = {}
        write_load_checkpoints(work)
        self.train = launcher.launch(["train", str(work)], timeout=launcher.deadline(120))
        assert self.train.ok, self.train.report()
        self.seconds["train"] = self.train.seconds
        hold = f"{launcher.deadline(60):.0f}"  # the held save reaches its hold point by then
        self.resume = launcher.launch(
            ["resume", str(work), "--kill-during-save", "--hold-timeout", hold],
            timeout=launcher.deadline(120),
        )
        self.seconds["resume"] = self.resume.seconds
        # every resume worker killed at its deadline: the Orbax restore and held save hung.
        # Measured with jax 0.12.1 and orbax-checkpoint 0.12.8, on this round's code and on
        # round 4's alike (an Orbax / jax interaction): the tests that read it say so.
        self.resume_hung = all(w.returncode is None for w in self.resume.workers)
        start = time.monotonic()
        single = launcher.run_single(["single", str(work)], timeout=launcher.deadline(120))
        assert single.returncode == 0, single.stderr[-4000:]
        self.seconds["single"] = time.monotonic() - start

    def json(self, name: str) -> dict:
        return json.loads((self.work / f"{name}.json").read_text())

    def arrays(self, name: str, prefix: str) -> dict[str, np.ndarray]:
        with np.load(self.work / f"{name}.npz") as f:
            return {k[len(prefix) :]: f[k] for k in f.files if k.startswith(prefix)}


# the checkpoint of issue 23, scaled down: a tied embedding split by rows over all 8
# devices, a kernel split by columns (24 MiB); the worker's train job loads it first
LOAD_EMBED, LOAD_KERNEL = (2048, 2048), (1024, 2048)


def write_load_checkpoints(work: Path) -> None:
    from safetensors.numpy import save_file

    import sharetree as st

    rng = np.random.default_rng(23)
    embed = rng.standard_normal(LOAD_EMBED, np.float32)
    kernel = rng.standard_normal(LOAD_KERNEL, np.float32)
    st.save(
        work / "load_own.safetensors",
        {"embed": embed, "kernel": kernel, "head": st.Tied("embed", st.T)},
    )
    (work / "load_hf").mkdir()  # save_pretrained style: the head is absent, tied by ties=
    save_file(
        {"model.embed_tokens.weight": embed, "kernel": kernel},
        str(work / "load_hf" / "model.safetensors"),
        metadata={"format": "pt"},
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    r = Run(tmp_path_factory.mktemp("multihost"))
    print(f"multi-process jobs, wall seconds: {r.seconds}")
    return r


def assert_close(a: dict, b: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def test_two_processes_see_one_global_mesh(run: Run) -> None:
    for i in range(2):
        facts = run.json(f"train_{i}")
        assert facts["process_index"] == i
        assert facts["process_count"] == 2
        assert facts["device_count"] == 8
        assert facts["local_device_count"] == 4
    assert run.json("single_0")["device_count"] == 8


def test_every_process_has_the_same_ties_and_treedef(run: Run) -> None:
    p0, p1 = run.json("train_0"), run.json("train_1")
    ties = [["blocks/2", "Tied('blocks/0')"], ["head", "Tied('embed', T)"]]
    for facts in (p0, p1):
        assert facts["ties"] == ties
        assert facts["final_ties"] == ties  # after 6 AdamW steps
        assert facts["final_treedef"] == facts["treedef"]
        assert [p for p, _ in facts["opt_ties"]] == [
            "1/0/mu/blocks/2",
            "1/0/mu/head",
            "1/0/nu/blocks/2",
            "1/0/nu/head",
        ]
    for key in ("treedef", "opt_treedef", "ties", "opt_ties", "final_treedef"):
        assert p0[key] == p1[key], key


def test_losses_grads_params_equal_one_process_with_8_devices(run: Run) -> None:
    single = run.json("single_0")
    for i in range(2):
        np.testing.assert_allclose(
            run.json(f"train_{i}")["losses"], single["tied_losses"], rtol=RTOL
        )
        assert_close(run.arrays(f"train_{i}", "grads/"), run.arrays("single_0", "tied/grads/"))
        assert_close(run.arrays(f"train_{i}", "params/"), run.arrays("single_0", "tied/params/"))
    losses = single["tied_losses"]
    assert len(losses) >= 5 and losses[-1] < losses[0]  # it trains


def test_equal_to_the_model_tied_by_hand(run: Run) -> None:
    # the reference has no sharetree: one embedding used as W and W.T, block 0 called twice
    single = run.json("single_0")
    np.testing.assert_allclose(run.json("train_0")["losses"], single["hand_losses"], rtol=RTOL)
    assert_close(run.arrays("train_0", "grads/"), run.arrays("single_0", "hand/grads/"))
    assert_close(run.arrays("train_0", "params/"), run.arrays("single_0", "hand/params/"))


def test_the_table_is_one_global_array(run: Run) -> None:
    for i in range(2):
        facts = run.json(f"train_{i}")
        assert facts["num_param_leaves"] == 7  # embed + 2 blocks x 3: no head, no third block
        assert facts["num_tables"] == 1
        assert facts["num_tables_in_state"] == 2  # Adam's mu and nu, one each
        assert facts["embed_shape"] == [64, 16]
        assert facts["embed_spec"] == "P('model', None)"
        assert facts["embed_fully_addressable"] is False
        assert facts["embed_local_shards"] == [[16, 16]] * 4  # vocab split over model=4


def test_per_device_argument_bytes_are_the_unique_shards(run: Run) -> None:
    facts = run.json("train_0")
    if facts["argument_bytes"] is None:
        pytest.skip("this XLA backend gives no memory analysis")
    assert facts["argument_bytes"] == facts["unique_shard_bytes"]


def test_orbax_restore_on_a_fresh_pair_then_training_continues(run: Run) -> None:
    run.need_resume()
    train = [run.json(f"train_{i}") for i in range(2)]
    for i in range(2):
        facts = run.json(f"resume_{i}")
        assert facts["restored_step"] == 3
        assert facts["restored_ties"] == train[i]["ties"]
        assert facts["restored_opt_ties"] == train[i]["opt_ties"]
        assert facts["restored_treedef"] == train[i]["treedef"]
        assert facts["restored_shardings_equal"] is True
        assert_close(run.arrays(f"resume_{i}", "restored/"), run.arrays("train_0", "saved/"), 0, 0)
        np.testing.assert_allclose(facts["losses"], train[i]["losses"][3:], rtol=RTOL)
        assert_close(run.arrays(f"resume_{i}", "params/"), run.arrays("train_0", "params/"))


def test_a_save_interrupted_by_a_killed_process_leaves_the_previous_checkpoint(run: Run) -> None:
    run.need_resume()
    codes = [w.returncode for w in run.resume.workers]
    assert codes[1] == -9, run.resume.report()  # killed during the write
    assert codes[0] != 0  # the job lost a process: the launcher ended it
    # checked when process 1 was killed: held before the barrier the commit needs, the
    # temporary directory of step 6 there and no committed step 6
    at_kill = json.loads((run.work / "save_in_flight_1.json").read_text())
    assert "async_write_complete" in at_kill["held_at"]
    assert "6" not in at_kill["ckpt_entries"]
    assert [e for e in at_kill["ckpt_entries"] if e.startswith("6.orbax-checkpoint-tmp")], at_kill
    ckpt = run.work / "ckpt"
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("6.")], "the save never started"
    assert not (ckpt / "6").exists()
    single = run.json("single_0")
    assert single["ckpt_steps"] == [3]  # the interrupted step 6 is not a checkpoint
    assert single["ckpt_ties"] == run.json("train_0")["ties"]
    assert_close(run.arrays("single_0", "ckpt/"), run.arrays("train_0", "saved/"), 0, 0)


def test_a_worker_that_cannot_reach_the_coordinator_fails_in_bounded_time(tmp_path: Path) -> None:
    address = f"127.0.0.1:{launcher.free_port()}"  # nothing listens there
    cmd = [sys.executable, str(launcher.WORKER), "train", str(tmp_path), "--coordinator", address]
    cmd += ["--process-id", "1", "--num-processes", "2", "--local-devices", "4"]
    proc = subprocess.run(
        [*cmd, "--init-timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,  # no hang: the worker gives up after its 3 s
        env=launcher._env(),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"could not reach the JAX coordinator at {address} within 3 s" in proc.stderr


def _worker_module():
    import importlib

    if str(launcher.ROOT) not in sys.path:
        sys.path.insert(0, str(launcher.ROOT))  # the worker imports benchmarks.memory
    return importlib.import_module("_multihost_worker")


def test_the_held_save_fails_loudly_when_orbax_internals_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the kill-during-save case never falls back to killing at an unknown moment
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.checkpointers import async_checkpointer as ac

    worker = _worker_module()
    name = "_background_wait_for_commit_futures"
    monkeypatch.setattr(ocp.CheckpointManager, "save", ocp.CheckpointManager.save)
    monkeypatch.setattr(ac, name, getattr(ac, name))  # restored after the test
    monkeypatch.delattr(ac, name)
    with pytest.raises(worker.OrbaxInternalsMoved, match="internals moved"):
        worker.hold_save_in_flight(str(tmp_path), 1, timeout=1.0)
    monkeypatch.undo()
    # the hook is installed but never reached (one process: Orbax calls no barrier)
    monkeypatch.setattr(ocp.CheckpointManager, "save", ocp.CheckpointManager.save)
    monkeypatch.setattr(ac, name, getattr(ac, name))
    worker.hold_save_in_flight(str(tmp_path), 1, timeout=1.0)
    ckpt = ocp.CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(worker.OrbaxInternalsMoved, match="never called"):
        ckpt.save(1, args=ocp.args.StandardSave({"x": np.zeros(3, np.float32)}))
    ckpt.wait_until_finished()
    ckpt.close()


def test_the_docs_recipe_is_the_worker_that_runs_here() -> None:
    import re

    doc = (Path(__file__).parent.parent / "docs" / "saving_and_scaling.md").read_text()
    worker = launcher.WORKER.read_text()
    blocks = re.findall(r"<!-- tests/_multihost_worker.py: (\w+) -->\n```py\n(.*?)```", doc, re.S)
    assert [name for name, _ in blocks] == ["start", "model", "train", "resume"]
    for name, code in blocks:
        region = re.search(
            rf"^# docs: begin {name}\n(.*?)^# docs: end {name}\n", worker, re.S | re.M
        )
        assert region, name
        assert code.strip() == region.group(1).strip(), (
            f"docs block {name!r} differs from the worker"
        )


def test_st_save_gathers_and_st_load_places_on_the_global_shardings(run: Run) -> None:
    import inspect

    import sharetree as st

    if "gather" not in inspect.signature(st.save).parameters:
        pytest.skip("st.save(..., gather=True) is not in this sharetree")
    assert (run.work / "model.safetensors").exists()  # written once, by process 0
    train_0 = run.json("train_0")
    for i in range(2):  # read at once by each process after save returned (its barrier)
        facts = run.json(f"read_after_save_{i}")
        assert facts["exists"] is True and facts["ties"] == train_0["ties"]
        np.testing.assert_array_equal(facts["embed"], run.arrays("train_0", "params/")["embed"])
    final = run.arrays("train_0", "params/")
    run.need_resume()
    for i in range(2):
        facts = run.json(f"resume_{i}")
        assert facts["st_load_ties"] == run.json("train_0")["ties"]
        assert facts["st_load_shardings_equal"] is True
        assert_close(run.arrays(f"resume_{i}", "st_load/"), final, 0, 0)


@pytest.mark.parametrize("name", ["own", "hf"])
def test_st_load_reads_only_each_process_share(run: Run, name: str) -> None:
    ties = {
        "own": [["head", "Tied('embed', T)"]],
        "hf": [["lm_head.weight", "Tied('model.embed_tokens.weight')"]],
    }
    for i in range(2):
        facts = run.json(f"load_{i}")[name]
        assert facts["ties"] == ties[name]  # the tie is kept
        assert facts["shards_equal"] and all(facts["shards_equal"].values()), facts["shards_equal"]
        assert len(facts["shards_equal"]) == 2  # the embedding and the kernel
        assert facts["embed_shape"] == list(LOAD_EMBED)  # one global array ...
        assert facts["embed_fully_addressable"] is False  # ... split over both processes
        assert facts["embed_local_shards"] == 4
        # this process's shards are half the file; reading the tensors whole would exceed 1x
        assert facts["growth"] < facts["file_bytes"], (
            f"{facts['growth'] / facts['file_bytes']:.2f}x"
        )


class Saved:
    """The ``save`` job: 2 processes x 4 devices each write their share of one file (issue 35)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        timeout = launcher.deadline(10)  # st.save's timeout= for the killed-process case
        self.job = launcher.launch(
            ["save", str(work), "--save-timeout", f"{timeout:.1f}"],
            timeout=launcher.deadline(150),
            stop_all_when_one_dies=False,  # process 0 must time out on its own
        )
        self.timeout = timeout
        self.facts = [
            json.loads(p.read_text()) if (p := work / f"save_{i}.json").exists() else None
            for i in range(2)
        ]
        assert self.facts[0] is not None and self.facts[1] is not None, self.job.report()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return Saved(tmp_path_factory.mktemp("multihost_save"))


def test_every_process_writes_its_share_of_one_standard_file(saved: Saved) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    import sharetree as st

    want = _worker_module().save_arrays()
    path = str(saved.work / "coop.safetensors")
    file = load_file(path)  # safetensors' own reader, in this plain process
    assert sorted(file) == sorted(want)  # each buffer once: no head, no slice
    for k, v in want.items():
        assert file[k].dtype == v.dtype and file[k].shape == v.shape, k
        np.testing.assert_array_equal(file[k], v, err_msg=k)
    with safe_open(path, "np") as f:
        assert f.metadata()["format"] == "pt"
    back = st.materialize(st.load(path))
    np.testing.assert_array_equal(back["head"], want["embed"].T)  # the transposed view
    np.testing.assert_array_equal(back["first"], want["kernel"][:8])  # the sliced view


def test_st_load_by_shard_gives_every_shard_and_keeps_the_ties(saved: Saved) -> None:
    for facts in saved.facts:
        assert facts["ties"] == [
            ["first", "Tied('kernel', slice(0, 8))"],
            ["head", "Tied('embed', T)"],
        ]
        assert facts["shards_equal"] == {"embed": True, "kernel": True, "norm": True, "mixed": True}
        assert facts["shardings_equal"] is True
        # no process held a whole buffer: its share of the file and one part at most
        assert facts["growth"] <= facts["file_bytes"] // 2 + facts["part_bytes"], facts


@pytest.mark.parametrize(
    ("fault", "code", "facts"),
    [
        ("bad_buffer", "E57", ["'norm'", "deleted", "process 1 of 2"]),
        ("metadata", "E220", ["metadata=", "process 1"]),
        ("not_shared", "E221", ["'model.safetensors'", "[1]", "local_0"]),
        ("disk_full", "E223", ["process 1 of 2", "No space left on device"]),
    ],
)
def test_a_fault_on_one_process_is_the_same_error_everywhere(saved, fault, code, facts) -> None:
    seen = [f["faults"][fault] for f in saved.facts]
    assert seen[0]["type"] == "TieError" and seen[0]["code"] == code, seen
    assert seen[0]["message"] == seen[1]["message"]  # the same error on every process
    text = "\n".join([seen[0]["message"], *seen[0]["notes"]])
    for fact in facts:
        assert fact in text, (fact, text)
    for f in saved.facts:
        assert f["intact_after_faults"] is True  # the previous file, byte for byte
        assert not [e for e in f["entries_after_faults"] if e.startswith(".")]  # no temporary
        assert not [e for e in f["entries_after_save"] if e.startswith(".")]
        assert f["same_after_resave"] is True


def test_a_process_killed_while_writing_is_a_timeout_and_the_old_file_stays(saved) -> None:
    codes = [w.returncode for w in saved.job.workers]
    assert codes == [0, -9], saved.job.report()  # process 0 went on alone, and returned
    facts = saved.facts[0]
    killed = facts["killed"]
    assert killed["code"] == "E224" and "process 1 of 2" in killed["message"], killed
    assert "'write'" in killed["message"]
    assert facts["killed_seconds"] < saved.timeout + launcher.deadline(30)  # no hang
    assert facts["intact_after_kill"] is True


def test_the_sharded_layout_written_by_both_processes(saved: Saved) -> None:
    from safetensors.numpy import load_file

    want = _worker_module().save_arrays()
    want["model.embed_tokens.weight"] = want.pop("embed")
    out = saved.work / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    seen = {}
    for name in files:  # safetensors' own reader, in this plain process
        part = load_file(str(out / name))
        assert all(index["weight_map"][k] == name for k in part)  # each tensor in one file
        seen.update(part)
    assert sorted(seen) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(seen[k], v, err_msg=k)
    for facts in saved.facts:
        hf = facts["hf"]
        assert hf["files"] == [*files, "model.safetensors.index.json"]
        assert hf["ties"] == [["lm_head.weight", "Tied('model.embed_tokens.weight')"]]
        assert all(hf["shards_equal"].values()), hf["shards_equal"]
