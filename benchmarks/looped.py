"""Looped models: the per-pass split of ``grad_by_use`` and training a looped model.

Issue 44 asks two things of a model that loops over ``K`` shared blocks for ``L`` passes
(``Tied("blocks/w", st.take(order))``, pass ``l`` reads block ``l mod K``), scanned:

* **per-pass split**: ``st.grad_by_use`` costs one backward pass plus the pull-backs,
  one per pass; timed under ``jit`` side by side with ``jax.grad`` of the same loss
  (for information: the pull-backs write ``L`` buffer-sized contributions);
* **training speed**: a step of the looped model costs what the same model written by
  hand costs (the blocks indexed in the loss with ``jnp.take``), at most 1.05x, on the
  tree path (``jit(grad(loss . materialize))`` against ``jit(grad(loss_by_hand))``)
  and the flat path (``restructure`` closed over against ``ravel_pytree``'s unravel).

All methods run interleaved in one process (medians of ``rounds``); the gradients are
checked against each other first. ``python -m benchmarks.looped`` writes
``benchmarks/results/<date>-looped.json`` with the machine recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import sharetree as st
from benchmarks.timing import interleaved, loadavg, machine_info

TARGET = 1.05
LOOPED = "looped tree: jax.grad(loss . materialize)"
"""Timed once: the per-pass split's baseline and the tree path's looped side."""


@dataclasses.dataclass(frozen=True)
class Dims:
    """The looped model: ``passes`` layers of width ``width`` over ``blocks`` blocks."""

    width: int = 256
    blocks: int = 3
    passes: int = 12
    batch: int = 64

    @classmethod
    def quick(cls) -> Dims:
        return cls(width=16, blocks=2, passes=4, batch=4)


def _run(layers: dict[str, Any], x: jax.Array) -> jax.Array:
    def step(h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        return jnp.tanh(h @ p["w"] + p["b"]), None

    return jnp.mean(jax.lax.scan(step, x, layers)[0] ** 2)


def _model(d: Dims) -> tuple[dict[str, Any], dict[str, Any], jax.Array, np.ndarray]:
    """The looped tree, its blocks as a plain dict, the input and the order."""
    rng = np.random.default_rng(0)
    stack = {
        "w": rng.standard_normal((d.passes, d.width, d.width)).astype(np.float32) / d.width**0.5,
        "b": rng.standard_normal((d.passes, d.width)).astype(np.float32) * 0.1,
    }
    tree = st.share_blocks({"layers": stack}, "layers", d.blocks, init="average")
    blocks = {n: jnp.asarray(v) for n, v in tree["layers_blocks"].items()}
    tree = {"layers": tree["layers"], "layers_blocks": blocks}
    x = jnp.asarray(rng.standard_normal((d.batch, d.width)), jnp.float32)
    return tree, blocks, x, np.arange(d.passes) % d.blocks


def _close(a: Any, b: Any, rtol: float = 1e-4) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and float(np.max(np.abs(a - b))) <= rtol * float(np.max(np.abs(b)))


def measure(d: Dims, rounds: int) -> dict[str, Any]:
    """The timings, ratios, targets and checks of both comparisons."""
    tree, blocks, x, order = _model(d)
    loss_tree = lambda t, x: _run(st.materialize(t)["layers"], x)  # noqa: E731

    def by_hand(b: dict[str, Any], x: jax.Array) -> jax.Array:
        return _run({n: jnp.take(v, order, axis=0) for n, v in b.items()}, x)

    flat, re = st.destructure(tree)
    r_flat, unravel = ravel_pytree(blocks)
    fns: dict[str, Callable[..., Any]] = {
        LOOPED: jax.jit(jax.grad(loss_tree)),
        "st.grad_by_use (per pass)": jax.jit(st.grad_by_use(loss_tree)),
        "tree by hand: grad(loss, jnp.take)": jax.jit(jax.grad(by_hand)),
        "flat: grad(loss . restructure)": jax.jit(jax.grad(lambda v, x: _run(re(v)["layers"], x))),
        "flat by hand: grad(loss . unravel)": jax.jit(
            jax.grad(lambda v, x: by_hand(unravel(v), x))
        ),
    }
    args = {
        LOOPED: (tree, x),
        "st.grad_by_use (per pass)": (tree, x),
        "tree by hand: grad(loss, jnp.take)": (blocks, x),
        "flat: grad(loss . restructure)": (flat, x),
        "flat by hand: grad(loss . unravel)": (r_flat, x),
    }
    compile_s = {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args[name]))
        compile_s[name] = time.perf_counter() - t0
    out = {name: f(*args[name]) for name, f in fns.items()}
    g = out[LOOPED]["layers_blocks"]
    checks = {
        "per-pass uses sum to jax.grad": all(
            _close(sum(out["st.grad_by_use (per pass)"][f"layers_blocks/{n}"].values()), g[n])
            for n in ("w", "b")
        ),
        "one use per pass": all(
            len(out["st.grad_by_use (per pass)"][f"layers_blocks/{n}"]) == d.passes + 1
            for n in ("w", "b")
        ),
        "tree equals by hand": all(
            _close(g[n], out["tree by hand: grad(loss, jnp.take)"][n]) for n in ("w", "b")
        ),
        "flat equals by hand": _close(
            out["flat: grad(loss . restructure)"], out["flat by hand: grad(loss . unravel)"]
        ),
    }
    run_s = interleaved({n: (lambda f=f, a=args[n]: f(*a)) for n, f in fns.items()}, rounds)
    ratios = {
        "per-pass split: grad_by_use / jax.grad": run_s["st.grad_by_use (per pass)"]
        / run_s[LOOPED],
        "tree: looped / by hand": run_s[LOOPED] / run_s["tree by hand: grad(loss, jnp.take)"],
        "flat: looped / by hand": run_s["flat: grad(loss . restructure)"]
        / run_s["flat by hand: grad(loss . unravel)"],
    }
    targets = [
        {"target": f"{k} <= {TARGET}", "ratio": ratios[k], "met": ratios[k] <= TARGET}
        for k in ("tree: looped / by hand", "flat: looped / by hand")
    ]
    rows = [{"method": n, "compile_s": compile_s[n], "run_s": run_s[n]} for n in fns]
    return {"rows": rows, "ratios": ratios, "targets": targets, "checks": checks}


def report(results: dict[str, Any]) -> str:
    """A plain-text table of the run."""
    m = results["machine"]
    lines = [
        f"looped models, {m['date']}: {m['cpu']}, {m['usable_cores']} usable core(s), "
        f"{m['device']}, jax {m['versions']['jax']}",
        f"{'method':<40} {'compile':>9} {'run':>11}",
    ]
    for r in results["rows"]:
        lines.append(f"{r['method']:<40} {r['compile_s']:>8.2f}s {r['run_s'] * 1e3:>9.3f}ms")
    lines += [f"{k}: {v:.3f}x" for k, v in results["ratios"].items()]
    lines += [
        f"target {t['target']}: {'met' if t['met'] else 'MISSED'}" for t in results["targets"]
    ]
    lines += [f"check {k}: {'ok' if v else 'FAILED'}" for k, v in results["checks"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.looped [--quick] [--out FILE] [--rounds N]``."""
    from benchmarks.run import RESULTS, save

    ap = argparse.ArgumentParser(prog="python -m benchmarks.looped", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run, saves nothing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    machine, t0 = machine_info(), time.perf_counter()
    dims = Dims.quick() if a.quick else Dims()
    rounds = a.rounds or (3 if a.quick else 201)
    results: dict[str, Any] = {"machine": machine, "config": dataclasses.asdict(dims)}
    results["config"].update(rounds=rounds, quick=a.quick)
    results.update(measure(dims, rounds))
    machine["loadavg_end"] = loadavg()
    results["wall_s"] = time.perf_counter() - t0
    results["note"] = a.note
    print(report(results))
    out = a.out
    if out is None and not a.quick:
        now = datetime.datetime.now()
        out = RESULTS / f"{now.date().isoformat()}-looped.json"
        if out.exists():  # a later run the same day never overwrites
            out = out.with_name(f"{now.date().isoformat()}-{now:%H%M%S}-looped.json")
    if out is not None:
        print(f"\nresults written to {save(results, Path(out))}")
    return 0 if all(results["checks"].values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
