"""Views of several positions in every display: summary, HTML, SVG, DOT and treescope.

Facts are checked against the trees written out by hand here (which position reads
which, the values computed in NumPy), never against the display's own helpers: the
DOT text is read back by a small parser of the language, the SVG by its geometry.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import jax
import numpy as np
import pytest
import treescope
from treescope import formatting_util

import sharetree as st
from sharetree._display import graph_svg
from sharetree._treescope import _Mark

SVG = "{http://www.w3.org/2000/svg}"
TAKE = (0, 1, 0, 1, 0, 1)


def _lora_tree():
    """LoRA on a tied embedding (the base under lora/embed/base), and the tied head."""
    rng = np.random.default_rng(0)
    e, a, b = (rng.normal(size=s).astype(np.float32) for s in ((10, 4), (10, 2), (2, 4)))
    tree = {
        "params": {
            "embed": st.Tied(
                {"base": "lora/embed/base", "a": "lora/embed/a", "b": "lora/embed/b"},
                st.lora(2.0),
            ),
            "head": st.Tied("embed", st.T),
        },
        "lora": {"embed": {"base": e, "a": a, "b": b}},
    }
    return tree, e + 2.0 * (a @ b)


def _stack_tree(d=4, r=2):
    """Shared blocks for a stack of 6 layers, each layer with its own adapter."""
    rng = np.random.default_rng(1)
    blocks = rng.normal(size=(2, d, d)).astype(np.float32)
    a = rng.normal(size=(6, d, r)).astype(np.float32)
    b = rng.normal(size=(6, r, d)).astype(np.float32)
    tree = {
        "blocks": blocks,
        "stack": st.Tied("blocks", st.take(TAKE)),
        "a": a,
        "b": b,
        "layers": st.Tied({"base": "stack", "a": "a", "b": "b"}, st.lora(0.5)),
    }
    return tree, blocks[list(TAKE)] + 0.5 * (a @ b)


def _subtree_tree():
    """Subtree inputs (a join per leaf), a view of one of its leaves, and a chain of joins."""
    enc = {"w": np.full((3, 3), 1.0, np.float32), "b": np.full(3, 2.0, np.float32)}
    delta = {"w": np.full((3, 3), 10.0, np.float32), "b": np.full(3, 20.0, np.float32)}
    return {
        "enc": enc,
        "delta": delta,
        "sum": st.Tied({"x": "enc", "y": "delta"}, st.add()),
        "sumT": st.Tied("sum/w", st.T),
        "sum2": st.Tied({"p": "sum", "q": "enc"}, st.add()),  # an input is itself a join
        "prod": st.Tied({"a": "sumT", "b": "delta/w"}, st.matmul() >> st.T),
    }


# what each view reads, written by hand: view path -> {input name: source path}
READS_BY_HAND = {
    "sum/b": {"x": "enc/b", "y": "delta/b"},
    "sum/w": {"x": "enc/w", "y": "delta/w"},
    "sum2/b": {"p": "sum/b", "q": "enc/b"},
    "sum2/w": {"p": "sum/w", "q": "enc/w"},
    "prod": {"a": "sum/w", "b": "delta/w"},
    "sumT": {None: "sum/w"},
}


def _rows(text, table):
    """The rows of the summary's ``table`` (``buffers`` or ``views``), split on 2+ spaces."""
    body = text.split(f"\n{table}:\n")[1].split("\n", 1)
    lines = [body[0]] + (body[1].splitlines() if len(body) > 1 else [])
    out = []
    for line in lines:
        if not line.startswith("  ") or line.startswith("  ... and"):
            break
        out.append(re.split(r"\s{2,}", line.strip()))
    return out[0], {r[0]: dict(zip(out[0], r)) for r in out[1:]}


def _inputs(cell):
    """``{name: source}`` from a cell ``a=x, b=y >> T``."""
    return dict(part.split("=", 1) for part in re.split(r", (?=\w+=)", cell))


# --------------------------------------------------------------------------- summary


def test_summary_row_of_a_view_of_several_names_each_input_and_its_transform():
    tree, embed = _lora_tree()
    text = st.summary(tree)
    _, views = _rows(text, "views")
    row = views["params/embed"]
    assert _inputs(row["buffer"]) == {
        "a": "lora/embed/a",
        "b": "lora/embed/b",
        "base": "lora/embed/base",
    }
    assert row["transform"] == "lora(2.0)"
    assert row["shape"] == str(embed.shape) and row["dtype"] == str(embed.dtype)
    # a view of it names that view as its source, with its own transform
    head = views["params/head"]
    assert (head["buffer"], head["transform"]) == ("params/embed", "T")
    assert head["shape"] == str(embed.T.shape)


def test_summary_buffer_counts_every_view_that_reads_it():
    tree, _ = _lora_tree()
    _, buffers = _rows(st.summary(tree), "buffers")
    # by hand: embed reads the three buffers, head reads them through embed
    readers = {p: {"params/embed", "params/head"} for p in ("a", "b", "base")}
    assert {p: int(buffers[f"lora/embed/{p}"]["views"]) for p in readers} == {
        p: len(r) for p, r in readers.items()
    }


def test_summary_input_through_a_view_shows_the_buffer_and_transform():
    tree, layers = _stack_tree()
    _, views = _rows(st.summary(tree), "views")
    assert _inputs(views["layers"]["buffer"]) == {
        "a": "a",
        "b": "b",
        "base": f"blocks >> take({TAKE})",  # stack is take(blocks)
    }
    assert views["layers"]["transform"] == "lora(0.5)"
    assert views["layers"]["shape"] == str(layers.shape)
    assert (views["stack"]["buffer"], views["stack"]["transform"]) == ("blocks", f"take({TAKE})")
    _, buffers = _rows(st.summary(tree), "buffers")
    assert [buffers[p]["views"] for p in ("a", "b", "blocks")] == ["1", "1", "2"]


def test_summary_of_subtree_inputs_and_a_chain_of_views_of_several():
    tree = _subtree_tree()
    text = st.summary(tree, max_rows=50)
    _, views = _rows(text, "views")
    assert _inputs(views["sum"]["buffer"]) == {"x": "enc", "y": "delta"}
    assert views["sum"]["shape"] == "2 leaves"
    assert _inputs(views["sum2"]["buffer"]) == {"p": "sum", "q": "enc"}
    assert _inputs(views["prod"]["buffer"]) == {"a": "sum/w >> T", "b": "delta/w"}
    assert views["prod"]["transform"] == "matmul >> T"
    assert views["sumT"]["buffer"] == "sum/w"
    _, buffers = _rows(text, "buffers")
    assert set(buffers) == {"enc", "delta"}  # the subtrees a tie reads: one row each
    # by hand, the ties reading a leaf of each: enc by sum, sum2 (q, and p through sum),
    # sumT and prod (through sum/w); delta by sum, sumT, sum2 (through sum) and prod
    assert (buffers["enc"]["views"], buffers["delta"]["views"]) == ("4", "4")
    page = st.canonicalize(tree)._repr_html_()  # every position: in a row or a disclosure
    for leaf in [*READS_BY_HAND, "enc/w", "enc/b", "delta/w", "delta/b"]:
        assert f">{leaf}<" in page, leaf


def test_html_disclosure_rows_of_a_subtree_view_name_each_leafs_inputs():
    tree = _subtree_tree()
    root = ET.fromstring(st.canonicalize(tree)._repr_html_())
    views_table = root.findall("./table")[2]
    leaf_rows = {}
    for details in views_table.iter("details"):
        for tr in details.iter("tr"):
            cells = ["".join(td.itertext()) for td in tr.findall("td")]
            if cells:
                leaf_rows[cells[0]] = cells
    for leaf in ("sum/w", "sum/b", "sum2/w", "sum2/b"):
        assert _inputs(leaf_rows[leaf][1]) == READS_BY_HAND[leaf], leaf


def test_a_long_inputs_list_is_clipped_like_other_lists():
    names = [f"in{i:02d}" for i in range(10)]
    tree = {n: np.ones(2, np.float32) for n in names}
    tree["total"] = st.Tied({n: n for n in names}, st.add())
    _, views = _rows(st.summary(tree), "views")
    cell = views["total"]["buffer"]
    shown = re.findall(r"(in\d\d)=", cell)
    assert 1 <= len(shown) < len(names) and set(shown) <= set(names)
    assert cell.endswith(f"... ({len(names) - len(shown)} more)")
    # the whole list is still there: the SVG edges, one per input
    svg = ET.fromstring(graph_svg(st.canonicalize(tree)))
    assert len(_edges(svg)) == len(names)


def test_fifty_views_of_several_clip_the_tables_and_the_drawing():
    tree = {"base": np.ones((3, 3), np.float32)}
    for i in range(50):
        tree[f"l{i:02d}"] = {
            "a": np.ones((3, 1), np.float32),
            "b": np.ones((1, 3), np.float32),
            "w": st.Tied({"base": "../base", "a": "a", "b": "b"}, st.lora(1.0)),
        }
    g = st.canonicalize(tree)
    text = st.summary(g)
    _, views = _rows(text, "views")
    assert len(views) == 20 and "... and 30 more views" in text
    assert all(_inputs(v["buffer"])["base"] == "base" for v in views.values())
    page = g._repr_html_()
    root = ET.fromstring(page)
    assert "... and 30 more views" in page
    svg = root.find(f".//{SVG}svg")
    drawn = [t for t in _titles(svg) if t.startswith("view ")]
    assert len(drawn) == 20
    assert len(_edges(svg)) == 20 * 3  # each drawn view: its three inputs
    _, buffers = _rows(text, "buffers")
    assert buffers["base"]["views"] == "50"


# --------------------------------------------------------------------------- SVG


def _titles(svg):
    return ["".join(t.itertext()) for t in svg.iter(f"{SVG}title")]


def _edges(svg):
    """The ``d`` of every edge (the arrow head's path is inside ``<defs>``)."""
    marker = {id(p) for p in svg.iter(f"{SVG}marker") for p in p.iter(f"{SVG}path")}
    return [p.get("d") for p in svg.iter(f"{SVG}path") if id(p) not in marker]


def _boxes(svg):
    """``{path: (x0, y0, x1, y1)}`` of every box, by the first word of its label."""
    out = {}
    for g in svg.iter(f"{SVG}g"):
        rect, text = g.find(f"{SVG}rect"), g.find(f"{SVG}text")
        x, y = float(rect.get("x")), float(rect.get("y"))
        w, h = float(rect.get("width")), float(rect.get("height"))
        out[text.text.split()[0]] = (x, y, x + w, y + h)
    return out


def _points(d, steps=24):
    """Points along an SVG path of M, C and L commands (cubic Béziers sampled)."""
    tokens = re.findall(r"[MCL]|-?[\d.]+", d)
    pts, cur, i = [], None, 0
    while i < len(tokens):
        cmd = tokens[i]
        n = {"M": 1, "L": 1, "C": 3}[cmd]
        xy = [float(t) for t in tokens[i + 1 : i + 1 + 2 * n]]
        ps = list(zip(xy[::2], xy[1::2]))
        if cmd == "C":
            (x1, y1), (x2, y2), (x3, y3) = ps
            x0, y0 = cur
            for k in range(1, steps + 1):
                t = k / steps
                a, b, c, e = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3
                pts.append((a * x0 + b * x1 + c * x2 + e * x3, a * y0 + b * y1 + c * y2 + e * y3))
        else:
            pts.append(ps[0])
        cur = ps[-1]
        i += 1 + 2 * n
    return pts


def _inside(p, box, margin=2.0):
    x, y = p
    return box[0] + margin < x < box[2] - margin and box[1] + margin < y < box[3] - margin


def test_svg_draws_a_view_of_several_as_a_node_with_an_edge_per_input():
    tree, _ = _lora_tree()
    svg = ET.fromstring(graph_svg(st.canonicalize(tree)))
    boxes = _boxes(svg)
    assert set(boxes) == {"lora/embed/a", "lora/embed/b", "lora/embed/base", "params/embed",
                          "params/head"}  # fmt: skip
    edges = _edges(svg)
    assert len(edges) == 3 + 1  # the inputs, and the view of it
    labels = sorted(t.text for t in svg.iter(f"{SVG}text") if t.get("text-anchor") == "end")
    assert labels == ["T", "a", "b", "base"]
    # each edge leaves a box's right side and ends at another's left side: the DAG, by hand
    want = {("lora/embed/a", "params/embed"), ("lora/embed/b", "params/embed"),
            ("lora/embed/base", "params/embed"), ("params/embed", "params/head")}  # fmt: skip
    got = set()
    for d in edges:
        pts = _points(d)
        (x0, y0), (x1, y1) = pts[0], pts[-1]
        src = [n for n, b in boxes.items() if abs(b[2] - x0) < 1.5 and b[1] <= y0 <= b[3]]
        dst = [n for n, b in boxes.items() if abs(b[0] - x1) < 1.5 and b[1] <= y1 <= b[3]]
        assert len(src) == 1 and len(dst) == 1, d
        got.add((src[0], dst[0]))
    assert got == want
    # the view of several is right of its inputs, the view of it right of it
    assert boxes["lora/embed/base"][2] < boxes["params/embed"][0] < boxes["params/head"][0]
    titles = _titles(svg)
    (embed,) = [t for t in titles if t.startswith("view params/embed")]
    assert all(f"{n}=lora/embed/{n}" in embed for n in ("a", "b", "base")) and "lora(2.0)" in embed


@pytest.mark.parametrize("make", [_lora_tree, _stack_tree, _subtree_tree])
def test_svg_edges_never_cross_a_box_and_end_at_distinct_rows(make):
    tree = make()[0] if make is not _subtree_tree else make()
    svg = ET.fromstring(graph_svg(st.canonicalize(tree)))
    boxes = _boxes(svg)
    ends = []
    for d in _edges(svg):
        pts = _points(d)
        for p in pts[1:-1]:
            hit = [n for n, b in boxes.items() if _inside(p, b)]
            assert not hit, (d, p, hit)
        ends.append(tuple(round(v) for v in pts[-1]))
    assert len(set(ends)) == len(ends)  # two edges into one box end apart (their labels too)


def test_svg_of_subtree_inputs_and_chains_has_an_edge_per_input_plus_views():
    tree = _subtree_tree()
    svg = ET.fromstring(graph_svg(st.canonicalize(tree)))
    # by hand, one row per Tied: sum (x, y), sumT (1), sum2 (p, q), prod (a, b)
    assert len(_edges(svg)) == 2 + 1 + 2 + 2
    texts = " ".join(t.text or "" for t in svg.iter(f"{SVG}text")) + " ".join(_titles(svg))
    for path in ("sum", "sumT", "sum2", "prod", "enc", "delta", "delta/w"):
        assert re.search(rf"(^|\s){re.escape(path)}(\s|$|\()", texts), path
    boxes = _boxes(svg)
    assert boxes["sum"][2] < boxes["sum2"][0] and boxes["sum"][2] < boxes["sumT"][0]
    assert boxes["sum"][2] < boxes["prod"][0]  # prod reads sum/w through T (sumT's source)


def test_html_of_the_examples_is_well_formed():
    for tree in (_lora_tree()[0], _stack_tree()[0], _subtree_tree()):
        root = ET.fromstring(st.canonicalize(tree)._repr_html_())
        assert root.find(f".//{SVG}svg") is not None


def test_input_names_and_paths_are_escaped_in_html():
    key = '<b onmouseover="x">&'
    tree = {key: np.ones(2, np.float32), "w": np.ones(2, np.float32)}
    tree["s"] = st.Tied({"in1": (key,), "in2": "w"}, st.add())
    page = st.canonicalize(tree)._repr_html_()
    ET.fromstring(page)
    assert "<b onmouseover" not in page and "&lt;b onmouseover=" in page


# --------------------------------------------------------------------------- DOT


def _tokens(text):
    spec = (
        r"\s+|(?P<arrow>->)|(?P<punct>[{}\[\];,=])|(?P<id>[A-Za-z_][\w.]*|-?\d+(\.\d+)?)"
        r'|(?P<str>"(?:[^"\\]|\\.)*")'
    )
    pos, out = 0, []
    for m in re.finditer(spec, text):
        assert m.start() == pos, f"not DOT at {text[pos : pos + 20]!r}"
        pos = m.end()
        for kind in ("arrow", "punct", "id", "str"):
            if m.group(kind) is not None:
                out.append((kind, m.group(kind)))
    assert pos == len(text), "trailing text"
    return out


def _unquote(tok):
    kind, s = tok
    if kind != "str":
        return s
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], s[1:-1])


def parse_dot(text):
    """A parser of the DOT subset: ``digraph ID { (attr | node | edge stmt ;)* }``."""
    toks, i = _tokens(text), 0

    def take(kind=None, value=None):
        nonlocal i
        k, v = toks[i]
        assert (kind is None or k == kind) and (value is None or v == value), (toks[i], kind, value)
        i += 1
        return toks[i - 1]

    def attrs():
        out = {}
        take("punct", "[")
        while toks[i] != ("punct", "]"):
            name = _unquote(take())
            take("punct", "=")
            out[name] = _unquote(take())
            if toks[i] == ("punct", ","):
                take()
        take("punct", "]")
        return out

    take("id", "digraph")
    take()
    take("punct", "{")
    nodes, edges = {}, []
    while toks[i] != ("punct", "}"):
        first = _unquote(take())
        if toks[i] == ("punct", "="):
            take()
            take()
        elif toks[i][0] == "arrow":
            take()
            second = _unquote(take())
            edges.append((first, second, attrs()))
        elif first in ("node", "edge", "graph"):
            attrs()
        else:
            nodes[first] = attrs()
        take("punct", ";")
    take("punct", "}")
    assert i == len(toks)
    return nodes, edges


def test_dot_is_the_dag_leaf_by_leaf():
    tree = _subtree_tree()
    nodes, edges = parse_dot(st.canonicalize(tree).to_dot())
    path = {n: a["label"].split("\n")[0] for n, a in nodes.items()}
    got = {(path[a], path[b], e["label"]) for a, b, e in edges}
    want = set()
    for view, inputs in READS_BY_HAND.items():
        for name, source in inputs.items():
            label = name
            if view == "prod" and name == "a":
                label = "a: T"  # sumT = T(sum/w)
            want.add((source, view, "T" if name is None else label))
    assert got == want
    assert len(edges) == sum(len(x) for x in READS_BY_HAND.values())
    # a view of several positions shows its transform on its node
    by_path = {path[n]: a["label"] for n, a in nodes.items()}
    assert by_path["sum/w"].split("\n")[1] == "add"
    assert by_path["prod"].split("\n")[1] == "matmul >> T"
    assert by_path["sumT"].count("\n") == 1  # path and shape only


def test_dot_of_the_examples_parses_with_every_path():
    for tree in (_lora_tree()[0], _stack_tree()[0], _subtree_tree()):
        g = st.canonicalize(tree)
        nodes, edges = parse_dot(g.to_dot(include_unshared=True))
        labels = {a["label"].split("\n")[0] for a in nodes.values()}
        leaves = jax.tree_util.tree_leaves_with_path(st.materialize(tree))
        paths = {"/".join(str(k.key) for k in kp) for kp, _ in leaves}
        assert labels == paths
        n_inputs = sum(len(v.inputs) or 1 for v in g.views.values())
        assert len(edges) == n_inputs
        assert all(a in nodes and b in nodes for a, b, _ in edges)


def test_dot_of_the_stack_names_the_take_of_the_base():
    tree, _ = _stack_tree()
    nodes, edges = parse_dot(st.canonicalize(tree).to_dot())
    path = {n: a["label"].split("\n")[0] for n, a in nodes.items()}
    got = sorted((path[a], path[b], e["label"]) for a, b, e in edges)
    assert got == [
        ("a", "layers", "a"),
        ("b", "layers", "b"),
        ("blocks", "layers", f"base: take({TAKE})"),
        ("blocks", "stack", f"take({TAKE})"),
    ]


# --------------------------------------------------------------------------- treescope


def test_treescope_renders_a_tied_of_several_refs_by_name():
    tree, _ = _lora_tree()
    text = treescope.render_to_text(tree)
    line = next(x for x in text.splitlines() if "'embed': Tied(" in x)
    note = line.split("# \u2192 view of ")[1]
    assert all(f"{n}=lora/embed/{n}" in note for n in ("a", "b", "base"))
    assert note.endswith("via lora(2.0)")
    page = treescope.render_to_html(tree, compressed=False)
    assert "a=lora/embed/a" in page
    # a climbing ref is shown as written
    climbs = st.Tied({"p": "../w", "q": "v"}, st.add())
    climb = {"w": np.ones(2), "x": {"v": np.ones(2), "s": climbs}}
    assert "p=../w, q=v" in treescope.render_to_text(climb)


def test_treescope_materialized_marks_views_of_several_and_their_values():
    tree, embed = _lora_tree()
    marked = st.treescope_materialized(tree).marked_tree()
    is_mark = lambda x: isinstance(x, _Mark)  # noqa: E731
    m_embed, m_head = marked["params"]["embed"], marked["params"]["head"]
    np.testing.assert_allclose(np.asarray(m_embed.value), embed, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(m_head.value), embed.T, rtol=1e-5, atol=1e-5)
    assert all(f"{n}=lora/embed/{n}" in m_embed.badge for n in ("a", "b", "base"))
    assert "lora(2.0)" in m_embed.badge
    assert m_head.badge == "[view of params/embed via T]"
    # a view of several has its own colour, and a view of it shares it
    own = formatting_util.color_from_string("params/embed")
    assert m_embed.color == own == m_head.color
    for name in ("a", "b", "base"):  # each buffer: both views read it (by hand)
        m = marked["lora"]["embed"][name]
        assert is_mark(m) and m.badge == "[buffer: 2 views]"
        assert "params/embed" in m.note and "params/head" in m.note
    text = repr(st.treescope_materialized(tree))
    assert "[view of params/embed via T]" in text


def test_treescope_materialized_of_subtree_inputs_and_chains():
    tree = _subtree_tree()
    marked = st.treescope_materialized(tree).marked_tree()
    enc, delta = tree["enc"], tree["delta"]
    by_hand = {"w": enc["w"] + delta["w"], "b": enc["b"] + delta["b"]}
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(marked["sum"][k].value), by_hand[k])
        np.testing.assert_array_equal(np.asarray(marked["sum2"][k].value), by_hand[k] + enc[k])
        assert marked["sum2"][k].badge == f"[view of p=sum/{k}, q=enc/{k} via add]"
    np.testing.assert_allclose(
        np.asarray(marked["prod"].value), (by_hand["w"].T @ delta["w"]).T, rtol=1e-6
    )
    assert "a=sum/w >> T" in marked["prod"].badge
    repr(st.treescope_materialized(tree))  # renders
