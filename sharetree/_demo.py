"""``python -m sharetree demo``: train the tied character-level LM of ``sharetree._lm``.

Needs the ``demo`` extra (Flax, optax, tqdm); see docs/integrations.md, "The demo model".
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import sys
import time
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sharetree as st
from sharetree._lm import HEAD_TIE, TinyLM, block_ties
from sharetree._tables import format_bytes, saved_percent
from sharetree.flax import TiedModule, tied

PROMPT = "The well "
TEMPERATURE = 0.8


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the demo model and hyperparameters of its training (hashable).

    Attributes:
        layers: blocks applied; blocks after the first are ``Tied`` to the first.
        lr: peak Adam learning rate (linear warm-up, cosine decay).
    """

    context: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 32
    lr: float = 4e-3


class Vocab:
    """Characters <-> integer ids (the sorted set of characters of a text)."""

    def __init__(self, text: str) -> None:
        self.chars = "".join(sorted(set(text)))
        self._index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Ids of ``text``; characters outside the vocabulary are dropped."""
        return np.array([self._index[c] for c in text if c in self._index], np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""
        return "".join(self.chars[int(i)] for i in ids)


def load_corpus() -> str:
    """The demo corpus shipped in ``sharetree/data/corpus.txt``."""
    return (importlib.resources.files("sharetree") / "data" / "corpus.txt").read_text("utf-8")


def make_model(vocab_size: int, cfg: Config) -> TiedModule:
    """``TinyLM`` of ``cfg``'s sizes, its head tied to the embedding and its blocks to the first."""
    lm = TinyLM(vocab_size, cfg.context, cfg.d_model, cfg.heads, cfg.layers)
    return tied(lm, {**HEAD_TIE, **block_ties(cfg.layers)})


def init_params(seed: int, vocab_size: int, cfg: Config) -> dict[str, Any]:
    """The canonical parameter tree of :func:`make_model`, with the ties in place."""
    init = jax.jit(make_model(vocab_size, cfg).init)  # one compilation, not one per op
    return init(jax.random.key(seed), jnp.zeros((1, cfg.context), jnp.int32))["params"]


def loss_fn(model: TiedModule, params: Any, tokens: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy (nats) of ``params`` on ``(batch, window + 1)`` tokens."""
    logp = jax.nn.log_softmax(model.apply({"params": params}, tokens[:, :-1]))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg: Config, params: Any, tokens: jax.Array) -> jax.Array:
    return make_model(params["embed"]["embedding"].shape[0], cfg).apply({"params": params}, tokens)


def _window_logits(cfg: Config, params: Any, ids: np.ndarray | list[int]) -> np.ndarray:
    """Float64 logits ``(context, vocab)`` of ``ids`` zero-padded to ``context`` (causal)."""
    window = np.zeros((1, cfg.context), np.int32)
    window[0, : len(ids)] = ids
    return np.asarray(_logits(cfg, params, jnp.asarray(window)), np.float64)[0]


def evaluate(params: Any, windows: np.ndarray, cfg: Config) -> float:
    """Mean next-character cross-entropy on ``windows`` of ``cfg.context + 1`` ids."""
    total = 0.0
    for w in windows:
        logits = _window_logits(cfg, params, w[:-1])  # log-probabilities: minus logsumexp
        norm = np.logaddexp.reduce(logits, axis=-1, keepdims=True)[:, 0]
        total -= (logits[np.arange(len(w) - 1), w[1:]] - norm).mean()
    return total / len(windows)


def generate(params: Any, vocab: Vocab, cfg: Config, prompt: str, length: int, seed: int) -> str:
    """Sample ``length`` characters after ``prompt`` at ``TEMPERATURE`` (prompt not repeated)."""
    rng = np.random.default_rng(seed)
    ids = list(vocab.encode(prompt)) or [0]
    out: list[int] = []
    for _ in range(length):
        context = (ids + out)[-cfg.context :]
        z = _window_logits(cfg, params, context)[len(context) - 1] / TEMPERATURE
        p = np.exp(z - z.max())
        out.append(int(rng.choice(len(p), p=p / p.sum())))
    return vocab.decode(out)


def run(steps: int, *, seed: int = 0, sample: int = 200, quiet: bool = False) -> Any:
    """Train the demo model with optax Adam; print the losses, what sharing saved and a sample.

    Returns:
        The trained canonical tree (``Tied`` nodes in place): what ``--out`` saves.
    """
    import optax
    from tqdm import tqdm

    cfg, text = Config(), load_corpus()
    print("sharetree demo: a character-level transformer language model with tied weights")
    print(f"  corpus   {len(text):,} characters of sharetree/data/corpus.txt")
    print("  ties     head/kernel = Tied('embed/embedding', T)   output layer = embedding.T")
    print("           block_1     = Tied('block_0')              one block applied twice")
    sys.stdout.flush()  # before the bar starts on stderr
    vocab = Vocab(text)
    data = vocab.encode(text)
    window, split = cfg.context + 1, int(len(data) * 0.9)
    train_data, held_out = jnp.asarray(data[:split]), data[split:]
    starts = np.linspace(0, len(held_out) - window, num=16).astype(int)
    eval_windows = np.stack([held_out[s : s + window] for s in starts])

    model = make_model(len(vocab), cfg)
    params = init_params(seed, len(vocab), cfg)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(1, min(50, steps // 10)), max(2, steps), cfg.lr * 0.1
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = opt.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, i: jax.Array) -> tuple[Any, Any, jax.Array]:
        key = jax.random.fold_in(jax.random.key(seed), i)
        idx = jax.random.randint(key, (cfg.batch,), 0, train_data.shape[0] - window)
        tokens = jax.vmap(lambda j: jax.lax.dynamic_slice(train_data, (j,), (window,)))(idx)
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    initial_eval = evaluate(params, eval_windows, cfg)
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="training", unit="step", file=sys.stderr, disable=quiet)
    for i in bar:
        params, opt_state, loss = step(params, opt_state, np.int32(i))
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    seconds = time.perf_counter() - t0
    final_eval = evaluate(params, eval_windows, cfg)
    print(
        f"held-out loss {initial_eval:.3f} -> {final_eval:.3f} nats/char "
        f"after {steps} steps ({seconds:.1f} s, compilation included)\n"
    )
    g = st.canonicalize(params)
    print(st.summary(g), end="\n\n")
    saved = g.size_expanded - g.size_unique
    print(
        f"parameters: {g.size_unique:,} unique vs {g.size_expanded:,} expanded: sharing saves "
        f"{saved:,} parameters ({saved_percent(g.size_unique, g.size_expanded):.1f}%), "
        f"{format_bytes(g.nbytes_expanded - g.nbytes_unique)} of float32"
    )
    state_size = sum(x.size for x in jax.tree.leaves(opt_state) if jnp.ndim(x) > 0)
    print(
        f"optimizer:  Adam holds {state_size:,} floats (2 per unique parameter), "
        f"not {2 * g.size_expanded:,}"
    )
    if sample:
        text = PROMPT + generate(params, vocab, cfg, PROMPT, sample, seed)
        print(f"\nsample (temperature {TEMPERATURE}):")
        print("\n".join(f"  {line}" for line in text.splitlines()))
    return params
