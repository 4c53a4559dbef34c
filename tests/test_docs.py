"""Every ```python block of docs/saving_and_scaling.md runs as written.

Each block is a complete program: one fresh Python process (8 simulated CPU
devices, because ``XLA_FLAGS`` must be set before JAX starts) runs the blocks
one after the other, each in a namespace of its own, so a block that leans on
a name from an earlier block fails here. The process runs in a temporary
directory (also its ``TMPDIR``), so no block can litter the repository or /tmp.
The blocks assert their own claims (the ties survive, each buffer is stored
once, the shardings are kept); this test checks that every block ran to the end.
A block that imports ``transformers`` (the ``hf`` extra) is skipped when
transformers or PyTorch is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "saving_and_scaling.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)

DRIVER = r"""
import re, sys, traceback
doc = sys.argv[1]
import jax
print(f"=== devices {jax.device_count()}", flush=True)
blocks = re.findall(r"^```python\n(.*?)^```$", open(doc).read(), re.S | re.M)
import importlib.util
hf = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
for i, code in enumerate(blocks):
    if "import transformers" in code and not hf:
        print(f"=== block {i} skipped (needs torch and transformers)", flush=True)
        continue
    try:
        exec(compile(code, f"{doc} (python block {i})", "exec"), {"__name__": "__main__"})
        print(f"=== block {i} ok", flush=True)
    except BaseException:
        print(f"=== block {i} failed", flush=True)
        traceback.print_exc(file=sys.stdout)
"""


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("orbax.checkpoint")
    pytest.importorskip("optax")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # 8 devices; level 0 = XLA's fast compile: the blocks are correctness smoke runs
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    work = tmp_path_factory.mktemp("docs")
    env["TMPDIR"] = str(work)  # the blocks' tempfile directories land in pytest's tmp dir
    # the blocks import this checkout's sharetree (they run in a temporary directory)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(DOC.parent.parent), env.get("PYTHONPATH")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(DOC)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=work,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_the_page_has_its_blocks() -> None:
    # save/load, find_ties, tie by hand, Hugging Face with and without torch, MLX quantized,
    # Orbax, sharding (the multi-host sketch is ```text)
    assert len(BLOCKS) == 8
    assert all("import sharetree as st" in code for code in BLOCKS)  # each block stands alone
    assert "jax.distributed.initialize()" in DOC.read_text()
    assert "jax.distributed.initialize()" not in "".join(BLOCKS)


def test_eight_simulated_devices(output: str) -> None:
    assert "=== devices 8\n" in output, output[-2000:]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(output: str, index: int) -> None:
    sections = {s.split("\n", 1)[0]: s for s in re.split(r"^=== ", output, flags=re.M) if s}
    if f"block {index} skipped (needs torch and transformers)" in sections:
        pytest.skip("this block needs torch and transformers (the hf extra)")
    assert f"block {index} ok" in sections, sections.get(f"block {index} failed", output)[-4000:]
