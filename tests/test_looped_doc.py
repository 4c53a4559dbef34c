"""Every ```python block of docs/looped.md runs as written, each in a namespace of its own.

What a block prints is the ```text block after it, as on the other pages of the site.

The blocks check their own claims (the shared weights stay one, the converted model at
full rank is the original, the experts move apart); the references by hand are in
tests/test_grad_by_pass.py, tests/test_blocks.py and tests/test_upcycle.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "looped.md"
# each ```python block, and the ```text block that shows what it prints (if any)
BLOCKS = re.findall(
    r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```$)?", DOC.read_text(), re.S | re.M
)


def test_the_page_has_its_three_recipes():
    text = DOC.read_text()
    for title in ("## Universal Transformer", "## Relaxed recursive", "## Upcycling"):
        assert title in text
    assert len(BLOCKS) == 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_block_runs(i, tmp_path, monkeypatch):
    code, shown = BLOCKS[i]
    if re.search(r"^import .*\btransformers\b", code, re.M) and not all(
        importlib.util.find_spec(m) for m in ("torch", "transformers")
    ):
        pytest.skip("needs torch and transformers")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile.mkdtemp lands in pytest's tmp dir
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{DOC} (python block {i})", "exec"), {"__name__": "__main__"})
    if "print(" in code:
        assert out.getvalue() == shown, f"docs/looped.md block {i}: the text after it is stale"
