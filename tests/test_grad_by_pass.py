"""grad_by_use split by pass: a view that gathers several entries of a buffer.

The reference is the model unrolled by hand: every pass its own copy of the block it
reads (plain arrays, no sharetree), differentiated with ``jax.grad``; the gradient of the
copy used by pass ``p`` is what pass ``p`` contributes to its block.
"""

import jax
import jax.numpy as jnp
import numpy as np
from _examples import examples
from hypothesis import given, settings
from hypothesis import strategies as hs

import sharetree as st

ORDER = (0, 1, 2, 0, 1, 2)  # 6 passes, 3 blocks, cyclic


def _blocks(key, k=3, d=4):
    kw, kb = jax.random.split(key)
    return {"w": jax.random.normal(kw, (k, d, d)) / 2, "b": jax.random.normal(kb, (k, d))}


def _run(layers, x):
    def step(h, layer):
        return jnp.tanh(h @ layer["w"] + layer["b"]), None

    h, _ = jax.lax.scan(step, x, layers)
    return jnp.sum(h**2)


def _unrolled_grads(blocks, x, order=ORDER):
    """The gradient of each pass's own copy: pass p's layer, written out by hand."""
    copies = [{n: v[i] for n, v in blocks.items()} for i in order]

    def loss(copies):
        h = x
        for layer in copies:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.sum(h**2)

    return jax.grad(loss)(copies)


def _placed(g, i, k):
    """``g`` at entry ``i`` of a stack of ``k`` (zeros elsewhere): a pass's share of the blocks."""
    return jnp.zeros((k, *g.shape), g.dtype).at[i].set(g)


def test_each_pass_of_a_take_view_equals_the_unrolled_copy_and_they_sum_to_jax_grad():
    blocks = _blocks(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    tree = {"blocks": blocks, "layers": st.Tied("blocks", st.take(ORDER))}
    calls = []

    def loss(m, x):
        calls.append(1)
        return _run(m["layers"], x)

    by_use = st.grad_by_use(loss)(tree, x)
    assert len(calls) == 1  # one backward pass, however many passes
    unrolled = _unrolled_grads(blocks, x)
    for name in ("w", "b"):
        uses = by_use[f"blocks/{name}"]
        passes = [f"layers/{name}[{p}]" for p in range(len(ORDER))]
        assert set(uses) == {f"blocks/{name}", *passes}
        np.testing.assert_array_equal(uses[f"blocks/{name}"], 0.0)  # the model never reads it
        for p, i in enumerate(ORDER):
            want = _placed(unrolled[p][name], i, 3)
            np.testing.assert_allclose(uses[f"layers/{name}[{p}]"], want, rtol=1e-5, atol=1e-6)
    total = jax.grad(lambda t: _run(st.materialize(t)["layers"], x))(tree)
    for name in ("w", "b"):
        summed = sum(by_use[f"blocks/{name}"].values())
        np.testing.assert_allclose(summed, total["blocks"][name], rtol=1e-5, atol=1e-6)


def test_steps_after_the_gather_are_pulled_back_before_the_split_and_jit_agrees():
    w = jax.random.normal(jax.random.key(2), (2, 3, 5))
    tree = {"w": w, "v": st.Tied("w", st.take((1, 0, 1)) >> st.scale(3.0) >> st.transpose(0, 2, 1))}
    target = jax.random.normal(jax.random.key(3), (3, 5, 3))

    def loss(m):
        return jnp.sum((m["v"] - target) ** 2)

    by_use = st.grad_by_use(loss)(tree)
    jitted = jax.jit(st.grad_by_use(loss))(tree)
    # by hand: v[p] = 3 * w[order[p]].T, so d/dw[order[p]] = 3 * (2 * (v[p] - target[p])).T
    v = 3.0 * np.transpose(np.asarray(w)[[1, 0, 1]], (0, 2, 1))
    for p, i in enumerate((1, 0, 1)):
        want = np.zeros((2, 3, 5), np.float32)
        want[i] = 3.0 * (2.0 * (v[p] - np.asarray(target[p]))).T
        np.testing.assert_allclose(by_use["w"][f"v[{p}]"], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(jitted["w"][f"v[{p}]"], want, rtol=1e-5, atol=1e-5)


def test_per_pass_lora_on_a_take_view_splits_the_base_by_pass():
    blocks = _blocks(jax.random.key(4))
    x = jax.random.normal(jax.random.key(5), (2, 4))
    layers = {n: st.Tied(f"blocks/{n}", st.take(ORDER)) for n in blocks}  # a tie per leaf
    tree = {"blocks": blocks, "layers": layers}
    out = st.add_lora(tree, "layers/w", rank=2, key=jax.random.key(6))
    b = jax.random.normal(jax.random.key(7), out["lora"]["layers"]["w"]["b"].shape)
    out["lora"]["layers"]["w"]["b"] = b  # adapters that are not zero
    by_use = st.grad_by_use(lambda m: _run(m["params"]["layers"], x))(out)
    a = out["lora"]["layers"]["w"]["a"]
    deltas = np.asarray(a @ b)
    # by hand: pass p's weight is block order[p] plus its own a[p] @ b[p]
    copies = {"w": np.stack([blocks["w"][i] + deltas[p] for p, i in enumerate(ORDER)])}
    unrolled = _unrolled_grads({"w": copies["w"], "b": blocks["b"][np.array(ORDER)]}, x, range(6))
    uses = by_use["params/blocks/w"]
    assert {f"params/layers/w[{p}]" for p in range(6)} <= set(uses)
    for p, i in enumerate(ORDER):
        want = _placed(unrolled[p]["w"], i, 3)
        np.testing.assert_allclose(uses[f"params/layers/w[{p}]"], want, rtol=1e-5, atol=1e-6)
    total = jax.grad(lambda t: _run(st.materialize(t)["params"]["layers"], x))(out)
    np.testing.assert_allclose(
        sum(uses.values()), total["params"]["blocks"]["w"], rtol=1e-5, atol=1e-6
    )


def test_a_view_of_several_inputs_reading_one_buffer_twice_is_one_use_per_input():
    w = jnp.array([1.0, 2.0, 3.0])
    v, u = st.Tied({"x": "w", "y": "w"}, st.add()), st.Tied({"p": "w"}, st.add())
    tree = {"w": w, "v": v, "u": u}
    by_use = st.grad_by_use(lambda m: jnp.sum(m["v"] * jnp.array([1.0, 10.0, 100.0])))(tree)
    uses = by_use["w"]
    assert set(uses) == {"w", "v[x]", "v[y]", "u"}  # one input of u reads w: its plain path
    np.testing.assert_array_equal(uses["v[x]"], [1.0, 10.0, 100.0])
    np.testing.assert_array_equal(uses["v[y]"], [1.0, 10.0, 100.0])


def test_report_shows_each_pass():
    blocks = _blocks(jax.random.key(8))
    x = jax.random.normal(jax.random.key(9), (2, 4))
    tree = {"blocks": blocks, "layers": st.Tied("blocks", st.take(ORDER))}
    report = st.grad_report(st.grad_by_use(lambda m: _run(m["layers"], x))(tree))
    uses = report["blocks/w"].uses
    assert [u.path for u in uses][1:] == [f"layers/w[{p}]" for p in range(6)]
    unrolled = _unrolled_grads(blocks, x)
    for p, u in enumerate(uses[1:]):
        np.testing.assert_allclose(u.norm, np.linalg.norm(unrolled[p]["w"]), rtol=1e-5)
    assert "layers/w[5]" in str(report)


def test_a_gather_after_a_reshape_splits_each_copy_of_one_array():
    w = jax.random.normal(jax.random.key(10), (3, 2))
    tree = {"w": w, "copies": st.Tied("w", st.reshape(1, 3, 2) >> st.take((0, 0, 0, 0)))}
    scales = jnp.arange(1.0, 5.0)[:, None, None]

    def loss(m):
        return jnp.sum(scales * m["copies"] ** 2)

    by_use = st.grad_by_use(loss)(tree)
    assert set(by_use["w"]) == {"w", *(f"copies[{e}]" for e in range(4))}
    for e in range(4):  # by hand: copy e contributes 2 * (e + 1) * w
        np.testing.assert_allclose(by_use["w"][f"copies[{e}]"], 2.0 * (e + 1) * w, rtol=1e-6)


@settings(max_examples=examples(40), deadline=None)
@given(
    hs.integers(1, 3).flatmap(
        lambda k: hs.tuples(
            hs.just(k), hs.lists(hs.integers(-k, k - 1), min_size=1, max_size=5), hs.integers(0, 2)
        )
    )
)
def test_each_pass_of_a_take_on_any_axis_is_its_entry_of_the_cotangent_placed_by_numpy(case):
    k, order, axis = case
    shape = [2, 3, 2]
    shape[axis] = k
    w = jnp.asarray(np.random.default_rng(k).standard_normal(shape), jnp.float32)
    out_shape = list(shape)
    out_shape[axis] = len(order)
    weights = jnp.asarray(np.random.default_rng(len(order)).standard_normal(out_shape), jnp.float32)
    tree = {"w": w, "v": st.Tied("w", st.take(order, axis=axis))}
    by_use = st.grad_by_use(lambda m: jnp.sum(weights * m["v"]))(tree)
    g = np.asarray(weights)  # the cotangent of v
    for p, i in enumerate(order):  # by hand: entry p of g, at entry i (mod k) of w
        want = np.zeros(shape, np.float32)
        index = [slice(None)] * 3
        index[axis] = i % k
        src = [slice(None)] * 3
        src[axis] = p
        want[tuple(index)] = g[tuple(src)]
        np.testing.assert_array_equal(by_use["w"][f"v[{p}]"], want)
