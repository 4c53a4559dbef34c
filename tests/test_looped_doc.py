"""Every ```python block of docs/looped.md runs as written, each in a namespace of its own.

What a block prints is the ```text block after it, as on the other pages of the site.

The blocks check their own claims (the shared weights stay one, the converted model at
full rank is the original, the experts move apart); the references by hand are in
tests/test_grad_by_pass.py, tests/test_blocks.py and tests/test_upcycle.py.
"""

from __future__ import annotations

import pytest
from _doc_blocks import DOCS, blocks, run_block

PAGE = "looped.md"
BLOCKS = blocks(PAGE)


def test_the_page_has_its_three_recipes():
    text = (DOCS / PAGE).read_text()
    for title in ("## Universal Transformer", "## Relaxed recursive", "## Upcycling"):
        assert title in text
    assert len(BLOCKS) == 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_block_runs(i, tmp_path, monkeypatch):
    run_block(PAGE, i, tmp_path, monkeypatch)
