"""Quantized ties (issue 34): what one packed table costs the lookup, the head and the file.

A tied table of ``vocab x width`` floats is held two ways: as a float buffer with the
head ``Tied("embed", st.T)``, and packed in MLX's 4-bit affine layout (``st.quantize``)
with the lookup ``Tied(refs, st.dequantize(4, 64))`` and the head
``Tied(refs, st.dequantize(4, 64) >> st.T)``. Memory is read from XLA's compiled
memory analysis of each ``jit`` program (``temp_size_in_bytes``: the buffers the
program allocates besides its arguments and outputs), so the figures are the
compiler's, not a sampled process:

* **lookup** of ``tokens`` ids, ``st.materialize(tree)["lookup"][ids]``: from the packed
  table no float copy of the whole table is made (XLA fuses the unpacking into the
  gather); side by side with the float table's lookup and with a lookup written by hand
  on the packed arrays (``q[ids]``, ``scales[ids]``, ``biases[ids]``, unpacked in
  ``jnp``);
* **head**, ``x @ head`` for ``tokens`` rows ``x``: the packed head makes the float
  table once (``vocab x width`` floats of temporary), where the float model reads its
  argument;
* **lookup and head** in one program (a one-layer tied LM's logits): the float table is
  made once and read by both;
* **checkpoint bytes**: ``st.save`` of the packed tree against the float tree (each
  stores the table once; the views are specs).

``python -m benchmarks.quantized`` writes ``benchmarks/results/<date>-quantized.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sharetree as st
from benchmarks.run import RESULTS, format_report, save
from benchmarks.suite import Section
from benchmarks.timing import loadavg, machine_info

FLOAT, PACKED, HAND = (
    "float table (head Tied('embed', st.T))",
    "sharetree: packed 4-bit table (st.dequantize views)",
    "by hand: packed arrays, rows gathered then unpacked in jnp",
)
BITS, GROUP = 4, 64


@dataclasses.dataclass(frozen=True)
class Dims:
    """The table and the batch."""

    vocab: int = 32768
    width: int = 1024
    tokens: int = 2048

    @classmethod
    def quick(cls) -> Dims:
        return cls(vocab=1024, width=256, tokens=64)


def _trees(dims: Dims) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    table = rng.normal(size=(dims.vocab, dims.width)).astype(np.float32)
    refs = {n: f"packed/{n}" for n in ("q", "scales", "biases")}
    packed = {
        "packed": st.quantize(table, BITS, GROUP),
        "lookup": st.Tied(refs, st.dequantize(BITS, GROUP)),
        "head": st.Tied(refs, st.dequantize(BITS, GROUP) >> st.T),
    }
    plain = {"lookup": jnp.asarray(table), "head": st.Tied("lookup", st.T)}
    return {FLOAT: plain, PACKED: packed}


def _unpack_rows(q: jax.Array, scales: jax.Array, biases: jax.Array) -> jax.Array:
    """4-bit words to floats, written out: 8 values a word, lowest bits first."""
    shifts = 4 * jnp.arange(8, dtype=jnp.uint32)
    values = (q[..., None] >> shifts) & 15
    grouped = values.reshape(*q.shape[:-1], -1, GROUP).astype(scales.dtype)
    return (grouped * scales[..., None] + biases[..., None]).reshape(*q.shape[:-1], -1)


def _memory(fn: Callable[..., Any], *args: Any) -> dict[str, int]:
    compiled = jax.jit(fn).lower(*args).compile()
    m = compiled.memory_analysis()
    return {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
    }


def _lookup(tree: Any, ids: jax.Array) -> jax.Array:
    return st.materialize(tree)["lookup"][ids]


def _head(tree: Any, x: jax.Array) -> jax.Array:
    return x @ st.materialize(tree)["head"]


def _logits(tree: Any, ids: jax.Array) -> jax.Array:
    m = st.materialize(tree)
    return jnp.tanh(m["lookup"][ids]) @ m["head"]


def _hand_lookup(packed: dict[str, jax.Array], ids: jax.Array) -> jax.Array:
    return _unpack_rows(packed["q"][ids], packed["scales"][ids], packed["biases"][ids])


def quantized_section(dims: Dims) -> Section:
    """Every figure, after checking that the methods agree (``AssertionError`` if not)."""
    sec = Section(None, "quantized ties")
    sec.info["dims"] = dataclasses.asdict(dims)
    sec.info["bits"], sec.info["group_size"] = BITS, GROUP
    trees = _trees(dims)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, dims.vocab, dims.tokens))
    x = jnp.asarray(rng.normal(size=(dims.tokens, dims.width)), jnp.float32)
    float_table_bytes = dims.vocab * dims.width * 4
    sec.info["float table bytes"] = float_table_bytes

    packed_arrays = trees[PACKED]["packed"]
    hand = jax.jit(_hand_lookup)(packed_arrays, ids)
    ours = jax.jit(_lookup)(trees[PACKED], ids)
    sec.check("the packed lookup equals the one by hand", bool(jnp.array_equal(ours, hand)))
    err = float(jnp.max(jnp.abs(ours - trees[FLOAT]["lookup"][ids])))
    scale = float(jnp.max(jnp.abs(packed_arrays["scales"])))
    sec.check("the packed lookup is within a step of the floats", err <= scale, f"{err:.3g}")
    head = jax.jit(_head)(trees[PACKED], x)
    by_hand = x @ _unpack_rows(**packed_arrays).T
    close = bool(jnp.allclose(head, by_hand, rtol=1e-4, atol=1e-3))
    sec.check("the packed head equals the one by hand", close)

    memory: dict[str, dict[str, dict[str, int]]] = {}
    memory["lookup"] = {
        FLOAT: _memory(_lookup, trees[FLOAT], ids),
        PACKED: _memory(_lookup, trees[PACKED], ids),
        HAND: _memory(_hand_lookup, packed_arrays, ids),
    }
    memory["head"] = {m: _memory(_head, trees[m], x) for m in (FLOAT, PACKED)}
    memory["lookup and head"] = {m: _memory(_logits, trees[m], ids) for m in (FLOAT, PACKED)}
    sec.info["compiled memory"] = memory
    lookup_temp = memory["lookup"][PACKED]["temp_bytes"]
    sec.target("packed lookup temp / float table", lookup_temp / float_table_bytes, "<=", 0.01)
    row_bytes = dims.tokens * dims.width * 4
    sec.target("packed lookup temp / its rows as floats", lookup_temp / row_bytes, "<=", 1.0)

    with tempfile.TemporaryDirectory() as d:
        sizes = {}
        for method in (FLOAT, PACKED):
            path = os.path.join(d, "m.safetensors")
            st.save(path, trees[method])
            sizes[method] = os.path.getsize(path)
    sec.info["checkpoint bytes"] = sizes
    sec.target("packed checkpoint / float", sizes[PACKED] / sizes[FLOAT], "<=", 0.2)
    return sec


def memory_table(info: dict[str, Any]) -> str:
    """The compiled memory and checkpoint bytes, as a markdown table."""
    whole = info["float table bytes"]
    lines = ["", "| program | method | temp bytes | of the float table |", "|---|---|---:|---:|"]
    for measure, by_method in info["compiled memory"].items():
        for method, m in by_method.items():
            t = m["temp_bytes"]
            lines.append(f"| {measure} | {method} | {t:,} | {t / whole:.3f} |")
    lines += ["", "| checkpoint | bytes |", "|---|---:|"]
    lines += [f"| {method} | {n:,} |" for method, n in info["checkpoint bytes"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.quantized [--quick] [--out FILE] [--note TEXT]``."""
    doc = (__doc__ or "").split("\n")[0]
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quantized", description=doc)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run, saves nothing")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    machine, t0 = machine_info(), time.perf_counter()
    dims = Dims.quick() if a.quick else Dims()
    sec = quantized_section(dims)
    machine["loadavg_end"] = loadavg()
    results = {
        "machine": machine,
        "config": {"dims": sec.info["dims"], "quick": a.quick},
        "wall_s": time.perf_counter() - t0,
        "sections": [{"leaves": None, "name": sec.name, "info": sec.info, "checks": sec.checks}],
        "rows": sec.rows,
        "targets": sec.targets,
        "checks_passed": len(sec.checks),
        "note": a.note,
    }
    print(format_report(results))
    print(memory_table(sec.info))
    out = a.out
    if out is None and not a.quick:
        out = RESULTS / f"{datetime.date.today().isoformat()}-quantized.json"
    if out is not None:
        print(f"\nresults written to {save(results, out)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
