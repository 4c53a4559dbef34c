"""Views of several positions: the resolver's joins, materialize and the flat path.

The reference is a small interpreter of the drawn graph written here in NumPy and jnp
(never sharetree): each node's value from its parents' by the op it names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import sharetree as st
from sharetree._resolve import structure_of
from tests._raises import raises

N = 3  # every node is an N x N matrix, so any op composes with any other


# --- a DAG of views, drawn ------------------------------------------------------------------

OPS = ("copy", "T", "scale", "add", "matmul", "lora")


@hs.composite
def dags(draw):
    """``(nodes, groups)``: each node ``(op, parents)``; buffers first; where each node sits."""
    n_buffers = draw(hs.integers(1, 4))
    n_views = draw(hs.integers(1, 7))
    nodes = [("buffer", ())] * n_buffers
    for i in range(n_buffers, n_buffers + n_views):
        op = draw(hs.sampled_from(OPS))
        arity = {
            "copy": 1,
            "T": 1,
            "scale": 1,
            "add": draw(hs.integers(1, 3)),
            "matmul": 2,
            "lora": 3,
        }[op]
        parents = tuple(draw(hs.integers(0, i - 1)) for _ in range(arity))
        nodes.append((op, parents))
    groups = [draw(hs.integers(0, 2)) for _ in nodes]  # nest nodes in subtrees g0..g2
    return nodes, groups


def _path(i, groups):
    return f"g{groups[i]}/n{i}"


def _tree(nodes, groups, values):
    tree = {}
    for i, (op, parents) in enumerate(nodes):
        refs = [_path(p, groups) for p in parents]
        if op == "buffer":
            x = values[i]
        elif op in ("copy", "T", "scale"):
            x = st.Tied(refs[0], {"copy": st.identity, "T": st.T, "scale": st.scale(0.5)}[op])
        elif op == "add":
            x = st.Tied({f"x{k}": r for k, r in enumerate(refs)}, st.add())
        elif op == "matmul":
            x = st.Tied({"a": refs[0], "b": refs[1]}, st.matmul())
        else:
            x = st.Tied({"base": refs[0], "a": refs[1], "b": refs[2]}, st.lora(0.25) >> st.T)
        tree.setdefault(f"g{groups[i]}", {})[f"n{i}"] = x
    return tree


def _by_hand(nodes, values, xp):
    """Every node's value, by its op on its parents' values (``xp``: numpy or jnp)."""
    out = []
    for i, (op, parents) in enumerate(nodes):
        p = [out[k] for k in parents]
        if op == "buffer":
            v = values[i]
        elif op == "copy":
            v = p[0]
        elif op == "T":
            v = p[0].T
        elif op == "scale":
            v = p[0] * 0.5
        elif op == "add":
            v = sum(p[1:], p[0])
        elif op == "matmul":
            v = p[0] @ p[1]
        else:
            v = (p[0] + 0.25 * (p[1] @ p[2])).T
        out.append(v)
    return out


def _values(nodes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((N, N)).astype(np.float32) * 0.5 for _ in nodes]


@settings(max_examples=100, deadline=None)
@given(dags(), hs.integers(0, 2**16))
def test_a_drawn_dag_of_views_materializes_and_differentiates_as_written_by_hand(dag, seed):
    nodes, groups = dag
    values = _values(nodes, seed)
    tree = _tree(nodes, groups, values)
    n_buffers = sum(op == "buffer" for op, _ in nodes)
    assert len(jax.tree.leaves(tree)) == n_buffers  # no view is a copy
    m = st.materialize(tree)
    want = _by_hand(nodes, [v.astype(np.float64) for v in values], np)
    for i in range(len(nodes)):
        np.testing.assert_allclose(m[f"g{groups[i]}"][f"n{i}"], want[i], rtol=1e-4, atol=1e-4)
    # each join is computed once: one join per view of several positions, in the structure
    several = sum(op in ("add", "matmul", "lora") for op, _ in nodes)
    assert len(structure_of(jax.tree.structure(tree)).joins) == several
    # gradients of every buffer, against the same graph written in jnp
    weights = _values(nodes, seed + 1)

    def loss_st(t):
        mm = st.materialize(t)
        return sum(jnp.vdot(weights[i], mm[f"g{groups[i]}"][f"n{i}"]) for i in range(len(nodes)))

    def loss_hand(bufs):
        vals = _by_hand(nodes, bufs + [None] * (len(nodes) - len(bufs)), jnp)
        return sum(jnp.vdot(weights[i], vals[i]) for i in range(len(nodes)))

    g = jax.grad(loss_st)(tree)
    g_hand = jax.grad(loss_hand)([jnp.asarray(values[i]) for i in range(n_buffers)])
    for i in range(n_buffers):
        np.testing.assert_allclose(g[f"g{groups[i]}"][f"n{i}"], g_hand[i], rtol=1e-3, atol=1e-3)
    # the flat path: one entry per buffer element, the same gradient
    flat, restructure = st.destructure(tree)
    assert flat.size == n_buffers * N * N
    gf = jax.grad(lambda v: loss_st(restructure.canonical(v)))(flat)
    np.testing.assert_allclose(gf, st.destructure(g)[0], rtol=1e-5, atol=1e-6)


def test_subtree_inputs_map_leaf_by_leaf_and_a_view_below_one_is_read():
    enc = {"w": np.ones((2, 3), np.float32), "b": np.arange(3.0, dtype=np.float32)}
    delta = {"w": np.full((2, 3), 2.0, np.float32), "b": np.ones(3, np.float32)}
    tree = {
        "enc": enc,
        "delta": delta,
        "tuned": st.Tied({"x": "enc", "y": "delta"}, st.add()),
        "bT": st.Tied("tuned/w", st.T),  # below a view of several positions
    }
    m = st.materialize(tree)
    np.testing.assert_array_equal(m["tuned"]["w"], enc["w"] + delta["w"])
    np.testing.assert_array_equal(m["tuned"]["b"], enc["b"] + delta["b"])
    np.testing.assert_array_equal(m["bT"], (enc["w"] + delta["w"]).T)
    assert len(structure_of(jax.tree.structure(tree)).joins) == 2  # one per leaf


def test_a_chain_of_views_of_several_computes_each_once():
    x = np.ones((3, 3), np.float32)
    tree = {
        "x": x,
        "y": x * 2,
        "s": st.Tied({"a": "x", "b": "y"}, st.add()),
        "p": st.Tied({"a": "s", "b": "s"}, st.matmul()),
        "q": st.Tied("p", st.T),
        "r": st.Tied("p"),
    }
    text = jax.jit(st.materialize).lower(tree).as_text()
    assert text.count("dot_general") == 1 and text.count("add") == 1
    m = st.materialize(tree)
    np.testing.assert_allclose(m["q"], ((x + 2 * x) @ (x + 2 * x)).T)


def test_several_refs_follow_the_scoping_rule_and_climb():
    w = np.arange(4.0, dtype=np.float32)
    tree = {"w": w, "sub": {"w": w * 10, "v": st.Tied({"near": "w", "far": "../w"}, st.add())}}
    with pytest.warns(UserWarning, match="E165"):  # a plain 'w' reads the nearer one
        m = st.materialize(tree)
    np.testing.assert_array_equal(m["sub"]["v"], w * 10 + w)
    tree["sub"]["v"] = st.Tied({"near": "./w", "far": "../w"}, st.add())
    np.testing.assert_array_equal(st.materialize(tree)["sub"]["v"], w * 10 + w)


# --- bad input: each names the view, the input and a fix ------------------------------------


def test_dangling_ref_among_several_names_which():
    tree = {"a": np.ones(2), "v": st.Tied({"x": "a", "y": "nope"}, st.add())}
    with raises("E1", "'v'", "input 'y'", "'nope'"):
        st.materialize(tree)


def test_a_cycle_through_a_view_of_several_is_shown_whole():
    tree = {"a": np.ones(2), "v": st.Tied({"x": "a", "y": "w"}, st.add()), "w": st.Tied("v", st.T)}
    with raises("E2", "'v'", "'w'", "input 'y'"):
        st.materialize(tree)


def test_subtree_inputs_of_different_structures():
    tree = {"a": {"p": np.ones(2), "q": np.ones(2)}, "b": {"p": np.ones(2)}}
    tree["v"] = st.Tied({"x": "a", "y": "b"}, st.add())
    with raises("E168", "'v'", "'x'", "'y'", "2 leaves", "['p', 'q']"):
        st.materialize(tree)


def test_shapes_that_do_not_multiply_or_add_name_the_view_and_its_inputs():
    tree = {
        "a": np.ones((2, 3)),
        "b": np.ones((4, 2)),
        "v": st.Tied({"a": "a", "b": "b"}, st.matmul()),
    }
    with raises("E106", "'v'", "(2, 3)", "(4, 2)", "3 columns", "4 rows"):
        st.materialize(tree)
    with raises("E106", "'v'", "(2, 3)", "(4, 2)"):
        _ = st.canonicalize(tree).views
    tree["v"] = st.Tied({"x": "a", "y": "b"}, st.add())
    with raises("E106", "'v'", "(2, 3)", "(4, 2)"):
        jax.eval_shape(st.materialize, tree)
    # adapter ranks that disagree
    tree = {"w": np.ones((4, 4)), "a": np.ones((4, 2)), "b": np.ones((3, 4))}
    tree["v"] = st.Tied({"base": "w", "a": "a", "b": "b"}, st.lora())
    with raises("E106", "'v'", "2 columns", "3 rows"):
        st.materialize(tree)


def test_take_out_of_range_negative_past_not_ints_empty_or_a_missing_axis():
    blocks = {"blocks": np.ones((2, 3, 3))}
    for bad in [(0, 2), (-3,)]:
        with raises("E71", "'v'", "size 2"):
            st.materialize({**blocks, "v": st.Tied("blocks", st.take(bad))})
    with raises("E71", "axis 3"):
        st.materialize({**blocks, "v": st.Tied("blocks", st.take((0,), axis=3))})
    with raises("E73", "indices", cls=st.TieTypeError):
        st.take((0.5, 1))
    with raises("E73", "indices", cls=st.TieTypeError):
        st.take(2)
    with raises("E72", "no entries"):
        st.take(())
