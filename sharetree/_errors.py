"""The exception types of sharetree: TieError, and TieTypeError for arguments of a wrong type."""

from __future__ import annotations

__all__ = ["TieError", "TieTypeError", "one_line", "safe_repr"]


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
