"""The exception types of sharetree: TieError, and TieTypeError for arguments of a wrong type."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["TieError", "TieTypeError", "one_line", "safe_repr", "bounded"]

MAX_MESSAGE = 4000
"""The longest message of a function that reads a file (a key of the file may be any length)."""

F = TypeVar("F", bound=Callable[..., Any])


class TieError(ValueError):
    """A bad tie, graph or input; each message names the path(s), expected, found and a fix.

    Example:
        >>> import sharetree as st
        >>> issubclass(st.TieError, ValueError)
        True
    """


class TieTypeError(TieError, TypeError):
    """A :class:`TieError` for an argument of the wrong type; also a ``TypeError``.

    Example:
        >>> import sharetree as st
        >>> issubclass(st.TieTypeError, TypeError), issubclass(st.TieTypeError, st.TieError)
        (True, True)
    """


def one_line(e: BaseException) -> str:
    """``TypeName: message`` of an exception on one line (for messages quoting a library)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def safe_repr(x: object, limit: int = 80) -> str:
    """``repr(x)`` cut to ``limit`` characters for a message; a repr that raises is named.

    Example:
        >>> from sharetree._errors import safe_repr
        >>> safe_repr(10**5000)
        '<int whose repr raised ValueError>'
    """
    try:
        text = repr(x)
    except Exception as e:  # a user object's repr, or an int past Python's digit limit
        return f"<{type(x).__name__} whose repr raised {type(e).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded(f: F) -> F:
    """``f`` whose TieError messages are cut in the middle past ``MAX_MESSAGE`` characters.

    For the functions that read files: a message quotes the file's keys, which may be of any
    length; its start (what failed, where) and end (the fix) are kept.
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
            raise type(e)(text[:half] + cut + text[-half:]) from e

    return call  # type: ignore[return-value]
