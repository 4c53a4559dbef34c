"""Views into part of a buffer on the flat path, against the same model with whole-buffer views.

Issue 21 asks that ``restructure`` with ``st.slice`` / ``st.index`` views stay
as fast as with whole-buffer views. Two models of the same layout are held as
a canonical tree, a plain tree of the unique buffers with the views written by
hand in the loss (the floor), and ``ravel_pytree`` of that plain tree:

* **partial views**: a padded vocabulary (``embed`` of ``V + 64`` rows, the head
  ``Tied("embed", st.slice(0, V) >> st.T)``), a scanned stack (``stack`` of
  ``L`` layers, layer ``i`` is ``Tied("stack", st.index(i))``) and a fused QKV
  (``qkv`` of ``3 D`` columns, q/k/v are ``st.slice(k D, (k + 1) D, axis=1)``);
* **whole-buffer views**: the same function shape with ``embed`` of ``V`` rows
  (head ``Tied("embed", st.T)``), ``L`` layer buffers of which every odd one is
  the previous one transposed, and ``k`` the transpose of ``q``.

For each, reverse mode (``jit(grad)``: compile and run), forward mode
(``jvp``), a Hessian-vector product and ``vmap`` of the loss over 16 vectors
are timed for sharetree's ``restructure`` (closed over) against
``ravel_pytree``, side by side in interleaved rounds. The targets: with partial
views, sharetree costs what ``ravel_pytree`` with the views by hand costs (at most
1.1x), as with whole-buffer views; the two models' ratios are recorded side by side
(a ratio of ratios, for information: the whole-buffer model has 15 buffers, so
``restructure`` cuts it at opaque offsets, and the partial one 3).
``python -m benchmarks.views`` runs this section alone and writes
``benchmarks/results/<date>-views.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
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
from benchmarks.suite import Section, _close, _flat_of
from benchmarks.timing import compile_times, interleaved, loadavg, machine_info

PAD = 64
"""Rows below the logical vocabulary (``resize_token_embeddings(pad_to_multiple_of=64)``)."""
VMAP = 16
BUFFERS = ("stack", "qkv")
"""Buffers of the partial model that the loss reads only through views."""
"""Flat vectors per ``vmap`` call."""
ST, RAVEL, FLOOR = (
    "sharetree: loss . restructure (closed over)",
    "ravel_pytree: loss . unravel (views by hand)",
    "floor: jit(grad(loss)) on the tree (views by hand)",
)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Vocabulary ``v``, width ``d``, layers ``layers``, batch ``batch``."""

    v: int = 2048
    d: int = 128
    layers: int = 24
    batch: int = 16

    @classmethod
    def quick(cls) -> Dims:
        """A tiny model for the smoke run."""
        return cls(v=32, d=8, layers=4, batch=4)


@dataclasses.dataclass
class ViewsModel:
    """One model: the canonical tree, the unique buffers, and the views written by hand."""

    name: str
    canonical: dict[str, Any]
    unique: dict[str, Any]
    by_hand: Callable[[dict[str, Any]], dict[str, Any]]  # unique buffers -> what the loss reads
    tokens: jax.Array


def loss(m: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Cross-entropy of a small residual net that reads embed, head, layers and q/k/v."""
    h = m["embed"][tokens]
    for i in sorted(m["layers"]):
        h = h + jnp.tanh(h @ m["layers"][i])
    q, k, v = h @ m["q"], h @ m["k"], h @ m["v"]
    h = jnp.tanh(q * k) + v
    logits = h @ m["head"]
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)


def _key(i: int) -> str:
    return f"{i:03d}"  # sorted keys flatten in layer order


def partial_model(dims: Dims) -> ViewsModel:
    """Padded vocabulary, scanned stack and fused QKV, read through slices and indices."""
    v, d, n = dims.v, dims.d, dims.layers
    rng = np.random.default_rng(0)
    unique = {
        "embed": jnp.asarray(rng.normal(size=(v + PAD, d)) / np.sqrt(d), jnp.float32),
        "stack": jnp.asarray(rng.normal(size=(n, d, d)) / (4 * np.sqrt(d)), jnp.float32),
        "qkv": jnp.asarray(rng.normal(size=(d, 3 * d)) / np.sqrt(d), jnp.float32),
    }
    canonical = {
        **unique,
        "head": st.Tied("embed", st.slice(0, v) >> st.T),
        "layers": {_key(i): st.Tied("stack", st.index(i)) for i in range(n)},
        **{p: st.Tied("qkv", st.slice(k * d, (k + 1) * d, axis=1)) for k, p in enumerate("qkv")},
    }

    def by_hand(u: dict[str, Any]) -> dict[str, Any]:
        qkv = {p: u["qkv"][:, k * d : (k + 1) * d] for k, p in enumerate("qkv")}
        layers = {_key(i): u["stack"][i] for i in range(n)}
        return {"embed": u["embed"], "head": u["embed"][:v].T, "layers": layers, **qkv}

    tokens = jnp.asarray(rng.integers(0, v, dims.batch), jnp.int32)
    return ViewsModel("partial views (slice, index)", canonical, unique, by_hand, tokens)


def whole_model(dims: Dims) -> ViewsModel:
    """The same function shape, every view a whole buffer transposed."""
    v, d, n = dims.v, dims.d, dims.layers
    rng = np.random.default_rng(0)
    own = [i for i in range(n) if i % 2 == 0]
    unique = {
        "embed": jnp.asarray(rng.normal(size=(v, d)) / np.sqrt(d), jnp.float32),
        "layers": {
            _key(i): jnp.asarray(rng.normal(size=(d, d)) / (4 * np.sqrt(d)), jnp.float32)
            for i in own
        },
        **{p: jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32) for p in "qv"},
    }
    tied_layers = {_key(i): st.Tied(f"layers/{_key(i - 1)}", st.T) for i in range(n) if i % 2}
    canonical = {
        **unique,
        "layers": {**unique["layers"], **tied_layers},
        "head": st.Tied("embed", st.T),
        "k": st.Tied("q", st.T),
    }

    def by_hand(u: dict[str, Any]) -> dict[str, Any]:
        own = u["layers"]
        layers = {_key(i): own[_key(i - 1)].T if i % 2 else own[_key(i)] for i in range(n)}
        return {**u, "layers": layers, "head": u["embed"].T, "k": u["q"].T}

    tokens = jnp.asarray(rng.integers(0, v, dims.batch), jnp.int32)
    return ViewsModel("whole-buffer views (T)", canonical, unique, by_hand, tokens)


def _transformed(measure: str, f: Callable[[Any], Any]) -> Callable[..., Any]:
    """``f`` (flat vector -> loss) as the ``jvp``, Hessian-vector product or ``vmap`` of it."""
    if measure == "jvp":
        return lambda v, t: jax.jvp(f, (v,), (t,))
    if measure == "hvp":
        return lambda v, t: jax.jvp(jax.grad(f), (v,), (t,))[1]
    return jax.vmap(f)


def _measure(sec: Section, model: ViewsModel, compile_repeats: int, rounds: int) -> dict:
    """Rows for one model; returns ``{measure: sharetree / ravel_pytree}``."""
    flat, re = st.destructure(model.canonical)
    r_flat, unravel = ravel_pytree(model.unique)
    tokens = model.tokens
    same = np.array_equal(flat, r_flat)
    sec.check(f"{model.name}: destructure == ravel_pytree of the unique buffers", same)
    st_loss = lambda v: loss(re(v), tokens)  # noqa: E731
    ravel_loss = lambda v: loss(model.by_hand(unravel(v)), tokens)  # noqa: E731
    floor_loss = lambda u: loss(model.by_hand(u), tokens)  # noqa: E731
    make = {
        FLOOR: lambda: jax.grad(floor_loss),
        ST: lambda: jax.grad(st_loss),
        RAVEL: lambda: jax.grad(ravel_loss),
    }
    args = {FLOOR: (model.unique,), ST: (flat,), RAVEL: (r_flat,)}
    _, compile_s, grad, _ = compile_times(make, args, compile_repeats)
    want = _flat_of(jax.tree.leaves(grad[FLOOR](model.unique)))
    for name in (ST, RAVEL):
        ok, detail = _close(np.asarray(grad[name](args[name][0])), want)
        sec.check(f"{model.name}: {name}: gradient == floor's", ok, detail)
    tangent = jnp.asarray(np.random.default_rng(1).normal(size=flat.shape), flat.dtype)
    batch = flat[None, :] * (1.0 + 0.01 * jnp.arange(VMAP, dtype=flat.dtype))[:, None]
    extra = {"model": model.name}
    runs = interleaved({n: (lambda n=n: grad[n](*args[n])) for n in make}, rounds)
    sec.add_rows(f"{model.name}: jit(grad) compile", compile_s, RAVEL, **extra)
    sec.add_rows(f"{model.name}: jit(grad) run", runs, RAVEL, **extra)
    ratios = {"compile": compile_s[ST] / compile_s[RAVEL], "grad": runs[ST] / runs[RAVEL]}
    for measure, call in (("jvp", (flat, tangent)), ("hvp", (flat, tangent)), ("vmap", (batch,))):
        fns = {ST: st_loss, RAVEL: ravel_loss}
        make = {n: functools.partial(_transformed, measure, f) for n, f in fns.items()}
        _, _, compiled, _ = compile_times(make, dict.fromkeys(fns, call), 1)
        a, b = (np.asarray(jax.tree.leaves(compiled[n](*call))[-1]) for n in (ST, RAVEL))
        ok, detail = _close(a, b)
        sec.check(f"{model.name}: {measure}: sharetree == ravel_pytree", ok, detail)
        times = interleaved({n: functools.partial(f, *call) for n, f in compiled.items()}, rounds)
        sec.add_rows(f"{model.name}: {measure} run", times, RAVEL, **extra)
        ratios[measure] = times[ST] / times[RAVEL]
    return ratios


def views_section(dims: Dims, compile_repeats: int, rounds: int) -> Section:
    """Both models, then: partial-view ratio / whole-view ratio for every measure."""
    sec = Section(None, "views")
    partial, whole = partial_model(dims), whole_model(dims)
    sec.check(
        "the views by hand equal materialize (both models)",
        all(
            np.array_equal(a, b)
            for m in (partial, whole)
            for a, b in zip(
                jax.tree.leaves(m.by_hand(m.unique)),
                jax.tree.leaves(
                    {k: x for k, x in st.materialize(m.canonical).items() if k not in BUFFERS}
                ),
            )
        ),
    )
    got = {m.name: _measure(sec, m, compile_repeats, rounds) for m in (partial, whole)}
    sec.info["dims"] = dataclasses.asdict(dims)
    sec.info["ratios (sharetree / ravel_pytree)"] = got
    for measure in got[partial.name]:
        p, w = got[partial.name][measure], got[whole.name][measure]
        sec.target(f"views (partial): {measure}: sharetree / ravel_pytree", p, "<=", 1.1)
        name = f"views: sharetree/ravel_pytree {measure}: partial / whole-buffer views"
        sec.target(name, p / w, "<=", 1.1, applies=False)
    for row in sec.rows:
        row["label"] = "views"
    for t in sec.targets:
        t["label"] = "views"
    return sec


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.views [--quick] [--out FILE]``."""
    from benchmarks.run import RESULTS, format_report, save

    doc = __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m benchmarks.views", description=doc)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run, saves nothing")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    machine, t0 = machine_info(), time.perf_counter()
    dims = Dims.quick() if a.quick else Dims()
    sec = views_section(dims, 1 if a.quick else 5, 3 if a.quick else 51)
    machine["loadavg_end"] = loadavg()
    results = {
        "machine": machine,
        "config": {"views": dataclasses.asdict(dims), "quick": a.quick},
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
        out = RESULTS / f"{datetime.date.today().isoformat()}-views.json"
    if out is not None:
        print(f"\nresults written to {save(results, out)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
