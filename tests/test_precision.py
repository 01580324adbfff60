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
