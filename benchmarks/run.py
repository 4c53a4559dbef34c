"""Run the sharetree benchmark suite: ``python -m benchmarks`` or ``python benchmarks/run.py``.

Options::

    --sizes 200,2000   materialized leaves of the tied MLP (default: 200, 700 and 2,000)
    --large            add 10,000 leaves (minutes of XLA compile per method)
    --quick            tiny smoke mode (seconds; nothing is saved unless --out is given)
    --compile-repeats  compile timings per method (default: 3 up to 500 leaves, else 1)
    --skip-lm          leave out the transformer LM case
    --out PATH         where to write the JSON (default benchmarks/results/<date>.json,
                       or <date>-<HHMM>.json when that exists: no run is overwritten)
    --no-save          print only

Every measurement first asserts that the methods agree (values and
gradients), then times them: warm-up, interleaved repeats, median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import design, hotpath, suite, views
from benchmarks import lm as lm_mod
from benchmarks import models as M
from benchmarks.timing import compiler_options, fmt_seconds, loadavg, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SIZES = (200, 700, 2000)
LARGE = 10_000
QUICK_SIZES = (16,)
QUICK_EAGER = 64
QUICK_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
"""Smoke mode checks correctness only, so it compiles at -O0 (about twice as fast)."""


def _compile_repeats(n: int) -> int:
    return 3 if n <= 500 else 1


def _grad_compile_repeats(n: int) -> int | dict[str, int]:
    """Above 500 leaves each compile takes minutes: repeat only the rows the targets compare."""
    if n <= 500:
        return 3
    return {suite.FLOOR: 3, suite.ST_FLAT: 3, suite.RAVEL: 2}


def _run_rounds(n: int) -> int:
    return 15 if n <= 500 else (9 if n <= 2000 else 5)


def _eager_rounds(n: int) -> int:
    return 9 if n <= 500 else (5 if n <= 2000 else 3)


def run_suite(
    sizes: Sequence[int] = DEFAULT_SIZES,
    *,
    eager_tree_sizes: Sequence[int] | None = None,
    quick: bool = False,
    compile_repeats: int | None = None,
    lm: bool = True,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    """Run every measurement and return the results (JSON-able).

    Args:
        sizes: materialized leaf counts of the tied MLP for every measurement.
        eager_tree_sizes: leaf counts for the eager materialize/canonicalize
            measurement (default: ``sizes`` plus 10,000; in quick mode 64).
        quick: tiny smoke mode: few repeats, a tiny LM.
        compile_repeats: compile timings per method (default by size).
        lm: include the transformer LM case.
        log: progress goes here (``None`` for silence).

    Raises:
        AssertionError: when two methods disagree on a value or gradient.
    """
    with compiler_options(QUICK_COMPILER_OPTIONS if quick else None):
        return _run_suite(sizes, eager_tree_sizes, quick, compile_repeats, lm, log)


def _run_suite(
    sizes: Sequence[int],
    eager_tree_sizes: Sequence[int] | None,
    quick: bool,
    compile_repeats: int | None,
    lm: bool,
    log: Any,
) -> dict[str, Any]:
    t_start = time.perf_counter()

    def say(msg: str) -> None:
        if log is not None:
            print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", file=log, flush=True)

    if eager_tree_sizes is None:
        eager_tree_sizes = (QUICK_EAGER,) if quick else tuple(sorted(set(sizes) | {LARGE}))
    machine = machine_info()
    sections: list[suite.Section] = []

    def add(sec: suite.Section) -> None:
        sec.info["loadavg_after"] = loadavg()  # the machine may be shared: record contention
        sec.info["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        sections.append(sec)

    # Cheap sections first, then the flat-path sizes in increasing order (the
    # 2,000-leaf compiles dominate the wall time).
    if sizes:
        n = min(sizes)
        say(f"{n} leaves: design notes (distinct kernels, naive slicing)")
        add(
            design.design_section(
                M.make_model(n),
                compile_repeats or (1 if quick else _compile_repeats(n)),
                3 if quick else _run_rounds(n),
            )
        )
    say("hot path: destructure with a large static leaf, unflattening Tied")
    add(hotpath.hotpath_section(3 if quick else 51, 2**20 if quick else hotpath.BIG_STATIC_BYTES))
    dims = views.Dims.quick() if quick else views.Dims()
    say(f"views into part of a buffer vs whole-buffer views ({dims})")
    add(views.views_section(dims, compile_repeats or (1 if quick else 5), 3 if quick else 51))
    for n in eager_tree_sizes:
        if n in sizes:
            continue
        say(f"{n} leaves: eager materialize / canonicalize")
        add(suite.eager_tree(M.make_model(n), 3 if quick else _eager_rounds(n)))
    if lm:
        cfg = lm_mod.LMConfig.tiny() if quick else lm_mod.LMConfig()
        say(f"transformer LM {cfg}")
        add(suite.lm_section(cfg, compile_repeats or (1 if quick else 7), 5 if quick else 100))
    for n in sorted(sizes):
        rounds = 3 if quick else _run_rounds(n)
        erounds = 3 if quick else _eager_rounds(n)
        crep = compile_repeats or (1 if quick else _grad_compile_repeats(n))
        say(f"{n} leaves: building the tied MLP ({M.num_layers(n)} layers)")
        model = M.make_model(n)
        say(f"{n} leaves: eager flatten")
        add(suite.eager_flatten(model, erounds))
        say(f"{n} leaves: jit(grad) compile and run (compile repeats: {crep})")
        sec, grads = suite.grad_compile_run(model, crep, rounds)
        add(sec)
        say(f"{n} leaves: bytes")
        add(suite.bytes_section(model, grads))
        del grads
        say(f"{n} leaves: vmap")
        add(suite.vmap_section(model, rounds))
        if n in eager_tree_sizes:
            say(f"{n} leaves: eager materialize / canonicalize")
            add(suite.eager_tree(model, erounds))
        del model
    machine["loadavg_end"] = loadavg()
    say("done")
    sections.sort(key=lambda sec: (sec.leaves is None, sec.leaves or 0))  # stable: by size
    return {
        "machine": machine,
        "config": {
            "sizes": list(sizes),
            "eager_tree_sizes": list(eager_tree_sizes),
            "quick": quick,
            "compile_repeats": compile_repeats,
            "compiler_options": QUICK_COMPILER_OPTIONS if quick else {},
            "layer": f"{M.D}x{M.D} weight + {M.D} bias, every 4th weight Tied(previous, T)",
            "batch": M.BATCH,
        },
        "wall_s": time.perf_counter() - t_start,
        "sections": [
            {"leaves": s.leaves, "name": s.name, "info": s.info, "checks": s.checks}
            for s in sections
        ],
        "rows": [r for s in sections for r in s.rows],
        "targets": [t for s in sections for t in s.targets],
        "checks_passed": sum(len(s.checks) for s in sections),
    }


# --------------------------------------------------------------------------- report


def _ratio(r: float) -> str:
    if math.isnan(r):
        return "-"
    return f"{r:.2f}x" if r < 100 else f"{r:.0f}x"


def _value(t: dict[str, Any]) -> str:
    v = t["value"]
    return f"{v:.1f}x" if t["op"] == ">=" else f"{v:.2f}"


def format_report(results: dict[str, Any]) -> str:
    """The markdown tables: times and ratios, targets, bytes, machine."""
    m = results["machine"]
    lines = [
        f"sharetree benchmarks, {m['date']}: {m['cpu']}, {m['usable_cores']} usable core(s), "
        f"{m['device']}, jax {m['versions']['jax']} / jaxlib {m['versions']['jaxlib']}, "
        f"python {m['python']}; load average {m['loadavg_start']} at start, "
        f"{m.get('loadavg_end')} at end",
        "",
        "| leaves | measure | method | time | ratio | vs |",
        "|---:|---|---|---:|---:|---|",
    ]
    for r in results["rows"]:
        leaves = r.get("label") or ("LM" if r["leaves"] is None else f"{r['leaves']:,}")
        lines.append(
            f"| {leaves} | {r['measure']} | {r['method']} | {fmt_seconds(r['seconds'])} | "
            f"{_ratio(r['ratio'])} | {r['baseline']} |"
        )
    lines += ["", "| leaves | target | measured | goal | met |", "|---:|---|---:|---|---|"]
    for t in results["targets"]:
        leaves = t.get("label") or ("LM" if t["leaves"] is None else f"{t['leaves']:,}")
        goal = f"{t['op']} {t['limit']:g}" + (" (aim)" if t["kind"] == "aim" else "")
        met = "yes" if t["met"] else "NO"
        if t["kind"] == "info":
            goal, met = f"({goal} at the target size)", "info"
        lines.append(f"| {leaves} | {t['target']} | {_value(t)} | {goal} | {met} |")
    lines += ["", "| leaves | bytes | unique | expanded (untied) |", "|---:|---|---:|---:|"]
    for s in results["sections"]:
        if s["name"] != "bytes":
            continue
        info = s["info"]
        for key in ("gradient (canonical tree)", "gradient (flat vector)", "Adam mu", "Adam nu"):
            lines.append(
                f"| {s['leaves']:,} | {key} | {info['nbytes ' + key]:,} | "
                f"{info['nbytes_expanded']:,} |"
            )
    lines += [
        "",
        f"{results['checks_passed']} correctness checks passed; wall time "
        f"{results['wall_s']:.0f} s.",
    ]
    return "\n".join(lines)


def save(results: dict[str, Any], path: Path) -> Path:
    """Write the results as JSON (creating the folder; a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def default_path(folder: Path, now: datetime.datetime) -> Path:
    """``<date>.json`` in ``folder``; a later run the same day gets its time (never overwrites)."""
    day = now.date().isoformat()
    candidates = [f"{day}.json", f"{day}-{now:%H%M}.json"]
    candidates += [f"{day}-{now:%H%M}-{k}.json" for k in range(2, 100)]
    for name in candidates:
        if not (folder / name).exists():
            return folder / name
    raise FileExistsError(f"{folder}: 100 result files for {day} {now:%H:%M}; pass --out")


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s.replace("_", "")) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes: expected comma-separated integers, got {text!r}"
        ) from None
    for n in sizes:
        if n < 8 or n % 2:
            raise argparse.ArgumentTypeError(f"--sizes: each size must be even and >= 8, got {n}")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=_parse_sizes, default=None, help="e.g. 200,2000")
    ap.add_argument("--large", action="store_true", help=f"add {LARGE:,} leaves")
    ap.add_argument("--quick", action="store_true", help="tiny smoke mode")
    ap.add_argument("--compile-repeats", type=int, default=None)
    ap.add_argument("--skip-lm", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    a = ap.parse_args(argv)
    if a.sizes is not None:
        sizes = a.sizes
    elif a.quick:
        sizes = list(QUICK_SIZES)
    else:
        sizes = list(DEFAULT_SIZES)
    if a.large and LARGE not in sizes:
        sizes.append(LARGE)
    results = run_suite(sizes, quick=a.quick, compile_repeats=a.compile_repeats, lm=not a.skip_lm)
    results["note"] = a.note
    print(format_report(results))
    out = a.out
    if out is None and not a.quick and not a.no_save:
        out = default_path(RESULTS, datetime.datetime.now())
    if out is not None and not a.no_save:
        print(f"\nresults written to {save(results, out)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    raise SystemExit(main())
