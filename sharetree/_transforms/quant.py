"""Quantized tables in MLX's affine layout: ``dequantize``, ``quantize`` and ``fake_quant``.

The layout is ``mlx.core.quantize``'s (mode ``"affine"``): a float table ``w`` of shape
``(..., n)`` is three arrays. ``q`` (uint32, ``(..., n * bits // 32)``) holds the values
``0 .. 2**bits - 1`` along the last axis, lowest bits first, as one bit stream: value ``i``
of a row has the bits ``i * bits .. (i + 1) * bits - 1``, bit ``b`` of the stream being bit
``b % 32`` of word ``b // 32`` (for 2, 4 and 8 bits a word holds ``32 // bits`` whole
values; a 3, 5 or 6-bit value may straddle two words). ``scales`` and ``biases``
(``(..., n // group_size)``) hold one scale and one bias per run of ``group_size`` values:
``w = scale * q + bias``, in the scales' dtype.

The quantization rule is MLX's (``quantize`` in mlx/backend/cpu/quantized.cpp and the
fallback in mlx/ops.cpp): per group, in float32, the end of larger magnitude (``min`` or
``max``) is the edge, the scale ``(max - min) / (2**bits - 1)`` (at least ``1e-7``) takes
the sign that puts the edge at ``q = 0`` (negative where the edge is the maximum), and is
then adjusted to ``edge / round(edge / scale)`` so that zero is exact; the bias is the
edge (0 where the edge rounds to 0 steps). Scales and biases are then rounded to the
table's dtype. MLX's GPU kernels (Metal, CUDA) differ in two corners: a group's maximum
starts at 0 (a group of negative values only) and halves round away from zero
(``round``, not ``rint``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from sharetree._errors import error, wrong_type
from sharetree._transforms.builtins import set_fields
from sharetree._transforms.protocol import Names, Transform, canonical_dtype, is_int

__all__ = ["BITS", "GROUP_SIZES", "Quantized", "dequantize", "fake_quant", "quantize"]

BITS = (2, 3, 4, 5, 6, 8)
"""The bit widths MLX's affine mode defines."""

GROUP_SIZES = (32, 64, 128)
"""The group sizes MLX's affine mode defines."""

_OTHER_MODES = {
    "mxfp4": "4-bit floats (e2m1) with uint8 power-of-two scales (e8m0) per 32, no biases",
    "mxfp8": "8-bit floats (e4m3) with uint8 power-of-two scales (e8m0) per 32, no biases",
    "nvfp4": "4-bit floats (e2m1) with uint8 fp8 (e4m3) scales per 16, no biases",
}
"""MLX's modes besides ``"affine"``: another layout, which sharetree does not read."""

_EPS = np.float32(1e-7)
"""MLX's smallest scale (a group of equal values)."""

Inputs = Mapping[str, Any]
"""``{name: value}``: arrays, tracers or ``jax.ShapeDtypeStruct``."""


class Quantized(TypedDict):
    """A table quantized by :func:`quantize`: the three inputs of :func:`dequantize`.

    A plain ``dict`` (a ``TypedDict``): put it in a tree where the float table was and tie
    the views to its keys, ``"embed/q"``, ``"embed/scales"``, ``"embed/biases"``. It saves
    and loads as a dict, and its keys are MLX's ``(w_q, scales, biases)`` in that order.

    Example:
        >>> import numpy as np, sharetree as st
        >>> packed = st.quantize(np.ones((2, 64), np.float32), 4, 64)
        >>> sorted(packed), packed["q"].dtype
        (['biases', 'q', 'scales'], dtype('uint32'))
    """

    q: jax.Array
    scales: jax.Array
    biases: jax.Array


# --- the parameters -----------------------------------------------------------------------


def _check_params(where: str, bits: Any, group_size: Any, mode: Any = "affine") -> None:
    """E73 for arguments of the wrong type, E200 for sizes MLX does not define, E201 a mode."""
    for what, v in (("bits", bits), ("group_size", group_size)):
        if not is_int(v):
            raise wrong_type("E73", f"{where}: {what}", "an integer", v, "pass integers: (4, 64)")
    if not isinstance(mode, str):
        raise wrong_type("E73", f"{where}: mode", 'the str "affine"', mode, 'pass mode="affine"')
    if mode != "affine":
        if mode in _OTHER_MODES:
            problem = f"MLX's mode {mode!r} ({_OTHER_MODES[mode]}) is not read by sharetree"
            fix = "quantize the float table again with mode='affine' (MLX's default)"
        else:
            problem = f"names no mode of MLX ({', '.join(['affine', *_OTHER_MODES])})"
            fix = "leave mode out: 'affine' is the only one sharetree reads"
        expected = "mode 'affine'"
        raise error("E201", where, problem, expected=expected, found=repr(mode), fix=fix)
    if bits not in BITS or group_size not in GROUP_SIZES:
        expected = (
            f"bits {', '.join(map(str, BITS))} and a group_size of "
            f"{', '.join(map(str, GROUP_SIZES))} (MLX's affine mode)"
        )
        fix = "pass MLX's sizes, e.g. (4, 64) (MLX's default)"
        if bits in GROUP_SIZES and group_size in BITS:
            fix = "sharetree takes (bits, group_size), MLX (group_size, bits): "
            fix += f"({group_size}, {bits})"
        found = f"bits {bits}, group_size {group_size}"
        raise error("E200", where, expected=expected, found=found, fix=fix)


@dataclasses.dataclass(frozen=True, eq=False)
class _Block:
    """Where the values of a block lie in its words: the fewest words holding whole values.

    A block of ``words`` words holds ``values`` values (``math.lcm(bits, 32)`` bits); each
    array is ``(words, values)``, static: whether value ``j`` has bits in word ``k``, how
    many of its bits come before that word (``below``), and its offset in it (``offset``).
    """

    bits: int
    words: int
    values: int
    meets: np.ndarray
    below: np.ndarray
    offset: np.ndarray


@functools.cache
def _block(bits: int) -> _Block:
    block_bits = math.lcm(bits, 32)
    words, values = block_bits // 32, block_bits // bits
    first = np.arange(values) * bits  # each value's first bit in its block's stream
    start = 32 * np.arange(words)[:, None]  # each word's first bit
    meets = (first < start + 32) & (first + bits > start)
    below = np.clip(start - first, 0, 31).astype(np.uint32)
    offset = np.clip(first - start, 0, 31).astype(np.uint32)
    return _Block(bits, words, values, meets, below, offset)


# --- the layout ---------------------------------------------------------------------------


def _unpack(q: ArrayLike, bits: int) -> jax.Array:
    """The values of the uint32 words ``q`` (``(..., words)``), ``(..., words * 32 // bits)``.

    Shifts and masks only, each value from the one or two words of its block that hold its
    bits (a 3, 5 or 6-bit value may straddle two): no gather, so XLA fuses it into what reads
    the view, a lookup ``table[ids]`` unpacking only the rows it reads.
    """
    q = jnp.asarray(q)
    block, mask = _block(bits), np.uint32((1 << bits) - 1)
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // block.words, block.words, 1)
    parts = (blocks >> block.offset) << block.below  # (..., blocks, words, values)
    # a value's bits from two words are disjoint: their sum is their bitwise or
    values = jnp.where(block.meets, parts, np.uint32(0)).sum(-2, dtype=jnp.uint32) & mask
    return values.reshape(*q.shape[:-1], q.shape[-1] * 32 // bits)


def _pack(values: jax.Array, bits: int) -> jax.Array:
    """uint32 ``values`` below ``2**bits`` (``(..., n)``) as words ``(..., n * bits // 32)``."""
    n, block = values.shape[-1], _block(bits)
    blocks = values.reshape(*values.shape[:-1], n // block.values, 1, block.values)
    parts = (blocks >> block.below) << block.offset  # (..., blocks, words, values)
    # the values' bits in a word are disjoint: their sum is their bitwise or
    words = jnp.where(block.meets, parts, np.uint32(0)).sum(-1, dtype=jnp.uint32)
    return words.reshape(*values.shape[:-1], n * bits // 32)


def _scaled(values: jax.Array, scales: ArrayLike, biases: ArrayLike, group_size: int) -> jax.Array:
    """``scale * value + bias`` of each group, in the scales' dtype (``(..., n)``)."""
    scales, biases = jnp.asarray(scales), jnp.asarray(biases)
    shape = values.shape
    grouped = values.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    out = grouped.astype(scales.dtype) * scales[..., None] + biases[..., None]
    return out.reshape(shape)


def _affine(w: ArrayLike, bits: int, group_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """MLX's affine rule: the values (uint32, ``(..., n)``), scales and biases in float32."""
    x = jnp.asarray(w).astype(jnp.float32)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    hi, lo = groups.max(-1), groups.min(-1)
    n_bins = np.float32((1 << bits) - 1)
    # MLX divides; XLA turns a division by a constant or a broadcast into a multiplication by
    # its reciprocal (rounded twice, one step off at ties): the barriers keep the division
    exact = jax.lax.optimization_barrier
    scale = jnp.maximum((hi - lo) / exact(jnp.full(hi.shape, n_bins)), _EPS)
    low_edge = jnp.abs(lo) > jnp.abs(hi)  # the end of larger magnitude is the edge
    scale = jnp.where(low_edge, scale, -scale)  # the edge is at q = 0, the other end above
    edge = jnp.where(low_edge, lo, hi)
    q0 = jnp.round(edge / scale)  # ties to even, as MLX's std::rint
    at_zero = q0 == 0
    scale = jnp.where(at_zero, scale, edge / jnp.where(at_zero, 1, q0))  # zero is exact
    bias = jnp.where(at_zero, np.float32(0), edge)
    steps = (groups - bias[..., None]) / exact(jnp.broadcast_to(scale[..., None], groups.shape))
    values = jnp.clip(jnp.round(steps), 0, n_bins).astype(jnp.uint32)
    return values.reshape(x.shape), scale, bias


def _table_dtype(where: str, w: Any, group_size: int) -> np.dtype:
    """The dtype of a table ``quantize`` or ``fake_quant`` reads, else E206."""
    shape, dtype = getattr(w, "shape", None), getattr(w, "dtype", None)
    fix = "quantize a float array of shape (..., n) with n a multiple of the group size"
    if shape is None or dtype is None:
        raise wrong_type("E206", where, "a float array", w, fix)
    found = f"{np.dtype(dtype).name}[{', '.join(map(str, shape))}]"
    if not jnp.issubdtype(dtype, jnp.floating):  # integers, complex: another type of array
        raise wrong_type("E206", where, "a real float array", w, fix, found=found)
    if not shape or shape[-1] % group_size or not shape[-1]:
        expected = f"a last axis of whole groups of {group_size} values"
        raise error("E206", where, expected=expected, found=found, fix=fix)
    return canonical_dtype(dtype)


def _check_finite(
    w: jax.Array, scales: jax.Array, biases: jax.Array, bits: int, group_size: int
) -> None:
    """E207 for a group holding NaN or an infinity, or whose scale or bias is not finite."""
    x = np.asarray(w)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    values_bad = ~np.isfinite(groups).all(-1)
    bad = values_bad | ~np.isfinite(np.asarray(scales)) | ~np.isfinite(np.asarray(biases))
    if not bad.any():
        return
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    *row, g = first
    at = f"group {g} (columns {g * group_size}:{(g + 1) * group_size})"
    if row:
        at = f"row {row[0] if len(row) == 1 else tuple(row)} {at}"
    if values_bad[first]:
        kinds = [k for k, f in (("NaN", np.isnan), ("inf", np.isinf)) if f(groups[first]).any()]
        found = f"{' and '.join(kinds)} among its values"
    else:
        found = (
            f"scale {np.asarray(scales)[first]}, bias {np.asarray(biases)[first]} "
            f"(its range overflows {x.dtype.name})"
        )
    more = int(bad.sum()) - 1
    found += f" ({more} more group{'s' * (more != 1)} alike)" if more else ""
    fix = "find where the values came from, or replace them (jnp.nan_to_num) before quantizing"
    where = f"quantize(w, {bits}, {group_size}): {at}"
    raise error("E207", where, "has no finite scale and bias", found=found, fix=fix)


# --- the transforms -----------------------------------------------------------------------


def _aval_text(v: Any) -> str:
    return f"{np.dtype(v.dtype).name}[{', '.join(map(str, v.shape))}]"


def _fits(words: int, groups: int) -> list[str]:
    """The ``dequantize(bits, group_size)`` calls that fit ``words`` per row and ``groups``."""
    return [
        f"dequantize({b}, {g})"
        for b in BITS
        for g in GROUP_SIZES
        if words * 32 % b == 0 and words * 32 // b == groups * g
    ]


@dataclasses.dataclass(frozen=True, repr=False)
class _Dequantize(Transform, name="dequantize"):
    """The class of :func:`dequantize`."""

    bits: int
    group_size: int
    mode: str = "affine"
    inputs: ClassVar = ("biases", "q", "scales")
    field_docs: ClassVar = {
        "bits": "2, 3, 4, 5, 6 or 8",
        "group_size": "32, 64 or 128",
        "mode": "the string 'affine'",
    }

    def __post_init__(self) -> None:
        _check_params(repr(self), self.bits, self.group_size, self.mode)
        set_fields(self, bits=int(self.bits), group_size=int(self.group_size))

    def _check(self, x: Inputs) -> jax.ShapeDtypeStruct:
        """The view's shape and dtype, else the error naming the inputs that do not fit."""
        where = repr(self)
        for name in self.inputs:
            if getattr(x[name], "shape", None) is None or getattr(x[name], "dtype", None) is None:
                found = f"{type(x[name]).__name__} at input {name!r}"
                fix = "tie the arrays quantize returned (or mx.quantize's)"
                raise error("E204", where, "takes arrays", found=found, fix=fix)
        q, scales, biases = x["q"], x["scales"], x["biases"]
        shown = f"q {_aval_text(q)}, scales {_aval_text(scales)}, biases {_aval_text(biases)}"
        if np.dtype(q.dtype) != np.uint32:
            fix = "view the words as uint32 (the same bits): q.view(np.uint32)"
            if not jnp.issubdtype(q.dtype, jnp.integer):
                fix = "tie the packed words quantize returned (uint32), not a float table"
            raise error("E202", where, expected="q of uint32 words", found=shown, fix=fix)
        for name, v in (("scales", scales), ("biases", biases)):
            if not jnp.issubdtype(v.dtype, jnp.floating):
                fix = "tie the float scales and biases quantize returned"
                expected = f"float {name} (the view's dtype is theirs)"
                raise error("E203", where, expected=expected, found=shown, fix=fix)
        if np.dtype(scales.dtype) != np.dtype(biases.dtype):
            fix = f"cast both to one dtype, e.g. biases.astype({np.dtype(scales.dtype).name})"
            expected = "scales and biases of one dtype"
            raise error("E203", where, expected=expected, found=shown, fix=fix)
        lead = q.shape[:-1]
        if (
            not q.shape
            or not scales.shape
            or scales.shape != biases.shape
            or scales.shape[:-1] != lead
        ):
            groups_ = f"({''.join(f'{d}, ' for d in lead)}groups)"
            expected = f"scales and biases of shape {groups_}, q's leading axes"
            expected = expected if q.shape else "q of shape (..., words)"
            fix = "tie the q, scales and biases of one quantized table"
            problem = "inputs of shapes that disagree"
            raise error("E204", where, problem, expected=expected, found=shown, fix=fix)
        words, groups = q.shape[-1], scales.shape[-1]
        b, g = self.bits, self.group_size
        n = words * 32 // b
        if words * 32 % b or n != groups * g:
            fits = _fits(words, groups)
            fix = f"{' or '.join(fits)} fit{'s' * (len(fits) == 1)} these shapes" if fits else ""
            fix = fix or "tie the q, scales and biases of one quantized table"
            if words * 32 % b == 0 and n % g == 0:
                k = n // g
                problem = f"q's {words} words per row hold {n} {b}-bit values: {k} group"
                problem += "s" * (k != 1)
                expected = f"scales and biases {(*q.shape[:-1], n // g)}"
            else:
                what = f"hold {n} {b}-bit values, not whole groups of {g}"
                what = f"do not hold whole {b}-bit values" if words * 32 % b else what
                problem = f"q's {words} words per row {what}"
                expected = f"q {(*q.shape[:-1], groups * g * b // 32)} for {groups} groups of {g}"
            raise error("E205", where, problem, expected=expected, found=shown, fix=fix)
        n = groups * g
        return jax.ShapeDtypeStruct((*q.shape[:-1], n), canonical_dtype(scales.dtype))

    def __call__(self, x: Inputs) -> jax.Array:  # type: ignore[override]
        self._check(x)
        values = _unpack(x["q"], self.bits)
        return _scaled(values, x["scales"], x["biases"], self.group_size)

    def abstract(self, aval: Inputs) -> jax.ShapeDtypeStruct:  # type: ignore[override]
        return self._check(aval)

    def axis_names(self, names: Mapping[str, Names], aval: Inputs) -> Names | None:  # type: ignore[override]
        q = tuple(names["q"])  # the view's last axis is q's, unpacked
        return q if len(q) == len(aval["q"].shape) else None

    def __repr__(self) -> str:
        mode = "" if self.mode == "affine" else f", mode={self.mode!r:.20}"  # in its error only
        return f"dequantize({self.bits!r:.20}, {self.group_size!r:.20}{mode})"


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _fake_quant(x: jax.Array, bits: int, group_size: int) -> jax.Array:
    """``dequantize(quantize(x))`` whose derivative is the identity (straight through)."""
    values, scales, biases = _affine(x, bits, group_size)
    return _scaled(values, scales.astype(x.dtype), biases.astype(x.dtype), group_size)


@_fake_quant.defjvp
def _fake_quant_jvp(bits: int, group_size: int, primals: Any, tangents: Any) -> Any:
    (x,), (dx,) = primals, tangents
    return _fake_quant(x, bits, group_size), dx


@dataclasses.dataclass(frozen=True, repr=False)
class _FakeQuant(Transform, name="fake_quant"):
    """The class of :func:`fake_quant`."""

    bits: int
    group_size: int
    field_docs: ClassVar = {"bits": "2, 3, 4, 5, 6 or 8", "group_size": "32, 64 or 128"}

    def __post_init__(self) -> None:
        _check_params(repr(self), self.bits, self.group_size)
        set_fields(self, bits=int(self.bits), group_size=int(self.group_size))

    def __call__(self, x: ArrayLike) -> jax.Array:
        _table_dtype(repr(self), x, self.group_size)
        return _fake_quant(jnp.asarray(x), self.bits, self.group_size)

    def abstract(self, aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        dtype = _table_dtype(repr(self), aval, self.group_size)
        return jax.ShapeDtypeStruct(tuple(aval.shape), dtype)

    def axis_names(self, names: Names, aval: jax.ShapeDtypeStruct) -> Names | None:
        return tuple(names) if len(names) == len(aval.shape) else None

    def __repr__(self) -> str:
        return f"fake_quant({self.bits!r:.20}, {self.group_size!r:.20})"


# --- the public functions: each documents its class ----------------------------------------


def dequantize(bits: int, group_size: int, mode: str = "affine") -> Transform:
    """A table quantized in MLX's affine layout: inputs ``q``, ``scales``, ``biases``.

    ``q`` holds ``bits``-bit values packed into uint32 words along the last axis (lowest
    bits first, one bit stream: a 3, 5 or 6-bit value may straddle two words), ``scales``
    and ``biases`` one float per run of ``group_size`` values; the view is
    ``scale * q + bias`` of shape ``(..., words * 32 // bits)``, in the scales' dtype,
    exactly as ``mlx.core.dequantize`` (any leading axes: a stack of tables). Note the
    order: ``(bits, group_size)``, where MLX takes ``(group_size, bits)``. Gradients reach
    the scales and biases (``q`` is integer). Follow it with transforms of one value:
    ``st.dequantize(4, 64) >> st.T`` is the head of a tied table. A lookup
    ``table[ids]`` under ``jit`` unpacks only the rows it reads.

    Args:
        bits: 2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128.
        mode: ``"affine"``, the only mode read (MLX's ``mxfp4``, ``mxfp8`` and ``nvfp4``
            are other layouts).

    Example:
        >>> import numpy as np, sharetree as st
        >>> w = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
        >>> refs = {"q": "embed/q", "scales": "embed/scales", "biases": "embed/biases"}
        >>> tree = {"embed": st.quantize(w, 4, 64),
        ...         "head": st.Tied(refs, st.dequantize(4, 64) >> st.T)}
        >>> head = st.materialize(tree)["head"]
        >>> head.shape, bool(abs(head - w.T).max() < 0.02)
        ((64, 4), True)
    """
    return _Dequantize(bits, group_size, mode)


def fake_quant(bits: int, group_size: int) -> Transform:
    """Quantize then dequantize a float table, with the identity as its derivative.

    The view is ``dequantize(quantize(w))`` (MLX's affine rule along the last axis, in
    ``w``'s dtype); its gradient goes straight through to ``w`` unchanged, so a float
    master trained through it learns what its quantized copy computes
    (quantization-aware training). Values that are not finite are not checked here (a
    traced table has no values): a group holding one gives ``nan``.

    Example:
        >>> import jax, jax.numpy as jnp, sharetree as st
        >>> tree = {"w": jnp.linspace(-1, 1, 64).reshape(1, 64)}
        >>> tree["v"] = st.Tied("w", st.fake_quant(2, 64))
        >>> len(set(st.materialize(tree)["v"][0].tolist()))  # 2 bits: 4 levels
        4
        >>> grad = jax.grad(lambda t: (3 * st.materialize(t)["v"]).sum())(tree)
        >>> bool((grad["w"] == 3).all())
        True
    """
    return _FakeQuant(bits, group_size)


def quantize(w: ArrayLike, bits: int, group_size: int, mode: str = "affine") -> Quantized:
    """Quantize a float table as ``mlx.core.quantize`` does: ``{"q", "scales", "biases"}``.

    Along the last axis, each run of ``group_size`` values gets a scale and a bias by MLX's
    affine rule (computed in float32, then rounded to ``w``'s dtype), and each value the
    integer ``0 .. 2**bits - 1`` nearest to ``(w - bias) / scale``, packed into uint32
    words (see :func:`dequantize`). Note the order: ``(w, bits, group_size)``, where MLX
    takes ``(w, group_size, bits)``. A group holding ``nan`` or an infinity is an error
    naming it, checked where ``w`` has values (not under ``jit``).

    Args:
        w: a float array of shape ``(..., n)``, ``n`` a multiple of ``group_size``.
        bits: 2, 3, 4, 5, 6 or 8.
        group_size: 32, 64 or 128.
        mode: ``"affine"``, the only mode.

    Returns:
        The :class:`Quantized` dict: ``q`` (uint32, ``(..., n * bits // 32)``), ``scales``
        and ``biases`` (``w``'s dtype, ``(..., n // group_size)``).

    Example:
        >>> import numpy as np, sharetree as st
        >>> packed = st.quantize(np.arange(64.0).reshape(1, 64), 4, 64)
        >>> packed["q"].shape, packed["scales"], packed["biases"]  # the edge 63 is q = 0
        ((1, 8), Array([[-4.2]], dtype=float32), Array([[63.]], dtype=float32))
    """
    where = f"quantize(w, {bits!r:.20}, {group_size!r:.20})"
    _check_params(where, bits, group_size, mode)
    dtype = _table_dtype(where, w, int(group_size))
    values, scales, biases = _affine(w, int(bits), int(group_size))
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    if not any(isinstance(a, jax.core.Tracer) for a in (w, scales)):
        _check_finite(jnp.asarray(w), scales, biases, int(bits), int(group_size))
    return Quantized(q=_pack(values, int(bits)), scales=scales, biases=biases)
