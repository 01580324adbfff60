"""The step's loss and metric totals ride one all-reduce operand (mirrorax.batch_sums), and stay exact.

Across processes every all-reduce operand is a round trip of the collective library (about 2.7 ms each
on 2 processes x 4 CPU devices), so the totals are summed per replica and packed; metrics that do not
add up over rows (and losses with other terms) stay in the global view. Each case here compares 8
devices with 1 (where nothing is packed).
"""

from __future__ import annotations

import re

import jax
import keras
import numpy as np
import pytest

import mirrorax as mx
from tests import helpers

pytestmark = pytest.mark.multi_device


def _data(n=100, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 12)).astype("float32")
    y = (x[:, :3].sum(1) > 0).astype("int32") + (x[:, 3] > 1).astype("int32")
    return x, y


def _model(seed=3, regularizer=None, metrics=("accuracy",), weighted=()):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((12,)),
                          keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer),
                          keras.layers.Dense(3)])
    m.compile(optimizer=keras.optimizers.SGD(0.1),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=list(metrics), weighted_metrics=list(weighted))
    return m


class BatchMax(keras.metrics.Metric):
    """Not a sum over rows: per-replica totals would add the replicas' maxima."""

    def __init__(self, name="batch_max", **kw):
        super().__init__(name=name, **kw)
        self.top = self.add_variable(shape=(), initializer="zeros", name="top")

    def update_state(self, y_true, y_pred, sample_weight=None):
        w = 1.0 if sample_weight is None else keras.ops.reshape(sample_weight, (-1, 1))
        self.top.assign(keras.ops.maximum(self.top.value, keras.ops.max(keras.ops.abs(y_pred) * w)))

    def result(self):
        return keras.ops.convert_to_tensor(self.top)


def _train(n, **model_kw):
    x, y = _data()
    w = np.linspace(0.5, 1.5, len(x)).astype("float32")
    trainer = mx.Trainer(_model(**model_kw), helpers.strategy(n))
    # batch 24 over 100 rows: an uneven last batch, padded and masked
    h = trainer.fit(x, y, sample_weight=w, batch_size=24, epochs=2, shuffle=False, verbose=0)
    return h.history, trainer.evaluate(x, y, batch_size=40)


@pytest.mark.parametrize("model_kw", [
    dict(metrics=("accuracy", "sparse_top_k_categorical_accuracy"), weighted=("accuracy",)),
    pytest.param(dict(metrics=("accuracy", BatchMax())), marks=pytest.mark.slow),
    pytest.param(dict(regularizer=keras.regularizers.L2(0.01)), marks=pytest.mark.slow),
], ids=["packed", "not-a-sum", "regularized-loss"])
def test_eight_devices_log_what_one_does(model_kw):
    if "metrics" in model_kw:  # a metric object serves one model: a fresh one for each
        model_kw = dict(model_kw, metrics=tuple(BatchMax() if isinstance(m, BatchMax) else m
                                                 for m in model_kw["metrics"]))
    one, eight = _train(1, **model_kw), _train(8, **model_kw)
    for key, values in one[0].items():
        np.testing.assert_allclose(eight[0][key], values, rtol=2e-6, atol=1e-7, err_msg=key)
    for key, value in one[1].items():
        np.testing.assert_allclose(eight[1][key], value, rtol=2e-6, atol=1e-7, err_msg=key)


def _step_hlo(trainer, x, y):
    """The optimized HLO of the train step ``trainer`` runs on ``(x, y)``."""
    args = helpers.train_step_args(trainer, x, y)  # first: fit selects the step variant ``train`` names
    return trainer.steps.train.lower(*args).compile().as_text()


def _train_step_hlo(n, **model_kw):
    x, y = _data()
    return _step_hlo(mx.Trainer(_model(**model_kw), helpers.strategy(n)), x, y)


def _all_reduce_operands(hlo: str) -> list[str]:
    """The shapes reduced by the program's all-reduces (XLA combines a step's into one instruction)."""
    lines = [line for line in hlo.splitlines() if " all-reduce(" in line]
    return [shape for line in lines
            for shape in re.findall(r"[a-z0-9]+\[[0-9,]*\]", line.split("=", 1)[1].split("all-reduce(")[0])]


def test_loss_and_metrics_take_one_operand_beside_the_gradients():
    # 4 gradients (2 kernels, 2 biases) and one f32[k] of totals: the loss and the two metrics' totals
    # (accuracy's total and count, top-k's total and count).
    operands = _all_reduce_operands(_train_step_hlo(8, metrics=("accuracy", "sparse_top_k_categorical_accuracy")))
    assert len(operands) == 5 and "f32[5]" in operands and "f32[]" not in operands, operands


@pytest.mark.slow
def test_a_loss_with_other_terms_keeps_its_own_reduction():
    # With a regulariser the loss is Keras's global one (its own operand); the metrics are still packed.
    operands = _all_reduce_operands(_train_step_hlo(8, regularizer=keras.regularizers.L2(0.01)))
    assert len(operands) == 6, operands
    assert sum(o == "f32[]" for o in operands) == 1, operands


def test_packing_is_a_sum_of_every_replica():
    from mirrorax import batch_sums

    s = helpers.strategy(8)
    rows = jax.device_put(np.arange(16, dtype=np.float32), s.batch_sharding)
    ints = jax.device_put(np.arange(16, dtype=np.int32), s.batch_sharding)

    @jax.jit
    def f(r, i):
        return batch_sums.per_replica_sums(lambda rr: [rr[0].sum(), rr[1].sum(), (rr[0] ** 2).sum()],
                                           (r, i), (s.mesh, s.batch_axis))

    total, int_total, squares = f(rows, ints)
    hlo = f.lower(rows, ints).compile().as_text()
    assert sorted(_all_reduce_operands(hlo)) == ["f32[2]", "s32[1]"]  # one operand per dtype
    assert float(total) == 120.0 and int(int_total) == 120 and float(squares) == float((np.arange(16) ** 2).sum())
    assert int_total.dtype == np.int32


@pytest.mark.slow
def test_a_functional_model_packs_its_loss_and_metrics_too():
    import optax

    def apply(p, x):
        return jax.numpy.tanh(x @ p["w"]) @ p["v"]

    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(12, 8)).astype("float32") * 0.3,
              "v": rng.normal(size=(8, 3)).astype("float32") * 0.3}
    x, y = _data()
    results = {}
    for n in (1, 8):
        model = mx.FunctionalModel(apply, params, loss="sparse_categorical_crossentropy_from_logits",
                                   optimizer=optax.sgd(0.1), metrics=["accuracy"])
        trainer = mx.Trainer(model, helpers.strategy(n))
        h = trainer.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        results[n] = (h.history, trainer.evaluate(x, y, batch_size=40))
        if n == 8:
            operands = _all_reduce_operands(_step_hlo(trainer, x, y))
            # 2 gradients and one f32[3]: the loss's sum and accuracy's total and count
            assert len(operands) == 3 and "f32[3]" in operands, operands
    for key, values in results[1][0].items():
        np.testing.assert_allclose(results[8][0][key], values, rtol=2e-6, atol=1e-7, err_msg=key)
    for key, value in results[1][1].items():
        np.testing.assert_allclose(results[8][1][key], value, rtol=2e-6, atol=1e-7, err_msg=key)
