"""The per-call hot path: what a repeated eager call costs, whatever the data.

Two rows, each against its own baseline, side by side (interleaved rounds):

* ``destructure`` of a tree with an 80 MB static (int32) leaf vs the same tree
  with a 32-byte one: static leaves are compared by identity, never by their
  bytes, so the ratio stays near 1 (target <= 2x; it was 530x when every call
  hashed the bytes).
* unflattening 5,000 ``Tied`` vs 5,000 ``None`` (``jax.tree.unflatten`` of a
  list): a ``Tied`` unflattens as itself, without validation (target <= 3x; it
  was 52x when each unflatten re-validated). ``None`` is unflattened by C++
  alone; each ``Tied`` costs one Python call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import sharetree as st
from benchmarks.suite import Section
from benchmarks.timing import interleaved

BIG_STATIC_BYTES = 80 * 2**20
SMALL_STATIC_BYTES = 32
UNFLATTEN_NODES = 5_000
LABEL = "hot path"
"""Shown in the leaves column of the printed tables (these rows have no model size)."""


def _params(static: np.ndarray, name: str) -> dict:
    """Seven 64 x 64 buffers, a transposed view and one static leaf under ``name``.

    The two trees are given different names for their static leaf: a layout is
    kept per structure, and two trees of one structure called in turn would each
    replace the other's (every call a new layout, as for any new structure).
    """
    rng = np.random.default_rng(0)
    tree = {f"l{i}": {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)} for i in range(8)}
    tree["l7"]["w"] = st.Tied("l6/w", st.T)
    tree[name] = static
    return tree


class _Floor:
    """The cheapest custom pytree node: no children, an unflatten that returns its aux data.

    What 5,000 of these cost over 5,000 ``None`` is jaxlib's C++ calling a registered
    Python function once per node, the floor of any custom node's unflatten (``Tied``
    does just this). A C builtin instead (``dict.__getitem__`` on ``{(): node}``)
    measured slower here, not faster.
    """


jax.tree_util.register_pytree_node(_Floor, lambda x: ((), x), lambda aux, children: aux)


def hotpath_section(rounds: int, static_bytes: int = BIG_STATIC_BYTES) -> Section:
    """Repeated ``destructure``, a large vs a small static leaf; unflatten ``Tied`` vs ``None``."""
    sec = Section(None, "hot path")
    big = _params(np.zeros(static_bytes // 4, np.int32), "tokens")
    small = _params(np.zeros(SMALL_STATIC_BYTES // 4, np.int32), "step")
    for name, tree in (("big", big), ("small", small)):
        flat, re = st.destructure(tree)
        back = re(flat)
        sec.check(
            f"destructure ({name} static leaf): restructure gives the static leaf back as it is",
            back.keys() == tree.keys()
            and all(back[k] is tree[k] for k in ("tokens", "step") if k in tree)
            and np.array_equal(back["l7"]["w"], np.asarray(tree["l6"]["w"]).T),
        )
    sec.check(
        "the two trees have the same flat vector",
        np.array_equal(st.destructure(big)[0], st.destructure(small)[0]),
    )
    big_name = f"destructure, {static_bytes / 2**20:.0f} MB static leaf"
    small_name = f"destructure, {SMALL_STATIC_BYTES}-byte static leaf"
    times = interleaved(
        {small_name: lambda: st.destructure(small)[0], big_name: lambda: st.destructure(big)[0]},
        rounds,
        warmup=3,
    )
    sec.add_rows("eager repeated destructure", times, small_name, label=LABEL)
    sec.target(
        "destructure: 80 MB / 32-byte static leaf", times[big_name] / times[small_name], "<=", 2.0
    )

    ties = [st.Tied("a", st.T) for _ in range(UNFLATTEN_NODES)]
    nones = [None] * UNFLATTEN_NODES
    tied_def, none_def = jax.tree.structure(ties), jax.tree.structure(nones)
    sec.check(
        "unflatten gives the same Tied objects back",
        all(a is b for a, b in zip(jax.tree.unflatten(tied_def, []), ties)),
    )
    floors = [_Floor() for _ in range(UNFLATTEN_NODES)]
    floor_def = jax.tree.structure(floors)
    sec.check(
        "the floor node unflattens to the same objects",
        all(a is b for a, b in zip(jax.tree.unflatten(floor_def, []), floors)),
    )
    tied_name = f"unflatten {UNFLATTEN_NODES:,} Tied"
    none_name = f"unflatten {UNFLATTEN_NODES:,} None"
    floor_name = f"unflatten {UNFLATTEN_NODES:,} cheapest custom nodes (floor)"
    times = interleaved(
        {
            none_name: lambda: jax.tree.unflatten(none_def, []),
            floor_name: lambda: jax.tree.unflatten(floor_def, []),
            tied_name: lambda: jax.tree.unflatten(tied_def, []),
        },
        rounds * 10,
        warmup=3,
    )
    sec.add_rows("jax.tree.unflatten", times, none_name, label=LABEL)
    sec.target("unflatten: Tied / None", times[tied_name] / times[none_name], "<=", 3.0)
    sec.target("unflatten: Tied / floor", times[tied_name] / times[floor_name], "<=", 1.2)
    floor = times[floor_name] / times[none_name]
    sec.target("unflatten: floor (cheapest custom node) / None", floor, "<=", 3.0, applies=False)
    for t in sec.targets:
        t["label"] = LABEL
    return sec
