"""The flat path at scale: one process x 8 devices, or one of 2 processes x 4 devices.

Usage: ``python tests/_flat_sharded_worker.py OUTDIR [--process-id i --num-processes n
--coordinator host:port --local-devices k]`` (``tests/_multihost_launcher.py`` passes
them). Every process builds the same trees on a (data, model) = (2, 4) mesh, runs the
flat path and the flat clients (optax, optimistix L-BFGS, lineax CG on Hessian-vector
products), and compares every addressable shard with the same computation on one device
of its own: the model tied by hand (``head = embed.T``, plain ``jax.grad``) and the same
client run on the one-device flat vector. It writes the facts to ``OUTDIR/flat_<i>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

ARGS = None
if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--coordinator", default=None)
    p.add_argument("--local-devices", type=int, default=8)
    p.add_argument("--init-timeout", type=int, default=30)
    ARGS = p.parse_args(sys.argv[1:])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.local_devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lineax as lx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optimistix as optx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sharetree as st  # noqa: E402

V, D, H, B = 64, 16, 32, 12
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(r"= \S+ (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo: str, only: str | None = None) -> dict[str, int]:
    """How many collectives of each kind a compiled program's HLO text has.

    With ``only``, just those whose ``op_name`` (where JAX traced them) contains it.
    """
    lines = [line for line in hlo.splitlines() if only is None or only in _op_name(line)]
    return dict(collections.Counter(m.group(1) for m in map(_OP.search, lines) if m))


def _op_name(line: str) -> str:
    found = re.search(r'op_name="([^"]*)"', line)
    return found.group(1) if found else ""


def arrays() -> dict[str, np.ndarray]:
    """The buffers' values, the same on every process (NumPy, one seed)."""
    rng = np.random.default_rng(0)
    return {
        "embed": rng.normal(size=(V, D)).astype(np.float32) * 0.5,
        "w1": rng.normal(size=(D, H)).astype(np.float32) / D**0.5,
        "w2": rng.normal(size=(H, D)).astype(np.float32) / H**0.5,
        "b1": np.full((H,), 0.1, np.float32),
        "scale": rng.normal(size=(5,)).astype(np.float32),  # 5 over 8 devices: padding
        "gate": rng.normal(size=(D,)).astype(jnp.bfloat16),
    }


TOKENS = np.arange(B) * 7 % V


def by_hand(p: dict) -> dict:
    """The materialized tree written by hand: the ties as plain JAX expressions."""
    m = {k: v for k, v in p.items()}
    m["head"] = p["embed"].T
    if "scale" in p:
        m["half"] = p["w1"][:, : H // 2]
        m["mix"] = p["w2"] @ p["w1"]
    return m


def model_loss(m: dict) -> jax.Array:
    """A tied LM's loss; the "mixed" layout's extra buffers and views each enter it."""
    x = m["embed"][TOKENS]
    if "scale" in m:
        x = x * m["gate"].astype(jnp.float32)
        hid = jnp.tanh(x @ m["w1"] + m["b1"]) + 0.1 * jnp.tanh(x @ m["half"]).sum(-1, keepdims=True)
        x = x + (hid @ m["mix"]) @ m["w2"] * 0.1 + jnp.sum(m["scale"] ** 2)
    else:
        x = x + jnp.tanh(x @ m["w1"]) @ m["w2"]
    return jnp.mean(jax.nn.logsumexp(x @ m["head"], -1) - (x @ m["head"])[:, 0])


LAYOUTS = {  # name: the buffers and each one's PartitionSpec on the (data, model) mesh
    # the model: embed by rows, w1 by columns, w2 by rows, over all 8 devices
    "sharded": {
        "embed": P(("data", "model"), None),
        "w1": P(None, ("data", "model")),
        "w2": P(("data", "model"), None),
    },
    # different axes, replicated over one axis or both, uneven (padded), bfloat16, views
    "mixed": {
        "embed": P("model", "data"),
        "w1": P(None, "model"),
        "w2": P("data", None),
        "b1": P(),
        "scale": P(),
        "gate": P("model"),
    },
}


def canonical(values: dict, layout: str) -> dict:
    tree = {k: values[k] for k in LAYOUTS[layout]}
    tree["head"] = st.Tied("embed", st.T)
    if layout == "mixed":
        tree["half"] = st.Tied("w1", st.slice(0, H // 2, axis=1))
        tree["mix"] = st.Tied({"a": "w2", "b": "w1"}, st.matmul())
    return tree


def max_error(global_array: jax.Array, reference: np.ndarray) -> float:
    """The largest difference of this process's shards from the same part of ``reference``."""
    worst = 0.0
    for shard in global_array.addressable_shards:
        got = np.asarray(shard.data, np.float64)
        want = np.asarray(reference, np.float64)[shard.index]
        worst = max(worst, float(np.max(np.abs(got - want), initial=0.0)))
    return worst


def tree_error(tree: dict, reference: dict) -> float:
    return max(max_error(tree[k], np.asarray(reference[k])) for k in reference)


def local(tree: dict) -> dict:
    """A tree's buffers on this process's first device: the one-device reference."""
    device = jax.local_devices()[0]
    return jax.tree.map(lambda x: jax.device_put(x, device), tree)


def run_clients(flat: jax.Array, re: st.Restructure) -> dict[str, jax.Array]:
    """optax, optimistix L-BFGS and lineax CG on a flat vector: each run's result."""
    loss = jax.jit(lambda v: model_loss(re(v)))
    out = {}
    opt = optax.adamw(1e-2, weight_decay=0.1)

    @jax.jit
    def adam(v):
        state = opt.init(v)
        for _ in range(4):
            g = jax.grad(loss)(v)
            updates, state = opt.update(g, state, v)
            v = optax.apply_updates(v, updates)
        return v

    out["optax"] = adam(flat)
    solver = optx.LBFGS(rtol=1e-6, atol=1e-6)
    sol = optx.minimise(lambda v, _: loss(v), solver, flat, max_steps=8, throw=False)
    out["lbfgs"] = sol.value
    grad = jax.grad(loss)
    cg = lx.CG(rtol=1e-6, atol=1e-7, max_steps=200)

    def newton_step(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """CG on (H + 50 I) d = g, H by Hessian-vector products (positive definite here)."""
        op = lx.FunctionLinearOperator(
            lambda v: jax.jvp(grad, (x,), (v,))[1] + 50.0 * v,
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            lx.positive_semidefinite_tag,
        )
        # throw=False: lineax's check is a callback on one device, which gathers the result
        sol = lx.linear_solve(op, grad(x), cg, throw=False)
        return sol.value, sol.stats["num_steps"]

    try:
        out["cg"], out["cg_steps"] = jax.jit(newton_step)(flat)
    except TypeError as e:  # lineax 0.1.0 on jax 0.8.1 / equinox 0.12.2: its own binding fails
        if "weak reference" not in str(e):
            raise
        out["cg_unavailable"] = f"lineax {lx.__version__}: {e}"
    return out


def check(layout: str, mesh: Mesh) -> dict:
    values = arrays()
    specs = LAYOUTS[layout]
    ref_tree = local(canonical(values, layout))
    sharded = canonical(values, layout)
    for k, spec in specs.items():
        sharded[k] = jax.make_array_from_callback(
            values[k].shape, NamedSharding(mesh, spec), lambda i, k=k: values[k][i]
        )
    flat, re = st.destructure(sharded)
    layout_ = re.sharded
    facts: dict = {"repr": repr(re), "length": flat.shape[0], "padding": layout_.padding}
    facts["devices"] = len(flat.sharding.device_set)
    facts["block_lengths"] = sorted({s.data.shape[0] for s in flat.addressable_shards})
    facts["block"] = layout_.block
    facts["addressable_blocks"] = len(flat.addressable_shards)
    facts["unique"] = sum(v.size for k, v in values.items() if k in specs)
    facts["mask_sum"] = int(jnp.sum(re.mask()))
    # values and shardings of restructure
    plain_ref = by_hand({k: values[k] for k in specs})
    m = re(flat)
    facts["value_error"] = tree_error(m, plain_ref)
    facts["shardings_kept"] = all(
        m[k].sharding.is_equivalent_to(sharded[k].sharding, m[k].ndim) for k in specs
    )
    facts["roundtrip_error"] = max_error(
        st.destructure(re.canonical(flat))[0], _gathered_reference(flat)
    )
    # gradients against the model tied by hand, on one device
    grad_flat = jax.jit(jax.grad(lambda v: model_loss(re(v))))(flat)
    by_hand_grad = jax.grad(lambda p: model_loss(by_hand(p)))(local({k: values[k] for k in specs}))
    g_tree = re.canonical(grad_flat)
    facts["grad_error"] = tree_error(g_tree, {k: np.asarray(by_hand_grad[k]) for k in specs})
    facts["grad_scale"] = max(
        float(np.max(np.abs(np.asarray(x, np.float64)))) for x in by_hand_grad.values()
    )
    mask = re.mask()
    facts["padding_grad"] = max(
        float(np.max(np.abs(np.asarray(g.data)[~np.asarray(mk.data)]), initial=0.0))
        for g, mk in zip(grad_flat.addressable_shards, mask.addressable_shards)
    )
    # collectives of the compiled flat jit(grad) against the plain tree program's
    # (the plain gradient placed as its parameters, as a step needs it; the flat one is)
    shardings = jax.tree.map(lambda x: x.sharding, sharded)
    plain = jax.jit(jax.grad(lambda p: model_loss(st.materialize(p))), out_shardings=shardings)
    flat_text = jax.jit(jax.grad(lambda v: model_loss(re(v)))).lower(flat).compile().as_text()
    facts["plain_collectives"] = collectives(plain.lower(sharded).compile().as_text())
    facts["flat_collectives"] = collectives(flat_text)
    facts["unpack_collectives"] = collectives(flat_text, "(_unpack_local)")
    facts["unpack_vjp_collectives"] = collectives(flat_text, "transpose(jvp(jit(_unpack_local")
    facts["replicated_buffers"] = sum(r > 1 for r in layout_.replicas)
    facts["replicated_axes"] = sum(
        len(axes) for axes, r in zip(layout_.gather_axes, layout_.replicas) if r > 1
    )
    # the clients, against the same runs on the one-device flat vector
    flat1, re1 = st.destructure(ref_tree)
    ours, theirs = run_clients(flat, re), run_clients(flat1, re1)
    if "cg_unavailable" in ours:
        facts["cg_unavailable"] = ours.pop("cg_unavailable")
        theirs.pop("cg_unavailable", None)
    else:
        facts["cg_steps"] = [int(ours.pop("cg_steps")), int(theirs.pop("cg_steps"))]
    facts["clients"] = sorted(ours)
    for name in ours:
        got, want = re.canonical(ours[name]), re1.canonical(theirs[name])
        facts[f"{name}_error"] = tree_error(got, {k: np.asarray(want[k]) for k in specs})
        facts[f"{name}_moved"] = tree_error(got, {k: np.asarray(values[k]) for k in specs})
        facts[f"{name}_padding"] = max(
            float(np.max(np.abs(np.asarray(x.data)[~np.asarray(mk.data)]), initial=0.0))
            for x, mk in zip(ours[name].addressable_shards, mask.addressable_shards)
        )
    return facts


def _gathered_reference(flat: jax.Array) -> np.ndarray:
    """The full flat vector as NumPy on this process (the roundtrip's reference)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(flat, tiled=True))


def main(args: argparse.Namespace) -> None:
    if args.num_processes > 1:
        from _multihost_worker import initialize

        initialize(args.coordinator, args.num_processes, args.process_id, args.init_timeout)
    devices = np.array(jax.devices()).reshape(2, 4)
    mesh = Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    out = {"processes": jax.process_count(), "jax": jax.__version__}
    out["layouts"] = {name: check(name, mesh) for name in LAYOUTS}
    path = os.path.join(args.outdir, f"flat_{jax.process_index()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(out, fh, indent=1)
    os.replace(path + ".tmp", path)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(ARGS)
