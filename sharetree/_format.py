"""The names and numbers of the sharetree file format (``docs/saving_and_scaling.md``)."""

from __future__ import annotations

__all__ = [
    "FORMAT_VERSION",
    "KEY_IMPLS",
    "KEY_LIBRARY",
    "KEY_TREE",
    "KEY_VERSION",
    "LIBRARY_VERSION",
    "MAX_DEPTH",
    "PREFIX",
]

LIBRARY_VERSION = "0.1.0.dev0"  # sharetree.__version__, written into every file
FORMAT_VERSION = 4
"""The newest file format version: ``load`` reads versions up to it."""

PREFIX = "sharetree."  # of sharetree's own metadata keys (refused in save(metadata=))
KEY_VERSION = PREFIX + "format_version"  # marks a file st.save wrote: its format version
KEY_TREE = PREFIX + "tree"  # the JSON structure of the tree
KEY_LIBRARY = PREFIX + "library_version"  # the version of sharetree that wrote the file

MAX_DEPTH = 200
"""The deepest nesting of containers :func:`save` writes and :func:`load` reads (the root is 0)."""

KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
"""The PRNG implementations of typed key arrays (``jax.random.key``) a file may hold."""
