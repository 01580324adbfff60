"""``steps_per_execution="auto"`` on several processes: process 0's choice is every process's.

Run as a script under ``mirrorax launch`` (2 processes x 2 devices), each process forces "auto" to choose
differently (process ``p``: ``k = 4 + 4p``); had each dispatched its own choice, the processes' programs
would differ and the job hang at its first fused step. Each process writes its weights, history and the
steps per execution of each epoch to ``$MP_OUT/auto<R>.npz``; ``train(strategy)`` (``steps_per_execution=1``)
is the test's one-process reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROWS, BATCH, EPOCHS = 8 * 48 + 5, 8, 2  # 49 batches an epoch, the last of 5 rows


def train(strategy, steps_per_execution: int | str = 1) -> dict[str, np.ndarray]:
    import keras

    import mirrorax as mx

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype(np.float32)
    y = (x[:, 0] > x[:, 1]).astype(np.int32)
    keras.backend.clear_session()
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    trainer = mx.Trainer(model, strategy, steps_per_execution=steps_per_execution)
    history = trainer.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, seed=1, verbose=0)
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    out.update({f"h_{k}": np.asarray(v, np.float64) for k, v in history.history.items()})
    out["k"] = np.asarray([u.steps_per_execution for u in trainer.utilisation])
    return out


if __name__ == "__main__":
    import mirrorax as mx
    from mirrorax.fit import meter

    strategy = mx.MultiWorkerMirroredStrategy()
    mine = 4 + 4 * strategy.process_index  # each process would choose another k: process 0's must win
    meter.choose_steps = lambda costs, **kwargs: mine
    meter.keeps_paying = lambda one, fused: True
    result = train(strategy, "auto")
    np.savez(os.path.join(os.environ["MP_OUT"], f"auto{strategy.process_index}.npz"), **result)
    print(f"process {strategy.process_index} done", flush=True)
