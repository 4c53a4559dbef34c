import contextlib
import io
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharetree as st
from sharetree import _demo
from sharetree.__main__ import main

STEPS = 25


def run(argv):
    """Run the command line in-process; return (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo") / "model.safetensors")
    code, out, err = run(["demo", "--steps", str(STEPS), "--sample", "40", "--out", path])
    return code, out, err, path


def _number(pattern, text):
    m = re.search(pattern, text, re.M)
    assert m is not None, f"{pattern!r} not in:\n{text}"
    return [int(g.replace(",", "")) if re.fullmatch(r"[\d,]+", g) else g for g in m.groups()]


def _param_counts(cfg, vocab_size):
    """Parameter counts of the demo model derived from its architecture, by hand."""
    d, f, c, v = cfg.d_model, cfg.d_ff, cfg.context, vocab_size
    block = 2 * d + d * 3 * d + d * d + 2 * d + d * f + f + f * d + d  # ln1, attn, ln2, mlp
    unique = v * d + c * d + block + 2 * d + v  # embed, one block, ln_f, head bias
    expanded = unique + (cfg.n_blocks - 1) * block + d * v  # + tied blocks + head kernel
    return unique, expanded


# --------------------------------------------------------------------------- demo


def test_demo_trains_and_reports(demo_run):
    code, out, err, _ = demo_run
    assert code == 0, err
    assert "Traceback" not in err
    first, last = (float(x) for x in _number(r"held-out loss ([\d.]+) -> ([\d.]+) nats/char", out))
    assert first == pytest.approx(np.log(59), abs=0.15)  # uniform over the 59 characters at init
    assert last < first - 0.6, out  # a clear decrease after 25 steps
    assert f"after {STEPS} steps" in out
    # the tqdm progress bar, with the loss, on stderr
    assert "training" in err and "loss=" in err and f"{STEPS}/{STEPS}" in err


def test_demo_sharing_summary_matches_the_architecture(demo_run):
    code, out, _, _ = demo_run
    assert code == 0
    vocab_size = len(set(_demo.load_corpus()))
    unique, expanded = _param_counts(_demo.Config(), vocab_size)
    assert _number(r"^  params\s+([\d,]+)\s+([\d,]+)", out) == [unique, expanded]
    saved = expanded - unique
    assert f"sharing saves {saved:,} parameters ({100 * saved / expanded:.1f}%)" in out
    assert f"Adam holds {2 * unique:,} floats (2 per unique parameter), not {2 * expanded:,}" in out
    assert re.search(r"^  head/kernel\s+embed/tokens\s+T\s+\(64, 59\)\s+float32$", out, re.M)
    assert re.search(r"^  blocks/1/mlp/w1\s+blocks/0/mlp/w1\s+identity", out, re.M)


def test_demo_prints_a_sample(demo_run):
    _, out, _, _ = demo_run
    sample = out.split("sample (temperature 0.8):\n")[1].split("\n\ncheckpoint")[0]
    text = "\n".join(line[2:] for line in sample.splitlines())
    assert text.startswith("The well ")
    assert len(text) == len("The well ") + 40
    assert set(text) <= set(_demo.load_corpus())


def test_demo_checkpoint_keeps_the_ties_and_inspect_shows_them(demo_run):
    code, out, _, path = demo_run
    assert code == 0 and os.path.exists(path)
    assert f"checkpoint: {path}" in out
    tree = st.load(path)
    assert tree["head"]["kernel"] == st.Tied("embed/tokens", st.T)
    assert tree["blocks"][1] == st.Tied("blocks/0")
    vocab_size = len(set(_demo.load_corpus()))
    unique, _ = _param_counts(_demo.Config(), vocab_size)
    assert sum(x.size for x in jax.tree.leaves(tree)) == unique  # each buffer stored once

    code, text, err = run(["inspect", path])
    assert code == 0, err
    assert text.splitlines()[0] == f"{path}: {os.path.getsize(path):,} bytes"
    assert text.rstrip("\n").split("\n", 1)[1] == st.summary(tree, max_rows=50)
    code, short, _ = run(["inspect", path, "--max-rows", "3"])
    assert code == 0 and "... and 12 more buffers" in short and "... and 8 more views" in short


def test_demo_gradient_sums_over_every_use():
    """The demo's tied model against the same model untied by hand, gradients summed back."""
    cfg = _demo.Config(context=8, d_model=8, n_heads=2, d_ff=16, n_blocks=2)
    params = jax.device_put(_demo.init_params(1, 5, cfg))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 5, (3, 9)), jnp.int32)

    def untied_loss(m):  # the same loss on separate arrays at every position, no ties
        logp = jax.nn.log_softmax(_demo.forward(m, tokens[:, :-1], cfg.n_heads))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    # one jit for both (XLA shares the work, so this costs one compilation)
    grad, g = jax.jit(
        lambda p: (
            jax.grad(_demo.loss_fn)(p, tokens, cfg.n_heads),
            jax.grad(untied_loss)(st.materialize(p)),
        )
    )(params)
    assert grad["head"]["kernel"] == st.Tied("embed/tokens", st.T)
    assert grad["blocks"][1] == st.Tied("blocks/0")
    np.testing.assert_allclose(
        grad["embed"]["tokens"], g["embed"]["tokens"] + g["head"]["kernel"].T, rtol=1e-5, atol=1e-7
    )
    for a, b0, b1 in zip(
        jax.tree.leaves(grad["blocks"][0]),
        jax.tree.leaves(g["blocks"][0]),
        jax.tree.leaves(g["blocks"][1]),
        strict=True,
    ):
        np.testing.assert_allclose(a, b0 + b1, rtol=1e-5, atol=1e-7)


def test_vocab():
    vocab = _demo.Vocab("abcab c")
    assert vocab.chars == " abc" and len(vocab) == 4
    assert vocab.decode(vocab.encode("cab a")) == "cab a"
    assert vocab.encode("xyz").size == 0


# --------------------------------------------------------------------------- help and errors


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["inspect", "-h"]])
def test_help(argv):
    code, out, err = run(argv)
    assert code == 0 and err == ""
    assert out.startswith("usage: python -m sharetree")
    if argv[0] == "demo":
        assert "--steps N" in out and "--out FILE" in out and "--seed S" in out
    if argv[0] == "inspect":
        assert "FILE" in out and "--max-rows N" in out


def _one_line_error(err, *needles):
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m sharetree") and ": error: " in lines[0]
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "required"),
        (["train"], "invalid choice: 'train'"),
        (["demo", "--steps", "0"], "--steps: must be at least 1, got 0"),
        (["demo", "--steps", "ten"], "expected an integer, got 'ten'"),
        (["demo", "--sample", "-1"], "--sample: must be at least 0"),
        (["demo", "--seed", "1.5"], "--seed: expected an integer, got '1.5'"),
        (["demo", "--seed", "-1"], "--seed: must be at least 0, got -1"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["inspect"], "FILE"),
        (["inspect", "a", "b"], "unrecognized arguments: b"),
    ],
)
def test_bad_arguments(argv, needle):
    code, out, err = run(argv)
    assert code == 2 and out == ""
    _one_line_error(err, needle)


def test_demo_rejects_a_bad_out_before_training(tmp_path):
    code, out, err = run(["demo", "--out", str(tmp_path / "missing" / "m.safetensors")])
    assert code == 2 and out == ""
    _one_line_error(err, "does not exist")
    code, out, err = run(["demo", "--out", str(tmp_path)])
    assert code == 2 and out == ""
    _one_line_error(err, "is a directory")


def test_inspect_missing_and_directory(tmp_path):
    code, out, err = run(["inspect", str(tmp_path / "nope.safetensors")])
    assert code == 2 and out == ""
    _one_line_error(err, "no such file", "nope.safetensors")
    code, out, err = run(["inspect", str(tmp_path)])
    assert code == 2
    _one_line_error(err, "is a directory")


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "bad-json"])
def test_inspect_damaged_files(tmp_path, damage):
    good = tmp_path / "good.safetensors"
    st.save(good, {"emb": np.ones((3, 2), np.float32), "head": st.Tied("emb", st.T)})
    path = tmp_path / f"{damage}.safetensors"
    data = good.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"this is not a checkpoint\n" * 10)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) - 7])
    else:  # a valid header length followed by broken JSON
        n = int.from_bytes(data[:8], "little")
        path.write_bytes(data[:8] + b"{" * n + data[8 + n :])
    code, out, err = run(["inspect", str(path)])
    assert code == 2 and out == ""
    _one_line_error(err, "cannot read", path.name)
    # the intact file still inspects fine
    code, out, _ = run(["inspect", str(good)])
    assert code == 0 and "head  emb     T" in out


def test_module_entry_point_exit_codes(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    ok = subprocess.run(
        [sys.executable, "-m", "sharetree", "--help"], capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0 and "demo" in ok.stdout and "inspect" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "sharetree", "inspect", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    _one_line_error(bad.stderr, "no such file")


# --------------------------------------------------------------------------- stdout that goes away


def test_inspect_into_a_reader_that_closes_early(tmp_path):
    """``python -m sharetree inspect FILE | head -1``: no traceback, exit code 141 (as SIGPIPE)."""
    # Long paths and many ties: the output (~140 KB) is far more than a pipe holds (64 KiB on
    # Linux), so the command is still writing when the reader has gone, buffered or not.
    long = "a_rather_long_module_name_" * 5
    tree = {f"{long}{i}": {"w": np.zeros((2,), np.float32)} for i in range(600)}
    for i in range(0, 600, 2):
        tree[f"{long}{i + 1}"]["w"] = st.Tied(f"{long}{i}/w", st.scale(2.0))
    path = tmp_path / "many.safetensors"
    st.save(path, tree)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["JAX_PLATFORMS"] = "cpu"
    argv = [sys.executable, "-m", "sharetree", "inspect", str(path), "--max-rows", "1000"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline().decode()
    proc.stdout.close()  # the reader leaves after one line, as `head -1` does
    err = proc.stderr.read().decode()
    proc.stderr.close()
    code = proc.wait(timeout=60)
    assert first == f"{path}: {os.path.getsize(path):,} bytes\n"
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "Exception ignored" not in err, err
    assert code == 141, (code, err)


def test_closed_stdout_stops_quietly():
    out, err = io.StringIO(), io.StringIO()
    out.close()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--help"])
    assert code == 141 and err.getvalue() == ""


def test_other_errors_are_not_taken_for_a_closed_stdout(monkeypatch):
    import sharetree.__main__ as cli

    def broken(args):
        raise ValueError("a bug, not a closed stdout")

    monkeypatch.setattr(cli, "_inspect", broken)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["inspect", "x"])
