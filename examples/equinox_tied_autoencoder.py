"""A tied autoencoder in Equinox: the decoder weight is the encoder weight, transposed.

``st.tie(model, {"dec/weight": st.Tied("enc/weight", st.T)})`` puts a leafless
``Tied`` into the ``dec.weight`` field of the ``eqx.nn.Linear``; the model
trains with ``eqx.filter_jit`` / ``eqx.filter_value_and_grad`` and optax, and
``st.materialize`` computes the decoder weight inside the loss.

Run:  python examples/equinox_tied_autoencoder.py            (a few seconds on 2 CPU cores)
      python examples/equinox_tied_autoencoder.py --steps 3  (smoke test)
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import sharetree as st


class AutoEncoder(eqx.Module):
    enc: eqx.nn.Linear
    dec: eqx.nn.Linear

    def __init__(self, din: int, dlatent: int, *, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.enc = eqx.nn.Linear(din, dlatent, key=k1)
        self.dec = eqx.nn.Linear(dlatent, din, key=k2)

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
    model = AutoEncoder(args.din, args.latent, key=jax.random.key(args.seed))
    model = st.tie(model, {"dec/weight": st.Tied("enc/weight", st.T)})
    print("dec.weight ->", model.dec.weight)
    print(st.canonicalize(model))

    tx = optax.adam(args.lr)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x):
        def loss_fn(m):
            m = st.materialize(m)
            return jnp.mean((jax.vmap(m)(x) - x) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    loss = float("nan")
    for i in range(args.steps):
        model, opt_state, loss_arr = step(model, opt_state, x)
        if i % 100 == 0 or i == args.steps - 1:
            loss = float(loss_arr)
            print(f"step {i:4d}  reconstruction mse {loss:.5f}")

    assert model.dec.weight == st.Tied("enc/weight", st.T)  # still tied
    print(f"variance explained: {1 - loss / float(jnp.mean(x**2)):.1%}")
    print(f"final loss {loss:.5f}  ({time.perf_counter() - t0:.1f} s)")
    return loss


if __name__ == "__main__":
    main()
