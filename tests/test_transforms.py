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
from _raises import message, raises

import sharetree as st
from sharetree import _transforms
from sharetree._transforms import REGISTRY, Transform, describe_spec

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
    st.take((0, 1, 0, 1, 0, 1)),
    st.take((2, -1), axis=1) >> st.T,
]
# transforms of {name: value}
SEVERAL = [st.lora(), st.lora(0.5) >> st.T, st.add(), st.matmul(), st.matmul() >> st.T]
# transforms of quantized tables, whose last axis is whole groups (X's is not): tests/test_quant.py
QUANTIZED = [st.dequantize(4, 64), st.dequantize(3, 32) >> st.T, st.fake_quant(6, 128)]


@pytest.mark.parametrize("t", ALL + SEVERAL + QUANTIZED, ids=repr)
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
    with raises("E102", "fn(", "<lambda>"):
        st.fn(lambda x: x).spec()


# --- bad arguments ---------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [None, np.ones(2, np.float16), 3, 2.5, object()], ids=lambda v: type(v).__name__
)
def test_astype_of_what_is_no_dtype_is_a_type_error(bad):
    with raises(
        "E73", "astype(", type(bad).__name__, "st.astype(jnp.bfloat16)", cls=st.TieTypeError
    ):
        st.astype(bad)


@pytest.mark.parametrize("bad", ["nope", "O", "U3", "i4,f8", "M8[ns]"])
def test_astype_rejects_what_is_not_a_numeric_dtype(bad):
    code = "E13b" if bad == "nope" else "E18"  # no dtype at all, or one JAX cannot compute with
    with raises(code, f"astype({bad!r})", "st.astype(jnp.bfloat16)"):
        st.astype(bad)


def test_astype_accepts_the_documented_forms():
    assert st.astype(float) == st.astype("float64") == st.astype(np.dtype("float64"))
    assert st.astype(jnp.bfloat16) == st.astype("bfloat16")
    assert st.astype(bool) == st.astype("bool")
    assert st.astype("int4") == st.astype(jnp.int4)


@pytest.mark.parametrize(
    "bad, found",
    [
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (np.float32("nan"), "nan"),
        (complex(1, math.inf), "(1+infj)"),
        (10**400, "inf"),
    ],
    ids=repr,
)
def test_scale_rejects_non_finite(bad, found):
    with raises("E19", "scale(", f"found {found}."):
        st.scale(bad)


@pytest.mark.parametrize("bad", ["2", True, np.bool_(False), None, [2.0], np.ones(2)], ids=repr)
def test_scale_rejects_non_numbers(bad):
    with raises("E73", "scale(c)", f"found {type(bad).__name__}", cls=st.TieTypeError):
        st.scale(bad)


@pytest.mark.parametrize(
    "make, code, facts",
    [
        (lambda: st.transpose(0, 0), "E22", ["transpose(0, 0)", "0..1", "[0, 0]"]),
        (lambda: st.transpose(0, 2), "E22", ["0..1", "[0, 2]"]),
        (lambda: st.transpose(1, -3), "E22", ["0..1", "[1, -3]"]),
        (lambda: st.transpose(True, False), "E73", ["transpose(True, False)", "bool True"]),
        (lambda: st.reshape(-1, -1), "E22", ["reshape(-1, -1)", "at most one -1", "[-1, -1]"]),
        (lambda: st.reshape(2, -2), "E22", ["sizes >= 0", "[2, -2]"]),
        (lambda: st.reshape(2.0, 3), "E73", ["reshape(2.0, 3)", "float 2.0"]),
    ],
)
def test_meaningless_axes_and_sizes(make, code, facts):
    with raises(code, *facts, cls=st.TieTypeError if code == "E73" else st.TieError):
        make()


def test_rank_mismatch_stays_an_error_when_the_view_is_computed():
    with pytest.raises(ValueError, match="out of bounds"):
        st.transpose(0, 1, 2)(np.ones((2, 3)))


# --- specs: registry, malformed specs --------------------------------------------


def test_every_registered_transform_has_a_factory_and_spec_names():
    package = _transforms.__name__ + "."
    builtin = {n for n, c in REGISTRY.items() if c.__module__.startswith(package)}
    assert builtin == {
        "identity",
        "transpose",
        "reshape",
        "astype",
        "scale",
        "fn",
        "slice",
        "index",
        "take",
        "chain",
        "lora",
        "add",
        "matmul",
        "dequantize",
        "fake_quant",
    }
    for name, cls in REGISTRY.items():
        assert cls.spec_name == name
    specs = {t.spec()["name"] for t in ALL + SEVERAL + QUANTIZED}
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
    del REGISTRY["test_flip"]


def test_a_new_transform_is_one_class(flip_transform):
    t = st.T >> flip_transform(0)
    assert t.spec()["parts"][1] == {"name": "test_flip", "axis": 0}
    assert st.transform_from_spec(t.spec()) == t
    assert describe_spec(t.spec()) == "T >> " + repr(flip_transform(0))
    np.testing.assert_array_equal(t(X[0]), np.flip(X[0].T, 0))
    with raises("E17", "'flop'", "test_flip"):
        st.transform_from_spec({"name": "flop"})
    with raises("E13", "st.test_flip", cls=st.TieTypeError):
        st.Tied("a", 3)
    flip = "'axis' (an integer)"  # its field_docs
    with raises("E74", flip, "TypeError: Flip(axis) takes an integer, got '0'"):
        st.transform_from_spec({"name": "test_flip", "axis": "0"})
    with raises("E20", "the field 'axis'", flip):
        st.transform_from_spec({"name": "test_flip"})


def test_registry_refuses_a_taken_name_and_a_class_that_is_no_dataclass():
    with raises("E100", "Other", "'scale'", "_Scale", cls=st.TieTypeError):

        class Other(Transform, name="scale"):
            pass

    class NoFields(Transform, name="test_no_fields"):  # not a dataclass: no spec to write
        def __call__(self, x):
            return x

    try:
        with raises("E100", "NoFields", "@dataclasses.dataclass(frozen=True)", cls=st.TieTypeError):
            NoFields().spec()
    finally:
        del REGISTRY["test_no_fields"]
    assert REGISTRY["scale"] is type(st.scale(1.0))


def test_unknown_name_lists_the_known_ones():
    known = ", ".join(sorted(REGISTRY))  # the built-ins, and any defined by users
    names = "add, astype, chain, dequantize, fake_quant, fn, identity, index, lora, matmul"
    names += ", reshape, scale, slice, take"
    assert names + ", transpose" in ", ".join(
        n for n in sorted(REGISTRY) if not n.startswith(("doc_", "test_"))
    )
    own = "import (or define) the class registered as 'rot90'"
    with raises("E17", "unknown transform name 'rot90'", known, own):
        st.transform_from_spec({"name": "rot90"})


RESHAPE = "the fields of 'reshape': 'shape'"


@pytest.mark.parametrize(
    "spec, code, facts",
    [
        ({"name": "reshape"}, "E20", ["the field 'shape'", "a list of integers"]),
        ({"name": "transpose"}, "E20", ["the field 'axes'"]),
        ({"name": "reshape", "shape": [2, 3], "order": "F"}, "E20", ["the field 'order'"]),
        ({"name": "identity", "x": 1}, "E20", ["the field 'x'", "'identity': none besides name"]),
        (
            {"name": "reshape", "shape": "23"},
            "E73",
            [f"{RESHAPE} (a list of integers)", "str '23'"],
        ),
        ({"name": "reshape", "shape": [2.5]}, "E73", ["'shape' (", "float 2.5"]),
        ({"name": "reshape", "shape": [True]}, "E73", ["'shape' (", "bool True"]),
        ({"name": "reshape", "shape": [-1, -1]}, "E22", ["'shape' (", "[-1, -1]"]),
        ({"name": "transpose", "axes": [0, 0]}, "E22", ["'axes' (", "[0, 0]"]),
        ({"name": "transpose", "axes": 1}, "E73", ["'axes' (", "int 1"]),
        ({"name": "astype", "dtype": None}, "E73", ["'dtype' (", "a dtype name", "NoneType"]),
        ({"name": "astype", "dtype": "object"}, "E18", ["'dtype' (", "found object"]),
        ({"name": "astype", "dtype": "nope"}, "E13b", ["'dtype' (", "'nope'"]),
        ({"name": "scale", "c": "2"}, "E73", ["'c' (", "a finite number", "str '2'"]),
        ({"name": "scale", "c": float("nan")}, "E19", ["'c' (", "found nan"]),
        ({"name": "scale", "c": [1.0]}, "E73", ["'c' (", "list [1.0]"]),
        ({"name": "scale", "c": [1.0, "x"]}, "E73", ["'c' (", "[1.0, 'x']"]),
        ({"name": "scale", "c": True}, "E73", ["'c' (", "bool True"]),
        ({"name": "fn", "function": 3}, "E20", ["field 'function'", "'module:qualname'", "int 3"]),
        ({"name": "fn", "function": "os.system"}, "E20", ["field 'function'", "'os.system'"]),
        ({"name": "fn", "function": "os:system; rm"}, "E20", ["field 'function'"]),
        ({"name": "chain", "parts": {"name": "T"}}, "E20", ["field 'parts'", "dict {'name'"]),
        ({"name": "chain", "parts": [{"name": "chain", "parts": []}]}, "E20", ["not chains"]),
        ({"name": "chain", "parts": [{"name": "reshape"}]}, "E20", ["the field 'shape'"]),
        ({"name": 3}, "E17", ["unknown transform name 3"]),
        ({"name": ["a"]}, "E17", ["unknown transform name ['a']"]),
        ({"shape": [2]}, "E17", ["a dict with a 'name' field", "dict {'shape': [2]}"]),
        ([("name", "T")], "E17", ["a dict with a 'name' field", "found list"]),
        (None, "E17", ["a dict with a 'name' field", "found NoneType"]),
    ],
    ids=repr,
)
def test_malformed_specs_say_which_field(spec, code, facts):
    kind = st.TieTypeError if code == "E73" else st.TieError  # a wrong type stays a TypeError
    with raises(code, *facts, cls=kind):
        st.transform_from_spec(spec)
    with raises(code, *facts, cls=kind):
        describe_spec(spec)


def test_malformed_spec_message_is_bounded():
    spec = {"name": "reshape", "shape": ["x" * 10_000] * 10_000}
    with raises("E73", "reshape('xxx") as e:
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
    with raises("E21", f"fn({name})", "are none", f"st.load(path, functions={{'{name}': "):
        st.transform_from_spec(spec)
    assert describe_spec(spec) == f"fn({name})"


def test_module_with_side_effect_is_not_imported(side_effect_module):
    name, marker = side_effect_module
    spec = {"name": "chain", "parts": [st.T.spec(), {"name": "fn", "function": f"{name}:f"}]}
    with raises("E21", f"fn({name}:f)", "are none"):
        st.transform_from_spec(spec)
    with raises("E21", f"fn({name}:f)", "are 'other:g'"):
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
    with raises("E73", "functions['jax.numpy:flipud']", "str 'flipud'", cls=st.TieTypeError):
        st.transform_from_spec(spec, functions={"jax.numpy:flipud": "flipud"})
    with raises("E55", "functions=", "found list", cls=st.TieTypeError):
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
        with raises("E21", "fn(os:system)"):
            st.transform_from_spec(unknown, functions=FUNCTIONS)
    finally:
        builtins.__import__, importlib.import_module = real_import, real_import_module
    assert restored == ALL and described[-1] == "fn(os:system)"


@pytest.mark.parametrize("out", [None, "s", (1, 2), {"x": 1}])
def test_fn_that_returns_no_array_is_an_error_not_a_lost_leaf(out):
    # materialize would otherwise put None (a leaf dropped) or a tuple (leaves added) there
    tree = {"a": np.ones((2, 3)), "b": st.Tied("a", st.fn(lambda x: out))}
    for call in (st.materialize, lambda t: st.canonicalize(t).views, jax.jit(st.materialize)):
        with raises("E66", "view 'b'", "fn(", f"found {type(out).__name__}"):
            call(tree)


def test_bad_argument_messages_fit_the_transform_and_stay_short():
    with raises("E73", "reshape(2.0)", "e.g. reshape(2, 3)", cls=st.TieTypeError):
        st.reshape(2.0)
    with raises("E73", "transpose('a')", "e.g. transpose(1, 0)", cls=st.TieTypeError):
        st.transpose("a")
    with raises("E19", "scale(1000") as e:
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
    with raises("E71", "view 'extra/n_heads'", "a scalar (shape (), no axes)", "Fix:") as e:
        st.materialize({"stack": stack, "extra": st.Tied("stack", t)})
    assert "between 0 and -1" not in message(e.value)
    with raises("E71", repr(t), "a scalar (shape (), no axes)"):
        t(np.float32(2.0))


def test_an_uncalled_transform_factory_is_told_to_call_it_with_a_working_example():
    factories = [getattr(st, n) for n in st.__all__ if _transforms.is_factory(getattr(st, n, None))]
    assert {f.__name__ for f in factories} >= {"slice", "index", "transpose", "reshape", "scale"}
    for f in factories:
        with raises("E13", f"st.{f.__name__} makes a transform", cls=st.TieTypeError) as e:
            st.Tied("embed", f)
        msg = str(e.value)
        assert "st.fn(...)" not in msg
        example = re.search(r"e\.g\. (st\..*?)\. See ", msg).group(1)
        assert isinstance(eval(example, {"st": st, "jnp": jnp}), st.Transform), example
    with raises("E13", "Roll is a transform class", "Roll(...)", cls=st.TieTypeError):

        @dataclasses.dataclass(frozen=True)
        class Roll(st.Transform):
            def __call__(self, x):
                return jnp.roll(x, 1)

        st.Tied("embed", Roll)


# pickle.dumps of the list below by sharetree before _transforms became a package (HEAD
# f759f63): it names the classes as sharetree._transforms._Chain, ._Transpose, ._Scale, ...
PICKLED_BEFORE_THE_SPLIT = (
    b"\x80\x04\x95\xaa\x01\x00\x00\x00\x00\x00\x00]\x94(\x8c\x15sharetree._transforms\x94\x8c"
    b"\x06_Chain\x94\x93\x94)\x81\x94}\x94\x8c\x05parts\x94h\x01\x8c\n_Transpose\x94\x93\x94)"
    b"\x81\x94}\x94\x8c\x04axes\x94Nsbh\x01\x8c\x06_Scale\x94\x93\x94)\x81\x94}\x94(\x8c\x01c"
    b"\x94G@\x00\x00\x00\x00\x00\x00\x00\x8c\x04kind\x94\x8c\x08builtins\x94\x8c\x05float\x94"
    b"\x93\x94ub\x86\x94sbh\x01\x8c\x08_Reshape\x94\x93\x94)\x81\x94}\x94\x8c\x05shape\x94K"
    b"\x02K\x03\x86\x94sbh\x01\x8c\x07_AsType\x94\x93\x94)\x81\x94}\x94\x8c\x05dtype\x94\x8c"
    b"\x08bfloat16\x94sbh\x01\x8c\x06_Slice\x94\x93\x94)\x81\x94}\x94(\x8c\x05start\x94K\x00"
    b"\x8c\x04stop\x94K\x01\x8c\x04axis\x94K\x00ubh\x01\x8c\x06_Index\x94\x93\x94)\x81\x94}"
    b"\x94(\x8c\x01i\x94K\x01h(K\x00ubh\x01\x8c\x08identity\x94\x93\x94h\x08)\x81\x94}\x94h"
    b"\x0bK\x01K\x00\x86\x94sbh\x01\x8c\x03_Fn\x94\x93\x94)\x81\x94}\x94\x8c\x08function\x94"
    b"\x8c\x04math\x94\x8c\x04sqrt\x94\x93\x94sb\x8c\x0fsharetree._tied\x94\x8c\x04Tied\x94"
    b"\x93\x94\x8c\x01a\x94\x8c\x01b\x94\x86\x94h\t\x86\x94R\x94e."
)


def test_pickles_written_before_the_split_load():
    back = pickle.loads(PICKLED_BEFORE_THE_SPLIT)
    assert back == [
        st.T >> st.scale(2.0),
        st.reshape(2, 3),
        st.astype(jnp.bfloat16),
        st.slice(0, 1),
        st.index(1),
        st.identity,
        st.transpose(1, 0),
        st.fn(math.sqrt),
        st.Tied("a/b", st.T),
    ]
    assert back[5] is st.identity
    assert pickle.loads(pickle.dumps(back)) == back
