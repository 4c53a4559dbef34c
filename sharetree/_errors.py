"""The one exception type of sharetree."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["TieError", "closest"]


class TieError(ValueError):
    """A bad tie, sharing graph or input to a sharetree function.

    Every message names the key path(s) involved, what was expected, what was
    found, and a way to fix it.

    Example:
        >>> import sharetree as st
        >>> issubclass(st.TieError, ValueError)
        True
    """


def closest(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """Return a ``did you mean ...`` hint listing the paths closest to ``name``."""
    candidates = sorted(set(candidates))
    matches = difflib.get_close_matches(name, candidates, n=n, cutoff=0.0)
    if not matches:
        return "the tree has no paths at all"
    return "closest existing path(s): " + ", ".join(repr(m) for m in matches)
