"""TF's multi-worker custom loop on mirrorax, one process of a job (``tests/test_tf_multi_worker.py``).

Run under ``mirrorax launch`` or with a ``TF_CONFIG`` per process, each process does one of:

* ``tutorial CKPT OUT [--epochs E] [--steps S] [--rows R] [--hold-at K --go FILE]``: runs
  ``examples/tf_multi_worker_ctl.py``'s ``main`` and writes its epochs (loss and accuracy at full precision),
  the resolver's answers and the checkpoints found after each epoch to ``OUT/rank<R>.json``. With
  ``--hold-at K`` it prints ``HOLD <pid>`` after its K-th step once the checkpoints written so far are on
  disk, and waits there (for a SIGKILL) until ``FILE`` exists;
* ``rows OUT``: TF's ``dataset_fn`` batched per replica, read with ``iter`` / ``next`` into ``strategy.run``:
  each global batch's real rows and TF's loss of ones (``compute_average_loss(..., global_batch_size)``);
* ``objects CKPT OUT``: an ``mx.Checkpoint`` of a model, an optimizer and a step counter made outside the
  scope, saved along TF's per-worker paths (the chief's directory and ``workertemp_1/``) through an
  ``mx.CheckpointManager`` keeping 2, then restored into fresh objects;
* ``save-and-exit CKPT``: saves a checkpoint as the program's very last act (the test restores it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tf_multi_worker_ctl.py"


def _example():
    spec = importlib.util.spec_from_file_location("mirrorax_example_tf_multi_worker_ctl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _option(name: str, default: str | None = None) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _write(out: str, rank: int, record: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def tutorial(ckpt: str, out: str) -> None:
    import types

    import mirrorax as mx

    example = _example()
    hold_at, go = _option("--hold-at"), _option("--go")
    steps = {"n": 0}
    saved: list[str] = []
    chief_dir = os.path.join(ckpt, "ckpt")

    made = []

    class Strategy(mx.MultiWorkerMirroredStrategy):  # counts the steps, for the handshake
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def run(self, fn, args=(), kwargs=None):
            result = super().run(fn, args, kwargs)
            steps["n"] += 1
            if hold_at is not None and steps["n"] == int(hold_at):
                _hold(chief_dir, go)
            return result

    class CheckpointManager(mx.CheckpointManager):  # records where each epoch's save went
        def save(self, checkpoint_number=None):
            saved.append(super().save(checkpoint_number))
            return saved[-1]

    example.mx = types.SimpleNamespace(**{name: getattr(mx, name) for name in mx.__all__})
    example.mx.MultiWorkerMirroredStrategy, example.mx.CheckpointManager = Strategy, CheckpointManager
    history = example.main(ckpt, num_epochs=int(_option("--epochs", "3")),
                           num_steps_per_epoch=int(_option("--steps", "70")), num_rows=int(_option("--rows", "8910")))
    resolver = made[0].cluster_resolver
    _write(out, made[0].process_index, {
        "history": history, "steps": steps["n"], "saved": saved,
        "resolver": [resolver.task_type, resolver.task_id, resolver.cluster_spec().as_dict()]})


def _hold(chief_dir: str, go: str | None) -> None:
    """Waits for the checkpoints started so far to be on disk (their temporary directories gone), then says
    ``HOLD <pid>`` and waits for the test's SIGKILL (or for ``go``)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and os.path.isdir(chief_dir) and \
            any(".orbax-checkpoint-tmp" in name for name in os.listdir(chief_dir)):
        time.sleep(0.05)
    print(f"HOLD {os.getpid()}", flush=True)
    while go is None or not os.path.exists(go):
        time.sleep(0.05)


def rows(out: str) -> None:
    import tensorflow as tf

    import mirrorax as mx

    strategy = mx.MultiWorkerMirroredStrategy()
    x = np.arange(1000, dtype=np.float32)[:, None]

    def dataset_fn(ctx):
        batch = ctx.get_per_replica_batch_size(128)
        return tf.data.Dataset.from_tensor_slices((x, np.ones(1000, np.float32))).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch)

    def step_fn(inputs):
        features, ones = inputs
        return mx.compute_average_loss(ones, global_batch_size=128), features[:, 0]

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    losses, seen = [], []
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        loss, features = strategy.run(step_fn, args=(batch,))
        losses.append(float(strategy.reduce("sum", loss, axis=None)))
        seen.append(sorted(float(v) for v in strategy.gather(features)))
    _write(out, strategy.process_index, {"losses": losses, "rows": seen})


def objects(ckpt: str, out: str) -> None:
    import keras

    import mirrorax as mx

    strategy = mx.MultiWorkerMirroredStrategy()

    def make(seed):
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            optimizer = keras.optimizers.Adam(0.1)
        epoch = keras.Variable(0, dtype="int32", name="epoch")  # outside the scope: one process's devices
        return model, optimizer, epoch

    model, optimizer, epoch = make(1)
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)

    def step(batch):
        features, targets = batch
        loss_fn = lambda: mx.compute_average_loss(keras.ops.mean((model(features) - targets) ** 2, axis=-1))  # noqa: E731
        _, grads = mx.value_and_grad(loss_fn, model)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    batches = strategy.experimental_distribute_dataset((x, y), batch_size=8)
    r = strategy.cluster_resolver
    own = ckpt if r.task_id == 0 else os.path.join(os.path.dirname(ckpt), f"workertemp_{r.task_id}",
                                                   os.path.basename(ckpt))
    checkpoint = mx.Checkpoint(model=model, optimizer=optimizer, epoch=epoch)
    manager = mx.CheckpointManager(checkpoint, directory=own, max_to_keep=2)
    paths = []
    for _ in range(3):
        for batch in batches:
            strategy.run(step, args=(batch,))
        epoch.assign_add(1)
        paths.append(manager.save())
    latest, kept = manager.latest_checkpoint, manager.checkpoints
    want = [np.asarray(w).tolist() for w in model.get_weights()]
    model2, optimizer2, epoch2 = make(2)
    mx.Checkpoint(model=model2, optimizer=optimizer2, epoch=epoch2).restore(latest)
    _write(out, strategy.process_index, {
        "paths": paths, "latest": latest, "kept": kept, "epoch": int(epoch2.numpy()),
        "weights_equal": [np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(model2.get_weights(), want)],
        "iterations": int(np.asarray(optimizer2.iterations.value)), "own_exists": os.path.isdir(own),
        "own_empty": os.path.isdir(own) and not os.listdir(own)})


def save_and_exit(ckpt: str) -> None:
    import keras

    import mirrorax as mx

    strategy = mx.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(4)])
    step = keras.Variable(41, dtype="int32")
    checkpoint = mx.Checkpoint(model=model, step=step)
    checkpoint.save(ckpt)  # the first save of a directory: on disk when save returns
    step.assign(42)
    model.layers[0].kernel.assign(np.full((64, 256), 0.5, np.float32))
    checkpoint.save(ckpt)  # the program's last act: written in the background, finished at exit
    print(f"saved by process {strategy.process_index}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "tutorial":
        tutorial(sys.argv[2], sys.argv[3])
    elif what == "rows":
        rows(sys.argv[2])
    elif what == "objects":
        objects(sys.argv[2], sys.argv[3])
    elif what == "save-and-exit":
        save_and_exit(sys.argv[2])
    else:
        raise SystemExit(f"unknown job {what!r}")
