"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_quick_start_has_the_two_commands():
    text = README.read_text()
    assert 'pip install -e ".[demo]" && python -m sharetree demo' in text
    assert 'pip install -e ".[test]" && python -m pytest' in text


def test_ci_runs_every_test_the_quick_run_skips():
    # the README's command is the quick run (tests/conftest.py); CI's jobs pass --full
    text = " ".join(README.read_text().split())
    assert "`python -m pytest -n 2 --full` runs everything" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "\nALL_TESTS=(--full)\n" in ci
    for job in ("main_job", "lowest_job"):
        body = ci.split(f"\n{job}() {{\n", 1)[1].split("\n}\n", 1)[0]
        assert 'run_pytest -q "${WORKERS[@]}" "${ALL_TESTS[@]}"' in body, job


def test_readme_summary_output_is_what_summary_prints(capsys):
    text = README.read_text()
    pattern = r"```python\n((?:(?!```).)*?print\(st\.summary\(params\)\)\n)```\n\n```text\n(.*?)```"
    code, shown = re.search(pattern, text, re.S).groups()
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out == shown


def _tour():
    text = README.read_text()
    code = re.search(r"## A 20-line tour\n.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    return code, namespace


def test_readme_tour_does_what_its_comments_say():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sharetree as st

    code, ns = _tour()
    params, grads, state = ns["params"], ns["grads"], ns["state"]
    # "84 unique / 148 expanded", "3 buffers, 1 view": counted by hand from the shapes
    assert "84 unique / 148 expanded" in code and "SharingGraph(3 buffers, 1 view;" in code
    unique = 16 * 4 + 4 + 16
    assert unique == 84 and unique + 4 * 16 == 148
    graph = st.canonicalize(params)
    assert (graph.num_unique, graph.num_views) == (3, 1)
    assert (graph.size_unique, graph.size_expanded) == (84, 148)
    assert repr(graph).startswith(
        "SharingGraph(3 buffers, 1 view; params 84 unique / 148 expanded;"
    )
    assert ns["flat"].shape == (84,)  # "84 unique parameters"
    # "Tied kept; encoder/kernel: summed gradient": against an untied copy, by hand
    assert grads["decoder"]["kernel"] == st.Tied("encoder/kernel", st.T)
    x = jnp.ones((8, 16))
    k = jax.random.key(0)
    w0 = jax.random.normal(k, (16, 4))

    def untied(w_enc, w_dec):
        h = jnp.tanh(x @ w_enc + jnp.zeros(4))
        return jnp.mean((h @ w_dec + jnp.zeros(16) - x) ** 2)

    g_enc, g_dec = jax.grad(untied, argnums=(0, 1))(w0, w0.T)
    np.testing.assert_allclose(grads["encoder"]["kernel"], g_enc + g_dec.T, rtol=1e-5, atol=1e-7)
    # "one Adam moment per unique buffer"
    mu = state[0].mu
    assert mu["decoder"]["kernel"] == st.Tied("encoder/kernel", st.T)
    assert sum(m.size for m in jax.tree.leaves(mu)) == 84
    # "still tied": the decoder kernel is no array but the tie, and the update moved the buffer
    assert params["decoder"]["kernel"] == st.Tied("encoder/kernel", st.T)
    assert not np.array_equal(params["encoder"]["kernel"], w0)
    np.testing.assert_array_equal(
        ns["restructure"](ns["flat"])["decoder"]["kernel"], params["encoder"]["kernel"].T
    )
    # "checks shapes": the tie in the last line is checked, a wrong one is an error
    try:
        st.tie({"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3))}, {"b": st.Tied("a", st.T)})
    except st.TieError as e:
        assert "(3, 2)" in str(e) or "[3, 2]" in str(e), e
    else:
        raise AssertionError("a tie with the wrong shape was accepted")
