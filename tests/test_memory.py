"""Nothing but the state (and the batches in flight) stays resident on the devices during fit."""

import jax
import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx

pytestmark = pytest.mark.multi_device


@pytest.mark.slow  # a fit that lists the live arrays after each batch (a callback per batch)
def test_no_single_device_copies_of_the_weights_during_fit():
    """Adam's slots were kept as whole single-device arrays on device 0 for the trainer's life (two per
    weight, beside the replicated state): device 0 ran out of memory before the others."""
    s = strategy(4)
    with s.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="tanh"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(128, 64)).astype(np.float32)
    y = np.arange(128) % 10
    kernel_shapes = {(64, 256), (256, 10)}
    found = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            d0 = jax.devices()[0]
            found.append([a.shape for a in jax.live_arrays()
                          if a.sharding.device_set == {d0} and a.shape in kernel_shapes])

    mx.Trainer(model, s).fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[Look()])
    assert found == [[], []]
