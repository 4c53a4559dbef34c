"""The normal form of chains: folding rules, against NumPy applied one step at a time."""

import functools
import operator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _examples import examples
from hypothesis import given, settings
from hypothesis import strategies as hs

import sharetree as st
from sharetree._transforms import describe_spec

F16, F32 = jnp.float16, jnp.float32
FUNCTIONS = {"jax.numpy:flipud": jnp.flipud}


def _np_reshape(shape, a):
    return np.reshape(a, shape)  # positional: numpy < 2.1 has no shape= keyword


def parts_of(t):
    return list(getattr(t, "parts", ())) or ([] if t == st.identity else [t])


# --- the rules, one by one -------------------------------------------------------


def test_transposes_cancel_and_compose():
    assert st.T >> st.T == st.identity
    assert st.transpose(1, 0, 2) >> st.transpose(1, 0, 2) == st.identity
    assert st.transpose(1, 2, 0) >> st.transpose(2, 0, 1) == st.identity
    assert st.transpose(1, 0) >> st.T == st.identity  # T on a matrix is transpose(1, 0)
    assert st.T >> st.transpose(2, 0, 1) == st.transpose(0, 2, 1)
    x = np.arange(24.0).reshape(2, 3, 4)
    for a, b in [
        (st.transpose(1, 2, 0), st.transpose(1, 0, 2)),
        (st.T, st.transpose(2, 0, 1)),
        (st.transpose(0, 2, 1), st.T),
    ]:
        folded = a >> b
        assert isinstance(folded, type(st.T)), folded  # one transpose
        np.testing.assert_array_equal(folded(x), b(a(x)))


def test_an_explicit_identity_permutation_checks_the_rank_until_it_folds():
    t = st.transpose(0, 1, 2)
    assert t != st.identity and parts_of(t) == [t]
    with pytest.raises(ValueError, match="out of bounds"):
        t(np.ones((2, 3)))
    assert t >> st.transpose(1, 0, 2) == st.transpose(1, 0, 2)


def test_transposes_of_different_ranks_do_not_fold():
    t = st.transpose(1, 0) >> st.transpose(1, 0, 2)
    assert parts_of(t) == [st.transpose(1, 0), st.transpose(1, 0, 2)]


def test_reshapes_are_the_last_one():
    assert st.reshape(6) >> st.reshape(2, 3) == st.reshape(2, 3)
    assert st.reshape(-1) >> st.reshape(2, 3) == st.reshape(2, 3)
    assert st.reshape(2, 3) >> st.reshape(3, -1) == st.reshape(3, 2)  # -1 filled from size 6
    assert st.reshape(-1) >> st.reshape(3, -1) == st.reshape(3, -1)
    # sizes that cannot match keep both steps, so the view still fails
    assert len(parts_of(st.reshape(6) >> st.reshape(4))) == 2
    assert len(parts_of(st.reshape(6) >> st.reshape(4, -1))) == 2
    with pytest.raises(TypeError):
        (st.reshape(6) >> st.reshape(4))(np.ones(4))


def test_scales_multiply():
    assert st.scale(2.0) >> st.scale(3.0) == st.scale(6.0)
    assert st.scale(2.0) >> st.scale(1j) == st.scale(2j)
    assert st.scale(1j) >> st.scale(1j) == st.scale(-1 + 0j)  # still complex
    assert st.scale(1j) >> st.scale(1j) != st.scale(-1.0)
    overflow = st.scale(1e300) >> st.scale(1e300)
    assert parts_of(overflow) == [st.scale(1e300), st.scale(1e300)]


def test_casts_fold_only_when_equal():
    assert st.astype(F16) >> st.astype(F16) == st.astype(F16)
    lossy = st.astype(F16) >> st.astype(F32)
    assert parts_of(lossy) == [st.astype(F16), st.astype(F32)]
    x = np.float32([1 + 2**-13, 3.14159])
    np.testing.assert_array_equal(lossy(x), x.astype(np.float16).astype(np.float32))
    assert not np.array_equal(lossy(x), x)


def test_nothing_folds_across_a_cast_or_an_fn():
    assert len(parts_of(st.T >> st.astype(F16) >> st.T)) == 3
    assert len(parts_of(st.scale(2.0) >> st.astype(F16) >> st.scale(2.0))) == 3
    assert len(parts_of(st.T >> st.fn(jnp.flipud) >> st.T)) == 3
    assert len(parts_of(st.fn(jnp.flipud) >> st.fn(jnp.flipud))) == 2


def test_identity_vanishes_and_one_part_is_that_part():
    assert st.chain() is st.identity and st.chain(st.identity, st.identity) is st.identity
    assert st.chain(st.T) is st.T
    assert st.identity >> st.scale(2.0) >> st.identity == st.scale(2.0)
    assert (st.T >> st.identity >> st.astype(F16)) == st.T >> st.astype(F16)
    # a fold that cancels lets its neighbours fold in turn
    assert st.scale(2.0) >> st.T >> st.T >> st.scale(0.25) == st.scale(0.5)
    a, b = st.scale(2.0) >> st.T, st.T >> st.scale(3.0)
    assert a >> b == st.scale(6.0)


def test_long_chains_build_in_linear_time():
    t = st.identity
    for _ in range(10_000):
        t = t >> st.T
    assert t == st.identity
    assert functools.reduce(operator.rshift, [st.T] * 10_001) == st.T
    assert st.chain(*[st.transpose(1, 2, 0)] * 9_999) == st.identity  # a 3-cycle, 3 | 9999
    t = st.identity
    for _ in range(10_000):
        t = t >> st.scale(2.0) >> st.scale(0.5)
    assert t == st.scale(1.0)


def test_materialize_a_long_chain_of_transposed_ties():
    x = np.arange(6.0).reshape(2, 3)
    n = 1_000
    tree = {"w0": x, **{f"w{i}": st.Tied(f"w{i - 1}", st.T) for i in range(1, n)}}
    out = st.materialize(tree)
    for i in (1, 2, n - 2, n - 1):
        np.testing.assert_array_equal(out[f"w{i}"], x.T if i % 2 else x)
    assert out[f"w{n - 1}"].shape == (3, 2)


# --- properties: random valid chains against NumPy step by step ------------------

SHAPES = [(24,), (4, 6), (6, 4), (2, 3, 4), (4, 3, 2), (2, 2, 6), (2, 2, 2, 3)]
EXACT_SCALES = [0.5, 2.0, -1.0, 1.5, -3.0, 0.25]  # products of a few are exact in float64
CASTS = [np.float32, np.float16, ml_dtypes.bfloat16]


def _shapes_of_size(n):
    """Shapes with ``n`` elements: the SHAPES that fit, and ``(n,)`` and ``(a, n // a)``."""
    pairs = [(a, n // a) for a in range(2, n) if n % a == 0]
    return [s for s in SHAPES if np.prod(s) == n] + [(n,)] + pairs


MOVES = {"identity", "T", "transpose", "reshape", "slice", "index"}  # they declare state_view


@hs.composite
def valid_chains(draw, max_parts=7, with_names=False):
    """(start shape, [(transform, numpy step)]), every step valid on the shape it gets.

    With ``with_names``: also the kinds drawn and the axis names step by step
    (``None`` once a step loses them), from the start names ``"abcd"[:ndim]``.
    """
    shape = draw(hs.sampled_from(SHAPES))
    start, steps, kinds = shape, [], []
    names = tuple("abcd"[: len(shape)])
    for _ in range(draw(hs.integers(0, max_parts))):
        ndim = len(shape)
        kind = draw(
            hs.sampled_from(
                ["identity", "T", "transpose", "reshape", "scale", "cast", "fn", "slice", "index"]
            )
        )
        if kind == "index" and ndim < 2:
            kind = "identity"  # keep at least one axis: every step sees an array
        kinds.append(kind)
        if kind == "identity":
            steps.append((st.identity, lambda x: x))
        elif kind == "T":
            steps.append((st.T, np.transpose))
            shape = shape[::-1]
            names = names and names[::-1]
        elif kind == "transpose":
            perm = draw(hs.permutations(range(ndim)))
            spelled = [a - ndim if draw(hs.booleans()) else a for a in perm]
            steps.append((st.transpose(*spelled), functools.partial(np.transpose, axes=perm)))
            shape = tuple(shape[a] for a in perm)
            names = names and tuple(names[a] for a in perm)
        elif kind == "reshape":
            new = draw(hs.sampled_from(_shapes_of_size(int(np.prod(shape)))))
            spelled = list(new)
            if draw(hs.booleans()):
                spelled[draw(hs.integers(0, len(new) - 1))] = -1
            steps.append((st.reshape(*spelled), functools.partial(_np_reshape, new)))
            names = names if new == shape else None
            shape = new
        elif kind == "scale":
            c = draw(
                hs.sampled_from(EXACT_SCALES)
                | hs.floats(-3, 3, allow_nan=False, allow_infinity=False)
            )
            steps.append((st.scale(c), functools.partial(operator.mul, c)))
        elif kind == "cast":
            dtype = draw(hs.sampled_from(CASTS))
            steps.append((st.astype(dtype), lambda x, d=dtype: x.astype(d).astype(np.float64)))
        elif kind == "slice":
            axis = draw(hs.integers(0, ndim - 1))
            n = shape[axis]
            lo = draw(hs.integers(0, n - 1))
            hi = draw(hs.integers(lo + 1, n))
            where = (slice(None),) * axis + (slice(lo, hi),)
            start_ = lo - n if draw(hs.booleans()) else lo
            stop = None if hi == n and draw(hs.booleans()) else hi
            steps.append((st.slice(start_, stop, axis=axis), lambda x, w=where: x[w]))
            shape = (*shape[:axis], hi - lo, *shape[axis + 1 :])
        elif kind == "index":
            axis = draw(hs.integers(-ndim, ndim - 1))
            i = draw(hs.integers(-shape[axis], shape[axis] - 1))
            where = (slice(None),) * (axis % ndim) + (i,)
            steps.append((st.index(i, axis=axis), lambda x, w=where: x[w]))
            shape = (*shape[: axis % ndim], *shape[axis % ndim + 1 :])
            names = names and (*names[: axis % ndim], *names[axis % ndim + 1 :])
        else:
            steps.append((st.fn(jnp.flipud), np.flipud))
            names = None
    if with_names:
        return start, steps, kinds, names
    return start, steps


def _rtol(parts):
    """The tightest relative tolerance of a chain against float64 NumPy: one rounding of the
    narrowest float it passes through (float32 if it casts to nothing narrower), per step.

    The buffer is float32; each scale or cast may round once more (the normal form may
    fold scales into one product, or move a scale across a cast), so the error is at most
    one eps of the narrowest dtype per part, plus the first rounding.
    """
    eps = float(np.finfo(np.float32).eps)
    for t in parts:
        if isinstance(t, type(st.astype(np.float32))):
            eps = max(eps, float(ml_dtypes.finfo(t.dtype).eps))
    return (len(parts) + 1) * eps


@settings(max_examples=examples(150), deadline=None)
@given(valid_chains(), hs.integers(0, 2**32 - 1))
def test_normal_form_computes_the_same_values(chain_and_start, seed):
    start, steps = chain_and_start
    parts = [t for t, _ in steps]
    x = np.random.default_rng(seed).standard_normal(start).astype(np.float32)

    ref = x.astype(np.float64)  # NumPy, one step at a time; rounding only at the casts
    for _, step in steps:
        ref = step(ref)
    one_by_one = jnp.asarray(x)
    for t in parts:
        one_by_one = t(one_by_one)
    normal = st.chain(*parts)
    got = normal(x)

    assert got.shape == ref.shape == one_by_one.shape
    assert got.dtype == jnp.asarray(one_by_one).dtype
    rtol = _rtol(parts)
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(one_by_one, np.float64), rtol=rtol, atol=1e-6
    )
    # idempotent, never longer, and its spec reads back as itself
    assert st.chain(normal) == normal and st.chain(*parts_of(normal)) == normal
    assert len(parts_of(normal)) <= sum(t != st.identity for t in parts)
    back = st.transform_from_spec(normal.spec(), functions=FUNCTIONS)
    assert back == normal and hash(back) == hash(normal)
    assert describe_spec(normal.spec()) == repr(normal).replace(
        "fn(flipud)", "fn(jax.numpy:flipud)"
    )
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    assert normal.abstract(aval) == jax.eval_shape(normal, aval)


@settings(max_examples=examples(120), deadline=None)
@given(valid_chains(max_parts=8), hs.integers(0, 8), hs.integers(0, 2**32 - 1))
def test_groupings_agree(chain_and_start, k, seed):
    start, steps = chain_and_start
    parts = [t for t, _ in steps]
    whole = st.chain(*parts)
    # built left to right, in any way: one normal form
    assert functools.reduce(operator.rshift, parts, st.identity) == whole
    incremental = st.identity
    for t in parts:
        incremental = st.chain(incremental, t)  # as the resolver composes a chain of ties
    assert incremental == whole and hash(incremental) == hash(whole)

    # any grouping computes the same view
    k = min(k, len(parts))
    split = st.chain(*parts[:k]) >> st.chain(*parts[k:])
    right = functools.reduce(lambda acc, t: t >> acc, reversed(parts), st.identity)
    x = np.random.default_rng(seed).standard_normal(start).astype(np.float32)
    for other in (split, right):
        got, want = other(x), whole(x)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float64), np.asarray(want, np.float64), _rtol(parts), atol=1e-6
        )

    # and has the same structure, unless T meets explicit axes or an explicit identity
    # permutation (then one grouping may keep a rank check the other folded away), or
    # products of inexact scales round differently
    transposes = [t.axes for t in parts if isinstance(t, type(st.T))]
    mixed = None in transposes and any(a is not None for a in transposes)
    no_op = any(a is not None and list(a) == sorted(a) for a in transposes)
    scales = [t.c for t in parts if isinstance(t, type(st.scale(1.0)))]
    if not mixed and not no_op and all(c in EXACT_SCALES for c in scales):
        for other in (split, right):
            assert other == whole and hash(other) == hash(whole) and repr(other) == repr(whole)


@settings(max_examples=examples(150), deadline=None)
@given(valid_chains(with_names=True), hs.integers(0, 2**32 - 1))
def test_capabilities_of_a_chain_are_those_of_its_parts(chain_names, seed):
    start, steps, kinds, names = chain_names
    normal = st.chain(*(t for t, _ in steps))
    x = np.random.default_rng(seed).standard_normal(start)  # float64: NumPy keeps it
    ref = x
    for _, step in steps:
        ref = step(ref)
    # numpy: the same values as NumPy step by step, without JAX's float32
    np.testing.assert_allclose(np.asarray(normal.numpy(x), np.float64), ref, rtol=3e-2, atol=1e-6)
    # state_view: declared exactly when every part moves or selects elements
    moves = normal.state_view()
    assert (moves is not None) == all(k in MOVES for k in kinds)
    if moves is not None:
        np.testing.assert_array_equal(moves.numpy(x), ref)  # moments move like the values
    # axis names: where NumPy step by step keeps them, the chain gives the same ones
    aval = jax.ShapeDtypeStruct(start, np.float32)
    if names is not None:
        assert normal.axis_names(tuple("abcd"[: len(start)]), aval) == names
    # inverse: where there is one, it undoes the view bit for bit
    back = normal.inverse()
    if back is not None:
        np.testing.assert_array_equal(back.numpy(normal.numpy(x)), x)
