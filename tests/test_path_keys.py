"""One path-key convention in every result, taken back by ``st.tie`` and ``st.untie`` as it is.

Every key sharetree returns (``grad_by_use``, ``SharingGraph.views`` and
``buffers``, ``find_ties``) is ``/``-joined, or the tuple of keys where a key
contains ``/`` (a dict key ``"a/b"``): ``path_key``. Tested against a tree
whose tied weight sits under such a key.
"""

import jax
import jax.numpy as jnp
import numpy as np

import sharetree as st


def _untied():
    w = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    return {"a/b": {"w": w}, "c": {"w": w.T.copy()}, "d": np.ones(3, np.float32)}


def _tied():
    return st.tie(_untied(), {("c", "w"): st.Tied(("a/b", "w"), st.T)})


def _loss(m):
    return jnp.sum(m["a/b"]["w"] ** 2) + jnp.sum(jnp.sin(m["c"]["w"])) + jnp.sum(m["d"])


def _round_trip(tree, view_key, buffer_key):
    """untie the view by its key, then tie it again by the keys: the same canonical tree."""
    untied = st.untie(tree, [view_key])
    np.testing.assert_array_equal(untied["c"]["w"], _untied()["c"]["w"])
    again = st.tie(untied, {view_key: st.Tied(buffer_key, st.T)})
    assert jax.tree.structure(again) == jax.tree.structure(tree)


def test_sharing_graph_keys_go_back_into_tie_and_untie():
    tree = _tied()
    g = st.canonicalize(tree)
    (view_key,) = g.views
    view = g.views[view_key]
    assert view_key == "c/w" and view.buffer == ("a/b", "w") and view.tie == "c/w"
    assert g.buffers[0].path == ("a/b", "w") and g.buffers[1].path == "d"
    _round_trip(tree, view_key, view.buffer)
    _round_trip(tree, view.path, g.buffers[0].path)
    assert "('a/b', 'w')" in st.summary(tree)  # shown as every message shows the path


def test_grad_by_use_keys_go_back_into_tie_and_untie_and_grad_report():
    tree = _tied()
    by_use = st.grad_by_use(_loss)(tree)
    assert list(by_use) == [("a/b", "w"), "d"]
    buffer_key = next(iter(by_use))
    uses = list(by_use[buffer_key])
    assert uses == [("a/b", "w"), "c/w"]
    _round_trip(tree, uses[1], buffer_key)
    # the uses sum to the gradient of the loss on the canonical tree (JAX's own sum)
    g = jax.grad(lambda t: _loss(st.materialize(t)))(tree)
    np.testing.assert_allclose(sum(by_use[buffer_key].values()), g["a/b"]["w"], rtol=1e-6)
    report = st.grad_report(by_use)
    assert report[buffer_key].path == report["('a/b', 'w')"].path
    assert "('a/b', 'w')" in str(report)


def test_find_ties_keys_go_back_into_tie():
    found = st.find_ties(_untied(), transforms=(st.T,))
    assert found == {"c/w": st.Tied(("a/b", "w"), st.T)}
    tree = st.tie(_untied(), found)
    assert tree["c"]["w"] == st.Tied(("a/b", "w"), st.T)
    np.testing.assert_array_equal(st.materialize(tree)["c"]["w"], _untied()["c"]["w"])
