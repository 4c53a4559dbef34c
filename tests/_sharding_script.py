"""Sharding and Orbax checks on 8 simulated CPU devices; run as a subprocess by the tests.

Usage: ``python tests/_sharding_script.py {sharding|orbax|all} OUT_JSON TMPDIR``.
``XLA_FLAGS`` must be set before jax is imported, so it is set here first; the
tests assert on the JSON this script writes (one entry per check).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharetree as st

VOCAB, DIM, HIDDEN, BATCH, SEQ = 64, 16, 32, 8, 6


def init(key: jax.Array) -> dict:
    """A tied-embedding language model: the output head is the embedding transposed."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (VOCAB, DIM)) * 0.5,
        "mlp": {
            "w1": jax.random.normal(k2, (DIM, HIDDEN)) / DIM**0.5,
            "b1": jnp.full((HIDDEN,), 0.1),
            "w2": jax.random.normal(k3, (HIDDEN, DIM)) / HIDDEN**0.5,
        },
        "head": st.Tied("embed", st.T),
    }


def forward(m: dict, tokens: jax.Array) -> jax.Array:
    """Logits of a materialized tree (no sharetree inside: plain arrays)."""
    x = m["embed"][tokens]
    x = x + jnp.tanh(x @ m["mlp"]["w1"] + m["mlp"]["b1"]) @ m["mlp"]["w2"]
    return x @ m["head"]


def loss(params: dict, batch: dict) -> jax.Array:
    logits = forward(st.materialize(params), batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def spec_of(path: tuple, x: jax.Array) -> P:
    """One PartitionSpec per buffer, chosen by path: the 'model' axis splits features."""
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return {
        "embed": P(None, "model"),
        "mlp/w1": P(None, "model"),
        "mlp/b1": P("model"),
        "mlp/w2": P("model", None),
    }[name]


def _spec(spec) -> str:
    """``str`` of a PartitionSpec as jax >= 0.9.1 prints it (older jax: ``PartitionSpec(...)``)."""
    return str(spec).replace("PartitionSpec(", "P(")


def make_mesh() -> jax.sharding.Mesh:
    """A 4x2 (data, model) mesh with automatic (GSPMD) sharding propagation."""
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))


def close(a: object, b: object, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        for x, y in zip(la, lb, strict=True)
    )


def sharding_checks() -> dict:
    out: dict = {"num_devices": jax.device_count()}
    mesh = make_mesh()
    params = init(jax.random.key(0))
    kt, ky = jax.random.split(jax.random.key(1))
    batch = {
        "tokens": jax.random.randint(kt, (BATCH, SEQ), 0, VOCAB),
        "targets": jax.random.randint(ky, (BATCH, SEQ), 0, VOCAB),
    }
    opt = optax.adam(1e-2)

    def step(p, s, b):
        value, grads = jax.value_and_grad(loss)(p, b)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value, grads

    # one device: the reference
    dev0 = jax.devices()[0]
    p1 = jax.device_put(params, dev0)
    b1 = jax.device_put(batch, dev0)
    s1 = opt.init(p1)
    new1, state1, value1, grads1 = jax.jit(step)(p1, s1, b1)

    # independent reference for the gradient: the untied model, with the head's
    # gradient summed back into the embedding by hand
    untied = dict(st.materialize(params))
    g_untied = jax.jit(
        jax.grad(
            lambda u, b: optax.softmax_cross_entropy_with_integer_labels(
                forward(u, b["tokens"]), b["targets"]
            ).mean()
        )
    )(untied, batch)
    out["grad_matches_untied_sum"] = bool(
        np.allclose(grads1["embed"], g_untied["embed"] + g_untied["head"].T, rtol=1e-5, atol=1e-6)
    )
    out["grad_head_is_tied"] = grads1["head"] == st.Tied("embed", st.T)

    # the mesh: one NamedSharding per buffer, a tree built with tree_map over the canonical tree
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_of(path, x)), params
    )
    out["sharding_tree_keeps_tie"] = shardings["head"] == params["head"]
    # the same tree from path rules (the hand-written spec_of above is the reference)
    by_path = st.shardings_by_path(
        params,
        mesh,
        {
            "embed": P(None, "model"),
            "mlp/w1": P(None, "model"),
            "*b1": P("model"),
            "mlp/*": P("model", None),
        },
    )
    out["shardings_by_path_equal"] = jax.tree.structure(by_path) == jax.tree.structure(
        shardings
    ) and all(a == b for a, b in zip(jax.tree.leaves(by_path), jax.tree.leaves(shardings)))
    out["num_shardings"] = len(jax.tree.leaves(shardings))
    batch_sharding = NamedSharding(mesh, P("data", None))
    ps = jax.device_put(params, shardings)
    bs = jax.device_put(batch, batch_sharding)
    out["device_put_keeps_tie"] = ps["head"] == st.Tied("embed", st.T)
    out["num_buffers"] = len(jax.tree.leaves(ps))
    emb = ps["embed"]
    out["embed_spec"] = _spec(emb.sharding.spec)
    out["embed_num_shards"] = len(emb.addressable_shards)
    out["embed_shard_shapes"] = sorted({tuple(s.data.shape) for s in emb.addressable_shards})
    out["embed_devices"] = len({s.device for s in emb.addressable_shards})
    # one (VOCAB, DIM) table among the arrays: split in 2 over 'model', replicated 4x over
    # 'data', so the devices hold 8 shards of 2 distinct slices, i.e. 4 copies (one per data
    # replica), not 8 (as two tables would give)
    tables = [x for x in jax.tree.leaves(ps) if x.shape == (VOCAB, DIM)]
    out["num_tables"] = len(tables)
    out["embed_distinct_slices"] = len({str(s.index) for s in emb.addressable_shards})
    out["table_copies_on_devices"] = sum(
        s.data.size for x in tables for s in x.addressable_shards
    ) / (VOCAB * DIM)

    # optimizer state: the params' shardings for every params-shaped part, replicated otherwise
    replicated = NamedSharding(mesh, P())
    state_shardings = optax.tree_map_params(
        opt,
        lambda _, s: s,
        jax.eval_shape(opt.init, params),
        shardings,
        transform_non_params=lambda _: replicated,
    )
    ss = jax.jit(opt.init, out_shardings=state_shardings)(ps)
    out["opt_state_keeps_tie"] = ss[0].mu["head"] == st.Tied("embed", st.T)
    out["opt_state_embed_spec"] = _spec(ss[0].mu["embed"].sharding.spec)
    sharded_step = jax.jit(
        step,
        in_shardings=(shardings, state_shardings, batch_sharding),
        out_shardings=(shardings, state_shardings, replicated, shardings),
    )
    compiled = sharded_step.lower(ps, ss, bs).compile()
    mem = compiled.memory_analysis()
    if mem is not None:
        # per-device argument bytes: each shard of each buffer once (no second table)
        per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((ps, ss, bs)))
        out["argument_bytes"] = [int(mem.argument_size_in_bytes), int(per_device)]
    new_s, state_s, value_s, grads_s = compiled(ps, ss, bs)

    out["loss_equal"] = bool(np.allclose(value_s, value1, rtol=1e-6))
    out["grads_equal"] = close(grads_s, grads1)
    out["step_equal"] = close(new_s, new1)
    out["state_equal"] = close(state_s, state1)
    out["new_params_keep_tie"] = new_s["head"] == st.Tied("embed", st.T)
    out["new_embed_spec"] = _spec(new_s["embed"].sharding.spec)
    out["grad_embed_spec"] = _spec(grads_s["embed"].sharding.spec)
    out["new_num_buffers"] = len(jax.tree.leaves(new_s))

    # a second step from the sharded state stays equal to the one-device run
    new2_s = compiled(new_s, state_s, bs)[0]
    new2_1 = jax.jit(step)(new1, state1, b1)[0]
    out["second_step_equal"] = close(new2_s, new2_1)
    return out


def orbax_checks(tmp: str) -> dict:
    import orbax.checkpoint as ocp

    out: dict = {}
    mesh = make_mesh()
    params = init(jax.random.key(0))
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_of(path, x)), params
    )
    ps = jax.device_put(params, shardings)
    path = os.path.join(tmp, "ckpt")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, ps)
    # the recipe: restore into an abstract canonical tree that carries the shardings
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), ps
    )
    with ocp.StandardCheckpointer() as ckptr:
        back = ckptr.restore(path, abstract)
    out["restored_tie"] = back["head"] == st.Tied("embed", st.T)
    out["restored_equal"] = close(back, params, rtol=0, atol=0)
    out["restored_specs_equal"] = all(
        a.sharding == b.sharding
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ps), strict=True)
    )
    out["restored_embed_spec"] = _spec(back["embed"].sharding.spec)
    out["restored_num_buffers"] = len(jax.tree.leaves(back))

    # the documented recipe for a train state: a fresh program's abstract tree, with the
    # params' and optimizer state's shardings put into it
    opt = optax.adam(1e-2)
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(
        opt,
        lambda _, s: s,
        jax.eval_shape(opt.init, params),
        shardings,
        transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(opt.init, out_shardings=opt_shardings)(ps)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(tmp, "state"), {"params": ps, "opt_state": opt_state})
    abstract = jax.eval_shape(lambda: {"params": init(jax.random.key(5)), "opt_state": opt_state})
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract,
        {"params": shardings, "opt_state": opt_shardings},
    )
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(os.path.join(tmp, "state"), abstract)
    out["state_ties"] = [
        state["params"]["head"] == st.Tied("embed", st.T),
        state["opt_state"][0].mu["head"] == st.Tied("embed", st.T),
        state["opt_state"][0].nu["head"] == st.Tied("embed", st.T),
    ]
    out["state_mu_embed_spec"] = _spec(state["opt_state"][0].mu["embed"].sharding.spec)
    out["state_equal"] = close(state, {"params": ps, "opt_state": opt_state}, rtol=0, atol=0)

    # st.save of a sharded (single-process, fully addressable) tree, then device_put back
    f = os.path.join(tmp, "model.safetensors")
    st.save(f, ps)
    loaded = jax.device_put(st.load(f), shardings)
    out["st_load_tie"] = loaded["head"] == st.Tied("embed", st.T)
    out["st_load_equal"] = close(loaded, params, rtol=0, atol=0)
    out["st_load_embed_spec"] = _spec(loaded["embed"].sharding.spec)
    return out


if __name__ == "__main__":
    mode, out_path = sys.argv[1], sys.argv[2]
    result = {}
    if mode in ("sharding", "all"):
        result["sharding"] = sharding_checks()
    if mode in ("orbax", "all"):
        result["orbax"] = orbax_checks(sys.argv[3])
    with open(out_path, "w") as fh:
        json.dump(result, fh)
