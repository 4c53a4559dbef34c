"""Quantized tables (MLX's affine layout): ``dequantize``, ``quantize`` and ``fake_quant``.

Every check is against a reference written here, independent of the package: the bits of
``q`` read one by one as MLX's stream (bit ``b`` of a row is bit ``b % 32`` of word
``b // 32``; value ``i`` is bits ``i * bits ..``, lowest first), MLX's affine rule written
in NumPy from its source (``quantize`` in mlx/backend/cpu/quantized.cpp and the fallback of
``affine_quantize`` in mlx/ops.cpp), and, where ``mlx`` imports, ``mx.quantize`` and
``mx.dequantize`` themselves.
"""

from __future__ import annotations

import itertools
import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from hypothesis import strategies as hs

import sharetree as st
from sharetree._transforms.quant import BITS, GROUP_SIZES, _pack, _unpack

PARAMS = list(itertools.product(BITS, GROUP_SIZES))
REFS = {"q": "embed/q", "scales": "embed/scales", "biases": "embed/biases"}
FLOATS = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# --- the references, by hand ----------------------------------------------------------------


def ref_unpack(q: np.ndarray, bits: int) -> np.ndarray:
    """The values of ``q``, bit by bit: each row's stream of bits cut into runs of ``bits``."""
    q = np.asarray(q, np.uint32)
    stream = (q[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1  # bit b % 32 of word b // 32
    stream = stream.reshape(*q.shape[:-1], q.shape[-1] * 32)
    n = q.shape[-1] * 32 // bits
    runs = stream.reshape(*q.shape[:-1], n, bits).astype(np.uint64)
    return (runs << np.arange(bits, dtype=np.uint64)).sum(-1).astype(np.uint32)  # lowest first


def ref_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` as MLX packs them: each one's bits, lowest first, one stream per row."""
    values = np.asarray(values, np.uint64)
    n = values.shape[-1]
    stream = (values[..., :, None] >> np.arange(bits, dtype=np.uint64)) & 1
    words = stream.reshape(*values.shape[:-1], n * bits // 32, 32)
    return (words << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def ref_dequantize(q, scales, biases, bits, group_size):
    """``scale * value + bias`` in the scales' dtype, as mx.dequantize's fallback computes it."""
    scales, biases = np.asarray(scales), np.asarray(biases)
    values = ref_unpack(q, bits).astype(scales.dtype)
    grouped = values.reshape(*values.shape[:-1], -1, group_size)
    out = grouped * scales[..., None] + biases[..., None]
    return out.reshape(values.shape)


def ref_quantize(w, bits, group_size):
    """MLX's affine rule, group by group in float32, as mlx/backend/cpu/quantized.cpp."""
    w = np.asarray(w)
    x = w.astype(np.float32)
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    values = np.zeros(groups.shape, np.uint32)
    scales = np.zeros(groups.shape[:-1], np.float32)
    biases = np.zeros(groups.shape[:-1], np.float32)
    n_bins, eps = np.float32(2**bits - 1), np.float32(1e-7)
    for i in np.ndindex(groups.shape[:-1]):
        g = groups[i]
        w_max, w_min = g.max(), g.min()
        mask = abs(w_min) > abs(w_max)
        scale = max((w_max - w_min) / n_bins, eps)
        scale = scale if mask else -scale
        edge = w_min if mask else w_max
        q0 = np.rint(edge / scale)
        bias = np.float32(0)
        if q0 != 0:
            scale = edge / q0
            bias = edge
        values[i] = np.clip(np.rint((g - bias) / scale), 0, n_bins)
        scales[i], biases[i] = scale, bias
    q = ref_pack(values.reshape(x.shape), bits)
    return q, scales.astype(w.dtype), biases.astype(w.dtype)


def quantized_tree(packed, bits, group_size):
    """A tied table: the lookup and the head read one packed table."""
    t = st.dequantize(bits, group_size)
    return {
        "embed": packed,
        "tok": st.Tied(REFS, t),
        "head": st.Tied(REFS, t >> st.T),
    }


def one_rounding_off(got, inputs, bits, group_size):
    """Whether ``got`` is ``scale * value + bias`` up to the rounding of the product, the one
    that XLA's fused multiply-add (under ``jit``) skips: the step of the product and of the
    result at most."""
    scales = np.asarray(inputs["scales"], np.float32)
    values = ref_unpack(inputs["q"], bits).astype(np.float32)
    grouped = values.reshape(*values.shape[:-1], -1, group_size)
    product = (grouped * scales[..., None]).reshape(values.shape)
    want = ref_dequantize(inputs["q"], scales, inputs["biases"], bits, group_size)
    step = np.spacing(np.abs(product)) + np.spacing(np.abs(want))
    return bool((np.abs(np.asarray(got, np.float32) - want) <= step).all())


def table(rng, shape, dtype=np.float32):
    """Rows of different scales, and groups of one sign, zeros, and +-m (an edge at a tie)."""
    w = rng.normal(size=shape) * rng.uniform(0.01, 3.0, size=(*shape[:-1], 1))
    flat = w.reshape(-1, shape[-1])
    flat[0, :32] = -np.abs(flat[0, :32])  # all negative: the edge is the minimum
    if len(flat) > 1:
        flat[1, :32] = np.abs(flat[1, :32])  # all positive
    if len(flat) > 2:
        flat[2, :32] = 0.0  # all zero: the smallest scale, bias 0
    if len(flat) > 3:
        flat[3, :32] = 1.5  # one value
        flat[3, 33], flat[3, 34] = 2.0, -2.0  # |min| == |max|: the max is the edge
    return w.astype(dtype)


def random_words(rng, shape):
    return rng.integers(0, 2**32, size=shape, dtype=np.uint32)


def packed_inputs(rng, lead, groups, bits, group_size, dtype=np.float32):
    words = groups * group_size * bits // 32
    q = random_words(rng, (*lead, words))
    scales = rng.normal(size=(*lead, groups)).astype(dtype)
    biases = rng.normal(size=(*lead, groups)).astype(dtype)
    return {"q": q, "scales": scales, "biases": biases}


# --- dequantize ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits, group_size", PARAMS)
@pytest.mark.parametrize(
    "lead, groups", [((5,), 3), ((4,), 1), ((2, 3), 2)], ids=["table", "one group", "stack"]
)
def test_dequantize_reads_the_bits_one_by_one(bits, group_size, lead, groups):
    rng = np.random.default_rng(bits * 1000 + group_size + groups)
    x = packed_inputs(rng, lead, groups, bits, group_size)
    want = ref_dequantize(x["q"], x["scales"], x["biases"], bits, group_size)
    tree = quantized_tree(x, bits, group_size)
    got = st.materialize(tree)
    assert got["tok"].shape == (*lead, groups * group_size) and got["tok"].dtype == np.float32
    np.testing.assert_array_equal(got["tok"], want)  # eager: two roundings, as MLX
    np.testing.assert_array_equal(got["head"], want.T)  # st.T: every axis reversed
    # under jit XLA may fuse scale * q + bias into one rounding (an FMA): one step at most
    assert one_rounding_off(jax.jit(st.materialize)(tree)["tok"], x, bits, group_size)
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    assert st.dequantize(bits, group_size).abstract(avals) == jax.eval_shape(
        st.dequantize(bits, group_size), avals
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequantize_computes_in_the_scales_dtype(dtype):
    rng = np.random.default_rng(0)
    x = packed_inputs(rng, (3,), 2, 4, 32, FLOATS[dtype])
    got = st.dequantize(4, 32)(x)
    assert got.dtype == FLOATS[dtype]
    np.testing.assert_array_equal(
        np.asarray(got), ref_dequantize(x["q"], x["scales"], x["biases"], 4, 32)
    )
    view = st.dequantize(4, 32).abstract(jax.tree.map(jnp.asarray, x))
    assert view.dtype == FLOATS[dtype] and view.shape == (3, 64)


def test_unpack_matches_a_python_loop_over_bits_for_the_straddling_widths():
    """The reference itself, checked against the plainest reading there is."""
    rng = np.random.default_rng(1)
    for bits in (3, 5, 6):
        q = random_words(rng, (2, bits * 2))
        n = q.shape[-1] * 32 // bits
        loop = np.zeros((2, n), np.uint32)
        for r, i, t in itertools.product(range(2), range(n), range(bits)):
            b = i * bits + t
            loop[r, i] |= ((int(q[r, b // 32]) >> (b % 32)) & 1) << t
        np.testing.assert_array_equal(ref_unpack(q, bits), loop)
        np.testing.assert_array_equal(np.asarray(_unpack(q, bits)), loop)


@settings(max_examples=examples(100), deadline=None)
@given(
    bits=hs.sampled_from(BITS),
    group_size=hs.sampled_from(GROUP_SIZES),
    lead=hs.lists(hs.integers(1, 3), max_size=2).map(tuple),
    groups=hs.integers(1, 3),
    seed=hs.integers(0, 2**32 - 1),
)
def test_pack_and_unpack_round_trip(bits, group_size, lead, groups, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**bits, size=(*lead, groups * group_size), dtype=np.uint32)
    words = np.asarray(_pack(jnp.asarray(values), bits))
    assert words.dtype == np.uint32 and words.shape == (*lead, groups * group_size * bits // 32)
    np.testing.assert_array_equal(words, ref_pack(values, bits))
    np.testing.assert_array_equal(np.asarray(_unpack(words, bits)), values)
    q = random_words(rng, words.shape)  # any words are values
    np.testing.assert_array_equal(np.asarray(_unpack(q, bits)), ref_unpack(q, bits))
    np.testing.assert_array_equal(np.asarray(_pack(_unpack(q, bits), bits)), q)


# --- quantize -----------------------------------------------------------------------------


@pytest.mark.parametrize("bits, group_size", PARAMS)
def test_quantize_follows_mlx_rule_by_hand(bits, group_size):
    rng = np.random.default_rng(bits + group_size)
    w = table(rng, (6, 2 * group_size))
    q, scales, biases = ref_quantize(w, bits, group_size)
    packed = st.quantize(w, bits, group_size)
    assert sorted(packed) == ["biases", "q", "scales"]
    np.testing.assert_array_equal(np.asarray(packed["q"]), q)
    np.testing.assert_array_equal(np.asarray(packed["scales"]), scales)
    np.testing.assert_array_equal(np.asarray(packed["biases"]), biases)
    jitted = jax.jit(st.quantize, static_argnums=(1, 2))(w, bits, group_size)
    for k in packed:
        np.testing.assert_array_equal(np.asarray(jitted[k]), np.asarray(packed[k]))
    # zero is exact, every value within a step (the other end may be clipped: zero on a step)
    back = ref_dequantize(q, scales, biases, bits, group_size)
    err = np.abs(back - w).reshape(6, 2, group_size)
    assert (err <= np.abs(scales)[..., None] + 1e-6).all()  # mx.quantize test's bound
    assert (back[w == 0] == 0).all()


def test_quantize_edges_zero_and_negative_scales():
    g = np.arange(64, dtype=np.float32)[None]  # max 63 > |min| 0: the edge is the max
    p = st.quantize(g, 4, 64)
    assert float(p["biases"][0, 0]) == 63.0 and float(p["scales"][0, 0]) < 0
    n = -g  # |min| > |max|: the edge is the min, the scale positive
    p = st.quantize(n, 4, 64)
    assert float(p["biases"][0, 0]) == -63.0 and float(p["scales"][0, 0]) > 0
    z = np.zeros((1, 32), np.float32)
    p = st.quantize(z, 3, 32)
    assert float(p["biases"][0, 0]) == 0.0 and float(p["scales"][0, 0]) == np.float32(-1e-7)
    assert (np.asarray(st.dequantize(3, 32)(p)) == 0).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_a_half_table_is_quantized_in_float32_then_rounded(dtype, bits):
    rng = np.random.default_rng(bits)
    w = table(rng, (8, 128), FLOATS[dtype])
    q, scales, biases = ref_quantize(w, bits, 64)
    packed = st.quantize(w, bits, 64)
    assert packed["scales"].dtype == FLOATS[dtype] == packed["biases"].dtype
    np.testing.assert_array_equal(np.asarray(packed["q"]), q)
    np.testing.assert_array_equal(np.asarray(packed["scales"]), scales)
    np.testing.assert_array_equal(np.asarray(packed["biases"]), biases)


@pytest.mark.parametrize("bits", BITS)
def test_ties_round_as_mlx_divides_eagerly_and_under_jit(bits):
    """Groups whose ends are +-m put the edge exactly half a step from a level, and their
    values often fall on half steps: a division XLA rounds otherwise (a multiplication by a
    reciprocal) lands on the other side of such a tie."""
    rng = np.random.default_rng(bits)
    m = rng.uniform(0.5, 8.0, size=(64, 1))
    w = (rng.uniform(-1, 1, size=(64, 64)) * m).astype(ml_dtypes.bfloat16)
    w[:, 0], w[:, 1] = m[:, 0], -m[:, 0]
    want = ref_quantize(w, bits, 64)
    for quantize in (st.quantize, jax.jit(st.quantize, static_argnums=(1, 2))):
        packed = quantize(w, bits, 64)
        for k, ref in zip(("q", "scales", "biases"), want):
            np.testing.assert_array_equal(np.asarray(packed[k]), ref, err_msg=k)
    jitted = jax.jit(st.fake_quant(bits, 64))(w)
    eager = st.fake_quant(bits, 64)(w)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bits, group_size", PARAMS)
def test_quantize_and_dequantize_match_mlx(bits, group_size, dtype):
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(7 * bits + group_size)
    w = table(rng, (2, 4, 2 * group_size), FLOATS[dtype])  # a stack of two tables
    w_mx = mx.array(w.astype(np.float32)).astype(getattr(mx, dtype))
    mq, ms, mb = mx.quantize(w_mx, group_size=group_size, bits=bits)

    def host(a):
        return np.asarray(a.astype(mx.float32)) if a.dtype != mx.uint32 else np.asarray(a)

    packed = st.quantize(w, bits, group_size)
    np.testing.assert_array_equal(np.asarray(packed["q"]), host(mq))
    np.testing.assert_array_equal(np.asarray(packed["scales"], np.float32), host(ms))
    np.testing.assert_array_equal(np.asarray(packed["biases"], np.float32), host(mb))
    ours = st.materialize(quantized_tree(packed, bits, group_size))["tok"]
    theirs = mx.dequantize(mq, ms, mb, group_size=group_size, bits=bits)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), host(theirs))
    # MLX reads what sharetree packs, and the other way round
    q_mx = mx.array(np.asarray(packed["q"]))
    s_mx, b_mx = (
        mx.array(np.asarray(packed[k], np.float32)).astype(getattr(mx, dtype))
        for k in ("scales", "biases")
    )
    again = mx.dequantize(q_mx, s_mx, b_mx, group_size=group_size, bits=bits)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), host(again))


def test_mlx_mode_other_than_affine_is_refused_with_its_layout():
    mx = pytest.importorskip("mlx.core")
    w = mx.ones((2, 32))
    _, scales = mx.quantize(w, mode="mxfp4")  # uint8 scales, no biases: another layout
    assert np.asarray(scales).dtype == np.uint8
    with raises("E201", "'mxfp4'", "e8m0", "'affine'"):
        st.dequantize(4, 32, mode="mxfp4")


def test_quantize_names_the_group_holding_nan_or_inf():
    w = np.ones((3, 128), np.float32)
    w[2, 70] = np.nan
    with raises("E207", "quantize(w, 4, 64)", "row 2", "group 1", "64:128", "NaN"):
        st.quantize(w, 4, 64)
    w = np.ones((2, 3, 64), np.float32)
    w[1, 0, 5] = -np.inf
    w[1, 2, 5] = np.inf
    with raises("E207", "row (1, 0)", "group 0", "inf", "1 more group"):
        st.quantize(w, 4, 32)
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 3e38, -3e38  # the range overflows float32: an infinite scale
    with raises("E207", "group 0", "scale", "overflows float32"):
        st.quantize(w, 4, 32)
    # traced: no values to check, nothing raised (fake_quant's case: a group of nan)
    jax.jit(st.quantize, static_argnums=(1, 2))(np.full((1, 32), np.nan, np.float32), 4, 32)


# --- fake_quant ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits, group_size", [(4, 64), (3, 32), (6, 128), (8, 32)])
def test_fake_quant_is_quantize_then_dequantize_by_hand(bits, group_size):
    rng = np.random.default_rng(bits)
    w = table(rng, (5, 2 * group_size))
    q, scales, biases = ref_quantize(w, bits, group_size)
    want = ref_dequantize(q, scales, biases, bits, group_size)
    np.testing.assert_array_equal(np.asarray(st.fake_quant(bits, group_size)(w)), want)
    inputs = {"q": q, "scales": scales, "biases": biases}
    assert one_rounding_off(jax.jit(st.fake_quant(bits, group_size))(w), inputs, bits, group_size)
    half = w.astype(ml_dtypes.bfloat16)
    q, scales, biases = ref_quantize(half, bits, group_size)
    got = st.fake_quant(bits, group_size)(half)
    assert got.dtype == ml_dtypes.bfloat16
    want = ref_dequantize(q, scales, biases, bits, group_size)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_fake_quant_gradient_is_the_identity_summed_over_two_views():
    rng = np.random.default_rng(3)
    V, D, B = 12, 64, 5
    w = table(rng, (V, D))
    ids = np.array([1, 3, 3, 7, 0])
    x = rng.normal(size=(B, D)).astype(np.float32)
    c_tok, c_head = rng.normal(size=(B, D)), rng.normal(size=(B, V))
    fq = st.fake_quant(4, 64)
    tree = {"w": w, "tok": st.Tied("w", fq), "head": st.Tied("w", fq >> st.T)}

    def loss(tree):
        m = st.materialize(tree)
        return jnp.sum(c_tok * m["tok"][ids]) + jnp.sum(c_head * (x @ m["head"]))

    want = np.zeros((V, D))  # by hand: as if fake_quant were the identity
    np.add.at(want, ids, c_tok)
    want += c_head.T @ x
    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        np.testing.assert_allclose(grad(tree)["w"], want, rtol=1e-5, atol=1e-5)
    flat, re = st.destructure(tree)
    np.testing.assert_allclose(
        jax.grad(lambda v: loss(re.canonical(v)))(flat), want.ravel(), rtol=1e-5, atol=1e-5
    )
    # forward: the views are the quantized table, not the master
    q, scales, biases = ref_quantize(w, 4, 64)
    np.testing.assert_array_equal(
        st.materialize(tree)["tok"], ref_dequantize(q, scales, biases, 4, 64)
    )
    assert jax.vmap(fq)(w[None]).shape == (1, V, D)


# --- a tied model on a packed table ---------------------------------------------------------


def _logits(m, ids):
    """A tied LM in two lines: the lookup ``table[ids]`` and the head ``x @ table.T``."""
    return jnp.tanh(m["tok"][ids]) @ m["head"]


def test_a_tied_model_on_a_packed_table_is_the_model_on_its_float_table():
    rng = np.random.default_rng(4)
    w = table(rng, (16, 96))
    ids = np.array([[0, 5, 5, 15], [3, 2, 1, 9]])
    packed = st.quantize(w, 3, 32)
    dense = ref_dequantize(
        np.asarray(packed["q"]), np.asarray(packed["scales"]), np.asarray(packed["biases"]), 3, 32
    )
    float_tree = {"tok": dense, "head": st.Tied("tok", st.T)}
    want = _logits(st.materialize(float_tree), ids)
    tree = quantized_tree(packed, 3, 32)
    np.testing.assert_array_equal(_logits(st.materialize(tree), ids), want)
    jitted = jax.jit(lambda t: _logits(st.materialize(t), ids))(tree)
    np.testing.assert_allclose(jitted, want, rtol=1e-5, atol=1e-5)


def test_gradients_reach_scales_and_biases_and_match_finite_differences():
    rng = np.random.default_rng(5)
    w = table(rng, (8, 64))
    ids = np.array([[1, 4, 4, 7]])
    labels = np.array([[4, 0, 7, 1]])
    tree = quantized_tree(st.quantize(w, 4, 32), 4, 32)

    def loss(tree):
        logits = _logits(st.materialize(tree), ids)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))

    # q is uint32: jax.grad needs allow_int (q's cotangent is float0, no value)
    with pytest.raises(TypeError, match="allow_int"):
        jax.grad(loss)(tree)
    grads = jax.grad(loss, allow_int=True)(tree)["embed"]
    assert grads["q"].dtype == jax.dtypes.float0
    assert np.abs(grads["scales"]).sum() > 0 and np.abs(grads["biases"]).sum() > 0

    def nudged(name, i, eps):
        a = np.array(tree["embed"][name], np.float64)
        a[i] += eps
        return float(loss({**tree, "embed": {**tree["embed"], name: a.astype(np.float32)}}))

    eps = 1e-3
    for name in ("scales", "biases"):
        for i in [(1, 0), (4, 1), (7, 1), (0, 0)]:
            fd = (nudged(name, i, eps) - nudged(name, i, -eps)) / (2 * eps)
            assert abs(fd - float(grads[name][i])) <= 2e-3 + 2e-2 * abs(fd), (name, i)

    # the flat path: q is a static leaf, the vector holds the scales and biases only
    flat, re = st.destructure(tree)
    assert flat.size == 2 * 8 * 2
    g_flat = jax.jit(jax.grad(lambda v: loss(re.canonical(v))))(flat)
    back = re.canonical(g_flat)["embed"]
    np.testing.assert_allclose(back["scales"], grads["scales"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(back["biases"], grads["biases"], rtol=1e-5, atol=1e-6)
    assert back["q"] is tree["embed"]["q"]


def test_a_lookup_under_jit_unpacks_only_the_rows_it_reads():
    V, D = 4096, 256
    avals = {
        "q": jax.ShapeDtypeStruct((V, D * 3 // 32), jnp.uint32),
        "scales": jax.ShapeDtypeStruct((V, D // 32), jnp.float32),
        "biases": jax.ShapeDtypeStruct((V, D // 32), jnp.float32),
    }
    tree = quantized_tree(avals, 3, 32)
    ids = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    compiled = jax.jit(lambda t, i: st.materialize(t)["tok"][i]).lower(tree, ids).compile()
    memory = compiled.memory_analysis()
    if memory is None:
        pytest.skip("this backend gives no memory analysis")
    assert memory.temp_size_in_bytes < V * D * 4 // 8  # far less than the float table


# --- specs, files, shapes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "t",
    [st.dequantize(4, 64), st.dequantize(3, 32) >> st.T, st.fake_quant(6, 128)],
    ids=repr,
)
def test_spec_round_trip_pickle_and_repr(t):
    assert st.transform_from_spec(t.spec()) == t
    assert pickle.loads(pickle.dumps(t)) == t and hash(pickle.loads(pickle.dumps(t))) == hash(t)
    assert repr(st.transform_from_spec(t.spec())) == repr(t)
    assert st.dequantize(4, 64).spec() == {
        "name": "dequantize",
        "bits": 4,
        "group_size": 64,
        "mode": "affine",
    }
    assert st.dequantize(np.int64(4), 64) == st.dequantize(4, 64)
    assert repr(st.dequantize(3, 32) >> st.T) == "dequantize(3, 32) >> T"


def test_a_packed_tied_table_saves_and_loads(tmp_path):
    rng = np.random.default_rng(6)
    tree = quantized_tree(st.quantize(table(rng, (4, 64)), 5, 32), 5, 32)
    path = tmp_path / "q.safetensors"
    st.save(path, tree)
    back = st.load(path)
    assert back["head"] == tree["head"] and back["embed"]["q"].dtype == np.uint32
    np.testing.assert_array_equal(st.materialize(back)["head"], st.materialize(tree)["head"])
    views = st.canonicalize(back).views  # shapes from dequantize's abstract
    assert {p: v.shape for p, v in views.items()} == {"head": (64, 4), "tok": (4, 64)}


# --- errors -------------------------------------------------------------------------------


def test_sizes_and_modes_mlx_does_not_define():
    with raises("E200", "dequantize(7, 64)", "bits 7", "2, 3, 4, 5, 6, 8"):
        st.dequantize(7, 64)
    with raises("E200", "group_size 16", "32, 64, 128"):
        st.fake_quant(4, 16)
    with raises("E200", "bits 64, group_size 4", "(4, 64)"):  # MLX's order
        st.quantize(np.ones((1, 64)), 64, 4)
    with raises("E201", "'nvfp4'", "fp8", "mode='affine'"):
        st.quantize(np.ones((1, 64)), 4, 64, mode="nvfp4")
    with raises("E201", "'int4'", "mxfp8"):
        st.dequantize(4, 64, mode="int4")
    with raises("E73", "bits", "float 4.0", cls=st.TieTypeError):
        st.dequantize(4.0, 64)
    with raises("E73", "mode", cls=st.TieTypeError):
        st.dequantize(4, 64, mode=None)
    with raises("E73", "group_size", "True", cls=st.TieTypeError):
        st.fake_quant(4, True)


def test_inputs_that_are_not_a_quantized_table():
    rng = np.random.default_rng(0)
    x = packed_inputs(rng, (3,), 2, 4, 64)
    bad = {**x, "q": x["q"].view(np.int32)}
    with raises("E202", "'embed/q' int32[3, 16]", "view(np.uint32)"):
        st.materialize(quantized_tree(bad, 4, 64))
    with raises("E203", "float16", "float32", "one dtype"):
        st.dequantize(4, 64)({**x, "biases": x["biases"].astype(np.float16)})
    with raises("E203", "int32[3, 2]"):
        st.dequantize(4, 64)({**x, "scales": x["scales"].astype(np.int32)})
    with raises("E204", "scales float32[2, 2]", "(3, groups)"):
        st.dequantize(4, 64)({**x, "scales": x["scales"][:2], "biases": x["biases"][:2]})
    with raises("E204", "takes arrays", "'scales'"):
        st.dequantize(4, 64)({**x, "scales": 1.0})
    with raises("E205", "16 words", "128 4-bit values", "(3, 2)", "float32[3, 1]", "(4, 128)"):
        st.dequantize(4, 64)({**x, "scales": x["scales"][:, :1], "biases": x["biases"][:, :1]})
    with raises("E205", "8 words", "not whole groups of 128", "(3, 32)", "dequantize(2, 64)"):
        st.dequantize(4, 128)({**x, "q": x["q"][:, :8]})
    with raises("E205", "17 words", "whole 3-bit values"):
        st.dequantize(3, 32)({**x, "q": np.zeros((3, 17), np.uint32)})
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    with raises("E205", "dequantize(3, 64)"):
        st.dequantize(3, 64).abstract(avals)  # the shapes alone, nothing computed


def test_tables_that_cannot_be_quantized():
    with raises("E206", "int32[2, 64]", "real float", cls=st.TieTypeError):
        st.quantize(np.ones((2, 64), np.int32), 4, 64)
    with raises("E206", "float32[2, 96]", "whole groups of 64"):
        st.quantize(np.ones((2, 96), np.float32), 4, 64)
    with raises("E206", "fake_quant(4, 32)", "float32[]"):
        st.materialize({"w": np.float32(1.0), "v": st.Tied("w", st.fake_quant(4, 32))})
    with raises("E206", "list", cls=st.TieTypeError):
        st.quantize([1.0] * 32, 4, 32)
