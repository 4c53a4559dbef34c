"""``share_blocks``: a stack of ``L`` layers as ``K`` shared blocks, read cyclically.

Relaxed Recursive Transformers (Bae et al., 2024) convert a trained model into one that
loops over fewer blocks: pass ``l`` reads block ``l mod K``, each block initialised from
the layers (stepwise, average, lower), and per-pass LoRA adapters initialised from the
truncated SVD of each layer's difference to its block restore what sharing lost.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from sharetree._adapters import add_lora
from sharetree._errors import error, short, wrong_type
from sharetree._paths import Path, PathLike, leaves_with_paths, path_str, to_path
from sharetree._resolve import nodes_at
from sharetree._tie import tie
from sharetree._tied import Tied, is_tied
from sharetree._transforms import take

__all__ = ["share_blocks", "block_init"]

Init = Literal["stepwise", "average", "lower"]
_INITS = ("stepwise", "average", "lower")
_FIX_PATH = "pass the path of a subtree whose leaves are arrays stacked on axis 0, one per layer"


def block_init(x: Any, num_blocks: int, init: Init) -> Any:
    """The ``num_blocks`` blocks of one stacked leaf ``x`` (layers on axis 0).

    ``stepwise``: block ``k`` is layer ``k * L // K``; ``average``: the mean of layers
    ``k, k + K, ...`` (the layers that read it); ``lower``: layer ``k``.
    """
    n = np.shape(x)[0]
    if init == "stepwise":
        return x[np.array([k * n // num_blocks for k in range(num_blocks)])]
    if init == "lower":
        return x[:num_blocks]
    readers = (jnp.asarray(x[k::num_blocks], jnp.float32) for k in range(num_blocks))
    return jnp.stack([jnp.mean(r, axis=0) for r in readers]).astype(x.dtype)


def share_blocks(
    tree: Any,
    path: PathLike,
    num_blocks: int,
    *,
    init: Init = "stepwise",
    blocks: PathLike | None = None,
    lora_rank: int | None = None,
    lora_scale: float = 1.0,
) -> Any:
    """Turn the ``L`` stacked layers at ``path`` into ``num_blocks`` shared blocks.

    The blocks (``K`` entries on axis 0 of each leaf) go to ``blocks`` (default: beside
    ``path``, named ``<name>_blocks``) and each leaf at ``path`` becomes
    ``Tied(<its block leaf>, st.take(order))`` with cyclic sharing: pass ``l`` reads
    block ``l mod K``. A scanned model reads the view as it read the stack;
    ``st.grad_by_use`` reports each pass's contribution (``"layers/w[3]"``).

    With ``lora_rank``, every leaf that is a stack of matrices (3 or more axes) gets
    per-pass adapters (:func:`sharetree.add_lora`'s layout) initialised from the
    truncated SVD of each layer's difference to its block, ``W_l - B_{l mod K} = U S
    V^T``: ``a = U_r S_r`` and ``b = V_r^T / lora_scale``. At full rank (``min(rows,
    columns)`` or more) the converted model equals the original; leaves of fewer axes
    (biases, norms) take their block's value.

    Args:
        tree: a dict tree (``Tied`` nodes allowed outside ``path``).
        path: the stacked layers: a leaf or a subtree of arrays with one leading axis ``L``.
        num_blocks: ``K``, between 1 and ``L``.
        init: ``"stepwise"`` (block ``k`` is layer ``k*L//K``), ``"average"`` (the mean of
            the layers that read it) or ``"lower"`` (layer ``k``).
        blocks: where the blocks go (a path that does not exist, in a dict).
        lora_rank: the rank of the per-pass adapters, or ``None`` for none.
        lora_scale: the adapters' scale (``base + lora_scale * a @ b``).

    Returns:
        The tree with the blocks and the views; with ``lora_rank``, ``{"params": that
        tree, "lora": the adapters}`` as :func:`sharetree.add_lora` returns it.

    Raises:
        TieError: a path that is not stacked layers, a bad ``num_blocks``, ``init``,
            ``lora_rank`` or ``blocks``.

    Example:
        >>> import numpy as np, sharetree as st
        >>> tree = {"layers": {"w": np.arange(4.0)[:, None] * np.ones((4, 2))}}
        >>> out = st.share_blocks(tree, "layers", 2, init="average")
        >>> out["layers"]["w"], out["layers_blocks"]["w"][:, 0].tolist()
        (Tied('layers_blocks/w', take((0, 1, 0, 1))), [1.0, 2.0])
    """
    where = f"share_blocks({short(path, 40)})"
    at = to_path(path, "share_blocks path")
    stack = _stack(tree, at, where)
    n = next(iter(stack.values())).shape[0]
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
        fix = f"pass num_blocks=2 (an int from 1 to {n})"
        raise wrong_type("E323", f"{where}: num_blocks", f"an int from 1 to {n}", num_blocks, fix)
    if not 1 <= num_blocks <= n:
        fix = f"pass num_blocks from 1 to {n} (the number of layers)"
        raise error("E323", f"{where}: num_blocks", found=str(num_blocks), fix=fix)
    if init not in _INITS:
        fix = f"pass init= one of {', '.join(map(repr, _INITS))}"
        expected = "an initialisation"
        raise error("E324", f"{where}: init", expected=expected, found=repr(init), fix=fix)
    if lora_rank is not None and (
        isinstance(lora_rank, bool) or not isinstance(lora_rank, (int, np.integer)) or lora_rank < 1
    ):
        fix = "pass lora_rank=8, or None for no adapters"
        raise wrong_type("E324", f"{where}: lora_rank", "None or an int >= 1", lora_rank, fix)
    if isinstance(lora_scale, bool) or not isinstance(lora_scale, (int, float)) or not lora_scale:
        fix = "pass lora_scale=1.0 (LoRA's alpha / rank)"
        raise wrong_type("E324", f"{where}: lora_scale", "a number other than 0", lora_scale, fix)
    dest = at[:-1] + (f"{at[-1]}_blocks",) if blocks is None else to_path(blocks, "blocks")
    order = tuple(i % num_blocks for i in range(n))
    values = {p: block_init(x, int(num_blocks), init) for p, x in stack.items()}
    out = _with_blocks(tree, dest, values, where)
    ties = {at + p: Tied(dest + p, take(order)) for p in stack}
    out = tie(out, ties)
    if lora_rank is None:
        return out
    matrices = [p for p, x in stack.items() if x.ndim >= 3]
    if not matrices:
        fix = "pass lora_rank=None, or choose layers that hold matrices"
        found = ", ".join(f"{path_str(at + p)!r} {x.shape}" for p, x in stack.items())
        problem = "holds no stack of matrices for adapters"
        raise error("E324", f"{where}: lora_rank", problem, found=found, fix=fix)
    chosen = [path_str(at + p) for p in matrices]
    adapted = add_lora(out, chosen, rank=int(lora_rank), key=jax.random.key(0), scale=lora_scale)
    for p in matrices:
        node = adapted["lora"]
        for k in at + p:
            node = node[k]
        node["a"], node["b"] = _svd_factors(stack[p], values[p], order, int(lora_rank), lora_scale)
    return adapted


def _svd_factors(
    layers: Any, blocks: Any, order: tuple[int, ...], rank: int, scale: float
) -> tuple[jax.Array, jax.Array]:
    """``a``, ``b`` with ``scale * a @ b`` the rank-``rank`` truncated SVD of each difference."""
    diff = np.asarray(layers, np.float64) - np.asarray(blocks, np.float64)[np.array(order)]
    u, s, vt = np.linalg.svd(diff, full_matrices=False)
    r = min(rank, s.shape[-1])
    a = np.zeros((*diff.shape[:-1], rank))
    b = np.zeros((*diff.shape[:-2], rank, diff.shape[-1]))
    a[..., :r] = u[..., :r] * s[..., None, :r]
    b[..., :r, :] = vt[..., :r, :] / scale
    return jnp.asarray(a, layers.dtype), jnp.asarray(b, layers.dtype)


def _stack(tree: Any, at: Path, where: str) -> dict[Path, Any]:
    """The leaves at ``at`` by their path below it: arrays of one leading axis ``L``."""
    nodes = nodes_at(tree, at)
    if len(nodes) != 1:
        raise error("E322", where, "names no node of the tree", fix=_FIX_PATH)
    found = nodes[0]
    leaves = dict(leaves_with_paths(found, is_tied))
    bad = next(((p, x) for p, x in leaves.items() if is_tied(x) or np.ndim(x) < 1), None)
    if not leaves or bad is not None:
        p, x = bad if bad is not None else ((), found)
        found_ = f"{path_str(at + p)!r}: {short(x, 60)}"
        expected = "arrays with a leading axis of layers (no Tied inside)"
        raise error("E322", where, expected=expected, found=found_, fix=_FIX_PATH)
    sizes = {p: np.shape(x)[0] for p, x in leaves.items()}
    if len(set(sizes.values())) > 1:
        found_ = ", ".join(f"{path_str(at + p)!r}: {n}" for p, n in sizes.items())
        problem = "has leaves of different numbers of layers (axis 0)"
        raise error("E322", where, problem, found=found_, fix=_FIX_PATH)
    return {p: jnp.asarray(x) for p, x in leaves.items()}


def _with_blocks(tree: Any, dest: Path, values: dict[Path, Any], where: str) -> Any:
    """A copy of the dict ``tree`` with the subtree ``values`` (by path below it) at ``dest``."""
    if not dest:
        raise error("E325", f"{where}: blocks", "is the root", fix="pass a path such as 'blocks'")
    out = dict(tree) if isinstance(tree, dict) else None
    node = out
    for key in dest[:-1]:
        child = node.get(key) if node is not None else None
        if not isinstance(child, dict) or node is None:
            node = None
            break
        node[key] = node = dict(child)
    if node is None or dest[-1] in node:
        problem = "exists already" if node is not None else "is not a key of a dict"
        fix = "pass blocks= a new key of a dict in the tree"
        raise error("E325", f"{where}: blocks {path_str(dest)!r}", problem, fix=fix)
    sub: Any = {} if values.keys() != {()} else values[()]
    for p, v in values.items():
        if not p:
            continue
        leaf = sub
        for key in p[:-1]:
            leaf = leaf.setdefault(key, {})
        leaf[p[-1]] = v
    node[dest[-1]] = sub
    return out
