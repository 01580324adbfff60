"""Mixed precision: bf16 compute with float32 master weights; float16 adds dynamic loss scaling."""

import keras
import numpy as np
import pytest
from helpers import cnn, digits, strategy

import mirrorax as mx

pytestmark = [pytest.mark.multi_device, pytest.mark.slow]  # each trains the CNN twice


def test_bfloat16_mixed_precision_stays_close_to_float32():
    x, y, xt, yt = digits(256)
    full = cnn(dropout=0.0)
    tf32 = mx.Trainer(full, strategy(4))
    tf32.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    half = cnn(dropout=0.0)
    tb16 = mx.Trainer(half, strategy(4), mixed_precision="bfloat16")
    hist = tb16.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    assert half.layers[0].compute_dtype == "bfloat16" and half.layers[-1].compute_dtype == "float32"
    assert all(w.dtype == np.float32 for w in half.get_weights())  # float32 master weights
    # bf16 keeps 8 bits of mantissa: the tolerance is on outcomes, not last bits
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    p32, p16 = tf32.predict(xt, batch_size=128), tb16.predict(xt, batch_size=128)
    assert np.abs(p32 - p16).max() < 0.1
    assert np.mean(p32.argmax(-1) == p16.argmax(-1)) > 0.95


def test_float16_mixed_precision_uses_dynamic_loss_scaling():
    x, y, _, _ = digits(128)
    model = cnn(dropout=0.0)
    hist = mx.Trainer(model, strategy(2), mixed_precision="float16").fit(x, y, batch_size=64, epochs=3,
                                                                         shuffle=False, verbose=0)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.layers[0].compute_dtype == "float16" and model.layers[-1].compute_dtype == "float32"
    assert np.isfinite(hist.history["loss"]).all() and hist.history["loss"][-1] < hist.history["loss"][0]
    assert all(w.dtype == np.float32 for w in model.get_weights())


def test_mixed_bfloat16_history_loss_and_evaluate_are_keras_data_parallels():
    """Keras's ``mixed_bfloat16`` policy (bfloat16 outputs): History's loss and evaluate are the numbers
    Keras's own step gives on the same 4 devices (Keras DataParallel, the rounding baseline), not only its
    weights. Within Keras's one program XLA may keep the outputs in float32 on their way into the loss; a
    loss summed per replica took them rounded to bfloat16 first, and History differed by 4e-5..4e-4."""
    import jax

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 16)).astype(np.float32), rng.integers(0, 4, 100)

    def run(scope, fit_in_scope):
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            with scope():
                keras.utils.set_random_seed(1)
                model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"),
                                          keras.layers.Dense(4, activation="softmax")])
                model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
                if fit_in_scope:  # Keras's distribution must be current while its fit runs
                    return _mixed_run(model, x, y)
            return _mixed_run(model, x, y)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    data_parallel = keras.distribution.DataParallel(devices=jax.devices()[:4])
    want_hist, want_eval, want_weights = run(data_parallel.scope, True)
    got_hist, got_eval, got_weights = run(strategy(4).scope, False)
    assert got_weights[0].dtype == np.float32
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_hist["loss"], want_hist["loss"], rtol=2e-7)
    np.testing.assert_allclose(got_eval, want_eval, rtol=2e-7)
    assert got_hist["accuracy"] == want_hist["accuracy"]


def _mixed_run(model, x, y):
    hist = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0).history
    return hist, model.evaluate(x, y, batch_size=20, verbose=0), model.get_weights()
