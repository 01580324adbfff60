"""Keras's shuffle order on processes whose numpy states differ: every process trains on process 0's.

``train(strategy, numpy_seed)`` is the single-process reference: the weights come from
``keras.utils.set_random_seed(0)``, the shuffle order from ``np.random.seed(numpy_seed)``. Run as a
script (2 processes under ``mirrorax launch``), process ``r`` seeds numpy with ``1000 + r`` and writes
``$MP_OUT/rank<R>.npz`` (its history and final weights).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROWS, BATCH = 96, 24


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 5)).astype(np.float32)
    return x, np.tanh(x @ rng.normal(size=(5, 2))).astype(np.float32)


def train(strategy, numpy_seed: int) -> dict[str, np.ndarray]:
    import keras

    keras.utils.set_random_seed(0)
    np.random.seed(numpy_seed)  # the order Keras's fit draws (the weights come from the seed above)
    with strategy.scope():
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
        m.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x, y = data()
    history = m.fit(x, y, batch_size=BATCH, epochs=2, verbose=0).history
    return {"loss": np.asarray(history["loss"]), **{f"w{i}": np.asarray(w) for i, w in enumerate(m.get_weights())}}


if __name__ == "__main__":
    import mirrorax as mx

    strategy = mx.MirroredStrategy()
    me = strategy.process_index
    np.savez(os.path.join(os.environ["MP_OUT"], f"rank{me}.npz"), **train(strategy, 1000 + me))
    print(f"process {me} done", flush=True)
    sys.exit(0)
