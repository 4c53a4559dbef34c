"""The Orbax recipe: canonical trees save and restore with orbax.checkpoint, ties intact.

Recipe (docs/saving_and_scaling.md): save the canonical tree as it is; restore
with an abstract canonical tree as target (``jax.eval_shape`` of the code that
builds the tree, or ``jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)``).
A ``Tied`` has no leaves, so Orbax stores each buffer once and the tie lives
in the target's structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sharetree as st

ocp = pytest.importorskip("orbax.checkpoint")

from test_sharding import script_results  # noqa: E402


def make_params(key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (12, 4)),
        "blocks": [
            {"w": jax.random.normal(k2, (4, 4)), "b": jnp.zeros(4)},
            {"w": st.Tied("blocks/0/w", st.T), "b": jnp.ones(4)},
        ],
        "proj": jax.random.normal(k3, (8, 2)),
        "proj_flat": st.Tied("proj", st.reshape(16) >> st.scale(0.5)),
        "head": st.Tied("embed", st.T),
        "step": jnp.array(3, jnp.int32),
    }


def loss(params: dict, tokens: jax.Array) -> jax.Array:
    m = st.materialize(params)
    x = m["embed"][tokens]
    for blk in m["blocks"]:
        x = jnp.tanh(x @ blk["w"] + blk["b"])
    return jnp.mean((x @ m["head"]) ** 2) + 1e-3 * jnp.sum(m["proj_flat"] ** 2)


def assert_same(a: object, b: object) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb  # same structure, so the same Tied nodes (ref and transform)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def save(path: object, tree: object) -> None:
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)


def restore(path: object, target: object = None) -> object:
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path) if target is None else ckptr.restore(path, target)


def test_roundtrip_with_abstract_target_keeps_ties(tmp_path) -> None:
    params = make_params(jax.random.key(0))
    save(tmp_path / "ckpt", params)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
    assert abstract["head"] == st.Tied("embed", st.T)  # tree_map keeps the ties
    back = restore(tmp_path / "ckpt", abstract)
    assert_same(back, params)
    assert back["blocks"][1]["w"] == st.Tied("blocks/0/w", st.T)
    assert_same(st.materialize(back), st.materialize(params))


def test_restore_in_a_fresh_program_from_eval_shape(tmp_path) -> None:
    params = make_params(jax.random.key(1))
    save(tmp_path / "ckpt", params)
    # a fresh program knows how to build the tree, not its values
    abstract = jax.eval_shape(make_params, jax.random.key(0))
    back = restore(tmp_path / "ckpt", abstract)
    assert_same(back, params)


def test_checkpoint_stores_each_buffer_once(tmp_path) -> None:
    params = make_params(jax.random.key(0))
    save(tmp_path / "ckpt", params)
    raw = restore(tmp_path / "ckpt")  # no target: what the checkpoint itself holds
    g = st.canonicalize(params)
    assert len(jax.tree.leaves(raw)) == g.num_unique == 6
    assert g.num_expanded == 9
    # the views were never written: without the target they come back as None
    assert raw["head"] is None and raw["proj_flat"] is None and raw["blocks"][1]["w"] is None
    np.testing.assert_array_equal(raw["embed"], params["embed"])


def test_resume_training_equals_uninterrupted_run(tmp_path) -> None:
    opt = optax.adamw(1e-2, weight_decay=1e-2)
    tokens = jnp.arange(12) % 12

    @jax.jit
    def step(p, s):
        grads = jax.grad(loss)(p, tokens)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    params = {k: v for k, v in make_params(jax.random.key(2)).items() if k != "step"}
    state = opt.init(params)
    for _ in range(2):
        params, state = step(params, state)
    save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    uninterrupted = step(params, state)

    abstract = jax.eval_shape(lambda: {"params": params, "opt_state": state})
    back = restore(tmp_path / "ckpt", abstract)
    assert back["params"]["head"] == st.Tied("embed", st.T)
    assert back["opt_state"][0].mu["head"] == st.Tied("embed", st.T)
    resumed = step(back["params"], back["opt_state"])
    assert_same(resumed, uninterrupted)


def test_sharded_arrays_roundtrip_on_a_mesh(tmp_path_factory) -> None:
    # run on 8 simulated devices by tests/_sharding_script.py (shared with test_sharding.py)
    result = script_results(tmp_path_factory)["orbax"]
    assert result["restored_tie"] is True
    assert result["restored_equal"] is True
    assert result["restored_specs_equal"] is True
    assert result["restored_embed_spec"] == "P(None, 'model')"
    assert result["restored_num_buffers"] == 4
    # a train state (params + Adam state) restored into the documented sharded target
    assert result["state_ties"] == [True, True, True]
    assert result["state_mu_embed_spec"] == "P(None, 'model')"
    assert result["state_equal"] is True
    # and st.save / st.load of the same sharded tree, placed back with device_put
    assert result["st_load_tie"] is True
    assert result["st_load_equal"] is True
    assert result["st_load_embed_spec"] == "P(None, 'model')"
