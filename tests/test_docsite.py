"""The documentation site's sources (mkdocs.yml, docs/): checks that need no mkdocs install.

The strict build itself (`mkdocs build --strict`, which runs the notebooks) is CI's
package job. Here: every public name has its entry in the API reference, every page
is in the navigation and every navigation entry is a file, every README section
the pages include is marked, and the Python blocks of the pages written for the site
run as written (their text outputs are what the code prints).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import tomllib
from pathlib import Path

import pytest

import sharetree
import sharetree.equinox
import sharetree.flax
import sharetree.nnx

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG = (ROOT / "mkdocs.yml").read_text()
# pages whose ```python blocks are tested elsewhere: integrations.md by test_examples.py,
# saving_and_scaling.md by test_docs.py, views.md by test_views_doc.py, looped.md by
# test_looped_doc.py; README sections by test_readme.py
TESTED_ELSEWHERE = {"integrations.md", "saving_and_scaling.md", "views.md", "looped.md"}


def _api_entries() -> list[str]:
    return re.findall(r"^::: ([\w.]+)\s*$", "".join(
        p.read_text() for p in sorted((DOCS / "api").glob("*.md"))), re.M)  # fmt: skip


def _public_names() -> list[str]:
    return (
        [f"sharetree.{n}" for n in sharetree.__all__]
        + [f"sharetree.flax.{n}" for n in sharetree.flax.__all__]
        + [f"sharetree.nnx.{n}" for n in sharetree.nnx.__all__]
        + [f"sharetree.equinox.{n}" for n in sharetree.equinox.__all__]
    )


def test_every_public_name_has_an_api_entry():
    entries = _api_entries()
    missing = [n for n in _public_names() if n not in entries]
    assert not missing, f"add a '::: NAME' line to docs/api/*.md for: {missing}"
    assert len(entries) == len(set(entries)), "an API entry is listed twice"


def test_every_api_entry_names_a_public_object():
    public = set(_public_names())
    extra = [e for e in _api_entries() if e not in public]
    assert not extra, f"docs/api/*.md documents names that are not public: {extra}"


def _nav_files() -> list[str]:
    nav = CONFIG.split("\nnav:\n", 1)[1]
    return re.findall(r"^\s+- (?:.+: )?([\w/.-]+\.(?:md|ipynb))\s*$", nav, re.M)


def test_navigation_and_pages_agree():
    nav = _nav_files()
    assert len(nav) == len(set(nav))
    assert [p for p in nav if not (DOCS / p).is_file()] == []
    pages = sorted(
        str(p.relative_to(DOCS))
        for p in DOCS.rglob("*.md")
        if not any(part.startswith("_") for part in p.relative_to(DOCS).parts)
    )
    assert [p for p in pages if p not in nav] == [], "add these pages to mkdocs.yml's nav"
    notebooks = sorted(f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks and [n for n in notebooks if n not in nav] == []
    assert {"index.md", "changelog.md", "benchmarks.md", "errors.md"} <= set(nav)


def test_included_sections_are_marked_in_their_files():
    includes = re.findall(r'^--8<-- "([^"]+)"\s*$', "".join(
        p.read_text() for p in DOCS.rglob("*.md")), re.M)  # fmt: skip
    assert "CHANGELOG.md" in includes and "benchmarks/README.md" in includes  # not copied
    for inc in includes:
        path, _, section = inc.partition(":")
        text = (ROOT / path).read_text()
        if section:
            start, end = f"<!-- --8<-- [start:{section}] -->", f"<!-- --8<-- [end:{section}] -->"
            assert text.count(start) == 1 and text.count(end) == 1, (path, section)
            assert text.index(start) < text.index(end)
    tour = (ROOT / "README.md").read_text().split("[start:tour] -->")[1].split("<!--")[0]
    assert "st.destructure(params)" in tour  # the overview page includes the whole tour


def test_the_docs_extra_installs_what_the_config_uses():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[\[<>=]", r)[0] for r in extras["docs"]}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocs-jupyter"} <= names
    assert "name: material" in CONFIG and "- mkdocstrings:" in CONFIG
    assert "- mkdocs-jupyter:" in CONFIG and "execute: !ENV [DOCS_EXECUTE, true]" in CONFIG
    readme = (ROOT / "README.md").read_text()
    assert 'python -m pip install -e ".[docs]" && mkdocs build --strict' in readme


SITE_PAGES = sorted(
    p.name for p in DOCS.glob("*.md") if p.name not in TESTED_ELSEWHERE and "```python" in
    p.read_text()
)  # fmt: skip


@pytest.mark.parametrize("page", SITE_PAGES)
def test_python_blocks_of_the_page_run_and_print_what_is_shown(page):
    text = (DOCS / page).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```$)?", text, re.S | re.M)
    assert blocks
    for code, shown in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/{page}", "exec"), {"__name__": "__main__"})
        if "print(" in code:
            assert out.getvalue() == shown, f"docs/{page}: the text after the block is stale"


def test_the_pages_with_code_are_the_ones_written_for_the_site():
    assert set(SITE_PAGES) >= {
        "why_ties_as_data.md", "ties_and_transforms.md", "flat.md", "display.md",
        "adapters.md"}  # fmt: skip


def test_the_display_page_shows_the_demo_models_graph_made_at_build_time():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hooks", DOCS / "_ext" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert "docs/_ext/hooks.py" in CONFIG
    page = (DOCS / "display.md").read_text()
    assert page.count(hooks.MARK) == 1
    html = hooks.on_page_markdown(page)
    assert hooks.MARK not in html
    # the subtree tie is one row with its 16 leaves behind a disclosure, and one edge
    assert html.count("<details>") == 2 and "the 16 leaves of block_1</summary>" in html
    assert "block_1  (16 leaves, " in html


def _load_ext(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, DOCS / "_ext" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_griffe_extension_turns_roles_into_links_and_titles_examples():
    ext = _load_ext("griffe_sharetree")
    public = set(_public_names())
    doc = ext.rewrite(sharetree.Restructure.__doc__, public)
    assert ":func:" not in doc and ":class:" not in doc and ":meth:" not in doc
    assert "[`destructure`][sharetree.destructure]" in doc  # a bare name of sharetree's
    # cleandoc: Python >= 3.13 dedents docstrings itself, older ones keep the indent
    summary = ext.rewrite(inspect.cleandoc(sharetree.summary.__doc__), public)
    assert "\nExamples:\n" in summary and "\nExample:\n" not in summary
    assert "[`grad_report`][sharetree.grad_report]" in summary
    # a private target is code, never a link to a page that does not exist
    assert ext.rewrite(":func:`~sharetree._io.describe`", public) == "`describe`"
    assert 'extensions: ["docs/_ext/griffe_sharetree.py:SharetreeDocstrings"]' in CONFIG
