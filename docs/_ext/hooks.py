"""mkdocs hooks: pages that show sharetree's own rendering, made when the site is built.

``<!-- sharetree:demo-graph -->`` in a page becomes the Jupyter HTML of the sharing
graph of the demo's model (``python -m sharetree demo``), as ``st.canonicalize``
renders it, so the page shows what the current code draws.
"""

from __future__ import annotations

from typing import Any

MARK = "<!-- sharetree:demo-graph -->"


def demo_graph_html() -> str:
    """The HTML (tables and SVG) of the sharing graph of the demo's tied model."""
    import sharetree as st
    from sharetree import _demo

    cfg = _demo.Config()
    params = _demo.init_params(0, len(set(_demo.load_corpus())), cfg)
    return st.canonicalize(params)._repr_html_()


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the marker by the demo model's sharing graph."""
    if MARK in markdown:
        markdown = markdown.replace(MARK, f'<div class="sharetree-demo">{demo_graph_html()}</div>')
    return markdown
