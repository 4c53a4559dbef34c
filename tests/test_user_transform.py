"""A transform defined outside the package works everywhere a built-in one does.

``Roll`` and ``Power`` below are what a user writes: a frozen dataclass that
subclasses ``st.Transform`` with ``name=`` and defines ``__call__`` (``Roll``
also says how optimizer moments move through it). Every result is checked
against NumPy written by hand or finite differences, never against sharetree.
"""

import dataclasses
import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _raises import message, raises

import sharetree as st
from sharetree import _transforms

A = np.arange(12.0, dtype=np.float32).reshape(4, 3) / 7.0
W_A = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
W_B = np.linspace(2.0, -3.0, 12, dtype=np.float32).reshape(4, 3)


@dataclasses.dataclass(frozen=True)
class Roll(st.Transform, name="test_user_roll"):
    """Roll the entries of one axis by ``shift``: moves elements, so moments move the same way."""

    shift: int
    axis: int = 0

    def __post_init__(self):
        for v in (self.shift, self.axis):
            if not isinstance(v, int) or isinstance(v, bool):
                raise st.TieTypeError(f"Roll takes integers, got {v!r}. Fix: Roll(1).")

    def __call__(self, x):
        return jnp.roll(jnp.asarray(x), self.shift, self.axis)

    def state_view(self):
        return self


@dataclasses.dataclass(frozen=True)
class Power(st.Transform, name="test_user_power"):
    """``x ** p``: says nothing about moments (the default)."""

    p: int = 2

    def __call__(self, x):
        return jnp.asarray(x) ** self.p


def _tree():
    return {"a": A, "b": st.Tied("a", Roll(1)), "c": st.Tied("a", Roll(-1, 1) >> Power(3))}


def _loss(m):
    return jnp.sum(W_A * m["a"]) + jnp.sum(W_B * m["b"]) + jnp.sum(jnp.sin(m["c"]))


def _loss_by_hand(a):
    """The same loss on the untied values, computed with NumPy (float64)."""
    a = a.astype(np.float64)
    b, c = np.roll(a, 1, 0), np.roll(a, -1, 1) ** 3
    return np.sum(W_A * a) + np.sum(W_B * b) + np.sum(np.sin(c))


def _grad_by_hand(a):
    """d loss / d a by the chain rule, by hand: each use pulled back through its view."""
    a = a.astype(np.float64)
    by_b = np.roll(W_B, -1, 0)  # the transpose of a roll is the opposite roll
    by_c = np.roll(np.cos(np.roll(a, -1, 1) ** 3) * 3 * np.roll(a, -1, 1) ** 2, 1, 1)
    return W_A + by_b + by_c, by_b, by_c


def test_materialize_and_tie_compute_the_views_by_hand():
    m = st.materialize(_tree())
    np.testing.assert_array_equal(m["b"], np.roll(A, 1, 0))
    np.testing.assert_allclose(m["c"], np.roll(A, -1, 1) ** 3, rtol=1e-6)
    # st.tie compares the copies a checkpoint stores twice
    untied = {"a": A, "b": np.roll(A, 1, 0)}
    assert st.tie(untied, {"b": st.Tied("a", Roll(1))}, atol=0.0)["b"] == st.Tied("a", Roll(1))
    with raises("E46", "'b'", "Roll(shift=2, axis=0)"):
        st.tie(untied, {"b": st.Tied("a", Roll(2))}, atol=0.0)
    with pytest.raises(TypeError, match="Roll takes integers"):  # the class's own message
        Roll(1.5)


def test_grad_destructure_and_grad_by_use_match_the_chain_rule_by_hand():
    full, by_b, by_c = _grad_by_hand(A)
    g = jax.grad(lambda t: _loss(st.materialize(t)))(_tree())
    assert g["b"] == st.Tied("a", Roll(1))
    np.testing.assert_allclose(g["a"], full, rtol=1e-5, atol=1e-6)
    # finite differences of the hand-written loss agree with the hand-written gradient
    eps, k = 1e-5, (2, 1)
    bump = np.zeros_like(A, np.float64)
    bump[k] = eps
    fd = (_loss_by_hand(A + bump) - _loss_by_hand(A - bump)) / (2 * eps)
    np.testing.assert_allclose(fd, full[k], rtol=1e-5)

    flat, re_ = st.destructure(_tree())
    np.testing.assert_array_equal(re_(flat)["b"], np.roll(A, 1, 0))
    g_flat = jax.jit(jax.grad(lambda v: _loss(re_(v))))(flat)
    np.testing.assert_allclose(g_flat.reshape(4, 3), full, rtol=1e-5, atol=1e-6)

    by_use = st.grad_by_use(_loss)(_tree())["a"]
    assert set(by_use) == {"a", "b", "c"}
    np.testing.assert_allclose(by_use["a"], W_A, rtol=1e-6)
    np.testing.assert_allclose(by_use["b"], by_b, rtol=1e-6)
    np.testing.assert_allclose(by_use["c"], by_c, rtol=1e-5, atol=1e-6)


def test_save_load_summary_and_html_show_the_user_transform(tmp_path):
    tree = _tree()
    path = tmp_path / "user.safetensors"
    st.save(path, tree)
    back = st.load(path)
    assert back["b"] == st.Tied("a", Roll(1)) and back["c"] == tree["c"]
    np.testing.assert_array_equal(back["a"], A)
    assert st.transform_from_spec(Roll(-1, 1).spec()) == Roll(-1, 1)
    assert Roll(-1, 1).spec() == {"name": "test_user_roll", "shift": -1, "axis": 1}
    with pytest.raises(st.TieTypeError) as info:  # its own error, the spec and fields noted
        st.transform_from_spec({"name": "test_user_roll", "shift": "1", "axis": 0})
    for fact in ("Roll takes integers, got '1'", "'shift': '1'", "the fields of 'test_user_roll'"):
        assert fact in message(info.value)

    text = st.summary(tree)
    assert re.search(r"b\s+a\s+Roll\(shift=1, axis=0\)\s+\(4, 3\)\s+float32", text), text
    assert "Roll(shift=-1, axis=1) >> Power(p=3)" in text
    html = st.canonicalize(tree)._repr_html_()
    assert "Roll(shift=1, axis=0)" in html and "(4, 3)" in html


def test_untie_state_moves_moments_when_declared_and_names_the_fix_when_not():
    tree = {"a": A, "b": st.Tied("a", Roll(1))}
    opt = optax.adam(0.1)
    state = opt.init(tree)
    grads = {"a": jnp.asarray(W_A), "b": st.Tied("a", Roll(1))}
    _, state = opt.update(grads, state, tree)
    new_state = st.untie_state(state, tree)
    mu_a = np.asarray(state[0].mu["a"])
    np.testing.assert_allclose(mu_a, 0.1 * W_A, rtol=1e-6)  # Adam's first moment by hand
    np.testing.assert_array_equal(new_state[0].mu["b"], np.roll(mu_a, 1, 0))
    np.testing.assert_array_equal(new_state[0].nu["b"], np.roll(state[0].nu["a"], 1, 0))

    powered = {"a": A, "b": st.Tied("a", Power(3))}
    with raises("E25", "'b'", "Power(p=3)", "'a'", "state_view()"):
        st.untie_state(optax.adam(0.1).init(powered), powered)


def test_no_module_outside_transforms_tests_a_transform_class_or_spec_name():
    builtin = [c.__name__ for c in _transforms.REGISTRY.values() if c.__qualname__[0] == "_"]
    pattern = re.compile(rf"\b({'|'.join(builtin)})\b|\bspec_name\b")
    package = pathlib.Path(_transforms.__file__).parent  # sharetree/_transforms/
    modules = list(package.parent.glob("*.py"))  # the other modules of sharetree
    assert modules and not any(f.is_relative_to(package) for f in modules)
    for f in modules:
        hits = [line for line in f.read_text().splitlines() if pattern.search(line)]
        assert not hits, f"{f.name} dispatches on transform classes: {hits}"


def test_a_foreign_file_moves_its_buffer_through_the_declared_inverse(tmp_path):
    from safetensors.numpy import save_file

    path = str(tmp_path / "model.safetensors")
    save_file({"head": np.ascontiguousarray(A.T)}, path, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = st.load(path, ties={"head": st.Tied("embed", st.transpose(1, 0))})
        np.testing.assert_array_equal(sd["embed"], A)
        with raises("E45", "Roll(shift=1, axis=0)", "'head'", "'embed'"):
            st.load(path, ties={"head": st.Tied("embed", Roll(1))})


@dataclasses.dataclass(frozen=True)
class Flip(st.Transform, name="test_user_flip"):
    """Reverse one axis: its own inverse, and it keeps every axis (names move with them)."""

    axis: int = 0

    def __call__(self, x):
        return jnp.flip(jnp.asarray(x), self.axis)

    def inverse(self):
        return self

    def axis_names(self, names, aval):
        return tuple(names)


@pytest.mark.parametrize("t", [Flip(0), Flip(1), st.T >> Flip(0), Flip(1) >> st.T])
def test_a_buffer_moved_through_an_inverse_that_keeps_the_axes_gets_its_values(tmp_path, t):
    # the file holds only the view: its buffer is the inverse of it, which is no permutation
    from safetensors.numpy import save_file

    path = str(tmp_path / "model.safetensors")
    save_file({"head": np.ascontiguousarray(W_A)}, path, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = st.load(path, ties={"head": st.Tied("embed", t)})
    np.testing.assert_array_equal(np.asarray(st.materialize(sd)["head"]), W_A)
    by_hand = {
        repr(Flip(0)): W_A[::-1],
        repr(Flip(1)): W_A[:, ::-1],
        repr(st.T >> Flip(0)): W_A[::-1].T,  # T(embed)[::-1] == W_A
        repr(Flip(1) >> st.T): W_A.T[:, ::-1],  # (embed[:, ::-1]).T == W_A
    }
    np.testing.assert_array_equal(sd["embed"], by_hand[repr(t)])


@dataclasses.dataclass(frozen=True)
class ReturnsNone(st.Transform, name="test_user_returns_none"):
    def __call__(self, x):
        return None


@dataclasses.dataclass(frozen=True)
class ReturnsPair(st.Transform, name="test_user_returns_pair"):
    def __call__(self, x):
        return (x, x)


@pytest.mark.parametrize("bad", [ReturnsNone(), ReturnsPair()], ids=repr)
def test_a_transform_returning_no_array_is_refused_wherever_views_are_computed(bad):
    tree = {"w": np.ones((2, 2), np.float32), "v": st.Tied("w", bad)}
    facts = [repr(bad), f"found {type(bad(np.ones(1))).__name__}"]
    with raises("E66", "view 'v'", *facts):
        st.materialize(tree)
    with raises("E66", "view 'v'", *facts):
        st.summary(tree)
    with raises("E66", "view 'v'", *facts):
        jax.eval_shape(st.materialize, tree)
    with raises("E66", "view 'v'", *facts):
        jax.jit(st.materialize)(tree)
    many = {"w": np.ones((2, 2), np.float32), **{f"v{i}": st.Tied("w", bad) for i in range(20)}}
    with raises("E66", "view 'v0'", *facts):
        st.materialize(many)  # the batched eager path (one compiled call for many views)


@dataclasses.dataclass(frozen=True)
class Rotate(st.Transform, name="test_user_rotate"):
    z: complex = 1 + 2j
    zs: tuple[complex, ...] = ()
    then: st.Transform | None = None
    parts: tuple[st.Transform, ...] = ()

    def __call__(self, x):
        y = jnp.asarray(x) * self.z
        for z in self.zs:
            y = y * z
        for t in (self.then, *self.parts):
            y = y if t is None else t(y)
        return y


@dataclasses.dataclass(frozen=True)
class Unresolved(st.Transform, name="test_user_unresolved_annotations"):
    z: "complex" = 1j
    inner: "NoSuchTransform" = st.T  # noqa: F821 - an annotation get_type_hints cannot resolve

    def __call__(self, x):
        return self.inner(jnp.asarray(x) * self.z)


@pytest.mark.parametrize(
    "t",
    [
        Rotate(),
        Rotate(2.0 - 0.5j, zs=(1j, 3 + 0j), then=st.slice(0, 2) >> st.T),
        Rotate(1j, parts=(st.T, st.scale(2.0), Rotate(then=st.T))),
        Unresolved(2 + 1j, st.slice(0, 1)),
    ],
    ids=repr,
)
def test_complex_and_transform_fields_round_trip_through_spec_and_a_file(t, tmp_path):
    spec = t.spec()
    assert json.loads(json.dumps(spec)) == spec  # the spec is plain JSON
    back = st.transform_from_spec(spec)
    assert back == t and type(back.z) is complex
    w = np.arange(4.0, dtype=np.float32).reshape(2, 2)
    path = str(tmp_path / "rot.safetensors")
    st.save(path, {"w": w, "v": st.Tied("w", t)})
    loaded = st.load(path)
    assert loaded["v"] == st.Tied("w", t)
    np.testing.assert_allclose(st.materialize(loaded)["v"], t(w))


def test_a_fold_must_give_one_transform_that_is_no_chain():
    # a chain or a non-transform from fold would leave a chain inside a chain (a file that
    # cannot load) or pass the value through; both are refused, naming the class and value
    @dataclasses.dataclass(frozen=True)
    class FoldsToChain(st.Transform, name="test_user_folds_to_chain"):
        def __call__(self, x):
            return x

        def fold(self, after):
            return st.T >> st.scale(2.0) if isinstance(after, FoldsToChain) else None

    @dataclasses.dataclass(frozen=True)
    class FoldsToText(st.Transform, name="test_user_folds_to_text"):
        def __call__(self, x):
            return x

        def fold(self, after):
            return "nope"

    with raises("E101", "FoldsToChain.fold(", "_Chain T >> scale(2.0)", cls=st.TieTypeError):
        st.T >> FoldsToChain() >> FoldsToChain()
    with raises("E101", "FoldsToText.fold(T)", "str 'nope'", cls=st.TieTypeError):
        st.chain(FoldsToText(), st.T)


def test_classes_that_cannot_be_read_back_are_refused_when_defined_or_read():
    with raises("E100", "Clipped", "_Scale", "Fix: subclass st.Transform", cls=st.TieTypeError):

        @dataclasses.dataclass(frozen=True)
        class Clipped(type(st.scale(1.0)), name="test_user_clipped"):
            def __call__(self, x):
                return jnp.clip(x * self.c, -1, 1)

    for bad in (3, ""):
        with raises("E100", "Named(name=...)", "a non-empty str", repr(bad), cls=st.TieTypeError):

            class Named(st.Transform, name=bad):
                pass

    with raises("E100", "Clash", "'transpose'", "_Transpose", cls=st.TieTypeError):

        class Clash(st.Transform, name="transpose"):
            pass

    class NotADataclass(st.Transform, name="test_user_not_a_dataclass"):
        def __call__(self, x):
            return x

    with raises("E100", "NotADataclass", "@dataclasses.dataclass(frozen=True)"):
        st.transform_from_spec({"name": "test_user_not_a_dataclass"})


@dataclasses.dataclass(frozen=True)
class Wrap(st.Transform, name="test_user_wrap"):
    inner: st.Transform

    def __call__(self, x):
        return self.inner(x)


def test_save_refuses_a_spec_that_would_not_read_back(tmp_path):
    # nested deeper than a file may hold: refused by save, as load would refuse the file
    deep = st.T
    for _ in range(9):
        deep = Wrap(deep)
    path = tmp_path / "m.safetensors"
    with raises("E17", "save: the tie at 'v'", "more than 8 deep"):
        st.save(path, {"w": A, "v": st.Tied("w", deep)})
    assert not path.exists()
    shallow = Wrap(Wrap(st.T))
    st.save(path, {"w": A, "v": st.Tied("w", shallow)})
    assert st.load(path)["v"] == st.Tied("w", shallow)

    # a transform in a field reads back as a transform whatever the field's annotation says
    # (here one that does not resolve), so it saves and loads
    @dataclasses.dataclass(frozen=True)
    class Unresolved(st.Transform, name="test_user_unresolved"):
        inner: "typing.Optional[st.Transform]" = None  # noqa: F821
        tag: "LocalOnly | None" = None  # noqa: F821

        def __call__(self, x):
            return self.inner(x)

    st.save(path, {"w": A, "v": st.Tied("w", Unresolved(st.T))})
    assert st.load(path)["v"] == st.Tied("w", Unresolved(st.T))

    # a complex number reads back as one only in a field annotated complex: elsewhere as the
    # pair [real, imag], another transform, so save refuses it, naming what would be read
    @dataclasses.dataclass(frozen=True)
    class Untyped(st.Transform, name="test_user_untyped"):
        z: object = 1j

        def __call__(self, x):
            return x * self.z

    with raises("E125", "'v'", "Untyped(z=(0.0, 1.0))"):
        st.save(path, {"w": A, "v": st.Tied("w", Untyped())})
