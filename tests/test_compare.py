"""``sharetree._compare`` against a reference written element by element in plain Python.

The reference never calls the vectorized NumPy code it checks: each element pair is
turned into a Python float (or complex) and compared by the rule the docs state:
equal values (``-0.0`` and ``0.0``, equal infinities) and NaNs in the same places are
0 apart, a NaN against a number is ``inf`` apart, otherwise ``|a - b|`` in float64.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from hypothesis import strategies as st_h

import sharetree as st
from sharetree import _compare as cmp

SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1.0, 1.125, -2.0, 1e-3, 3.0, 448.0]
DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]


def _number(x: object) -> complex | float:
    """One element as a Python number (bfloat16 and float8 exactly, via their float value)."""
    return complex(x) if isinstance(x, (complex, np.complexfloating)) else float(x)


def _isnan(x: complex | float) -> bool:
    return math.isnan(x.real) or math.isnan(x.imag) if isinstance(x, complex) else math.isnan(x)


def _distance(x: complex | float, y: complex | float) -> float:
    if x == y or (_isnan(x) and _isnan(y)):
        return 0.0
    d = abs(x - y)
    return math.inf if math.isnan(d) else d


def reference(a: np.ndarray, b: np.ndarray, atol: float) -> tuple[float, int]:
    """The largest distance and how many exceed ``atol``, one element pair at a time."""
    ds = [_distance(_number(x), _number(y)) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    return max(ds, default=0.0), sum(d > atol for d in ds)


def _array(values: list[float], dtype: type) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.array(values, np.float64).astype(dtype)  # inf in float8_e4m3fn: NaN


pairs = st_h.integers(1, 8).flatmap(
    lambda n: st_h.tuples(
        st_h.lists(st_h.sampled_from(SPECIAL), min_size=n, max_size=n),
        st_h.lists(st_h.sampled_from(SPECIAL), min_size=n, max_size=n),
        st_h.sampled_from(DTYPES),
        st_h.sampled_from(DTYPES),
    )
)


@settings(max_examples=examples(200), deadline=None)
@given(pair=pairs, atol=st_h.sampled_from([0.0, 1e-3, 0.125, 1.0]))
def test_difference_matches_the_elementwise_reference(pair, atol):
    xs, ys, da, db = pair
    a, b = _array(xs, da), _array(ys, db)
    d = cmp.difference(a, b, atol)
    assert (d.worst, d.bad, d.size) == (*reference(a, b, atol), len(xs))
    # close: find_ties' compare; bit for bit at atol 0, else every element within atol
    if atol == 0.0:
        assert cmp.close(a, b, 0.0) == (da is db and a.tobytes() == b.tobytes())
    else:
        assert cmp.close(a, b, atol) == (reference(a, b, atol)[1] == 0)


def test_minus_zero_nan_and_infinities():
    a = np.array([0.0, np.nan, np.inf, -np.inf, 1.0])
    b = np.array([-0.0, np.nan, np.inf, np.inf, np.nan])
    np.testing.assert_array_equal(cmp.abs_diff(a, b), [0.0, 0.0, 0.0, np.inf, np.inf])
    assert cmp.difference(a[:3], b[:3], 0.0) == cmp.Difference(0.0, 0, 3)
    assert not cmp.bit_equal(a[:1], b[:1])  # -0.0 and 0.0: equal values, other bits
    assert cmp.bit_equal(a[1:3], b[1:3])  # the same NaN bits
    assert not cmp.close(a[:1], b[:1], 0.0) and cmp.close(a[:1], b[:1], 1e-9)


def test_bfloat16_and_float8_compare_by_value_in_float64():
    one = np.ones(3, ml_dtypes.bfloat16)
    other = one.copy()
    other[1] = ml_dtypes.bfloat16(1.0078125)  # the next bfloat16 after 1.0
    assert cmp.difference(one, other, 0.0) == cmp.Difference(0.0078125, 1, 3)
    assert cmp.difference(one, np.ones(3, np.float32), 0.0).worst == 0.0  # across dtypes
    e4 = np.array([1.0, 1.125], ml_dtypes.float8_e4m3fn)
    assert cmp.difference(e4, np.array([1.0, 1.0]), 0.1) == cmp.Difference(0.125, 1, 2)
    # float64 keeps what float32 would round away
    wide = cmp.difference(np.array([1.0]), np.array([1.0 + 1e-12]), 0.0)
    assert wide.bad == 1 and 0.9e-12 < wide.worst < 1.1e-12


def test_non_numbers_are_equal_or_infinitely_apart():
    a, b = np.array(["x", "y"]), np.array(["x", "z"])
    assert cmp.difference(a, b, 0.5) == cmp.Difference(math.inf, 1, 2)
    assert cmp.difference(a, a.copy(), 0.0).worst == 0.0


def test_complex_values():
    a = np.array([1 + 1j, complex(math.nan, 0), 2j])
    b = np.array([1 + 1j, complex(math.nan, 0), 2j + 0.5])
    assert cmp.difference(a, b, 0.1) == cmp.Difference(*reference(a, b, 0.1), 3)


@settings(max_examples=examples(60), deadline=None)
@given(
    rows=st_h.lists(st_h.lists(st_h.sampled_from(SPECIAL), min_size=4, max_size=4), min_size=1),
    sample=st_h.lists(st_h.sampled_from(SPECIAL), min_size=4, max_size=4),
    atol=st_h.sampled_from([1e-3, 0.5]),
)
def test_near_is_the_rows_within_atol_everywhere(rows, sample, atol):
    table, s = np.array(rows), np.array(sample, np.float32)
    want = [k for k, row in enumerate(table) if reference(row, s, atol)[1] == 0]
    assert cmp.near(cmp.wide(table), s, atol).tolist() == want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
def test_on_devices_equals_the_host(dtype):
    xs = [0.0, -0.0, math.nan, math.inf, 1.0, 1.125]
    ys = [-0.0, 0.0, math.nan, math.inf, math.nan, 1.0]
    with jax.enable_x64(True):  # float64 stays float64 on the device
        a, b = jnp.asarray(xs, dtype), jnp.asarray(ys, dtype)
    host = cmp.difference(np.asarray(a), np.asarray(b), 0.1)
    assert cmp.difference_on_devices(a, b, 0.1) == host == cmp.Difference(math.inf, 2, 6)


def test_kind_is_what_jax_computes():
    f64 = jax.ShapeDtypeStruct((2,), np.float64)
    assert cmp.kind(f64) == ((2,), np.dtype(np.float32))  # x64 off: computed in float32
    assert cmp.kind(f64) != cmp.kind(jax.ShapeDtypeStruct((2,), np.float16))
    assert cmp.kind("gelu") is str and cmp.describe("gelu") == "str 'gelu'"
    assert cmp.describe(jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)) == "bfloat16[2, 3]"


@pytest.mark.parametrize("good", [0, 0.0, 1e-6, np.float32(0.5), np.int64(2)])
def test_check_atol_takes_real_numbers(good):
    assert cmp.check_atol(good, "tie") == float(good)


@pytest.mark.parametrize("bad", [-1.0, math.nan, -math.inf])
def test_check_atol_refuses_negative_and_nan(bad):
    with raises("E55", "tie(atol=...)", "a number >= 0", repr(bad), "1e-6") as info:
        cmp.check_atol(bad, "tie")
    assert not isinstance(info.value, st.TieTypeError)


@pytest.mark.parametrize("bad", ["0", True, np.bool_(False), None, 1j])
def test_check_atol_refuses_other_types(bad):
    with raises("E55", "find_ties(atol=...)", type(bad).__name__, cls=st.TieTypeError):
        cmp.check_atol(bad, "find_ties")


def test_concrete_values_and_values_that_are_not():
    keys = jax.random.split(jax.random.key(0), 3)
    np.testing.assert_array_equal(cmp.concrete(keys, "k"), jax.random.key_data(keys))
    assert cmp.concrete([1, 2], "x").tolist() == [1, 2]
    with raises("E62", "at 'w'", "jax.ShapeDtypeStruct float32[2]", "outside jit"):
        cmp.concrete(jax.ShapeDtypeStruct((2,), jnp.float32), "at 'w'")
    with raises("E62", "at 'w'", "traced int32[3]", "leave atol out"):
        jax.jit(lambda x: cmp.concrete(x, "at 'w'", cmp.LEAVE_ATOL_OUT))(jnp.arange(3))
    gone = jnp.ones(2)
    gone.delete()
    with raises("E62", "at 'g'", "ArrayImpl (RuntimeError)") as info:
        cmp.concrete(gone, "at 'g'")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_check_copies_says_the_copies_differ_once_for_tie_and_load():
    a, b = np.arange(4.0), np.arange(4.0) + np.array([0, 0, 0.5, 0.25])
    tie = cmp.Copies("tie 'b' <- Tied('a')", "b", "a")
    cmp.check_copies(tie, a, a.copy(), 0.0)
    cmp.check_copies(tie, a, b, 0.5)
    fixes = ("without atol, st.tie keeps 'a'", "st.tie(tree, {'a': Tied('b')})", "atol to 0.5")
    with raises("E46", "tie 'b' <- Tied('a')", "'b' and 'a' differ by up to 0.5", *fixes):
        cmp.check_copies(tie, a, b, 0.1)
    load = tie._replace(where="load 'm': tie 'b' <- Tied('a')", load=True)
    with raises("E46", "load 'm'", "2 of 4 elements above atol=0.1", "tie the other way round"):
        cmp.check_copies(load, a, b, 0.1)
    transposed = tie._replace(transform=st.T)
    with raises("E46", "'b' and T of 'a'", "st.tie(tree, {'a': Tied('b', T)})"):
        cmp.check_copies(transposed, a, b, 0.1)
    no_inverse = load._replace(transform=st.scale(2.0))
    with raises("E46", "write the values you want into 'a'", "scale(2.0) has no inverse") as info:
        cmp.check_copies(no_inverse, a, b, 0.1)
    assert "tie the other way round" not in str(info.value)
    with raises("E46", "'b' holds 'relu', 'a' holds 'gelu'") as info:
        cmp.check_copies(tie, "relu", "gelu", 0.0)
    assert "raise atol" not in str(info.value)  # strings: no tolerance helps
    with raises("E7", "a view of float64[2, 2]", "the value it replaces is float64[4]"):
        cmp.check_copies(tie, a, a.reshape(2, 2), 0.0)
    with jax.enable_x64(True):
        placed = jnp.asarray(a), jnp.asarray(b)
    with raises("E46", "differ by up to 0.5", "2 of 4 elements"):
        cmp.check_copies(load, *placed, 0.1, on_devices=True)
