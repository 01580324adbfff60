"""One state on every process: an *unseeded* Keras model, so each process initialises other weights.

``replay(strategy, start, reset)`` is the single-process reference: it trains from given initial weights
and takes ``reset`` between the two fits. Run as a script (2 processes under ``mirrorax launch``) it
writes ``$MP_OUT/rank<R>.npz``: this process's own initial weights (``init_*``), the weights it sets
between the fits (``reset_*``, different on every process) and the final weights (``final_*``). During
the first fit a batch callback reads the weights on process 0 only, so the processes take different
paths through the loop's "did the model change?" check.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROWS, FEATURES, CLASSES, BATCH = 96, 6, 3, 32


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return x, (x[:, :CLASSES].argmax(axis=1)).astype(np.int32)


def model(strategy):
    import keras

    with strategy.scope():  # no keras.utils.set_random_seed: every process draws its own weights
        m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(CLASSES, activation="softmax")])
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return m


def fit_twice(m, trainer, reset, callbacks=()):
    x, y = data()
    trainer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))
    m.set_weights(reset)
    trainer.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(w) for w in m.get_weights()]


def replay(strategy, start, reset):
    import mirrorax as mx

    m = model(strategy)
    m.set_weights(start)
    return fit_twice(m, mx.Trainer(m, strategy), reset)


if __name__ == "__main__":
    import keras

    import mirrorax as mx

    strategy = mx.MirroredStrategy()
    me = strategy.process_index
    m = model(strategy)
    init = [np.asarray(w) for w in m.get_weights()]
    rng = np.random.default_rng(100 + me)
    reset = [rng.normal(size=w.shape).astype(w.dtype) for w in init]

    class ReadOnPrimary(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if me == 0:
                self.model.get_weights()

    final = fit_twice(m, mx.Trainer(m, strategy), reset, [ReadOnPrimary()])
    out = {f"init_{i}": w for i, w in enumerate(init)}
    out.update({f"reset_{i}": w for i, w in enumerate(reset)})
    out.update({f"final_{i}": w for i, w in enumerate(final)})
    np.savez(os.path.join(os.environ["MP_OUT"], f"rank{me}.npz"), **out)
    print(f"process {me} done", flush=True)
    sys.exit(0)
