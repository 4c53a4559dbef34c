"""Ties through device_put, jit with in/out shardings and optax on a 4x2 (data, model) mesh.

The ``st.shardings_by_path`` tests at the end run in this process, on an
abstract mesh (its checks need only axis names and sizes).

The checks run in a subprocess (``tests/_sharding_script.py``) because
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax
starts; the script writes one JSON entry per check and the tests below assert
on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from hypothesis import strategies as st_h
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import sharetree as st

SCRIPT = Path(__file__).with_name("_sharding_script.py")


def script_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the script once per test session (sharding and Orbax checks together)."""
    base = tmp_path_factory.getbasetemp()
    out = base / "sharding_script.json"
    if not out.exists():
        work = tmp_path_factory.mktemp("sharding_script")
        env = dict(
            os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
        )
        # the script imports this checkout's sharetree (not whichever one is installed)
        root = str(SCRIPT.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "all", str(work / "out.json"), str(work)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        (work / "out.json").replace(out)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return script_results(tmp_path_factory)["sharding"]


def test_eight_simulated_devices(result: dict) -> None:
    assert result["num_devices"] == 8


def test_sharding_tree_has_one_sharding_per_buffer(result: dict) -> None:
    # built with tree_map over the canonical tree: the Tied head gets no sharding of its own
    assert result["sharding_tree_keeps_tie"] is True
    assert result["num_shardings"] == 4
    assert result["shardings_by_path_equal"] is True  # st.shardings_by_path gives the same tree


def test_device_put_keeps_the_tie_and_one_buffer_per_table(result: dict) -> None:
    assert result["device_put_keeps_tie"] is True
    assert result["num_buffers"] == 4  # embed, w1, b1, w2: the head is no array
    assert result["num_tables"] == 1


def test_tied_table_is_one_buffer_sharded_across_all_devices(result: dict) -> None:
    assert result["embed_spec"] == "P(None, 'model')"
    assert result["embed_num_shards"] == 8
    assert result["embed_devices"] == 8
    assert result["embed_shard_shapes"] == [[64, 8]]  # DIM 16 split over model=2
    assert result["embed_distinct_slices"] == 2
    # 8 shards of half a table: one copy per data replica (4), not two tables (8)
    assert result["table_copies_on_devices"] == 4.0


def test_jit_arguments_hold_each_buffer_once(result: dict) -> None:
    if "argument_bytes" not in result:
        pytest.skip("this XLA backend gives no memory analysis")
    compiled_bytes, expected_bytes = result["argument_bytes"]
    assert compiled_bytes == expected_bytes


def test_gradient_equals_one_device_and_untied_sum(result: dict) -> None:
    assert result["grad_matches_untied_sum"] is True  # independent reference
    assert result["grad_head_is_tied"] is True
    assert result["loss_equal"] is True
    assert result["grads_equal"] is True
    assert result["grad_embed_spec"] == "P(None, 'model')"


def test_adam_step_equals_one_device_and_keeps_ties_and_shardings(result: dict) -> None:
    assert result["opt_state_keeps_tie"] is True
    assert result["opt_state_embed_spec"] == "P(None, 'model')"
    assert result["step_equal"] is True
    assert result["state_equal"] is True
    assert result["second_step_equal"] is True
    assert result["new_params_keep_tie"] is True
    assert result["new_num_buffers"] == 4
    assert result["new_embed_spec"] == "P(None, 'model')"


# --- st.shardings_by_path: checked in this process, on an abstract (2, 4) mesh -----------------

MESH = AbstractMesh((2, 4), ("data", "model"))
RULES = {"embed/*": P("model", None), "*/kernel": P(None, "model"), "*": P()}


def flax_like() -> dict:
    """Paths as Flax writes them: the embedding table under ``embed/embedding``."""
    return {
        "embed": {"embedding": np.zeros((64, 16), np.float32)},
        "mlp": {"kernel": np.zeros((16, 32), np.float32), "bias": np.zeros(32, np.float32)},
        "head": {"kernel": st.Tied("embed/embedding", st.T)},
        "blocks": [{"kernel": np.zeros((16, 16), np.float32)}, st.Tied("blocks/0")],
    }


def test_shardings_by_path_has_the_canonical_structure_one_sharding_per_buffer() -> None:
    params = flax_like()
    shardings = st.shardings_by_path(params, MESH, RULES)
    assert jax.tree.structure(shardings) == jax.tree.structure(params)  # Tied nodes included
    assert shardings["head"]["kernel"] == st.Tied("embed/embedding", st.T)
    assert shardings["blocks"][1] == st.Tied("blocks/0")
    assert len(jax.tree.leaves(shardings)) == 4  # embed, mlp kernel + bias, block 0
    # the reference: the specs written out by hand for each buffer
    expected = {
        "embed": {"embedding": P("model", None)},
        "mlp": {"kernel": P(None, "model"), "bias": P()},
        "head": {"kernel": st.Tied("embed/embedding", st.T)},
        "blocks": [{"kernel": P(None, "model")}, st.Tied("blocks/0")],
    }
    assert shardings == jax.tree.map(lambda s: NamedSharding(MESH, s), expected)


def test_shardings_by_path_first_match_wins_and_takes_shape_dtype_structs() -> None:
    abstract = jax.eval_shape(lambda: {"a": {"kernel": np.zeros((8, 8))}, "b": np.zeros(4)})
    s = st.shardings_by_path(abstract, MESH, [("a/kernel", P("data")), ("*", P("model"))])
    assert s["a"]["kernel"].spec == P("data") and s["b"].spec == P("model")


def test_shardings_by_path_for_optax_state_via_tree_map_params() -> None:
    import optax

    params = flax_like()
    shardings = st.shardings_by_path(params, MESH, RULES)
    opt = optax.adamw(1e-3)
    replicated = NamedSharding(MESH, P())
    state = optax.tree_map_params(
        opt,
        lambda _, s: s,
        jax.eval_shape(opt.init, params),
        shardings,
        transform_non_params=lambda _: replicated,
    )
    assert state[0].mu == shardings and state[0].nu == shardings  # ties kept, one per buffer
    assert state[0].count == replicated


def test_shardings_by_path_unmatched_leaf_names_it_unless_a_default() -> None:
    params = flax_like()
    with raises("E38", "leaf 'mlp/bias' (shape (32,))", "['embed/*', '*/kernel']", "default=P()"):
        st.shardings_by_path(params, MESH, {"embed/*": P("model"), "*/kernel": P()})
    s = st.shardings_by_path(params, MESH, {"embed/*": P("model"), "*/kernel": P()}, default=P())
    assert s["mlp"]["bias"].spec == P()


def test_shardings_by_path_unused_pattern_is_an_error_unless_not_strict() -> None:
    rules = {"embed/*": P(), "head/*": P(), "*": P()}  # head/kernel is a view: no array
    with raises("E38", "pattern 'head/*'", "'head/kernel'"):
        st.shardings_by_path(flax_like(), MESH, rules)
    st.shardings_by_path(flax_like(), MESH, rules, strict=False)


def test_shardings_by_path_unknown_mesh_axis_names_path_and_axes() -> None:
    where = "rule 'embed/*' at 'embed/embedding' (shape (64, 16))"
    with raises("E39", where, "{'data': 2, 'model': 4}", "re:tensor.*not found"):
        st.shardings_by_path(flax_like(), MESH, {"embed/*": P("tensor"), "*": P()})


def test_shardings_by_path_non_divisible_dimension_names_path_shape_axis_size() -> None:
    tree = {"w": np.zeros((6, 3), np.float32)}
    fit = "at 'w' does not fit its buffer of shape (6, 3): PartitionSpec('model',)"
    with raises("E40", fit, "{'data': 2, 'model': 4}", "re:partitioned 4 times.*size is 6"):
        st.shardings_by_path(tree, MESH, {"w": P("model")})
    with raises("E40", "re:partitioned 8 times.*size is 12"):
        st.shardings_by_path({"w": np.zeros((12,))}, MESH, {"w": P(("data", "model"))})
    st.shardings_by_path({"w": np.zeros((16,))}, MESH, {"w": P(("data", "model"))})


def test_shardings_by_path_spec_longer_than_the_array_names_path() -> None:
    with raises("E40", "at 'mlp/bias' does not fit its buffer of shape (32,)", "rank at least"):
        st.shardings_by_path(flax_like(), MESH, {"mlp/bias": P(None, "model"), "*": P()})


def test_shardings_by_path_bad_rules_and_leaves() -> None:
    with raises("E64", "rule '*'", "PartitionSpec", "found str 'model'", cls=st.TieTypeError):
        st.shardings_by_path(flax_like(), MESH, {"*": "model"})
    with raises("E64", "str patterns", "found tuple (0, ", cls=st.TieTypeError):
        st.shardings_by_path(flax_like(), MESH, [(0, P())])
    with raises("E162", "leaf 'name'", "an array", "found str 'x'", cls=st.TieTypeError):
        st.shardings_by_path({"name": "x"}, MESH, {"*": P()})


def test_shardings_by_path_rejects_what_is_not_a_mesh() -> None:
    with raises("E162", "jax.sharding.Mesh", "found list", cls=st.TieTypeError):
        st.shardings_by_path(flax_like(), jax.devices(), RULES)


AXES = {"data": 2, "model": 4}


@settings(max_examples=examples(150), deadline=None)
@given(
    shape=st_h.lists(st_h.integers(1, 12), min_size=0, max_size=3),
    entries=st_h.lists(
        st_h.sampled_from([None, "data", "model", ("data", "model"), ("model", "data")]),
        max_size=4,
    ),
)
def test_shardings_by_path_accepts_exactly_the_specs_that_fit(shape, entries) -> None:
    # the reference: a spec fits when it is no longer than the shape and each sharded
    # dimension is divisible by the product of its axes' sizes, and no axis is used twice
    spec = P(*entries)
    used = [a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    fits = len(entries) <= len(shape) and all(
        shape[d] % np.prod([AXES[a] for a in (e if isinstance(e, tuple) else (e,))]) == 0
        for d, e in enumerate(entries)
        if e is not None
    )
    fits = fits and len(used) == len(set(used))  # a mesh axis splits one dimension only
    tree = {"w": np.zeros(shape, np.float32), "head": st.Tied("w")}
    try:
        out = st.shardings_by_path(tree, MESH, {"w": spec})
    except st.TieError as e:
        assert not fits, e
        assert e.code in ("E39", "E40") and "rule 'w' at 'w'" in str(e) and "Fix:" in str(e)
    else:
        assert fits is True
        assert out["w"] == NamedSharding(MESH, spec) and out["head"] == st.Tied("w")


def test_specs_jax_rejects_on_the_mesh_name_the_path():
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    rejected = r"re:rejects (P|PartitionSpec)\(UNCONSTRAINED"
    with raises("E39", "rule '*' at 'w' (shape (2, 2))", rejected):
        st.shardings_by_path({"w": np.zeros((2, 2))}, mesh, {"*": P(P.UNCONSTRAINED)})


def test_a_view_along_an_explicitly_sharded_axis_says_to_reshard() -> None:
    code = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import sharetree as st
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
S = jax.device_put(np.zeros((4, 8, 8), np.float32), NamedSharding(mesh, P("data", None, "model")))
try:
    st.materialize({"stack": S, "layer": st.Tied("stack", st.index(2))})
except st.TieError as e:
    print(e.code, e, *getattr(e, "__notes__", ()))
# a file other tools wrote, its two copies compared on the mesh: the same error, named by load
import os, sys, tempfile, warnings
from safetensors.numpy import save_file
wte = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)  # a vocabulary padded to 12 rows
path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
save_file({"wte.weight": wte, "lm_head.weight": wte[:10].copy()}, path)
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st.load(path, ties={"lm_head.weight": st.Tied("wte.weight", st.slice(0, 10))},
                shardings={"wte.weight": NamedSharding(mesh, P(("data", "model"), None))})
except st.TieError as e:
    print("LOAD", e.code, e, *getattr(e, "__notes__", ()))
"""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    mat, load = out[: out.index("LOAD ")], out[out.index("LOAD ") :]
    assert mat.startswith("E9 [E9]") and "view 'layer'" in mat and "index(2)" in mat, out
    assert "ShardingTypeError" in mat and "jax.sharding.reshard" in mat
    assert "Fix: use a transform" not in mat  # the fix is to reshard, not another transform
    assert load.startswith("LOAD E9 [E9]") and "view 'lm_head.weight'" in load, out
    assert "ShardingTypeError" in load and "jax.sharding.reshard" in load
