import contextlib
import io
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sharetree as st
from sharetree import _demo
from sharetree.__main__ import main
from sharetree._tables import format_bytes

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
    d, c, v = cfg.d_model, cfg.context, vocab_size
    attn = 4 * (d * d + d)  # query, key, value and out: kernels and biases
    block = 2 * d + attn + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)  # ln, attn, ln, up, down
    unique = v * d + c * d + block + 2 * d  # embed, pos, one block, ln_f (the head has no bias)
    expanded = unique + (cfg.layers - 1) * block + d * v  # + tied blocks + head kernel
    return unique, expanded


def _leaf_counts(cfg):
    """(buffers, views) of the demo model, by hand: 16 arrays per block."""
    per_block = 2 + 8 + 2 + 2 + 2  # ln_attn, attn (4 kernels, 4 biases), ln_mlp, up, down
    return 2 + per_block + 2, (cfg.layers - 1) * per_block + 1  # embed, pos, ln_f; head


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
    head = rf"\(64, {vocab_size}\)\s+float32\s+{format_bytes(64 * vocab_size * 4)}$"
    assert re.search(rf"^  head/kernel\s+embed/embedding\s+T\s+{head}", out, re.M)
    block = _number(r"^  block_1\s+block_0\s+identity\s+(\d+) leaves\s+float32", out)
    assert block == [_leaf_counts(_demo.Config())[1] - 1]  # one row for the block's 16 views
    assert "block_1/up/kernel" not in out


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
    assert tree["head"]["kernel"] == st.Tied("embed/embedding", st.T)
    assert tree["block_1"] == st.Tied("block_0")
    vocab_size = len(set(_demo.load_corpus()))
    unique, _ = _param_counts(_demo.Config(), vocab_size)
    assert sum(x.size for x in jax.tree.leaves(tree)) == unique  # each buffer stored once

    code, text, err = run(["inspect", path])
    assert code == 0, err
    written = f"sharetree format 1 (written by sharetree {st.__version__})"
    assert text.splitlines()[0] == f"{path}: {os.path.getsize(path):,} bytes, {written}"
    assert text.rstrip("\n").split("\n", 1)[1] == st.summary(tree, max_rows=50)
    # the subtree tie block_1 <- block_0 is one row of each table, not one per leaf
    buffers, views = _leaf_counts(_demo.Config())
    per_block = views - 1  # every view but the head's is a leaf of block_1
    rows = [line.split() for line in text.splitlines()]
    assert ["block_1", "block_0", "identity", str(per_block), "leaves", "float32"] in [
        r[:6] for r in rows
    ]
    assert ["block_0", str(per_block), "leaves", "float32"] in [r[:4] for r in rows]
    assert not any(r and r[0].startswith(("block_0/", "block_1/")) for r in rows)
    assert f"{buffers} buffers, {views} views (from 2 ties)" in text
    code, short, _ = run(["inspect", path, "--max-rows", "1"])
    assert code == 0
    assert f"... and {buffers - per_block} more buffers" in short  # block_0's row is shown
    assert "... and 1 more views" in short  # block_1's row (16 views) shown, the head's not


def test_demo_gradient_sums_over_every_use():
    """The demo's tied model against the same linen module untied, gradients summed back."""
    cfg = _demo.Config(context=8, d_model=8, heads=2, layers=3)
    model = _demo.make_model(5, cfg)
    params = _demo.init_params(1, 5, cfg)
    assert params["head"]["kernel"] == st.Tied("embed/embedding", st.T)
    assert params["block_1"] == params["block_2"] == st.Tied("block_0")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 5, (3, 9)), jnp.int32)

    def untied_loss(m):  # the bare module on separate arrays at every position, no ties
        logits = model.module.apply({"params": m}, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    # one jit for both (XLA shares the work, so this costs one compilation)
    (value, grad), (ref_value, g) = jax.jit(
        lambda p: (
            jax.value_and_grad(_demo.loss_fn, argnums=1)(model, p, tokens),
            jax.value_and_grad(untied_loss)(st.materialize(p)),
        )
    )(params)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert grad["head"]["kernel"] == st.Tied("embed/embedding", st.T)
    assert grad["block_1"] == grad["block_2"] == st.Tied("block_0")
    assert set(g) == {"embed", "pos", "block_0", "block_1", "block_2", "ln_f", "head"}
    np.testing.assert_allclose(
        grad["embed"]["embedding"],
        g["embed"]["embedding"] + g["head"]["kernel"].T,
        rtol=1e-5,
        atol=1e-7,
    )
    # every use of the block contributes (else the sum below would prove little)
    assert min(float(optax.tree.norm(g[f"block_{i}"])) for i in range(3)) > 1e-3
    for a, b0, b1, b2 in zip(
        jax.tree.leaves(grad["block_0"]),
        jax.tree.leaves(g["block_0"]),
        jax.tree.leaves(g["block_1"]),
        jax.tree.leaves(g["block_2"]),
        strict=True,
    ):
        np.testing.assert_allclose(a, b0 + b1 + b2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad["pos"], g["pos"], rtol=1e-5, atol=1e-7)


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
        (["demo", "--steps", "0"], "--steps: must be from 1 to 2,147,483,647, got 0"),
        (["demo", "--steps", "ten"], "expected an integer, got 'ten'"),
        (["demo", "--sample", "-1"], "--sample: must be from 0 to"),
        (["demo", "--seed", "1.5"], "--seed: expected an integer, got '1.5'"),
        (["demo", "--seed", "-1"], "--seed: must be from 0 to 4,294,967,295, got -1"),
        (["demo", "--seed", str(2**63)], f"--seed: must be from 0 to 4,294,967,295, got {2**63}"),
        (["inspect", "f", "--max-rows", "1" + "0" * 30], "--max-rows: must be from 1 to"),
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


def test_demo_without_its_extra_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a)
    )
    code, out, err = run(["demo", "--steps", "1"])
    assert code == 2 and out == ""
    _one_line_error(
        err, "sharetree demo: error: the demo needs tqdm", "pip install 'sharetree[demo]'"
    )


def test_inspect_missing_and_directory(tmp_path):
    code, out, err = run(["inspect", str(tmp_path / "nope.safetensors")])
    assert code == 2 and out == ""
    _one_line_error(err, "python -m sharetree inspect: error: no such file", "nope.safetensors")
    code, out, err = run(["inspect", str(tmp_path)])  # a directory that holds no checkpoint
    assert code == 2
    _one_line_error(err, "E47", "holds neither", "model.safetensors")


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


def test_inspect_names_an_fn_view_without_importing_or_calling_it(tmp_path):
    # the file names jax.numpy:flipud: inspect shows it and the view's shape as unknown
    path = tmp_path / "fn.safetensors"
    st.save(path, {"emb": np.ones((3, 2), np.float32), "head": st.Tied("emb", st.fn(jnp.flipud))})
    code, out, err = run(["inspect", str(path)])
    assert code == 0 and err == "", err
    assert re.search(r"head  emb     fn\(jax\.numpy:flipud\)  static  -", out), out
    assert "1 view(s) use st.fn functions" in out


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
    assert first.startswith(f"{path}: {os.path.getsize(path):,} bytes, sharetree format 1")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "Exception ignored" not in err, err
    assert code == 141, (code, err)


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "FILE"]])
def test_a_process_started_with_stdout_closed_has_no_traceback(tmp_path, argv):
    """``python -m sharetree ... >&-``: Python sets ``sys.stdout`` to None; nothing breaks."""
    path = tmp_path / "m.safetensors"
    st.save(path, {"emb": np.ones((3, 2), np.float32), "head": st.Tied("emb", st.T)})
    argv = [str(path) if a == "FILE" else a for a in argv]
    proc = subprocess.run(
        ["sh", "-c", 'exec "$0" -m sharetree "$@" >&-', sys.executable, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    if argv == ["--help"]:  # argparse writes help to stderr when there is no stdout
        assert proc.stderr.startswith("usage: python -m sharetree")
    else:
        assert proc.stderr == ""


def test_other_errors_are_not_taken_for_a_closed_stdout(monkeypatch):
    import sharetree.__main__ as cli

    def broken(parser, args):
        raise ValueError("a bug, not a closed stdout")

    monkeypatch.setattr(cli, "_inspect", broken)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["inspect", "x"])


# --------------------------------------------------------------------------- untrusted files


def _inspect_subprocess(path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "sharetree", "inspect", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_inspect_of_a_pipe_does_not_block(tmp_path):
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)  # a read would wait for a writer forever
    done = _inspect_subprocess(fifo)
    assert done.returncode == 2 and done.stdout == ""
    _one_line_error(done.stderr, "is not a regular file", "fifo.safetensors")


def test_inspect_escapes_control_characters_of_the_file(tmp_path):
    path = tmp_path / "evil.safetensors"
    forged = "n\nsharing graph: 0 buffers, 0 views"  # a newline must not forge a line
    tree = {"\x1b[2Jw": np.ones(2, np.float32), "v\x07": st.Tied("\x1b[2Jw"), forged: np.ones(3)}
    st.save(path, tree)
    done = _inspect_subprocess(path)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "\\x1b[2Jw" in done.stdout and "v\\x07" in done.stdout
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("sharing graph")] == [
        "sharing graph: 2 buffers, 1 view"
    ]
    assert any(line.startswith("  n\\nsharing graph: 0 buffers") for line in lines)
