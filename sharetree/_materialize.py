"""``materialize``: compute every view of a canonical tree."""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu

from sharetree._graph import expand_leaves, structure_of

__all__ = ["materialize"]


def materialize(tree: Any) -> Any:
    """Replace every ``Tied`` by its value: ``transform(value at ref)``.

    Pure JAX: works under ``jit``, ``grad``, ``vmap`` and ``jvp``, and under
    ``jax.grad(lambda t: loss(materialize(t)))`` the gradient of each buffer
    accumulates over all of its uses. An identity view of an array is the very
    same object as its buffer. A tree without ties is returned as it is.
    Transforms apply to array and number leaves; other leaves (strings, None,
    functions) of a tied subtree are shared as they are.

    Args:
        tree: a canonical tree.

    Returns:
        The materialized tree: same containers, every ``Tied`` replaced.

    Raises:
        TieError: for a bad graph (see :func:`canonicalize`) or a transform
            that fails on its buffer (naming the tie, transform and shape).

    Example:
        >>> import numpy as np, sharetree as st
        >>> w = np.arange(6.0).reshape(2, 3)
        >>> m = st.materialize({"enc": w, "dec": st.Tied("enc", st.T), "same": st.Tied("enc")})
        >>> m["dec"].shape, m["same"] is w
        ((3, 2), True)
    """
    leaves, treedef = jtu.tree_flatten(tree)
    structure = structure_of(treedef)
    if not structure.ties:
        return tree
    return jtu.tree_unflatten(structure.expanded_treedef, expand_leaves(structure, leaves))
