"""Refs that climb: ``Tied("../0")`` reaches an outer position past a nearer one of the same name.

References are independent of the resolver: the same model written by hand on the unique
buffers (gradients, optimizer steps), object identity of materialized positions, and the
positions chosen by the test itself.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from hypothesis import strategies as hst

import sharetree as st


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Foo:
    """Functors.jl's test struct: two fields, nested."""

    x: object
    y: object


def test_optimisers_jl_tied_tuples_with_momentum():
    # Optimisers.jl "tied weights": (twice, (copy, twice)), momentum steps
    twice = jnp.array([1.0, 2.0])
    tree = (twice, (jnp.array([1.0, 2.0]), twice))
    tied = st.tie_identical(tree)
    assert tied[1][1] == st.Tied("../0") == st.Tied(("0",), up=1)
    assert isinstance(tied[1][0], jax.Array)  # the copy stays its own buffer
    m = st.materialize(tied)
    assert m[1][1] is m[0] and m[1][0] is not m[0]

    def loss(p):
        a, (b, c) = st.materialize(p)
        return jnp.sum(a * jnp.array([1.0, 3.0])) + jnp.sum(b**2) + jnp.sum(c * c * c)

    def loss_by_hand(a, b):  # the same model on the two unique buffers
        return jnp.sum(a * jnp.array([1.0, 3.0])) + jnp.sum(b**2) + jnp.sum(a * a * a)

    opt = optax.sgd(0.01, momentum=0.9)
    state = opt.init(tied)
    assert len(jax.tree.leaves(state)) == 2  # one momentum per buffer
    ref_params = (twice, jnp.array([1.0, 2.0]))
    ref_state = opt.init(ref_params)
    for _ in range(3):
        g = jax.grad(loss)(tied)
        assert g[1][1] == st.Tied("../0")
        updates, state = opt.update(g, state, tied)
        tied = optax.apply_updates(tied, updates)
        rg = jax.grad(loss_by_hand, argnums=(0, 1))(*ref_params)
        ru, ref_state = opt.update(rg, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ru)
        np.testing.assert_allclose(tied[0], ref_params[0], rtol=1e-6)
        np.testing.assert_allclose(tied[1][0], ref_params[1], rtol=1e-6)


def test_functors_jl_sharing_with_fmap_to_float64():
    # Functors.jl: m1 = Foo(shared, Foo(copy, Foo(shared, copy))); y.x shadows the root's x
    shared, copy = np.ones(3, np.float32), np.ones(3, np.float32)
    m1 = Foo(shared, Foo(copy, Foo(shared, copy)))
    tied = st.tie_identical(m1)
    assert tied.y.y.x == st.Tied("../../x")
    assert tied.y.y.y == st.Tied("../x")  # the copy, one level up
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: np.asarray(a, np.float64), tied)  # fmap to float
        assert wide.y.y.x == st.Tied("../../x")
        m = st.materialize(wide)
    assert m.y.y.x is m.x and m.y.y.y is m.y.x and m.x.dtype == np.float64
    assert m.y.x is not m.x


def test_the_spellings_and_what_each_reads():
    a, b = np.zeros(2), np.ones(2)
    for ref in ("../0", ("0",)):
        up = None if isinstance(ref, str) else 1
        m = st.materialize((a, (b, st.Tied(ref, up=up))))
        assert m[1][1] is a
    assert st.materialize((a, (b, st.Tied("./0"))))[1][1] is b  # exactly the nearest
    assert repr(st.Tied("../0")) == "Tied('../0')"
    assert repr(st.Tied(("a/b",), up=2)) == "Tied(('a/b',), up=2)"
    assert st.Tied("../../x").up == 2 and st.Tied("./x").up == 0 and st.Tied("x").up is None
    # a key named '..' is written as a tuple of keys, never as a climb
    assert st.materialize({"..": {"w": a}, "v": st.Tied(("..", "w"))})["v"] is a


def test_a_plain_ref_that_a_nearer_name_shadows_warns_and_says_both():
    a, b = np.zeros(2), np.ones(2)
    tree = (a, (b, st.Tied("0")))
    with pytest.warns(UserWarning) as w:
        m = st.materialize(tree)
    assert m[1][1] is b  # the lexical rule is kept
    text = str(w[0].message)
    assert text.startswith("[E165]") and "'1/1'" in text and "'1/0'" in text
    assert "'../0'" in text and "'./0'" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.materialize((a, (b, st.Tied("./0"))))  # said exactly: no warning
        st.materialize({"enc": a, "dec": {"w": st.Tied("enc")}})  # nothing shadowed


def test_climbing_past_the_root_or_in_the_middle_is_an_error():
    a = np.zeros(2)
    with raises("E163", "'1/0'", "'../../0'", "2"):
        st.materialize((a, (st.Tied("../../0"),)))
    with raises("E15", "'a/../b'", cls=st.TieTypeError if False else st.TieError):
        st.Tied("a/../b")
    with raises("E15", "up", "-1"):
        st.Tied("x", up=-1)
    with raises("E1", "'../wq'", "closest", "'w'"):
        st.materialize({"w": a, "sub": {"v": st.Tied("../wq")}})


def test_wrapping_a_tree_keeps_what_a_climbing_ref_reads():
    a, b = np.zeros(2), np.ones(2)
    tied = st.tie_identical((a, (b, a)))
    for wrap in (lambda t: {"params": t}, lambda t: [t, b], lambda t: Foo(t, (t,))):
        m = st.materialize(wrap(tied))
        inner = jax.tree.leaves(m, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2)[0]
        assert inner[1][1] is inner[0] and inner[1][0] is not inner[0]


def test_untie_then_tie_back_find_ties_then_tie_save_then_load(tmp_path):
    w, c = np.arange(4.0).reshape(2, 2), np.arange(4.0).reshape(2, 2) + 10
    tree = (w, (c, w.T.copy(), {"0": w}))
    found = st.find_ties(tree)
    assert found == {"1/1": st.Tied("0", st.T), "1/2/0": st.Tied("0")}  # refs from the root
    tied = st.tie(tree, found)
    assert tied[1][1] == st.Tied("../0", st.T) and tied[1][2]["0"] == st.Tied("../../0")
    m = st.materialize(tied)
    assert m[1][2]["0"] is w and np.array_equal(m[1][1], w.T)
    back = st.tie(st.untie(tied), found)
    assert back == tied
    st.save(tmp_path / "t.safetensors", tied)
    loaded = st.load(tmp_path / "t.safetensors")
    assert loaded[1][1] == st.Tied("../0", st.T) and loaded[1][2]["0"] == st.Tied("../../0")
    np.testing.assert_array_equal(st.materialize(loaded)[1][1], w.T)


NAMES = hst.sampled_from(["x", "w", "0", "1"])


@hst.composite
def _shadowed_trees(draw):
    """A nested dict tree reusing a few names at every depth, and positions to share at."""

    def node(depth):
        if depth == 0 or draw(hst.booleans()):
            return None  # a leaf slot
        keys = draw(hst.lists(NAMES, min_size=1, max_size=3, unique=True))
        return {k: node(depth - 1) for k in keys}

    shape = node(4) or {"x": None}
    slots = []

    def walk(t, path):
        for k, v in t.items():
            if v is None:
                slots.append((*path, k))
            else:
                walk(v, (*path, k))

    walk(shape, ())
    groups = draw(hst.lists(hst.integers(0, 2), min_size=len(slots), max_size=len(slots)))
    return shape, slots, groups


@settings(max_examples=examples(150), deadline=None)
@given(_shadowed_trees())
def test_tie_identical_recovers_every_sharing_on_shadowed_trees(drawn):
    shape, slots, groups = drawn
    arrays = [np.full(2, float(g)) for g in range(3)]
    own = iter(range(100, 200))

    def fill(t, path):
        return {
            k: fill(v, (*path, k))
            if isinstance(v, dict)
            else (
                arrays[groups[slots.index((*path, k))]]
                if groups[slots.index((*path, k))] < 2
                else np.full(2, float(next(own)))
            )
            for k, v in t.items()
        }

    tree = fill(shape, ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the refs written never need the shadowing warning
        tied = st.tie_identical(tree)
        for wrapped in (tied, {"outer": tied}, [tied]):
            m = st.materialize(wrapped)
            inner = m if wrapped is tied else (m["outer"] if isinstance(m, dict) else m[0])
            flat_in = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
            flat_out = dict(jax.tree_util.tree_flatten_with_path(inner)[0])
            assert flat_in.keys() == flat_out.keys()
            for k, x in flat_in.items():
                assert flat_out[k] is x  # each position reads exactly its own array


def _tampered_climb(tmp_path, up, version=None):
    import json

    from _files import read_raw, write_with_metadata

    good = tmp_path / "good.safetensors"
    st.save(good, (np.zeros(2), (np.ones(2), st.Tied("../0"))))
    tensors, meta = read_raw(good)
    assert meta["sharetree.format_version"] == "3"  # an older reader refuses it
    tree = json.loads(meta["sharetree.tree"])
    tie = tree["children"][1]["children"][1]
    assert tie["t"] == "tied" and tie["up"] == 1
    tie["up"] = up
    meta["sharetree.tree"] = json.dumps(tree)
    if version is not None:
        meta["sharetree.format_version"] = version
    bad = tmp_path / "bad.safetensors"
    write_with_metadata(bad, tensors, meta)
    return bad


def test_a_file_whose_ref_climbs_past_the_root_or_is_malformed(tmp_path):
    with raises("E163", "'1/1'", "'../../../0'", "1 level"):
        st.load(_tampered_climb(tmp_path, 3))
    with raises("E29", "bad.safetensors", "'1/1'", "'up'", "-1"):
        st.load(_tampered_climb(tmp_path, -1))
    with raises("E29", "bad.safetensors", "'up'", "version 2"):
        st.load(_tampered_climb(tmp_path, 1, version="2"))
    sibling = st.materialize(st.load(_tampered_climb(tmp_path, 0)))  # './0': '1/0'
    np.testing.assert_array_equal(sibling[1][1], np.ones(2))
    with raises("E2", "'0'", "'1'"):  # exact refs that loop: the cycle check holds
        st.materialize({"0": st.Tied("./1"), "1": st.Tied("./0"), "w": np.ones(2)})
    loaded = st.load(_tampered_climb(tmp_path, 1))
    assert loaded[1][1] == st.Tied("../0")


def test_a_file_without_climbs_keeps_its_older_version(tmp_path):
    from _files import read_raw

    st.save(tmp_path / "a.safetensors", {"enc": np.ones(2), "dec": st.Tied("enc")})
    assert read_raw(tmp_path / "a.safetensors")[1]["sharetree.format_version"] == "1"


def test_nnx_split_takes_a_climbing_ref_as_the_path_it_names():
    nnx = pytest.importorskip("flax.nnx")
    import sharetree.nnx

    class Pair(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(1))

    m = Pair()
    climbed = sharetree.nnx.split(m, ties={"b/kernel": st.Tied("../a/kernel", st.T)})
    rooted = sharetree.nnx.split(m, ties={"b/kernel": st.Tied("a/kernel", st.T)})
    assert jax.tree.structure(climbed) == jax.tree.structure(rooted)
    with raises("E163", "'b/kernel'", "climbs 3"):
        sharetree.nnx.split(m, ties={"b/kernel": st.Tied("../../../a/kernel")})


def test_a_foreign_files_ties_keep_their_climb(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    save_file({"embed": np.arange(6.0).reshape(2, 3)}, str(path))
    out = st.load(path, ties={"head": st.Tied("./embed", st.T)})
    np.testing.assert_array_equal(st.materialize(out)["head"], np.arange(6.0).reshape(2, 3).T)
    with raises("E163", "'head'", "'../embed'"):
        st.load(path, ties={"head": st.Tied("../embed", st.T)})


def test_flax_tied_takes_a_climbing_ref_between_partition_boxes():
    nn = pytest.importorskip("flax.linen")
    import sharetree.flax

    class Lm(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.normal(), ("vocab", "embed"))
            e = self.param("embed", init, (8, 4))
            head = self.param(
                "head", nn.with_partitioning(nn.initializers.normal(), ("embed", "vocab")), (4, 8)
            )
            return e[x] @ head

    climbed = sharetree.flax.tied(Lm(), {"head": st.Tied("./embed", st.T)})
    rooted = sharetree.flax.tied(Lm(), {"head": st.Tied("embed", st.T)})
    x = jnp.array([1, 2])
    a = climbed.init(jax.random.key(0), x)
    b = rooted.init(jax.random.key(0), x)
    assert a["params"]["head"] == st.Tied("./embed", st.T)
    np.testing.assert_array_equal(climbed.apply(a, x), rooted.apply(b, x))
