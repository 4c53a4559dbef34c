"""Transforms one by one: values, equality, pickling, specs, the registry, safe reading."""

import builtins
import dataclasses
import importlib
import math
import pickle
import re
import sys
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharetree as st
from sharetree import _transforms
from sharetree._transforms import Transform, describe_spec

X = np.arange(24.0, dtype=np.float32).reshape(2, 3, 4)
FUNCTIONS = {"jax.numpy:flipud": jnp.flipud}

ALL = [
    st.identity,
    st.T,
    st.transpose(1, 0, 2),
    st.reshape(4, 6),
    st.astype(jnp.bfloat16),
    st.scale(0.5),
    st.scale(2j),
    st.scale(1.5 - 0.25j),
    st.fn(jnp.flipud),
    st.T >> st.reshape(24),
    st.astype(jnp.float16) >> st.astype(jnp.float32),
    st.fn(jnp.flipud) >> st.scale(3.0) >> st.T,
    st.slice(0, 2, axis=1),
    st.slice(-2, None),
    st.index(-1, axis=2),
    st.slice(0, 1) >> st.T >> st.index(0),
]


@pytest.mark.parametrize("t", ALL, ids=repr)
def test_hashable_equal_picklable_and_spec_roundtrip(t):
    back = pickle.loads(pickle.dumps(t))
    assert back == t and hash(back) == hash(t)
    restored = st.transform_from_spec(t.spec(), functions=FUNCTIONS)
    assert restored == t and hash(restored) == hash(t)


@pytest.mark.parametrize("t", ALL, ids=repr)
def test_describe_spec_is_the_repr_with_fn_by_its_stored_name(t):
    assert describe_spec(t.spec()) == repr(t).replace("fn(flipud)", "fn(jax.numpy:flipud)")


def test_value_equality_and_reprs():
    assert st.T == st.transpose() and hash(st.T) == hash(st.transpose())
    assert st.transpose(-1, 0) == st.transpose(1, 0) and st.transpose((2, 0, 1)) == st.transpose(
        2, 0, 1
    )
    assert st.reshape(4, 6) == st.reshape((4, 6)) and st.reshape(4, 6) != st.reshape(6, 4)
    assert st.astype("float16") == st.astype(np.float16) == st.astype(np.dtype("f2"))
    assert st.scale(2) == st.scale(2.0) == st.scale(np.float32(2.0))
    assert st.scale(-0.0) == st.scale(0.0) and repr(st.scale(-0.0)) == "scale(0.0)"
    assert [repr(t) for t in (st.identity, st.T, st.reshape(4, 6), st.scale(0.5))] == [
        "identity",
        "T",
        "reshape(4, 6)",
        "scale(0.5)",
    ]
    assert repr(st.T >> st.astype(jnp.bfloat16)) == "T >> astype(bfloat16)"
    assert pickle.loads(pickle.dumps(st.identity)) is st.identity


def test_complex_scale_is_not_equal_to_the_real_one():
    # 2.0 == 2+0j in Python, but only one of them makes the view complex
    assert st.scale(2 + 0j) != st.scale(2.0)
    assert st.scale(2 + 0j) == st.scale(np.complex64(2))
    assert {st.scale(2 + 0j), st.scale(2.0)} == {st.scale(2.0), st.scale(2 + 0j)}
    assert len({st.scale(2 + 0j), st.scale(2.0)}) == 2
    assert st.scale(2 + 0j)(np.ones(2, np.float32)).dtype == jnp.complex64
    assert st.scale(2.0)(np.ones(2, np.float32)).dtype == jnp.float32


def test_values_match_numpy():
    np.testing.assert_array_equal(st.identity(X), X)
    assert st.identity(X) is X
    np.testing.assert_array_equal(st.T(X), X.T)
    np.testing.assert_array_equal(st.transpose(1, 0, 2)(X), X.transpose(1, 0, 2))
    np.testing.assert_array_equal(st.transpose(-1, 0, 1)(X), X.transpose(2, 0, 1))
    np.testing.assert_array_equal(st.reshape(4, -1)(X), X.reshape(4, 6))
    assert st.astype(jnp.bfloat16)(X).dtype == jnp.bfloat16
    np.testing.assert_allclose(st.scale(0.5)(X), X * 0.5)
    np.testing.assert_allclose(st.scale(1.5 - 0.25j)(X), X * (1.5 - 0.25j), rtol=1e-6)
    np.testing.assert_array_equal(st.fn(jnp.flipud)(X), np.flipud(X))
    np.testing.assert_array_equal((st.T >> st.reshape(24))(X), X.T.reshape(24))


def test_scale_dtypes_follow_jax_promotion_with_a_python_scalar():
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.int32, jnp.int8, jnp.bool_):
        x = jnp.ones(3, dtype)
        assert st.scale(0.5)(x).dtype == (x * 0.5).dtype, dtype
        assert st.scale(0.5j)(x).dtype == jnp.complex64, dtype
    assert st.scale(0.5)(jnp.ones(3, jnp.float16)).dtype == jnp.float16  # kept
    assert st.scale(3)(jnp.ones(3, jnp.int32)).dtype == jnp.float32  # int buffer -> float
    assert st.scale(0.5)(jnp.ones(3, jnp.complex64)).dtype == jnp.complex64


def test_abstract_matches_eval_shape():
    aval = jax.ShapeDtypeStruct(X.shape, X.dtype)
    for t in ALL:
        assert t.abstract(aval) == jax.eval_shape(t, aval), t


def test_fn_calls_its_function_with_a_jax_array():
    seen = []

    def record(x):
        seen.append(type(x))
        return x

    st.fn(record)(np.ones(2))
    assert seen and issubclass(seen[0], jax.Array)


def test_fn_spec_needs_importable_function():
    with pytest.raises(st.TieError, match="cannot be written"):
        st.fn(lambda x: x).spec()


# --- bad arguments ---------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [None, np.ones(2, np.float16), 3, 2.5, object(), "nope", "O", "U3", "i4,f8", "M8[ns]"]
)
def test_astype_rejects_what_is_not_a_numeric_dtype(bad):
    with pytest.raises(st.TieError, match=r"astype\(.*the dtype argument.*expected a boolean or"):
        st.astype(bad)


def test_astype_accepts_the_documented_forms():
    assert st.astype(float) == st.astype("float64") == st.astype(np.dtype("float64"))
    assert st.astype(jnp.bfloat16) == st.astype("bfloat16")
    assert st.astype(bool) == st.astype("bool")
    assert st.astype("int4") == st.astype(jnp.int4)


@pytest.mark.parametrize(
    "bad",
    [math.nan, math.inf, -math.inf, np.float32("nan"), complex(1, math.inf), 10**400],
    ids=repr,
)
def test_scale_rejects_non_finite(bad):
    with pytest.raises(st.TieError, match=r"scale\(.*expected a finite number"):
        st.scale(bad)


@pytest.mark.parametrize("bad", ["2", True, np.bool_(False), None, [2.0], np.ones(2)], ids=repr)
def test_scale_rejects_non_numbers(bad):
    with pytest.raises(st.TieError, match="finite Python or NumPy number"):
        st.scale(bad)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: st.transpose(0, 0), "permutation"),
        (lambda: st.transpose(0, 2), "permutation"),
        (lambda: st.transpose(1, -3), "permutation"),
        (lambda: st.transpose(True, False), "integers"),
        (lambda: st.reshape(-1, -1), "at most one -1"),
        (lambda: st.reshape(2, -2), "sizes >= 0"),
        (lambda: st.reshape(2.0, 3), "integers"),
    ],
)
def test_meaningless_axes_and_sizes(make, match):
    with pytest.raises(st.TieError, match=match):
        make()


def test_rank_mismatch_stays_an_error_when_the_view_is_computed():
    with pytest.raises(ValueError, match="out of bounds"):
        st.transpose(0, 1, 2)(np.ones((2, 3)))


# --- specs: registry, malformed specs --------------------------------------------


def test_every_registered_transform_has_a_factory_and_spec_names():
    builtin = {n for n, c in _transforms._REGISTRY.items() if c.__module__ == _transforms.__name__}
    assert builtin == {
        "identity",
        "transpose",
        "reshape",
        "astype",
        "scale",
        "fn",
        "slice",
        "index",
        "chain",
    }
    for name, cls in _transforms._REGISTRY.items():
        assert cls.spec_name == name
    specs = {t.spec()["name"] for t in ALL}
    assert specs == builtin  # ALL covers every registered transform


@pytest.fixture
def flip_transform():
    """A transform defined outside sharetree: one dataclass, no spec code, nothing else to edit."""

    @dataclasses.dataclass(frozen=True)
    class Flip(Transform, name="test_flip"):
        axis: int
        field_docs: ClassVar[dict[str, str]] = {"axis": "an integer"}

        def __post_init__(self):
            if not isinstance(self.axis, int):
                raise TypeError(f"Flip(axis) takes an integer, got {self.axis!r}")

        def __call__(self, x):
            return jnp.flip(jnp.asarray(x), self.axis)

    yield Flip
    del _transforms._REGISTRY["test_flip"]


def test_a_new_transform_is_one_class(flip_transform):
    t = st.T >> flip_transform(0)
    assert t.spec()["parts"][1] == {"name": "test_flip", "axis": 0}
    assert st.transform_from_spec(t.spec()) == t
    assert describe_spec(t.spec()) == "T >> " + repr(flip_transform(0))
    np.testing.assert_array_equal(t(X[0]), np.flip(X[0].T, 0))
    with pytest.raises(st.TieError, match=r"known in this process: .*test_flip"):
        st.transform_from_spec({"name": "flop"})
    with pytest.raises(st.TieError, match=r"st\.test_flip"):
        st.Tied("a", 3)
    with pytest.raises(
        st.TieError,
        match=r"field 'axis' of 'test_flip' should be an integer, found str '0' "
        r"\(TypeError: Flip\(axis\) takes an integer, got '0'\)",
    ):
        st.transform_from_spec({"name": "test_flip", "axis": "0"})
    with pytest.raises(st.TieError, match=r"the field 'axis' is missing.*'axis' \(an integer\)"):
        st.transform_from_spec({"name": "test_flip"})


def test_registry_refuses_a_taken_name_and_a_class_that_is_no_dataclass():
    with pytest.raises(TypeError, match="'scale' is already taken"):

        class Other(Transform, name="scale"):
            pass

    class NoFields(Transform, name="test_no_fields"):  # not a dataclass: no spec to write
        def __call__(self, x):
            return x

    try:
        with pytest.raises(TypeError, match="NoFields is not a dataclass.*@dataclasses"):
            NoFields().spec()
    finally:
        del _transforms._REGISTRY["test_no_fields"]
    assert _transforms._REGISTRY["scale"] is type(st.scale(1.0))


def test_unknown_name_lists_the_known_ones():
    known = ", ".join(sorted(_transforms._REGISTRY))  # the built-ins, and any defined by users
    assert "astype, chain, fn, identity, index, reshape, scale, slice, transpose" in ", ".join(
        n for n in sorted(_transforms._REGISTRY) if not n.startswith(("doc_", "test_"))
    )
    with pytest.raises(
        st.TieError,
        match=rf"unknown transform name 'rot90'; known in this process: {known}\. Fix: if it "
        r"is a transform of your own, import \(or define\) the class registered as 'rot90'",
    ):
        st.transform_from_spec({"name": "rot90"})


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"name": "reshape"}, r"the field 'shape' is missing"),
        ({"name": "transpose"}, r"the field 'axes' is missing"),
        ({"name": "reshape", "shape": [2, 3], "order": "F"}, r"the field 'order' is not one of"),
        ({"name": "identity", "x": 1}, r"the field 'x' is not one of its fields.*are: none"),
        ({"name": "reshape", "shape": "23"}, r"field 'shape' of 'reshape' should be a list of int"),
        ({"name": "reshape", "shape": [2.5]}, r"field 'shape'.*found list \[2\.5\]"),
        ({"name": "reshape", "shape": [True]}, r"field 'shape'"),
        ({"name": "reshape", "shape": [-1, -1]}, r"field 'shape'.*at most one -1"),
        ({"name": "transpose", "axes": [0, 0]}, r"field 'axes'.*permutation"),
        ({"name": "transpose", "axes": 1}, r"field 'axes'"),
        ({"name": "astype", "dtype": None}, r"field 'dtype' of 'astype' should be a dtype name"),
        ({"name": "astype", "dtype": "object"}, r"field 'dtype'.*cannot compute with"),
        ({"name": "astype", "dtype": "nope"}, r"field 'dtype'"),
        ({"name": "scale", "c": "2"}, r"field 'c' of 'scale' should be a finite number"),
        ({"name": "scale", "c": float("nan")}, r"field 'c'.*expected a finite number"),
        ({"name": "scale", "c": [1.0]}, r"field 'c'.*found list \[1\.0\]"),
        ({"name": "scale", "c": [1.0, "x"]}, r"field 'c'"),
        ({"name": "scale", "c": True}, r"field 'c'"),
        ({"name": "fn", "function": 3}, r"field 'function' of 'fn' should be a 'module:qualname'"),
        ({"name": "fn", "function": "os.system"}, r"field 'function'"),
        ({"name": "fn", "function": "os:system; rm"}, r"field 'function'"),
        ({"name": "chain", "parts": {"name": "T"}}, r"field 'parts' of 'chain' should be a list"),
        ({"name": "chain", "parts": [{"name": "chain", "parts": []}]}, r"not chains"),
        ({"name": "chain", "parts": [{"name": "reshape"}]}, r"the field 'shape' is missing"),
        ({"name": 3}, r"unknown transform name 3"),
        ({"name": ["a"]}, r"unknown transform name \['a'\]"),
        ({"shape": [2]}, r"expected a dict with a 'name' field"),
        ([("name", "T")], r"expected a dict with a 'name' field, found list"),
        (None, r"expected a dict with a 'name' field, found NoneType"),
    ],
    ids=repr,
)
def test_malformed_specs_say_which_field(spec, match):
    with pytest.raises(st.TieError, match=match):
        st.transform_from_spec(spec)
    with pytest.raises(st.TieError, match=match):
        describe_spec(spec)


def test_malformed_spec_message_is_bounded():
    spec = {"name": "reshape", "shape": ["x" * 10_000] * 10_000}
    with pytest.raises(st.TieError) as e:
        st.transform_from_spec(spec)
    assert len(str(e.value)) < 1000


def test_chain_spec_in_normal_form_on_reading():
    spec = {"name": "chain", "parts": [st.T.spec(), st.T.spec(), st.scale(2.0).spec()]}
    assert st.transform_from_spec(spec) == st.scale(2.0)
    assert describe_spec(spec) == "scale(2.0)"
    assert st.transform_from_spec({"name": "chain", "parts": []}) == st.identity


# --- reading never imports or calls what a spec names ----------------------------


@pytest.fixture
def side_effect_module(tmp_path, monkeypatch):
    """A module on sys.path whose import writes a file."""
    marker = tmp_path / "imported.txt"
    name = "sharetree_test_side_effect_mod"
    (tmp_path / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\ndef f(x):\n    return x + 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec(name) is not None  # it would import
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name, marker


@pytest.mark.parametrize("name", ["sys:exit", "os:system", "builtins:exec", "builtins:eval"])
def test_fn_spec_names_are_never_resolved(name):
    spec = {"name": "fn", "function": name}
    with pytest.raises(
        st.TieError,
        match=rf"fn\({name}\): the function '{name}' is not among the functions passed in "
        rf"\(no functions were given\).*Fix: .*st\.load\(path, functions=\{{'{name}': ",
    ):
        st.transform_from_spec(spec)
    assert describe_spec(spec) == f"fn({name})"


def test_module_with_side_effect_is_not_imported(side_effect_module):
    name, marker = side_effect_module
    spec = {"name": "chain", "parts": [st.T.spec(), {"name": "fn", "function": f"{name}:f"}]}
    with pytest.raises(st.TieError, match=rf"'{name}:f' is not among"):
        st.transform_from_spec(spec)
    with pytest.raises(st.TieError, match=r"the functions given are 'other:g'"):
        st.transform_from_spec(spec, functions={"other:g": jnp.flipud})
    assert describe_spec(spec) == f"T >> fn({name}:f)"
    assert name not in sys.modules and not marker.exists()

    def plus_one(x):
        return x + 1

    t = st.transform_from_spec(spec, functions={f"{name}:f": plus_one})
    assert t == st.T >> st.fn(plus_one)
    np.testing.assert_array_equal(t(X[0]), X[0].T + 1)
    assert name not in sys.modules and not marker.exists()


def test_functions_must_be_a_mapping_of_callables():
    spec = st.fn(jnp.flipud).spec()
    with pytest.raises(st.TieError, match=r"functions\['jax.numpy:flipud'\].*takes a callable"):
        st.transform_from_spec(spec, functions={"jax.numpy:flipud": "flipud"})
    with pytest.raises(st.TieError, match="expected a mapping"):
        st.transform_from_spec(spec, functions=[jnp.flipud])


def test_reading_specs_runs_no_import():
    specs = [t.spec() for t in ALL]
    unknown = {"name": "fn", "function": "os:system"}
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def no_new_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name not in sys.modules:  # NumPy's own lazy imports of loaded modules are fine
            raise AssertionError(f"import during spec reading: {name}")
        return real_import(name, *args, **kwargs)

    def no_import_module(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"importlib.import_module during spec reading: {args}")

    builtins.__import__, importlib.import_module = no_new_import, no_import_module
    try:
        restored = [st.transform_from_spec(spec, functions=FUNCTIONS) for spec in specs]
        described = [describe_spec(spec) for spec in [*specs, unknown]]
        with pytest.raises(st.TieError):
            st.transform_from_spec(unknown, functions=FUNCTIONS)
    finally:
        builtins.__import__, importlib.import_module = real_import, real_import_module
    assert restored == ALL and described[-1] == "fn(os:system)"


@pytest.mark.parametrize("out", [None, "s", (1, 2), {"x": 1}])
def test_fn_that_returns_no_array_is_an_error_not_a_lost_leaf(out):
    # materialize would otherwise put None (a leaf dropped) or a tuple (leaves added) there
    tree = {"a": np.ones((2, 3)), "b": st.Tied("a", st.fn(lambda x: out))}
    for call in (st.materialize, lambda t: st.canonicalize(t).views, jax.jit(st.materialize)):
        with pytest.raises(st.TieError, match=r"view 'b'.*fn\(.*\) returned .*, not an array"):
            call(tree)


def test_bad_argument_messages_fit_the_transform_and_stay_short():
    with pytest.raises(st.TieError, match=r"integer sizes, e\.g\. reshape\(2, 3\)"):
        st.reshape(2.0)
    with pytest.raises(st.TieError, match=r"integer axes, e\.g\. transpose\(1, 0\)"):
        st.transpose("a")
    with pytest.raises(st.TieError) as e:
        st.scale(10**400)
    assert len(str(e.value)) < 300


def test_slice_refuses_exactly_the_ranges_empty_for_every_buffer_and_suggests_valid_ones():
    def nonempty_for_some_size(start, stop):  # NumPy by hand, sizes up to 16, no clipping
        for n in range(1, 17):
            if -n <= start < n and (stop is None or -n <= stop <= n):
                if np.arange(n)[start:stop].size:
                    return True
        return False

    for start in range(-6, 7):
        for stop in [None, *range(-6, 7)]:
            possible = nonempty_for_some_size(start, stop)
            try:
                st.slice(start, stop)
            except st.TieError as e:
                assert not possible, (start, stop)
                fix = re.search(r"e\.g\. (st\.slice\([^)]*\))", str(e)).group(1)
                suggested = eval(fix, {"st": st})  # builds, and is not empty for some size
                assert nonempty_for_some_size(suggested.start, suggested.stop), (start, stop, fix)
            else:
                assert possible, (start, stop)


@pytest.mark.parametrize("t", [st.index(3), st.slice(0, 1), st.index(0, axis=-1)], ids=repr)
def test_an_axis_transform_of_a_scalar_says_it_has_no_axes(t):
    stack = {"w": np.ones((4, 3, 2), np.float32), "n_heads": 3}
    with pytest.raises(st.TieError) as e:
        st.materialize({"stack": stack, "extra": st.Tied("stack", t)})
    msg = str(e.value)
    assert "view 'extra/n_heads'" in msg and "the buffer is a scalar (shape (), no axes)" in msg
    assert "between 0 and -1" not in msg and "Fix:" in msg
    with pytest.raises(st.TieError, match=r"scalar \(shape \(\), no axes\)"):
        t(np.float32(2.0))


def test_an_uncalled_transform_factory_is_told_to_call_it_with_a_working_example():
    factories = [
        getattr(st, n) for n in st.__all__ if _transforms._is_factory(getattr(st, n, None))
    ]
    assert {f.__name__ for f in factories} >= {"slice", "index", "transpose", "reshape", "scale"}
    for f in factories:
        with pytest.raises(st.TieError) as e:
            st.Tied("embed", f)
        msg = str(e.value)
        assert f"st.{f.__name__} makes a transform: call it, e.g. st.{f.__name__}(" in msg
        assert "st.fn(...)" not in msg
        example = re.search(r"e\.g\. (st\..*)\.$", msg).group(1)
        assert isinstance(eval(example, {"st": st, "jnp": jnp}), st.Transform), example
    with pytest.raises(st.TieError, match=r"Roll is a transform class: pass an instance, Roll"):

        @dataclasses.dataclass(frozen=True)
        class Roll(st.Transform):
            def __call__(self, x):
                return jnp.roll(x, 1)

        st.Tied("embed", Roll)
