"""Smoke test of the benchmark suite at tiny size: correctness only, never a time.

``run_suite`` asserts, before timing anything, that every method gives the
same values and gradients (sharetree, ravel_pytree, the plain-tree floor,
equinox.nn.Shared, Flax NNX, the transformer LM tied by hand); this test runs
it once at tiny size and checks what it reports. That run takes about 40 s: the tests
that read it are marked ``slow`` (the quick run skips them, ``--full`` and CI run them).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("equinox")
pytest.importorskip("flax")
pytest.importorskip("optax")

from benchmarks import models as M  # noqa: E402
from benchmarks import quantized, several, suite, views  # noqa: E402
from benchmarks import run as bench  # noqa: E402

SIZE = 16  # materialized leaves: 8 layers, 2 of them tied
EAGER = 40


@pytest.fixture(scope="module")
def results() -> dict:
    return bench.run_suite((SIZE,), eager_tree_sizes=(EAGER,), quick=True, log=None)


def _checks(results: dict, section: str) -> list[dict]:
    return [c for s in results["sections"] if s["name"] == section for c in s["checks"]]


@pytest.mark.slow
def test_every_section_ran_and_every_check_passed(results):
    names = {s["name"] for s in results["sections"]}
    assert names == {
        "eager flatten",
        "jit(grad)",
        "bytes",
        "vmap",
        "eager tree ops",
        "design: distinct kernels",
        "transformer LM",
        "hot path",
        "views",
    }
    # every check is asserted as it is made (a failed one raises, see the next test), so
    # what is left to check is that each section made the checks it should have
    checks = {s["name"]: {c["check"] for c in s["checks"]} for s in results["sections"]}
    for section in ("eager flatten", "jit(grad)", "bytes", "vmap", "eager tree ops"):
        assert checks[section], f"section {section!r} checked nothing"
    assert len(checks["jit(grad)"]) >= 2 * 6  # loss and gradient of every method


@pytest.mark.slow
def test_partial_and_whole_buffer_views_agree_with_the_views_by_hand(results):
    checks = {c["check"] for c in _checks(results, "views")}
    for model in ("partial views (slice, index)", "whole-buffer views (T)"):
        for method in (views.ST, views.RAVEL):
            assert f"{model}: {method}: gradient == floor's" in checks
        for measure in ("jvp", "hvp", "vmap"):
            assert f"{model}: {measure}: sharetree == ravel_pytree" in checks
    targets = {t["target"] for t in results["targets"] if t.get("label") == "views"}
    assert "views (partial): hvp: sharetree / ravel_pytree" in targets
    assert "views: sharetree/ravel_pytree hvp: partial / whole-buffer views" in targets


@pytest.mark.slow
def test_views_of_several_buffers_agree_with_the_models_by_hand():
    # LoRA on a tied LM and shared blocks for a scanned stack, each against the same model
    # written by hand: every check is asserted as it is made (a failed one raises), so
    # what is left to check is that each model made every check
    sec = several.several_section(several.LMDims.quick(), several.StackDims.quick(), 1, 2)
    checks = {c["check"] for c in sec.checks}
    assert all(c["ok"] for c in sec.checks)
    for model in (several.LM_NAME, several.STACK_NAME):
        for method in (several.ST_TREE, several.RAVEL, several.ST_FLAT):
            assert f"{model}: {method}: gradient == by hand" in checks
            assert f"{model}: forward dot_generals: {method} == by hand" in checks
    dots = sec.info[several.LM_NAME]["forward dot_generals"]
    layers = several.LMDims.quick().layers
    assert dots[several.ST_TREE] == 1 + 8 * layers + 1  # a @ b once, 8 per layer, the head


def test_quantized_ties_agree_by_hand_and_the_lookup_makes_no_float_table():
    # the packed lookup and head against the same computation written by hand (asserted as
    # they are made), then the compiler's own memory figures: a lookup from the packed table
    # allocates nothing the size of the table (XLA fuses the unpacking into the gather)
    dims = quantized.Dims.quick()
    sec = quantized.quantized_section(dims)
    assert len(sec.checks) == 3 and all(c["ok"] for c in sec.checks)
    memory = sec.info["compiled memory"]
    table = dims.vocab * dims.width * 4
    assert memory["lookup"][quantized.PACKED]["temp_bytes"] < table // 16
    assert memory["head"][quantized.PACKED]["temp_bytes"] >= table  # the float table, once
    sizes = sec.info["checkpoint bytes"]
    assert sizes[quantized.PACKED] < sizes[quantized.FLOAT] / 5


def test_a_table_computed_once_per_view_fails_the_product_count(monkeypatch):
    # the count must catch a forward program that computes the adapted table once per view
    # (here the hand model's; sharetree's is then one product short of it)
    real = several.lm_case

    def twice(dims):
        case = real(dims)
        hand = case.by_hand

        def by_hand(u):
            f = u["lora"]["embed"]
            return {**hand(u), "head": (f["base"] + dims.scale * (f["a"] @ f["b"])).T}

        case.by_hand = by_hand
        return case

    monkeypatch.setattr(several, "lm_case", twice)
    with pytest.raises(AssertionError, match="forward dot_generals"):
        several.several_section(several.LMDims.quick(), several.StackDims.quick(), 1, 1)


def test_dot_generals_counts_a_nested_jit_at_each_call():
    # a nested jit is one private function in the text, run at each of its calls
    mm = jax.jit(jnp.matmul)
    x = jnp.ones((3, 3))
    text = jax.jit(lambda a: mm(a, a) + mm(a, a.T)).lower(x).as_text()
    assert text.count("stablehlo.dot_general") == 1
    assert several.dot_generals(text) == 2


def test_a_method_with_a_wrong_gradient_fails_the_suite(monkeypatch):
    # the suite's own check must catch a method whose loss is right and gradient wrong
    real = suite._methods

    def with_a_wrong_gradient(model):
        methods = real(model)
        m = methods[suite.ST_FLAT]
        loss = m.loss
        m.loss = lambda v, x: loss(v, x) + 1e-2 * jnp.sum(v - jax.lax.stop_gradient(v))
        return methods

    monkeypatch.setattr(suite, "_methods", with_a_wrong_gradient)
    with pytest.raises(AssertionError, match=r"restructure \(closed over\): gradient == floor's"):
        suite.grad_compile_run(M.make_model(SIZE), 1, 1, methods=[suite.ST_FLAT])


@pytest.mark.slow
def test_all_peers_agree_on_loss_and_gradient(results):
    checks = {c["check"] for c in _checks(results, "jit(grad)")}
    for method in (
        suite.ST_FLAT,
        suite.ST_ARG,
        "sharetree: loss . materialize (tree)",
        "ravel_pytree: loss . unravel (views by hand)",
        "eqx.nn.Shared + ravel_pytree",
        "nnx split/merge, shared Param",
    ):
        assert f"{method}: loss == floor's" in checks
        assert f"{method}: gradient == floor's" in checks
    methods = {r["method"] for r in results["rows"] if r["measure"] == "compile"}
    assert "floor: jit(grad(loss)) on the tree" in methods


@pytest.mark.slow
def test_restructure_gradient_is_one_concatenate(results):
    # The cotangent of restructure is one concatenate over the unique buffers: no
    # per-leaf pad (the quadratic pad-and-add backward) and no dynamic-update-slice.
    # Under jit on CPU the vector is cut by dynamic slices at offsets XLA cannot
    # fold (closed over or passed as an argument: the same program).
    (info,) = [s["info"] for s in results["sections"] if s["name"] == "jit(grad)"]
    ops = info["optimized HLO opcodes"]
    n_tied = sum(M.is_tied_layer(i) for i in range(M.num_layers(SIZE)))
    for method in (suite.ST_FLAT, suite.ST_ARG):
        assert ops[method].get("concatenate") == 1
        assert ops[method].get("pad", 0) == 0 and ops[method].get("dynamic-update-slice", 0) == 0
        assert ops[method].get("dynamic-slice") == SIZE - n_tied  # one per buffer, none per view
        assert ops[method].get("slice", 0) <= 1  # only the cond predicate's 1-element read
        assert ops[method].get("dot") == ops[suite.FLOOR]["dot"]
    assert ops[suite.ST_FLAT] == ops[suite.ST_ARG]


@pytest.mark.slow
def test_bytes_equal_unique_bytes(results):
    (info,) = [s["info"] for s in results["sections"] if s["name"] == "bytes"]
    n_tied = sum(M.is_tied_layer(i) for i in range(M.num_layers(SIZE)))
    per_w, per_b = M.D * M.D * 4, M.D * 4
    unique = (SIZE // 2 - n_tied) * per_w + SIZE // 2 * per_b
    assert info["nbytes_unique"] == unique
    assert info["nbytes_expanded"] == unique + n_tied * per_w
    for key in ("gradient (canonical tree)", "gradient (flat vector)", "Adam mu", "Adam nu"):
        assert info[f"nbytes {key}"] == unique
    assert info["num_unique"] == SIZE - n_tied and info["num_expanded"] == SIZE


@pytest.mark.slow
def test_lm_and_report(results, tmp_path):
    (lm,) = [s for s in results["sections"] if s["name"] == "transformer LM"]
    assert lm["checks"] and lm["checks"][0]["ok"]
    assert lm["info"]["nbytes_unique"] < lm["info"]["nbytes_expanded"]
    # Targets are recorded (values are times: not asserted); the report and JSON render.
    kinds = {t["target"]: t["kind"] for t in results["targets"]}
    assert kinds["LM step run: sharetree / by hand"] == "target"
    assert kinds["eager destructure: ravel_pytree / sharetree (speed-up)"] == "info"
    text = bench.format_report(results)
    assert "| leaves | target | measured | goal | met |" in text and "sharetree" in text
    out = bench.save(results, tmp_path / "r.json")
    loaded = json.loads(out.read_text())
    assert loaded["machine"]["cores"] >= 1 and loaded["machine"]["versions"]["jax"]


def test_cli_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "7", "--no-save"])
    assert "even and >= 8" in capsys.readouterr().err


def test_default_results_path_never_overwrites(tmp_path):
    now = datetime.datetime(2026, 12, 1, 9, 5)
    first = bench.default_path(tmp_path, now)
    assert first.name == "2026-12-01.json"
    bench.save({"run": 1}, first)
    second = bench.default_path(tmp_path, now)
    assert second.name == "2026-12-01-0905.json"
    bench.save({"run": 2}, second)
    assert bench.default_path(tmp_path, now).name == "2026-12-01-0905-2.json"
    assert json.loads(first.read_text()) == {"run": 1}  # the first run is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-12-01-0905.json", "2026-12-01.json"]


@pytest.mark.slow
def test_flat_sharded_benchmark_checks_hold_at_tiny_size(tmp_path):
    """``benchmarks.flat_sharded --quick`` on 8 simulated devices (a subprocess): its checks."""
    import os
    import subprocess

    out = tmp_path / "flat.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "benchmarks.flat_sharded", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    facts = result["flat_sharded"]
    assert facts["devices"] == 8 and result["machine"]["backend"] == "cpu"
    assert all(facts["checks"].values()), facts["checks"]
    # the tree sharded over every device but one replicated bias: one gather more, no other
    tree, flat = facts["collectives"]["tree"], facts["collectives"]["flat"]
    assert flat.get("all-gather", 0) <= tree.get("all-gather", 0) + 1
    assert flat.get("all-reduce", 0) <= tree.get("all-reduce", 0)


def test_looped_benchmark_checks_its_gradients_and_records_the_machine(tmp_path):
    from benchmarks import looped

    out = tmp_path / "looped.json"
    assert looped.main(["--quick", "--out", str(out)]) == 0  # every check passed
    saved = json.loads(out.read_text())
    assert saved["machine"]["versions"]["jax"] and saved["machine"]["device"]
    assert all(saved["checks"].values()) and len(saved["checks"]) == 4
    methods = {r["method"] for r in saved["rows"]}
    assert {"st.grad_by_use (per pass)", looped.LOOPED} <= methods
    assert {t["target"] for t in saved["targets"]} == {
        "tree: looped / by hand <= 1.05",
        "flat: looped / by hand <= 1.05",
    }
