"""Every script in examples/ runs as a script (tiny settings), and so do the docs' snippets.

One fresh Python process runs them all, one after the other (each example via
``runpy`` as ``__main__`` with its own ``sys.argv``), so JAX and Flax are
imported once; XLA's fast-compile mode keeps the smoke runs short (about 25 s, still:
the tests that read them are marked ``slow``).
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DOC = ROOT / "docs" / "integrations.md"

TINY = {
    "flax_tied_lm.py": [
        "--steps",
        "3",
        "--dim",
        "16",
        "--layers",
        "1",
        "--seq",
        "16",
        "--batch",
        "2",
    ],
    "equinox_tied_autoencoder.py": ["--steps", "3", "--din", "8", "--latent", "2"],
    "nnx_tied_autoencoder.py": ["--steps", "3", "--din", "8", "--latent", "2"],
    "nnx_tree_mode_stack.py": ["--steps", "3", "--din", "8", "--latent", "2", "--layers", "2"],
}

DRIVER = r"""
import re, runpy, sys, traceback
examples, doc, tiny = sys.argv[1], sys.argv[2], eval(sys.argv[3])
for name, argv in tiny.items():
    print(f"=== {name}", flush=True)
    sys.argv = [name, *argv]
    try:
        runpy.run_path(f"{examples}/{name}", run_name="__main__")
        print(f"=== {name} ok", flush=True)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
print("=== docs", flush=True)
blocks = re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)
namespace = {}
import warnings
warnings.filterwarnings("error", category=UserWarning)  # a page's examples warn about nothing
try:
    for code in blocks:  # in order, one namespace: later blocks reuse earlier names
        exec(compile(code, doc, "exec"), namespace)
    print(f"=== docs ok ({len(blocks)} blocks)", flush=True)
except BaseException:
    traceback.print_exc(file=sys.stdout)
"""


@pytest.fixture(scope="module")
def output():
    for name in ("flax", "equinox"):
        pytest.importorskip(name)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(EXAMPLES), str(DOC), repr(TINY)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sections = re.split(r"^=== ", proc.stdout, flags=re.M)
    return {s.split("\n", 1)[0]: s for s in sections if s}, proc.stdout


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(TINY)


@pytest.mark.slow  # the scripts run in one process: about 25 s
@pytest.mark.parametrize("name", sorted(TINY))
def test_example_runs(output, name):
    sections, stdout = output
    text = sections.get(name, "")
    assert f"=== {name} ok" in stdout, text[-4000:]
    match = re.search(r"final loss ([-+0-9.eE]+|nan)", text)
    assert match, text[-2000:]
    assert math.isfinite(float(match.group(1)))
    assert "1 view" in text  # the sharing graph was printed: one tie


@pytest.mark.slow
def test_integrations_doc_python_blocks_run(output):
    _, stdout = output
    assert re.search(r"=== docs ok \(([6-9]|\d\d) blocks\)", stdout), stdout[-4000:]
