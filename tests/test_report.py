import jax
import jax.numpy as jnp
import numpy as np

import sharetree as st
from sharetree._resolve import structure_of


def _tree():
    return {
        "enc": {"kernel": np.ones((4, 3), np.float32), "bias": np.zeros(3, np.float32)},
        "dec": {"kernel": st.Tied("enc/kernel", st.T), "bias": np.zeros(4, np.float32)},
        "again": st.Tied("enc"),
        "steps": np.int32(3),
    }


def test_counts_params_and_bytes():
    g = st.canonicalize(_tree())
    assert g.num_unique == 4  # enc/kernel, enc/bias, dec/bias, steps
    assert g.num_expanded == 7  # + dec/kernel, again/kernel, again/bias
    assert g.num_views == 3
    assert g.size_unique == 12 + 3 + 4 + 1
    assert g.size_expanded == g.size_unique + 12 + 12 + 3
    assert g.nbytes_unique == 4 * (12 + 3 + 4) + 4
    assert g.nbytes_expanded == g.nbytes_unique + 4 * 27


def test_buffers_and_views_in_flatten_order():
    g = st.canonicalize(_tree())
    assert [b.path for b in g.buffers] == ["dec/bias", "enc/bias", "enc/kernel", "steps"]
    assert [b.num_views for b in g.buffers] == [0, 1, 2, 0]
    assert g.buffers[2].shape == (4, 3) and g.buffers[2].dtype == np.float32
    v = g.views["dec/kernel"]
    assert (v.buffer, v.transform, v.shape, v.tie) == ("enc/kernel", st.T, (3, 4), "dec/kernel")
    assert g.views["again/kernel"].tie == "again"
    assert set(g.ties) == {"dec/kernel", "again"}


def test_repr_is_readable():
    r = repr(st.canonicalize(_tree()))
    assert r.startswith("SharingGraph(4 buffers, 3 views;") and "unique" in r


def test_structure_cached_per_treedef():
    a, b = _tree(), _tree()
    assert structure_of(jax.tree.structure(a)) is structure_of(jax.tree.structure(b))
    c = dict(_tree(), dec={"kernel": st.Tied("enc/kernel"), "bias": np.zeros(4)})
    assert structure_of(jax.tree.structure(c)) is not structure_of(jax.tree.structure(a))


def test_owner_is_the_buffer_not_a_later_position():
    # owners are deterministic: only non-Tied positions are buffers, whatever the order
    tree = {"a": st.Tied("z"), "z": jnp.ones(2)}
    g = st.canonicalize(tree)
    assert [b.path for b in g.buffers] == ["z"] and list(g.views) == ["a"]


def test_no_ties():
    tree = {"a": jnp.ones(2)}
    g = st.canonicalize(tree)
    assert (g.num_unique, g.num_expanded, g.views) == (1, 1, {})
    assert st.materialize(tree) is tree


def test_view_names_the_tie_written_at_its_position():
    a = np.ones((2, 3), np.float32)
    tree = {
        "enc": {"w": a},
        "dec": {"w": st.Tied("enc/w", st.T)},
        "chain": st.Tied("dec/w", st.T),
        "sub": st.Tied("dec"),
    }
    g = st.canonicalize(tree)
    assert g.views["dec/w"].tie == "dec/w"
    assert g.views["chain"].tie == "chain" and g.views["chain"].transform == st.T >> st.T
    assert g.views["sub/w"].tie == "sub" and g.views["sub/w"].buffer == "enc/w"


def test_views_of_prng_keys_have_shapes():
    keys = jax.random.split(jax.random.key(0), 6).reshape(2, 3)
    g = st.canonicalize({"a": keys, "b": st.Tied("a", st.T)})
    assert g.views["b"].shape == (3, 2) and g.views["b"].dtype == keys.dtype
