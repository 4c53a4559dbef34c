"""Fuzzing st.load (and describe) with damaged files: a TieError or the tree, nothing else.

Each example takes one valid file and damages it: a value of the tree JSON
replaced by random JSON, a field dropped or added, the JSON nested thousands
of levels deep, a metadata entry changed, a tensor renamed, dropped, added or
retyped, header bytes flipped, the file truncated; or the header written by hand
(a key given twice, a lying length, a bad dtype, shape or offsets). Every outcome must be a
``TieError``, a documented ``UserWarning`` (a file without sharetree metadata;
node types rebuilt as dicts), or a whole, self-consistent tree (the original
one when nothing that matters changed); never another exception, an import,
or a call of a function with a concrete array.
"""

from __future__ import annotations

import builtins
import collections
import importlib
import json
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _examples import examples
from _raises import message
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as hs
from safetensors import safe_open
from safetensors.numpy import save_file

import sharetree as st
from sharetree.__main__ import describe

EVIL = "sharetree_fuzz_evil_mod"
FN_NAME = "fuzzlib.ops:record"
CALLS: list[Any] = []


def record(x: jax.Array) -> jax.Array:
    """The caller's function: may be traced (shape checks), never run on a concrete array."""
    CALLS.append(x)
    return jnp.flipud(x)


FUNCTIONS = {FN_NAME: record}

TREE = {
    "emb": np.arange(12.0, dtype=np.float32).reshape(4, 3),
    "head": st.Tied("emb", st.T),
    "blocks": [
        {"w": np.ones((2, 2), np.float32), "b": np.zeros(2, ml_dtypes.bfloat16)},
        {"w": st.Tied("blocks/0/w", st.scale(2.0) >> st.reshape(4)), "b": st.Tied("blocks/0/b")},
    ],
    "od": collections.OrderedDict([("z", 1), ("a", "s")]),
    "t": (None, 2.5, 1 + 2j, True),
    "f8": np.ones(3, ml_dtypes.float8_e4m3fn),
    "key": jax.random.key(0),
    "fnv": st.Tied("emb", st.T),  # its transform becomes fn(FN_NAME) in the file
}

WORDS = [
    "dict", "odict", "list", "tuple", "none", "node", "tied", "value", "static", "buffer",
    "fn", "chain", "transpose", "reshape", "scale", "astype", "identity", "emb", "head",
    "blocks", "0", "w", "__metadata__", "sys:exit", "os:system", "builtins:exec",
    f"{EVIL}:f", FN_NAME, "threefry2x32", "rbg", "os.system", "float8_e4m3fn", "bfloat16",
    "float32", "uint8", "uint32", "object", "<U3", "int", "float", "complex", "str", "bool",
    "t", "keys", "children", "ref", "transform", "tensor", "dtype", "shape", "raw", "scalar",
    "key", "name", "parts", "axes", "c", "function", "type",
]  # fmt: skip
FIELDS = [
    "t",
    "keys",
    "children",
    "ref",
    "transform",
    "tensor",
    "dtype",
    "shape",
    "raw",
    "scalar",
    "key",
    "type",
    "value",
    "name",
    "parts",
    "function",
    "axes",
    "c",
]

JSON = hs.recursive(
    hs.none()
    | hs.booleans()
    | hs.integers(-(2**64), 2**64)
    | hs.sampled_from([0, 1, 2, 3, 4, 12, -1])
    | hs.floats(allow_nan=True, allow_infinity=True)
    | hs.text(max_size=4)
    | hs.sampled_from(WORDS),
    lambda c: hs.lists(c, max_size=4) | hs.dictionaries(hs.sampled_from(FIELDS), c, max_size=4),
    max_leaves=8,
)


def _read(path: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and metadata of a file (float8 by hand: safetensors' numpy reader lacks it)."""
    f8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    tensors = {}
    with safe_open(str(path), framework="np") as f:
        for k in f.keys():
            if header[k]["dtype"] in f8:
                begin, end = header[k]["data_offsets"]
                raw = data[8 + n + begin : 8 + n + end]
                dtype = f8[header[k]["dtype"]]
                tensors[k] = np.frombuffer(raw, dtype).reshape(header[k]["shape"])
            else:
                tensors[k] = f.get_tensor(k)
        return tensors, dict(f.metadata())


@pytest.fixture(scope="module")
def good(tmp_path_factory: Any) -> dict[str, Any]:
    """The valid file (bytes, tensors, metadata, structure) and a warm-up load."""
    path = tmp_path_factory.mktemp("fuzz") / "good.safetensors"
    st.save(path, TREE)
    tensors, meta = _read(path)
    structure = json.loads(meta["sharetree.tree"])
    i = structure["keys"].index("fnv")
    structure["children"][i]["transform"] = {"name": "fn", "function": FN_NAME}
    meta["sharetree.tree"] = json.dumps(structure)
    save_file(tensors, str(path), metadata=meta)
    expected = st.load(path, functions=FUNCTIONS)  # imports everything a load needs
    describe(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_file({"a": np.ones(1)}, str(path) + ".foreign")
        st.load(str(path) + ".foreign")
    return _Quiet(
        {
            "bytes": path.read_bytes(),
            "tensors": tensors,
            "meta": meta,
            "structure": structure,
            "expected": expected,
        }
    )


class _Quiet(dict):
    """A dict with a short repr (hypothesis prints fixtures of a failing example)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {len(self)}>"


class _Imports(list):
    def __repr__(self) -> str:
        return f"<{len(self)} imports>"


def _spots(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a JSON document, without recursion."""
    out, todo = [], [doc]
    while todo:
        node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            out.append((node, k))
            if isinstance(v, (dict, list)):
                todo.append(v)
    return out


def _same(a: Any, b: Any) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb, strict=True):
        if type(x) is not type(y):
            return False
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if hasattr(x, "dtype"):
            if x.dtype != y.dtype or np.shape(x) != np.shape(y):
                return False
            if not np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True):
                return False
        elif not (x == y or (x != x and y != y)):
            return False
    return True


def _mutate(data: Any, good: dict[str, Any]) -> tuple[bytes | None, Any]:
    """Draw one damage; return the file's bytes, or None and (tensors, metadata) to write."""
    kind = data.draw(
        hs.sampled_from(
            ["value", "value", "drop", "add", "deep", "meta", "tensor", "bytes", "truncate"]
        )
    )
    tensors = dict(good["tensors"])
    meta = dict(good["meta"])
    structure = json.loads(json.dumps(good["structure"]))
    if kind in ("value", "drop", "add", "deep"):
        spots = _spots(structure)
        node, key = spots[data.draw(hs.integers(0, len(spots) - 1))]
        if kind == "value":
            node[key] = data.draw(JSON)
        elif kind == "drop":
            del node[key]
        elif kind == "add":
            target = node if isinstance(node, dict) else node[key]
            if isinstance(target, dict):
                target[data.draw(hs.sampled_from(FIELDS))] = data.draw(JSON)
            elif isinstance(target, list):
                target.insert(0, data.draw(JSON))
        else:
            n = data.draw(hs.sampled_from([300, 500, 3000, 100_000]))
            inner = node[key]
            text = json.dumps(structure)
            marker = "\x00HERE\x00"
            node[key] = marker
            text = json.dumps(structure).replace(
                json.dumps(marker), "[" * n + json.dumps(inner) + "]" * n
            )
            meta["sharetree.tree"] = text
            return None, (tensors, meta)
        meta["sharetree.tree"] = json.dumps(structure)
    elif kind == "meta":
        key = data.draw(
            hs.sampled_from(
                [
                    "sharetree.format_version",
                    "sharetree.tree",
                    "sharetree.library_version",
                    "sharetree.other",
                    "__metadata__",
                ]
            )
        )
        if data.draw(hs.booleans()) and key in meta:
            del meta[key]
        else:
            meta[key] = data.draw(
                hs.sampled_from(["", "0", "1", "2", "-1", "{}", "[]", "x"]) | hs.text(max_size=5)
            )
    elif kind == "tensor":
        name = data.draw(hs.sampled_from(sorted(tensors)))
        action = data.draw(hs.sampled_from(["rename", "drop", "extra", "retype", "reshape"]))
        if action == "rename":
            tensors[data.draw(hs.sampled_from(WORDS) | hs.text(min_size=1, max_size=4))] = (
                tensors.pop(name)
            )
        elif action == "drop":
            del tensors[name]
        elif action == "extra":
            tensors[data.draw(hs.sampled_from(WORDS))] = np.ones(2, np.float32)
        elif action == "retype":
            dtype = data.draw(hs.sampled_from([np.uint8, np.float64, np.int32, np.bool_]))
            tensors[name] = tensors[name].astype(dtype)
        else:
            tensors[name] = tensors[name].reshape(-1)[: data.draw(hs.integers(0, 3))]
    else:
        raw = bytearray(good["bytes"])
        if kind == "truncate":
            return bytes(raw[: data.draw(hs.integers(0, len(raw) - 1))]), None
        for _ in range(data.draw(hs.integers(1, 4))):
            i = data.draw(hs.integers(0, min(len(raw), 8 + 2000) - 1))
            raw[i] = data.draw(hs.integers(0, 255))
        return bytes(raw), None
    return None, (tensors, meta)


@pytest.fixture
def no_imports(monkeypatch: Any, tmp_path: Any) -> Any:
    """Record imports; EVIL would leave a marker if it were ever imported."""
    marker = tmp_path / "evil.marker"
    (tmp_path / f"{EVIL}.py").write_text(f"open({str(marker)!r}, 'w')\ndef f(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = _Imports()
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def record_import(name: str, *args: Any, **kwargs: Any) -> Any:
        imported.append(name)
        return real_import(name, *args, **kwargs)

    def record_import_module(name: str, *args: Any, **kwargs: Any) -> Any:
        imported.append(name)
        return real_import_module(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", record_import)
    monkeypatch.setattr(importlib, "import_module", record_import_module)
    return imported, marker


@settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=hs.data())
def test_damaged_files_give_the_tree_or_a_tie_error(good, no_imports, tmp_path, data) -> None:
    imported, marker = no_imports
    blob, parts = _mutate(data, good)
    path = tmp_path / "fuzzed.safetensors"
    if blob is not None:
        path.write_bytes(blob)
    else:
        tensors, meta = parts
        try:
            save_file(tensors, str(path), metadata=meta)
        except Exception:  # safetensors itself refuses (e.g. a '__metadata__' entry)
            event("safetensors refused to write it")
            return
    before_modules = set(sys.modules)
    del imported[:]
    CALLS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out: Any = st.load(path, functions=FUNCTIONS)
        except st.TieError as e:
            assert e.code and "fuzzed.safetensors" in message(e), message(e)
            event("TieError")
            out = None
        try:
            text = describe(path)
            assert isinstance(text, str)
        except st.TieError as e:
            assert "\n" not in str(e)
    assert set(sys.modules) == before_modules, set(sys.modules) - before_modules
    assert EVIL not in imported and not marker.exists()
    assert all(isinstance(x, jax.core.Tracer) for x in CALLS), "called on a concrete array"
    if out is None:
        return
    warned = [w for w in caught if issubclass(w.category, UserWarning)]
    event("warning" if warned else "loaded")
    if warned:  # a foreign file (flat dict of arrays) or nodes rebuilt as dicts
        assert isinstance(out, dict)
        assert any(str(w.message).startswith(("[E142]", "[E130]")) for w in warned), warned
        return
    if _same(out, good["expected"]):
        return
    # a different file that is still well formed (e.g. another value): a whole tree that
    # materializes and saves and loads back unchanged
    st.materialize(out)
    again = tmp_path / "again.safetensors"
    st.save(again, out)
    resaved = {**FUNCTIONS, f"{record.__module__}:{record.__qualname__}": record}
    assert _same(st.load(again, functions=resaved), out)


def _header_of(blob: bytes) -> tuple[list[Any], bytes]:
    """The header of a safetensors file as ordered pairs (duplicates kept), and its data."""
    n = int.from_bytes(blob[:8], "little")
    pairs = json.loads(blob[8 : 8 + n], object_pairs_hook=lambda ps: [list(p) for p in ps])
    return pairs, blob[8 + n :]


def _dump(value: Any) -> str:
    """JSON text of ``_header_of``'s pairs: a list of 2-lists is an object (duplicates and all)."""
    if isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        if value and all(isinstance(p[0], str) for p in value):
            return "{" + ",".join(f"{json.dumps(k)}:{_dump(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_dump, value)) + "]"
    return json.dumps(value)


@settings(
    max_examples=examples(100),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=hs.data())
def test_crafted_headers_give_the_tree_or_a_tie_error(good, tmp_path, data) -> None:
    """Hand-written headers: keys twice, lying lengths, bad dtypes, shapes and offsets."""
    pairs, body = _header_of(good["bytes"])
    i = data.draw(hs.integers(0, len(pairs) - 1))
    name, value = pairs[i]
    kind = data.draw(hs.sampled_from(["twice", "length", "dtype", "shape", "offsets", "meta"]))
    delta = 0
    if kind == "twice":  # the library keeps one of the two: a silent pick
        pairs.insert(
            data.draw(hs.integers(0, len(pairs))), [name, data.draw(hs.just(value) | JSON)]
        )
    elif kind == "length":
        delta = data.draw(hs.integers(-16, 16).filter(bool))
    elif name == "__metadata__":
        key = data.draw(hs.sampled_from([k for k, _ in value] + ["sharetree.tree", "x"]))
        value.insert(data.draw(hs.integers(0, len(value))), [key, data.draw(JSON)])
    else:
        field = {"dtype": 0, "shape": 1, "offsets": 2, "meta": data.draw(hs.integers(0, 2))}[kind]
        value[field][1] = data.draw(
            JSON
            | hs.sampled_from(["F4", "F8_E4M3", "I4", "C128", "U64", "bool", ""])
            | hs.lists(hs.integers(-(2**65), 2**65), max_size=3)
        )
    text = _dump(pairs).encode()
    blob = (len(text) + delta).to_bytes(8, "little", signed=True) + text + body
    path = tmp_path / "crafted.safetensors"
    path.write_bytes(blob)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out: Any = st.load(path, functions=FUNCTIONS)
        except st.TieError as e:
            assert e.code and "crafted.safetensors" in message(e), message(e)
            out = None
        try:
            describe(path)
        except st.TieError as e:
            assert "\n" not in str(e)
    event(f"{kind}: {'TieError' if out is None else 'loaded'}")
    if kind == "twice":
        assert out is None, "a key given twice loaded"
    elif out is not None and not _same(out, good["expected"]):
        st.materialize(out)  # a different but well-formed file: a whole, consistent tree
