"""label_by_path / mask_by_path: label and mask trees for optax, built from path patterns."""

import fnmatch
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _raises import raises

import sharetree as st
from sharetree._paths import keypath_to_path


def _tree():
    return {
        "embed": {"embedding": np.ones((7, 4), np.float32)},
        "blocks": [
            {"attn": {"kernel": np.ones((4, 4)), "bias": np.zeros(4)}, "ln": {"scale": np.ones(4)}},
            {"attn": {"kernel": np.ones((4, 4)), "bias": np.zeros(4)}, "ln": {"scale": np.ones(4)}},
        ],
        "head": {"kernel": st.Tied("embed/embedding", st.T), "bias": np.zeros(7)},
    }


def _reference_labels(tree, rules, default):
    """Independent reference: test every '/'-prefix of each leaf path; the first rule wins."""
    out = {}
    for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = keypath_to_path(kp)
        names = ["/".join(path[: k + 1]) for k in range(len(path))]
        label = next(
            (lab for pat, lab in rules if any(fnmatch.fnmatchcase(n, pat) for n in names)), default
        )
        out["/".join(path)] = label
    return out


def _as_dict(tree):
    return {
        "/".join(keypath_to_path(kp)): x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def test_labels_follow_the_first_matching_pattern_and_keep_ties():
    tree = _tree()
    rules = [("*/bias", "no_decay"), ("*/ln/*", "no_decay"), ("blocks/0", "frozen"), ("*", "decay")]
    labels = st.label_by_path(tree, rules)
    assert labels["head"]["kernel"] == st.Tied("embed/embedding", st.T)
    assert jax.tree.structure(labels) == jax.tree.structure(tree)
    assert _as_dict(labels) == _reference_labels(tree, rules, None)
    assert labels["blocks"][0]["attn"]["kernel"] == "frozen"
    assert labels["blocks"][1]["attn"]["kernel"] == "decay"
    assert labels["blocks"][1]["attn"]["bias"] == "no_decay"


def test_a_pattern_naming_a_node_covers_every_leaf_below_it():
    tree = _tree()
    labels = st.label_by_path(tree, {"blocks": "body"}, default="other")
    assert _as_dict(labels) == _reference_labels(tree, [("blocks", "body")], "other")
    assert set(jax.tree.leaves(labels["blocks"])) == {"body"}
    assert labels["embed"]["embedding"] == "other"


def test_mask_by_path():
    tree = _tree()
    mask = st.mask_by_path(tree, ["*kernel", "embed"])
    expected = _reference_labels(tree, [("*kernel", True), ("embed", True)], False)
    assert _as_dict(mask) == expected
    assert mask["head"]["kernel"] == st.Tied("embed/embedding", st.T)
    assert st.mask_by_path(tree, "head/bias")["head"]["bias"] is True
    assert sum(jax.tree.leaves(st.mask_by_path(tree, "head/bias"))) == 1


def test_a_leaf_without_a_label_is_an_error_naming_it():
    with raises("E38", "leaf 'head/bias'", "['embed', 'blocks']", "'head/bias' or '*'"):
        st.label_by_path(_tree(), {"embed": "a", "blocks": "b"})


def test_a_pattern_that_matches_nothing_is_an_error_with_a_hint():
    with raises("E38", "pattern 'embd/*'", "closest existing path(s): 'embed"):
        st.label_by_path(_tree(), {"embd/*": "a"}, default="b")
    # a pattern that names only a tied position: the view shares its buffer's label
    with raises("E38", "pattern 'head/kernel'", "'head/kernel' (Tied('embed/embedding', T))"):
        st.mask_by_path(_tree(), "head/kernel")
    assert st.mask_by_path(_tree(), "head/kernel", strict=False)["head"]["bias"] is False
    assert (
        st.label_by_path(_tree(), {"nothing": "x"}, default="y", strict=False)["head"]["bias"]
        == "y"
    )


def test_bad_rules_and_patterns():
    with raises("E64", "(pattern, label) pairs", "('*', 'a', 'b')", cls=st.TieTypeError):
        st.label_by_path(_tree(), [("*", "a", "b")])
    with raises("E64", "mask_by_path", "str patterns", "found int 0", cls=st.TieTypeError):
        st.mask_by_path(_tree(), [0])


def test_paths_with_attribute_names_and_nnx_variables():
    nnx = pytest.importorskip("flax.nnx")

    class AE(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(3, 2, rngs=rngs)
            self.dec = nnx.Linear(2, 3, rngs=rngs)

    _, state = nnx.split(AE(nnx.Rngs(0)))
    state = st.tie(state, {"dec/kernel": st.Tied("enc/kernel", st.T)})
    # "enc/kernel" names the Variable; its leaf is "enc/kernel/value"
    mask = st.mask_by_path(state, "enc/kernel")
    assert _as_dict(mask) == {
        "dec/bias/value": False,
        "enc/bias/value": False,
        "enc/kernel/value": True,
    }
    assert mask["dec"]["kernel"] == st.Tied("enc/kernel", st.T)


@pytest.mark.parametrize("bad", [None, 1, 2.5, object()])
def test_rules_and_patterns_that_are_not_collections(bad):
    tree = {"a": np.zeros(2)}
    found = f"found {type(bad).__name__}"
    with raises("E64", "label_by_path", "{pattern: label}", found, cls=st.TieTypeError):
        st.label_by_path(tree, bad)
    with raises("E64", "mask_by_path", "str patterns", found, cls=st.TieTypeError):
        st.mask_by_path(tree, bad)


# -- a rule that matches a view but not its buffer is warned about -----------------


def _gpt():
    return {
        "embed": {"embedding": np.ones((8, 4), np.float32)},
        "block": {"kernel": np.ones((4, 4), np.float32), "bias": np.zeros(4, np.float32)},
        "head": {"kernel": st.Tied("embed/embedding", st.T)},
        "block2": st.Tied("block"),
    }


def test_mask_matching_a_tied_head_but_not_its_embedding_warns_naming_both():
    # nanoGPT's weight-decay question: "*kernel" means the output layer too, but the
    # output layer is a view of the embedding, which gets False
    with pytest.warns(UserWarning) as record:
        mask = st.mask_by_path(_gpt(), "*kernel")
    assert mask["embed"]["embedding"] is False and mask["block"]["kernel"] is True
    (w,) = [w for w in record if "mask_by_path" in str(w.message)]
    msg = str(w.message)
    assert msg.startswith("[E161] mask_by_path: pattern '*kernel'") and "1 view" in msg
    assert "'head/kernel' (Tied('embed/embedding', T) at 'head/kernel') would get True" in msg
    assert "buffer 'embed/embedding' gets False" in msg
    assert "Fix: write the rule for the buffer's path ('embed/embedding')" in msg
    assert w.filename == __file__  # points at the caller
    # "block2/kernel" is a view of "block/kernel", which "*kernel" matches: no word about it
    assert "block2" not in msg


def test_labels_and_shardings_warn_only_when_the_view_would_get_another_value():
    import warnings

    from jax.sharding import PartitionSpec as P

    tree = _gpt()
    with pytest.warns(UserWarning, match=r"^\[E161\]") as record:
        st.label_by_path(tree, {"head/*": "a", "*": "b"}, strict=False)
    (msg,) = [str(w.message) for w in record]
    assert "'head/*'" in msg and "1 view" in msg and "get 'a'" in msg and "gets 'b'" in msg
    mesh = jax.make_mesh((1,), ("model",))
    with pytest.warns(UserWarning, match=r"^\[E161\] shardings_by_path") as record:
        st.shardings_by_path(tree, mesh, {"head": P(None, "model"), "*": P()}, strict=False)
    (msg,) = [str(w.message) for w in record]
    assert "pattern 'head'" in msg and re.search(r"(P|PartitionSpec)\(None, 'model'\)", msg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.label_by_path(tree, {"*": "b"})  # a catch-all matches the buffers too
        st.label_by_path(tree, {"*kernel": "x", "embed/*": "x", "*": "y"})  # the same label
        st.mask_by_path(tree, ["*kernel", "embed/*"])
        st.shardings_by_path(tree, mesh, {"head": P(), "*": P()}, strict=False)  # the same spec
        st.shardings_by_path(tree, mesh, {"embed": P("model", None), "*": P()})


def test_strict_errors_say_why_a_rule_is_unused():
    p = {"enc": {"w": np.ones((5, 3)), "b": np.zeros(3)}, "dec": {"b": np.zeros(5)}}
    # shadowed: it matches leaves, but an earlier rule matches them first
    with raises("E38", "pattern 'enc'", "'*' matches 'enc/b' (and 1 more of its leaves) first"):
        st.label_by_path(p, [("*", "default"), ("enc", "encoder")])
    # a path inside a subtree view: the view it names and its buffer
    tied = {"l0": {"w": np.ones((2, 2)), "b": np.ones(2)}, "l1": st.Tied("l0"), "o": np.ones(1)}
    with raises("E38", "'l1/w' (in Tied('l0') at 'l1', a view of 'l0/w')"):
        st.mask_by_path(tied, "l1/w")


def test_the_pattern_a_missing_label_suggests_matches_that_leaf():
    # keys with '/' and fnmatch's brackets: the suggested pattern is escaped, and it works
    tree = {"a/b": {"c": np.ones(1)}, "w[0]": np.ones(1)}
    for leaf, pattern in ((("a/b", "c"), "a/b/c"), (("w[0]",), "w[[]0]")):
        with raises("E38", f"(e.g. {pattern!r} or '*')"):
            st.label_by_path({leaf[0]: tree[leaf[0]]}, {"zzz": 1}, strict=False)
    assert st.label_by_path(tree, {"a/b/c": "x", "w[[]0]": "y"}) == {"a/b": {"c": "x"}, "w[0]": "y"}


# --- partition / combine: what jax.grad takes, and the frozen rest --------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402


def _mixed_tree():
    return {
        "q": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "a": np.ones((2, 2), np.float32),
        "b": {"k": np.full(3, 2.0, np.float32), "n": np.int32(4)},
        "v": st.Tied("a", st.T),
    }


@given(hs.lists(hs.booleans(), min_size=2, max_size=2))
def test_partition_then_combine_gives_the_tree_back_leaf_for_leaf(bits):
    tree = _mixed_tree()
    chosen = [p for p, bit in zip(["a", "b/k"], bits, strict=True) if bit]
    mask = (
        st.mask_by_path(tree, chosen, strict=False)
        if chosen
        else jax.tree.map(lambda _: False, tree)
    )
    train, frozen = st.partition(tree, mask)
    flat_t = dict(jax.tree_util.tree_flatten_with_path(train, is_leaf=lambda x: x is None)[0])
    flat_f = dict(jax.tree_util.tree_flatten_with_path(frozen, is_leaf=lambda x: x is None)[0])
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        picked = "/".join(keypath_to_path(kp)) in chosen
        assert (flat_t[kp] is x) == picked and (flat_f[kp] is x) != picked
        assert (flat_t[kp] is None) != picked
    back = st.combine(train, frozen)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert all(x is y for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True))


def test_grad_of_the_trainable_part_equals_the_gradient_by_hand():
    tree = _mixed_tree()
    train, frozen = st.partition(tree, st.mask_by_path(tree, "a"))

    def loss(t):
        m = st.materialize(st.combine(t, frozen))
        return jnp.sum(m["v"] * jnp.arange(4.0).reshape(2, 2)) + jnp.sum(m["q"])

    g = jax.grad(loss)(train)
    np.testing.assert_array_equal(g["a"], np.arange(4.0).reshape(2, 2).T)  # d/da of sum(a.T*c)
    assert g["q"] is None and g["v"] == st.Tied("a", st.T)


def test_partition_refuses_integer_leaves_to_train_and_masks_of_another_tree():
    tree = _mixed_tree()
    with raises("E341", "'b/n'", "int32[]"):
        st.partition(tree, st.mask_by_path(tree, "b"))
    with raises("E341", "mask", "st.mask_by_path"):
        st.partition(tree, {"a": True})
    with raises("E341", "'a'", "str", cls=st.TieTypeError):
        st.partition(tree, {**st.mask_by_path(tree, "a"), "a": "yes"})
