"""Bad inputs of the several-input transforms, add_lora, quantize and nnx.tie: each one is
the error of its row (its code and class, the position and what was found), never a crash
while the message is built (issue 40, item 10)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _raises import raises

import sharetree as st

W = np.ones((2, 2), np.float32)

# values that are no array of the view's shape: 0-d arrays, Python numbers, a string
ODD = {
    "0-d": np.float32(1.0),
    "number": 3.0,
    "int": 2,
    "string": "s",
}


def _views(odd):
    q = st.quantize(np.ones((4, 64), np.float32), bits=4, group_size=64)
    return {
        "add": ({"a": odd, "b": W}, {"x": "a", "y": "b"}, st.add(), "E106"),
        "matmul": ({"a": odd, "b": W}, {"a": "a", "b": "b"}, st.matmul(), "E106"),
        "lora": (
            {"base": W, "a": odd, "b": np.ones((1, 2), np.float32)},
            {"base": "base", "a": "a", "b": "b"},
            st.lora(),
            "E106",
        ),
        "dequantize": (
            {"q": q["q"], "scales": odd, "biases": q["biases"]},
            {"q": "q", "scales": "scales", "biases": "biases"},
            st.dequantize(4, 64),
            "E204",
        ),
    }


@pytest.mark.parametrize("kind", sorted(ODD))
@pytest.mark.parametrize("transform", ["add", "matmul", "lora", "dequantize"])
def test_an_input_that_is_no_array_of_the_views_shape_is_its_rows_error(transform, kind):
    tree, refs, t, code = _views(ODD[kind])[transform]
    tree = {**tree, "view": st.Tied(refs, t)}
    with raises(code, "'view'"):
        st.materialize(tree)


def test_add_lora_of_a_pattern_that_is_not_a_str():
    for bad in (3, None, b"w", {"w": 1}):
        with raises("E173", "where", type(bad).__name__, cls=st.TieTypeError):
            st.add_lora({"w": W}, bad, rank=1, key=jax.random.key(0))


def test_add_lora_of_an_empty_matrix():
    for shape in ((0, 4), (4, 0), (3, 0, 4)):
        tree = {"w": np.ones(shape, np.float32)}
        with raises("E174", "'w'", f"float32{list(shape)}"):
            st.add_lora(tree, "w", rank=1, key=jax.random.key(0))


@pytest.mark.parametrize("key", [0, 1.5, "k", np.zeros(3, np.uint32), None])
def test_add_lora_of_a_key_that_is_no_prng_key(key):
    with raises("E290", "key", cls=st.TieTypeError):
        st.add_lora({"w": W}, "w", rank=1, key=key)


def test_add_lora_takes_typed_and_raw_keys_alike():
    typed = st.add_lora({"w": W}, "w", rank=1, key=jax.random.key(0))
    raw = st.add_lora({"w": W}, "w", rank=1, key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(typed["lora"]["w"]["a"], raw["lora"]["w"]["a"])


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.complex64, np.bool_])
def test_quantize_of_what_is_not_real_floats_is_a_type_error(dtype):
    with raises("E206", f"{np.dtype(dtype).name}[4, 64]", cls=st.TieTypeError):
        st.quantize(np.ones((4, 64), dtype), bits=4, group_size=64)


def test_nnx_tie_of_a_tree_without_variables_is_a_type_error():
    sharetree_nnx = pytest.importorskip("sharetree.nnx")
    for tree in ({"a": W, "b": W}, [W, W]):
        with raises("E69", "NNX module", type(tree).__name__, cls=st.TieTypeError):
            sharetree_nnx.tie(tree, {"b": "a"})
