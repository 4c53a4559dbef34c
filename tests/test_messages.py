"""Messages shaped by the builder (sharetree/_errors.py), for every code and every warning.

The message of every builder call in the package is rendered from its source: each literal
part as written, each value it formats (``{path!r}``, a variable) as a stand-in, so a call
site that puts punctuation in its ``where`` (``"save: timeout="``), leaves a field empty or
doubles a colon is found without reaching the error at run time. Every documented code is
rendered so. Each warning is then called through its public entry point from this file, and
must be reported at this file's line, not inside the package.
"""

from __future__ import annotations

import ast
import collections
import json
import pathlib
import re
import tempfile
import uuid
import warnings
from typing import Any

import hypothesis.strategies as hs
import jax
import numpy as np
import pytest
from hypothesis import given
from test_error_codes import PACKAGE, documented_codes, raised_codes, retired_codes

import sharetree as st
from sharetree import _errors

BUILDERS = {"error": 0, "wrong_type": 0, "warn": 0, "check_bool": 1, "check_mapping": 1}
"""The builder's functions and the position of their ``code`` argument (``where`` follows)."""

STAND_IN = "x"
"""What a formatted value renders as (``'x'`` for ``{value!r}``)."""


def _text(node: ast.expr | None) -> str | None:
    """The text an expression of a message part renders, values replaced by stand-ins."""
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else STAND_IN
    if isinstance(node, ast.JoinedStr):
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
            else:
                assert isinstance(part, ast.FormattedValue)
                out.append(repr(STAND_IN) if part.conversion == ord("r") else STAND_IN)
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return STAND_IN  # a variable or a call: a value the message formats


def _arg(node: ast.Call, position: int, keyword: str) -> ast.expr | None:
    for kw in node.keywords:
        if kw.arg == keyword:
            return kw.value
    return node.args[position] if len(node.args) > position else None


def _assigned(function: ast.AST) -> dict[str, list[ast.expr]]:
    """The expressions each local name of ``function`` is given (``x = ...``, ``a, x = ...``)."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(function):
        pairs: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts))
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
            for first in out.get(getattr(node.target, "id", ""), [])[:1]:
                pairs.append((node.target, ast.BinOp(first, ast.Add(), node.value)))
        for target, value in pairs:
            if isinstance(target, ast.Name):
                out.setdefault(target.id, []).append(value)
    return out


def _texts(node: ast.expr | None, names: dict[str, list[ast.expr]]) -> list[str | None]:
    """Each text ``node`` may render: a local name as each expression it is given."""
    if isinstance(node, ast.Name) and node.id in names:
        return [_text(v) for v in names[node.id] if not isinstance(v, ast.Name)] or [STAND_IN]
    return [_text(node)]


def _own(function: ast.AST) -> list[ast.AST]:
    """The nodes of ``function``, not those of the functions defined inside it."""
    out, stack = [], list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if not isinstance(node, (ast.FunctionDef, ast.Lambda)):
            out.append(node)
            stack += ast.iter_child_nodes(node)
    return out


def rendered() -> list[tuple[str, str, str]]:
    """``(place, code, message)`` of every builder call in the package, rendered."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_errors.py":
            continue
        module = ast.parse(path.read_text())
        functions = [n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)]
        for function in functions:
            names = _assigned(function)
            for node in _own(function):
                name = getattr(node, "func", None) and getattr(node.func, "id", "")
                if not isinstance(node, ast.Call) or name not in BUILDERS:
                    continue
                place = f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}"
                for where in _texts(_arg(node, BUILDERS[name] + 1, "where"), names):
                    out.append((place, *_render(node, name, where or "")))
    return out


def _render(node: ast.Call, name: str, where: str) -> tuple[str, str]:
    """The code and message of one builder call, with ``where`` as given."""
    i = BUILDERS[name]
    code = _arg(node, i, "code")
    code_text = code.value if isinstance(code, ast.Constant) else "E0"
    if name == "wrong_type":
        problem, expected = "", _text(_arg(node, 2, "expected"))
        found, fix = "list [1]", _text(_arg(node, 4, "fix")) or ""
    elif name in ("check_bool", "check_mapping"):
        problem, expected, found = "", "a thing", "int 3"
        fix = (_text(_arg(node, 4, "fix")) or "") if name == "check_mapping" else "y"
    else:
        problem = _text(_arg(node, 2, "problem")) or ""
        expected = _text(_arg(node, 99, "expected"))
        found, fix = _text(_arg(node, 99, "found")), _text(_arg(node, 99, "fix")) or ""
    try:
        return code_text, _errors._message(code_text, where, problem, expected, found, fix)
    except ValueError as e:  # the builder refused the where
        return code_text, f"REFUSED {e}"


BAD = {
    "the builder refused its where": re.compile(r"^REFUSED"),
    "'::'": re.compile(r"::"),
    "'=:'": re.compile(r"=:"),
    "an empty field": re.compile(r"(expected|found|Fix:)\s*[.;,:]|^\[E\w+\]\s*[:;.]|;\s*[.;]"),
    "a type name before its own repr": re.compile(r"\b([A-Z]\w+) \1\("),
}


def problems(messages: list[tuple[str, str, str]]) -> list[str]:
    return [
        f"{place} ({name}): {text}"
        for place, _, text in messages
        for name, pattern in BAD.items()
        if pattern.search(text)
    ]


def test_every_message_is_shaped_by_the_builder():
    messages = rendered()
    assert len(messages) > 300  # the whole package's calls
    assert problems(messages) == []


def test_every_documented_code_is_rendered():
    messages = rendered()
    shown = {code for _, code, _ in messages}
    passed = set(raised_codes()) - shown  # codes handed to a helper (its message rendered)
    live = set(documented_codes()) - set(retired_codes())
    assert live - shown - passed == set()
    assert passed <= set(raised_codes())


def test_the_checks_catch_each_shape():
    """Each rejected shape, built as the old call sites built it, is found."""
    made = [
        ("a", "E1", "[E166] Tied.ref:: expected a Tied of one ref, found Tied Tied({'a': 'x'})."),
        ("b", "E1", "[E55] save: timeout=: expected seconds."),
        ("c", "E1", "[E7] tie 'a' differs; found ."),
    ]
    assert [p.split(" (")[1].split(")")[0] for p in problems(made)] == [
        "'::'",
        "a type name before its own repr",
        "'=:'",
        "an empty field",
    ]
    with pytest.raises(ValueError, match="sharetree bug"):
        _errors.error("E1", "save: timeout=", "is bad")
    with pytest.raises(ValueError, match="sharetree bug"):
        _errors.error("E1", "", "is bad")


@pytest.mark.parametrize(
    "value, shown",
    [
        (st.Tied("a"), "Tied('a')"),
        (pathlib.PurePosixPath("m"), "PurePosixPath('m')"),
        (jax.ShapeDtypeStruct((2,), np.float32), "ShapeDtypeStruct(shape=(2,), dtype=float32)"),
        (3, "int 3"),
        ({"a": 1}, "dict {'a': 1}"),
        (np.float32(2), "float32 np.float32(2.0)"),
    ],
)
def test_a_type_is_named_once(value: Any, shown: str):
    assert _errors.found_type(value, 100) == shown


def _warned(call: Any) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return [w for w in record if str(w.message).startswith("[E")]


def _fresh() -> str:
    return "k" + uuid.uuid4().hex[:8]  # a new key: a new treedef, not a cached structure


def _static_leaf_changes() -> None:
    k = _fresh()
    st.destructure({"w": np.ones(2), k: "a"})
    st.destructure({"w": np.ones(2), k: "b"})


def _shadowed_ref() -> None:
    w = np.ones(2)
    st.materialize({_fresh(): w, "w": w, "sub": {"w": w, "v": st.Tied("w")}})


def _mask_of_a_view() -> None:
    k = _fresh()
    st.mask_by_path({"embed": np.ones((2, 2)), k: st.Tied("embed", st.T)}, k, strict=False)


def _load_of_dicts() -> None:
    """E130: a file saved from a pytree node class, loaded without ``like=``."""
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "m.safetensors"
        st.save(path, collections.namedtuple("Pair", "w v")(np.ones(2), st.Tied("w")))
        st.load(path)


def _load_of_a_foreign_file() -> None:
    """E142: a safetensors file another tool wrote (no sharetree metadata)."""
    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "model.safetensors"
        save_file({"w": np.ones(2, np.float32)}, str(path))
        st.load(path)


def _load_of_an_mlx_directory() -> None:
    """E142: an ``mlx_lm`` directory whose config does not say ``tie_word_embeddings``."""
    from test_mlx_files import QUANTIZATION, write_by_hand

    with tempfile.TemporaryDirectory() as folder:
        write_by_hand(pathlib.Path(folder), config={"quantization": QUANTIZATION})
        st.load(folder)


def _load_of_an_unknown_family() -> None:
    """E362: a Hugging Face directory of a family sharetree does not know, its config tied."""
    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory() as folder:
        config = {"model_type": "mystery", "tie_word_embeddings": True}
        (pathlib.Path(folder) / "config.json").write_text(json.dumps(config))
        weights = {"model.embed_tokens.weight": np.ones((4, 2), np.float32)}
        save_file(weights, str(pathlib.Path(folder) / "model.safetensors"))
        st.load(folder)


WARNINGS = {
    "E130": [_load_of_dicts],
    "E142": [_load_of_a_foreign_file, _load_of_an_mlx_directory],
    "E160": [_static_leaf_changes],
    "E161": [_mask_of_a_view],
    "E165": [_shadowed_ref],
    "E362": [_load_of_an_unknown_family],
}
ENTRY_POINTS = [(code, call) for code, calls in sorted(WARNINGS.items()) for call in calls]


@pytest.mark.parametrize(("code", "call"), ENTRY_POINTS, ids=[c.__name__ for _, c in ENTRY_POINTS])
def test_a_warning_is_reported_at_the_callers_line(code: str, call: Any):
    found = _warned(call)
    assert [str(w.message)[1 : 1 + len(code)] for w in found] == [code]
    assert found[0].filename == __file__
    assert found[0].category is UserWarning


def test_every_warning_code_is_called_here():
    """Each code the package warns with has its entry points in ``WARNINGS`` (one per call
    site), and no module warns past the builder."""
    assert _warn_codes() == set(WARNINGS)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "_errors.py":
            assert "warnings.warn(" not in path.read_text(), path


def _warn_codes() -> set[str]:
    codes = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "warn":
                code = _arg(node, 0, "code")
                assert isinstance(code, ast.Constant), f"{path}:{node.lineno}"
                codes.add(code.value)
    return codes


@given(hs.text(min_size=1, max_size=20).filter(lambda s: s == s.strip()))
def test_a_where_is_taken_unless_it_ends_in_punctuation(where: str):
    ok = not where.endswith((":", ";", ",", ".", "="))
    try:
        _errors.error("E1", where, "is bad")
    except ValueError:
        assert not ok
    else:
        assert ok
