"""The small transformer LM of the demo, the examples and the LM benchmark (an untied module).

Its ties are data given to :func:`sharetree.flax.tied`; see docs/integrations.md,
"The demo model".
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import flax.linen as nn
import jax

from sharetree._errors import error
from sharetree._tied import Tied
from sharetree._transforms import T

__all__ = ["HEAD_TIE", "Block", "TinyLM", "block_ties"]

HEAD_TIE: Mapping[str, Tied] = types.MappingProxyType({"head/kernel": Tied("embed/embedding", T)})
"""The output layer is the embedding table, transposed."""


def block_ties(layers: int) -> dict[str, Tied]:
    """Ties that make every block after ``block_0`` a view of it (one block, ``layers`` uses)."""
    return {f"block_{i}": Tied("block_0") for i in range(1, layers)}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP of width ``4 * d_model``."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array) -> jax.Array:
        a = nn.LayerNorm(name="ln_attn")(h)
        h = h + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(a, mask=mask)
        m = nn.LayerNorm(name="ln_mlp")(h)
        m = nn.Dense(4 * self.d_model, name="up")(m)
        return h + nn.Dense(self.d_model, name="down")(nn.gelu(m))


class TinyLM(nn.Module):
    """A decoder-only transformer LM: integer tokens ``(batch, window)`` -> logits ``(..., vocab)``.

    Attributes:
        context: longest window (positions have learned embeddings).
        tie_by_hand: use ``nn.Embed.attend`` as the output layer instead of ``head``.
    """

    vocab: int
    context: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    tie_by_hand: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Next-token logits at every position of ``tokens`` (causal)."""
        window = tokens.shape[-1]
        if window > self.context:
            fix = f"feed at most {self.context} tokens, or build a model with a longer context"
            expected = f"at most context={self.context} tokens"
            raise error("E187", "TinyLM", expected=expected, found=f"a window of {window}", fix=fix)
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
