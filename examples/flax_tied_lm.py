"""A character-level transformer LM in Flax linen whose output layer is the embedding, transposed.

The model is ``TinyLM`` (``sharetree/_lm.py``, the model of ``python -m
sharetree demo``): an ordinary linen module with a ``Dense`` head of its own,
which knows nothing about tying. ``sharetree.flax.tied`` ties ``head/kernel``
to ``embed/embedding``: the parameters, the gradients, the AdamW state and the
weight-decay mask all hold the table once, and ``TrainState.apply_gradients``
keeps the tie.

Run:  python examples/flax_tied_lm.py            (about 20 s on 2 CPU cores)
      python examples/flax_tied_lm.py --steps 3  (smoke test)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import sharetree as st
from sharetree._lm import TinyLM
from sharetree.flax import tied

TEXT = (
    "A tie is data, not object identity. The decoder kernel is the encoder kernel "
    "transposed, the output layer is the embedding table, and every optimizer sees "
    "each shared buffer exactly once. Gradients from every use are summed by the "
    "chain rule, weight decay is applied once, and a checkpoint stores one copy. "
)


def make_model(vocab: int, dim: int, layers: int, max_len: int):
    lm = TinyLM(vocab, context=max_len, d_model=dim, heads=4, layers=layers)
    return tied(lm, {"head/kernel": st.Tied("embed/embedding", st.T)})


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    chars = sorted(set(TEXT))
    data = np.array([chars.index(c) for c in TEXT], np.int32)
    model = make_model(len(chars), args.dim, args.layers, args.seq)
    params = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, args.seq), jnp.int32))
    params = params["params"]
    print(st.canonicalize(params))
    print("head/kernel ->", params["head"]["kernel"])

    # weight decay on matrices only, chosen by path; the tied head has no leaf, so no entry
    decay = lambda p: st.mask_by_path(p, ["*kernel", "embed"])  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, 0.01, mask=decay))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(args.seed)
    loss = float("nan")
    for i in range(args.steps):
        starts = rng.integers(0, len(data) - args.seq - 1, size=args.batch)
        batch = jnp.asarray(np.stack([data[s : s + args.seq + 1] for s in starts]))
        state, loss_arr = step(state, batch)
        if i % 25 == 0 or i == args.steps - 1:
            loss = float(loss_arr)
            print(f"step {i:4d}  loss {loss:.3f}")

    assert state.params["head"]["kernel"] == st.Tied("embed/embedding", st.T)  # still tied
    adam = state.opt_state[1][0]
    print(
        f"adam moments: {len(jax.tree.leaves(adam.mu))} "
        f"(= {st.canonicalize(state.params).num_unique} unique buffers)"
    )

    prompt = "A tie is "
    tokens = [chars.index(c) for c in prompt]
    apply = jax.jit(state.apply_fn)
    for _ in range(40):
        window = np.zeros((1, args.seq), np.int32)
        ctx = tokens[-args.seq :]
        window[0, : len(ctx)] = ctx
        logits = apply({"params": state.params}, jnp.asarray(window))
        tokens.append(int(jnp.argmax(logits[0, len(ctx) - 1])))
    print("sample:", repr("".join(chars[t] for t in tokens)))
    print(f"final loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)")
    return loss


if __name__ == "__main__":
    main()
