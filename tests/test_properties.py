"""Hypothesis properties over random nested containers with random ties.

The reference side never uses sharetree's resolver: ties are generated as a
table ``{target: (ref, transform chain)}`` and resolved here by plain recursion.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as hs

import sharetree as st
from sharetree._paths import node_paths
from sharetree._resolve import ref_to

SHAPES = [(), (3,), (2, 3), (3, 3), (2, 2, 2)]
TRANSFORMS = [
    [],
    [st.T],
    [st.reshape(-1)],
    [st.astype(jnp.float16)],
    [st.scale(2.0)],
    [st.T, st.scale(-1.5)],
    [st.reshape(-1), st.astype(jnp.float16)],
]

base_trees = hs.recursive(
    hs.sampled_from(range(len(SHAPES))),
    lambda children: hs.one_of(
        hs.dictionaries(hs.sampled_from("abcd"), children, min_size=1, max_size=3),
        hs.lists(children, min_size=1, max_size=3),
    ),
    max_leaves=8,
)


def _names(kp):
    out = []
    for k in kp:
        out.append(str(k.key) if hasattr(k, "key") else str(k.idx))
    return tuple(out)


def _get(tree, path):
    for k in path:
        tree = tree[k] if isinstance(tree, dict) else tree[int(k)]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    k = path[0] if isinstance(tree, dict) else int(path[0])
    if isinstance(tree, dict):
        return {**tree, k: _set(tree[k], path[1:], value)}
    return [(_set(c, path[1:], value) if i == k else c) for i, c in enumerate(tree)]


@hs.composite
def tied_trees(draw):
    shape_tree = draw(base_trees)
    if not isinstance(shape_tree, (dict, list)):
        shape_tree = {"a": shape_tree}
    rng = np.random.default_rng(draw(hs.integers(0, 2**16)))
    tree = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=SHAPES[s]), jnp.float32), shape_tree)
    leaves = [_names(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    nodes = sorted({p[:k] for p in leaves for k in range(1, len(p))})
    table = {}
    for j, target in enumerate(leaves):
        if j == 0 or not draw(hs.booleans()):
            continue
        earlier = leaves[:j]
        subtrees = [
            n
            for n in nodes
            if target[: len(n)] != n and all(p in earlier for p in leaves if p[: len(n)] == n)
        ]
        ref = draw(hs.sampled_from(earlier + subtrees))
        table[target] = (ref, draw(hs.sampled_from(TRANSFORMS)))
    canonical = tree
    positions = node_paths(leaves)
    for target, (ref, chain) in table.items():
        try:  # refs are scoped (innermost subtree first): write the one that names `ref`
            written = ref_to(ref, target, positions)
        except st.TieError:
            assume(False)  # no spelling names it from there (a subtree has the same path)
        # ref_to sees nodes only: no inner scope may reach the ref through a view either
        for k in range(len(target) - 1, 0, -1):
            p = target[:k] + written
            assume(not any(p[:m] in table for m in range(1, len(p) + 1)))
        canonical = _set(
            canonical, target, st.Tied(written, st.identity if not chain else _compose(chain))
        )
    return tree, canonical, table


def _compose(chain):
    out = st.identity
    for t in chain:
        out = out >> t
    return out


def _reference(tree, table):
    """Materialize by recursion over the generated table; also list each view."""
    views = []  # (target leaf path, buffer path, chain)

    def value(path, chain):
        if path in table:
            ref, c = table[path]
            return value(ref, c + chain)
        node = _get(tree, path)
        if isinstance(node, dict):
            return {k: value(path + (k,), chain) for k in node}
        if isinstance(node, list):
            return [value(path + (str(i),), chain) for i in range(len(node))]
        out = node
        for t in chain:
            out = t(out)
        return (path, chain, out)

    def build(path):
        if path in table:
            ref, c = table[path]
            v = value(ref, list(c))
            for kp, (bpath, chain, _) in jax.tree_util.tree_flatten_with_path(
                v, is_leaf=lambda x: isinstance(x, tuple)
            )[0]:
                views.append((path + _names(kp), bpath, chain))
            return jax.tree.map(lambda x: x[2], v, is_leaf=lambda x: isinstance(x, tuple))
        node = _get(tree, path)
        if isinstance(node, dict):
            return {k: build(path + (k,)) for k in node}
        if isinstance(node, list):
            return [build(path + (str(i),)) for i in range(len(node))]
        return node

    return build(()), views


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        # XLA may fuse a chain of views of a float16 buffer and round once instead of per step:
        # allow a few units in the last place of the leaf's own dtype (1e-6 for float32)
        rtol = (
            max(1e-6, 4 * float(jnp.finfo(x.dtype).eps))
            if jnp.issubdtype(x.dtype, jnp.inexact)
            else 0
        )
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol)


def _loss(m):
    return sum(
        jnp.sum(jnp.sin((k + 1) * x.astype(jnp.float32))) for k, x in enumerate(jax.tree.leaves(m))
    )


@given(tied_trees())
def test_materialize_and_restructure_equal_reference(case):
    tree, canonical, table = case
    expected, _ = _reference(tree, table)
    _assert_trees_equal(st.materialize(canonical), expected)
    flat, re = st.destructure(canonical)
    _assert_trees_equal(re(flat), expected)
    _assert_trees_equal(re.canonical(flat), canonical)
    # restructure passed into jit: a static argument, offsets made opaque to XLA (dynamic slices)
    _assert_trees_equal(jax.jit(lambda v, r: r(v))(flat, re), expected)


@given(tied_trees())
def test_gradients_equal_untied_gradient_summed_through_each_view(case):
    tree, canonical, table = case
    expected, views = _reference(tree, table)
    g_untied = jax.grad(_loss)(expected)  # one independent array per position
    reference = {}
    for kp, _ in jax.tree_util.tree_flatten_with_path(canonical)[0]:
        path = _names(kp)
        reference[path] = _get(g_untied, path).astype(jnp.float32)
    for target, bpath, chain in views:
        buf = _get(tree, bpath)
        _, vjp = jax.vjp(lambda b, chain=chain: _compose(chain)(b) if chain else b, buf)
        reference[bpath] = reference[bpath] + vjp(_get(g_untied, target))[0].astype(jnp.float32)

    g_tree = jax.grad(lambda t: _loss(st.materialize(t)))(canonical)
    assert jax.tree.structure(g_tree) == jax.tree.structure(canonical)
    flat, re = st.destructure(canonical)
    g_flat = re.canonical(jax.grad(lambda v: _loss(re(v)))(flat))
    g_arg = re.canonical(jax.jit(jax.grad(lambda v, r: _loss(r(v))))(flat, re))
    # a float16 view rounds its value; jit may fuse the chain and round once, so the
    # gradient through it agrees to float16 precision only
    half = any(
        str(getattr(t, "dtype", "")) in ("float16", "bfloat16") for *_, c in views for t in c
    )
    tol = 1e-2 if half else 2e-3
    for g in (g_tree, g_flat, g_arg):
        for kp, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
            np.testing.assert_allclose(leaf, reference[_names(kp)], rtol=tol, atol=tol)


@given(tied_trees())
def test_ties_survive_tree_map(case):
    _, canonical, table = case
    calls = []
    out = jax.tree.map(lambda x: calls.append(1) or x * 2, canonical)
    assert jax.tree.structure(out) == jax.tree.structure(canonical)
    assert len(calls) == len(jax.tree.leaves(canonical)) == len(jax.tree.leaves(canonical))
    n_tied = len(jax.tree.leaves(canonical, is_leaf=lambda x: isinstance(x, st.Tied))) - len(
        jax.tree.leaves(canonical)
    )
    assert n_tied == len(table)


@given(tied_trees())
def test_canonicalize_counts_equal_brute_force(case):
    tree, canonical, table = case
    expected, views = _reference(tree, table)
    g = st.canonicalize(canonical)
    buffers = jax.tree.leaves(canonical)
    assert g.num_unique == len(buffers)
    assert g.num_expanded == len(jax.tree.leaves(expected))
    assert g.num_views == len(views)
    assert g.size_unique == sum(x.size for x in buffers)
    assert g.size_expanded == sum(x.size for x in jax.tree.leaves(expected))
    assert g.nbytes_expanded == sum(x.nbytes for x in jax.tree.leaves(expected))
    assert sorted(g.views) == sorted("/".join(t) for t, _, _ in views)
    for target, bpath, chain in views:
        assert g.views["/".join(target)].buffer == "/".join(bpath)
        assert g.views["/".join(target)].transform == _compose(chain)
