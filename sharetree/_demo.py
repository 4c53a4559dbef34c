"""The ``python -m sharetree demo`` model: a tied character-level language model.

A small causal transformer over a window of characters, in pure JAX, with two
kinds of sharing written as ``Tied`` nodes:

* the output projection is the token embedding transposed
  (``head/kernel = Tied("embed/tokens", T)``), as in GPT-2 and most LMs;
* the second transformer block is the first one again
  (``blocks/1 = Tied("blocks/0")``), ALBERT-style cross-layer sharing.

The training loop is plain ``jax.grad`` + optax on the canonical tree: optax
holds moments for each buffer once, and the gradient of a shared buffer is the
sum over its uses without any extra code. The corpus ships with the package
(``sharetree/data/corpus.txt``, original text dedicated to the public domain).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sharetree as st

__all__ = [
    "Config",
    "Vocab",
    "load_corpus",
    "init_params",
    "forward",
    "loss_fn",
    "evaluate",
    "train",
    "generate",
    "TrainResult",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of the demo model and its training.

    Attributes:
        context: characters per window (the model sees at most this many).
        d_model: width of embeddings and of the residual stream.
        n_heads: attention heads (``d_model`` must be divisible by it).
        d_ff: hidden width of the feed-forward layer.
        n_blocks: transformer blocks applied; blocks after the first are ``Tied``
            to the first (one set of block weights used ``n_blocks`` times).
        batch: windows per training step.
        lr: peak Adam learning rate (linear warm-up, cosine decay).
    """

    context: int = 32
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 192
    n_blocks: int = 2
    batch: int = 32
    lr: float = 4e-3


class Vocab:
    """Characters <-> integer ids (the sorted set of characters of a text).

    Example:
        >>> from sharetree._demo import Vocab
        >>> v = Vocab("hello")
        >>> v.chars, v.encode("hole").tolist(), v.decode([3, 1, 2])
        ('ehlo', [1, 3, 2, 0], 'ohl')
    """

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
    """The demo corpus shipped in ``sharetree/data/corpus.txt`` (about 22 KB)."""
    return (importlib.resources.files("sharetree") / "data" / "corpus.txt").read_text("utf-8")


def init_params(seed: int, vocab_size: int, cfg: Config) -> dict[str, Any]:
    """The canonical parameter tree, with the two ties in place.

    Initialised with NumPy (host arrays, nothing to compile), float32.

    Example:
        >>> import sharetree as st
        >>> from sharetree._demo import Config, init_params
        >>> p = init_params(0, 10, Config(d_model=8, n_heads=2, d_ff=16))
        >>> p["head"]["kernel"], p["blocks"][1]
        (Tied('embed/tokens', T), Tied('blocks/0'))
        >>> st.materialize(p)["head"]["kernel"].shape
        (8, 10)
    """
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
    d, f = cfg.d_model, cfg.d_ff
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, np.float32)

    def norm() -> dict[str, np.ndarray]:
        return {"scale": np.ones(d, np.float32), "bias": zeros(d)}

    out_std = 0.02 / math.sqrt(2 * cfg.n_blocks)
    block = {
        "ln1": norm(),
        "attn": {"qkv": normal((d, 3 * d), d**-0.5), "out": normal((d, d), out_std)},
        "ln2": norm(),
        "mlp": {
            "w1": normal((d, f), d**-0.5),
            "b1": zeros(f),
            "w2": normal((f, d), out_std),
            "b2": zeros(d),
        },
    }
    return {
        "embed": {
            "tokens": normal((vocab_size, d), 0.02),
            "positions": normal((cfg.context, d), 0.02),
        },
        "blocks": [block] + [st.Tied("blocks/0") for _ in range(cfg.n_blocks - 1)],
        "ln_f": norm(),
        "head": {"kernel": st.Tied("embed/tokens", st.T), "bias": zeros(vocab_size)},
    }


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _attention(x: jax.Array, p: dict[str, jax.Array], n_heads: int) -> jax.Array:
    b, c, d = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, c, n_heads, d // n_heads).transpose(0, 2, 1, 3) for t in (q, k, v))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d // n_heads)
    scores = scores + jnp.where(jnp.tril(jnp.ones((c, c), bool)), 0.0, -1e9)  # causal
    # A hand-written softmax: same values as jax.nn.softmax, a third of its XLA:CPU compile time.
    e = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
    weights = e / e.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, v).transpose(0, 2, 1, 3).reshape(b, c, d)
    return out @ p["out"]


def forward(materialized: dict[str, Any], tokens: jax.Array, n_heads: int) -> jax.Array:
    """Next-character logits ``(batch, window, vocab)`` of a materialized tree."""
    m = materialized
    x = m["embed"]["tokens"][tokens] + m["embed"]["positions"][: tokens.shape[1]]
    for block in m["blocks"]:
        x = x + _attention(_layer_norm(x, block["ln1"]), block["attn"], n_heads)
        h = jax.nn.gelu(_layer_norm(x, block["ln2"]) @ block["mlp"]["w1"] + block["mlp"]["b1"])
        x = x + h @ block["mlp"]["w2"] + block["mlp"]["b2"]
    x = _layer_norm(x, m["ln_f"])
    return x @ m["head"]["kernel"] + m["head"]["bias"]


def loss_fn(params: dict[str, Any], tokens: jax.Array, n_heads: int) -> jax.Array:
    """Mean next-character cross-entropy (nats) of the canonical ``params`` on ``tokens``."""
    logits = forward(st.materialize(params), tokens[:, :-1], n_heads)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


@functools.partial(jax.jit, static_argnums=2)
def _logits(params: dict[str, Any], tokens: jax.Array, n_heads: int) -> jax.Array:
    return forward(st.materialize(params), tokens, n_heads)


def evaluate(params: dict[str, Any], windows: np.ndarray, n_heads: int) -> float:
    """Mean next-character cross-entropy on ``windows`` (one window at a time).

    One window at a time, so that evaluation and :func:`generate` share one
    compiled forward pass of shape ``(1, context)``.
    """
    total = 0.0
    for w in windows:
        logits = np.asarray(_logits(params, jnp.asarray(w[None, :-1]), n_heads), np.float64)[0]
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total += -logp[np.arange(len(w) - 1), w[1:]].mean()
    return total / len(windows)


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        params: the trained canonical tree (``Tied`` nodes in place).
        vocab: the character vocabulary.
        cfg: the configuration used.
        losses: the training loss at every step.
        initial_eval: loss on a fixed held-out batch before training.
        final_eval: the same after training.
        seconds: wall time of the training loop (compilation included).
        opt_state_size: number of floats in the optimizer state.
    """

    params: dict[str, Any]
    vocab: Vocab
    cfg: Config
    losses: list[float]
    initial_eval: float
    final_eval: float
    seconds: float
    opt_state_size: int


def train(
    steps: int,
    *,
    seed: int = 0,
    cfg: Config | None = None,
    text: str | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train the demo model with optax Adam on the canonical tree.

    Args:
        steps: optimisation steps.
        seed: seed of the initialisation and of the batches.
        cfg: hyperparameters (``Config()`` by default).
        text: the corpus (the shipped one by default). The last 10% is held
            out for ``initial_eval`` / ``final_eval``.
        progress: called after each step with ``(step, loss)``.

    Returns:
        A :class:`TrainResult`.
    """
    import optax

    cfg = cfg or Config()
    text = load_corpus() if text is None else text
    vocab = Vocab(text)
    data = vocab.encode(text)
    window = cfg.context + 1
    split = int(len(data) * 0.9)
    if split - window < 1 or len(data) - split < window:
        raise ValueError(
            f"the corpus has {len(data)} characters; it needs at least "
            f"{10 * (window + 1)} for windows of {window}"
        )
    train_data, held_out = jnp.asarray(data[:split]), data[split:]
    starts = np.linspace(0, len(held_out) - window, num=16).astype(int)
    eval_windows = np.stack([held_out[s : s + window] for s in starts])

    params = jax.device_put(init_params(seed, len(vocab), cfg))  # ties survive device_put
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(1, min(50, steps // 10)), max(2, steps), cfg.lr * 0.1
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = opt.init(params)
    n_heads = cfg.n_heads
    base_key = jax.random.key(seed)

    @jax.jit
    def step(params: Any, opt_state: Any, i: jax.Array) -> tuple[Any, Any, jax.Array]:
        key = jax.random.fold_in(base_key, i)
        idx = jax.random.randint(key, (cfg.batch,), 0, train_data.shape[0] - window)
        tokens = jax.vmap(lambda j: jax.lax.dynamic_slice(train_data, (j,), (window,)))(idx)
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, n_heads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    initial_eval = evaluate(params, eval_windows, n_heads)
    losses: list[float] = []
    t0 = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, np.int32(i))
        losses.append(float(loss))
        if progress is not None:
            progress(i, losses[-1])
    seconds = time.perf_counter() - t0
    final_eval = evaluate(params, eval_windows, n_heads)
    state_size = sum(x.size for x in jax.tree.leaves(opt_state) if jnp.ndim(x) > 0)
    return TrainResult(params, vocab, cfg, losses, initial_eval, final_eval, seconds, state_size)


def generate(
    params: dict[str, Any],
    vocab: Vocab,
    cfg: Config,
    prompt: str,
    length: int,
    *,
    seed: int = 0,
    temperature: float = 0.8,
) -> str:
    """Sample ``length`` characters after ``prompt`` (the prompt is not repeated).

    Example:
        >>> import jax
        >>> from sharetree._demo import Config, Vocab, generate, init_params
        >>> cfg = Config(context=8, d_model=8, n_heads=2, d_ff=16)
        >>> vocab = Vocab("abc ")
        >>> out = generate(init_params(0, len(vocab), cfg), vocab, cfg, "ab", 5)
        >>> len(out), set(out) <= set("abc ")
        (5, True)
    """
    n_heads, c = cfg.n_heads, cfg.context
    rng = np.random.default_rng(seed)
    ids = list(vocab.encode(prompt)) or [0]
    out: list[int] = []
    for _ in range(length):
        context = (ids + out)[-c:]
        window = np.zeros((1, c), np.int32)
        window[0, : len(context)] = context  # causal: positions after the last are ignored
        logits = np.asarray(_logits(params, jnp.asarray(window), n_heads), np.float64)
        z = logits[0, len(context) - 1] / temperature
        p = np.exp(z - z.max())
        out.append(int(rng.choice(len(p), p=p / p.sum())))
    return vocab.decode(out)
