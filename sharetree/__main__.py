"""Command line: ``python -m sharetree demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import optax

    import sharetree as st

    k1, k2 = jax.random.split(jax.random.key(args.seed))
    x = jax.random.normal(k1, (256, 16)) @ jax.random.normal(k2, (16, 16)) * 0.5
    params = {
        "encoder": {"kernel": 0.1 * jax.random.normal(k1, (16, 4)), "bias": jnp.zeros(4)},
        "decoder": {"kernel": st.Tied("encoder/kernel", st.T), "bias": jnp.zeros(16)},
    }

    def loss(p):
        m = st.materialize(p)
        h = jnp.tanh(x @ m["encoder"]["kernel"] + m["encoder"]["bias"])
        return jnp.mean((h @ m["decoder"]["kernel"] + m["decoder"]["bias"] - x) ** 2)

    opt = optax.adam(args.lr)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    print("tied autoencoder: decoder/kernel = Tied('encoder/kernel', T)")
    for i in range(args.steps):
        params, state, value = step(params, state)
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(value):.4f}")
    g = st.canonicalize(params)
    print(g)
    print(
        f"parameters: {g.size_unique:,} unique vs {g.size_expanded:,} expanded; "
        f"Adam state holds {sum(a.size for a in jax.tree.leaves((state[0].mu, state[0].nu))):,} "
        "moments (2 per unique parameter)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m sharetree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small tied model and show the sharing")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 1:
            parser.error("--steps must be at least 1")
        return _demo(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
