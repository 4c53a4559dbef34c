"""Views into part of a buffer: ``st.slice`` and ``st.index``.

Every value is checked against NumPy indexing written by hand, every gradient
against the same model written by hand with the slices in its forward code
(``jnp`` indexing of the one buffer), or against the untied copies' gradients
summed back into the buffer by hand.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _examples import examples
from _raises import message, raises
from hypothesis import given, settings
from hypothesis import strategies as hs
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

import sharetree as st

V, PAD, D = 5, 8, 3  # logical vocabulary, padded rows, width
EMBED = np.arange(PAD * D, dtype=np.float32).reshape(PAD, D) / 10.0
X = np.linspace(-1.0, 1.0, 2 * D, dtype=np.float32).reshape(2, D)


def padded_lm():
    return {"embed": EMBED, "head": st.Tied("embed", st.slice(0, V) >> st.T)}


def loss(m):
    """Logits of X through the head (D -> V), plus a use of the whole table."""
    return jnp.sum(jnp.tanh(X @ m["head"])) + 0.5 * jnp.sum(m["embed"] ** 2)


def loss_by_hand(embed):
    """The same model, the slice written in its forward code: the reference."""
    return jnp.sum(jnp.tanh(X @ embed[:V].T)) + 0.5 * jnp.sum(embed**2)


# --- building: Python semantics, refused when built --------------------------------


@settings(max_examples=examples(150), deadline=None)
@given(
    shape=hs.lists(hs.integers(1, 5), min_size=1, max_size=3),
    data=hs.data(),
)
def test_slice_and_index_are_numpy_indexing(shape, data):
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    axis = data.draw(hs.integers(-len(shape), len(shape) - 1))
    n = shape[axis]
    start = data.draw(hs.integers(-n, n - 1))
    lo = start % n
    stop = data.draw(hs.one_of(hs.none(), hs.integers(lo + 1, n), hs.integers(lo + 1 - n, 0)))
    if stop == 0:
        stop = None  # 0 from the end is no entry at all
    t = st.slice(start, stop, axis=axis)
    where = [slice(None)] * len(shape)
    where[axis] = slice(start, stop)
    expected = a[tuple(where)]
    np.testing.assert_array_equal(t(a), expected)
    np.testing.assert_array_equal(t.numpy(a), expected)
    assert t.abstract(jax.ShapeDtypeStruct(a.shape, a.dtype)).shape == expected.shape
    assert st.transform_from_spec(t.spec()) == t
    i = data.draw(hs.integers(-n, n - 1))
    where[axis] = i
    np.testing.assert_array_equal(st.index(i, axis=axis)(a), a[tuple(where)])
    np.testing.assert_array_equal(st.index(i, axis=axis).numpy(a), a[tuple(where)])


@pytest.mark.parametrize("start, stop", [(3, 3), (5, 2), (-1, -3), (-2, -2)])
def test_empty_or_reversed_ranges_are_refused_when_built(start, stop):
    with raises("E72", f"st.slice({start}, {stop}", f"range {start}:{stop}", "e.g. st.slice("):
        st.slice(start, stop)


@pytest.mark.parametrize(
    "make, facts",
    [
        (lambda: st.slice(0.5, 2), ["st.slice(0.5, 2, axis=0): start", "float 0.5"]),
        (lambda: st.slice(0, "2"), ["stop", "str '2'"]),
        (lambda: st.slice(0, 2, axis=None), ["axis", "NoneType None"]),
        (lambda: st.slice(True, 2), ["start", "bool True"]),
        (lambda: st.index(1.0), ["st.index(1.0, axis=0): i", "float 1.0"]),
        (lambda: st.index(1, axis="0"), ["axis", "str '0'"]),
    ],
)
def test_non_integers_are_type_errors(make, facts):
    with raises("E73", *facts, "e.g. st.", cls=st.TieTypeError) as info:
        make()
    assert isinstance(info.value, TypeError)


def test_reprs_and_spec_round_trip():
    assert repr(st.slice(0, 151851) >> st.T) == "slice(0, 151851) >> T"
    assert repr(st.slice(-2, None, axis=1)) == "slice(-2, None, axis=1)"
    assert repr(st.index(3)) == "index(3)" and repr(st.index(-1, axis=2)) == "index(-1, axis=2)"
    assert st.slice(0, 4) == st.slice(np.int64(0), 4) and hash(st.slice(0, 4)) == hash(
        st.slice(0, 4)
    )
    for t in (st.slice(1, None, axis=1) >> st.T, st.index(2) >> st.scale(2.0)):
        assert st.transform_from_spec(t.spec()) == t


# --- resolution: outside the buffer ------------------------------------------------


@pytest.mark.parametrize(
    "t, what",
    [
        (st.slice(0, 9), ["range 0:9 of axis 0 (size 8) is outside it", "within 0:8"]),
        (st.slice(-9, None), ["range -9: of axis 0 (size 8) is outside it"]),
        (st.slice(6, -3), ["range 6:-3 of axis 0 (size 8) is empty"]),
        (st.index(8), ["entry 8 is outside axis 0 (size 8)", "between -8 and 7"]),
        (st.index(-9), ["entry -9 is outside axis 0"]),
        (st.slice(0, 2, axis=2), ["needs axis 2", "shape (8, 3) (2 axes)", "between -2 and 1"]),
        (st.T >> st.index(0, axis=-3), ["needs axis -3"]),
    ],
)
def test_outside_the_buffer_is_a_tie_error_naming_the_view_shape_and_fix(t, what):
    tree = {"embed": EMBED, "head": st.Tied("embed", t)}
    flat, re_ = st.destructure(tree)  # the views are computed by restructure
    for resolve in (st.materialize, lambda tr: st.canonicalize(tr).views, lambda _: re_(flat)):
        with raises("E71", "view 'head'", "float32[8, 3]", *what, "Fix:"):
            resolve(tree)
    with raises("E71", "'head'", *what):
        st.tie({"embed": EMBED, "head": np.zeros((2, 2))}, {"head": tree["head"]})


@pytest.mark.parametrize("t", [st.index(0), st.index(-1), st.slice(0, 1), st.slice(-1, None)])
def test_a_view_of_an_empty_axis_says_the_axis_is_empty_not_a_range_that_cannot_fit(t):
    tree = {"embed": np.zeros((0, 3), np.float32), "head": st.Tied("embed", t)}
    fix = "Fix: refer to a buffer whose axis is not empty"
    with raises("E71", "view 'head'", "(size 0)", fix) as info:
        st.materialize(tree)
    assert "0:0" not in message(info.value) and "between 0 and -1" not in message(info.value)


# --- values and gradients ----------------------------------------------------------


def test_padding_rows_get_no_gradient_from_the_head():
    head_only = jax.grad(lambda t: jnp.sum(jnp.tanh(X @ st.materialize(t)["head"])))(padded_lm())
    g = np.asarray(head_only["embed"])
    assert np.all(g[V:] == 0.0) and np.all(g[:V] != 0.0)
    by_hand = jax.grad(lambda e: jnp.sum(jnp.tanh(X @ e[:V].T)))(EMBED)
    np.testing.assert_allclose(g, by_hand, rtol=1e-6)
    g = jax.grad(lambda t: loss(st.materialize(t)))(padded_lm())
    np.testing.assert_allclose(g["embed"], jax.grad(loss_by_hand)(EMBED), rtol=1e-6)
    assert g["head"] == padded_lm()["head"]


def test_the_flat_path_reverse_forward_hvp_and_vmap_match_the_model_by_hand():
    flat, re_ = st.destructure(padded_lm())
    assert flat.shape == (PAD * D,)
    f = jax.jit(lambda v: loss(re_(v)))
    ref = lambda v: loss_by_hand(v.reshape(PAD, D))  # noqa: E731
    np.testing.assert_allclose(f(flat), ref(flat), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(flat), jax.grad(ref)(flat), rtol=1e-5)
    tangent = jnp.cos(jnp.arange(flat.size, dtype=jnp.float32))
    _, jvp = jax.jvp(f, (flat,), (tangent,))
    np.testing.assert_allclose(jvp, jax.jvp(ref, (flat,), (tangent,))[1], rtol=1e-5)
    hvp = jax.jvp(jax.grad(f), (flat,), (tangent,))[1]
    np.testing.assert_allclose(hvp, jax.jvp(jax.grad(ref), (flat,), (tangent,))[1], rtol=1e-4)
    batch = jnp.stack([flat, 2 * flat])
    np.testing.assert_allclose(jax.vmap(f)(batch), jax.vmap(ref)(batch), rtol=1e-6)
    np.testing.assert_array_equal(re_(flat)["head"], EMBED[:V].T)


def test_grad_by_use_gives_each_use_in_the_buffers_shape_zero_outside_its_part():
    by_use = st.grad_by_use(loss)(padded_lm())["embed"]
    head = np.asarray(by_use["head"])
    assert head.shape == (PAD, D) and np.all(head[V:] == 0.0)
    by_hand = jax.grad(lambda e: jnp.sum(jnp.tanh(X @ e[:V].T)))(EMBED)
    np.testing.assert_allclose(head, by_hand, rtol=1e-6)
    np.testing.assert_allclose(by_use["embed"], EMBED, rtol=1e-6)  # d(0.5 e^2) = e


def test_a_buffer_read_only_through_views_fused_qkv_and_overlapping_views():
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((D, 3 * D)).astype(np.float32)
    tree = {
        "qkv": qkv,
        **{n: st.Tied("qkv", st.slice(k * D, (k + 1) * D, axis=1)) for k, n in enumerate("qkv")},
        "overlap": st.Tied("qkv", st.slice(D - 1, 2 * D + 1, axis=1) >> st.T),
    }

    def attn(m):
        s = (X @ m["q"]) @ (X @ m["k"]).T
        return jnp.sum(jax.nn.softmax(s) @ (X @ m["v"])) + jnp.sum(jnp.sin(m["overlap"]))

    def attn_by_hand(w):
        q, k, v = w[:, :D], w[:, D : 2 * D], w[:, 2 * D :]
        s = (X @ q) @ (X @ k).T
        return jnp.sum(jax.nn.softmax(s) @ (X @ v)) + jnp.sum(jnp.sin(w[:, D - 1 : 2 * D + 1].T))

    m = st.materialize(tree)
    for k, n in enumerate("qkv"):
        np.testing.assert_array_equal(m[n], qkv[:, k * D : (k + 1) * D])
    np.testing.assert_allclose(attn(m), attn_by_hand(qkv), rtol=1e-6)
    g = jax.grad(lambda t: attn(st.materialize(t)))(tree)
    np.testing.assert_allclose(g["qkv"], jax.grad(attn_by_hand)(qkv), rtol=1e-5, atol=1e-6)
    flat, re_ = st.destructure(tree)
    assert flat.size == qkv.size  # the one buffer
    np.testing.assert_allclose(
        jax.grad(lambda v: attn(re_(v)))(flat).reshape(qkv.shape),
        jax.grad(attn_by_hand)(qkv),
        rtol=1e-5,
        atol=1e-6,
    )
    by_use = st.grad_by_use(attn)(tree)["qkv"]
    assert set(by_use) == {"qkv", "q", "k", "v", "overlap"}
    assert np.all(np.asarray(by_use["qkv"]) == 0.0)  # the buffer's own position is unused
    total = sum(np.asarray(x) for x in by_use.values())
    np.testing.assert_allclose(total, jax.grad(attn_by_hand)(qkv), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(by_use["q"])[:, D:] == 0.0)


def test_a_subtree_tie_indexes_every_array_of_a_scanned_stack():
    rng = np.random.default_rng(1)
    stack = {"w": rng.standard_normal((4, D, D)).astype(np.float32), "b": np.zeros((4, D))}
    tree = {"stack": stack, "extra": st.Tied("stack", st.index(3))}
    m = st.materialize(tree)
    np.testing.assert_array_equal(m["extra"]["w"], stack["w"][3])
    np.testing.assert_array_equal(m["extra"]["b"], stack["b"][3])

    def f(m):
        def layer(x, p):
            return jnp.tanh(x @ p["w"] + p["b"]), None

        y, _ = jax.lax.scan(layer, X, m["stack"])
        return jnp.sum(layer(y, m["extra"])[0])

    def f_by_hand(w, b):
        y = X
        for i in range(4):
            y = jnp.tanh(y @ w[i] + b[i])
        return jnp.sum(jnp.tanh(y @ w[3] + b[3]))

    g = jax.grad(lambda t: f(st.materialize(t)))(tree)
    gw, gb = jax.grad(f_by_hand, argnums=(0, 1))(stack["w"], stack["b"])
    np.testing.assert_allclose(g["stack"]["w"], gw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["stack"]["b"], gb, rtol=1e-5, atol=1e-6)


# --- optimizer state, boxes, shardings, files, display -------------------------------


def test_untie_state_carries_adam_moments_through_slices_and_indices():
    stack = np.arange(2 * PAD * D, dtype=np.float32).reshape(2, PAD, D) / 7.0
    tree = {
        "stack": stack,
        "head": st.Tied("stack", st.index(1) >> st.slice(0, V) >> st.T),
        "row": st.Tied("stack", st.index(-1, axis=1)),
    }
    opt = optax.adam(0.1)
    state = opt.init(tree)
    grads = {"stack": jnp.asarray(np.cos(stack)), "head": tree["head"], "row": tree["row"]}
    _, state = opt.update(grads, state, tree)
    new = st.untie_state(state, tree)
    mu, nu = np.asarray(state[0].mu["stack"]), np.asarray(state[0].nu["stack"])
    np.testing.assert_allclose(mu, 0.1 * np.cos(stack), rtol=1e-6)  # Adam by hand
    np.testing.assert_array_equal(new[0].mu["head"], mu[1, :V].T)
    np.testing.assert_array_equal(new[0].nu["head"], nu[1, :V].T)
    np.testing.assert_array_equal(new[0].mu["row"], mu[:, -1])
    untied = st.untie(tree)
    assert jax.tree.map(np.shape, new[0].mu) == jax.tree.map(np.shape, untied)


def test_shardings_by_path_of_a_tree_with_views_shards_the_buffer_only():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    abstract = {
        "embed": jax.ShapeDtypeStruct((PAD * 4, 8), jnp.float32),
        "head": st.Tied("embed", st.slice(0, 30) >> st.T),
        "qkv": jax.ShapeDtypeStruct((8, 24), jnp.float32),
        "q": st.Tied("qkv", st.slice(0, 8, axis=1)),
    }
    s = st.shardings_by_path(abstract, mesh, {"embed": P("model", None), "qkv": P(None, "model")})
    assert s["embed"].spec == P("model", None) and s["qkv"].spec == P(None, "model")
    assert s["head"] == abstract["head"] and s["q"] == abstract["q"]
    shapes = jax.eval_shape(st.materialize, abstract)
    assert shapes["head"].shape == (8, 30) and shapes["q"].shape == (8, 8)
    # on a real mesh: the buffers placed by their shardings, the views computed under jit
    mesh = jax.make_mesh((1,), ("model",))
    tree = {"embed": EMBED, "head": st.Tied("embed", st.slice(0, V) >> st.T)}
    s = st.shardings_by_path(tree, mesh, {"embed": P("model", None)})
    placed = jax.device_put(tree, s)
    assert placed["embed"].sharding == s["embed"] and placed["head"] == tree["head"]
    m = jax.jit(st.materialize, in_shardings=(s,))(placed)
    np.testing.assert_array_equal(m["head"], EMBED[:V].T)


def test_save_stores_each_buffer_once_and_the_views_in_metadata(tmp_path):
    tree = padded_lm()
    path = tmp_path / "lm.safetensors"
    st.save(path, tree)
    with safe_open(str(path), "np") as f:
        assert len(list(f.keys())) == 1  # the table, once
        header = f.metadata()
    assert '"name": "slice"' in "".join(header.values()) or "slice" in str(header)
    back = st.load(path)
    assert back["head"] == tree["head"]
    np.testing.assert_array_equal(back["embed"], EMBED)


def test_summary_dot_and_html_show_the_view_and_its_shape():
    tree = {
        "embed": jax.ShapeDtypeStruct((151936, 64), jnp.bfloat16),
        "head": st.Tied("embed", st.slice(0, 151851) >> st.T),
    }
    text = st.summary(tree)
    assert re.search(r"head\s+embed\s+slice\(0, 151851\) >> T\s+\(64, 151851\)", text), text
    dot = st.canonicalize(tree).to_dot()
    assert 'label="slice(0, 151851) >> T"' in dot and "[64, 151851]" in dot
    html = st.canonicalize(tree)._repr_html_()
    assert "slice(0, 151851) &gt;&gt; T" in html and "64, 151851" in html


def test_find_ties_finds_a_stored_slice():
    sd = {"embed": EMBED, "head": EMBED[:V].T.copy()}
    assert st.find_ties(sd, transforms=(st.identity, st.slice(0, V) >> st.T)) == {
        "head": st.Tied("embed", st.slice(0, V) >> st.T)
    }


def test_abstract_of_slice_and_index_does_not_trace():
    calls = []
    real = jax.eval_shape

    def spy(*a, **k):
        calls.append(a)
        return real(*a, **k)

    aval = jax.ShapeDtypeStruct((PAD, D), jnp.float32)
    jax.eval_shape = spy
    try:
        out = (st.slice(1, -1) >> st.T >> st.index(0)).abstract(aval)
    finally:
        jax.eval_shape = real
    assert out.shape == (PAD - 2,) and not calls


def test_flax_partition_boxes_slice_keeps_the_names_index_drops_the_indexed_one():
    nn = pytest.importorskip("flax.linen")
    from sharetree.flax import tied

    def box(*names):
        return nn.with_logical_partitioning(nn.initializers.normal(1.0), names)

    class Padded(nn.Module):
        last_names: tuple = ("embed", "mlp")

        @nn.compact
        def __call__(self, tokens):
            embed = self.param("embed", box("vocab", "embed"), (PAD, D))
            stack = self.param("stack", box("layers", "embed", "mlp"), (2, D, 4))
            last = self.param("last", box(*self.last_names), (D, 4))
            down = self.param("down", box("mlp", "embed"), (4, D))
            head = self.param("head", box("embed", "vocab"), (D, V))
            h = jnp.tanh(embed[tokens] @ stack[0]) @ down
            return jnp.tanh(h @ last) @ down @ head

    ties = {"head": st.Tied("embed", st.slice(0, V) >> st.T), "last": st.Tied("stack", st.index(1))}
    model = tied(Padded(), ties)
    tokens = jnp.array([[0, 4, 2]])
    variables = model.init(jax.random.key(0), tokens)
    params = variables["params"]
    assert params["head"] == ties["head"] and params["last"] == ties["last"]
    m = model.materialize(variables)["params"]
    assert m["head"].names == ("embed", "vocab")  # slice keeps, T permutes
    assert m["last"].names == ("embed", "mlp")  # index drops "layers"
    e, s, d = (np.asarray(params[k].value) for k in ("embed", "stack", "down"))
    h = np.tanh(e[np.asarray(tokens)] @ s[0]) @ d
    by_hand = np.tanh(h @ s[1]) @ d @ e[:V].T
    np.testing.assert_allclose(model.apply(variables, tokens), by_hand, rtol=1e-5, atol=1e-6)
    with raises("E42", "'last'", "('embed', 'mlp')"):
        tied(Padded(last_names=("mlp", "embed")), ties).init(jax.random.key(0), tokens)
