"""Every ```python block of docs/views.md runs as written, each in a namespace of its own.

What a block prints is the ```text block after it, as on the other pages of the site.

The blocks check their own claims against the model written by hand with the
slices in its forward code; a block that imports ``transformers`` is skipped
when transformers or PyTorch is not installed.
"""

from __future__ import annotations

import pytest
from _doc_blocks import DOCS, blocks, run_block

PAGE = "views.md"
BLOCKS = blocks(PAGE)


def test_the_page_has_its_three_recipes():
    text = (DOCS / PAGE).read_text()
    for title in ("## Padded-vocabulary head", "## Fused QKV", "## Scanned stack"):
        assert title in text
    assert len(BLOCKS) == 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_block_runs(i, tmp_path, monkeypatch):
    run_block(PAGE, i, tmp_path, monkeypatch)
