"""One process of a multi-controller JAX job: a tied-embedding LM trained on a global mesh.

The recipe of docs/saving_and_scaling.md ("Many hosts"); ``tests/test_multihost.py``
runs it as written. Start one process per host (here: per simulated host, on
127.0.0.1)::

    python tests/_multihost_worker.py train OUTDIR --process-id 0 --num-processes 2 \
        --coordinator 127.0.0.1:PORT --local-devices 4

Modes:

* ``train``: build the sharded model, train ``STEPS`` steps with AdamW and
  clipping, save the train state with Orbax after ``SAVE_AT`` steps, write
  the results (``OUTDIR/train_<i>.json`` and ``.npz``, for process ``i``).
* ``resume``: a fresh job restores the Orbax checkpoint into abstract targets
  carrying the global shardings and trains the remaining steps; then it
  starts another save and process 1 is killed during it (``--kill-during-save``).
* ``save``: ``st.save`` by every process of one file (each process writing its
  share), read back sharded; then the faults: a bad buffer on one process,
  different metadata, a path not every process sees, a full disk, and last a
  process killed while writing (``save_<i>.json``).
* ``single``: the references, on one process with 8 devices: the same model,
  and the same model tied by hand (``W`` and ``W.T``, a block used twice).
  It also restores the latest Orbax checkpoint (after the interrupted save).

On a real cluster: drop ``--local-devices`` and the gloo line (GPUs use NCCL,
TPUs ICI), call ``jax.distributed.initialize()`` without arguments where the
cluster environment provides them, and put the checkpoint directory on a
filesystem or object store that every host sees.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import socket
import sys
import threading
import time
import warnings


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("mode", choices=["train", "resume", "single", "save"])
    p.add_argument("outdir")
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (127.0.0.1 here)")
    p.add_argument("--local-devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--init-timeout", type=int, default=30, help="seconds to reach the coordinator")
    p.add_argument("--kill-during-save", action="store_true")
    p.add_argument("--save-timeout", type=float, default=10.0, help="st.save timeout= (save)")
    p.add_argument(
        "--hold-timeout",
        type=float,
        default=60.0,
        help="seconds for the held save to reach its hold point (--kill-during-save)",
    )
    return p.parse_args(argv)


ARGS = parse_args(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None:  # before JAX starts: simulated CPU devices
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.local_devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sharetree as st  # noqa: E402
from benchmarks.memory import PeakAnon  # noqa: E402

VOCAB, DIM, HIDDEN, BATCH, SEQ = 64, 16, 32, 8, 9
STEPS, SAVE_AT = 6, 3
# st.save(..., gather=True) / st.load(..., shardings=) exist (sharetree >= the io release)
ST_SAVE_GATHERS = "gather" in inspect.signature(st.save).parameters


# docs: begin start
def wait_for_coordinator(address: str, timeout: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise naming it after ``timeout`` s.

    ``jax.distributed.initialize`` aborts the whole process (a C++ check
    failure, no Python exception) when the coordinator stays unreachable, so
    the processes other than 0 (which hosts the coordinator) probe it first.
    """
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"could not reach the JAX coordinator at {address} within {timeout:g} s "
                    f"({e}). Fix: start process 0 with --coordinator {address}, or pass the "
                    "address and port process 0 listens on."
                ) from None
            time.sleep(0.2)


def initialize(coordinator: str | None, num_processes: int, process_id: int, timeout: int) -> None:
    """``jax.distributed.initialize`` with gloo collectives and a bounded coordinator wait."""
    if num_processes == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only: gloo collectives
    if process_id != 0:
        wait_for_coordinator(coordinator, timeout)
    jax.distributed.initialize(
        coordinator, num_processes, process_id, initialization_timeout=timeout
    )


# docs: end start


# docs: begin model
RULES = {  # one PartitionSpec per buffer, by path (the head is a view: it needs none)
    "embed": P("model", None),  # (vocab, dim): the vocabulary split over "model"
    "blocks/*/w1": P(None, "model"),
    "blocks/*/w2": P("model", None),
    "*": P(),  # everything else replicated
}


def init(key: jax.Array) -> dict:
    """A tied LM: the head is the embedding transposed, block 2 is block 0 used again."""
    ke, *kb = jax.random.split(key, 5)

    def block(k1, k2):
        return {
            "w1": jax.random.normal(k1, (DIM, HIDDEN)) / DIM**0.5,
            "w2": jax.random.normal(k2, (HIDDEN, DIM)) / HIDDEN**0.5,
            "scale": jnp.ones(DIM),
        }

    return {
        "embed": jax.random.normal(ke, (VOCAB, DIM)),
        "blocks": [block(kb[0], kb[1]), block(kb[2], kb[3]), st.Tied("blocks/0")],
        "head": st.Tied("embed", st.T),
    }


def forward(m: dict, tokens: jax.Array) -> jax.Array:
    """Logits of a materialized (plain) tree: causal mean mixing and an MLP per block."""
    x = m["embed"][tokens]
    steps = jnp.arange(1, tokens.shape[1] + 1, dtype=x.dtype)[None, :, None]
    for b in m["blocks"]:
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * b["scale"]
        h = jnp.cumsum(h, axis=1) / steps  # each position sees itself and the past
        x = x + jax.nn.gelu(h @ b["w1"]) @ b["w2"]
    return x @ m["head"]


def loss_of_materialized(m: dict, batch: jax.Array) -> jax.Array:
    logits = forward(m, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def loss(params: dict, batch: jax.Array) -> jax.Array:
    return loss_of_materialized(st.materialize(params), batch)


def global_batch(step: int) -> np.ndarray:
    """The global batch of a step (each process below keeps only its rows)."""
    return np.random.default_rng(step).integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)


OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2, weight_decay=0.1))


def make_mesh() -> Mesh:
    """A (data, model) = (processes, 4) mesh; process i holds row i, so "model" is inside a host."""
    devices = np.array(jax.devices()).reshape(-1, 4)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


class Setup:
    """The mesh, the sharding trees and the jitted step (the same on every process)."""

    def __init__(self, loss_fn=loss, init_fn=init) -> None:
        self.mesh = make_mesh()
        abstract = jax.eval_shape(init_fn, jax.random.key(0))
        self.shardings = st.shardings_by_path(abstract, self.mesh, RULES)
        replicated = NamedSharding(self.mesh, P())
        self.opt_shardings = optax.tree_map_params(
            OPT,
            lambda _, s: s,
            jax.eval_shape(OPT.init, abstract),
            self.shardings,
            transform_non_params=lambda _: replicated,
        )
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.init = jax.jit(init_fn, out_shardings=self.shardings)
        self.opt_init = jax.jit(OPT.init, out_shardings=self.opt_shardings)

        def step(params, opt_state, batch):
            value, grads = jax.value_and_grad(loss_fn)(params, batch)  # grads keep the ties
            updates, opt_state = OPT.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, grads

        self.step = jax.jit(
            step,
            in_shardings=(self.shardings, self.opt_shardings, self.batch_sharding),
            out_shardings=(self.shardings, self.opt_shardings, replicated, self.shardings),
        )

    def batch(self, step: int) -> jax.Array:
        """This process's rows of the global batch, assembled into one global array."""
        rows = BATCH // jax.process_count()
        start = jax.process_index() * rows
        local = global_batch(step)[start : start + rows]
        return jax.make_array_from_process_local_data(self.batch_sharding, local)

    def abstract_state(self) -> dict:
        """Restore target: the fresh program's train state, abstract, with global shardings."""
        shapes = jax.eval_shape(lambda: {"params": init(jax.random.key(0))})
        shapes["opt_state"] = jax.eval_shape(OPT.init, shapes["params"])
        shardings = {"params": self.shardings, "opt_state": self.opt_shardings}
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )


# docs: end model


# docs: begin train
def gathered(tree: object) -> dict[str, np.ndarray]:
    """Every leaf of a global tree as a full NumPy array on this process, keyed by path."""
    full = multihost_utils.process_allgather(tree, tiled=True)
    flat = jax.tree_util.tree_flatten_with_path(full)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="/"): np.asarray(x) for k, x in flat}


def train(args: argparse.Namespace) -> None:
    setup = Setup()
    params = setup.init(jax.random.key(0))
    opt_state = setup.opt_init(params)
    out = describe(setup, params, opt_state)
    record: dict[str, np.ndarray] = {}
    losses = []
    ckpt = ocp.CheckpointManager(os.path.join(args.outdir, "ckpt"))
    for i in range(STEPS):
        if i == SAVE_AT:  # every process saves; Orbax writes each shard once
            ckpt.save(i, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            ckpt.wait_until_finished()
            record.update({f"saved/{k}": v for k, v in gathered(params).items()})
        params, opt_state, value, grads = setup.step(params, opt_state, setup.batch(i))
        losses.append(float(value))
        record.update({f"grads/{i}/{k}": v for k, v in gathered(grads).items()})
    ckpt.close()
    out["losses"] = losses
    out["final_ties"] = ties_of(params)
    out["final_treedef"] = str(jax.tree.structure(params))
    record.update({f"params/{k}": v for k, v in gathered(params).items()})
    if ST_SAVE_GATHERS:  # a .safetensors export: every process gathers, process 0 writes
        st.save(os.path.join(args.outdir, "model.safetensors"), params, gather=True)
    write(args, out, record)


# docs: end train


def load_by_shard(outdir: str) -> dict:
    """``st.load`` with global shardings of the checkpoints ``tests/test_multihost.py`` wrote.

    Each process measures the peak growth of its anonymous memory during the
    load and checks every addressable shard against the file's tensors.
    """
    from safetensors.numpy import load_file, save_file

    mesh = make_mesh()
    rows = NamedSharding(mesh, P(("data", "model"), None))  # over all 8 devices
    cols = NamedSharding(mesh, P(None, ("data", "model")))
    me = jax.process_index()
    warm = os.path.join(outdir, f"warm_{me}.safetensors")  # first calls, not measured
    save_file({"embed": np.ones((8, 2), np.float32), "kernel": np.ones((2, 8), np.float32)}, warm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not written by sharetree
        st.load(warm, shardings={"embed": rows, "kernel": cols})
    cases = {
        "own": ("load_own.safetensors", {}, {"embed": rows, "kernel": cols, "head": None}),
        "hf": ("load_hf", {"ties": {"lm_head.weight": "model.embed_tokens.weight"}},
               {"model.embed_tokens.weight": rows, "kernel": cols, "lm_head.weight": None}),
    }  # fmt: skip
    shards = lambda x: x.addressable_shards  # noqa: E731
    out = {}
    for name, (file, kw, shardings) in cases.items():
        path = os.path.join(outdir, file)
        with PeakAnon() as memory:
            loaded = st.load(path, shardings=shardings, **kw)
        ref = load_file(path if name == "own" else os.path.join(path, "model.safetensors"))
        embed = "embed" if name == "own" else "model.embed_tokens.weight"
        out[name] = {
            "growth": memory.growth,
            "file_bytes": os.path.getsize(path if name == "own" else f"{path}/model.safetensors"),
            "ties": ties_of(loaded),
            "shards_equal": {
                k: all(np.array_equal(np.asarray(s.data), ref[k][s.index]) for s in shards(x))
                for k, x in loaded.items()
                if isinstance(x, jax.Array)
            },
            "embed_shape": list(loaded[embed].shape),
            "embed_fully_addressable": loaded[embed].is_fully_addressable,
            "embed_local_shards": len(loaded[embed].addressable_shards),
        }  # fmt: skip
        del loaded, ref
    return out


def ties_of(tree: object) -> list[list[str]]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, st.Tied))[0]
    return [
        [jax.tree_util.keystr(k, simple=True, separator="/"), repr(x)]
        for k, x in flat
        if isinstance(x, st.Tied)
    ]


def describe(setup: Setup, params: dict, opt_state: object) -> dict:
    """Facts about the global train state, as this process sees them."""
    batch = setup.batch(0)
    compiled = setup.step.lower(params, opt_state, batch).compile()
    mem = compiled.memory_analysis()
    leaves = jax.tree.leaves((params, opt_state, batch))
    embed = params["embed"]
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "treedef": str(jax.tree.structure(params)),
        "opt_treedef": str(jax.tree.structure(opt_state)),
        "ties": ties_of(params),
        "opt_ties": ties_of(opt_state),
        "num_param_leaves": len(jax.tree.leaves(params)),
        "num_tables": sum(x.shape == (VOCAB, DIM) for x in jax.tree.leaves(params)),
        "num_tables_in_state": sum(x.shape == (VOCAB, DIM) for x in jax.tree.leaves(opt_state)),
        "embed_shape": list(embed.shape),
        "embed_spec": str(embed.sharding.spec).replace("PartitionSpec(", "P("),
        "embed_fully_addressable": embed.is_fully_addressable,
        "embed_local_shards": sorted(list(s.data.shape) for s in embed.addressable_shards),
        "argument_bytes": None if mem is None else int(mem.argument_size_in_bytes),
        "unique_shard_bytes": sum(x.addressable_shards[0].data.nbytes for x in leaves),
    }


# docs: begin resume
def resume(args: argparse.Namespace) -> None:
    setup = Setup()
    ckpt = ocp.CheckpointManager(os.path.join(args.outdir, "ckpt"))
    step = ckpt.latest_step()
    state = ckpt.restore(step, args=ocp.args.StandardRestore(setup.abstract_state()))
    params, opt_state = state["params"], state["opt_state"]
    out = {
        "restored_step": step,
        "restored_ties": ties_of(params),
        "restored_opt_ties": ties_of(opt_state),
        "restored_treedef": str(jax.tree.structure(params)),
        "restored_shardings_equal": all(
            x.sharding == s
            for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(setup.shardings))
        )
        and all(
            x.sharding == s
            for x, s in zip(jax.tree.leaves(opt_state), jax.tree.leaves(setup.opt_shardings))
        ),
    }
    record = {f"restored/{k}": v for k, v in gathered(params).items()}
    if ST_SAVE_GATHERS:  # the export, read back by every process onto the global shardings
        loaded = st.load(os.path.join(args.outdir, "model.safetensors"), shardings=setup.shardings)
        out["st_load_ties"] = ties_of(loaded)
        out["st_load_shardings_equal"] = jax.tree.structure(loaded) == jax.tree.structure(
            setup.shardings
        ) and all(
            x.sharding == s
            for x, s in zip(jax.tree.leaves(loaded), jax.tree.leaves(setup.shardings))
        )
        record.update({f"st_load/{k}": v for k, v in gathered(loaded).items()})
    losses = []
    for i in range(step, STEPS):
        params, opt_state, value, _ = setup.step(params, opt_state, setup.batch(i))
        losses.append(float(value))
    out["losses"] = losses
    record.update({f"params/{k}": v for k, v in gathered(params).items()})
    write(args, out, record)  # written before the interrupted save below
    ckpt.save(STEPS, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    if args.kill_during_save and jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the write is under way in the background
    ckpt.wait_until_finished()
    ckpt.close()


# docs: end resume


def by_hand_init(key: jax.Array) -> dict:
    """The same weights without sharetree: one embedding and two blocks."""
    p = init(key)
    return {"embed": p["embed"], "blocks": p["blocks"][:2]}


def by_hand_loss(p: dict, batch: jax.Array) -> jax.Array:
    """Tied by hand: the head is ``W.T`` and block 0 is called twice."""
    m = {"embed": p["embed"], "blocks": [*p["blocks"], p["blocks"][0]], "head": p["embed"].T}
    return loss_of_materialized(m, batch)


def single(args: argparse.Namespace) -> None:
    record: dict[str, np.ndarray] = {}
    out: dict = {"device_count": jax.device_count()}
    for name, setup in (("tied", Setup()), ("hand", Setup(by_hand_loss, by_hand_init))):
        params = setup.init(jax.random.key(0))
        opt_state = setup.opt_init(params)
        losses = []
        for i in range(STEPS):
            params, opt_state, value, grads = setup.step(params, opt_state, setup.batch(i))
            losses.append(float(value))
            record.update(
                {f"{name}/grads/{i}/{k}": np.asarray(v) for k, v in gathered(grads).items()}
            )
        out[f"{name}_losses"] = losses
        record.update({f"{name}/params/{k}": v for k, v in gathered(params).items()})
    # the checkpoint directory after the interrupted save: the previous step restores intact
    path = os.path.join(args.outdir, "ckpt")
    if os.path.isdir(path):
        ckpt = ocp.CheckpointManager(path)
        out["ckpt_steps"] = list(ckpt.all_steps())
        setup = Setup()
        state = ckpt.restore(
            ckpt.latest_step(), args=ocp.args.StandardRestore(setup.abstract_state())
        )
        out["ckpt_ties"] = ties_of(state["params"])
        record.update({f"ckpt/{k}": v for k, v in gathered(state["params"]).items()})
        ckpt.close()
    write(args, out, record)


def write(args: argparse.Namespace, out: dict, record: dict[str, np.ndarray]) -> None:
    name = os.path.join(args.outdir, f"{args.mode}_{jax.process_index()}")
    np.savez(name + ".npz", **record)
    with open(name + ".json", "w") as fh:
        json.dump(out, fh)


def read_after_save(args: argparse.Namespace) -> None:
    """Every process reads the export as soon as ``train`` returns: no sync after st.save.

    ``st.save(gather=True)`` ends with a barrier, so the file process 0 wrote is
    there when ``save`` returns on any process (process 1 reads it at once).
    """
    path = os.path.join(args.outdir, "model.safetensors")
    facts = {"exists": os.path.exists(path)}
    if facts["exists"]:
        back = st.load(path)
        facts.update(ties=ties_of(back), embed=np.asarray(back["embed"]).tolist())
    with open(os.path.join(args.outdir, f"read_after_save_{jax.process_index()}.json"), "w") as fh:
        json.dump(facts, fh)


# the tree of the cooperative save (issue 35): rows over all 8 devices, columns, replicated
SAVE_SHAPES = {"embed": (2048, 2048), "kernel": (1024, 2048), "norm": (2048,), "mixed": (64, 32)}


def save_arrays() -> dict[str, np.ndarray]:
    """The global values of the cooperative save's buffers (the test recomputes them)."""
    rng = np.random.default_rng(35)
    out = {k: rng.standard_normal(s).astype(np.float32) for k, s in SAVE_SHAPES.items()}
    out["mixed"] = out["mixed"].astype(jnp.bfloat16)
    return out


def save_tree(mesh: Mesh) -> tuple[dict, dict]:
    """The tied tree of global arrays, and its shardings (``None`` for the views)."""
    every = ("data", "model")
    specs = {
        "embed": P(every, None),  # rows over every device of both processes
        "kernel": P(None, every),  # columns: each part written as strided runs
        "norm": P(),  # replicated: one writer
        "mixed": P("model", None),  # 4 parts, each on both processes: one writer each
    }
    shardings = {k: NamedSharding(mesh, p) for k, p in specs.items()}
    values = save_arrays()
    tree = {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
        for k, v in values.items()
    }
    tree["head"] = st.Tied("embed", st.T)  # a transposed view
    tree["first"] = st.Tied("kernel", st.slice(0, 8))  # a sliced view
    return tree, {**shardings, "head": None, "first": None}


def error_facts(run) -> dict:
    """What ``run()`` raised: its class, code, message and notes (``None`` if it returned)."""
    try:
        run()
    except Exception as e:
        return {"type": type(e).__name__, "code": getattr(e, "code", None), "message": str(e),
                "notes": list(getattr(e, "__notes__", ()))}  # fmt: skip
    return {"type": None}


def digest(path: str) -> str | None:
    import hashlib

    return hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.exists(path) else None


def save_job(args: argparse.Namespace) -> None:
    """Every process saves its share of one file; then the faults, the kill last."""
    from sharetree._files import rounds

    mesh, me, out = make_mesh(), jax.process_index(), {}
    path = os.path.join(args.outdir, "coop.safetensors")
    tree, shardings = save_tree(mesh)
    small = {
        "w": jax.device_put(np.ones((8, 2), np.float32), NamedSharding(mesh, P(("data", "model"))))
    }
    st.save(os.path.join(args.outdir, "warm.safetensors"), small)  # first calls, not measured
    with PeakAnon() as memory:
        st.save(path, tree, metadata={"format": "pt"})
    out["growth"], out["file_bytes"] = memory.growth, os.path.getsize(path)
    out["part_bytes"] = max(  # the largest part this process holds
        s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
    )
    loaded = st.load(path, shardings=shardings)  # back onto the same shardings, by shard
    values = save_arrays()
    out["ties"] = ties_of(loaded)
    out["shards_equal"] = {
        k: all(np.array_equal(np.asarray(s.data), values[k][s.index]) for s in x.addressable_shards)
        for k, x in loaded.items()
        if isinstance(x, jax.Array)
    }
    out["shardings_equal"] = all(loaded[k].sharding == shardings[k] for k in values)
    del loaded
    before = digest(path)
    faults = {}

    def bad_buffer():  # a buffer deleted on process 1 only
        bad = dict(tree)
        if me == 1:
            ones = np.ones(2048, np.float32)  # no collective: process 0 does not build it
            bad["norm"] = jax.make_array_from_callback(
                (2048,), tree["norm"].sharding, ones.__getitem__
            )
            bad["norm"].delete()
        st.save(path, bad)

    faults["bad_buffer"] = error_facts(bad_buffer)
    faults["metadata"] = error_facts(lambda: st.save(path, tree, metadata={"step": str(me)}))
    local = os.path.join(args.outdir, f"local_{me}")  # the same relative path, other directories
    os.makedirs(local, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(local)
    try:
        faults["not_shared"] = error_facts(lambda: st.save("model.safetensors", tree))
    finally:
        os.chdir(cwd)
    real = rounds.write_runs

    def full(fd, start, part, runs):  # the disk fills while process 1 writes
        if me == 1:
            raise OSError(28, "No space left on device")
        return real(fd, start, part, runs)

    rounds.write_runs = full
    faults["disk_full"] = error_facts(lambda: st.save(path, tree))
    rounds.write_runs = real
    out["intact_after_faults"] = digest(path) == before
    out["entries_after_faults"] = sorted(os.listdir(args.outdir))
    out["faults"] = faults
    multihost_utils.sync_global_devices("save_job: faults done")
    st.save(path, tree, metadata={"format": "pt"})  # a successful save after the faults
    out["entries_after_save"] = sorted(os.listdir(args.outdir))
    out["same_after_resave"] = digest(path) == before
    hf_dir = os.path.join(args.outdir, "hf")  # Hugging Face's sharded layout, by both processes
    names = {"embed": "model.embed_tokens.weight", "kernel": "kernel", "norm": "norm"}
    names["mixed"] = "mixed"
    hf = {names[k]: tree[k] for k in values}
    hf["lm_head.weight"] = st.Tied("model.embed_tokens.weight")  # dropped, recorded
    st.save(hf_dir, hf, max_shard_size="12MB", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a Hugging Face directory: loaded as a flat dict
        back = st.load(hf_dir, shardings={**{names[k]: shardings[k] for k in values},
                                          "lm_head.weight": None})  # fmt: skip
    out["hf"] = {
        "files": sorted(os.listdir(hf_dir)),
        "ties": ties_of(back),
        "shards_equal": {
            k: all(
                np.array_equal(np.asarray(s.data), values[k][s.index])
                for s in back[names[k]].addressable_shards
            )
            for k in values
        },
    }
    del back
    write(args, out, {})

    def killed(fd, start, part, runs):  # process 1 dies while writing its share
        if me == 1:
            os.pwrite(fd, b"\xff" * 64, start)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fd, start, part, runs)

    rounds.write_runs = killed
    start = time.monotonic()
    out["killed"] = error_facts(lambda: st.save(path, tree, timeout=args.save_timeout))
    out["killed_seconds"] = time.monotonic() - start
    out["intact_after_kill"] = digest(path) == before
    write(args, out, {})
    os._exit(0)  # process 1 is gone: jax.distributed.shutdown would wait for it


class OrbaxInternalsMoved(RuntimeError):
    """The Orbax function the kill-during-save case holds is gone or changed."""


def hold_save_in_flight(outdir: str, step: int, timeout: float) -> None:
    """Make the kill during the save of ``step`` deterministic (process 1, ``--kill-during-save``).

    Orbax's background save thread (``async_checkpointer._background_wait_for_commit_futures``,
    the same in orbax-checkpoint 0.11.17 and 0.12) waits for this process's writes,
    then calls ``sync_fn`` for the ``async_write_complete`` barrier that every
    process must reach before the primary host commits the save (renames the
    temporary directory). Here that first ``sync_fn`` call never returns: the save
    is held mid-flight, its temporary directory written and not committed, and it
    cannot commit without this process. ``CheckpointManager.save(step)`` then
    returns only once the thread is held there and the temporary directory is seen
    (recorded in ``OUTDIR/save_in_flight_1.json``), so the ``os.kill`` right after
    ``save`` in :func:`resume` always lands during the write. Anything else (the
    function gone, no ``sync_fn``, another barrier first, the hold not reached
    within ``timeout`` s, no temporary directory) raises: never the racy path.
    """
    from orbax.checkpoint._src.checkpointers import async_checkpointer as ac

    name = "_background_wait_for_commit_futures"
    background = getattr(ac, name, None)
    if background is None or "sync_fn" not in inspect.signature(background).parameters:
        raise OrbaxInternalsMoved(
            f"orbax-checkpoint {ocp.__version__}: {ac.__name__}.{name}(..., sync_fn=...) is "
            "gone, so the kill-during-save case cannot hold the save in flight. Orbax's "
            "internals moved: find the function its background save thread runs and the "
            "barrier before the commit, and hold that in hold_save_in_flight."
        )
    reached = threading.Event()
    seen: dict[str, str] = {}

    def held_background(*args, **kwargs):
        def hold(key, *rest, **kw):
            seen["key"] = str(key)
            reached.set()
            if "async_write_complete" in str(key):
                threading.Event().wait()  # held here until the process is killed
            raise OrbaxInternalsMoved(f"the first barrier after the writes is {key!r}")

        return background(*args, **{**kwargs, "sync_fn": hold})

    ac._background_wait_for_commit_futures = held_background
    save = ocp.CheckpointManager.save
    ckpt = os.path.join(outdir, "ckpt")

    def save_then_wait_for_the_hold(self, save_step, *args, **kwargs):
        result = save(self, save_step, *args, **kwargs)
        if save_step != step:
            return result
        if not reached.wait(timeout):
            raise OrbaxInternalsMoved(
                f"orbax-checkpoint {ocp.__version__}: the background save never called "
                f"{name}'s sync_fn within {timeout:g} s. Orbax's internals moved: the "
                "kill-during-save case cannot hold the save in flight."
            )
        if "async_write_complete" not in seen["key"]:
            raise OrbaxInternalsMoved(
                f"orbax-checkpoint {ocp.__version__}: the first barrier after the writes "
                f"is {seen['key']!r}, not async_write_complete. Orbax's internals moved."
            )
        entries = sorted(os.listdir(ckpt))
        if str(step) in entries or not any(e.startswith(f"{step}.") for e in entries):
            raise RuntimeError(f"the save of step {step} is not in flight: {ckpt} has {entries}")
        with open(os.path.join(outdir, "save_in_flight_1.json"), "w") as fh:
            json.dump({"held_at": seen["key"], "ckpt_entries": entries}, fh)
        return result

    ocp.CheckpointManager.save = save_then_wait_for_the_hold


if __name__ == "__main__":
    initialize(ARGS.coordinator, ARGS.num_processes, ARGS.process_id, ARGS.init_timeout)
    if ARGS.mode == "resume" and ARGS.kill_during_save and ARGS.process_id == 1:
        hold_save_in_flight(ARGS.outdir, STEPS, ARGS.hold_timeout)
    if ARGS.mode == "train" and os.path.isdir(os.path.join(ARGS.outdir, "load_hf")):
        facts = load_by_shard(ARGS.outdir)  # first, in a fresh process: st.load by shard
        with open(os.path.join(ARGS.outdir, f"load_{jax.process_index()}.json"), "w") as fh:
            json.dump(facts, fh)
    {"train": train, "resume": resume, "single": single, "save": save_job}[ARGS.mode](ARGS)
    if ARGS.mode == "train" and ST_SAVE_GATHERS:
        read_after_save(ARGS)
    if ARGS.num_processes > 1:
        jax.distributed.shutdown()
