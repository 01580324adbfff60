"""The custom-loop examples on several processes: the keras.io JAX guide's loop and the GAN, on uneven data.

Run under ``mirrorax launch`` (``tests/test_multiprocess.py``), each process trains ``examples/keras_io_guide.py``
and ``examples/gan.py`` on every device of the job and writes what it got to ``$MP_OUT/rank<R>.npz``; the test
compares the processes with each other and with one device (``results(1)``, in the test's own process).
``per_example`` adds a ``strategy.run`` step over an uneven dataset: a Keras metric's count and the
predictions gathered across steps (only real rows, every process the same); ``pieces`` the same data unpacked
in the loop (``for x, y in dist``) into ``strategy.jit`` and ``strategy.run``.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
ROWS = 50  # batches of 16, 16, 16 and a short 2 (on 4 devices: 4 rows each, the last batch 2 real rows of 16)


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"mirrorax_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_example(num_devices: int | None) -> dict[str, np.ndarray]:
    """A TF-style evaluation loop per replica: a Keras metric updated in the step (no mask passed) and
    the predictions gathered after each step."""
    import jax
    import keras

    import mirrorax as mx

    strategy = mx.MirroredStrategy(devices=None if num_devices is None else jax.devices()[:num_devices])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(ROWS, 4)).astype(np.float32), rng.integers(0, 3, ROWS).astype(np.int32)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    accuracy = keras.metrics.SparseCategoricalAccuracy()

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        accuracy.update_state(labels, predictions)
        return predictions

    predictions = []
    for batch in strategy.experimental_distribute_dataset((x, y), batch_size=16):
        predictions.append(strategy.gather(strategy.run(test_step, args=(batch,))))
    return {"predictions": np.concatenate(predictions), "count": np.asarray(float(accuracy.count.value)),
            "accuracy": np.asarray(float(accuracy.result()))}


def pieces(num_devices: int | None) -> dict[str, np.ndarray]:
    """Batches unpacked in the loop (``for x, y in dist``): what ``strategy.jit`` computes of each piece, and a
    Keras metric updated in ``strategy.run`` with them (real rows only, every process the same)."""
    import jax
    import jax.numpy as jnp
    import keras

    import mirrorax as mx

    strategy = mx.MirroredStrategy(devices=None if num_devices is None else jax.devices()[:num_devices])
    x = np.arange(1, ROWS + 1, dtype=np.float32)
    y = (np.arange(ROWS) % 3).astype(np.float32)
    mean = keras.metrics.Mean()

    def update(x):
        mean.update_state(x)

    step = strategy.jit(lambda x, y: (jnp.mean(x), jnp.sum(x * y), jnp.asarray(x.shape[0])))
    got, gathered, sums = [], [], []
    for xb, yb in strategy.experimental_distribute_dataset((x, y), batch_size=16):
        got.append(step(xb, yb))
        strategy.run(update, args=(xb,))
        gathered.append(strategy.gather(yb))  # the host's reads of a piece: its real rows only
        sums.append(strategy.reduce("sum", xb, axis=0))
    return {"steps": np.asarray([[float(v) for v in g] for g in got]), "mean": np.asarray(float(mean.result())),
            "count": np.asarray(float(mean.count.value)), "gathered": np.concatenate(gathered),
            "sums": np.asarray(sums)}


def results(num_devices: int | None) -> dict[str, np.ndarray]:
    """Every number the two examples and :func:`per_example` return, flat (``guide_*``, ``gan_*``, ``rows_*``)."""
    import jax

    out: dict[str, np.ndarray] = {}
    guide = example("keras_io_guide").main(num_devices=num_devices, verbose=False)
    gan = example("gan").main(num_devices=num_devices, verbose=False)
    for prefix, tree in (("guide", guide), ("gan", gan), ("rows", per_example(num_devices)),
                         ("pieces", pieces(num_devices))):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[f"{prefix}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return out


if __name__ == "__main__":
    import mirrorax as mx

    strategy = mx.MultiWorkerMirroredStrategy()
    print(f"process {strategy.process_index} of {strategy.process_count}: "
          f"{strategy.num_replicas_in_sync} replicas in sync", flush=True)
    np.savez(os.path.join(os.environ["MP_OUT"], f"rank{strategy.process_index}.npz"), **results(None))
    print(f"process {strategy.process_index} done", flush=True)
    sys.exit(0)
