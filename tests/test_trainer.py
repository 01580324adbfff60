"""The Trainer's own API (``mirrorax.trainer``): what its constructor refuses, and what ``fit``, ``evaluate``,
``predict``, ``*_on_batch`` and ``host_state`` return. A tiny Keras model on 2 devices, fit once per module;
the engine's guarantees (equivalence, the window, checkpoints, short batches) have their own test files.
Every call here takes batches of 16 rows, so that the few programs the fit compiled serve the rest."""

import jax
import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx

ROWS, FEATURES, CLASSES, BATCH = 32, 4, 3, 16


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES, activation="softmax")])
    m.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def _data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)


class Fitted:
    def __init__(self) -> None:
        self.x, self.y = _data()
        self.trainer = mx.Trainer(_model(), strategy(2))
        self.history = self.trainer.fit(self.x, self.y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                                        validation_data=(self.x[:BATCH], self.y[:BATCH]))
        # Read before any test trains on: the validation data scored with the weights the fit ended on.
        self.validation_after_fit = self.trainer.test_on_batch(self.x[:BATCH], self.y[:BATCH])


@pytest.fixture(scope="module")
def fitted():
    return Fitted()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(strategy="gpu"), TypeError, r"strategy must be a mirrorax\.MirroredStrategy; received 'gpu' \(of type str\)"),
    (dict(accumulation_steps=0), ValueError, r"accumulation_steps must be an integer >= 1; received 0"),
    (dict(prefetch=-1), ValueError, r"prefetch must be an integer >= 0; received -1"),
    (dict(mixed_precision="int8"), ValueError, r"mixed_precision must be one of .*; received 'int8'"),
    (dict(on_nonfinite="explode"), ValueError, r"on_nonfinite must be one of .*; received 'explode'"),
], ids=["strategy", "accumulation_steps", "prefetch", "mixed_precision", "on_nonfinite"])
def test_constructor_refuses_bad_options_with_the_received_value(kwargs, error, match):
    kwargs = {"strategy": strategy(1), **kwargs}
    with pytest.raises(error, match=match):
        mx.Trainer(_model(), **kwargs)


def test_max_in_flight_is_the_strategys_and_the_error_says_so():
    with pytest.raises(TypeError, match=r"received max_in_flight=3.*mx\.MirroredStrategy\(max_in_flight=3\)"):
        mx.Trainer(_model(), strategy(1), max_in_flight=3)  # type: ignore[arg-type]
    windowed = mx.MirroredStrategy(devices=jax.devices()[:1], max_in_flight=1)
    assert mx.Trainer(_model(), windowed).strategy.max_in_flight == 1


def test_no_state_before_the_first_call():
    t = mx.Trainer(_model(), strategy(1))
    assert t.state is None
    with pytest.raises(RuntimeError, match="no state yet; call fit, evaluate or predict first"):
        t.host_state()


def test_fit_returns_a_keras_like_history(fitted):
    h = fitted.history
    assert isinstance(h, mx.History) and h.epoch == [0, 1]
    assert set(h.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(v) == 2 and all(np.isfinite(v)) for v in h.history.values())
    assert h.history["loss"][1] < h.history["loss"][0]
    assert len(h.samples_per_second) == 2 and min(h.samples_per_second) > 0
    assert repr(h) == "History(epochs=2, keys=['loss', 'accuracy', 'val_loss', 'val_accuracy'])"


def test_evaluate_returns_floats_and_agrees_with_its_batches(fitted):
    t, x, y = fitted.trainer, fitted.x, fitted.y
    logs = t.evaluate(x, y, batch_size=BATCH)
    assert set(logs) == {"loss", "accuracy"} and all(isinstance(v, float) for v in logs.values())
    # Exact sums over the rows: two equal batches average to the whole.
    halves = [t.test_on_batch(x[i:i + BATCH], y[i:i + BATCH]) for i in (0, BATCH)]
    for k in logs:
        np.testing.assert_allclose(logs[k], np.mean([h[k] for h in halves]), rtol=1e-5)
    # The validation data scored after the fit gives the last epoch's val_ metrics.
    last = {k: fitted.history.history[f"val_{k}"][-1] for k in logs}
    np.testing.assert_allclose([fitted.validation_after_fit[k] for k in logs], [last[k] for k in logs], rtol=1e-6)


def test_predict_returns_every_row_in_order(fitted):
    out = fitted.trainer.predict(fitted.x, batch_size=BATCH)
    assert isinstance(out, np.ndarray) and out.shape == (ROWS, CLASSES)
    # The model holds the trained values (written back): its own call gives the same rows.
    np.testing.assert_allclose(out, np.asarray(fitted.trainer.model(fitted.x)), rtol=1e-5, atol=1e-6)


def test_train_on_batch_is_one_step_and_host_state_is_numpy(fitted):
    t = fitted.trainer
    before = int(t.host_state().step)
    logs = t.train_on_batch(fitted.x[:BATCH], fitted.y[:BATCH])
    assert set(logs) == {"loss", "accuracy"} and all(isinstance(v, float) for v in logs.values())
    state = t.host_state()
    assert isinstance(state, mx.TrainState) and int(state.step) == before + 1
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(state.params))
    assert set(t.compile_counts()) == {"train", "train_many", "evaluate", "predict"}
