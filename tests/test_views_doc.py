"""Every ```python block of docs/views.md runs as written, each in a namespace of its own.

What a block prints is the ```text block after it, as on the other pages of the site.

The blocks check their own claims against the model written by hand with the
slices in its forward code; a block that imports ``transformers`` is skipped
when transformers or PyTorch is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "views.md"
# each ```python block, and the ```text block that shows what it prints (if any)
BLOCKS = re.findall(
    r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```$)?", DOC.read_text(), re.S | re.M
)


def test_the_page_has_its_three_recipes():
    text = DOC.read_text()
    for title in ("## Padded-vocabulary head", "## Fused QKV", "## Scanned stack"):
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
        assert out.getvalue() == shown, f"docs/views.md block {i}: the text after it is stale"
