"""What every display shares: text and HTML tables cut after ``max_rows`` rows, and their cells.

Used by ``summary`` and the graph's HTML (``_display``), ``grad_report``, the treescope view
(``_treescope``) and ``inspect``. Styles are inline: notebook viewers drop ``<style>`` blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from html import escape
from typing import Any

from sharetree._errors import error, wrong_type
from sharetree._paths import plural
from sharetree._report import SharingGraph

MAX_ROWS = 20
"""Default number of rows per table (and views per drawing) before cutting."""


def check_max_rows(max_rows: Any, where: str) -> None:
    """Raise the E55 error unless ``max_rows`` (rows per table) is an int >= 1."""
    where, expected, fix = f"{where}: max_rows", "an int >= 1 (rows per table)", "pass max_rows=50"
    if isinstance(max_rows, bool) or not isinstance(max_rows, int):
        raise wrong_type("E55", where, expected, max_rows, fix)
    if max_rows < 1:
        raise error("E55", where, expected=expected, found=str(max_rows), fix=fix)


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units; bytes below 1 KiB are exact)."""
    if n < 1024:
        return f"{n} B"
    k = min((int(n).bit_length() - 1) // 10, 4)  # the largest unit that is at most n
    return f"{n / 1024**k:.1f} {'KMGT'[k - 1]}iB"


def saved_percent(unique: int, expanded: int) -> float:
    """Percentage of ``expanded`` that sharing saves (``0.0`` when ``expanded`` is 0)."""
    return 100.0 * (expanded - unique) / expanded if expanded > 0 else 0.0


def headline(g: SharingGraph) -> str:
    """``sharing graph: 20 buffers, 17 views``, then ``(from 2 ties)`` when a tie is a subtree's."""
    head = f"sharing graph: {plural(g.num_unique, 'buffer')}, {plural(g.num_views, 'view')}"
    ties = len({v.tie for v in g.views.values()})
    return head + (f" (from {plural(ties, 'tie')})" if ties != g.num_views else "")


def more_line(total: int, shown: int, what: str) -> str:
    """The ``... and K more WHAT`` line of a table or drawing cut after ``shown`` of ``total``."""
    return f"... and {total - shown:,} more {what}" if total > shown else ""


def first_of(names: Sequence[str], n: int) -> str:
    """The first ``n`` of ``names``, comma-separated, then ``, ... (K more)``."""
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def leaves_cell(n: int) -> str:
    """``1 leaf``, ``2 leaves``: the shape cell of a row that stands for several leaves."""
    return f"{n:,} leaf" if n == 1 else f"{n:,} leaves"


def printable(text: str) -> str:
    """``text`` with each character that would move a terminal (a newline, an escape) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def text_table(
    header: tuple[str, ...], rows: Sequence[tuple[str, ...]], more: str = ""
) -> list[str]:
    """The lines of a text table (indented, columns padded), then the ``more`` line if any.

    A cell's newlines and control characters are escaped: a key cannot forge a line.
    """
    rows = [tuple(map(printable, r)) for r in rows]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [("  " + "  ".join(map(str.ljust, r, widths))).rstrip() for r in [header, *rows]]
    return lines + (["  " + printable(more)] if more else [])


CELL = "padding:2px 8px;text-align:left;border-bottom:1px solid #e5e7eb;"
"""The inline style of a table cell (left-aligned)."""
_NUM = "padding:2px 8px;text-align:right;border-bottom:1px solid #e5e7eb;"
_MONO = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;"


def html_table(
    header: tuple[str, ...],
    rows: Sequence[tuple[str, ...]],
    numeric: Set[int],
    more: str = "",
    details: Sequence[Sequence[tuple[str, ...]]] = (),
) -> str:
    """An HTML table; ``details`` (none, or one per row): leaf rows shown in a disclosure."""

    def cells(tag: str, r: Sequence[str]) -> str:
        return "".join(
            f'<{tag} style="{_NUM if i in numeric else CELL}">{escape(x)}</{tag}>'
            for i, x in enumerate(r)
        )

    body = []
    for r, inner in zip(rows, details or [()] * len(rows)):
        body.append(f"<tr>{cells('td', r)}</tr>")
        if inner:
            body.append(
                f'<tr><td colspan="{len(header)}" style="padding:0 8px 4px 24px;">'
                f'<details><summary style="cursor:pointer;color:#4b5563;">'
                f"the {leaves_cell(len(inner))} of {escape(r[0])}</summary>"
                f"{html_table(header, inner, numeric)}</details></td></tr>"
            )
    if more:
        body.append(
            f'<tr><td colspan="{len(header)}" style="{CELL}color:#6b7280;">{escape(more)}</td></tr>'
        )
    return (
        # a class, so that page themes (mkdocs-material styles `table:not([class])`) leave it be
        f'<table class="sharetree-table" '
        f'style="border-collapse:collapse;margin:4px 0 8px 0;{_MONO}font-size:12px;">'
        f"<thead><tr>{cells('th', header)}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def html_page(kind: str, headline: str, parts: Iterable[str]) -> str:
    """An HTML block of class ``kind``: a bold ``headline``, then ``parts`` (inline styles only)."""
    return (
        f'<div class="{kind}" style="{_MONO}font-size:12px;line-height:1.35;">'
        f"<div><b>{escape(headline)}</b></div>{''.join(parts)}</div>"
    )


def svg(width: float, height: float, font_px: int, body: Iterable[str]) -> str:
    """An inline ``<svg>`` element of the given size holding ``body``."""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" style="{_MONO}font-size:{font_px}px;">'
        f"{''.join(body)}</svg>"
    )
