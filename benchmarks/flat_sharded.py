"""The flat path at scale (issue 43): a tied LM sharded over 8 devices, flat vs tree.

A tied language model (``head = Tied("embed", st.T)``; ``embed`` by rows, ``w1`` by
columns, ``w2`` by rows, over all devices of the mesh; a replicated bias beside them) is
held two ways on the same mesh, side by side in one process:

* the tree: ``jit(grad(loss . materialize))`` of the sharded canonical tree, gradients
  placed as the parameters (what a training step needs);
* the flat path: ``st.destructure`` (shard-major) and ``jit(grad(loss . restructure))``.

Per device it reports, from XLA's compiled memory analysis (arguments, outputs,
temporaries), the memory of ``destructure`` (the vector it allocates and its
temporaries) and of each gradient step, against that device's share of the model and
the largest part one buffer adds to it (a replicated buffer, gathered where read); the
process's peak anonymous memory while eager ``destructure`` runs (all simulated devices
live in this one process); the collectives of both compiled steps; and the step times
(interleaved rounds, medians). ``python -m benchmarks.flat_sharded [--quick]`` runs on
8 simulated CPU devices (or the devices there are, with ``--devices 0``) and writes
``benchmarks/results/<date>-flat-sharded.json`` with the machine.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--devices" not in sys.argv:  # before jax starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import collections
import datetime
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import sharetree as st
from benchmarks.memory import PeakAnon
from benchmarks.run import RESULTS, save
from benchmarks.timing import interleaved, machine_info

_OP = re.compile(r"= \S+ (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)")


def collectives(hlo: str) -> dict[str, int]:
    """How many collectives of each kind a compiled program's HLO text has."""
    return dict(collections.Counter(m.group(1) for m in map(_OP.search, hlo.splitlines()) if m))


def model(vocab: int, dim: int, hidden: int, mesh: Mesh) -> dict:
    """The tied LM's canonical tree, each buffer sharded as the module docstring says."""
    axes = tuple(mesh.axis_names)
    rng = np.random.default_rng(0)
    specs = {"embed": P(axes, None), "w1": P(None, axes), "w2": P(axes, None), "b": P()}
    values = {
        "embed": rng.normal(size=(vocab, dim)).astype(np.float32) * 0.02,
        "w1": rng.normal(size=(dim, hidden)).astype(np.float32) / dim**0.5,
        "w2": rng.normal(size=(hidden, dim)).astype(np.float32) / hidden**0.5,
        "b": np.zeros((hidden,), np.float32),
    }
    tree: dict[str, Any] = {
        k: jax.device_put(values[k], NamedSharding(mesh, s)) for k, s in specs.items()
    }
    tree["head"] = st.Tied("embed", st.T)
    return tree


def loss(m: dict, tokens: jax.Array) -> jax.Array:
    x = m["embed"][tokens]
    x = x + jnp.tanh(x @ m["w1"] + m["b"]) @ m["w2"]
    logits = x @ m["head"]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[:, 0])


def per_device(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of one device's program: arguments, outputs, temporaries."""
    m = compiled.memory_analysis()
    out = {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
        "aliased": int(getattr(m, "alias_size_in_bytes", 0)),
    }
    out["peak"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


def run(vocab: int, dim: int, hidden: int, tokens: int, rounds: int) -> dict:
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    tree = model(vocab, dim, hidden, mesh)
    batch = jax.device_put(np.arange(tokens) * 7 % vocab)
    buffers = {k: v for k, v in tree.items() if isinstance(v, jax.Array)}
    model_bytes = sum(x.nbytes for x in buffers.values())
    n = len(devices)
    with PeakAnon() as peak:
        flat, re = st.destructure(tree)
        flat.block_until_ready()
    layout = re.sharded
    assert layout is not None
    itemsize = flat.dtype.itemsize
    share = model_bytes / n
    # one buffer's part: the largest shard a device gathers (a replicated buffer's, here b)
    gathered = [p * r for p, r in zip(layout.parts, layout.replicas) if r > 1]
    largest_part = max(gathered, default=0) * itemsize
    from sharetree import _flat_sharded  # the packing program, for its memory analysis

    packer = jax.jit(lambda *b: _flat_sharded.pack(b, layout, np.dtype(flat.dtype)))
    dest = per_device(packer.lower(*jax.tree.leaves(tree)).compile())  # flatten order
    dest["new"] = dest["outputs"] + dest["temporaries"]

    shardings = jax.tree.map(lambda x: x.sharding, tree)
    plain = jax.jit(jax.grad(lambda p, t: loss(st.materialize(p), t)), out_shardings=shardings)
    flat_step = jax.jit(jax.grad(lambda v, t: loss(re(v), t)))
    plain_c = plain.lower(tree, batch).compile()
    flat_c = flat_step.lower(flat, batch).compile()
    times = interleaved(
        {"tree": lambda: plain_c(tree, batch), "flat": lambda: flat_c(flat, batch)}, rounds
    )
    g_tree = re.canonical(flat_c(flat, batch))
    g_plain = plain_c(tree, batch)
    grad_error = max(float(jnp.max(jnp.abs(g_tree[k] - g_plain[k]))) for k in buffers)
    step = {"tree": per_device(plain_c), "flat": per_device(flat_c)}
    checks = {
        "vector spans every device": len(flat.sharding.device_set) == n,
        "each device holds one block": {s.data.shape[0] for s in flat.addressable_shards}
        == {layout.block},
        "destructure allocates <= share + one buffer's part": dest["new"] <= share + largest_part,
        # the flat gradient is assembled into its block: about one more copy of the share
        "flat step <= tree step + 2 shares": step["flat"]["peak"]
        <= step["tree"]["peak"] + 2 * share,
        "gradients equal the tree program's": grad_error <= 1e-6,
    }
    return {
        "sizes": {"vocab": vocab, "dim": dim, "hidden": hidden, "tokens": tokens},
        "devices": n,
        "model_bytes": model_bytes,
        "share_bytes_per_device": share,
        "largest_part_bytes": largest_part,
        "padding": layout.padding,
        "step_extra_bytes_per_device": step["flat"]["peak"] - step["tree"]["peak"],
        "step_extra_over_share": (step["flat"]["peak"] - step["tree"]["peak"]) / share,
        "destructure_per_device": dest,
        "destructure_process_growth_bytes": peak.growth,
        "step_per_device": step,
        "collectives": {
            "tree": collectives(plain_c.as_text()),
            "flat": collectives(flat_c.as_text()),
        },
        "step_seconds": times,
        "flat_over_tree": times["flat"] / times["tree"],
        "grad_error": grad_error,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="a small model (the tests')")
    p.add_argument("--devices", type=int, default=8, help="0: the devices jax has")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sizes = (512, 64, 256, 64, 5) if args.quick else (16384, 512, 2048, 512, 20)
    result = {"machine": machine_info(), "flat_sharded": run(*sizes)}
    day = datetime.date.today().isoformat()
    out = args.out or RESULTS / f"{day}-flat-sharded.json"
    save(result, out)
    print(out)
    failed = [k for k, ok in result["flat_sharded"]["checks"].items() if not ok]
    if failed:
        raise SystemExit(f"failed checks: {failed}")


if __name__ == "__main__":
    main()
