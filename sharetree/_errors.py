"""Every sharetree error is built here: its class, its code and the shape of its message.

A message names where (the function and the key path(s)), what was expected, what was
found and a fix, and carries a code: its row in ``docs/errors.md``, where the "why" lives.
Call sites never format a whole sentence or pick an exception class themselves:

>>> from sharetree._errors import error, wrong_type
>>> e = error("E5", "tie target 'dec/w'", "does not exist in the tree",
...           found="'dec/W', 'enc/w'", fix="use the path as key paths name it")
>>> print(e)
[E5] tie target 'dec/w' does not exist in the tree; found 'dec/W', 'enc/w'. Fix: use the path
as key paths name it. See https://sharetree.github.io/sharetree/errors/#e5
>>> type(wrong_type("E55", "tie(check=...)", "True or False", "yes")).__name__
'TieTypeError'

The builder owns the punctuation: ``where`` names a place and carries none at its end (no
``:``, ``=``, ``.``), and a value's type is named before its repr only where the repr does
not name it already. A warning is built the same way by :func:`warn`, and is reported at
the first line outside sharetree (the user's), however deep inside the package it arose.

Context is added to an error in flight with :func:`add_context` (a PEP 678 note): its class,
code and chain survive.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "DOCS",
    "FIXES",
    "TieError",
    "TieTypeError",
    "add_context",
    "bounded",
    "check_bool",
    "check_mapping",
    "error",
    "found_type",
    "one_line",
    "rebuilt",
    "short",
    "warn",
    "wrong_type",
]

DOCS = "https://sharetree.github.io/sharetree/errors/"
"""The errors page; each code is an anchor on it (``#e7`` for ``E7``)."""

MAX_MESSAGE = 4000
"""The longest message of a function that reads a file (a key of the file may be any length)."""

FIXES: Mapping[str, str] = {
    "outside_jit": "call it outside jit, grad and vmap, on concrete arrays",
    "functions": 'pass the function in, e.g. functions={"mylib.ops:softcap": softcap}',
    "resave": "save the tree again with st.save",
    "keyword": "leave the keyword out for its default",
}
"""Fixes that several errors share, by name (``fix=FIXES["outside_jit"]``)."""

F = TypeVar("F", bound=Callable[..., Any])


class TieError(ValueError):
    """A bad tie, graph or input; each message names the path(s), expected, found and a fix.

    ``code`` is the error's row in the errors page (``"E7"``); it also opens the message.

    Example:
        >>> import sharetree as st
        >>> issubclass(st.TieError, ValueError)
        True
    """

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class TieTypeError(TieError, TypeError):
    """A :class:`TieError` for an argument of the wrong type; also a ``TypeError``.

    Example:
        >>> import sharetree as st
        >>> issubclass(st.TieTypeError, TypeError), issubclass(st.TieTypeError, st.TieError)
        (True, True)
    """


_TRAILING = (":", ";", ",", ".", "=")
"""What a ``where`` may not end with: the builder puts the punctuation after it."""


def _check_where(where: str) -> None:
    """A ValueError (a bug in sharetree, not in the user's input) for a malformed ``where``."""
    cut = where.endswith("...")  # a value cut short ('enc'/...) ends the where
    if not where.strip() or where != where.strip() or (where.endswith(_TRAILING) and not cut):
        raise ValueError(f"sharetree bug: an error's where {where!r} is empty or punctuated")


def _message(
    code: str, where: str, problem: str, expected: str | None, found: str | None, fix: str
) -> str:
    _check_where(where)
    text = f"[{code}] {where}" + (f" {problem}" if problem else "")
    facts = [f"expected {expected}" if expected else "", f"found {found}" if found else ""]
    facts_text = ", ".join(f for f in facts if f)
    if facts_text:
        text += ("; " if problem else ": ") + facts_text
    text += "" if text.endswith(".") else "."  # a cut value ends in "...": kept
    if fix:
        text += f" Fix: {fix}" + ("" if fix.endswith(".") else ".")
    return f"{text} See {DOCS}#{code.lower()}"


def error(
    code: str,
    where: str,
    problem: str = "",
    *,
    expected: str | None = None,
    found: str | None = None,
    fix: str = "",
) -> TieError:
    """The :class:`TieError` of row ``code``: where, the problem, expected, found, the fix.

    Args:
        code: the row of ``docs/errors.md`` (``"E7"``, ``"E1b"``).
        where: the function and the path(s), e.g. ``"tie 'dec/w' <- 'enc/w'"``, or an
            argument as ``"save(timeout=...)"``; no punctuation at its end (checked).
        problem: what is wrong, in a few words (``"overlaps 'dec'"``).
        expected: what was expected there.
        found: what was found instead.
        fix: what to do.

    Returns:
        The error, to ``raise``.
    """
    return TieError(_message(code, where, problem, expected, found, fix), code=code)


def wrong_type(
    code: str, where: str, expected: str, value: Any, fix: str = "", *, found: str | None = None
) -> TieTypeError:
    """The :class:`TieTypeError` of row ``code`` for ``value``, which is not ``expected``.

    The message shows the value's type and a short repr of it (the repr alone where it
    names the type itself, ``Tied('a')``, ``PosixPath('m')``), or ``found`` where given
    (an array's dtype and shape).

    >>> print(wrong_type("E1", "f(x=...)", "a str", [1]).args[0].split(". See")[0])
    [E1] f(x=...): expected a str, found list [1]
    """
    found = found_type(value) if found is None else found
    return TieTypeError(_message(code, where, "", expected, found, fix), code=code)


def found_type(value: Any, limit: int = 40) -> str:
    """A value for a message's "found": its type's name, then its short repr (once).

    >>> found_type(3), found_type(range(2))
    ('int 3', 'range(0, 2)')
    """
    text, name = short(value, limit), type(value).__name__
    return text if text.startswith((name + "(", name + "<")) else f"{name} {text}"


def warn(
    code: str,
    where: str,
    problem: str = "",
    *,
    expected: str | None = None,
    found: str | None = None,
    fix: str = "",
) -> None:
    """Warn with the message of row ``code``, built as :func:`error` builds it.

    The warning is reported at the first frame outside the sharetree package: the user's
    line that called it, however deep inside the package it arose.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     warn("E160", "destructure", "saw a static leaf change")
    >>> w[0].filename == __file__ or w[0].filename.startswith("<doctest")
    True
    """
    message = _message(code, where, problem, expected, found, fix)
    warnings.warn(message, UserWarning, stacklevel=_outside_stacklevel())


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the nearest frame outside sharetree, seen from :func:`warn`."""
    frame: FrameType | None = sys._getframe(2)  # 1: warn itself
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def rebuilt(message: str, code: str, type_error: bool = False) -> TieError:
    """The error of ``code`` whose message is ``message``, raised elsewhere (another process).

    >>> e = rebuilt("[E7] tie 'a': ...", "E7")
    >>> e.code, str(e)
    ('E7', "[E7] tie 'a': ...")
    """
    return (TieTypeError if type_error else TieError)(message, code=code)


def check_bool(value: Any, code: str, where: str) -> bool:
    """``value`` as a bool if it is one (NumPy's too), else the :func:`wrong_type` error.

    >>> check_bool(1, "E55", "tie(check=...)")
    Traceback (most recent call last):
    sharetree._errors.TieTypeError: [E55] tie(check=...): expected True or False, found int 1. ...
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise wrong_type(code, where, "True or False", value, FIXES["keyword"])


def check_mapping(value: Any, code: str, where: str, expected: str, fix: str = "") -> Mapping:
    """``value`` if it is a mapping, else the :func:`wrong_type` error naming ``expected``."""
    if isinstance(value, Mapping):
        return value
    raise wrong_type(code, where, expected, value, fix)


def add_context(e: BaseException, context: str) -> BaseException:
    """``e`` with ``context`` added as a note (its class, code and chain stay); returns ``e``.

    >>> e = add_context(TieError("[E1] ...", code="E1"), "while loading 'm.safetensors'")
    >>> e.__notes__, e.code
    (["while loading 'm.safetensors'"], 'E1')
    """
    e.add_note(context)
    return e


def one_line(e: BaseException) -> str:
    """``TypeName: message`` of an exception on one line (for messages quoting a library)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def short(x: object, limit: int = 80) -> str:
    """``repr(x)`` cut to ``limit`` characters for a message; a repr that raises is named.

    Example:
        >>> short(10**5000)
        '<int whose repr raised ValueError>'
        >>> short("x" * 100, 10)
        "'xxxxxx..."
    """
    try:
        text = repr(x)
    except Exception as e:  # a user object's repr, or an int past Python's digit limit
        return f"<{type(x).__name__} whose repr raised {type(e).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded(f: F) -> F:
    """``f`` whose TieError messages are cut in the middle past ``MAX_MESSAGE`` characters.

    For the functions that read files: a message quotes the file's keys, which may be of any
    length; its start (the code, what failed, where) and end (the fix) are kept, and so are
    its class and code.
    """

    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except TieError as e:
            text, half = str(e), MAX_MESSAGE // 2
            if len(text) <= MAX_MESSAGE:
                raise
            cut = f" ... ({len(text) - MAX_MESSAGE:,} characters cut) ... "
            shorter = type(e)(text[:half] + cut + text[-half:], code=e.code)
            for note in getattr(e, "__notes__", ()):
                shorter.add_note(note)
            raise shorter from e

    return call  # type: ignore[return-value]
