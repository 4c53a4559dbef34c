"""A realistic case: the tied-embedding transformer LM of ``sharetree._lm`` trained with optax.

Two versions of the same model (``TinyLM``, the model of ``python -m sharetree
demo``) and train step:

* ``by hand``: ``TinyLM(..., tie_by_hand=True)``, whose output layer is
  ``nn.Embed.attend`` (logits = h @ E.T), the way linen users tie embeddings today;
* ``sharetree``: ``TinyLM``'s own ``nn.Dense(vocab, use_bias=False, name="head")``
  with its kernel tied to the embedding by
  ``sharetree.flax.tied(model, {"head/kernel": st.Tied("embed/embedding", st.T)})``.

Both hold exactly the same parameters (the canonical tree has a ``Tied`` node
where the hand-tied model has nothing) and compute the same loss, gradients
and optax update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import sharetree as st
from sharetree._lm import HEAD_TIE, TinyLM
from sharetree.flax import tied


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Sizes of the language model and of its batch."""

    vocab: int = 512
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    batch: int = 8

    @classmethod
    def tiny(cls) -> LMConfig:
        """A configuration small enough for a smoke test."""
        return cls(vocab=32, d_model=16, heads=2, layers=1, seq=8, batch=2)

    def model(self, *, tie_by_hand: bool = False) -> TinyLM:
        """The ``TinyLM`` of these sizes (context ``seq``)."""
        return TinyLM(self.vocab, self.seq, self.d_model, self.heads, self.layers, tie_by_hand)


def make_step(apply_fn: Callable[..., Any], tx: optax.GradientTransformation) -> Callable:
    """One optax train step: ``(params, opt_state, tokens) -> (params, opt_state, loss, grads)``."""

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        logits = apply_fn({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


@dataclasses.dataclass
class LMCase:
    """Both versions, ready to step: ``steps[name]`` and ``args[name]``."""

    cfg: LMConfig
    steps: dict[str, Callable]
    args: dict[str, tuple[Any, Any, Any]]
    num_params: int
    nbytes_unique: int
    nbytes_expanded: int


def make_case(cfg: LMConfig, seed: int = 0) -> LMCase:
    """Build both versions from one set of initial parameters."""
    hand = cfg.model(tie_by_hand=True)
    shared = tied(cfg.model(), HEAD_TIE)
    key = jax.random.key(seed)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    p_hand = hand.init(key, tokens[:, :-1])["params"]
    p_init = shared.init(key, tokens[:, :-1])["params"]
    # The same values: the canonical tree is the hand-tied tree plus a Tied head.
    p_st = dict(p_hand)
    p_st["head"] = {"kernel": st.Tied("embed/embedding", st.T)}
    if jax.tree.structure(p_st) != jax.tree.structure(dict(p_init)):
        raise AssertionError(
            f"sharetree LM params do not have the structure of tied(...).init: "
            f"{jax.tree.structure(p_st)} vs {jax.tree.structure(dict(p_init))}"
        )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-2))
    graph = st.canonicalize(p_st)
    return LMCase(
        cfg,
        {
            "by hand (Embed.attend)": make_step(hand.apply, tx),
            "sharetree": make_step(shared.apply, tx),
        },
        {
            "by hand (Embed.attend)": (p_hand, tx.init(p_hand), tokens),
            "sharetree": (p_st, tx.init(p_st), tokens),
        },
        graph.size_unique,
        graph.nbytes_unique,
        graph.nbytes_expanded,
    )


def check_equal(case: LMCase, outs: dict[str, Any]) -> dict[str, Any]:
    """Assert both steps give the same loss, gradients and new parameters.

    Returns:
        A small report: the loss and the largest relative differences.
    """
    hand_p, _, hand_loss, hand_g = outs["by hand (Embed.attend)"]
    st_p, _, st_loss, st_g = outs["sharetree"]
    for tree in (st_p, st_g):
        if not isinstance(tree["head"]["kernel"], st.Tied):
            raise AssertionError("sharetree LM step lost the tie at head/kernel")

    def strip(t: Any) -> Any:
        return {k: v for k, v in t.items() if k != "head"}

    def rel(a: Any, b: Any) -> float:
        a_l, b_l = jax.tree.leaves(a), jax.tree.leaves(b)
        if jax.tree.structure(a) != jax.tree.structure(b):
            raise AssertionError("sharetree LM tree structure differs from the hand-tied one")
        scale = max(float(np.max(np.abs(np.asarray(y)))) for y in b_l) + 1e-30
        return (
            max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a_l, b_l))
            / scale
        )

    loss_rel = abs(float(st_loss) - float(hand_loss)) / abs(float(hand_loss))
    grad_rel = rel(strip(st_g), dict(hand_g))
    param_rel = rel(strip(st_p), dict(hand_p))
    if not (loss_rel < 1e-5 and grad_rel < 1e-4 and param_rel < 1e-5):
        raise AssertionError(
            f"LM train step differs: loss rel {loss_rel:.2e}, grads rel {grad_rel:.2e}, "
            f"params rel {param_rel:.2e}"
        )
    return {
        "loss": float(hand_loss),
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,
        "param_rel": param_rel,
    }
