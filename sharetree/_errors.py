"""The exception types of sharetree: TieError, and TieTypeError for arguments of a wrong type."""

from __future__ import annotations

__all__ = ["TieError", "TieTypeError"]


class TieError(ValueError):
    """A bad tie, sharing graph or input to a sharetree function.

    Every message names the key path(s) involved, what was expected, what was
    found, and a way to fix it.

    Example:
        >>> import sharetree as st
        >>> issubclass(st.TieError, ValueError)
        True
    """


class TieTypeError(TieError, TypeError):
    """A :class:`TieError` for an argument of the wrong type; also a ``TypeError``.

    Example:
        >>> import sharetree as st
        >>> try:
        ...     st.scale("2")
        ... except TypeError as e:
        ...     print(type(e).__name__, isinstance(e, st.TieError))
        TieTypeError True
    """
