"""Views of several buffers (issue 33): adapters on a tied LM and on a shared-block stack.

Two models, each held two ways, timed side by side in one process:

* **LoRA on a tied LM**: a small causal transformer whose embedding is tied to the
  output head (``head = Tied("embed", st.T)``) carries one adapter,
  ``st.add_lora(params, "embed", rank=8, ...)``: the lookup and the head both read
  ``base + s * a @ b``;
* **shared blocks for a scanned stack**: ``K`` blocks (an MLP each) reused by ``L``
  layers, ``Tied("blocks/w", st.take(order))``, each layer with its own adapter
  (``st.add_lora`` on the stack views), ``jax.lax.scan`` over the materialized stack.

Against each, the same model written by hand: a plain dict of the same unique arrays
(the bases, ``a``, ``b`` and the other weights) whose loss writes the views in ``jnp``
(``table = base + s * a @ b`` once, read by the lookup and, transposed, by the head;
``blocks[order] + s * a @ b`` for the stack). The training step is ``jit(grad)`` of the
loss with respect to every array (compile: fresh functions, several repeats, median;
run: many calls after a warm-up, median), methods interleaved:

* the tree path: ``st.materialize`` inside the loss, the adapted tree as the argument,
  against the hand model's dict;
* the flat path: ``st.destructure`` / ``restructure`` (closed over) against
  ``jax.flatten_util.ravel_pytree`` of the hand model's dict.

Before timing, every method's gradient is checked against the hand model's, and the
forward program of each sharetree method is checked to hold as many ``dot_general``s
as the hand model's (the adapted table computed once however many views read it;
counted in the lowered StableHLO, a function's count added at each of its calls).
The targets: sharetree within 1.1x of the hand model on both paths, compile and run.
``python -m benchmarks.several`` writes ``benchmarks/results/<date>-several.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import re
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
from benchmarks.run import QUICK_COMPILER_OPTIONS, RESULTS, format_report, save
from benchmarks.suite import Section
from benchmarks.timing import compile_times, compiler_options, interleaved, loadavg, machine_info

HAND, ST_TREE, RAVEL, ST_FLAT = (
    "by hand: jit(grad(loss)) on the unique arrays (views in jnp)",
    "sharetree: loss . materialize (adapted tree)",
    "ravel_pytree: loss . unravel (views in jnp)",
    "sharetree: loss . restructure (closed over)",
)
METHODS = (HAND, ST_TREE, RAVEL, ST_FLAT)
PATHS = {"tree": (ST_TREE, HAND), "flat": (ST_FLAT, RAVEL)}
"""Each path's sharetree method and the hand-written method it is judged against."""
LIMIT = 1.1
LM_NAME, STACK_NAME = "LoRA-on-tied LM", "shared-block stack"


@dataclasses.dataclass(frozen=True)
class LMDims:
    """The tied LM: vocabulary, width, heads, layers, MLP width, batch, adapter."""

    vocab: int = 4096
    d: int = 256
    heads: int = 4
    layers: int = 4
    ff: int = 1024
    seq: int = 64
    batch: int = 8
    rank: int = 8
    scale: float = 2.0

    @classmethod
    def quick(cls) -> LMDims:
        """A tiny LM for the smoke run."""
        return cls(vocab=32, d=16, heads=2, layers=1, ff=32, seq=8, batch=2, rank=2)


@dataclasses.dataclass(frozen=True)
class StackDims:
    """The shared-block stack: ``blocks`` blocks for ``layers`` scanned layers."""

    blocks: int = 2
    layers: int = 12
    d: int = 256
    ff: int = 1024
    batch: int = 256
    rank: int = 8
    scale: float = 0.5

    @classmethod
    def quick(cls) -> StackDims:
        """A tiny stack for the smoke run."""
        return cls(blocks=2, layers=4, d=8, ff=16, batch=4, rank=2)

    @property
    def order(self) -> tuple[int, ...]:
        """Layer ``i`` uses block ``i % blocks``."""
        return tuple(i % self.blocks for i in range(self.layers))


@dataclasses.dataclass
class Case:
    """One model: the adapted canonical tree, the hand model's arrays, and the two losses.

    ``loss(m, batch)`` is the model on materialized parameters ``m`` (the original
    structure: ``st.materialize(adapted)["params"]``); ``by_hand(unique)`` writes the
    views in ``jnp`` and returns what the model reads, so the hand model's loss is
    ``loss(by_hand(unique), batch)``.
    """

    name: str
    adapted: dict[str, Any]
    unique: dict[str, Any]
    by_hand: Callable[[dict[str, Any]], dict[str, Any]]
    loss: Callable[[dict[str, Any], Any], jax.Array]
    batch: Any


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


def _as_trained(adapted: dict[str, Any], rng: np.random.Generator, scale: float) -> None:
    """Give every ``b`` (zero after ``add_lora``) random values, so every gradient is nonzero."""
    for factors in adapted["lora"].values():
        for leaf in [factors] if "b" in factors else factors.values():
            leaf["b"] = _normal(rng, leaf["b"].shape, scale)


def _unique(adapted: Any) -> Any:
    """The adapted tree without its ``Tied`` nodes: the arrays a hand model holds."""
    if isinstance(adapted, dict):
        out = {k: _unique(v) for k, v in adapted.items() if not isinstance(v, st.Tied)}
        return {k: v for k, v in out.items() if not isinstance(v, dict) or v}
    return adapted


def _rms(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def lm_loss(m: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy of a causal transformer reading ``embed`` and ``head``."""
    x = m["embed"][tokens[:, :-1]]
    b, t, d = x.shape
    heads = m["heads"]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i in sorted(m["layers"]):
        p = m["layers"][i]
        h = _rms(x)
        q, k, v = ((h @ p[w]).reshape(b, t, heads, d // heads) for w in ("wq", "wk", "wv"))
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads)
        a = jax.nn.softmax(jnp.where(causal, s, -1e30), axis=-1)
        x = x + jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, d) @ p["wo"]
        x = x + jax.nn.gelu(_rms(x) @ p["w1"]) @ p["w2"]
    logits = _rms(x) @ m["head"]
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def lm_case(dims: LMDims) -> Case:
    """The tied LM with one adapter on its embedding, and the same model by hand."""
    rng = np.random.default_rng(0)
    d = dims.d
    layers = {
        f"{i:02d}": {
            **{w: _normal(rng, (d, d), d**-0.5) for w in ("wq", "wk", "wv", "wo")},
            "w1": _normal(rng, (d, dims.ff), d**-0.5),
            "w2": _normal(rng, (dims.ff, d), dims.ff**-0.5),
        }
        for i in range(dims.layers)
    }
    params = {
        "embed": _normal(rng, (dims.vocab, d), 1.0),
        "head": st.Tied("embed", st.T),
        "layers": layers,
    }
    adapted = st.add_lora(params, "embed", rank=dims.rank, key=jax.random.key(0), scale=dims.scale)
    _as_trained(adapted, rng, 0.1)
    heads, s = dims.heads, dims.scale

    def by_hand(u: dict[str, Any]) -> dict[str, Any]:
        f = u["lora"]["embed"]
        table = f["base"] + s * (f["a"] @ f["b"])  # once, read by the lookup and the head
        return {"embed": table, "head": table.T, "layers": u["params"]["layers"]}

    def loss(m: dict[str, Any], tokens: jax.Array) -> jax.Array:
        return lm_loss({**m, "heads": heads}, tokens)

    tokens = jnp.asarray(rng.integers(0, dims.vocab, (dims.batch, dims.seq + 1)), jnp.int32)
    return Case(LM_NAME, adapted, _unique(adapted), by_hand, loss, tokens)


def stack_loss(m: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Squared error of a residual MLP scanned over the layers of ``m["stack"]``."""
    x, y = batch

    def layer(h: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return h + jnp.tanh(_rms(h) @ w["w1"]) @ w["w2"], None

    h, _ = jax.lax.scan(layer, x, m["stack"])
    return jnp.mean((h - y) ** 2)


def stack_case(dims: StackDims) -> Case:
    """``K`` shared blocks for ``L`` scanned layers, an adapter per layer, and the same by hand."""
    rng = np.random.default_rng(1)
    k, d, ff, order = dims.blocks, dims.d, dims.ff, dims.order
    params = {
        "blocks": {
            "w1": _normal(rng, (k, d, ff), d**-0.5),
            "w2": _normal(rng, (k, ff, d), 0.5 * ff**-0.5),
        },
        "stack": {w: st.Tied(f"blocks/{w}", st.take(order)) for w in ("w1", "w2")},
    }
    adapted = st.add_lora(
        params, "stack/*", rank=dims.rank, key=jax.random.key(1), scale=dims.scale
    )
    _as_trained(adapted, rng, 0.1)
    s, index = dims.scale, np.asarray(order)

    def by_hand(u: dict[str, Any]) -> dict[str, Any]:
        blocks, lora = u["params"]["blocks"], u["lora"]["stack"]
        stack = {w: blocks[w][index] + s * (lora[w]["a"] @ lora[w]["b"]) for w in blocks}
        return {"blocks": blocks, "stack": stack}

    x = _normal(rng, (dims.batch, d), 1.0)
    y = _normal(rng, (dims.batch, d), 1.0)
    return Case(STACK_NAME, adapted, _unique(adapted), by_hand, stack_loss, (x, y))


_FUNC = re.compile(r"func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)")
_CALL = re.compile(r"\bcall\s+@([\w.$-]+)")


def dot_generals(stablehlo: str) -> int:
    """``dot_general``s a lowered StableHLO module runs: each function counted at each call.

    ``jax.jit(f).lower(...).as_text()`` may outline a nested ``jit`` as a private
    function called from several places; its products run once per call, so the count
    of the text alone could hide a product computed twice.
    """
    own: dict[str, int] = {}
    calls: dict[str, list[str]] = {}
    current = None
    for line in stablehlo.splitlines():
        m = _FUNC.search(line)
        if m:
            current = m.group(1)
            own[current], calls[current] = 0, []
            continue
        if current is not None:
            own[current] += line.count("stablehlo.dot_general")
            calls[current] += _CALL.findall(line)

    def total(name: str) -> int:
        return own[name] + sum(total(c) for c in calls[name])

    return total("main")


def _close(a: np.ndarray, b: np.ndarray, rtol: float = 1e-4) -> tuple[bool, str]:
    """``a`` equals ``b`` within ``rtol`` of ``b``'s largest magnitude."""
    if a.shape != b.shape:
        return False, f"shapes {a.shape} vs {b.shape}"
    scale = float(np.max(np.abs(b)))
    err = float(np.max(np.abs(a - b)))
    return err <= rtol * scale, f"max |diff| {err:.3g} (max |ref| {scale:.3g})"


def _by_path(tree: Any) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def _losses(case: Case) -> tuple[dict[str, Callable[..., jax.Array]], dict[str, Any]]:
    """Each method's loss (of its argument and the batch) and its argument."""
    flat, restructure = st.destructure(case.adapted)
    r_flat, unravel = ravel_pytree(case.unique)
    loss, by_hand = case.loss, case.by_hand
    fns = {
        HAND: lambda u, batch: loss(by_hand(u), batch),
        ST_TREE: lambda t, batch: loss(st.materialize(t)["params"], batch),
        RAVEL: lambda v, batch: loss(by_hand(unravel(v)), batch),
        ST_FLAT: lambda v, batch: loss(restructure(v)["params"], batch),
    }
    args = {HAND: case.unique, ST_TREE: case.adapted, RAVEL: r_flat, ST_FLAT: flat}
    return fns, args


def measure(sec: Section, case: Case, compile_repeats: int, rounds: int) -> dict[str, Any]:
    """Check every method against the hand model, count products, then time; the ratios."""
    fns, args = _losses(case)
    sec.check(
        f"{case.name}: destructure == ravel_pytree of the hand model's arrays",
        np.array_equal(args[ST_FLAT], args[RAVEL]),
    )
    want = case.loss(case.by_hand(case.unique), case.batch)
    m = st.materialize(case.adapted)["params"]
    ok, detail = _close(np.asarray(case.loss(m, case.batch)), np.asarray(want))
    sec.check(f"{case.name}: loss of the materialized tree == by hand", ok, detail)

    # the adapted table once per step: as many products in each forward program
    dots = {
        n: dot_generals(jax.jit(f).lower(args[n], case.batch).as_text()) for n, f in fns.items()
    }
    for name in (ST_TREE, RAVEL, ST_FLAT):
        sec.check(
            f"{case.name}: forward dot_generals: {name} == by hand",
            dots[name] == dots[HAND],
            f"{dots[name]} vs {dots[HAND]}",
        )
    make: dict[str, Callable[[], Callable[..., Any]]]
    make = {n: functools.partial(jax.grad, f) for n, f in fns.items()}
    call: dict[str, Sequence[Any]] = {n: (args[n], case.batch) for n in fns}
    cpu: dict[str, list[float]] = {}
    _, compile_s, compiled, samples = compile_times(make, call, compile_repeats, cpu)
    grad_dots = {
        n: dot_generals(jax.jit(jax.grad(f)).lower(*call[n]).as_text()) for n, f in fns.items()
    }
    for name in (ST_TREE, RAVEL, ST_FLAT):
        sec.check(
            f"{case.name}: jit(grad) dot_generals: {name} == by hand",
            grad_dots[name] == grad_dots[HAND],
            f"{grad_dots[name]} vs {grad_dots[HAND]}",
        )

    grads = {n: compiled[n](*call[n]) for n in fns}
    want_tree = _by_path(grads[HAND])
    got_tree = _by_path(grads[ST_TREE])
    sec.check(
        f"{case.name}: {ST_TREE}: gradient paths == the hand model's arrays",
        list(got_tree) == list(want_tree),
        f"{list(got_tree)} vs {list(want_tree)}",
    )
    want_flat = np.concatenate([np.ravel(want_tree[p]) for p in want_tree])
    for name in (ST_TREE, RAVEL, ST_FLAT):
        got = grads[name]
        got = np.concatenate([np.ravel(x) for x in got_tree.values()]) if name == ST_TREE else got
        ok, detail = _close(np.asarray(got), want_flat)
        sec.check(f"{case.name}: {name}: gradient == by hand", ok, detail)

    runs = interleaved({n: functools.partial(compiled[n], *call[n]) for n in fns}, rounds)
    median_cpu = {n: float(np.median(v)) for n, v in cpu.items()}
    ratios: dict[str, float] = {}
    for path, (mine, ref) in PATHS.items():
        extra = {"model": case.name, "path": path, "label": case.name}
        for what, times in (("compile", compile_s), ("run", runs)):
            pair = {ref: times[ref], mine: times[mine]}
            sec.add_rows(f"{path} path: jit(grad) {what}", pair, ref, **extra)
            ratios[f"{path} {what}"] = r = times[mine] / times[ref]
            name = f"{case.name}: {path} path, jit(grad) {what}: sharetree / by hand"
            sec.target(name, r, "<=", LIMIT)
        ratios[f"{path} compile (CPU s)"] = median_cpu[mine] / median_cpu[ref]
    for row in sec.targets:
        row.setdefault("label", case.name)
    sec.info[case.name] = {
        "forward dot_generals": dots,
        "jit(grad) dot_generals": grad_dots,
        "compile samples (wall s)": samples,
        "compile samples (CPU s)": cpu,
        "compile (s)": compile_s,
        "run (s)": runs,
        "ratios (sharetree / by hand)": ratios,
        "arrays": {p: list(np.shape(x)) for p, x in want_tree.items()},
        "loadavg_after": loadavg(),
    }
    return ratios


def several_section(
    lm_dims: LMDims, stack_dims: StackDims, compile_repeats: int, rounds: int
) -> Section:
    """Both models; ``AssertionError`` before any timing when a method disagrees."""
    sec = Section(None, "views of several buffers")
    sec.info["dims"] = {
        LM_NAME: dataclasses.asdict(lm_dims),
        STACK_NAME: dataclasses.asdict(stack_dims),
    }
    sec.info["compile_repeats"], sec.info["run_rounds"] = compile_repeats, rounds
    for case in (lm_case(lm_dims), stack_case(stack_dims)):
        measure(sec, case, compile_repeats, rounds)
    return sec


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.several [--quick] [--out FILE] [--note TEXT]``."""
    doc = (__doc__ or "").split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m benchmarks.several", description=doc)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run, saves nothing")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compile-repeats", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    machine, t0 = machine_info(), time.perf_counter()
    lm_dims, stack_dims = (
        (LMDims.quick(), StackDims.quick()) if a.quick else (LMDims(), StackDims())
    )
    repeats = a.compile_repeats or (1 if a.quick else 7)
    rounds = a.rounds or (3 if a.quick else 51)
    with compiler_options(QUICK_COMPILER_OPTIONS if a.quick else None):
        sec = several_section(lm_dims, stack_dims, repeats, rounds)
    machine["loadavg_end"] = loadavg()
    results = {
        "machine": machine,
        "config": {
            "dims": sec.info["dims"],
            "compile_repeats": repeats,
            "run_rounds": rounds,
            "quick": a.quick,
        },
        "wall_s": time.perf_counter() - t0,
        "sections": [{"leaves": None, "name": sec.name, "info": sec.info, "checks": sec.checks}],
        "rows": sec.rows,
        "targets": sec.targets,
        "checks_passed": len(sec.checks),
        "note": a.note,
    }
    print(format_report(results))
    out = a.out
    if out is None and not a.quick:
        out = RESULTS / f"{datetime.date.today().isoformat()}-several.json"
    if out is not None:
        print(f"\nresults written to {save(results, out)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
