import html
import math
import re
import time
import xml.etree.ElementTree as ET

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope
from _raises import raises
from treescope import formatting_util

import sharetree as st
from sharetree._display import graph_html, graph_svg
from sharetree._tables import format_bytes, saved_percent
from sharetree._treescope import _Mark


def _tree():
    return {
        "enc": {"kernel": np.ones((4, 3), np.float32), "bias": np.zeros(3, np.float32)},
        "dec": {"kernel": st.Tied("enc/kernel", st.T), "bias": np.zeros(4, np.float32)},
        "again": st.Tied("enc"),
        "steps": np.int32(3),
        "name": "ae",
    }


def _expanded_by_hand(tree):
    """Sizes and bytes of the materialized tree, counted leaf by leaf (no sharetree graph)."""
    leaves = [x for x in jax.tree.leaves(st.materialize(tree)) if hasattr(x, "dtype")]
    return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


def _unique_by_hand(tree):
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


# --------------------------------------------------------------------------- summary


def test_summary_exact_text():
    tree = {"enc": np.zeros((2, 3), np.float32), "dec": st.Tied("enc", st.T)}
    assert st.summary(tree) == "\n".join(
        [
            "sharing graph: 1 buffer, 1 view",
            "          unique  expanded  saved",
            "  leaves  1       2         50.0%",
            "  params  6       12        50.0%",
            "  bytes   24 B    48 B      50.0%",
            "buffers:",
            "  path  shape   dtype    bytes  views",
            "  enc   (2, 3)  float32  24 B   1",
            "views:",
            "  path  buffer  transform  shape   dtype    bytes",
            "  dec   enc     T          (3, 2)  float32  24 B",
        ]
    )


def test_summary_totals_match_counts_by_hand():
    tree = _tree()
    text = st.summary(tree)
    size_u, bytes_u = _unique_by_hand(tree)
    size_e, bytes_e = _expanded_by_hand(tree)
    assert (size_u, size_e) == (12 + 3 + 4 + 1, 12 + 3 + 4 + 1 + 12 + 12 + 3)
    params = re.search(r"^  params\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)%$", text, re.M)
    assert params is not None, text
    assert int(params[1].replace(",", "")) == size_u
    assert int(params[2].replace(",", "")) == size_e
    assert float(params[3]) == pytest.approx(round(100 * (1 - size_u / size_e), 1))
    row = re.search(r"^  bytes\s+(.+?)\s{2,}(.+?)\s{2,}([\d.]+)%$", text, re.M)
    assert row is not None
    assert (row[1], row[2]) == (format_bytes(bytes_u), format_bytes(bytes_e))
    assert float(row[3]) == pytest.approx(round(100 * (1 - bytes_u / bytes_e), 1))
    leaves = re.search(r"^  leaves\s+(\d+)\s+(\d+)", text, re.M)
    assert leaves is not None
    n_materialized = len(jax.tree.leaves(st.materialize(tree)))
    assert (int(leaves[1]), int(leaves[2])) == (len(jax.tree.leaves(tree)), n_materialized)


def test_summary_lists_every_buffer_and_view_with_details():
    text = st.summary(_tree())
    # 3 views: dec/kernel, and again/kernel + again/bias from the one subtree tie at again
    assert text.splitlines()[0] == "sharing graph: 5 buffers, 3 views (from 2 ties)"
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ")}
    # enc is read whole by the subtree tie: one row, 12 + 3 float32 = 60 bytes, read by 2 rows
    assert rows["enc"][1:] == ["2", "leaves", "float32", "60", "B", "2"]
    assert "enc/kernel" not in rows and "enc/bias" not in rows
    assert rows["dec/bias"][-1] == "0"
    assert rows["steps"][1:3] == ["()", "int32"]
    assert rows["name"][1:3] == ["static", "-"]
    assert rows["dec/kernel"][1:] == ["enc/kernel", "T", "(3,", "4)", "float32", "48", "B"]
    assert rows["again"][1:] == ["enc", "identity", "2", "leaves", "float32", "60", "B"]
    assert "again/kernel" not in rows and "again/bias" not in rows


def _demo_params():
    from sharetree._demo import Config, init_params

    return init_params(0, 11, Config(context=8, d_model=8, heads=2))


def _block_by_hand(params):
    """The demo's first block: its leaves and bytes, counted with jax.tree (no sharetree)."""
    leaves = jax.tree.leaves(params["block_0"])
    return len(leaves), sum(x.size * x.dtype.itemsize for x in leaves)


def test_summary_shows_a_subtree_tie_as_one_row():
    params = _demo_params()
    n, nbytes = _block_by_hand(params)
    assert n == 16
    text = st.summary(params)
    assert text.splitlines()[0] == "sharing graph: 20 buffers, 17 views (from 2 ties)"
    views = text.split("views:\n")[1].splitlines()
    assert [line.split()[:3] for line in views] == [
        ["path", "buffer", "transform"],
        ["block_1", "block_0", "identity"],
        ["head/kernel", "embed/embedding", "T"],
    ]
    assert views[1].split()[3:] == ["16", "leaves", "float32", *format_bytes(nbytes).split()]
    buffers = text.split("buffers:\n")[1].split("views:")[0].splitlines()
    assert len(buffers) == 1 + 5  # header; block_0, embed, ln_f bias and scale, pos
    assert buffers[1].split() == ["block_0", "16", "leaves", "float32",
                                  *format_bytes(nbytes).split(), "1"]  # fmt: skip
    assert not any("block_0/" in line or "block_1/" in line for line in text.splitlines())
    # cut after 3 rows: the shared rows first, and the hidden ones counted in leaves
    short = st.summary(params, max_rows=1)
    assert "... and 4 more buffers" in short  # 16 of 20 shown (block_0)
    assert "... and 1 more views" in short  # the 16 views of block_1 shown, head/kernel not


def test_a_leaf_tie_whose_keys_hold_a_slash_shows_its_shape_not_a_subtree():
    # paths with "/" in a key are tuples; the row is still one leaf's, with its shape
    params = {"a/b": np.ones(2, np.float32), "c/d": st.Tied(("a/b",))}
    views = st.summary(params).split("views:\n")[1].splitlines()
    assert views[1].split() == ["('c/d',)", "('a/b',)", "identity", "(2,)", "float32", "8", "B"]


def test_subtree_tie_rows_in_html_have_their_leaves_behind_a_disclosure():
    params = _demo_params()
    g = st.canonicalize(params)
    root = ET.fromstring(g._repr_html_())
    tables = root.findall("./table")
    assert len(tables) == 3  # totals, buffers, views (the leaf tables are nested inside)
    view_rows = [tr for tr in tables[2].find("tbody").findall("tr")]
    plain = [tr for tr in view_rows if tr.find("td/details") is None]
    top = [["".join(td.itertext()) for td in tr] for tr in plain]
    assert [r[:3] for r in top] == [["block_1", "block_0", "identity"],
                                    ["head/kernel", "embed/embedding", "T"]]  # fmt: skip
    (details,) = [tr.find("td/details") for tr in view_rows if tr.find("td/details") is not None]
    assert "".join(details.find("summary").itertext()) == "the 16 leaves of block_1"
    inner = [["".join(td.itertext()) for td in tr] for tr in details.iter("tr")][1:]
    by_hand = {
        "block_1/" + "/".join(k.key for k in kp): x
        for kp, x in jax.tree_util.tree_leaves_with_path(params["block_0"])
    }
    assert [r[0] for r in inner] == sorted(by_hand)
    assert all(r[1] == "block_0/" + r[0].removeprefix("block_1/") for r in inner)
    assert all(r[3] == str(tuple(by_hand[r[0]].shape)) for r in inner)
    buffer_details = tables[1].find("tbody/tr/td/details")
    assert "".join(buffer_details.find("summary").itertext()) == "the 16 leaves of block_0"
    assert len(buffer_details.findall(".//tbody/tr")) == 16


def test_svg_draws_a_subtree_tie_as_one_edge():
    params = _demo_params()
    _, nbytes = _block_by_hand(params)
    svg = ET.fromstring(graph_svg(st.canonicalize(params)))
    ns = "{http://www.w3.org/2000/svg}"
    assert len(list(svg.iter(f"{ns}path"))) == 2 + 1  # block_1 <- block_0, head <- embed; arrow
    texts = [t.text for t in svg.iter(f"{ns}text")]
    assert "block_0  (16 leaves)" in texts
    assert f"block_1  (16 leaves, {format_bytes(nbytes)})" in texts
    assert not any("block_0/" in t or "block_1/" in t for t in texts)
    titles = ["".join(t.itertext()) for t in svg.iter(f"{ns}title")]
    block = next(t for t in titles if t.startswith("view block_1"))
    assert block.startswith("view block_1 = identity(block_0): block_1/attn/key/bias, ")


def test_subtree_ties_nested_and_through_other_ties():
    w = np.ones((2, 3), np.float32)
    tree = {
        "a": {"inner": {"x": w, "y": np.zeros(3, np.float32)}, "z": np.zeros(2, np.float32)},
        "b": st.Tied("a"),  # reads all of a
        "c": st.Tied("a/inner", st.scale(2.0)),  # reads a part of a: a's row holds it
        "d": {"p": st.Tied("a/z"), "q": np.zeros(1, np.float32)},
        "e": st.Tied("d"),  # e/p reads a/z through d/p's tie, e/q reads d/q
    }
    text = st.summary(tree)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ")}
    assert rows["a"][1:4] == ["3", "leaves", "float32"]  # the outermost subtree read
    assert "a/inner" not in rows
    assert rows["b"][1:5] == ["a", "identity", "3", "leaves"]
    assert rows["c"][1:5] == ["a/inner", "scale(2.0)", "2", "leaves"]
    assert rows["d/p"][1:3] == ["a/z", "identity"]
    # e's leaves read a/z and d/q: no one subtree, so the ref as written
    assert rows["e"][1:5] == ["d", "identity", "2", "leaves"]
    assert rows["d"][1:3] == ["1", "leaf"]  # d/q, under d, which e reads
    materialized = st.materialize(tree)
    assert len(jax.tree.leaves(materialized["e"])) == 2


def test_summary_composes_chained_transforms_in_order():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    tree = {"w": w, "a": st.Tied("w", st.reshape(3, 2)), "b": st.Tied("a", st.T)}
    line = next(x for x in st.summary(tree).splitlines() if x.startswith("  b "))
    # b = T(reshape(w)): reshape first, then transpose, giving (2, 3)
    cells = ["b", "w", "reshape(3,", "2)", ">>", "T", "(2,", "3)", "float32", "24", "B"]
    assert line.split() == cells
    assert st.materialize(tree)["b"].shape == w.reshape(3, 2).T.shape


def test_summary_without_ties_and_of_a_graph():
    tree = {"a": np.zeros(3, np.float32), "b": [np.ones(2, np.float64)]}
    text = st.summary(tree)
    assert "0 views" in text and "(none: nothing is shared)" in text
    assert re.search(r"^  params\s+5\s+5\s+0\.0%$", text, re.M)
    assert st.summary(st.canonicalize(tree)) == text


def test_summary_of_empty_tree():
    text = st.summary({})
    assert text.startswith("sharing graph: 0 buffers, 0 views")
    assert "buffers:\n  (none)" in text


def test_summary_cuts_long_tables_and_keeps_shared_buffers():
    tree = {f"l{i:03d}": np.zeros(2, np.float32) for i in range(200)}
    tree = st.tie(tree, {f"l{i:03d}": "l150" for i in range(160, 190)})
    t0 = time.perf_counter()
    text = st.summary(tree, max_rows=5)
    assert time.perf_counter() - t0 < 5.0
    assert "... and 165 more buffers" in text  # 170 buffers, 5 shown
    assert "... and 25 more views" in text  # 30 views, 5 shown
    assert "  l150 " in text  # the shared buffer is shown although it is late in flatten order
    buffer_rows = text.split("buffers:\n")[1].split("views:")[0].splitlines()
    assert len(buffer_rows) == 1 + 5 + 1  # header, rows, "... and K more"


def test_summary_bad_input():
    with raises("E55", "summary: max_rows", "found 0"):
        st.summary({"a": np.zeros(2)}, max_rows=0)
    with raises("E1", "'dec'", "'encc'", "'enc'"):
        st.summary({"enc": np.zeros(2), "dec": st.Tied("encc")})


def test_format_helpers():
    assert [format_bytes(n) for n in (0, 1023, 1024, 10 * 2**30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "10.0 GiB",
    ]
    assert saved_percent(1, 4) == 75.0 and saved_percent(5, 5) == 0.0


# --------------------------------------------------------------------------- HTML / SVG


NASTY = "<script>alert(\"x\")</script> & 'q'"


def _nasty_tree():
    return {
        "enc": {NASTY: np.ones((2, 3), np.float32)},
        "dec<b>": st.Tied(("enc", NASTY), st.T),
        "plain": np.zeros(2, np.float32),
    }


def test_repr_html_is_well_formed_and_escapes_everything():
    g = st.canonicalize(_nasty_tree())
    page = g._repr_html_()
    assert "<script>" not in page and "dec<b>" not in page
    assert html.escape("dec<b>") in page
    root = ET.fromstring(page)  # well-formed XML: nothing unescaped broke the markup
    text = "".join(root.itertext())
    assert "dec<b>" in text and '<script>alert("x")</script>' in text
    assert root.find(".//{http://www.w3.org/2000/svg}svg") is not None


def test_repr_html_tables_and_totals():
    tree = _tree()
    g = st.canonicalize(tree)
    root = ET.fromstring(g._repr_html_())
    tables = root.findall("./table")
    assert len(tables) == 3  # totals, buffers, views
    rows = [[("".join(td.itertext())) for td in tr] for tr in tables[0].iter("tr")]
    size_u, bytes_u = _unique_by_hand(tree)
    size_e, bytes_e = _expanded_by_hand(tree)
    assert rows[2] == [
        "params",
        f"{size_u:,}",
        f"{size_e:,}",
        f"{100 * (1 - size_u / size_e):.1f}%",
    ]
    assert rows[3][1:3] == [format_bytes(bytes_u), format_bytes(bytes_e)]

    def top_rows(table):  # the table's own rows, without the disclosures' nested rows
        trs = [tr for tr in table.find("tbody").findall("tr") if tr.find("td/details") is None]
        return [["".join(td.itertext()) for td in tr] for tr in trs]

    def nested_rows(table):  # the rows behind each disclosure, by its summary line
        out = {}
        for d in table.iter("details"):
            out["".join(d.find("summary").itertext())] = [
                ["".join(td.itertext()) for td in tr] for tr in d.find("table/tbody")
            ]
        return out

    # enc is read whole by the tie at again: one row, its two buffers behind a disclosure
    assert [r[0] for r in top_rows(tables[1])] == ["dec/bias", "enc", "name", "steps"]
    (inner,) = nested_rows(tables[1]).values()
    assert [r[0] for r in inner] == ["enc/bias", "enc/kernel"]
    by_path = {b.path: b for b in g.buffers}
    assert [r[4] for r in inner] == [str(by_path[r[0]].num_views) for r in inner]
    assert [r[4] for r in inner] == ["1", "2"]  # enc/kernel: again/kernel and dec/kernel
    assert {(r[0], r[1], r[2]) for r in top_rows(tables[2])} == {
        ("dec/kernel", "enc/kernel", "T"),
        ("again", "enc", "identity"),
    }
    views_inside = nested_rows(tables[2])["the 2 leaves of again"]
    assert {(r[0], r[1], r[2]) for r in views_inside} == {
        ("again/kernel", "enc/kernel", "identity"),
        ("again/bias", "enc/bias", "identity"),
    }


def test_repr_html_without_views_has_no_drawing():
    page = st.canonicalize({"a": np.zeros(2)})._repr_html_()
    ET.fromstring(page)
    assert "<svg" not in page and "nothing is shared" in page


def test_svg_draws_each_view_and_labels_non_identity_edges():
    g = st.canonicalize(_tree())
    svg = ET.fromstring(graph_svg(g))
    ns = "{http://www.w3.org/2000/svg}"
    titles = ["".join(t.itertext()) for t in svg.iter(f"{ns}title")]
    assert sorted(t for t in titles if t.startswith("buffer")) == [
        "buffer enc/kernel",
        "buffer enc: enc/bias, enc/kernel",
    ]
    assert sorted(t for t in titles if t.startswith("view")) == [
        "view again = identity(enc): again/bias, again/kernel",
        "view dec/kernel = T(enc/kernel)",
    ]
    assert len(list(svg.iter(f"{ns}path"))) == 2 + 1  # two edges (one a subtree's), arrow head
    labels = [t.text for t in svg.iter(f"{ns}text") if t.get("text-anchor") == "end"]
    assert labels == ["T"]


def test_html_of_a_large_tree_is_cut_and_fast():
    n = 3000  # 3000 layers: 2000 tied to layer0 (transposed), 1000 unshared
    tree = {f"layer{i}": {"w": np.zeros((2, 2), np.float32)} for i in range(n)}
    for i in range(1, n, 3):
        tree[f"layer{i}"]["w"] = st.Tied("layer0/w", st.T)
        tree[f"layer{i + 1}"]["w"] = st.Tied("layer0/w", st.T)
    n_views = len(range(1, n, 3)) * 2
    t0 = time.perf_counter()
    g = st.canonicalize(tree)
    page = g._repr_html_()
    text = st.summary(g)
    assert time.perf_counter() - t0 < 5.0
    assert len(page) < 60_000
    root = ET.fromstring(page)
    ns = "{http://www.w3.org/2000/svg}"
    views_drawn = [t for t in root.iter(f"{ns}title") if "".join(t.itertext()).startswith("view")]
    assert len(views_drawn) == 20
    assert f"... and {n_views - 20:,} more views" in page
    assert f"... and {n_views - 20:,} more views" in text
    assert f"... and {n - n_views - 20:,} more buffers" in page


# --------------------------------------------------------------------------- DOT


def _dot_graph(dot):
    nodes = dict(re.findall(r'^  (\w+) \[label="((?:[^"\\]|\\.)*)"', dot, re.M))
    edges = re.findall(r'^  (\w+) -> (\w+) \[label="((?:[^"\\]|\\.)*)"\];$', dot, re.M)
    return nodes, edges


def test_to_dot_edges_match_the_views():
    g = st.canonicalize(_tree())
    dot = g.to_dot()
    assert dot.startswith("digraph sharing {") and dot.endswith("}")
    nodes, edges = _dot_graph(dot)
    got = {(nodes[a].split("\\n")[0], nodes[b].split("\\n")[0], t) for a, b, t in edges}
    want = {(v.buffer, v.path, repr(v.transform)) for v in g.views.values()}
    assert got == want
    assert "dec/bias" not in dot  # buffers without views are left out by default
    full = g.to_dot(include_unshared=True)
    assert "dec/bias\\nfloat32[4]" in full and "name\\nstatic" in full


def test_to_dot_escapes_quotes_and_backslashes():
    key = 'we"ird\\key'
    g = st.canonicalize({key: np.zeros(2, np.float32), "v": st.Tied((key,), st.scale(-1.0))})
    nodes, edges = _dot_graph(g.to_dot())
    assert len(edges) == 1
    assert nodes[edges[0][0]] == 'we\\"ird\\\\key\\nfloat32[2]'


# --------------------------------------------------------------------------- treescope


def test_treescope_renders_tied_with_ref_transform_and_link():
    tree = _tree()
    text = treescope.render_to_text(tree)
    assert "'kernel': Tied('enc/kernel', T),  # → view of enc/kernel via T" in text
    assert "'again': Tied('enc'),  # → view of enc" in text
    page = treescope.render_to_html(tree, compressed=False)
    assert "Tied" in page and "view of enc/kernel via T" in page
    assert formatting_util.color_from_string("enc/kernel") in page


def test_treescope_tied_text_matches_its_repr():
    for tied in (st.Tied("a/b"), st.Tied(("x/y", "z"), st.T >> st.scale(2.0))):
        assert treescope.render_to_text({"t": tied}) == f"{{'t': {tied!r}}}"  # collapsed
        text = treescope.render_to_text({"t": tied, "pad": np.arange(30.0).reshape(3, 10)})
        assert f"'t': {tied!r},  # → view of {st._paths.path_str(tied.ref)}" in text


def test_treescope_escapes_tied_refs_in_html():
    ref = '<b onmouseover="alert(1)">&'
    page = treescope.render_to_html({"d": st.Tied(ref, st.T)}, compressed=False)
    assert "<b onmouseover" not in page
    assert "&lt;b onmouseover=" in page


def test_treescope_texts_escape_what_moves_a_terminal_in_keys():
    # a tree loaded from a file may hold any key: no escape or newline reaches the terminal
    for key in ("k\x1b[2J", "a\nb"):
        tree = {key: np.ones(2, np.float32), "v": st.Tied((key,), st.T)}
        for text in (treescope.render_to_text(tree), repr(st.treescope_materialized(tree))):
            assert "\x1b" not in text and "a\nb" not in text
            assert repr(key)[1:-1] in text  # shown escaped, as Python writes it
        summary = st.summary(tree)
        assert "\x1b" not in summary and "a\nb" not in summary and repr(key)[1:-1] in summary


def test_treescope_materialized_marks_views_and_buffers():
    tree = _tree()
    shown = st.treescope_materialized(tree)
    text = repr(shown)
    assert text.startswith("# materialized tree; sharing graph: 5 buffers, 3 views")
    assert "'kernel': [view of enc/kernel via T]" in text
    assert "[buffer: 2 views]" in text and "shared with again/kernel, dec/kernel" in text
    assert "'bias': [view of enc/bias]" in text and "# from Tied at again" in text
    bundle = shown._repr_mimebundle_()
    assert "[view of enc/kernel via T]" in bundle["text/html"]
    assert bundle["text/plain"] == text


def test_treescope_materialized_values_are_the_materialized_tree():
    tree = _tree()
    marked = st.treescope_materialized(tree).marked_tree()
    is_mark = lambda x: isinstance(x, _Mark)  # noqa: E731
    unwrapped = jax.tree.map(lambda x: x.value if is_mark(x) else x, marked, is_leaf=is_mark)
    want = st.materialize(tree)
    assert jax.tree.structure(unwrapped) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(unwrapped), jax.tree.leaves(want), strict=True):
        if isinstance(b, str):
            assert a == b
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    marks = [x for x in jax.tree.leaves(marked, is_leaf=is_mark) if is_mark(x)]
    assert len(marks) == 3 + 2  # three views, two buffers that have views
    for m in marks:  # a buffer and its views share a colour
        buf = m.badge.split()[2].rstrip("]") if m.badge.startswith("[view") else None
        if buf is not None:
            assert m.color == formatting_util.color_from_string(buf)


def test_treescope_with_an_equinox_module():
    class AE(eqx.Module):
        enc: eqx.nn.Linear
        dec: eqx.nn.Linear

    key1, key2 = jax.random.split(jax.random.key(0))
    model = AE(eqx.nn.Linear(3, 2, key=key1), eqx.nn.Linear(2, 3, key=key2))
    model = st.tie(model, {"dec/weight": st.Tied("enc/weight", st.T)})
    text = treescope.render_to_text(model)
    assert "weight=Tied('enc/weight', T),  # → view of enc/weight via T" in text
    shown = repr(st.treescope_materialized(model))
    assert "weight=[view of enc/weight via T]" in shown
    assert "weight=[buffer: 1 view]" in shown
    np.testing.assert_array_equal(
        st.treescope_materialized(model).marked_tree().dec.weight.value, model.enc.weight.T
    )


def test_graph_display_under_jit_structure_only():
    # The HTML only needs shapes: a tree of ShapeDtypeStructs displays too.
    tree = {"w": jax.ShapeDtypeStruct((3, 5), jnp.bfloat16), "v": st.Tied("w", st.T)}
    text = st.summary(tree)
    assert "(5, 3)  bfloat16" in text
    assert math.isclose(float(re.search(r"([\d.]+)%", text)[1]), 50.0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "5", None, True])
def test_max_rows_must_be_a_positive_int_everywhere(bad):
    tree = {"a": np.zeros(2), "b": st.Tied("a")}
    g = st.canonicalize(tree)
    wrong_type = isinstance(bad, bool) or not isinstance(bad, int)
    cls = st.TieTypeError if wrong_type else st.TieError
    for where, call in (
        ("summary", lambda: st.summary(tree, max_rows=bad)),
        ("graph_html", lambda: graph_html(g, max_rows=bad)),
        ("graph_svg", lambda: graph_svg(g, max_rows=bad)),
        ("grad_report", lambda: st.grad_report({"a": {"a": np.ones(2)}}, max_rows=bad)),
    ):
        with raises("E55", f"{where}: max_rows", "an int >= 1", repr(bad), cls=cls):
            call()
