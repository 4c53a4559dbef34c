"""Files holding views of several positions (issue 33): save, load, inspect, crafted files.

Round trips are checked against the values written by hand in NumPy (not by sharetree),
the file as the ``safetensors`` library reads it, and crafted metadata written with
``safetensors.numpy.save_file``: each malformed several-ref node is a TieError naming the
view's path and the input, raised before any transform runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _files import read_raw, write_with_metadata
from _raises import raises
from safetensors import safe_open

import sharetree as st
import sharetree._files.header
from sharetree.__main__ import describe, main
from sharetree._transforms import REGISTRY

RNG = np.random.default_rng(33)


def ints(*shape: int) -> np.ndarray:
    """Small integers as float32: every sum and product below is exact."""
    return RNG.integers(-3, 4, shape).astype(np.float32)


V, D, R = 6, 4, 2
E, A, B = ints(V, D), ints(V, R), ints(R, D)
BLOCKS, SA, SB = ints(2, D, D), ints(6, D, R), ints(6, R, D)
FE, FP = ints(V, 3), ints(3, D)
ENC = {"w": ints(D, D), "b": ints(D)}
DELTA = {"w": ints(D, D), "b": ints(D)}
W_ROOT, W_NEAR, CA, CB = ints(D, D), ints(D, D), ints(D, R), ints(R, D)
ORDER = (0, 1, 0, 1, 0, 1)


def lora_tree() -> dict[str, Any]:
    """(a) LoRA on a tied embedding: the lookup and the head read the adapted table."""
    refs = {"base": "lora/embed/base", "a": "lora/embed/a", "b": "lora/embed/b"}
    return {
        "params": {"embed": st.Tied(refs, st.lora(2.0)), "head": st.Tied("embed", st.T)},
        "lora": {"embed": {"base": E, "a": A, "b": B}},
    }


def stack_tree() -> dict[str, Any]:
    """(b) two shared blocks for six scanned layers, each layer with its own adapter."""
    return {
        "blocks": BLOCKS,
        "stack": st.Tied("blocks", st.take(ORDER)),
        "a": SA,
        "b": SB,
        "layers": st.Tied({"base": "stack", "a": "a", "b": "b"}, st.lora(0.5)),
    }


def factorized_tree() -> dict[str, Any]:
    """(c) a factorized head ``(e @ p).T``."""
    return {"e": FE, "p": FP, "head": st.Tied({"a": "e", "b": "p"}, st.matmul() >> st.T)}


def subtree_tree() -> dict[str, Any]:
    """(d) inputs that are subtrees of one structure, added leaf by leaf."""
    return {"enc": ENC, "delta": DELTA, "tuned": st.Tied({"x": "enc", "y": "delta"}, st.add())}


def climbing_tree() -> dict[str, Any]:
    """(e) a several-ref tie whose base climbs past a nearer ``w``."""
    tie = st.Tied({"base": "../w", "a": "a", "b": "b"}, st.lora())
    return {"w": W_ROOT, "blk": {"w": W_NEAR, "a": CA, "b": CB, "v": tie}}


# Each case: the tree, the views computed by hand in NumPy, the buffers the file stores.
CASES = {
    "lora": (
        lora_tree,
        lambda: {
            ("params", "embed"): E + 2.0 * (A @ B),
            ("params", "head"): (E + 2.0 * (A @ B)).T,
        },
        {"lora/embed/base", "lora/embed/a", "lora/embed/b"},
    ),
    "stack": (
        stack_tree,
        lambda: {
            ("stack",): BLOCKS[list(ORDER)],
            ("layers",): BLOCKS[list(ORDER)] + 0.5 * np.matmul(SA, SB),
        },
        {"blocks", "a", "b"},
    ),
    "factorized": (factorized_tree, lambda: {("head",): (FE @ FP).T}, {"e", "p"}),
    "subtree": (
        subtree_tree,
        lambda: {("tuned", k): ENC[k] + DELTA[k] for k in ("w", "b")},
        {"enc/w", "enc/b", "delta/w", "delta/b"},
    ),
    "climbing": (
        climbing_tree,
        lambda: {("blk", "v"): W_ROOT + CA @ CB},
        {"w", "blk/w", "blk/a", "blk/b"},
    ),
}


def at(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def ties_of(tree: Any) -> dict[str, st.Tied]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, st.Tied))
    return {jax.tree_util.keystr(p): x for p, x in flat[0] if isinstance(x, st.Tied)}


def buffers_of(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("case", CASES)
def test_round_trip_reads_back_equal_and_computes_the_hand_written_views(tmp_path, case):
    make, by_hand, stored = CASES[case]
    tree, path = make(), tmp_path / "m.safetensors"
    st.save(path, tree)
    back = st.load(path)
    assert ties_of(back) == ties_of(tree)  # == on every Tied node: refs, names, transform
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    saved, loaded = buffers_of(tree), buffers_of(back)
    assert saved.keys() == loaded.keys()
    for k, x in saved.items():  # bit-equal, same dtype
        assert loaded[k].dtype == x.dtype and loaded[k].tobytes() == x.tobytes(), k
    m = st.materialize(back)
    for view, want in by_hand().items():
        np.testing.assert_array_equal(np.asarray(at(m, view)), want.astype(np.float32))
    with safe_open(str(path), framework="np") as f:  # each buffer once, no view stored
        assert set(f.keys()) == stored
        assert f.metadata()["sharetree.format_version"] == "4"


def test_the_refs_are_written_by_name_with_their_climbs(tmp_path):
    st.save(tmp_path / "m.safetensors", climbing_tree())
    tree = json.loads(read_raw(tmp_path / "m.safetensors")[1]["sharetree.tree"])
    node = tree["children"][1]["children"][3]
    assert node == {
        "t": "tied",
        "refs": {"a": {"ref": ["a"]}, "b": {"ref": ["b"]}, "base": {"ref": ["w"], "up": 1}},
        "transform": {"name": "lora", "scale": 1.0},
    }


def test_a_file_without_views_of_several_positions_is_written_as_before(tmp_path):
    w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    for tree, version, tie in (
        ({"w": w, "v": st.Tied("w", st.T)}, "1", '{"t":"tied","ref":["w"],'),
        ({"w": w, "b": {"v": st.Tied("../w")}}, "3", '{"t":"tied","ref":["w"],"up":1,'),
    ):
        st.save(tmp_path / "m.safetensors", tree)
        meta = read_raw(tmp_path / "m.safetensors")[1]
        assert meta["sharetree.format_version"] == version
        assert tie in meta["sharetree.tree"] and "refs" not in meta["sharetree.tree"]
    st.save(tmp_path / "m.safetensors", {"w": w, "v": st.Tied("w", st.T)})
    assert read_raw(tmp_path / "m.safetensors")[1]["sharetree.tree"] == (
        '{"t":"dict","keys":["w","v"],"children":[{"t":"buffer","tensor":"w","dtype":"float32",'
        '"shape":[2,3],"raw":false,"scalar":false},'
        '{"t":"tied","ref":["w"],"transform":{"name":"transpose","axes":null}}]}'
    )


def test_one_ref_ties_beside_a_view_of_several_keep_their_form(tmp_path):
    st.save(tmp_path / "m.safetensors", lora_tree())
    tree = json.loads(read_raw(tmp_path / "m.safetensors")[1]["sharetree.tree"])
    head = tree["children"][0]["children"][1]
    assert head == {"t": "tied", "ref": ["embed"], "transform": {"name": "transpose", "axes": None}}


@dataclasses.dataclass(frozen=True)
class Mix(st.Transform, name="test_files_mix"):
    """A user's transform of two inputs: ``x * w + y``."""

    w: float = 1.0
    inputs: ClassVar = ("x", "y")
    calls: ClassVar[list[str]] = []

    def __call__(self, v):  # type: ignore[override]
        Mix.calls.append("call")
        return jnp.asarray(v["x"]) * self.w + jnp.asarray(v["y"])

    def abstract(self, aval):  # type: ignore[override]
        Mix.calls.append("abstract")
        return jax.ShapeDtypeStruct(aval["x"].shape, aval["x"].dtype)


def mix_tree() -> dict[str, Any]:
    return {"p": E, "q": E.copy(), "m": st.Tied({"x": "p", "y": "q"}, Mix(3.0) >> st.T)}


def test_a_users_registered_transform_of_several_inputs_round_trips(tmp_path):
    st.save(tmp_path / "m.safetensors", mix_tree())
    back = st.load(tmp_path / "m.safetensors")
    assert back["m"] == st.Tied({"x": "p", "y": "q"}, Mix(3.0) >> st.T)
    np.testing.assert_array_equal(np.asarray(st.materialize(back)["m"]), (E * 3.0 + E).T)


def test_an_unregistered_transform_is_refused_by_load_and_described_by_inspect(
    tmp_path, monkeypatch, capsys
):
    path = tmp_path / "m.safetensors"
    st.save(path, mix_tree())
    monkeypatch.delitem(REGISTRY, "test_files_mix")
    with raises("E17", "test_files_mix", "m.safetensors", "'m'"):
        st.load(path)
    text = describe(path)  # a stand-in takes the file's names: nothing imported or called
    assert "x <- p, y <- q" in text and "not registered" in text
    assert main(["inspect", str(path)]) == 0
    assert '"name":"test_files_mix"' in capsys.readouterr().out


def test_an_fn_after_a_transform_of_several_inputs_comes_only_from_functions(tmp_path):
    tree = {"x": E, "y": E, "s": st.Tied({"x": "x", "y": "y"}, st.add() >> st.fn(jnp.tanh))}
    st.save(tmp_path / "m.safetensors", tree)
    with raises("E21", "jax.numpy:tanh", "'s'"):
        st.load(tmp_path / "m.safetensors")
    back = st.load(tmp_path / "m.safetensors", functions={"jax.numpy:tanh": jnp.tanh})
    assert back["s"] == tree["s"]
    np.testing.assert_allclose(np.asarray(st.materialize(back)["s"]), np.tanh(2 * E), rtol=1e-6)


def test_load_like_a_template_holding_views_of_several_positions(tmp_path):
    tree = stack_tree()
    st.save(tmp_path / "m.safetensors", tree)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    back = st.load(tmp_path / "m.safetensors", like=template)
    assert ties_of(back) == ties_of(tree)
    np.testing.assert_array_equal(back["blocks"], BLOCKS)
    template["layers"] = st.Tied({"base": "stack", "a": "a", "b": "b"}, st.lora(1.0))
    with raises("E128", "'layers'", "lora(0.5)", "lora"):
        st.load(tmp_path / "m.safetensors", like=template)


def test_orbax_round_trip_keeps_views_of_several_positions(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = jax.tree.map(jnp.asarray, lora_tree())
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", tree)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    with ocp.StandardCheckpointer() as ckptr:
        back = ckptr.restore(tmp_path / "ckpt", abstract)
    assert ties_of(back) == ties_of(lora_tree())
    head = np.asarray(st.materialize(back)["params"]["head"])
    np.testing.assert_array_equal(head, (E + 2.0 * (A @ B)).T)


# ------------------------------------------------------------------- inspect


def test_inspect_names_each_input(tmp_path, capsys):
    for make, facts in (
        (lora_tree, ["params/embed", "lora(2.0)", "a <- lora/embed/a", "base <- lora/embed/base"]),
        (stack_tree, ["layers", "base <- blocks >> take((0, 1, 0, 1, 0, 1))", "a <- a"]),
        (subtree_tree, ["tuned/w", "x <- enc/w, y <- delta/w", "tuned/b"]),
        (climbing_tree, ["blk/v", "base <- w"]),
    ):
        path = tmp_path / f"{make.__name__}.safetensors"
        st.save(path, make())
        assert main(["inspect", str(path)]) == 0
        out = capsys.readouterr().out
        assert "sharetree format 4" in out
        inputs = out.split("\ninputs:\n")[1]
        for fact in facts:
            assert fact in inputs, (fact, out)


# ------------------------------------------------------------------ crafted files


def _embed(s: dict[str, Any]) -> dict[str, Any]:
    return s["children"][0]["children"][0]


def _head(s: dict[str, Any]) -> dict[str, Any]:
    return s["children"][0]["children"][1]


def _nested(depth: int) -> Any:
    junk: Any = "x"
    for _ in range(depth):  # linear: each level holds the one below once
        junk = [{"t": junk}]
    return junk


def _set(node, key, value):
    node[key] = value


def _rename(refs, old, new):
    refs[new] = refs.pop(old)


# name -> (edit of the tree JSON, the code, the facts besides the file and the view's path)
CRAFTED = {
    "refs not a dict": (lambda s: _set(_embed(s), "refs", [["lora", "embed", "a"]]), "E29",
                        ["'refs'", "list"]),
    "refs empty": (lambda s: _set(_embed(s), "refs", {}), "E29", ["'refs'", "{}"]),
    "a name not an identifier": (lambda s: _rename(_embed(s)["refs"], "a", "a-1"), "E29",
                                 ["input 'a-1'", "identifier"]),
    "an input not an object": (lambda s: _set(_embed(s)["refs"], "a", "lora/embed/a"), "E29",
                               ["input 'a'", "'lora/embed/a'"]),
    "a ref not a list": (lambda s: _set(_embed(s)["refs"]["a"], "ref", "lora/embed/a"), "E29",
                         ["input 'a'", "field 'ref'", "list of str"]),
    "a ref of numbers": (lambda s: _set(_embed(s)["refs"]["b"], "ref", [1.5, None]), "E29",
                         ["input 'b'", "field 'ref'"]),
    "a ref missing": (lambda s: _set(_embed(s)["refs"], "base", {"up": 1}), "E29",
                      ["input 'base'", "field 'ref'", "missing"]),
    "up negative": (lambda s: _set(_embed(s)["refs"]["b"], "up", -1), "E29",
                    ["input 'b'", "field 'up'", "-1"]),
    "up a bool": (lambda s: _set(_embed(s)["refs"]["b"], "up", True), "E29",
                  ["input 'b'", "field 'up'", "True"]),
    "deeply nested junk": (lambda s: _set(_embed(s)["refs"]["a"], "ref", _nested(60)), "E29",
                           ["input 'a'", "field 'ref'"]),
    "ref and refs": (lambda s: _set(_embed(s), "ref", ["lora"]), "E29", ["field 'ref'"]),
    "up beside refs": (lambda s: _set(_embed(s), "up", 1), "E29", ["field 'up'"]),
    "names the transform does not take": (lambda s: _rename(_embed(s)["refs"], "a", "c"),
                                          "E131", ["input 'a'", "'c'", "lora(2.0)"]),
    "a one-input transform with named refs": (
        lambda s: _set(_embed(s), "transform", {"name": "transpose", "axes": None}), "E131",
        ["'a', 'b', 'base'", "T", "one value"]),
    "a several-input transform not first": (
        lambda s: _set(_embed(s), "transform", {"name": "chain", "parts": [
            {"name": "transpose", "axes": None}, {"name": "lora", "scale": 1.0}]}), "E104",
        ["lora", "not first", "field 'transform'"]),
    "deeply nested transform": (
        lambda s: _set(_embed(s), "transform", json.loads(
            '{"name":"chain","parts":[' * 30 + '{"name":"add"}' + "]}" * 30)), "E20",
        ["field 'transform'", "not chains"]),
}  # fmt: skip


@pytest.mark.parametrize("name", CRAFTED)
def test_a_crafted_several_ref_node_is_a_tie_error_naming_the_view(tmp_path, name, monkeypatch):
    edit, code, facts = CRAFTED[name]
    bad = _crafted(tmp_path, lora_tree(), edit)
    ran = []  # nothing computes: the node is refused while the header is read
    for method in ("__call__", "abstract", "numpy"):
        monkeypatch.setattr(REGISTRY["lora"], method, lambda self, x: ran.append(self))
    with raises(code, "bad.safetensors", "'params/embed'", *facts):
        st.load(bad)
    with raises(code, "bad.safetensors", "'params/embed'", *facts):
        describe(bad)
    assert not ran


def test_crafted_refs_that_the_graph_refuses_name_the_view_and_the_ref(tmp_path):
    def edit(s):
        _embed(s)["refs"]["b"]["ref"] = ["lora", "embed", "c"]

    bad = _crafted(tmp_path, lora_tree(), edit)
    with raises("E1", "'params/embed'", "'lora/embed/c'", "bad.safetensors"):
        st.load(bad)


def test_a_one_ref_tie_with_a_transform_of_several_inputs(tmp_path):
    bad = _crafted(tmp_path, lora_tree(), lambda s: _set(_head(s), "transform", {"name": "add"}))
    with raises("E131", "bad.safetensors", "'params/head'", "one ref", "add"):
        st.load(bad)


def test_refs_in_a_file_of_an_older_version(tmp_path):
    bad = _crafted(tmp_path, lora_tree(), lambda s: None, version="3")
    with raises("E29", "bad.safetensors", "'params/embed'", "'refs'", "version 3"):
        st.load(bad)


def test_the_users_class_taking_other_names_than_the_file_never_computes(tmp_path):
    def edit(s):
        s["children"][2]["refs"] = {"x": {"ref": ["p"]}, "z": {"ref": ["q"]}}

    bad = _crafted(tmp_path, mix_tree(), edit)
    Mix.calls.clear()
    with raises("E131", "'m'", "input 'y'", "'x', 'z'", "Mix(w=3.0)"):
        st.load(bad)
    assert Mix.calls == []


def test_a_version_4_file_is_refused_by_a_reader_of_version_3(tmp_path, monkeypatch):
    st.save(tmp_path / "m.safetensors", lora_tree())
    monkeypatch.setattr(sharetree._files.header, "FORMAT_VERSION", 3)
    with raises("E126", "m.safetensors", "version 4", "up to 3", "pip install -U"):
        st.load(tmp_path / "m.safetensors")
    with raises("E126", "version 4", "up to 3"):
        describe(tmp_path / "m.safetensors")


def _crafted(tmp_path, tree, edit, version=None):
    good = tmp_path / "good.safetensors"
    st.save(good, tree)
    tensors, meta = read_raw(good)
    structure = json.loads(meta["sharetree.tree"])
    edit(structure)
    meta["sharetree.tree"] = json.dumps(structure)
    if version is not None:
        meta["sharetree.format_version"] = version
    bad = tmp_path / "bad.safetensors"
    write_with_metadata(bad, tensors, copy.deepcopy(meta))
    return bad
