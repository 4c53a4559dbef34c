"""grad_by_use and grad_report against independent references.

The reference for each contribution is the gradient of an *untied* copy of the
tree (every view an independent array, built by plain recursion in
test_properties, never by sharetree's resolver) at that position, pulled back
by hand through each step of the view's chain (``test_properties._vjp_by_hand``:
``jnp`` written out per step, never sharetree's transforms).
"""

import html.parser
import math
import re
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _examples import examples
from _raises import raises
from hypothesis import given, settings
from test_properties import (
    F32_ATOL,
    F32_RTOL,
    HALF_TOL,
    _get,
    _half,
    _loss,
    _names,
    _reference,
    _vjp_by_hand,
    tied_trees,
)

import sharetree as st


def _by_use_reference(tree, canonical, table):
    """{buffer: {use: contribution}} from an untied copy, pulled back through each view by hand."""
    expected, views = _reference(tree, table)
    g_untied = jax.grad(_loss)(expected)
    ref = {}
    for kp, _ in jax.tree_util.tree_flatten_with_path(canonical)[0]:
        path = _names(kp)
        ref["/".join(path)] = {"/".join(path): _get(g_untied, path)}
    for target, bpath, chain in views:
        pulled = _vjp_by_hand(chain, _get(tree, bpath), _get(g_untied, target))
        ref["/".join(bpath)]["/".join(target)] = pulled
    return ref, views


@settings(max_examples=examples(120), deadline=None)
@given(tied_trees())
def test_each_use_equals_the_untied_gradient_pulled_back_and_they_sum_to_jax_grad(case):
    tree, canonical, table = case
    reference, views = _by_use_reference(tree, canonical, table)
    by_use = st.grad_by_use(_loss)(canonical)
    assert list(by_use) == list(reference)  # every buffer, in flatten order
    rtol, atol = (HALF_TOL, HALF_TOL) if _half(views) else (F32_RTOL, F32_ATOL)
    for buffer, uses in reference.items():
        assert set(by_use[buffer]) == set(uses)
        for use, g in uses.items():
            got = by_use[buffer][use]
            assert (
                got.shape == g.shape and got.dtype == g.dtype == _get(tree, buffer.split("/")).dtype
            )
            np.testing.assert_allclose(got, g, rtol=rtol, atol=atol)
    accumulated = jax.grad(lambda t: _loss(st.materialize(t)))(canonical)
    for kp, g in jax.tree_util.tree_flatten_with_path(accumulated)[0]:
        total = sum(by_use["/".join(_names(kp))].values())
        np.testing.assert_allclose(total, g, rtol=rtol, atol=atol)


@settings(max_examples=examples(100), deadline=None)
@given(tied_trees())
def test_under_jit_equals_eager(case):
    tree, canonical, table = case
    _, views = _reference(tree, table)
    eager = st.grad_by_use(_loss)(canonical)
    jitted = jax.jit(st.grad_by_use(_loss))(canonical)
    assert jax.tree.structure(jitted) == jax.tree.structure(eager)
    # the same computation; jit may fuse a float16 cast with its neighbours (one rounding
    # placed elsewhere), and float32 sums of sines may be reassociated
    rtol, atol = (HALF_TOL, HALF_TOL) if _half(views) else (F32_RTOL, F32_ATOL)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def _apply(m, x):
    for layer in m["layers"]:
        x = layer["weight"] @ x + layer["bias"][:, None]
    return x


def test_seed_001_chain_of_a_layer_used_twice():
    # Flux: d2 = Dense(d1.weight, d1.bias); c = Chain(d1, d2); gradient of sum(c(x))
    k1, k2 = jax.random.split(jax.random.key(1))
    d1 = {"weight": jax.random.normal(k1, (2, 2)), "bias": jnp.zeros(2)}
    x = jax.random.normal(k2, (2, 1))
    chain = {"layers": [d1, st.Tied("layers/0")]}
    loss = lambda m, x: _apply(m, x).sum()  # noqa: E731
    by_use = st.grad_by_use(loss)(chain, x)
    # reference: two independent copies (the structural gradient, one entry per location)
    g = jax.grad(loss)({"layers": [dict(d1), dict(d1)]}, x)["layers"]
    for name in ("weight", "bias"):
        uses = by_use[f"layers/0/{name}"]
        assert list(uses) == [f"layers/0/{name}", f"layers/1/{name}"]
        np.testing.assert_allclose(uses[f"layers/0/{name}"], g[0][name], rtol=1e-6)
        np.testing.assert_allclose(uses[f"layers/1/{name}"], g[1][name], rtol=1e-6)
    # by hand: d sum(W h + b) / dW at the second layer is 1 h^T, with h = W x + b
    h = d1["weight"] @ x + d1["bias"][:, None]
    np.testing.assert_allclose(
        by_use["layers/0/weight"]["layers/1/weight"], np.ones((2, 1)) @ h.T, rtol=1e-6
    )
    accumulated = jax.grad(lambda t: loss(st.materialize(t), x))(chain)
    np.testing.assert_allclose(
        sum(by_use["layers/0/weight"].values()), accumulated["layers"][0]["weight"], rtol=1e-6
    )


def test_transforms_pull_back_as_their_vjps_by_hand():
    w = jnp.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]])
    tree = {
        "w": w,
        "t": st.Tied("w", st.T),
        "s": st.Tied("w", st.scale(-3.0)),
        "h": st.Tied("w", st.astype(jnp.float16)),
        "f": st.Tied("w", st.fn(jnp.tanh)),
        "r": st.Tied("w", st.reshape(6)),
    }
    c = {k: jnp.arange(1.0, 7.0).reshape(s) for k, s in [("w", (2, 3)), ("t", (3, 2)), ("r", (6,))]}

    def loss(m):
        return (
            (m["w"] * c["w"]).sum()
            + (m["t"] * c["t"]).sum()
            + (m["s"] ** 2).sum()
            + m["h"].astype(jnp.float32).sum() * 2
            + m["f"].sum()
            + (m["r"] * c["r"]).sum()
        )

    uses = st.grad_by_use(loss)(tree)["w"]
    np.testing.assert_allclose(uses["w"], c["w"])
    np.testing.assert_allclose(uses["t"], c["t"].T)  # VJP of T is T
    np.testing.assert_allclose(uses["s"], -3.0 * (2 * -3.0 * w), rtol=1e-6)  # times c
    assert uses["h"].dtype == jnp.float32  # VJP of astype: a cast back
    np.testing.assert_allclose(uses["h"], 2 * np.ones((2, 3)))
    np.testing.assert_allclose(uses["f"], 1 - np.tanh(w) ** 2, rtol=1e-5, atol=1e-6)  # jax.vjp of f
    np.testing.assert_allclose(uses["r"], c["r"].reshape(2, 3))
    assert all(g.shape == w.shape for g in uses.values())


def test_fun_is_differentiated_once_not_once_per_use():
    calls = []
    tree = {"w": jnp.ones(3), **{f"v{i}": st.Tied("w", st.scale(float(i + 1))) for i in range(5)}}

    def loss(m):
        calls.append(1)
        return sum(jnp.sum(x) for x in jax.tree.leaves(m))

    by_use = st.grad_by_use(loss)(tree)
    assert len(calls) == 1 and len(by_use["w"]) == 6
    np.testing.assert_allclose(by_use["w"]["v3"], 4.0 * np.ones(3))


def test_has_aux_argnums_and_kwargs():
    tree = {"a": jnp.array([1.0, 2.0]), "b": st.Tied("a", st.scale(2.0))}

    def loss(x, m, *, k):
        return (m["a"] * x).sum() + k * m["b"].sum(), {"k": k}

    by_use, aux = st.grad_by_use(loss, argnums=1, has_aux=True)(jnp.array([3.0, 4.0]), tree, k=5.0)
    assert aux == {"k": 5.0}
    np.testing.assert_allclose(by_use["a"]["a"], [3.0, 4.0])
    np.testing.assert_allclose(by_use["a"]["b"], [10.0, 10.0])


def test_tree_without_ties_has_one_use_per_buffer():
    tree = {"a": jnp.array([1.0, 2.0]), "b": jnp.array(3.0)}
    loss = lambda m: (m["a"] ** 2).sum() + m["b"]  # noqa: E731
    by_use = st.grad_by_use(loss)(tree)
    assert by_use.keys() == {"a", "b"} and all(len(u) == 1 for u in by_use.values())
    np.testing.assert_allclose(by_use["a"]["a"], jax.grad(loss)(tree)["a"])
    text = str(st.grad_report(by_use))
    assert "no buffer has more than one use (nothing is tied)" in text


def test_non_scalar_output_is_jax_grads_own_error():
    tree = {"a": jnp.ones(2), "b": st.Tied("a")}
    with pytest.raises(TypeError, match="Gradient only defined for scalar-output functions"):
        st.grad_by_use(lambda m: m["a"] + m["b"])(tree)


def test_flax_tied_module_apply_as_fun():
    pytest.importorskip("flax")
    import flax.linen as nn

    from sharetree.flax import tied

    class AE(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(3, use_bias=False, name="enc")(x)
            return nn.Dense(4, use_bias=False, name="dec")(jnp.tanh(h))

    model = tied(AE(), {"dec/kernel": st.Tied("enc/kernel", st.T)})
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    params = model.init(jax.random.key(0), x)["params"]
    loss = lambda p: ((model.apply({"params": p}, x) - x) ** 2).sum()  # noqa: E731
    by_use = st.grad_by_use(loss)(params)
    assert list(by_use["enc/kernel"]) == ["dec/kernel", "enc/kernel"]
    np.testing.assert_allclose(
        sum(by_use["enc/kernel"].values()), jax.grad(loss)(params)["enc"]["kernel"], rtol=1e-5
    )


# ---------------------------------------------------------------------------
# grad_report


def _np_cos(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return a @ b / (np.sqrt(a @ a) * np.sqrt(b @ b))


def test_report_numbers_equal_numpy():
    rng = np.random.default_rng(3)
    uses = {p: rng.normal(size=(3, 2)).astype(np.float32) for p in ("e", "head", "aux")}
    report = st.grad_report({"e": uses, "b": {"b": np.ones(2)}})
    e = report["e"]
    norms = {p: float(np.sqrt(np.sum(np.square(g, dtype=np.float64)))) for p, g in uses.items()}
    for u in e.uses:
        assert math.isclose(u.norm, norms[u.path], rel_tol=1e-12)
        assert math.isclose(u.share, norms[u.path] / sum(norms.values()), rel_tol=1e-12)
        rest = sum(g.astype(np.float64) for p, g in uses.items() if p != u.path)
        assert math.isclose(u.cos_rest, _np_cos(uses[u.path], rest), rel_tol=1e-9)
    names = [u.path for u in e.uses]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            assert math.isclose(e.cosines[i][j], _np_cos(uses[a], uses[b]), rel_tol=1e-9)
    total = sum(g.astype(np.float64) for g in uses.values())
    assert math.isclose(e.norm, float(np.linalg.norm(total)), rel_tol=1e-12)
    assert report["b"].uses[0].cos_rest is None and [b.path for b in report.shared] == ["e"]
    text = str(report)
    assert f"{norms['head']:.4g}" in text and "1 buffer with one use each: b" in text


def test_report_of_bfloat16_parameters_equals_numpy_in_float64():
    params = {
        "embed": jnp.arange(6, dtype=jnp.bfloat16).reshape(3, 2),
        "head": st.Tied("embed", st.T),
    }

    def loss(m):
        return jnp.sum(m["embed"].astype(jnp.float32) ** 2) + jnp.sum(m["head"].astype(jnp.float32))

    by_use = st.grad_by_use(loss)(params)
    report = st.grad_report(by_use)
    (buffer,) = report.buffers
    uses = {u.path: u.norm for u in buffer.uses}
    by_hand = 2 * np.arange(6.0).reshape(3, 2)  # d/de sum(e**2); the head's use is all ones
    assert uses["embed"] == pytest.approx(np.linalg.norm(by_hand))
    assert uses["head"] == pytest.approx(np.sqrt(6.0))


def test_report_two_uses_that_fight():
    tree = {"embed": jnp.array([[1.0, 2.0]]), "head": st.Tied("embed", st.T)}
    report = st.grad_report(st.grad_by_use(lambda m: m["embed"].sum() - 3 * m["head"].sum())(tree))
    (head,) = [u for u in report["embed"].uses if u.path == "head"]
    assert head.cos_rest == pytest.approx(-1.0) and head.share == pytest.approx(0.75)
    assert 'fill="#dc2626"' in report._repr_html_()  # red: the use fights the other


class _Checker(html.parser.HTMLParser):
    VOID = frozenset({"br", "img", "hr", "meta", "input"})

    def __init__(self):
        super().__init__()
        self.stack = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack, tag)
        self.stack.pop()


def test_report_html_is_well_formed_and_escaped():
    rng = np.random.default_rng(0)
    by_use = {
        "w<b>": {"w<b>": rng.normal(size=4), "v&1": rng.normal(size=4)},
        "x": {"x": np.ones(1)},
    }
    page = st.grad_report(by_use)._repr_html_()
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert not checker.stack
    assert "w&lt;b&gt;" in page and "<b>w<b>" not in page and "v&amp;1" in page
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 1
    root = ET.fromstring(svgs[0])
    bars = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")]
    assert len(bars) == 2
    report = st.grad_report(by_use)
    widths = sorted(float(r.get("width")) for r in bars)
    shares = sorted(u.share for u in report["w<b>"].uses)
    np.testing.assert_allclose(widths, [220 * s for s in shares], atol=0.06)


def test_report_cuts_after_max_rows():
    by_use = {f"b{i}": {f"b{i}": np.ones(2), f"v{i}": np.ones(2)} for i in range(5)}
    text = str(st.grad_report(by_use, max_rows=2))
    assert "b1: 2 uses" in text and "b2: 2 uses" not in text
    assert "... and 3 more buffers used in several places" in text


def test_report_errors():
    with raises("E27", "grad_report", "found list [1, 2]", cls=st.TieTypeError):
        st.grad_report([1, 2])
    with raises("E27", "buffer 'a'", "different sizes", "'a': 2", "'b': 3"):
        st.grad_report({"a": {"a": np.ones(2), "b": np.ones(3)}})
    with raises("E27", "buffer 'a'", "contribution of 'a'", "outside jit"):
        jax.jit(lambda g: st.grad_report({"a": {"a": g}}) and 0)(jnp.ones(2))


def test_readme_section_output_is_what_the_code_prints(capsys):
    import pathlib

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = text.split("## Which use moves a tied weight?")[1].split("\n## ")[0]
    code, shown = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```", section, re.S).groups()
    (more,) = re.findall(r"```py\n(.*?)```", section, re.S)  # continues the first block
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert capsys.readouterr().out == shown
    exec(compile(more, "README.md", "exec"), namespace)
    assert namespace["untied"]["head"].shape == (8, 10)


def test_summary_with_grads_by_use_ends_with_the_report():
    import jax.numpy as jnp

    tree = {"embed": jnp.array([[1.0, 2.0]]), "head": st.Tied("embed", st.T)}
    by_use = st.grad_by_use(lambda m: m["embed"].sum() - 3 * m["head"].sum())(tree)
    text = st.summary(tree, by_use)
    assert text.startswith(st.summary(tree) + "\n")
    assert text.endswith(str(st.grad_report(by_use)))
    assert "cos(rest)" in text and "-1.000" in text


def test_grad_by_use_names_leaves_without_a_gradient():
    tree = {"w": jnp.ones(2), "v": st.Tied("w"), "step": jnp.array(3), "name": "x"}
    with raises("E67", "leaf 'name'", "floating or complex", "found str"):
        st.grad_by_use(lambda m: m["w"].sum())(tree)
    del tree["name"]
    with raises("E67", "leaf 'step'", "floating or complex", "found int32[]"):
        st.grad_by_use(lambda m: m["w"].sum())(tree)


def test_grad_report_bad_contributions_and_keys():
    with raises("E68", "buffer 'a'", "contribution of 'x'", "<U1"):
        st.grad_report({"a": {"x": np.array(["s"])}})
    with raises("E68", "'/'-joined", "found int 1", cls=st.TieTypeError):
        st.grad_report({1: {"x": np.ones(2)}})
    with pytest.raises(KeyError) as info:
        st.grad_report({"a": {"a": np.ones(2)}})["b"]
    assert "'b'" in str(info.value) and "closest existing path(s): 'a'" in str(info.value)
