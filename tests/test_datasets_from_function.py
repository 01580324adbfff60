"""``strategy.distribute_datasets_from_function`` with TF's meaning: a pipeline batched per replica makes
TF's global batch, TF's ``iter`` / ``next`` into ``strategy.run`` works, a pipeline batched per process
keeps working. 2 processes x 2 devices: ``tests/test_tf_multi_worker.py``."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx

pytestmark = pytest.mark.multi_device

ROWS = 1000  # at a global batch of 128: 7 full batches and one of 104


def _dataset_fn(x, y, global_batch, size="replica"):
    import tensorflow as tf

    def dataset_fn(ctx):
        ask = ctx.get_per_replica_batch_size if size == "replica" else ctx.get_per_pipeline_batch_size
        batch = ask(global_batch)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch)

    return dataset_fn


@pytest.mark.parametrize("size", ["replica", "pipeline"])
def test_tfs_iter_next_into_run_takes_the_global_batch_on_4_devices(size):
    # TF's tutorial: iterator = iter(dist); strategy.run(step_fn, args=(next(iterator),)). Batched by
    # get_per_replica_batch_size(128) each of the 4 replicas takes its own 32 rows: global batches of
    # 128 (it was 32, and compute_average_loss(..., global_batch_size=128) divided 32 rows' sum by 128).
    s = strategy(4)
    x, y = np.arange(ROWS, dtype=np.float32)[:, None], np.ones(ROWS, np.float32)
    dist = s.distribute_datasets_from_function(_dataset_fn(x, y, 128, size))
    count = keras.metrics.Sum()

    def step_fn(inputs):
        features, ones = inputs
        count.update_state(ones)
        return mx.compute_average_loss(ones, global_batch_size=128)  # TF's: the real rows' sum / 128

    iterator = iter(dist)
    losses = [float(s.reduce("sum", s.run(step_fn, args=(next(iterator),)), axis=None)) for _ in range(len(dist))]
    with pytest.raises(StopIteration):
        next(iterator)
    assert losses == [1.0] * 7 + [104 / 128]
    assert float(count.result()) == ROWS  # every row once, no padding counted
    firsts = [float(np.asarray(b[0])[0, 0]) for b in dist]
    assert firsts == [0.0, 128.0, 256.0, 384.0, 512.0, 640.0, 768.0, 896.0]  # the rows in order, by global batch


def test_fit_on_a_per_replica_pipeline_trains_keras_global_batches():
    # The same pipeline through Trainer.fit: Keras's fit on the arrays at batch_size=128 (no shuffle).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(4, 1))).astype(np.float32)[:, 0]

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    plain = build()
    want = plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    s = strategy(4)
    with s.scope():
        model = build()
    got = mx.Trainer(model, s).fit(s.distribute_datasets_from_function(_dataset_fn(x, y, 64)), epochs=2,
                                   verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_pipeline_of_replica_batches_that_asks_no_size_is_named_with_both_fixes():
    s = strategy(4)
    x, y = np.zeros((64, 4), np.float32), np.zeros(64, np.float32)
    dist = s.distribute_datasets_from_function(lambda ctx: [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)])
    with pytest.raises(ValueError, match=r"one replica's batch \(64 / 4 replicas\).*get_per_pipeline_batch_size"):
        next(iter(s.experimental_distribute_dataset(dist, batch_size=64)))
