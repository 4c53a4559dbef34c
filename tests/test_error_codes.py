"""Every error code raised in the package has its row in docs/errors.md, and every row is raised.

The codes are read from the source (the builder's calls in ``sharetree/``), so a code can
only be a literal: a code built at run time would escape this check and is itself a failure.
The rows are read from the table of docs/errors.md; a row's anchor is what a message's link
points at. A row whose situation is now reported under another code stays (old links still
land), retired: its situation cell opens with ``*Retired:*`` and names the code that replaced
it; such a row is raised nowhere, and the code it names is a row that is raised.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import sharetree as st
from sharetree import _errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = pathlib.Path(st.__file__).parent
ERRORS_MD = ROOT / "docs" / "errors.md"

CODE_ARG = {"error": 0, "wrong_type": 0, "warn": 0, "check_bool": 1, "check_mapping": 1}
"""The builder's functions and the position of their ``code`` argument."""

ROW = re.compile(r'^\| <a id="(e\w+)"></a>(E\w+) \|([^|]*)\|', re.M)
RETIRED = "*Retired:*"
CODE = re.compile(r"\bE\d+[a-z]?\b")


def _calls() -> list[tuple[str, int, ast.Call, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", "")  # the builder is imported by name
            if name in CODE_ARG and path.name != "_errors.py":
                found.append((path.relative_to(PACKAGE).as_posix(), node.lineno, node, name))
    return found


def _code(node: ast.Call, name: str) -> ast.expr | None:
    for kw in node.keywords:
        if kw.arg == "code":
            return kw.value
    i = CODE_ARG[name]
    return node.args[i] if len(node.args) > i else None


def _passed_codes() -> dict[str, list[str]]:
    """Codes handed to a helper that raises for its caller: ``f(..., code="E90")`` and the
    literal default of a ``code`` parameter (``def check_fits(..., code="E40")``)."""
    codes: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            values = []
            if isinstance(node, ast.Call):
                values = [kw.value for kw in node.keywords if kw.arg == "code"]
            elif isinstance(node, ast.FunctionDef):
                a = node.args
                named = [*zip(a.kwonlyargs, a.kw_defaults), *zip(a.args[::-1], a.defaults[::-1])]
                values = [d for arg, d in named if arg.arg == "code" and d is not None]
            for v in values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    codes.setdefault(v.value, []).append(f"{where}:{node.lineno}")
    return codes


def raised_codes() -> dict[str, list[str]]:
    """Every code the package's source passes to the builder, with where.

    A builder call's code is a literal, or the ``code`` parameter of a helper that raises
    for its callers, whose literals (its default, its callers' ``code=``) count instead.
    """
    codes = _passed_codes()
    for where, line, node, name in _calls():
        code = _code(node, name)
        if isinstance(code, ast.Name) and code.id == "code":
            continue  # a helper's parameter: counted by _passed_codes
        assert isinstance(code, ast.Constant) and isinstance(code.value, str), (
            f"{where}:{line}: {name}(...) needs its code as a literal string"
        )
        codes.setdefault(code.value, []).append(f"{where}:{line}")
    return codes


def _rows(text: str | None = None) -> list[tuple[str, str]]:
    """``(code, situation)`` of each row of the table (of docs/errors.md), in order."""
    rows = ROW.findall(ERRORS_MD.read_text() if text is None else text)
    for anchor, code, _ in rows:
        assert anchor == code.lower(), f"row {code}: its anchor is {anchor!r}"
    return [(code, situation.strip()) for _, code, situation in rows]


def documented_codes() -> list[str]:
    return [code for code, _ in _rows()]


def retired_codes(text: str | None = None) -> dict[str, list[str]]:
    """Each retired row with the codes its situation names (the one that replaced it first)."""
    return {
        code: [c for c in CODE.findall(situation) if c != code]
        for code, situation in _rows(text)
        if situation.startswith(RETIRED)
    }


def retired_problems(raised: set[str], retired: dict[str, list[str]]) -> list[str]:
    """What is wrong with the retired rows: raised still, or naming no live, raised code."""
    problems = [f"retired row {c} is still raised" for c in sorted(retired) if c in raised]
    for code, named in sorted(retired.items()):
        if not named or named[0] not in raised or named[0] in retired:
            first = named[0] if named else "no code"
            problems.append(f"retired row {code} names {first}, not a row that is raised")
    return problems


def test_the_builder_is_used_and_codes_are_well_formed():
    codes = raised_codes()
    assert len(codes) > 50  # the whole package goes through the builder
    bad = [c for c in codes if not re.fullmatch(r"E\d+[a-z]?", c)]
    assert not bad, bad


def test_every_raised_code_has_a_row_and_every_row_is_raised():
    raised, rows, retired = set(raised_codes()), documented_codes(), retired_codes()
    assert len(rows) == len(set(rows)), sorted(c for c in rows if rows.count(c) > 1)
    live = set(rows) - set(retired)
    assert raised - set(rows) == set(), "codes without a row in docs/errors.md"
    assert live - raised == set(), "rows of docs/errors.md that no code raises"


def test_a_retired_row_is_not_raised_and_names_the_code_that_replaced_it():
    assert retired_problems(set(raised_codes()), retired_codes()) == []


def test_the_retired_rule():
    """Read from the situation cell's opening mark (a live row may say "was row 41"), and
    checked: a retired row is raised nowhere and names a live code that is raised."""
    table = "\n".join(
        [
            '| <a id="e5"></a>E5 | a missing target (was row 41) | `tie` | the target |',
            '| <a id="e9"></a>E9 | *Retired:* now [E5](#e5), with a note | (nothing) | |',
            '| <a id="e12"></a>E12 | *Retired:* reported elsewhere | (nothing) | |',
        ]
    )
    retired = retired_codes(table)
    assert retired == {"E9": ["E5"], "E12": []}
    assert retired_problems({"E5"}, {"E9": ["E5"]}) == []
    assert retired_problems({"E5", "E9"}, {"E9": ["E5"]}) == ["retired row E9 is still raised"]
    assert retired_problems({"E7"}, retired) == [
        "retired row E12 names no code, not a row that is raised",
        "retired row E9 names E5, not a row that is raised",
    ]


def test_no_error_is_built_outside_the_builder():
    """A ``TieError(...)`` / ``TieTypeError(...)`` built by hand would carry no code."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                assert name not in {"TieError", "TieTypeError"}, f"{path.name}:{node.lineno}"


@pytest.mark.parametrize("builder", [_errors.error, _errors.wrong_type])
def test_a_message_opens_with_its_code_and_links_its_row(builder):
    e = (
        builder("E7", "tie 'a'", "x", "y")
        if builder is _errors.wrong_type
        else builder("E7", "tie 'a'", "differs", expected="x", found="y", fix="do z")
    )
    assert e.code == "E7" and str(e).startswith("[E7] tie 'a'")
    assert str(e).endswith(f"{_errors.DOCS}#e7")
    assert isinstance(e, st.TieTypeError) == (builder is _errors.wrong_type)
