"""A Griffe extension for the API reference: sharetree's docstrings as mkdocstrings reads them.

The docstrings are Google style with Sphinx roles (``:func:`~sharetree.load```), which
mkdocstrings (Markdown) would print as they are, and ``Example:`` sections, which Griffe
only parses as examples (doctest lines as code) when titled ``Examples:``. This extension
rewrites both when Griffe loads an object, before the docstring is parsed; the source is
not changed. A role naming a public object becomes a cross-reference link to its entry,
any other role plain code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc):`(~?)([\w.]+)(\(\))?`")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_RST_ESCAPE = re.compile(r"(?<=`)\\ ")  # ``OSError``\ s: reST's escaped space before a suffix


def _public() -> set[str]:
    import sharetree
    import sharetree.flax
    import sharetree.nnx

    names = {f"sharetree.{n}" for n in sharetree.__all__}
    names |= {f"sharetree.flax.{n}" for n in sharetree.flax.__all__}
    names |= {f"sharetree.nnx.{n}" for n in sharetree.nnx.__all__}
    return names


def rewrite(text: str, public: set[str]) -> str:
    r"""``text`` with ``Example:`` titled ``Examples:`` and each role a link or code.

    Example:
        >>> rewrite(":func:`~sharetree.load` and :meth:`canonical`", {"sharetree.load"})
        '[`load`][sharetree.load] and `canonical`'
        >>> rewrite(":func:`load`", {"sharetree.load"})
        '[`load`][sharetree.load]'
        >>> rewrite("other ``OSError``\ s", set())
        'other ``OSError``s'
    """

    def role(m: re.Match[str]) -> str:
        short, target = m.group(1), m.group(2)
        shown = target.rsplit(".", 1)[-1] if short else target
        shown = f"`{shown}{m.group(3) or ''}`"
        # a bare name of sharetree's (``destructure``) and a method or attribute of a public
        # class (``sharetree.Restructure.canonical``) link too
        for full in (target, f"sharetree.{target}"):
            if full in public or full.rsplit(".", 1)[0] in public - {"sharetree"}:
                return f"[{shown}][{full}]"
        return shown

    return _ROLE.sub(role, _EXAMPLE.sub(r"\1Examples:", _RST_ESCAPE.sub("", text)))


class SharetreeDocstrings(griffe.Extension):
    """Rewrites every docstring of the ``sharetree`` package as :func:`rewrite` says."""

    def __init__(self) -> None:
        super().__init__()
        self.public = _public()

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each object Griffe loads from sharetree."""
        if obj.docstring is not None and obj.path.startswith("sharetree"):
            obj.docstring.value = rewrite(obj.docstring.value, self.public)
