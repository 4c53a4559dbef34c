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
from sharetree._paths import format_aval, key_str, path_key, path_str
from sharetree._report import Buffer, SharingGraph, View, canonicalize
from sharetree._tables import (
    BOX_PAD,
    MAX_ROWS,
    ROW_H,
    Layout,
    Waypoint,
    box,
    check_max_rows,
    clip,
    columns_of,
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


_IDENTITY = repr(identity)
_MAX_INPUTS = 4  # inputs named in a cell before "... (K more)"


class _Input(NamedTuple):
    """One input of a view of several positions (of a row: what its leaves have in common)."""

    name: str
    source: str  # the buffer, subtree or view of several positions it reads
    transform: str  # on the way from ``source``: ``identity`` for none


def _input_text(x: _Input) -> str:
    """``base=lora/embed/base``, ``base=blocks >> take((0, 1))``: an input and its transform."""
    return f"{x.name}={x.source}" + ("" if x.transform == _IDENTITY else f" >> {x.transform}")


def _named(name: str, transform: str) -> str:
    """An input's edge label: ``base``, or ``base: take((0, 1))`` when not identity."""
    return name + ("" if transform == _IDENTITY else f": {transform}")


def _inputs_cell(inputs: Sequence[_Input]) -> str:
    """The inputs of a view of several positions, clipped after ``_MAX_INPUTS``."""
    return first_of([_input_text(x) for x in inputs], _MAX_INPUTS)


class _Group(NamedTuple):
    """One row of the view table: a ``Tied`` and the views it makes (one per leaf it ties)."""

    path: str  # where the Tied is written
    buffer: str  # the buffer it reads, or the subtree that holds them; its inputs, for several
    transform: str  # the composed transform, or "mixed" when the leaves differ
    views: tuple[View, ...]
    inputs: tuple[_Input, ...] = ()  # a view of several positions': its inputs by name

    @property
    def subtree(self) -> bool:
        """Whether the tie is a subtree's: several views, or one below the tie's path."""
        return len(self.views) != 1 or key_str(self.views[0].path) != self.path

    @property
    def sources(self) -> tuple[str, ...]:
        """The paths it reads: its buffer (or subtree), or each input's source."""
        return tuple(x.source for x in self.inputs) if self.inputs else (self.buffer,)


def _common_source(tie: str, pairs: Iterable[tuple[str, str]]) -> str | None:
    """``B`` when every view ``tie/S`` reads ``B/S`` for one ``B``, else ``None``.

    Args:
        tie: the path of the ``Tied``.
        pairs: each view's path and the path it reads.
    """
    found = set()
    for path, source in pairs:
        suffix = path[len(tie) :]
        if not (path.startswith(tie) and suffix.startswith("/") and source.endswith(suffix)):
            return None
        found.add(source[: -len(suffix)])
    return found.pop() if len(found) == 1 else None


def _common(values: Iterable[str]) -> str:
    """The one value of ``values``, or ``mixed`` when they differ."""
    seen = set(values)
    return seen.pop() if len(seen) == 1 else "mixed"


def _group_input(tie: str, views: Sequence[View], name: str, written: Any) -> _Input:
    """The input ``name`` of the views of one ``Tied`` of several refs, as one row shows it.

    A subtree's input is the subtree its leaves read (``enc`` for ``enc/w``, ``enc/b``);
    when they read no one subtree, the ref as written (``written``: the path it reads).
    """
    xs = [v.inputs[name] for v in views]
    if len(views) == 1 and key_str(views[0].path) == tie:
        return _Input(name, key_str(xs[0].source), repr(xs[0].transform))
    pairs = [(key_str(v.path), key_str(x.source)) for v, x in zip(views, xs)]
    source = _common_source(tie, pairs)
    if source is not None:
        return _Input(name, source, _common(repr(x.transform) for x in xs))
    return _Input(name, "mixed" if written is None else key_str(path_key(written)), _IDENTITY)


def _view_groups(g: SharingGraph) -> list[_Group]:
    """The views grouped by the ``Tied`` that made them, in flatten order."""
    by_tie: dict[str, list[View]] = {}
    for v in g.views.values():
        by_tie.setdefault(key_str(v.tie), []).append(v)
    ties = g.ties
    reads = {key_str(path_key(p)): r for p, r in g.structure.reads.items()}
    out = []
    for tie, vs in by_tie.items():
        transform = _common(repr(v.transform) for v in vs)
        if vs[0].inputs:  # a view of several positions: a row naming each input
            written = reads.get(tie, {})
            inputs = tuple(_group_input(tie, vs, n, written.get(n)) for n in vs[0].inputs)
            out.append(_Group(tie, _inputs_cell(inputs), transform, tuple(vs), inputs))
            continue
        pairs = [(key_str(v.path), key_str(v.buffer)) for v in vs]
        source = _common_source(tie, pairs)
        if len(vs) == 1 and key_str(vs[0].path) == tie:
            source = key_str(vs[0].buffer)
        elif source is None:  # the subtree holds ties to elsewhere: name the ref as written
            source = path_str(ties[vs[0].tie].ref)
        out.append(_Group(tie, source, transform, tuple(vs)))
    return out


def _buffer_rows(g: SharingGraph, groups: Sequence[_Group]) -> list[tuple[int, _Row, list[_Row]]]:
    """(views, cells, details) of the buffers, those of a subtree a tie reads as one row."""
    index = {key_str(b.path) for b in g.buffers}
    sources = {s for grp in groups if grp.subtree for s in grp.sources if s not in index}
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
        readers = sum(
            any(key_str(b) in inside for v in grp.views for b in v.buffers) for grp in groups
        )
        rows.append((readers, (path, *_summed(bs), str(readers)), inner))
    return rows


def _summed(xs: Sequence[Buffer | View]) -> tuple[str, str, str]:
    """The shape, dtype and bytes cells of a row that stands for the leaves ``xs``."""
    nbytes = format_bytes(sum(x.nbytes for x in xs))
    return leaves_cell(len(xs)), _common(_shape_dtype(x)[1] for x in xs), nbytes


def _view_cells(v: View) -> _Row:
    """A view's row: for a view of several positions, its inputs in the buffer cell."""
    buffer = key_str(v.buffer)
    if v.inputs:
        named = [_Input(n, key_str(x.source), repr(x.transform)) for n, x in v.inputs.items()]
        buffer = _inputs_cell(named)
    return (key_str(v.path), buffer, repr(v.transform), *_shape_dtype(v), format_bytes(v.nbytes))


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


_CHAR_W = 7.0  # px per character at 12px


class _Edge(NamedTuple):
    """An edge of the drawing: a drawn node -> a shown row, labelled with what is on the way."""

    source: str  # a shown row's path, or a path a row reads (a buffer, a subtree)
    target: str  # a shown row's path
    label: str  # the input's name (for a view of several) and the transform ("" for none)
    reads: frozenset[str]  # the leaves its views read (a subtree box's hover text)


def _edges(shown: Sequence[_Group]) -> list[_Edge]:
    """One edge per row that reads one source, one per input of a view of several positions."""
    paths = {grp.path for grp in shown}
    several = [grp.path for grp in shown if grp.inputs]

    def node(source: str) -> str:  # a leaf of a drawn view of several positions is its row
        if source in paths:
            return source
        return next((p for p in several if source.startswith(p + "/")), source)

    out = []
    for grp in shown:
        if not grp.inputs:
            label = "" if grp.transform == _IDENTITY else grp.transform
            reads = frozenset(key_str(v.buffer) for v in grp.views)
            out.append(_Edge(node(grp.buffer), grp.path, label, reads))
        for x in grp.inputs:
            reads = frozenset(key_str(v.inputs[x.name].source) for v in grp.views)
            out.append(_Edge(node(x.source), grp.path, _named(x.name, x.transform), reads))
    return out


def _real(nodes: Iterable[str | Waypoint]) -> list[str]:
    """The nodes that are drawn (paths), without the waypoints of long edges."""
    return [n for n in nodes if isinstance(n, str)]


def graph_svg(g: SharingGraph, *, max_rows: int = MAX_ROWS) -> str:
    """The sharing DAG as inline SVG, each view right of what it reads; ``""`` without views.

    Edges are labelled with their transform; a view of several positions has one edge
    per input, labelled with its name, and views of it hang off it. Hovering a box
    lists its leaves.
    """
    if not g.views:
        return ""
    check_max_rows(max_rows, "graph_svg")
    shown = _view_groups(g)[:max_rows]
    more = more_line(len(g.views), sum(len(grp.views) for grp in shown), "views")
    rows, edges = {grp.path: grp for grp in shown}, _edges(shown)
    into: dict[str, list[_Edge]] = {}
    reads: dict[str, set[str]] = {}  # the leaves a source's box stands for
    for e in edges:
        into.setdefault(e.target, []).append(e)
        reads.setdefault(e.source, set()).update(e.reads)
    buffers = {key_str(b.path): i for i, b in enumerate(g.buffers)}
    views = {key_str(p) for p in g.views}
    sources = {n: [e.source for e in es] for n, es in into.items()}
    columns, routed = columns_of(list(dict.fromkeys([*(e.source for e in edges), *rows])), sources)

    def inside(n: str) -> list[str]:  # the buffers a source's box stands for
        return [p for p in buffers if p == n or p.startswith(n + "/") or p in reads[n]]

    first = lambda n: min(map(buffers.__getitem__, inside(n)), default=len(buffers))  # noqa: E731
    columns[0][:] = sorted(_real(columns[0]), key=first)

    def label(n: str) -> str:  # a row: its transform if of several, leaves and bytes if a subtree
        grp = rows.get(n)
        if grp is None:
            whole = n in buffers or n in views
            return clip(n, 36) + ("" if whole else f"  ({leaves_cell(len(inside(n)))})")
        leaves, _, nbytes = _summed(grp.views)
        several = f" = {clip(grp.transform, 28)}" if grp.inputs else ""
        return clip(n, 36) + several + (f"  ({leaves}, {nbytes})" if grp.subtree else "")

    def title(n: str) -> str:
        grp = rows.get(n)
        if grp is None:
            if n in views:
                return f"source {n}: a view not drawn (see max_rows)"
            return f"buffer {n}" + ("" if n in buffers else ": " + first_of(sorted(reads[n]), 20))
        text = f"view {n} = {grp.transform}({grp.buffer})"
        leaves = [key_str(v.path) for v in grp.views]
        return text + (": " + first_of(leaves, 20) if grp.subtree else "")

    widths = [max(len(label(n)) for n in _real(col)) * _CHAR_W + 2 * BOX_PAD for col in columns]
    label_w = [
        max((len(clip(e.label, 32)) for n in _real(col) for e in into.get(n, ())), default=0)
        * _CHAR_W
        for col in columns
    ]
    lay = Layout(columns, routed, widths, [w + 90 for w in label_w])
    mid = f"stm{next(_svg_ids)}"
    out = [
        f'<defs><marker id="{mid}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        f'fill="#6b7280"/></marker></defs>',
    ]
    ends, labels = lay.ends(), []  # edges under the boxes, their labels over everything
    for n, es in into.items():
        for k, e in enumerate(es):
            out.append(
                f'<path d="{lay.path(n, k, ends)}" fill="none" stroke="#6b7280" '
                f'marker-end="url(#{mid})"/>'
            )
            if e.label:
                labels.append(
                    f'<text x="{lay.x[lay.column[n]] - 10:.0f}" y="{ends[n][k] - 4:.1f}" '
                    f'text-anchor="end" fill="#374151" stroke="#fff" stroke-width="3" '
                    f'paint-order="stroke">{escape(clip(e.label, 32))}</text>'
                )
    for n in _real(lay.column):
        x, w = lay.x[lay.column[n]], widths[lay.column[n]]
        style = _VIEW_STYLE if n in rows or n in views else _BUFFER_STYLE
        out.append(box(title(n), x, lay.top[n], w, lay.height(n), label(n), style))
    out += labels
    if more:
        at = f'x="{lay.x[1]:.0f}" y="{lay.bottom + 14:.0f}"'
        out.append(f'<text {at} fill="#6b7280">{escape(more)}</text>')
    height = lay.bottom + 4 + (ROW_H if more else 0)
    width = max(lay.x[-1] + widths[-1], lay.x[1] + len(more) * _CHAR_W) + 4
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

    One node per buffer and per view (leaf by leaf); a view of several positions shows
    its transform and has an edge per input labelled ``name`` or ``name: transform``.

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
    views = list(g.views.values())
    node = {b.path: f"b{i}" for i, b in enumerate(g.buffers)}
    node.update((v.path, f"v{j}") for j, v in enumerate(views))
    several = lambda v: f"\n{v.transform!r}" if v.inputs else ""  # noqa: E731
    label = lambda x, more="": _dot_str(f"{x.path}{more}\n{format_aval(x.aval)}")  # noqa: E731
    lines = [
        'digraph sharing {\n  rankdir=LR;\n  node [shape=box, fontname="monospace", fontsize=10];'
    ]
    lines += [
        f'  b{i} [label={label(b)}, style="filled", fillcolor="{_BUFFER_FILL}"];'
        for i, b in enumerate(g.buffers)
        if include_unshared or b.num_views
    ]
    lines += [
        f'  v{j} [label={label(v, several(v))}, style="dashed"];' for j, v in enumerate(views)
    ]
    for j, v in enumerate(views):  # a view of several positions: an edge per input, by name
        named = [(x.source, _named(n, repr(x.transform))) for n, x in v.inputs.items()]
        for source, text in named or [(v.buffer, repr(v.transform))]:
            lines.append(f"  {node[source]} -> v{j} [label={_dot_str(text)}];")
    return "\n".join([*lines, "}"])


# the renderers that SharingGraph looks up (the core never imports this module)
DISPLAY.update(graph_html=graph_html, graph_dot=graph_dot)
