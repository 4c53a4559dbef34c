import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharetree as st

X = np.arange(24.0, dtype=np.float32).reshape(2, 3, 4)

ALL = [
    st.identity,
    st.T,
    st.transpose(1, 0, 2),
    st.reshape(4, 6),
    st.astype(jnp.bfloat16),
    st.scale(0.5),
    st.scale(2j),
    st.fn(jnp.flipud),
    st.T >> st.reshape(24),
]


@pytest.mark.parametrize("t", ALL, ids=repr)
def test_hashable_equal_picklable_and_spec_roundtrip(t):
    assert hash(t) == hash(pickle.loads(pickle.dumps(t)))
    assert pickle.loads(pickle.dumps(t)) == t
    assert st.transform_from_spec(t.spec()) == t


def test_value_equality_and_reprs():
    assert st.T == st.transpose() and hash(st.T) == hash(st.transpose())
    assert st.reshape(4, 6) == st.reshape((4, 6)) and st.reshape(4, 6) != st.reshape(6, 4)
    assert st.astype("float16") == st.astype(np.float16)
    assert st.scale(2) == st.scale(2.0)
    assert [repr(t) for t in (st.identity, st.T, st.reshape(4, 6), st.scale(0.5))] == [
        "identity",
        "T",
        "reshape(4, 6)",
        "scale(0.5)",
    ]
    assert repr(st.T >> st.astype(jnp.bfloat16)) == "T >> astype(bfloat16)"
    assert pickle.loads(pickle.dumps(st.identity)) is st.identity


def test_values_match_numpy():
    np.testing.assert_array_equal(st.identity(X), X)
    np.testing.assert_array_equal(st.T(X), X.T)
    np.testing.assert_array_equal(st.transpose(1, 0, 2)(X), X.transpose(1, 0, 2))
    np.testing.assert_array_equal(st.reshape(4, -1)(X), X.reshape(4, 6))
    assert st.astype(jnp.bfloat16)(X).dtype == jnp.bfloat16
    np.testing.assert_allclose(st.scale(0.5)(X), X * 0.5)
    np.testing.assert_array_equal(st.fn(jnp.flipud)(X), np.flipud(X))
    np.testing.assert_array_equal((st.T >> st.reshape(24))(X), X.T.reshape(24))


def test_chain_normalises():
    assert st.identity >> st.identity is st.identity
    assert st.identity >> st.T == st.T
    a = st.T >> st.reshape(24)
    assert (a >> st.scale(2.0)) == (st.T >> (st.reshape(24) >> st.scale(2.0)))


def test_abstract_matches_eval_shape():
    aval = jax.ShapeDtypeStruct(X.shape, X.dtype)
    for t in ALL:
        assert t.abstract(aval) == jax.eval_shape(t, aval), t


def test_fn_spec_needs_importable_function():
    with pytest.raises(st.TieError, match="cannot be written"):
        st.fn(lambda x: x).spec()


def test_unknown_and_malformed_specs():
    with pytest.raises(st.TieError, match="unknown transform name 'rot90'"):
        st.transform_from_spec({"name": "rot90"})
    with pytest.raises(st.TieError, match="malformed"):
        st.transform_from_spec({"name": "reshape"})
    with pytest.raises(st.TieError, match="cannot import"):
        st.transform_from_spec({"name": "fn", "function": "nowhere_module:f"})


def test_scale_rejects_non_numbers():
    with pytest.raises(st.TieError, match="number"):
        st.scale("2")
