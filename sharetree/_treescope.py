"""The sharing in treescope: a ``Tied`` rendered as a coloured view, a materialized tree marked.

Importing it registers :func:`tied_treescope_repr` as ``Tied``'s treescope renderer
(``_tied.DISPLAY``); treescope itself is imported only when something is rendered.
"""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu

from sharetree._materialize import expand_leaves, leaves_and_structure
from sharetree._paths import key_str, path_str, plural, ref_str
from sharetree._report import SharingGraph
from sharetree._tables import first_of, headline, printable, saved_percent
from sharetree._tied import DISPLAY, Tied
from sharetree._transforms import Transform, identity

__all__ = ["MaterializedDisplay", "tied_treescope_repr", "treescope_materialized"]


_NEUTRAL = "#e5e7eb"
"""The colour of a ``Tied`` of several refs: it reads several buffers, none of them its own."""
_MAX_INPUTS = 4  # inputs named in a note before "... (K more)"


def _color(source: str) -> str:
    """The colour of a buffer, or of a view of several positions (by path), and of its views."""
    from treescope import formatting_util

    return formatting_util.color_from_string(source)


def _via(t: Transform) -> str:
    return "" if t == identity else f" via {t!r}"


def tied_treescope_repr(tied: Tied, path: str | None, subtree_renderer: Any) -> Any:
    """``Tied('enc/w', T)  # view of enc/w``, coloured as the buffer at its ref is.

    A ``Tied`` of several refs names each (``# view of a=lora/a, b=lora/b via lora``) on
    a neutral grey: it reads several buffers.
    """
    from treescope import rendering_parts as rp

    if tied.inputs is None:
        ref = path_str(tied.ref)
        color = _color(ref)
    else:
        named = [f"{n}={key_str(ref_str(r))}" for n, r in tied.refs]
        ref, color = first_of(named, _MAX_INPUTS), _NEUTRAL
    line = rp.siblings(rp.maybe_qualified_type_name(Tied), repr(tied).removeprefix("Tied"))
    node = rp.build_one_line_tree_node(line, path, background_color=color)
    note = printable(f"  # \u2192 view of {ref}{_via(tied.transform)}")
    return rp.siblings_with_annotations(node, extra_annotations=[rp.comment_color(rp.text(note))])


class _Mark:
    """A materialized leaf wrapped with a note, for :class:`MaterializedDisplay`."""

    __slots__ = ("badge", "color", "note", "value")

    def __init__(self, value: Any, badge: str, note: str, color: str) -> None:
        self.value, self.badge, self.note, self.color = value, badge, note, color

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import rendering_parts as rp

        inner = subtree_renderer(self.value, path=path)
        style = f"background-color:{self.color};border-radius:3px;"
        badge = rp.custom_style(rp.text(printable(self.badge)), style)
        notes = [rp.comment_color(rp.text(printable(f"  # {self.note}")))] if self.note else []
        return rp.siblings_with_annotations(badge, " ", inner, extra_annotations=notes)


class MaterializedDisplay:
    """A materialized tree that treescope shows with every buffer and view marked.

    Made by :func:`treescope_materialized`; a buffer and its views share a
    colour. Display it in Jupyter, pass it to ``treescope.show``, or ``print`` it.

    Attributes:
        tree: the canonical tree.
        graph: its sharing graph.

    Example:
        >>> import numpy as np, sharetree as st
        >>> st.MaterializedDisplay({"w": np.ones(3), "v": st.Tied("w")}).graph
        SharingGraph(1 buffer, 1 view; params 3 unique / 6 expanded; bytes 24 / 48)
    """

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self._leaves, structure = leaves_and_structure(tree)
        self.graph = SharingGraph(structure, self._leaves)

    def marked_tree(self) -> Any:
        """The materialized tree whose buffer and view leaves are wrapped with their notes.

        A view is coloured as its source is: its buffer, or the view of several positions
        it reads (which has its own colour, from its path); a buffer counts every view
        that reads it, through views of several positions too.
        """
        structure = self.graph.structure
        n = len(structure.buffer_paths)
        uses: dict[int, list[str]] = {}
        for view in structure.views:
            for b in structure.parents[view.buffer]:
                uses.setdefault(b, []).append(path_str(view.path))
        marked = []
        values = expand_leaves(structure, self._leaves)
        for (i, t, p, at), x in zip(structure.expanded, values, strict=True):
            src = path_str(structure.source_path(i))
            if t is not None:
                note = f"from Tied at {path_str(at)}" if at not in (None, p) else ""
                of = f"{src}{_via(t)}"
                if i >= n and structure.joins[i - n].path == p:  # a view of several itself
                    join = structure.joins[i - n]
                    named = [f"{name}={path_str(structure.source_path(inp.source))}"
                             + ("" if inp.transform == identity else f" >> {inp.transform!r}")
                             for name, inp in join.inputs]  # fmt: skip
                    of = first_of(named, _MAX_INPUTS) + _via(join.transform)
                marked.append(_Mark(x, f"[view of {of}]", note, _color(src)))
            elif i in uses:
                badge = f"[buffer: {plural(len(uses[i]), 'view')}]"
                marked.append(_Mark(x, badge, f"shared with {first_of(uses[i], 3)}", _color(src)))
            else:
                marked.append(x)
        return jtu.tree_unflatten(structure.expanded_treedef, marked)

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import rendering_parts as rp

        g = self.graph
        saved = saved_percent(g.nbytes_unique, g.nbytes_expanded)
        head = f"# materialized tree; {headline(g)} ({saved:.1f}% of bytes saved)"
        body = subtree_renderer(self.marked_tree(), path=path)
        return rp.siblings_with_annotations(rp.comment_color(rp.text(head)), rp.text("\n"), body)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        # Not ``_repr_html_``: treescope embeds any object that has one, which would recurse.
        import treescope

        page = treescope.render_to_html(self, compressed=False)
        return {"text/html": page, "text/plain": repr(self)}

    def __repr__(self) -> str:
        import treescope

        return treescope.render_to_text(self)


def treescope_materialized(tree: Any) -> MaterializedDisplay:
    """Show the materialized ``tree`` in treescope, its views and buffers marked.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"enc": np.arange(2, dtype=np.float32), "dec": st.Tied("enc", st.scale(2.0))}
        >>> print(st.treescope_materialized(tree))
        # materialized tree; sharing graph: 1 buffer, 1 view (50.0% of bytes saved)
        {
          'dec': [view of enc via scale(2.0)] <jax.Array([0., 2.], dtype=float32)>,
          'enc': [buffer: 1 view] np.array([0., 1.], dtype=float32),  # shared with dec
        }
    """
    return MaterializedDisplay(tree)


# the renderer that Tied looks up (the core never imports this module)
DISPLAY.update(tied_treescope=tied_treescope_repr)
