"""``raises(code, *facts)``: an error's code, class and the facts its message must name.

Tests check facts, not sentences: the code (its row in docs/errors.md), the class, and
the paths, numbers and names the message must show; the wording is free to change.

    with raises("E7", "'dec'", "(3, 2)"):
        st.tie(...)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

import sharetree as st


def message(e: BaseException) -> str:
    """The message of ``e`` with its notes, as a user reads it."""
    return "\n".join([str(e), *getattr(e, "__notes__", ())])


@contextlib.contextmanager
def raises(
    code: str, *facts: str, cls: type[BaseException] = st.TieError
) -> Iterator[pytest.ExceptionInfo]:
    """Expect a ``cls`` of ``code`` whose message (notes included) contains every fact.

    A fact is a plain substring; ``re:PATTERN`` is a regular expression searched for.
    """
    with pytest.raises(cls) as info:
        yield info
    e = info.value
    text = message(e)
    assert getattr(e, "code", None) == code, f"expected code {code}, got {e.code!r}: {text}"
    assert text.startswith(f"[{code}]"), text
    for fact in facts:
        if fact.startswith("re:"):
            assert re.search(fact[3:], text, re.S), f"{fact[3:]!r} not in: {text}"
        else:
            assert fact in text, f"{fact!r} not in: {text}"
