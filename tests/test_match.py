"""The one tie matcher (sharetree/_match.py), against a brute-force search written here.

The reference compares every array with every earlier view, whole, in NumPy: the first
earlier view (in the order they were added) whose value has the array's shape and dtype
and equal bytes (``atol=0``), or elements within ``atol``. The matcher must find the same
one, reading each array again only to confirm a candidate.
"""

from __future__ import annotations

import hypothesis.strategies as hs
import numpy as np
import pytest
from hypothesis import given

import sharetree as st
from sharetree._match import SAMPLES, Matcher, View, constant


def _by_hand(earlier: list[tuple[View, np.ndarray]], a: np.ndarray, atol: float) -> View | None:
    for view, value in earlier:
        if value.shape != a.shape or value.dtype != a.dtype:
            continue
        if atol == 0.0:
            same = value.tobytes() == np.ascontiguousarray(a).tobytes()
        else:
            same = bool(np.all(np.abs(value.astype(np.float64) - a.astype(np.float64)) <= atol))
        if same:
            return view
    return None


def _run(arrays: list[np.ndarray], transforms, atol: float, keep: bool = False):
    """The matcher's and the reference's first match of each array, as find_ties offers them
    (``keep``: the matcher keeps each view's value instead of reading the array again)."""
    held: dict[int, np.ndarray] = {}
    m = Matcher(None if keep else held.__getitem__, atol)
    earlier: list[tuple[View, np.ndarray]] = []
    got, want = [], []
    for i, a in enumerate(arrays):
        got.append(m.find(a))
        want.append(_by_hand(earlier, a, atol))
        held[i] = a
        for t in transforms:
            if t == st.T and a.ndim != 2:
                continue
            value = t.numpy(a)
            m.add(View(i, t), value)
            earlier.append((View(i, t), np.ascontiguousarray(value)))
    return got, want


@hs.composite
def _arrays(draw):
    """A few small arrays, some copies (as they are, transposed, slightly moved) of others."""
    rng = np.random.default_rng(draw(hs.integers(0, 2**16)))
    shapes = [(2, 3), (3, 2), (4,), (2, 2)]
    out: list[np.ndarray] = []
    for _ in range(draw(hs.integers(1, 8))):
        kind = draw(hs.sampled_from(["new", "copy", "transpose", "moved", "small"]))
        if out and kind in ("copy", "transpose", "moved"):
            a = out[draw(hs.integers(0, len(out) - 1))]
            a = a.T.copy() if kind == "transpose" else a.copy()
            if kind == "moved":
                a = a + np.float32(1e-3)
        else:
            values = rng.integers(0, 3, size=shapes[draw(hs.integers(0, 3))])
            a = values.astype(np.float32)  # few distinct values: samples collide often
        out.append(a)
    return out


@given(_arrays(), hs.sampled_from([0.0, 1e-2]), hs.booleans())
def test_the_matcher_finds_what_a_brute_force_search_finds(arrays, atol, keep):
    got, want = _run(arrays, (st.identity, st.T), atol, keep)
    assert got == want


def test_a_fingerprint_collision_is_compared_whole():
    # two arrays of SAMPLES * 4 elements, equal at every sampled position, different elsewhere
    n = SAMPLES * 4
    a = np.arange(n, dtype=np.float32)
    b = a.copy()
    b[1] = -1.0  # between the first two sampled positions (0 and ~4)
    got, want = _run([a, b, a.copy()], (st.identity,), 0.0)
    assert got == want == [None, None, View(0, st.identity)]


def test_bit_exact_at_atol_zero():
    # -0.0 and 0.0 are equal numbers, not one stored value
    a = np.array([0.0, 1.0, 2.0], np.float32)
    b = np.array([-0.0, 1.0, 2.0], np.float32)
    assert _run([a, b], (st.identity,), 0.0)[0] == [None, None]
    assert _run([a, b], (st.identity,), 1e-9)[0] == [None, View(0, st.identity)]


@pytest.mark.parametrize(
    "a, one",
    [
        (np.zeros((3, 2)), True),
        (np.ones(1), True),
        (np.array([], np.float32), True),
        (np.array([1.0, 1.0 + 1e-7]), False),
        (np.arange(4), False),
    ],
)
def test_a_constant_array_is_one_value(a, one):
    assert constant(a) == one


def test_find_ties_and_inspect_share_the_constant_rule(tmp_path):
    # a fresh bias twice and a norm's ones twice: neither finds a tie; a real copy is found
    from safetensors.numpy import save_file

    from sharetree._files.container import Reader
    from sharetree._files.suggest import suggest_ties

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    sd = {
        "a.bias": np.zeros(4, np.float32),
        "b.bias": np.zeros(4, np.float32),
        "n1": np.ones(4, np.float32),
        "n2": np.ones(4, np.float32),
        "w": w,
        "w2": w.T.copy(),
    }
    assert st.find_ties(sd) == {"w2": st.Tied("w", st.T)}
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    found = [(s.target, s.ref, s.transform, s.why) for s in suggest_ties([Reader(path)], path)]
    assert found == [("w2", "w", st.T, View("w", st.T).why())]
