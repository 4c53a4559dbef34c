"""What every display shares: tables cut after ``max_rows`` rows, their cells, SVG and its layout.

Text and HTML tables, the ``<svg>`` element and the columns of a drawn DAG. Used by
``summary`` and the graph's HTML (``_display``), ``grad_report``, the treescope view
(``_treescope``) and ``inspect``. Styles are inline: notebook viewers drop ``<style>`` blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence, Set
from html import escape
from typing import Any, Generic, NamedTuple, TypeVar

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


ROW_H, BOX_H, BOX_PAD = 26, 20, 8
"""A drawing's row height, box height and text padding (px); ``k`` rows: ``k * ROW_H - 6``."""


def clip(s: str, n: int) -> str:
    """``s``, cut to ``n`` characters with an ellipsis when longer."""
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def box(title: str, x: float, top: float, w: float, h: float, text: str, style: str) -> str:
    """An SVG box from height ``top``, with a hover ``title`` and a ``text`` label."""
    return (
        f'<g><title>{escape(title)}</title><rect x="{x:.0f}" y="{top:.1f}" width="{w:.0f}" '
        f'height="{h:.0f}" rx="3" {style}/><text x="{x + BOX_PAD:.0f}" '
        f'y="{top + h / 2 + 4:.1f}">{escape(text)}</text></g>'
    )


Node = TypeVar("Node", bound=Hashable)
"""A node of a drawn DAG (a path, for the sharing graph)."""


class Waypoint(NamedTuple):
    """Where an edge that spans columns crosses one between: a node of one row, not drawn."""

    target: Hashable  # the node the edge goes into
    edge: int  # which of its edges (in ``into[target]``)
    column: int


def columns_of(
    nodes: Sequence[Node], into: Mapping[Node, Sequence[Node]]
) -> tuple[list[list[Node | Waypoint]], dict[Node | Waypoint, list[Node | Waypoint]]]:
    """The nodes of a DAG by column, and its edges routed through :class:`Waypoint` nodes.

    A node without sources is in column 0, another one right of its deepest source. An
    edge into column ``d`` from column ``s < d - 1`` passes a waypoint in each column
    between, so that the layout keeps a row free for it there.

    Args:
        nodes: every node, in the order each column lists them.
        into: each node's sources (one per edge into it).

    Returns:
        The columns (the waypoints after the nodes), and ``into`` with each long edge's
        last waypoint as its source, each waypoint's source the one before it.
    """
    depth: dict[Node, int] = {}
    active: set[Node] = set()  # entered, not finished (one met again would be a cycle)
    for start in nodes:
        stack = [(start, False)]
        while stack:
            n, finish = stack.pop()
            if finish:
                depth[n] = 1 + max((depth.get(s, 0) for s in into.get(n, ())), default=-1)
                active.discard(n)
            elif n not in depth and n not in active:
                active.add(n)
                stack += [(n, True), *((s, False) for s in into.get(n, ()))]
    columns: list[list[Node | Waypoint]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for n in nodes:
        columns[depth[n]].append(n)
    routed: dict[Node | Waypoint, list[Node | Waypoint]] = {}
    for n in nodes:
        routed[n] = []
        for k, s in enumerate(into.get(n, ())):
            last: Node | Waypoint = s
            for d in range(depth.get(s, 0) + 1, depth[n]):
                w = Waypoint(n, k, d)
                routed[w], last = [last], w
                columns[d].append(w)
            routed[n].append(last)
    return columns, routed


class Layout(Generic[Node]):
    """The heights of a DAG's boxes drawn in columns (:func:`columns_of`), left to right.

    A node takes one row per edge into it, each edge ending at its own row (its label at
    its left) in the order of its source's height. Column 0 keeps its order; each next
    column is sorted by its sources' mean height and placed there; then, right to left,
    each column is sorted again and each node that feeds others moves to the mean height
    of the rows it feeds (twice, as the rows an edge ends at follow its source). No box
    overlaps the one above it or starts above ``top``.

    Args:
        columns: the nodes by column (:func:`columns_of`); sorted here.
        into: each node's sources, routed through waypoints (:func:`columns_of`).
        widths: each column's box width (px).
        gaps: the space left of each column (px): at least its edges' labels and 90.
        top: the least height of a box's top (px).

    Attributes:
        top: each node's top (px).
        x: each column's left (px).
        bottom: the lowest box's bottom row edge (px).
    """

    def __init__(
        self,
        columns: list[list[Node]],
        into: Mapping[Node, Sequence[Node]],
        widths: Sequence[float],
        gaps: Sequence[float],
        top: float = 12,
    ) -> None:
        self.widths, self.gaps, self.x = widths, gaps, [4.0]
        for d in range(1, len(columns)):
            self.x.append(self.x[-1] + widths[d - 1] + gaps[d])
        self.column = {n: d for d, col in enumerate(columns) for n in col}
        self.into, self._start = into, top
        self.top: dict[Node, float] = {}
        self.slots = {n: max(1, len(into.get(n, ()))) for col in columns for n in col}
        self._place(columns[0], {})
        for col in columns[1:]:
            want = {n: _mean([self.centre(s) for s in into[n]]) for n in col}
            col.sort(key=want.__getitem__)  # stable: ties keep the given order
            self._place(col, {n: want[n] - self.height(n) / 2 for n in col})
        feeds: dict[Node, list[tuple[Node, int]]] = {}  # source -> (target, edge index)
        for n, sources in into.items():
            for k, s in enumerate(sources):
                feeds.setdefault(s, []).append((n, k))
        for col in [*reversed(columns[:-1])] * 2:  # twice: the ends move with their sources
            ends = self.ends()
            want = {n: _mean([ends[t][k] for t, k in feeds[n]]) if n in feeds else self.centre(n)
                    for n in col}  # fmt: skip
            col.sort(key=want.__getitem__)
            self._place(col, {n: want[n] - self.height(n) / 2 for n in col})
        self.bottom = max(self.top[n] + self.slots[n] * ROW_H for n in self.top)

    def height(self, n: Node) -> float:
        """The height of ``n``'s box."""
        return self.slots[n] * ROW_H - (ROW_H - BOX_H)

    def centre(self, n: Node) -> float:
        """Where edges leave ``n``: the middle of its box."""
        return self.top[n] + self.height(n) / 2

    def ends(self) -> dict[Node, list[float]]:
        """Where each edge into a node ends, in the order of ``into[node]``."""
        out = {}
        for n, sources in self.into.items():
            order = sorted(range(len(sources)), key=lambda k: self.centre(sources[k]))
            rows = {k: r for r, k in enumerate(order)}
            out[n] = [self.top[n] + rows[k] * ROW_H + BOX_H / 2 for k in range(len(sources))]
        return out

    def path(self, n: Node, k: int, ends: Mapping[Node, Sequence[float]]) -> str:
        """The SVG path of the ``k``-th edge into ``n``, through its waypoints.

        ``ends`` is :meth:`ends`. Each stretch bends in the gap before a column and runs
        flat from 60 px after the column before it, under the label.
        """
        waypoints = []
        s = self.into[n][k]
        while isinstance(s, Waypoint):
            waypoints.append(s)
            s = self.into[s][0]
        c = self.column[s]
        x, y = self.x[c] + self.widths[c], self.centre(s)
        out = f"M{x:.0f},{y:.1f}"
        for w in [*reversed(waypoints), n]:
            c, last = self.column[w], w is n
            x1, y1 = self.x[c], ends[n][k] if last else self.centre(w)
            bend = f"{x + self.gaps[c] / 2:.0f},{y:.1f} {x + 60:.0f},{y1:.1f}"
            out += f" C{bend} {x1 - last:.0f},{y1:.1f}"
            x, y = x1 + self.widths[c], y1
            out += "" if last else f" L{x:.0f},{y:.1f}"
        return out

    def _place(self, col: Sequence[Node], want: Mapping[Node, float]) -> None:
        y = self._start
        for n in col:
            self.top[n] = max(want.get(n, y), y)
            y = self.top[n] + self.slots[n] * ROW_H


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)
