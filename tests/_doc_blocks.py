"""The ```python blocks of a docs page and the ```text block that shows what each prints.

Shared by the tests of the recipe pages (``test_views_doc``, ``test_looped_doc``): each
block runs as written in a namespace of its own, its temporary files in pytest's
directory; a block that imports ``transformers`` is skipped where transformers or PyTorch
is not installed; where a block prints, the text after it must be what it printed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import tempfile
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def blocks(page: str) -> list[tuple[str, str]]:
    """``(code, shown)`` of every ```python block of ``docs/<page>`` (shown may be '')."""
    text = (DOCS / page).read_text()
    return re.findall(r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```$)?", text, re.S | re.M)


def run_block(page: str, i: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run block ``i`` of ``docs/<page>`` and check the text shown after it."""
    code, shown = blocks(page)[i]
    if re.search(r"^import .*\btransformers\b", code, re.M) and not all(
        importlib.util.find_spec(m) for m in ("torch", "transformers")
    ):
        pytest.skip("needs torch and transformers")
    if "nnx.set_graph_mode" in code and not _has_tree_mode():
        pytest.skip("NNX tree mode (nnx.set_graph_mode) needs flax >= 0.12.6")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile.mkdtemp lands in pytest's tmp dir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        name = f"{DOCS / page} (python block {i})"
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    if "print(" in code:
        assert out.getvalue() == shown, f"docs/{page} block {i}: the text after it is stale"


def _has_tree_mode() -> bool:
    from flax import nnx

    return hasattr(nnx, "set_graph_mode")
