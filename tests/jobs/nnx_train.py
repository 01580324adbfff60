"""Flax NNX on several processes: a CNN with BatchNorm and Dropout trained by ``@strategy.jit`` steps and by
``mx.Trainer``, on uneven data.

Run under ``mirrorax launch`` (``tests/test_nnx_multiprocess.py``), each process trains on every device of
the job from arrays every process holds whole, of which each process places only its own rows of each global
batch, and writes what it got to ``$MP_OUT/rank<R>.npz``; the test compares the processes with each other and
with one device (``results`` of a 1-device strategy, in the test's own process).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROWS, BATCH, EPOCHS = 50, 16, 2  # global batches of 16, 16, 16 and a short 2 (on 4 devices: 4 rows each)


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8, 8, 1)).astype(np.float32)
    return {"x": x, "y": np.argmax(x.reshape(ROWS, -1) @ rng.normal(size=(64, 5)), axis=1).astype(np.int32)}


def _cnn(seed: int):
    from flax import nnx

    class CNN(nnx.Module):
        """BatchNorm after a conv without bias (BatchNorm would cancel it) and Dropout with its own
        ``Rngs`` stream; GELU keeps the case well-conditioned (as ``tests/test_nnx.py``'s)."""

        def __init__(self, rngs: nnx.Rngs):
            self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.head = nnx.Linear(8 * 4 * 4, 5, rngs=rngs)

        def __call__(self, x):
            x = nnx.gelu(self.bn(self.conv(x)))
            x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
            return self.head(self.drop(x.reshape(x.shape[0], -1)))

    return CNN(nnx.Rngs(seed))


def _host(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
            for a in jax.tree.leaves(tree)]


def custom_loop(strategy, unpacked: bool = False) -> dict[str, np.ndarray]:
    """Two epochs of ``@strategy.jit`` train and evaluation steps with an ``nnx.Optimizer`` and an
    ``nnx.MultiMetric``: the metrics of each pass, the rows ``Accuracy`` counted, the model and optimizer.
    ``unpacked``: each batch unpacked in the loop (``for x, y in dist``), the steps given ``x, y``."""
    import optax
    from flax import nnx

    model = _cnn(0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

    @strategy.jit
    def train_step(model, optimizer, metrics, batch):
        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])

    @strategy.jit
    def eval_step(model, metrics, batch):
        loss, logits = loss_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])

    @strategy.jit
    def train_step_xy(model, optimizer, metrics, x, y):
        train_step(model, optimizer, metrics, {"x": x, "y": y})

    @strategy.jit
    def eval_step_xy(model, metrics, x, y):
        eval_step(model, metrics, {"x": x, "y": y})

    items = (data()["x"], data()["y"]) if unpacked else data()
    batches = strategy.experimental_distribute_dataset(items, batch_size=BATCH)
    steps = (train_step_xy, eval_step_xy) if unpacked else (train_step, eval_step)
    out: dict[str, list] = {"metrics": [], "counts": []}
    for _ in range(EPOCHS):
        for mode, step, args in (("train", steps[0], (model, optimizer, metrics)), ("eval", steps[1],
                                                                                   (model, metrics))):
            model.train() if mode == "train" else model.eval()
            for batch in batches:
                step(*args, *(batch if unpacked else (batch,)))
            out["metrics"].append([float(v) for _, v in sorted(metrics.compute().items())])
            out["counts"].append(int(metrics.accuracy.count[...]))
            metrics.reset()
    result = {"metrics": np.asarray(out["metrics"]), "counts": np.asarray(out["counts"])}
    result.update({f"state{i}": a for i, a in enumerate(_host(nnx.state((model, optimizer))))})
    return result


def trainer(strategy) -> dict[str, np.ndarray]:
    """``mx.Trainer(module, optimizer=nnx.Optimizer(...))``: two epochs of ``fit`` (unshuffled), ``evaluate``
    and ``predict``; the history, the results and the module's trained variables."""
    import optax
    from flax import nnx

    import mirrorax as mx

    x, y = data()["x"], data()["y"]
    model = _cnn(1)
    fit = mx.Trainer(model, strategy, loss="sparse_categorical_crossentropy_from_logits",
                     optimizer=nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), metrics=["accuracy"])
    history = fit.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    result = {f"history_{k}": np.asarray(v, np.float64) for k, v in history.history.items()}
    result.update({f"evaluate_{k}": np.asarray(v, np.float64)
                   for k, v in fit.evaluate(x, y, batch_size=BATCH, verbose=0).items()})
    result["predict"] = np.asarray(fit.predict(x, batch_size=BATCH, verbose=0))
    result.update({f"model{i}": a for i, a in enumerate(_host(nnx.state(model)))})
    return result


def results(strategy) -> dict[str, np.ndarray]:
    """Every number :func:`custom_loop` (its batches whole and unpacked) and :func:`trainer` return, flat
    (``loop_*``, ``unpacked_*``, ``trainer_*``)."""
    out = {f"loop_{k}": v for k, v in custom_loop(strategy).items()}
    out.update({f"unpacked_{k}": v for k, v in custom_loop(strategy, unpacked=True).items()})
    out.update({f"trainer_{k}": v for k, v in trainer(strategy).items()})
    return out


if __name__ == "__main__":
    import mirrorax as mx

    strategy = mx.MultiWorkerMirroredStrategy()
    print(f"process {strategy.process_index} of {strategy.process_count}: "
          f"{strategy.num_replicas_in_sync} replicas in sync", flush=True)
    out = results(strategy)
    np.savez(os.path.join(os.environ["MP_OUT"], f"rank{strategy.process_index}.npz"), **out)
    print(f"process {strategy.process_index} done", flush=True)
    sys.exit(0)
