"""Seeing the sharing: ``summary`` (text), HTML and SVG for Jupyter, DOT.

Importing it registers the graph's HTML and DOT with ``SharingGraph`` (``_tied.DISPLAY``);
the treescope renderings are in ``_treescope``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any, NamedTuple

from sharetree._grad_report import grad_report
from sharetree._paths import format_aval, key_str, path_str
from sharetree._report import Buffer, SharingGraph, View, canonicalize
from sharetree._tables import (
    MAX_ROWS,
    check_max_rows,
    first_of,
    format_bytes,
    headline,
    html_page,
    html_table,
    leaves_cell,
    more_line,
    saved_percent,
    svg,
    text_table,
)
from sharetree._tied import DISPLAY
from sharetree._transforms import identity

__all__ = [
    "summary",
    "graph_html",
    "graph_svg",
    "graph_dot",
]

_BUFFER_FILL = "#dbeafe"
_BUFFER_STYLE = f'fill="{_BUFFER_FILL}" stroke="#1d4ed8"'
_VIEW_STYLE = 'fill="#ffedd5" stroke="#c2410c" stroke-dasharray="4 2"'
_svg_ids = itertools.count()
_Row = tuple[str, ...]  # the cells of a table row


def _shape_dtype(x: Buffer | View) -> tuple[str, str]:
    """Its shape and dtype cells: ``(2, 3)`` and ``float32``, or ``static`` and ``-``."""
    if x.shape is None:
        return "static", "-"
    return "(" + ", ".join(map(str, x.shape)) + (",)" if len(x.shape) == 1 else ")"), str(x.dtype)


class _Section(NamedTuple):
    """One table of a summary; ``details``: each row's leaves, behind a disclosure in HTML."""

    title: str
    header: tuple[str, ...]
    rows: Sequence[tuple[str, ...]]
    more: str  # the "... and K more" line, or ""
    none: str  # the text shown when there are no rows
    numeric: frozenset[int]  # columns aligned right in HTML
    details: Sequence[Sequence[tuple[str, ...]]] = ()


class _Group(NamedTuple):
    """One row of the view table: a ``Tied`` and the views it makes (one per leaf it ties)."""

    path: str  # where the Tied is written
    buffer: str  # the buffer it reads, or the subtree that holds the buffers it reads
    transform: str  # the composed transform, or "mixed" when the leaves differ
    views: tuple[View, ...]

    @property
    def subtree(self) -> bool:
        """Whether the tie is a subtree's: several views, or one below the tie's path."""
        return len(self.views) != 1 or key_str(self.views[0].path) != self.path


def _common_source(tie: str, views: Sequence[View]) -> str | None:
    """``B`` when every view ``tie/S`` reads buffer ``B/S`` for one ``B``, else ``None``."""
    found = set()
    for v in views:
        path, buffer = key_str(v.path), key_str(v.buffer)
        suffix = path[len(tie) :]
        if not (path.startswith(tie) and suffix.startswith("/") and buffer.endswith(suffix)):
            return None
        found.add(buffer[: -len(suffix)])
    return found.pop() if len(found) == 1 else None


def _common(values: Iterable[str]) -> str:
    """The one value of ``values``, or ``mixed`` when they differ."""
    seen = set(values)
    return seen.pop() if len(seen) == 1 else "mixed"


def _view_groups(g: SharingGraph) -> list[_Group]:
    """The views grouped by the ``Tied`` that made them, in flatten order."""
    by_tie: dict[str, list[View]] = {}
    for v in g.views.values():
        by_tie.setdefault(key_str(v.tie), []).append(v)
    ties = g.ties
    out = []
    for tie, vs in by_tie.items():
        source = _common_source(tie, vs)
        if len(vs) == 1 and key_str(vs[0].path) == tie:
            source = key_str(vs[0].buffer)
        elif source is None:  # the subtree holds ties to elsewhere: name the ref as written
            source = path_str(ties[vs[0].tie].ref)
        out.append(_Group(tie, source, _common(repr(v.transform) for v in vs), tuple(vs)))
    return out


def _buffer_rows(g: SharingGraph, groups: Sequence[_Group]) -> list[tuple[int, _Row, list[_Row]]]:
    """(views, cells, details) of the buffers, those of a subtree a tie reads as one row."""
    index = {key_str(b.path) for b in g.buffers}
    sources = {grp.buffer for grp in groups if grp.subtree and grp.buffer not in index}
    members: dict[str, list[Buffer]] = {}
    for b in g.buffers:  # a buffer in several such subtrees is in the outermost one's row
        path = key_str(b.path)
        src = min((s for s in sources if path.startswith(s + "/")), key=len, default=path)
        members.setdefault(src, []).append(b)
    rows: list[tuple[int, _Row, list[_Row]]] = []
    for path, bs in members.items():
        inner: list[_Row] = [
            (key_str(b.path), *_shape_dtype(b), format_bytes(b.nbytes), str(b.num_views))
            for b in bs
        ]
        if path not in sources:
            rows.append((bs[0].num_views, inner[0], []))
            continue
        inside = {key_str(b.path) for b in bs}
        readers = sum(any(key_str(v.buffer) in inside for v in grp.views) for grp in groups)
        rows.append((readers, (path, *_summed(bs), str(readers)), inner))
    return rows


def _summed(xs: Sequence[Buffer | View]) -> tuple[str, str, str]:
    """The shape, dtype and bytes cells of a row that stands for the leaves ``xs``."""
    nbytes = format_bytes(sum(x.nbytes for x in xs))
    return leaves_cell(len(xs)), _common(_shape_dtype(x)[1] for x in xs), nbytes


def _view_cells(v: View) -> _Row:
    path, buffer = key_str(v.path), key_str(v.buffer)
    return (path, buffer, repr(v.transform), *_shape_dtype(v), format_bytes(v.nbytes))


def _sections(g: SharingGraph, max_rows: int) -> list[_Section]:
    """The buffer and view tables, cut after ``max_rows`` rows (buffers with views kept first)."""
    groups = _view_groups(g)
    brows = _buffer_rows(g, groups)
    shown = sorted(sorted(range(len(brows)), key=lambda i: not brows[i][0])[:max_rows])
    b_rows = [brows[i][1] for i in shown]
    b_details = [brows[i][2] for i in shown]
    v_shown = groups[:max_rows]
    v_rows = [
        (grp.path, grp.buffer, grp.transform, *_summed(grp.views))
        if grp.subtree
        else _view_cells(grp.views[0])
        for grp in v_shown
    ]
    v_details = [[_view_cells(v) for v in grp.views] if grp.subtree else [] for grp in v_shown]
    n_buffers = sum(len(d) or 1 for d in b_details)
    n_views = sum(len(grp.views) for grp in v_shown)
    return [
        _Section("buffers", ("path", "shape", "dtype", "bytes", "views"), b_rows,
                 more_line(len(g.buffers), n_buffers, "buffers"), "(none)", frozenset({3, 4}),
                 b_details),
        _Section("views", ("path", "buffer", "transform", "shape", "dtype", "bytes"), v_rows,
                 more_line(len(g.views), n_views, "views"), "(none: nothing is shared)",
                 frozenset({5}), v_details),
    ]  # fmt: skip


def _totals(g: SharingGraph) -> list[tuple[str, str, str, str]]:
    """(what, unique, expanded, saved) lines of the totals block."""
    counts = [
        ("leaves", g.num_unique, g.num_expanded, "{:,}".format),
        ("params", g.size_unique, g.size_expanded, "{:,}".format),
        ("bytes", g.nbytes_unique, g.nbytes_expanded, format_bytes),
    ]
    return [(w, f(u), f(x), f"{saved_percent(u, x):.1f}%") for w, u, x, f in counts]


_TOTALS = ("", "unique", "expanded", "saved")


def summary(
    tree: Any,
    grads_by_use: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    max_rows: int = MAX_ROWS,
) -> str:
    """A plain-text summary of the sharing in ``tree`` (or a SharingGraph), for terminals and logs.

    Totals, then tables of buffers and views of at most ``max_rows`` rows; a
    subtree tie is one row (see "Seeing the sharing" in the docs). Given
    ``st.grad_by_use(fun)(tree, ...)``, it ends with its :func:`~sharetree.grad_report`.

    Raises:
        TieError: when the tree's ties do not resolve (as for ``canonicalize``).

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"enc": np.zeros((2, 3), np.float32), "dec": st.Tied("enc", st.T)}
        >>> print(st.summary(tree))
        sharing graph: 1 buffer, 1 view
                    unique  expanded  saved
          leaves    1       2         50.0%
          params    6       12        50.0%
          bytes     24 B    48 B      50.0%
        buffers:
          path  shape   dtype    bytes  views
          enc   (2, 3)  float32  24 B   1
        views:
          path  buffer  transform  shape   dtype    bytes
          dec   enc     T          (3, 2)  float32  24 B
    """
    g = tree if isinstance(tree, SharingGraph) else canonicalize(tree)
    check_max_rows(max_rows, "summary")
    lines = [headline(g), *text_table(_TOTALS, _totals(g))]
    for sec in _sections(g, max_rows):
        body = text_table(sec.header, sec.rows, sec.more) if sec.rows else ["  " + sec.none]
        lines += [f"{sec.title}:", *body]
    if grads_by_use is not None:
        lines.append(str(grad_report(grads_by_use, max_rows=max_rows)))
    return "\n".join(lines)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def _box(title: str, x: float, y: float, w: float, text: str, style: str) -> str:
    """An SVG box centred on height ``y`` with a hover ``title`` and a ``text`` label."""
    return (
        f'<g><title>{escape(title)}</title><rect x="{x}" y="{y - _BOX_H / 2:.1f}" width="{w:.0f}" '
        f'height="{_BOX_H}" rx="3" {style}/><text x="{x + _PAD}" y="{y + 4:.1f}">'
        f"{escape(text)}</text></g>"
    )


_BOX_H, _PAD = 20, 8


def graph_svg(g: SharingGraph, *, max_rows: int = MAX_ROWS) -> str:
    """The sharing DAG as inline SVG (buffers left, views right), ``""`` without views.

    Edges are labelled with their transform; hovering a box lists its leaves.
    """
    if not g.views:
        return ""
    check_max_rows(max_rows, "graph_svg")
    groups = _view_groups(g)
    order = {key_str(b.path): i for i, b in enumerate(g.buffers)}
    for grp in groups:  # a subtree's place: its first buffer's
        order.setdefault(grp.buffer, min(order[key_str(v.buffer)] for v in grp.views))
    shown = sorted(groups[:max_rows], key=lambda grp: order[grp.buffer])
    more = more_line(len(g.views), sum(len(grp.views) for grp in shown), "views")
    buffers = {key_str(b.path) for b in g.buffers}

    def left_label(grp: _Group) -> str:  # a subtree: its number of buffers
        inside = {key_str(v.buffer) for v in grp.views}
        n = sum(p.startswith(grp.buffer + "/") or p in inside for p in buffers)
        return _clip(grp.buffer, 36) + ("" if grp.buffer in buffers else f"  ({leaves_cell(n)})")

    def right_label(grp: _Group) -> str:  # a subtree tie: its number of views and their bytes
        leaves, _, nbytes = _summed(grp.views)
        return _clip(grp.path, 36) + (f"  ({leaves}, {nbytes})" if grp.subtree else "")

    char_w, row_h, top = 7.0, 26, 12
    left_w = max(len(left_label(grp)) for grp in shown) * char_w + 2 * _PAD
    right_w = max(len(right_label(grp)) for grp in shown) * char_w + 2 * _PAD
    label_w = max(len(_clip(grp.transform, 28)) for grp in shown) * char_w
    gap = max(70.0, label_w + 90)
    x0, x1 = 4.0 + left_w, 4.0 + left_w + gap  # where the edges start and end (the views' left)
    height = top + len(shown) * row_h + 4 + (row_h if more else 0)
    width = max(x1 + right_w, x1 + len(more) * char_w) + 4
    mid = f"stm{next(_svg_ids)}"
    out = [
        f'<defs><marker id="{mid}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        f'fill="#6b7280"/></marker></defs>',
    ]
    for buf, run in itertools.groupby(enumerate(shown), key=lambda kv: kv[1].buffer):
        rows = [(grp, top + k * row_h + _BOX_H / 2) for k, grp in run]  # each row and its height
        by = sum(y for _, y in rows) / len(rows)
        first = rows[0][0]
        title = f"buffer {buf}"
        if buf not in buffers:
            title += ": " + first_of(sorted({key_str(v.buffer) for v in first.views}), 20)
        out.append(_box(title, 4.0, by, left_w, left_label(first), _BUFFER_STYLE))
        for grp, y in rows:
            out.append(
                f'<path d="M{x0:.0f},{by:.1f} C{x0 + gap / 2:.0f},{by:.1f} '
                f'{x1 - label_w - 30:.0f},{y:.1f} {x1 - 1:.0f},{y:.1f}" fill="none" '
                f'stroke="#6b7280" marker-end="url(#{mid})"/>'
            )
            if grp.transform != repr(identity):
                out.append(
                    f'<text x="{x1 - 10:.0f}" y="{y - 4:.1f}" text-anchor="end" '
                    f'fill="#374151">{escape(_clip(grp.transform, 28))}</text>'
                )
            title = f"view {grp.path} = {grp.transform}({grp.buffer})"
            if grp.subtree:
                title += ": " + first_of([key_str(v.path) for v in grp.views], 20)
            out.append(_box(title, x1, y, right_w, right_label(grp), _VIEW_STYLE))
    if more:
        out.append(
            f'<text x="{x1}" y="{top + len(shown) * row_h + 14}" fill="#6b7280">'
            f"{escape(more)}</text>"
        )
    return svg(width, height, 12, out)


def graph_html(g: SharingGraph, *, max_rows: int = MAX_ROWS) -> str:
    """The HTML of a :class:`~sharetree.SharingGraph` in Jupyter: totals, tables, drawing."""
    check_max_rows(max_rows, "graph_html")
    buffers, views = _sections(g, max_rows)
    views = views._replace(header=("path", "\u2190 buffer", *views.header[2:]))
    parts = [html_table(_TOTALS, _totals(g), numeric={1, 2, 3})]
    for sec in (buffers, views) if views.rows else (buffers,):
        parts.append(f"<div><b>{sec.title}</b></div>")
        parts.append(html_table(sec.header, sec.rows, sec.numeric, sec.more, sec.details))
    no_views = "<div><i>no views: nothing is shared</i></div>"
    parts.append(graph_svg(g, max_rows=max_rows) if views.rows else no_views)
    return html_page("sharetree-graph", headline(g), parts)


def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def graph_dot(g: SharingGraph, *, include_unshared: bool = False) -> str:
    r"""Graphviz DOT text of the sharing graph; buffers without views only if ``include_unshared``.

    Example:
        >>> import numpy as np, sharetree as st
        >>> g = st.canonicalize({"a": np.zeros((2, 3), np.float32), "b": st.Tied("a", st.T)})
        >>> print(g.to_dot())
        digraph sharing {
          rankdir=LR;
          node [shape=box, fontname="monospace", fontsize=10];
          b0 [label="a\nfloat32[2, 3]", style="filled", fillcolor="#dbeafe"];
          v0 [label="b\nfloat32[3, 2]", style="dashed"];
          b0 -> v0 [label="T"];
        }
    """
    index = {b.path: i for i, b in enumerate(g.buffers)}
    label = lambda x: _dot_str(f"{x.path}\n{format_aval(x.aval)}")  # noqa: E731
    lines = [
        'digraph sharing {\n  rankdir=LR;\n  node [shape=box, fontname="monospace", fontsize=10];'
    ]
    lines += [
        f'  b{i} [label={label(b)}, style="filled", fillcolor="{_BUFFER_FILL}"];'
        for i, b in enumerate(g.buffers)
        if include_unshared or b.num_views
    ]
    lines += [f'  v{j} [label={label(v)}, style="dashed"];' for j, v in enumerate(g.views.values())]
    lines += [
        f"  b{index[v.buffer]} -> v{j} [label={_dot_str(repr(v.transform))}];"
        for j, v in enumerate(g.views.values())
    ]
    return "\n".join([*lines, "}"])


# the renderers that SharingGraph looks up (the core never imports this module)
DISPLAY.update(graph_html=graph_html, graph_dot=graph_dot)
