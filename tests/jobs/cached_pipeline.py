"""keras.io's ``.cache().prefetch()`` pipelines, evaluated and predicted on in plain Keras and under a
4-device scope, in a process pinned to one core (where a tf.data iterator dropped half-read most often
leaves its cache truncated). Each trial makes the same fresh pipeline for each side: a seeded reshuffling
``shuffle`` before the cache, 400 rows in 13 batches (more than ``prefetch(10)`` reads ahead).

Prints one JSON line per trial: per side, evaluate's list, predict's rows, the rows the pipeline yields
afterwards, and how many times its source generator was started (once per pass that is not read from
the cache). Usage: ``python cached_pipeline.py [TRIALS]``.
"""

import json
import os
import sys

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread starts: they inherit it
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mirrorax as mx  # noqa: E402

ROWS, FEATURES = 400, 8
rng = np.random.default_rng(0)
x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
y = (x @ rng.normal(size=(FEATURES, 1)) > 0).astype(np.float32)


def pipeline(starts):
    def rows():
        starts.append(1)
        yield from zip(x, y)

    spec = (tf.TensorSpec((FEATURES,), tf.float32), tf.TensorSpec((1,), tf.float32))
    ds = tf.data.Dataset.from_generator(rows, output_signature=spec)
    return ds.shuffle(ROWS, seed=1337).batch(32).cache().prefetch(10)


def model():
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(1, activation="sigmoid")])
    m.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
    return m


plain = model()
with mx.MirroredStrategy(devices=jax.devices()[:4]).scope():
    scoped = model()
for m in (plain, scoped):  # the metrics built, as after a fit: Keras reads no batch to build
    m.evaluate(x, y, verbose=0)
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
    out = {}
    for name, m in (("plain", plain), ("scoped", scoped)):
        starts: list[int] = []
        ds = pipeline(starts)
        evaluate = m.evaluate(ds, verbose=0)
        predict = m.predict(ds, verbose=0)
        rows_after = sum(int(b[1].shape[0]) for b in ds)
        out[name] = {"evaluate": evaluate, "predict": predict.ravel().tolist(), "rows_after": rows_after,
                     "generator_runs": len(starts)}
    print(json.dumps(out), flush=True)
