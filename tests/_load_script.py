"""Loads checkpoints in a fresh process and prints JSON facts (``tests/test_load_by_shard.py``).

``python tests/_load_script.py host folder``: no shardings, peak anonymous memory
per load; ``python tests/_load_script.py shards folder`` (8 simulated devices):
what each shard holds and which bytes were read.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings


def main(mode: str, folder: str) -> None:
    """Write the checkpoints, load them, print the facts as one JSON line."""
    if mode == "shards":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors.numpy import load_file, save_file

    import sharetree as st
    from benchmarks.memory import PeakAnon, fixed_mmap_threshold
    from sharetree._files import container

    warnings.simplefilter("ignore")  # the foreign-file warning
    fixed_mmap_threshold()
    rng = np.random.default_rng(0)
    EMB = rng.standard_normal((1024, 2048), np.float32)  # 8 MiB
    KER = rng.standard_normal((2048, 1024), np.float32)  # 8 MiB
    INT4 = rng.integers(-8, 8, (512, 1024)).astype(jnp.int4)  # raw bytes in the file
    BIAS = np.arange(10.0, dtype=np.float32)  # no mesh axis of 2 or 4 divides it
    TREE = {"embed": EMB, "kernel": KER, "q": INT4, "bias": BIAS, "head": st.Tied("embed", st.T)}
    SD = {"lm_head.weight": np.ascontiguousarray(EMB.T), "kernel": KER}  # only the head: a move
    TIES = {"lm_head.weight": st.Tied("embed", st.T)}

    reads: list[tuple[str, tuple[tuple[int, int], ...] | None, int]] = []
    readers = [0]
    real_read, real_init = container.Reader.read, container.Reader.__init__

    def counting_read(self, name, index=None, view=None):
        a = real_read(self, name, index, view)
        bounds = None if index is None else tuple((s.start, s.stop) for s in index)
        reads.append((name, bounds, a.nbytes))
        return a

    def counting_init(self, *a, **k):
        readers[0] += 1
        real_init(self, *a, **k)

    container.Reader.read, container.Reader.__init__ = counting_read, counting_init
    own, hf = os.path.join(folder, "own.safetensors"), os.path.join(folder, "hf.safetensors")
    st.save(own, TREE)
    save_file(SD, hf, metadata={"format": "pt"})
    out: dict = {"sizes": {"own": os.path.getsize(own), "hf": os.path.getsize(hf)}}

    if mode == "host":
        st.load(own), st.load(hf, ties=TIES)  # warm-up: imports, first calls
        for name, load in (("own", lambda: st.load(own)), ("hf", lambda: st.load(hf, ties=TIES))):
            gc.collect()
            reads.clear()
            readers[0] = 0
            with PeakAnon() as m:
                tree = load()
            want = st.materialize(
                TREE
                if name == "own"
                else {**SD, "lm_head.weight": TIES["lm_head.weight"], "embed": EMB}
            )
            got = st.materialize(tree)
            out[name] = {
                "growth": m.growth,
                "readers": readers[0],
                "bytes_read": {
                    k: sum(b for n, _, b in reads if n == k) for k in {n for n, _, _ in reads}
                },
                "equal": all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want),
                "head": repr(tree["head" if name == "own" else "lm_head.weight"]),
            }
            del tree, got
    else:
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        rows, cols = (
            NamedSharding(mesh, P(("data", "model"), None)),
            NamedSharding(mesh, P(None, "model")),
        )
        file = load_file(own)  # the reference: the file's tensors, read by safetensors
        cases = {
            "own": (
                own,
                {},
                {"embed": rows, "kernel": cols, "q": cols, "bias": None, "head": None},
            ),
            "hf": (hf, {"ties": TIES}, {"embed": rows, "kernel": cols, "lm_head.weight": None}),
        }
        for name, (path, kw, shardings) in cases.items():
            reads.clear()
            tree = st.load(path, shardings=shardings, **kw)
            ref = {"embed": EMB, "kernel": KER, "q": INT4}
            out[name] = {
                "shards_equal": {
                    k: all(
                        np.array_equal(np.asarray(s.data), ref[k][s.index])
                        for s in tree[k].addressable_shards
                    )
                    for k in shardings
                    if shardings[k] is not None
                },
                "specs": {
                    k: str(tree[k].sharding.spec) for k in shardings if shardings[k] is not None
                },
                "reads": reads[:],
                "head": repr(tree["head" if name == "own" else "lm_head.weight"]),
            }
        out["file_kernel_equal"] = bool(np.array_equal(file["kernel"], KER))
        both = os.path.join(folder, "both.safetensors")  # both copies: compared on the devices
        save_file({"emb": EMB, "head": np.ascontiguousarray(EMB.T)}, both)
        tied = {"ties": {"head": st.Tied("emb", st.T)}, "shardings": {"emb": rows, "head": None}}
        out["both_head"] = repr(st.load(both, **tied)["head"])
        off = np.ascontiguousarray(EMB.T)
        off[7, 1000] += 0.5
        save_file({"emb": EMB, "head": off}, both)
        try:
            st.load(both, **tied)
        except st.TieError as e:
            out["both_error"] = str(e)
        try:
            three = NamedSharding(mesh, P(None, "model", None))  # three entries, two dimensions
            st.load(own, shardings={**cases["own"][2], "embed": three})
        except st.TieError as e:
            out["rank_error"] = str(e)
        try:
            st.load(own, shardings={**cases["own"][2], "bias": NamedSharding(mesh, P("model"))})
        except st.TieError as e:
            out["fit_error"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
