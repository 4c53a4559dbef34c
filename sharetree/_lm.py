"""The small transformer language model of the demo, the examples and the LM benchmark.

``TinyLM`` is an ordinary Flax linen decoder: token and position embeddings,
pre-norm blocks of causal self-attention and an MLP, a final layer norm and a
``Dense`` output layer named ``head``. The module knows nothing about sharing;
the ties are data given to :func:`sharetree.flax.tied`:

* ``HEAD_TIE`` ties the output layer to the embedding table, transposed
  (``head/kernel = Tied("embed/embedding", T)``), as in GPT-2;
* ``block_ties(layers)`` makes every block after the first a view of the
  first (``block_1 = Tied("block_0")``), ALBERT-style cross-layer sharing.

``TinyLM(..., tie_by_hand=True)`` is the same model tied the way linen users
write it, with ``nn.Embed.attend`` (and no ``head`` parameters): the reference
that ``benchmarks/lm.py`` compares the ``tied`` version against.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import flax.linen as nn
import jax

from sharetree._tied import Tied
from sharetree._transforms import T

__all__ = ["HEAD_TIE", "Block", "TinyLM", "block_ties"]

HEAD_TIE: Mapping[str, Tied] = types.MappingProxyType({"head/kernel": Tied("embed/embedding", T)})
"""The output layer is the embedding table, transposed."""


def block_ties(layers: int) -> dict[str, Tied]:
    """Ties that make every block after ``block_0`` a view of it (one block used ``layers`` times).

    Example:
        >>> from sharetree._lm import block_ties
        >>> block_ties(3)
        {'block_1': Tied('block_0'), 'block_2': Tied('block_0')}
    """
    return {f"block_{i}": Tied("block_0") for i in range(1, layers)}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP of width ``4 * d_model``.

    Attributes:
        d_model: width of the residual stream.
        heads: attention heads (``d_model`` must be divisible by it).
    """

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array) -> jax.Array:
        """``h + attention(h) + mlp(...)`` on ``h`` of shape ``(batch, window, d_model)``."""
        a = nn.LayerNorm(name="ln_attn")(h)
        h = h + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(a, mask=mask)
        m = nn.LayerNorm(name="ln_mlp")(h)
        m = nn.Dense(4 * self.d_model, name="up")(m)
        return h + nn.Dense(self.d_model, name="down")(nn.gelu(m))


class TinyLM(nn.Module):
    """A decoder-only transformer LM: integer tokens ``(batch, window)`` -> logits ``(..., vocab)``.

    Parameters (the ``"params"`` collection): ``embed/embedding`` ``(vocab, d_model)``,
    ``pos`` ``(context, d_model)``, ``block_0`` .. ``block_{layers-1}``, ``ln_f`` and,
    unless ``tie_by_hand``, ``head/kernel`` ``(d_model, vocab)`` (no bias), the
    position that ``HEAD_TIE`` makes a view of the embedding.

    Attributes:
        vocab: number of token ids.
        context: longest window; positions have their own learned embedding.
        d_model: width of embeddings and of the residual stream.
        heads: attention heads per block.
        layers: transformer blocks.
        tie_by_hand: use ``nn.Embed.attend`` as the output layer (the embedding
            tied inside the module) instead of a ``Dense`` head of its own.

    Example:
        >>> import jax, jax.numpy as jnp, sharetree as st
        >>> from sharetree.flax import tied
        >>> from sharetree._lm import HEAD_TIE, TinyLM
        >>> model = tied(TinyLM(vocab=11, context=8, d_model=16, heads=2, layers=1), HEAD_TIE)
        >>> tokens = jnp.zeros((1, 8), jnp.int32)
        >>> params = model.init(jax.random.key(0), tokens)["params"]
        >>> params["head"]
        {'kernel': Tied('embed/embedding', T)}
        >>> model.apply({"params": params}, tokens).shape
        (1, 8, 11)
    """

    vocab: int
    context: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    tie_by_hand: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Next-token logits at every position of ``tokens`` (causal: position ``i`` sees ``<= i``).

        Raises:
            ValueError: a window longer than ``context``.
        """
        window = tokens.shape[-1]
        if window > self.context:
            raise ValueError(
                f"TinyLM: a window of {window} tokens is longer than context={self.context}. "
                f"Fix: feed at most {self.context} tokens, or build a model with a longer context."
            )
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(self.vocab, self.d_model, embedding_init=init, name="embed")
        pos = self.param("pos", init, (self.context, self.d_model))
        h = embed(tokens) + pos[:window]
        mask = nn.make_causal_mask(tokens)
        for i in range(self.layers):
            h = Block(self.d_model, self.heads, name=f"block_{i}")(h, mask)
        h = nn.LayerNorm(name="ln_f")(h)
        if self.tie_by_hand:
            return embed.attend(h)
        return nn.Dense(self.vocab, use_bias=False, name="head")(h)
