"""Run in its own process (x64 is global): a float64 Dense model, Keras's fit against the Trainer.

Prints one JSON line: the largest absolute weight difference to Keras's float64 single-device fit after
one and after three SGD steps, on 1 and on 4 devices, and the dtypes the trained weights have.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_ENABLE_X64"] = "1"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "4"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", True)

import keras  # noqa: E402
import numpy as np  # noqa: E402

keras.config.set_floatx("float64")

import mirrorax as mx  # noqa: E402


def model(loss: str) -> keras.Model:
    keras.utils.set_random_seed(7)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(4, activation="softmax" if loss != "mse" else None)])
    m.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    return m


def functional(x: np.ndarray, y: np.ndarray) -> dict[str, dict]:
    """A float64 FunctionalModel: one SGD step against the same step written in plain JAX."""
    import jax.numpy as jnp
    import optax

    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(6, 4)), "b": np.zeros(4)}

    def apply(p, xb):
        return xb @ p["w"] + p["b"]

    def loss(p):
        logp = jax.nn.log_softmax(apply(p, x), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    grads = jax.grad(loss)(params)
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    out = {}
    for n in (1, 4):
        m = mx.FunctionalModel(apply, params, loss="sparse_categorical_crossentropy_from_logits",
                               optimizer=optax.sgd(0.5))
        mx.Trainer(m, mx.MirroredStrategy(devices=jax.devices()[:n])).fit(x, y, batch_size=48, epochs=1,
                                                                          shuffle=False, verbose=0)
        diff = max(float(np.max(np.abs(np.asarray(m.params[k]) - np.asarray(want[k])))) for k in params)
        out[f"functional/1step/{n}dev"] = {"diff": diff, "moved": float(np.max(np.abs(want["w"] - params["w"]))),
                                           "dtypes": sorted({np.asarray(a).dtype.name for a in m.params.values()})}
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6))  # float64, as the user has it
    y_cls = rng.integers(0, 4, 48)
    y_reg = rng.normal(size=(48, 4))
    out = {}
    for loss, y in (("sparse_categorical_crossentropy", y_cls), ("mse", y_reg)):
        for steps, bs in ((1, 48), (3, 16)):
            ref = model(loss)
            ref.fit(x, y, batch_size=bs, epochs=1, shuffle=False, verbose=0)
            for n in (1, 4):
                m = model(loss)
                mx.Trainer(m, mx.MirroredStrategy(devices=jax.devices()[:n])).fit(
                    x, y, batch_size=bs, epochs=1, shuffle=False, verbose=0)
                diff = max(float(np.max(np.abs(a - b))) for a, b in zip(m.get_weights(), ref.get_weights()))
                moved = max(float(np.max(np.abs(a - b))) for a, b in zip(m.get_weights(), model(loss).get_weights()))
                out[f"{loss}/{steps}step/{n}dev"] = {"diff": diff, "moved": moved,
                                                     "dtypes": sorted({w.dtype.name for w in m.get_weights()})}
    out.update(functional(x, y_cls))
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
