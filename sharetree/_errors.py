"""The one exception type of sharetree."""

from __future__ import annotations

__all__ = ["TieError"]


class TieError(ValueError):
    """A bad tie, sharing graph or input to a sharetree function.

    Every message names the key path(s) involved, what was expected, what was
    found, and a way to fix it.

    Example:
        >>> import sharetree as st
        >>> issubclass(st.TieError, ValueError)
        True
    """
