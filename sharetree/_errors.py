"""The exception types of sharetree: TieError, and TieTypeError for arguments of a wrong type."""

from __future__ import annotations

__all__ = ["TieError", "TieTypeError"]


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
