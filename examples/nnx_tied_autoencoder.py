"""A tied autoencoder in Flax NNX: the decoder kernel is the encoder kernel, transposed.

``sharetree.nnx.split(model, ties=ties)`` returns a graphdef and a canonical
``nnx.State`` in which ``dec/kernel`` is a leafless ``Tied``; the loss rebuilds
the model with ``sharetree.nnx.merge``, and plain ``jax.grad`` + optax train
the state. ``sharetree.nnx.update`` writes the result back into the model.

Run:  python examples/nnx_tied_autoencoder.py            (a few seconds on 2 CPU cores)
      python examples/nnx_tied_autoencoder.py --steps 3  (smoke test)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sharetree as st
import sharetree.nnx as stnnx


class AutoEncoder(nnx.Module):
    def __init__(self, din: int, dlatent: int, *, rngs: nnx.Rngs) -> None:
        self.enc = nnx.Linear(din, dlatent, rngs=rngs)
        self.dec = nnx.Linear(dlatent, din, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dec(jnp.tanh(self.enc(x)))


def make_data(n: int, din: int, rank: int, seed: int) -> jax.Array:
    """Points near a ``rank``-dimensional subspace of ``R^din``."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((din, rank)))[0]
    x = rng.standard_normal((n, rank)) @ basis.T + 0.01 * rng.standard_normal((n, din))
    return jnp.asarray(x, jnp.float32)


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--din", type=int, default=32)
    ap.add_argument("--latent", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    x = make_data(512, args.din, args.latent, args.seed)
    model = AutoEncoder(args.din, args.latent, rngs=nnx.Rngs(args.seed))
    graphdef, state = stnnx.split(model, ties={"dec/kernel": st.Tied("enc/kernel", st.T)})
    print(jax.tree.map(jnp.shape, state))
    print(st.canonicalize(state))

    tx = optax.adamw(args.lr, weight_decay=1e-4, mask=lambda s: st.mask_by_path(s, "*/kernel"))
    opt_state = tx.init(state)

    @jax.jit
    def step(state, opt_state, x):
        def loss_fn(s):
            return jnp.mean((stnnx.merge(graphdef, s)(x) - x) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    loss = float("nan")
    for i in range(args.steps):
        state, opt_state, loss_arr = step(state, opt_state, x)
        if i % 100 == 0 or i == args.steps - 1:
            loss = float(loss_arr)
            print(f"step {i:4d}  reconstruction mse {loss:.5f}")

    assert state["dec"]["kernel"] == st.Tied("enc/kernel", st.T)  # still tied
    stnnx.update(model, graphdef, state)  # back into the stateful model
    assert np.array_equal(model.dec.kernel[...], model.enc.kernel[...].T)
    print(f"variance explained: {1 - loss / float(jnp.mean(x**2)):.1%}")
    print(f"final loss {loss:.5f}  ({time.perf_counter() - t0:.1f} s)")
    return loss


if __name__ == "__main__":
    main()
