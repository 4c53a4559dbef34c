"""``python -m benchmarks.save``: ``st.save`` by every process against ``gather=True``.

The checkpoint of the load benchmark (``benchmarks/load.py``): a ``16,384 x 2,048``
float32 embedding tied to the head (``Tied("embed", T)``), split by rows over all
devices, and a ``2,048 x 8,192`` kernel split by columns (192 MiB). Each setup (2
processes x 4 devices, 4 x 2; JAX processes over gloo on 127.0.0.1) starts fresh
processes, which load their shards of the file (``st.load(shardings=)``), warm up on
a tiny tree, then measure in turns:

* ``st.save(path, tree)``: every process writes its share of one file;
* ``st.save(path, tree, gather=True)``: every process gathers, process 0 writes.

Each measurement is the peak growth of the process's anonymous memory (``RssAnon``
sampled on a thread; the first round, in a fresh process) and the wall time. The
reference is one process's ``safetensors.numpy.save_file`` of the whole tree (host
arrays), timed in this process. The two files of a round are compared: the same header
(as JSON) and the same data, byte for byte.
Results go to ``benchmarks/results/<date>-save.json`` with the machine and its load
average. Run it alone: ``flock /tmp/sharetree-bench.lock python -m benchmarks.save``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.load import EMBED, KERNEL, QUICK_EMBED, QUICK_KERNEL

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SETUPS = ((2, 4), (4, 2))  # (processes, devices per process)
METHODS = ("st.save", "st.save(gather=True)")


def write_checkpoint(path: Path, embed: tuple[int, int], kernel: tuple[int, int]) -> int:
    """The tied checkpoint the workers load their shards of; its size in bytes."""
    import numpy as np

    import sharetree as st

    rng = np.random.default_rng(0)
    tree = {
        "embed": rng.standard_normal(embed, np.float32),
        "kernel": rng.standard_normal(kernel, np.float32),
        "head": st.Tied("embed", st.T),
    }
    st.save(path, tree)
    return path.stat().st_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_setup(path: Path, processes: int, devices: int, rounds: int, timeout: float) -> list[dict]:
    """Start ``processes`` workers of one job; return each one's measurements."""
    port, out = free_port(), Path(tempfile.mkdtemp(prefix="sharetree-save-", dir=path.parent))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "benchmarks.save", "--worker", str(path), str(out)]
        cmd += ["--process-id", str(i), "--processes", str(processes), "--port", str(port)]
        cmd += ["--rounds", str(rounds)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"{processes} x {devices}: a worker failed or timed out")
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [json.loads((out / f"{i}.json").read_text()) for i in range(processes)]


def contents(path: str) -> tuple[dict, str]:
    """A file's header (parsed: safetensors writes metadata in a hash map's order) and the
    SHA-256 of its data."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return header, h.hexdigest()


def worker(args: argparse.Namespace) -> None:
    """One process: initialize, load its shards, warm up, then both saves in turns."""
    import gc

    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.memory import PeakAnon, fixed_mmap_threshold

    fixed_mmap_threshold()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{args.port}", args.processes, args.process_id, initialization_timeout=60
    )
    import sharetree as st

    mesh = jax.make_mesh((jax.device_count(),), ("all",))
    shardings = {
        "embed": NamedSharding(mesh, P("all", None)),  # rows over every device
        "kernel": NamedSharding(mesh, P(None, "all")),  # columns
        "head": None,
    }
    tree = st.load(args.worker, shardings=shardings)  # this process's shards only
    small = {"w": jax.device_put(np.ones((64, 2), np.float32), shardings["embed"])}
    for gather in (False, True):  # first calls, not measured
        st.save(os.path.join(args.out, "warm.safetensors"), small, gather=gather)
    gc.collect()
    paths = {m: os.path.join(args.out, f"{i}.safetensors") for i, m in enumerate(METHODS)}
    methods = {
        "st.save": lambda: st.save(paths["st.save"], tree),
        "st.save(gather=True)": lambda: st.save(paths["st.save(gather=True)"], tree, gather=True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    growth: dict[str, int] = {}
    same: list[bool] = []
    for _ in range(args.rounds):
        for name, save in methods.items():
            gc.collect()
            multihost_utils.sync_global_devices(f"bench {name}")  # start together
            with PeakAnon() as memory:
                start = time.perf_counter()
                save()
                seconds[name].append(time.perf_counter() - start)
            growth.setdefault(name, memory.growth)  # the first round: a fresh process
        same.append(contents(paths["st.save"]) == contents(paths["st.save(gather=True)"]))
    local = sum(s.data.nbytes for k in ("embed", "kernel") for s in tree[k].addressable_shards)
    facts = {"local_shard_bytes": local, "same_file": same}
    facts["largest_part_bytes"] = max(
        s.data.nbytes for k in ("embed", "kernel") for s in tree[k].addressable_shards
    )
    with open(os.path.join(args.out, f"{args.process_id}.json"), "w") as f:
        json.dump({"growth": growth, "seconds": seconds, **facts}, f)
    jax.distributed.shutdown()


def save_file_seconds(path: Path, rounds: int) -> list[float]:
    """One process's ``safetensors`` ``save_file`` of the whole tree (host arrays), timed."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    out = path.with_name("save_file.safetensors")
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        save_file(tensors, str(out))
        times.append(time.perf_counter() - start)
    out.unlink()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("out_dir", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per method")
    p.add_argument("--quick", action="store_true", help="a 1.5 MiB file, one round; saves nothing")
    p.add_argument("--out", type=Path, help="where to write the JSON (default: results/)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per setup")
    args = p.parse_args(argv)
    if args.worker:
        args.out = args.out_dir
        worker(args)
        return 0
    from benchmarks.timing import machine_info

    machine = machine_info()  # before the run: the load average it started at
    rounds = 1 if args.quick else args.rounds
    embed, kernel = (QUICK_EMBED, QUICK_KERNEL) if args.quick else (EMBED, KERNEL)
    with tempfile.TemporaryDirectory(prefix="sharetree-bench-") as d:
        path = Path(d) / "model.safetensors"
        size = write_checkpoint(path, embed, kernel)
        reference = statistics.median(save_file_seconds(path, rounds))
        rows = []
        for processes, devices in SETUPS:
            workers = run_setup(path, processes, devices, rounds, args.timeout)
            med = {
                m: statistics.median(t for w in workers for t in w["seconds"][m]) for m in METHODS
            }
            row = {
                "setup": f"{processes} x {devices} devices",
                "processes": processes,
                "devices_per_process": devices,
                "share_over_file": max(w["local_shard_bytes"] for w in workers) / size,
                "part_over_file": max(w["largest_part_bytes"] for w in workers) / size,
                "growth_over_file": {
                    m: max(w["growth"][m] for w in workers) / size for m in METHODS
                },
                "seconds": med,
                "time_over_gather": med["st.save"] / med["st.save(gather=True)"],
                "time_over_save_file": med["st.save"] / reference,
                "same_file_as_gather": all(all(w["same_file"]) for w in workers),
                "workers": workers,
            }
            rows.append(row)
    print(
        f"file: {size / 2**20:.0f} MiB (embed {embed}, kernel {kernel}, float32); {rounds} round(s)"
    )
    print(f"one process's safetensors save_file of the whole tree: {reference:.3f} s")
    print("| setup | peak RssAnon growth / file: st.save, gather=True | share / file | "
          "time: st.save, gather=True | st.save / save_file | same file |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        g, s = r["growth_over_file"], r["seconds"]
        print(
            f"| {r['setup']} | {g['st.save']:.2f}x, {g['st.save(gather=True)']:.2f}x "
            f"| {r['share_over_file']:.2f}x | {s['st.save']:.3f} s, "
            f"{s['st.save(gather=True)']:.3f} s | {r['time_over_save_file']:.2f}x "
            f"| {r['same_file_as_gather']} |"
        )
    if args.quick and args.out is None:
        return 0
    import datetime

    machine["loadavg_end"] = list(os.getloadavg())
    out = args.out or RESULTS / f"{datetime.date.today().isoformat()}-save.json"
    result = {"machine": machine, "file_bytes": size, "embed": embed, "kernel": kernel}
    result["save_file_seconds"] = reference
    out.write_text(json.dumps({**result, "rounds": rounds, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
