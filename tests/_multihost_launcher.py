"""Start a multi-controller JAX job on this machine: N worker processes on a loopback port.

Each worker gets ``--coordinator 127.0.0.1:PORT --process-id i --num-processes N``.
:func:`launch` waits for all of them with one deadline, kills every process it
started when one fails or the deadline passes, and returns each worker's exit
status and output so that a failure can report every worker's stderr.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("_multihost_worker.py")
ROOT = WORKER.parent.parent  # the repository: the workers import this checkout's sharetree


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the worker sets the simulated device count itself
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@dataclass(frozen=True)
class Worker:
    """What one worker process did."""

    process_id: int
    returncode: int | None  # None: killed by the launcher (deadline or another worker failed)
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Job:
    """The workers of one launch, and how long the launch took."""

    workers: tuple[Worker, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(w.returncode == 0 for w in self.workers)

    def report(self) -> str:
        """Every worker's exit status and the tail of its stderr (for assertion messages)."""
        return "\n".join(
            f"--- process {w.process_id}: exit {w.returncode}\n{w.stderr[-3000:]}"
            for w in self.workers
        )


def deadline(seconds: float) -> float:
    """``seconds`` as on an idle 4-core machine, scaled to this one's cores and load.

    A job of 2 processes x 4 simulated devices shares the cores with whatever else
    runs (pytest-xdist workers, other jobs): fewer cores or a higher load average give
    it proportionally longer, so a deadline stops a hang, never a slow machine.
    """
    cores = os.cpu_count() or 1
    return seconds * max(1.0, 4 / cores) * max(1.0, os.getloadavg()[0] / cores)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group: it and its children
        proc.wait()


def launch(
    args: list[str],
    *,
    num_processes: int = 2,
    timeout: float = 120.0,
    port: int | None = None,
    stop_all_when_one_dies: bool = True,
    worker: Path = WORKER,
) -> Job:
    """Run ``_multihost_worker.py ARGS`` as ``num_processes`` processes of one job.

    Args:
        args: the worker's arguments (mode, output directory, options).
        num_processes: how many processes (one per simulated host).
        timeout: seconds for the whole job; then every worker still running is killed.
        port: the coordinator's port (a free loopback port by default).
        stop_all_when_one_dies: kill the others as soon as one worker exits
            with an error (a cluster scheduler ends a job that lost a process).
        worker: the worker script (``_multihost_worker.py`` by default).
    """
    port = free_port() if port is None else port
    env = _env()
    procs = []
    logs = []
    start = time.monotonic()
    try:
        for i in range(num_processes):
            out = tempfile.TemporaryFile()
            err = tempfile.TemporaryFile()
            logs.append((out, err))
            cmd = [
                sys.executable,
                str(worker),
                *args,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--process-id",
                str(i),
                "--num-processes",
                str(num_processes),
                "--local-devices",
                "4",
            ]
            procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
            )
        killed: set[int] = set()
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if time.monotonic() - start > timeout or (failed and stop_all_when_one_dies):
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        killed.add(i)
                        _kill(p)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill(p)
    workers = []
    for i, (p, (out, err)) in enumerate(zip(procs, logs)):
        out.seek(0)
        err.seek(0)
        text_out, text_err = (
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
        )
        out.close()
        err.close()
        workers.append(Worker(i, None if i in killed else p.returncode, text_out, text_err))
    return Job(tuple(workers), time.monotonic() - start)


def run_single(args: list[str], *, timeout: float = 120.0) -> Worker:
    """Run the worker as one process with 8 simulated devices (the reference)."""
    env = _env()
    proc = subprocess.run(
        [sys.executable, str(WORKER), *args, "--local-devices", "8"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return Worker(0, proc.returncode, proc.stdout, proc.stderr)
