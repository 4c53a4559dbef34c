"""``grad_report``: which use moves a tied weight (norms, shares and cosines of its uses)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from html import escape
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from sharetree._errors import check_mapping, error, short, wrong_type
from sharetree._paths import closest, key_str, plural
from sharetree._tables import (
    CELL,
    MAX_ROWS,
    check_max_rows,
    first_of,
    html_page,
    html_table,
    more_line,
    svg,
    text_table,
)

__all__ = ["GradReport", "BufferUses", "Use", "grad_report"]

_BAR = 20  # characters (text) for a share of 100%
_BAR_PX = 220  # pixels (SVG) for a share of 100%
_AGREE = "#2563eb"
_FIGHT = "#dc2626"


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a buffer.

    Attributes:
        path: the position (the buffer's own path, or a view's).
        norm: the 2-norm of its contribution (pulled back into the buffer's shape).
        share: ``norm`` over the sum of the uses' norms (``nan`` if every use is zero).
        cos_rest: cosine between its contribution and the sum of the other uses'
            (``None`` for a buffer's only use, ``nan`` when either is zero).
    """

    path: str
    norm: float
    share: float
    cos_rest: float | None


@dataclasses.dataclass(frozen=True)
class BufferUses:
    """The uses of one buffer.

    Attributes:
        path: the buffer's path.
        uses: one :class:`Use` per use, in flatten order.
        norm: the 2-norm of the accumulated gradient (the sum of the uses).
        cosines: ``cosines[i][j]`` between uses i and j (``nan`` where one is zero).
    """

    path: str
    uses: tuple[Use, ...]
    norm: float
    cosines: tuple[tuple[float, ...], ...]


_FIX = "pass what st.grad_by_use(fun)(tree, ...) returns"


def _host(x: Any, where: str) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # tracers have no value
        fix = "call st.grad_report outside jit, on what grad_by_use returned from it"
        raise error("E27", where, "is not a concrete array", found=type(x).__name__, fix=fix) from e
    if not (a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.number)):  # bfloat16 too
        found = f"{a.dtype} {short(a, 60)}"
        raise error("E68", where, "is not a numeric array", found=found, fix=_FIX)
    return a.astype(np.complex128 if np.iscomplexobj(a) else np.float64).ravel()


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return math.nan
    return float(np.real(np.vdot(a, b))) / (na * nb)


def _is_key(k: Any) -> bool:
    """A path as results write it: '/'-joined, or a tuple of keys (a key containing '/')."""
    return isinstance(k, str) or (isinstance(k, tuple) and all(isinstance(x, str) for x in k))


def _buffer_uses(path: Any, uses: Any) -> BufferUses:
    where, expected = f"grad_report: buffer {short(path)}", "a non-empty dict {use: contribution}"
    if not check_mapping(uses, "E27", where, expected, _FIX):
        raise error("E27", where, "has no uses", expected=expected, found="{}", fix=_FIX)
    bad = next((k for k in (path, *uses) if not _is_key(k)), None)
    if bad is not None:
        expected = "'/'-joined paths (tuples of keys where a key holds '/')"
        raise wrong_type("E68", f"{where}: a path", expected, bad, _FIX)
    path = key_str(path)  # shown as every sharetree message shows a path
    where = f"grad_report: buffer {path!r}"
    vecs = {key_str(u): _host(g, f"{where}: the contribution of {u!r}") for u, g in uses.items()}
    if len({v.size for v in vecs.values()}) != 1:
        sizes = ", ".join(f"{u!r}: {v.size}" for u, v in vecs.items())
        raise error("E27", where, "has uses of different sizes", found=sizes, fix=_FIX)
    total = sum(vecs.values())
    norms = {u: float(np.linalg.norm(v)) for u, v in vecs.items()}
    denominator = sum(norms.values()) or math.nan  # every share is nan when every use is zero
    rows = tuple(
        Use(u, norms[u], norms[u] / denominator, None if len(vecs) == 1 else _cos(v, total - v))
        for u, v in vecs.items()
    )
    cosines = tuple(tuple(_cos(a, b) for b in vecs.values()) for a in vecs.values())
    return BufferUses(path, rows, float(np.linalg.norm(total)), cosines)


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted with ``spec``; ``-`` for ``None`` and ``nan``."""
    return "-" if x is None or math.isnan(x) else format(x, spec)


_HEADER = ("use", "norm", "share", "cos(rest)")


class _Block(NamedTuple):
    """What the text and HTML reports show of one buffer used in several places."""

    buffer: BufferUses
    title: str  # after the buffer's path: its number of uses and the norm of their sum
    rows: list[tuple[str, ...]]  # path, norm, share, cos(rest) of each use shown
    more: str  # the "... and K more uses" line, or ""


@dataclasses.dataclass(frozen=True)
class GradReport:
    """Which use moves each tied weight: made by :func:`grad_report`.

    ``print`` it, or see a table and a bar chart per shared buffer in Jupyter.

    Attributes:
        buffers: one :class:`BufferUses` per buffer, in flatten order.
        max_rows: the most buffers (and uses per buffer) shown.
    """

    buffers: tuple[BufferUses, ...]
    max_rows: int = MAX_ROWS

    @property
    def shared(self) -> tuple[BufferUses, ...]:
        """The buffers with two or more uses."""
        return tuple(b for b in self.buffers if len(b.uses) > 1)

    def __getitem__(self, path: str | tuple[str, ...]) -> BufferUses:
        """The uses of the buffer at ``path`` (a ``KeyError`` naming the closest paths if none)."""
        found = next((b for b in self.buffers if b.path == key_str(path)), None)
        if found is None:
            raise KeyError(
                f"{path!r}: no such buffer; {closest(str(path), (b.path for b in self.buffers))}"
            )
        return found

    def _headline(self) -> str:
        n, k = len(self.buffers), len(self.shared)
        if not k:
            return (
                f"gradient by use: no buffer has more than one use (nothing is tied), so each "
                f"of the {plural(n, 'buffer')} gets its gradient from its own position only"
            )
        return f"gradient by use: {k:,} of {plural(n, 'buffer')} used in several places"

    def _blocks(self) -> Iterator[_Block]:
        """Per buffer shown: it, its title after the path, its rows and ``... more`` line."""
        for b in self.shared[: self.max_rows]:
            rows: list[tuple[str, ...]] = [
                (u.path, _fmt(u.norm, ".4g"), _fmt(u.share, ".1%"), _fmt(u.cos_rest, "+.3f"))
                for u in b.uses[: self.max_rows]
            ]
            title = f": {len(b.uses)} uses, norm of their sum {_fmt(b.norm, '.4g')}"
            yield _Block(b, title, rows, more_line(len(b.uses), len(rows), "uses"))

    def _single(self) -> str:
        single = [b.path for b in self.buffers if len(b.uses) == 1]
        if not single or not self.shared:
            return ""
        return f"{plural(len(single), 'buffer')} with one use each: {first_of(single, 5)}"

    def __str__(self) -> str:
        lines = [self._headline()]
        for b, title, rows, more in self._blocks():
            bars = ("" if math.isnan(u.share) else "\u2588" * round(_BAR * u.share) for u in b.uses)
            table = text_table((*_HEADER, ""), [(*r, bar) for r, bar in zip(rows, bars)], more)
            lines += [b.path + title, *table]
        more = more_line(len(self.shared), self.max_rows, "buffers used in several places")
        lines += [line for line in (more, self._single()) if line]
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__

    def _svg(self, b: BufferUses, rows: list[tuple[str, ...]]) -> str:
        label_w = 7 * max(len(r[0]) for r in rows) + 12
        out = []
        for k, (u, (path, norm, pct, cos)) in enumerate(zip(b.uses, rows)):
            y = 4 + k * 18
            width = 0.0 if math.isnan(u.share) else u.share * _BAR_PX
            fill = _FIGHT if u.cos_rest is not None and u.cos_rest < 0 else _AGREE
            out.append(
                f"<g><title>{escape(path)}: norm {norm}, share {pct}, cos(rest) {cos}</title>"
                f'<text x="0" y="{y + 12}">{escape(path)}</text>'
                f'<rect x="{label_w}" y="{y + 2}" width="{width:.1f}" height="12" fill="{fill}"/>'
                f'<text x="{label_w + width + 6:.1f}" y="{y + 12}" fill="#374151">'
                f"{pct} cos {cos}</text></g>"
            )
        return svg(label_w + _BAR_PX + 150, 4 + 18 * len(rows) + 4, 11, out)

    def _repr_html_(self) -> str:
        parts = []
        for b, title, rows, more in self._blocks():
            parts += [
                f"<div><b>{escape(b.path)}</b>{escape(title)}</div>",
                html_table(_HEADER, rows, numeric={1, 2, 3}, more=more),
                self._svg(b, rows),
            ]
        more = more_line(len(self.shared), self.max_rows, "buffers")
        parts += [f'<div style="{CELL}">{more}</div>'] if more else []
        parts += [f"<div>{escape(self._single())}</div>"] if self._single() else []
        return html_page("sharetree-grad-report", self._headline(), parts)


def grad_report(by_use: Mapping[str, Mapping[str, Any]], *, max_rows: int = MAX_ROWS) -> GradReport:
    """Summarize :func:`~sharetree.grad_by_use` output: norm, share and cosine of each use.

    Computed on the host in float64 (see "Reading grad_report" in the docs).

    Args:
        by_use: what ``st.grad_by_use(fun)(tree, ...)`` returns (concrete, not traced).
        max_rows: the most buffers, and uses per buffer, shown.

    Raises:
        TieError: an input that is not such a dict, contributions of one
            buffer with different sizes, or traced values.

    Example:
        >>> import jax.numpy as jnp, sharetree as st
        >>> tree = {"embed": jnp.array([[1.0, 2.0]]), "head": st.Tied("embed", st.T)}
        >>> loss = lambda m: m["embed"].sum() - 3 * m["head"].sum()
        >>> print(st.grad_report(st.grad_by_use(loss)(tree)))
        gradient by use: 1 of 1 buffer used in several places
        embed: 2 uses, norm of their sum 2.828
          use    norm   share  cos(rest)
          embed  1.414  25.0%  -1.000     █████
          head   4.243  75.0%  -1.000     ███████████████
    """
    expected = "a dict {buffer path: {use path: contribution}}"
    check_mapping(by_use, "E27", "grad_report", expected, _FIX)
    check_max_rows(max_rows, "grad_report")
    return GradReport(tuple(_buffer_uses(p, u) for p, u in by_use.items()), max_rows)
