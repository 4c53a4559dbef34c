"""sharetree._files.header: a file's untrusted ``sharetree.*`` metadata, checked field by field.

Every malformed file is a TieError naming the file, the node's path and the field
(``_raises.raises``: the code, then the facts the message must show).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from _files import TIED, read_raw, tampered, write_with_metadata
from _raises import message, raises

import sharetree as st
from sharetree.__main__ import describe
from sharetree._files.format import FIELDS, FORMAT_VERSION

# ------------------------------------------------------------------- the table


def test_the_table_of_fields_is_the_documented_format() -> None:
    """``FIELDS`` names the node kinds and fields of "The file format" in the docs, no more."""
    doc = (Path(__file__).parents[1] / "docs" / "saving_and_scaling.md").read_text()
    section = doc.split("### The file format")[1].split("\n## ")[0]
    documented: dict[str, set[str]] = {}
    for kinds, fields in re.findall(r"^\| (`\w+`(?:, `\w+`)*) \|([^|]*)\|", section, re.M):
        for kind in re.findall(r"`(\w+)`", kinds):
            documented[kind] = set(re.findall(r"`(\w+)`", re.sub(r"\(.*?\)", "", fields)))
    del documented["t"]  # the table's heading
    assert documented == {kind: {f.name for f in fields} for kind, fields in FIELDS.items()}


# ------------------------------------------------ format version and tree JSON


def test_newer_format_version(tmp_path) -> None:
    def bump(tensors, meta, structure):
        meta["sharetree.format_version"] = str(FORMAT_VERSION + 1)
        meta["sharetree.library_version"] = "9.0"

    bad = tampered(tmp_path, TIED, bump)
    newer, reads = f"version {FORMAT_VERSION + 1}", f"up to {FORMAT_VERSION}"
    with raises("E126", "bad.safetensors", newer, "'9.0'", reads, "pip install -U"):
        st.load(bad)


def test_malformed_format_version(tmp_path) -> None:
    for version in ("one", "0", "000"):  # versions start at 1
        edit = lambda t, m, s, v=version: m.update({"sharetree.format_version": v})  # noqa: E731
        bad = tampered(tmp_path, TIED, edit)
        with raises("E29", "bad.safetensors", "sharetree.format_version", f"'{version}'"):
            st.load(bad)


def test_metadata_not_json(tmp_path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, TIED)
    tensors, meta = read_raw(good)
    meta["sharetree.tree"] = "{not json"
    write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
    with raises("E29", "b.safetensors", "sharetree.tree", "not valid JSON", "JSONDecodeError"):
        st.load(tmp_path / "b.safetensors")


def test_missing_tree_metadata(tmp_path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, TIED)
    tensors, meta = read_raw(good)
    del meta["sharetree.tree"]
    write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
    with raises("E29", "b.safetensors", "no 'sharetree.tree'", "st.save"):
        st.load(tmp_path / "b.safetensors")


def test_deeply_nested_metadata_is_a_tie_error(tmp_path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, TIED)
    tensors, meta = read_raw(good)
    lists = '{"t":"list","children":[' * 250 + '{"t":"none"}' + "]}" * 250
    deep = ("E30", "Python recurses")
    for text, outcomes in [
        ("[" * 100_000 + "]" * 100_000, [deep]),  # json.loads stops at the recursion limit
        # unterminated: CPython < 3.13's decoder recurses and stops at the limit, 3.13's
        # reaches the end of the text first; either way a TieError naming the file
        ('{"t":"list","children":' + "[" * 5000, [deep, ("E29", "not valid JSON")]),
        (lists, [("E30", "deeper than 200 levels")]),  # parsed, refused by depth
        # parsed or not (that depends on the stack), a value echoed in the message
        *[
            (f'{{"t":"static","type":{"[" * n}{"]" * n}}}', [deep, ("E29", "'type'")])
            for n in (600, 990)
        ],
    ]:
        meta["sharetree.tree"] = text
        write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
        for read in (st.load, describe):
            with pytest.raises(st.TieError) as e:
                read(tmp_path / "b.safetensors")
            text = message(e.value)
            assert "b.safetensors" in text, text
            assert any(e.value.code == c and fact in text for c, fact in outcomes), text
    meta["sharetree.tree"] = '["' + '\\"' * 200_000  # an unterminated string
    write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
    with raises("E29", "b.safetensors", "not valid JSON"):
        st.load(tmp_path / "b.safetensors")


def test_tree_json_naming_a_field_twice_is_refused(tmp_path) -> None:
    good = tmp_path / "g.safetensors"
    st.save(good, {"w": np.ones(2, np.float32), "v": st.Tied("w")})
    tensors, meta = read_raw(good)
    text = meta["sharetree.tree"]  # a second "children" would silently drop the tie at 'v'
    meta["sharetree.tree"] = (
        text[:-1] + ',"children":[' + json.dumps(json.loads(text)["children"][0]) + "]}"
    )
    write_with_metadata(tmp_path / "b.safetensors", tensors, meta)
    with raises("E52", "b.safetensors", "'children' twice"):
        st.load(tmp_path / "b.safetensors")


# ------------------------------------------------------------ nodes and fields


def test_metadata_malformed_structure(tmp_path) -> None:
    def drop(tensors, meta, structure):
        i = structure["keys"].index("enc")
        del structure["children"][i]["children"][0]["t"]

    with raises("E29", "bad.safetensors", "'enc/w'", "field 't'", "a node kind", "missing"):
        st.load(tampered(tmp_path, TIED, drop))

    def unknown(tensors, meta, structure):
        structure["t"] = "hypercube"

    with raises("E126", "bad.safetensors", "'<root>'", "'hypercube'", "upgrade sharetree"):
        st.load(tampered(tmp_path, TIED, unknown))


def _set(key: str, value: Any, where: str = "enc/w") -> Any:
    """An edit of the saved TIED that sets field ``key`` of the node at ``where``."""

    def edit(tensors, meta, structure):
        node = structure
        for k in where.split("/") if where else []:
            node = node["children"][node["keys"].index(k)]
        if value is _DROP:
            del node[key]
        else:
            node[key] = value

    return edit


_DROP = object()


@pytest.mark.parametrize(
    "edit, where, code, facts",
    [
        (_set("ref", [], "head"), "head", "E29", ["'ref'", "non-empty list", "list []"]),
        (_set("ref", "embed", "head"), "head", "E29", ["'ref'", "non-empty list", "'embed'"]),
        (_set("ref", [None], "head"), "head", "E29", ["'ref'", "str or int keys", "[None]"]),
        (_set("transform", "T", "head"), "head", "E29", ["'transform'", "JSON object", "'T'"]),
        (_set("transform", {"name": "chain", "parts": 3}, "head"), "head", "E20", ["'parts'"]),
        (_set("t", 3), "enc/w", "E29", ["field 't'", "a node kind", "int 3"]),
        (_set("shape", [2, -3]), "enc/w", "E29", ["'shape'", "sizes >= 0", "[2, -3]"]),
        (_set("shape", [2.0, 3]), "enc/w", "E29", ["'shape'", "[2.0, 3]"]),
        (_set("shape", [True, 3]), "enc/w", "E29", ["'shape'", "[True, 3]"]),
        (_set("shape", _DROP), "enc/w", "E29", ["'shape'", "missing"]),
        (_set("dtype", "object"), "enc/w", "E29", ["'dtype'", "numeric dtype", "'object'"]),
        (_set("dtype", ["f4"]), "enc/w", "E29", ["'dtype'", "['f4']"]),
        (_set("dtype", "float64"), "enc/w", "E127", ["'enc/w'", "float64[2, 3]", "float32[2, 3]"]),
        (_set("raw", "no"), "enc/w", "E29", ["'raw'", "true or false", "'no'"]),
        (_set("raw", True), "enc/w", "E127", ["uint8[24]", "bytes of float32[2, 3]"]),
        (_set("scalar", True), "enc/w", "E29", ["'scalar'", "[2, 3]"]),
        (_set("tensor", 7), "enc/w", "E29", ["'tensor'", "int 7"]),
        (_set("tensor", "nope"), "enc/w", "E127", ["'nope'", "no such tensor"]),
        (_set("tensor", "embed"), "enc/w", "E127", ["'embed'", "float32[4, 3]"]),
        (_set("key", "threefry2x32"), "enc/w", "E29", ["'key'", "uint32", "float32"]),
        (_set("key", "os.system"), "enc/w", "E29", ["'key'", "threefry2x32", "'os.system'"]),
        (_set("keys", "ab", "enc"), "enc", "E29", ["'keys'", "str or int keys", "'ab'"]),
        (_set("keys", ["w", "w"], "enc"), "enc", "E29", ["'keys'", "distinct", "['w', 'w']"]),
        (_set("keys", [0, "b"], "enc"), "enc", "E31", ["str and int keys", "[0, 'b']"]),
        (_set("children", {}, "enc"), "enc", "E29", ["'children'", "a list of nodes", "{}"]),
        (_set("children", [1, 2], "enc"), "enc/w", "E29", ["a JSON object", "int 1"]),
    ],
)
def test_every_malformed_field_names_file_and_path(tmp_path, edit, where, code, facts) -> None:
    bad = tampered(tmp_path, TIED, edit)
    with raises(code, "bad.safetensors", f"'{where}'", *facts):
        st.load(bad)


def test_malformed_value_leaves(tmp_path) -> None:
    tree = {"n": 3, "s": "x", "c": 1 + 2j, "w": np.ones(1)}
    for key, value, facts in [
        ("n", {"t": "value", "type": "int", "value": "3"}, ["'value'", "int value", "'3'"]),
        ("n", {"t": "value", "type": "module", "value": 3}, ["'type'", "bool", "'module'"]),
        ("n", {"t": "value", "type": "int"}, ["'value'", "missing"]),
        ("c", {"t": "value", "type": "complex", "value": [1]}, ["'value'", "[1]"]),
        ("s", {"t": "static", "type": 5}, ["'type'", "a type name", "int 5"]),
        ("s", {"t": "node", "type": "x.Y", "keys": ["a"], "children": []}, ["distinct keys"]),
    ]:

        def edit(tensors, meta, structure, key=key, value=value):
            structure["children"][structure["keys"].index(key)] = value

        with raises("E29", "bad.safetensors", f"'{key}'", *facts):
            st.load(tampered(tmp_path, tree, edit))


def test_key_field_needs_format_version_2(tmp_path) -> None:
    def downgrade(tensors, meta, structure):
        meta["sharetree.format_version"] = "1"

    bad = tampered(tmp_path, {"k": jax.random.key(0)}, downgrade)
    with raises("E29", "'k'", "field 'key'", "format version 2", "version 1"):
        st.load(bad)

    def other_shape(tensors, meta, structure):  # threefry keys are 2 words each
        tensors["<root>"] = np.zeros(3, np.uint32)
        structure["shape"] = [3]

    bad = tampered(tmp_path, jax.random.key(0), other_shape)
    with raises("E29", "'<root>'", "field 'key'", "threefry2x32 keys", "uint32[3]"):
        st.load(bad)


def test_file_content_in_messages_is_cut_and_type_names_are_checked(tmp_path) -> None:
    def kind(tensors, meta, structure):
        structure["t"] = "[" * 10_000

    path = tampered(tmp_path, TIED, kind)
    with raises("E126", "'<root>'", "re:'\\[{50}", "upgrade sharetree") as e:
        st.load(path)
    assert len(str(e.value).replace(str(path), "")) < 300  # the file's text cut, whatever the path
    bad = tampered(
        tmp_path, TIED, lambda t, m, s: m.update({"sharetree.format_version": "9" * 5000})
    )
    with raises("E29", "sharetree.format_version", "re:'9{50}", "st.save") as e:
        st.load(bad)
    assert len(str(e.value).replace(str(bad), "")) < 400

    def escape(tensors, meta, structure):
        structure["children"].append({"t": "static", "type": "\x1b[2J"})
        structure["keys"].append("s")

    with raises("E29", "'s'", "field 'type'", "a type name", "'\\x1b[2J'"):
        st.load(tampered(tmp_path, TIED, escape))


# ------------------------------------------------- buffers against the tensors


def test_missing_tensor(tmp_path) -> None:
    bad = tampered(tmp_path, TIED, lambda t, m, s: t.pop("embed"))
    with raises("E127", "bad.safetensors", "'embed'", "float32[4, 3]", "no such tensor"):
        st.load(bad)


def test_a_tensor_used_twice(tmp_path) -> None:
    tree = {"a": np.ones(2, np.float32), "b": np.zeros(2, np.float32)}
    bad = tampered(tmp_path, tree, _set("tensor", "a", "b"))
    with raises("E127", "bad.safetensors", "'b'", "'a'", "used twice"):
        st.load(bad)


def test_extra_tensor(tmp_path) -> None:
    bad = tampered(tmp_path, TIED, lambda t, m, s: t.update(stowaway=np.ones(1)))
    with raises("E127", "bad.safetensors", "does not use", "['stowaway']"):
        st.load(bad)


def test_tensor_of_wrong_shape(tmp_path) -> None:
    bad = tampered(tmp_path, TIED, lambda t, m, s: t.update(embed=np.ones((3, 4), np.float32)))
    with raises("E127", "'embed'", "expected float32[4, 3]", "found float32[3, 4]"):
        st.load(bad)
