"""Hypothesis properties over random nested containers with random ties.

The reference side shares no code with sharetree: ties are generated as a table
``{target: (ref, chain)}`` whose chain is a list of plain steps (``("T",)``,
``("scale", 2.0)``, ``("slice", start, stop, axis)``, ``("index", i, axis)``,
...), resolved here by plain recursion; each step's value is written in NumPy
and its VJP by hand (``_apply``, ``_vjp_by_hand``). sharetree's transform
objects appear only where the canonical tree is built (``_st_chain``) and where
its resolved transforms are compared with that chain.
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
    [("T",)],
    [("reshape", -1)],
    [("astype", "float16")],
    [("scale", 2.0)],
    [("T",), ("scale", -1.5)],
    [("reshape", -1), ("astype", "float16")],
    [("slice", 1, None, 0)],
    [("slice", 0, -1, -1)],
    [("index", -1, 0)],
    [("index", 1, -1)],
    [("T",), ("slice", 0, 2, 0)],
    [("index", 0, 0), ("scale", 3.0)],
]


def _st_step(step):
    """The sharetree transform of one plain step (only to build the canonical tree)."""
    kind, *arg = step
    return {
        "T": lambda: st.T,
        "reshape": lambda: st.reshape(*arg),
        "astype": lambda: st.astype(jnp.dtype(arg[0])),
        "scale": lambda: st.scale(arg[0]),
        "slice": lambda: st.slice(arg[0], arg[1], axis=arg[2]),
        "index": lambda: st.index(arg[0], axis=arg[1]),
    }[kind]()


def _st_chain(chain):
    out = st.identity
    for step in chain:
        out = out >> _st_step(step)
    return out


def _where(kind, arg, ndim):
    """The index of a slice step (``x[start:stop]`` along its axis) or an index step (``x[i]``)."""
    *at, axis = arg
    return (slice(None),) * (axis % ndim) + (slice(*at) if kind == "slice" else at[0],)


def _apply(chain, x):
    """A view's value by hand, one step at a time, with array methods (NumPy or jnp arrays).

    A transpose reverses every axis, a reshape is C-order, a scale multiplies by a
    Python float (computed in the array's dtype), slice and index are indexing.
    """
    for kind, *arg in chain:
        if kind == "T":
            x = x.transpose()
        elif kind == "reshape":
            x = x.reshape(arg)
        elif kind == "astype":
            x = x.astype(np.dtype(arg[0]))
        elif kind == "scale":
            x = x * arg[0]
        elif kind in ("slice", "index"):
            x = x[_where(kind, arg, x.ndim)]
        else:
            raise AssertionError(kind)
    return x


def _np_value(chain, x):
    return _apply(chain, np.asarray(x))


def _fits(chain, shape):
    """Whether each slice and index of ``chain`` lies inside what it gets (a view never clips)."""
    x = np.zeros(shape, np.int8)
    for step in chain:
        kind, *arg = step
        if kind in ("slice", "index"):
            if x.ndim == 0:
                return False
            n = x.shape[arg[-1] % x.ndim]
            if kind == "index" and not -n <= arg[0] < n:
                return False
            if kind == "slice":
                start = arg[0] + n if arg[0] < 0 else arg[0]
                stop = n if arg[1] is None else arg[1] + n if arg[1] < 0 else arg[1]
                if not 0 <= start < stop <= n:
                    return False
        x = _apply([step], x)
    return True


def _vjp_by_hand(chain, x, g, xp=jnp):
    """The cotangent of the buffer ``x`` for a cotangent ``g`` of ``chain(x)``, by hand.

    Each step pulled back in reverse order: a transpose transposes back, a reshape
    reshapes to the shape it got, a cast casts back to the dtype it got, a scale
    scales, a slice or an index puts the cotangent into its part of zeros of the
    shape it got. ``xp``: ``jnp`` or ``np``, the library the cotangents are in.
    """
    inputs = []  # (shape, dtype) each step received
    y = np.zeros(np.shape(x), np.asarray(x).dtype)
    for step in chain:
        inputs.append((y.shape, y.dtype))
        y = _apply([step], y)
    g = xp.asarray(g)
    for (kind, *arg), (shape, dtype) in zip(reversed(chain), reversed(inputs)):
        if kind == "T":
            g = g.transpose()
        elif kind == "reshape":
            g = g.reshape(shape)
        elif kind == "astype":
            g = g.astype(dtype)
        elif kind == "scale":
            g = g * arg[0]
        elif xp is np:  # slice, index
            out = np.zeros(shape, g.dtype)
            out[_where(kind, arg, len(shape))] = g
            g = out
        else:
            g = jnp.zeros(shape, g.dtype).at[_where(kind, arg, len(shape))].set(g)
    return g


def _has_cast_to_half(chain):
    return any(kind == "astype" and arg[0] in ("float16", "bfloat16") for kind, *arg in chain)


def _half(views):
    """Whether a view's chain casts to a 16-bit float (its rounding then bounds the gradients)."""
    return any(_has_cast_to_half(chain) for *_, chain in views)


F32_RTOL = F32_ATOL = 1e-5  # float32 gradients: a few hundred roundings of sums of sines
HALF_TOL = 2 * float(jnp.finfo(jnp.float16).eps)  # one float16 rounding, placed differently


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
        # a chain whose slices and indices fit every leaf it is applied to
        value = _resolve(tree, table, ref, [])
        shapes = [leaf[2].shape for leaf in jax.tree.leaves(value, is_leaf=_is_leaf)]
        fitting = [c for c in TRANSFORMS if all(_fits(c, shape) for shape in shapes)]
        table[target] = (ref, draw(hs.sampled_from(fitting)))
    canonical = tree
    positions = node_paths(leaves)
    for target, (ref, chain) in table.items():
        # refs are scoped (innermost subtree first): write the one that names `ref`, a
        # climbing one where every scoped spelling is shadowed
        written = ref_to(ref, target, positions)
        # ref_to sees nodes only: no inner scope may reach a scoped ref through a view either
        for k in range(len(target) - 1, 0, -1) if written.up is None else ():
            p = target[:k] + written.keys
            assume(not any(p[:m] in table for m in range(1, len(p) + 1)))
        tied = st.Tied(written.keys, _st_chain(chain), up=written.up)
        canonical = _set(canonical, target, tied)
    return tree, canonical, table


def _is_leaf(x):
    return isinstance(x, tuple)


def _resolve(tree, table, path, chain):
    """The value at ``path`` followed by ``chain``: ``(buffer path, whole chain, NumPy value)``
    at each leaf, by plain recursion over the table."""
    if path in table:
        ref, c = table[path]
        return _resolve(tree, table, ref, c + chain)
    node = _get(tree, path)
    if isinstance(node, dict):
        return {k: _resolve(tree, table, path + (k,), chain) for k in node}
    if isinstance(node, list):
        return [_resolve(tree, table, path + (str(i),), chain) for i in range(len(node))]
    return (path, chain, _np_value(chain, node))


def _reference(tree, table):
    """Materialize by recursion over the generated table (NumPy values); also list each view."""
    views = []  # (target leaf path, buffer path, chain)

    def build(path):
        if path in table:
            ref, c = table[path]
            v = _resolve(tree, table, ref, list(c))
            for kp, (bpath, chain, _) in jax.tree_util.tree_leaves_with_path(v, is_leaf=_is_leaf):
                views.append((path + _names(kp), bpath, chain))
            return jax.tree.map(lambda x: x[2], v, is_leaf=_is_leaf)
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
        pulled = _vjp_by_hand(chain, _get(tree, bpath), _get(g_untied, target))
        reference[bpath] = reference[bpath] + pulled.astype(jnp.float32)

    g_tree = jax.grad(lambda t: _loss(st.materialize(t)))(canonical)
    assert jax.tree.structure(g_tree) == jax.tree.structure(canonical)
    flat, re = st.destructure(canonical)
    g_flat = re.canonical(jax.grad(lambda v: _loss(re(v)))(flat))
    g_arg = re.canonical(jax.jit(jax.grad(lambda v, r: _loss(r(v))))(flat, re))
    # a float16 view rounds its cotangent; jit may fuse the chain and round at another
    # step, so the gradient through it agrees to a float16 rounding only
    rtol, atol = (HALF_TOL, HALF_TOL) if _half(views) else (F32_RTOL, F32_ATOL)
    for g in (g_tree, g_flat, g_arg):
        for kp, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
            np.testing.assert_allclose(leaf, reference[_names(kp)], rtol=rtol, atol=atol)


@given(tied_trees())
def test_ties_survive_tree_map(case):
    tree, canonical, table = case
    calls = []
    out = jax.tree.map(lambda x: calls.append(1) or x * 2, canonical)
    assert jax.tree.structure(out) == jax.tree.structure(canonical)
    # one call per buffer: the tree's leaves minus the tied positions, counted by hand
    buffers = [
        p
        for p in (_names(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
        if p not in table
    ]
    assert len(calls) == len(buffers)
    for kp, x in jax.tree_util.tree_flatten_with_path(out)[0]:
        np.testing.assert_array_equal(x, 2 * np.asarray(_get(tree, _names(kp))))
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
        assert g.views["/".join(target)].transform == _st_chain(chain)
