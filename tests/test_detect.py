import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from hypothesis import strategies as st_h

import sharetree as st


def test_tie_identical_ties_array_objects_only():
    w = jnp.ones((2, 2))
    n = np.zeros(3)
    tree = {"a": w, "b": [w, n], "c": n, "d": 1.0, "e": 1.0, "f": None, "g": "s", "h": "s"}
    out = st.tie_identical(tree)
    assert out["b"][0] == st.Tied("a") and out["c"] == st.Tied("b/1")
    assert out["d"] == 1.0 and out["e"] == 1.0 and out["h"] == "s"
    assert st.canonicalize(out).num_unique == 2 + 4  # w, n, two floats, two strings
    m = st.materialize(out)
    assert m["b"][0] is w and m["c"] is n


def test_tie_identical_leaves_equal_but_distinct_arrays_alone():
    tree = {"a": jnp.ones(2), "b": jnp.ones(2)}
    assert st.tie_identical(tree) is tree


def test_tie_identical_ref_shadowed_from_the_root():
    # 'x/y/v' holds the array at 'x/w'; the root's 'w' is another array and 'x/y/x/w' a
    # third, so 'x/w' and 'w' would each read another one or leave a reader guessing: the
    # ref climbs one level, to 'x', exactly
    a, b, c = np.zeros(3), np.arange(3.0), np.ones(3)
    tree = {"w": a, "x": {"w": b, "y": {"v": b, "x": {"w": c}}}}
    out = st.tie_identical(tree)
    assert out["x"]["y"]["v"] == st.Tied("../w")
    assert st.materialize(out)["x"]["y"]["v"] is b


def test_find_ties_refs_are_from_the_root_so_tie_takes_them_where_a_ref_is_shadowed():
    # 'x/y/v' equals the array at 'x/w'; the root's 'w' and 'x/y/x/w' are others
    a, b, c = np.zeros(3), np.arange(3.0), np.ones(3)
    tree = {"w": a, "x": {"w": b, "y": {"v": b.copy(), "x": {"w": c}}}}
    found = st.find_ties(tree)
    assert found == {"x/y/v": st.Tied("x/w")}  # the buffer's path, as tie's targets are written
    out = st.tie(tree, found)
    np.testing.assert_array_equal(st.materialize(out)["x"]["y"]["v"], b)
    # a buffer that no scoped ref written at the view can name: the ref climbs
    out = st.tie(t := {"a": b, "sub": {"a": c, "v": b.copy()}}, st.find_ties(t))
    assert out["sub"]["v"] == st.Tied("../a") and st.materialize(out)["sub"]["v"] is b


def test_tie_identical_first_in_flatten_order_is_buffer():
    w = jnp.arange(3.0)
    out = st.tie_identical({"z": w, "a": w})
    assert out["z"] == st.Tied("a") and out["a"] is w


def test_find_ties_identity_and_transpose_feed_tie():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(5, 3)).astype(np.float32)
    sd = {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb.copy(),
        "proj.weight": emb.T.copy(),
        "other": rng.normal(size=(5, 3)).astype(np.float32),
        "zeros_a": np.zeros(4),
        "zeros_b": np.zeros(4),
    }
    ties = st.find_ties(sd)
    assert ties == {
        "model.embed_tokens.weight": st.Tied("lm_head.weight"),
        "proj.weight": st.Tied("lm_head.weight", st.T),
    }
    tied = st.tie(sd, ties)
    m = st.materialize(tied)
    for k in sd:
        np.testing.assert_array_equal(m[k], sd[k])
    assert st.canonicalize(tied).num_unique == 4


def test_find_ties_atol():
    a = np.linspace(0, 1, 6).reshape(2, 3)
    sd = {"a": a, "b": a + 1e-7, "c": a.T + 1e-3}
    assert st.find_ties(sd) == {}
    assert st.find_ties(sd, atol=1e-6) == {"b": st.Tied("a")}
    assert st.find_ties(sd, atol=1e-2) == {"b": st.Tied("a"), "c": st.Tied("a", st.T)}


def test_find_ties_custom_transforms_and_slash_keys():
    a = np.arange(6.0)
    sd = {"x/y": a, "z": a.reshape(2, 3) * 1.0}
    ties = st.find_ties(sd, transforms=(st.reshape(2, 3),))
    assert ties == {"z": st.Tied(("x/y",), st.reshape(2, 3))}
    with raises("E13", "transpose", cls=st.TieTypeError):
        st.find_ties(sd, transforms=(np.transpose,))


def test_gradients_do_not_get_tied():
    # identical gradient objects mean nothing: grads of distinct params stay distinct positions
    p = {"a": jnp.ones(2), "b": jnp.ones(2)}
    g = jax.grad(lambda t: jnp.sum(t["a"] + t["b"]))(p)
    assert st.canonicalize(g).num_views == 0


def test_find_ties_atol_validated_and_nans_match_in_place():
    a = np.array([np.nan, 1.0, 2.0])
    sd = {"a": a, "b": a.copy()}
    assert st.find_ties(sd) == {"b": st.Tied("a")}
    assert st.find_ties(sd, atol=0.1) == {"b": st.Tied("a")}
    with raises("E55", "find_ties(atol=...)", "a number >= 0", "-1", "1e-6"):
        st.find_ties(sd, atol=-1)
    with raises("E55", "find_ties(atol=...)", "str '0'", cls=st.TieTypeError):
        st.find_ties(sd, atol="0")


def test_find_ties_computes_each_view_once():
    calls = []

    def counting(x):
        calls.append(1)
        return x * 2.0

    rng = np.random.default_rng(0)
    sd = {f"w{i:02d}": rng.normal(size=(3, 4)) for i in range(30)}
    sd["w30"] = sd["w07"] * 2.0
    for atol in (0.0, 1e-9):
        calls.clear()
        ties = st.find_ties(sd, transforms=(st.identity, st.fn(counting)), atol=atol)
        assert ties == {"w30": st.Tied("w07", st.fn(counting))}
        assert len(calls) == 30  # once per buffer (the tied w30 is no buffer), not per pair


def test_find_ties_fingerprint_never_replaces_the_full_compare():
    a = np.random.default_rng(1).normal(size=100_000).astype(np.float32)
    b = a.copy()
    b[1] += 1.0  # index 1 is not among the sampled positions of 100,000 elements
    b2 = a.copy()
    b2[-2] = np.nextafter(b2[-2], np.float32(np.inf))
    assert st.find_ties({"a": a, "b": b, "c": b2}) == {}
    assert st.find_ties({"a": a, "b": b, "c": b2}, atol=1e-6) == {"c": st.Tied("a")}
    assert st.find_ties(
        {"a": a, "b": a.copy(), "c": a.reshape(200, 500).T.copy()},
        transforms=(st.identity, st.reshape(500, 200), st.T),
    ) == {
        "b": st.Tied("a"),
    }


def _reference_find_ties(sd, transforms, atol):
    """The definition, pair by pair: a later leaf equal to transform(an earlier buffer)."""
    found, buffers = {}, []
    for k, a in sd.items():  # sorted keys = flatten order of these dicts
        if a.size <= 1 or np.all(a == a.flat[0]):
            continue
        hit = None
        for bk, b in buffers:
            for t in transforms:
                v = np.asarray(t(b))
                if (
                    v.shape == a.shape
                    and v.dtype == a.dtype
                    and (
                        np.array_equal(v.view(np.uint64), a.view(np.uint64))
                        if atol == 0
                        else np.allclose(v, a, rtol=0, atol=atol, equal_nan=True)
                    )
                ):
                    hit = st.Tied(bk, t)
                    break
            if hit:
                break
        if hit:
            found[k] = hit
        else:
            buffers.append((k, a))
    return found


@settings(max_examples=examples(120), deadline=None)
@given(
    picks=st_h.lists(st_h.tuples(st_h.integers(0, 3), st_h.integers(0, 2)), min_size=1, max_size=8),
    atol=st_h.sampled_from([0.0, 1e-3]),
)
def test_find_ties_matches_the_pairwise_definition(picks, atol):
    rng = np.random.default_rng(len(picks))
    base = [
        rng.normal(size=(2, 3)),
        rng.normal(size=(3, 2)),
        rng.normal(size=(2, 3)),
        np.round(rng.normal(size=(3, 3))),
    ]
    ops = [lambda x: x, lambda x: x.T.copy(), lambda x: x + 1e-4]
    sd = {f"k{i}": ops[o](base[b]) for i, (b, o) in enumerate(picks)}
    sd = dict(sorted(sd.items()))
    transforms = (st.identity, st.T)
    with jax.enable_x64(True):
        expected = _reference_find_ties(sd, transforms, atol)
    assert st.find_ties(sd, transforms, atol=atol) == expected


def test_find_ties_compares_numeric_arrays_only_and_never_traced_ones():
    keys = jax.random.split(jax.random.key(0), 4)
    tree = {
        "k1": keys, "k2": keys,  # PRNG keys have no NumPy form: not parameters, skipped
        "s1": np.array(["x", "y"]), "s2": np.array(["x", "y"]),  # strings: skipped
        "o1": np.array([1, None], object), "o2": np.array([1, None], object),
        "w": np.arange(4.0), "v": np.arange(4.0),
    }  # fmt: skip
    assert st.find_ties(tree) == {"w": st.Tied("v")}
    assert st.find_ties(tree, atol=0.1) == {"w": st.Tied("v")}
    with raises("E62", "find_ties: the leaf 'a'", "traced float32[3]", "outside jit"):
        jax.jit(st.find_ties)({"a": jnp.arange(3.0), "b": jnp.arange(3.0)})


@pytest.mark.parametrize("bad", [None, st.T, 3])
def test_find_ties_transforms_must_be_a_sequence(bad):
    with raises("E62", "transforms=", "a sequence of transforms", type(bad).__name__) as info:
        st.find_ties({"a": np.arange(3.0)}, bad)
    assert isinstance(info.value, st.TieTypeError)


def test_find_ties_with_atol_compares_far_fewer_than_every_pair(monkeypatch):
    # distinct leaves of one shape: the samples of a bucket are compared in one vectorized
    # step per leaf, so no pair is compared one by one (there were n^2 / 2 compares: minutes
    # at a few thousand leaves)
    from sharetree import _match

    calls = []
    real = _match.close
    monkeypatch.setattr(_match, "close", lambda x, y, atol: calls.append(1) or real(x, y, atol))
    rng = np.random.default_rng(0)
    tree = {f"l{i:03d}": rng.standard_normal(16).astype(np.float32) for i in range(500)}
    tree["m"] = tree["l007"] + np.float32(1e-7)  # within atol of one leaf; and equal infinities
    tree["inf"], tree["inf2"] = np.array([np.inf, 1.0, np.nan]), np.array([np.inf, 1.0, np.nan])
    tree["bf"] = jnp.arange(4, dtype=jnp.bfloat16)
    tree["bg"] = jnp.arange(4, dtype=jnp.bfloat16).at[2].add(jnp.bfloat16(0.0078125))
    found = st.find_ties(tree, atol=1e-2)
    assert found == {"bg": st.Tied("bf"), "inf2": st.Tied("inf"), "m": st.Tied("l007")}
    assert len(calls) <= 10, len(calls)
