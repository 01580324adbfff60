"""A GAN: two models, two optimizers, two steps that alternate, a loop that ``fit`` cannot express.

The generator maps noise to 2-D points; the discriminator tells them from real points drawn around
``REAL_MEAN``. Each step is a :meth:`mirrorax.MirroredStrategy.jit` function written for the global
batch (the discriminator's step, then the generator's, on the same batch), each with its own state
donated. The noise is part of the data (drawn on the host for every epoch), so every device count draws
the same noise for the same example and the run does not depend on the device count: the weights after
training on 1 device and on 2, 3 or 4 devices, or on 2 processes, agree to float32 rounding (1,030 points:
the last batch holds 30; a batch of 100 does not divide by 3, and each step sees the real rows only).

Run: ``python examples/gan.py``, or ``main(num_devices=3)`` from Python.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mirrorax as mx

REAL_MEAN = np.array([2.0, -1.0], np.float32)
REAL_STD = 0.5
NOISE_DIM = 4


def init_mlp(rng: np.random.Generator, sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """Weights of a tanh MLP with layer sizes ``sizes`` (Glorot-scaled normal, zero biases), on the host."""
    return [{"w": (rng.normal(size=(m, n)) * np.sqrt(2.0 / (m + n))).astype(np.float32),
             "b": np.zeros((n,), np.float32)} for m, n in zip(sizes[:-1], sizes[1:])]


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """The MLP's output for the rows of ``x`` (tanh between layers, linear last layer)."""
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def generator(params: Any, noise: jax.Array) -> jax.Array:
    """Points (``(rows, 2)``) made from noise (``(rows, NOISE_DIM)``)."""
    return mlp(params, noise)


def discriminator(params: Any, points: jax.Array) -> jax.Array:
    """One logit per point: > 0 means "real"."""
    return mlp(params, points)[:, 0]


def real_points(n: int, seed: int = 0) -> np.ndarray:
    """``n`` real points, normal around ``REAL_MEAN``."""
    return (REAL_MEAN + REAL_STD * np.random.default_rng(seed).normal(size=(n, 2))).astype(np.float32)


def main(num_devices: int | None = None, epochs: int = 4, batch_size: int = 100, num_examples: int = 1030,
         seed: int = 0, verbose: bool = True) -> dict[str, Any]:
    """Trains the GAN on ``num_devices`` devices (``None``: all of them).

    Returns:
      ``{"generator": ..., "discriminator": ...}`` (host weights), ``"d_losses"`` and ``"g_losses"`` (the
      mean of each epoch), and ``"fake_means"``: the mean of generated points before training and after
      each epoch (it moves toward ``REAL_MEAN``).
    """
    strategy = mx.MirroredStrategy(devices=None if num_devices is None else jax.devices()[:num_devices])
    d_opt, g_opt = optax.adam(5e-3, b1=0.5), optax.adam(5e-3, b1=0.5)
    rng = np.random.default_rng(seed)
    g_params = init_mlp(rng, [NOISE_DIM, 16, 2])
    d_params = init_mlp(rng, [2, 16, 1])
    g_state = strategy.replicate({"params": g_params, "opt": g_opt.init(g_params)})
    d_state = strategy.replicate({"params": d_params, "opt": d_opt.init(d_params)})
    real = real_points(num_examples, seed)

    @strategy.jit(donate_argnums=0)
    def d_step(d_state, g_params, batch):
        fake = generator(g_params, batch.data["noise"])

        def loss_fn(params):
            # -log D(real) - log(1 - D(fake)), per example, averaged over the real rows.
            per_example = (jax.nn.softplus(-discriminator(params, batch.data["real"]))
                           + jax.nn.softplus(discriminator(params, fake)))
            return mx.compute_average_loss(per_example, batch)

        loss, grads = jax.value_and_grad(loss_fn)(d_state["params"])
        updates, opt = d_opt.update(grads, d_state["opt"], d_state["params"])
        return {"params": optax.apply_updates(d_state["params"], updates), "opt": opt}, loss

    @strategy.jit(donate_argnums=0)
    def g_step(g_state, d_params, batch):
        def loss_fn(params):
            # The non-saturating generator loss: -log D(G(z)).
            logits = discriminator(d_params, generator(params, batch.data["noise"]))
            return mx.compute_average_loss(jax.nn.softplus(-logits), batch)

        loss, grads = jax.value_and_grad(loss_fn)(g_state["params"])
        updates, opt = g_opt.update(grads, g_state["opt"], g_state["params"])
        return {"params": optax.apply_updates(g_state["params"], updates), "opt": opt}, loss

    eval_noise = np.random.default_rng(seed + 10_000).normal(size=(num_examples, NOISE_DIM)).astype(np.float32)

    def fake_mean(g_params) -> np.ndarray:
        """The mean of generated points, computed on the host (numpy) to watch the generator."""
        x, layers = eval_noise, jax.device_get(g_params)
        for layer in layers[:-1]:
            x = np.tanh(x @ layer["w"] + layer["b"])
        return (x @ layers[-1]["w"] + layers[-1]["b"]).mean(axis=0)

    fake_means = [fake_mean(g_state["params"])]
    d_losses, g_losses = [], []
    for epoch in range(epochs):
        # Fresh noise every epoch, drawn per example: the same on any device count.
        noise = np.random.default_rng([seed, epoch]).normal(size=(num_examples, NOISE_DIM)).astype(np.float32)
        data = strategy.experimental_distribute_dataset({"real": real, "noise": noise}, batch_size=batch_size,
                                                        shuffle=True, seed=seed)
        d_epoch, g_epoch = [], []
        for batch in data:
            d_state, d_loss = d_step(d_state, g_state["params"], batch)
            g_state, g_loss = g_step(g_state, d_state["params"], batch)
            d_epoch.append(d_loss)
            g_epoch.append(g_loss)
        d_losses.append(float(np.mean([float(v) for v in d_epoch])))
        g_losses.append(float(np.mean([float(v) for v in g_epoch])))
        fake_means.append(fake_mean(g_state["params"]))
        if verbose:
            print(f"Epoch {epoch}: d_loss {d_losses[-1]:.4f}  g_loss {g_losses[-1]:.4f}  "
                  f"fake mean {np.round(fake_means[-1], 3)} (real {REAL_MEAN})")

    def host(tree):
        return jax.tree.map(np.asarray, tree)

    return {"generator": host(g_state["params"]), "discriminator": host(d_state["params"]),
            "d_losses": d_losses, "g_losses": g_losses, "fake_means": fake_means}


if __name__ == "__main__":
    main()
