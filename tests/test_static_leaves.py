"""Static (non-inexact) leaves cost nothing per call: their contents are never read.

``destructure`` keeps integer arrays, PRNG keys, strings and other non-parameter
leaves in ``restructure`` as they are; comparing and hashing them (at each
repeated ``destructure`` and at each jit cache lookup of a ``restructure``)
never reads, copies or hashes their bytes. Speed is measured in benchmarks/
(the ``static leaf`` rows), not here.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharetree as st


def test_a_static_array_is_never_read_after_the_first_destructure():
    # a deleted jax.Array raises on any read of its contents: repeated destructures,
    # equality, hashing and a jit that takes the restructure as a static argument
    # must all work without one
    big = jnp.arange(1_000, dtype=jnp.int32)
    tree = {"w": jnp.ones(3), "v": st.Tied("w", st.scale(2.0)), "n": big}
    flat, re = st.destructure(tree)
    big.delete()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same object: nothing changed, nothing to warn
        flat2, re2 = st.destructure(tree)
    assert re2 == re and hash(re2) == hash(re)
    traces = []

    def loss(v, r):
        traces.append(1)
        return jnp.sum(r(v)["v"])

    f = jax.jit(loss, static_argnums=1)
    assert f(flat, re) == 6.0 and f(flat2, re2) == 6.0  # 2 * (1 + 1 + 1)
    assert len(traces) == 1
    assert re(flat)["n"] is big  # kept as it is, never copied


def test_a_changed_python_value_warns_that_it_changed_and_an_equal_one_does_not():
    def tree(tag):
        return {"w": jnp.ones(2), "tag": tag}

    st.destructure(tree("a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.destructure(tree("a"))  # an equal str: the same static leaf
    with pytest.warns(UserWarning, match=r"^\[E160\]") as record:
        st.destructure(tree("b"))
    (w,) = record
    assert "static leaf 'tag' (static)" in str(w.message) and "changed" in str(w.message)


def test_an_int_array_rebuilt_with_the_same_values_is_another_static_leaf():
    def tree():
        return {"w": jnp.ones(2), "k": np.arange(4)}

    _, r1 = st.destructure(tree())
    with pytest.warns(UserWarning, match=r"^\[E160\]") as record:
        _, r2 = st.destructure(tree())
    (w,) = record
    assert "'k' (int64[4])" in str(w.message) and "another array object" in str(w.message)
    assert "identity" in str(w.message)
    assert r1 != r2  # honest: a jit taking it as a static argument would retrace
