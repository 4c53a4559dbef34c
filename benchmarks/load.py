"""``python -m benchmarks.load``: ``st.load(path, shardings=...)`` by process count, side by side.

The checkpoint of issue 23: a ``16,384 x 2,048`` float32 embedding tied to the
head (``Tied("embed", T)``), split by rows over all devices, and a ``2,048 x
8,192`` kernel split by columns (192 MiB). Each setup (1 process x 8 devices,
2 x 4, 4 x 2; JAX processes over gloo on 127.0.0.1) starts fresh processes;
each process measures, in turns:

* ``st.load(path, shardings=...)``: peak growth of its anonymous memory
  (``RssAnon`` sampled on a thread) and wall time;
* ``safetensors.numpy.load_file(path)``, the reference: each process reading
  the whole file to the host, nothing placed.

Before the measured rounds the file is read once (page cache warm) and a tiny
file loaded (first calls). The table gives, per setup, the largest memory
growth of any process over the file size and the median time ratio. Results
go to ``benchmarks/results/<date>-load.json`` with the machine. Run it alone:
``flock /tmp/sharetree-bench.lock python -m benchmarks.load``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SETUPS = ((1, 8), (2, 4), (4, 2))  # (processes, devices per process)
EMBED, KERNEL = (16384, 2048), (2048, 8192)
QUICK_EMBED, QUICK_KERNEL = (1024, 256), (256, 512)


def _write(path: Path, embed: tuple[int, int], kernel: tuple[int, int]) -> int:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_setup(path: Path, processes: int, devices: int, rounds: int, timeout: float) -> list[dict]:
    """Start ``processes`` workers of one job; return each one's measurements."""
    port, out = _free_port(), Path(tempfile.mkdtemp(prefix="sharetree-load-"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "benchmarks.load", "--worker", str(path), str(out)]
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


def worker(args: argparse.Namespace) -> None:
    """One process: initialize, warm up, then st.load and load_file in turns."""
    import gc
    import warnings

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors.numpy import load_file, save_file

    from benchmarks.memory import PeakAnon, fixed_mmap_threshold

    fixed_mmap_threshold()
    if args.processes > 1:
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
    path = args.worker
    warm = os.path.join(args.out, f"warm_{args.process_id}.safetensors")
    save_file({"embed": np.ones((64, 2), np.float32), "kernel": np.ones((2, 64), np.float32)}, warm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st.load(warm, shardings={"embed": shardings["embed"], "kernel": shardings["kernel"]})
    del load_file(path)["embed"]  # the file in the page cache (file-backed, not anonymous)
    gc.collect()
    methods = {
        "st.load(shardings=)": lambda: st.load(path, shardings=shardings),
        "safetensors load_file": lambda: load_file(path),
    }
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    growth: dict[str, int] = {}
    for r in range(args.rounds):
        for name, load in methods.items():
            gc.collect()
            with PeakAnon() as memory:
                start = time.perf_counter()
                tree = load()
                jax.block_until_ready(tree)
                seconds[name].append(time.perf_counter() - start)
            growth.setdefault(name, memory.growth)  # the first round: a fresh process
            if r == 0 and name.startswith("st.load"):
                embed = tree["embed"]
                local = sum(
                    s.data.nbytes for x in (embed, tree["kernel"]) for s in x.addressable_shards
                )
                facts = {
                    "embed_fully_addressable": embed.is_fully_addressable,
                    "local_shard_bytes": local,
                    "head": repr(tree["head"]),
                }
            del tree
    with open(os.path.join(args.out, f"{args.process_id}.json"), "w") as f:
        json.dump({"growth": growth, "seconds": seconds, **facts}, f)
    if args.processes > 1:
        jax.distributed.shutdown()


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
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per setup")
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
        size = _write(path, embed, kernel)
        rows = []
        for processes, devices in SETUPS:
            workers = run_setup(path, processes, devices, rounds, args.timeout)
            med = {
                k: statistics.median(t for w in workers for t in w["seconds"][k])
                for k in workers[0]["seconds"]
            }
            growth = max(w["growth"]["st.load(shardings=)"] for w in workers)
            rows.append(
                {
                    "setup": f"{processes} x {devices} devices",
                    "processes": processes,
                    "devices_per_process": devices,
                    "growth_over_file": growth / size,
                    "local_shards_over_file": max(w["local_shard_bytes"] for w in workers) / size,
                    "load_file_growth_over_file": max(
                        w["growth"]["safetensors load_file"] for w in workers
                    )
                    / size,
                    "seconds": med,
                    "time_over_load_file": med["st.load(shardings=)"]
                    / med["safetensors load_file"],
                    "embed_fully_addressable": workers[0]["embed_fully_addressable"],
                    "head": workers[0]["head"],
                    "workers": workers,
                }
            )
    print(
        f"file: {size / 2**20:.0f} MiB (embed {embed}, kernel {kernel}, float32); {rounds} round(s)"
    )
    print(
        "| setup | peak RssAnon growth / file | local shards / file | load time / load_file time |"
    )
    print("|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['setup']} | {r['growth_over_file']:.2f}x | {r['local_shards_over_file']:.2f}x "
            f"| {r['time_over_load_file']:.2f}x ({r['seconds']['st.load(shardings=)']:.3f} s / "
            f"{r['seconds']['safetensors load_file']:.3f} s) |"
        )
    if args.quick and args.out is None:
        return 0
    import datetime

    machine["loadavg_end"] = list(os.getloadavg())
    out = args.out or RESULTS / f"{datetime.date.today().isoformat()}-load.json"
    result = {"machine": machine, "file_bytes": size, "embed": embed, "kernel": kernel}
    out.write_text(json.dumps({**result, "rounds": rounds, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
