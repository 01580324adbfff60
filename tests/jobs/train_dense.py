"""The multi-process equivalence job: a small Dense model trained deterministically.

``train(strategy)`` is imported by the tests for the 1-process runs; run as a script (under
``mirrorax launch``) it trains on every device of the job and writes what this process got to
``$MP_OUT/rank<R>.npz`` (weights, history, evaluate, predict), so that the test can compare processes.
``MP_DIE=kill:R:E`` / ``MP_DIE=raise:R:E`` make process R die at the end of epoch E (for failure tests).
"""

from __future__ import annotations

import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROWS, FEATURES, CLASSES, BATCH, EPOCHS = 200, 12, 3, 32, 3  # 200 = 6 full batches + 8 padded rows


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES].argmax(axis=1)).astype(np.int32)
    return x, y


class _Die:
    """A Keras-style callback that makes one process die mid-training."""

    def __init__(self, spec: str, process: int) -> None:
        self.mode, rank, epoch = spec.split(":")
        self.rank, self.epoch, self.process = int(rank), int(epoch), process

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.epoch and self.process == self.rank:
            print(f"process {self.process} dies now ({self.mode}) at {time.time():.3f}", flush=True)
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure in process {self.process}")


def train(strategy, *, epochs: int = EPOCHS, verbose: int | str = 0, callbacks=(), width: int = 16
          ) -> dict[str, np.ndarray]:
    """Array inputs (the engine slices each process's rows), shuffled, with validation."""
    import mirrorax as mx

    x, y = data()
    model = _model(strategy, width)
    trainer = mx.Trainer(model, strategy=strategy)
    history = trainer.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=True, seed=3, verbose=verbose,
                          validation_data=(x[:50], y[:50]), callbacks=list(callbacks))
    result = trainer.evaluate(x, y, batch_size=BATCH)
    predictions = trainer.predict(x, batch_size=BATCH)
    return _results(model, history, result, predictions)


def train_unshuffled(strategy, *, pipeline: bool) -> dict[str, np.ndarray]:
    """Unshuffled; with ``pipeline`` each process feeds only its own rows of every global batch through
    ``strategy.distribute_datasets_from_function`` (the last global batch is short: 8 rows)."""
    import mirrorax as mx

    x, y = data()
    model = _model(strategy)
    trainer = mx.Trainer(model, strategy=strategy)
    if pipeline:
        def dataset_fn(ctx):
            rows = ctx.get_per_pipeline_batch_size(BATCH)
            batches = []
            for start in range(0, ROWS, BATCH):
                xb, yb = x[start:start + BATCH], y[start:start + BATCH]
                share = -(-len(xb) // ctx.num_input_pipelines)
                lo = ctx.input_pipeline_id * share
                assert share <= rows
                batches.append((xb[lo:lo + share], yb[lo:lo + share]))
            return batches

        source = strategy.distribute_datasets_from_function(dataset_fn)
        history = trainer.fit(source, batch_size=BATCH, epochs=2, verbose=0)
    else:
        history = trainer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    result = trainer.evaluate(x, y, batch_size=BATCH)
    return _results(model, history, result, trainer.predict(x, batch_size=BATCH))


def _model(strategy, width: int = 16):
    import keras

    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return model


def _results(model, history, result, predictions) -> dict[str, np.ndarray]:
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    out.update({f"h_{k}": np.asarray(v, np.float64) for k, v in history.history.items()})
    out.update({f"e_{k}": np.asarray(v, np.float64) for k, v in result.items()})
    out["predict"] = np.asarray(predictions)
    return out


if __name__ == "__main__":
    import mirrorax as mx

    shard = os.environ.get("MP_SHARD") or None  # "optimizer" / "all": the state split over the 4 devices
    if os.environ.get("MP_MESH") == "hybrid":  # one row per process: shard= within it (HSDP)
        strategy = mx.MultiWorkerMirroredStrategy(mesh=mx.hybrid_mesh(), shard=shard)
    else:
        strategy = mx.MultiWorkerMirroredStrategy(shard=shard)
    print(f"process {strategy.process_index} of {strategy.process_count}: "
          f"{strategy.num_replicas_in_sync} replicas in sync", flush=True)
    if os.environ.get("MP_MESH"):
        kernel = strategy.state_sharding((FEATURES, int(os.environ.get("MP_WIDTH", "16"))), "params")
        print(f"process {strategy.process_index}: mesh {dict(strategy.mesh.shape)}, process axes "
              f"{strategy.process_axes}, batch axes {strategy.batch_axes}, kernel {tuple(kernel.spec)}", flush=True)
    die = [_Die(os.environ["MP_DIE"], strategy.process_index)] if os.environ.get("MP_DIE") else []
    epochs = int(os.environ.get("MP_EPOCHS", EPOCHS))
    result = train(strategy, epochs=epochs, verbose=2, callbacks=die, width=int(os.environ.get("MP_WIDTH", "16")))
    np.savez(os.path.join(os.environ["MP_OUT"], f"rank{strategy.process_index}.npz"), **result)
    if os.environ.get("MP_PIPELINE"):
        result = train_unshuffled(strategy, pipeline=True)
        np.savez(os.path.join(os.environ["MP_OUT"], f"pipeline{strategy.process_index}.npz"), **result)
    print(f"process {strategy.process_index} done", flush=True)
    sys.exit(0)
