"""keras-io: guides/training_with_built_in_methods.py (Keras 3 version, "Handling losses and metrics
that don't fit the standard signature": the LogisticEndpoint layer, a loss from add_loss, a model
compiled with no loss, fit on a dict with no targets).

Verbatim: LogisticEndpoint, its model, compile and fit. Changed: data (96 rows, targets a function of
the inputs instead of uniform noise on 3 rows), verbose, a fixed seed.
"""

import keras
import numpy as np
from keras import ops


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits, sample_weights=None):
        # Compute the training-time loss value and add it
        # to the layer using `self.add_loss()`.
        loss = self.loss_fn(targets, logits, sample_weights)
        self.add_loss(loss)

        # Return the inference-time prediction tensor (for `.predict()`).
        return ops.softmax(logits)


def program(strategy_scope):
    rng = np.random.default_rng(14)
    with strategy_scope():
        inputs = keras.Input(shape=(3,), name="inputs")
        targets = keras.Input(shape=(10,), name="targets")
        logits = keras.layers.Dense(10)(inputs)
        predictions = LogisticEndpoint(name="predictions")(targets, logits)

        model = keras.Model(inputs=[inputs, targets], outputs=predictions)
        model.compile(optimizer="adam")  # No loss argument!

    features = rng.random((96, 3))
    data = {
        "inputs": features,
        "targets": 1 / (1 + np.exp(-(features - 0.5) @ rng.normal(size=(3, 10)))),
    }
    model.fit(data, verbose=0)
    return {"history": model.history.history, "weights": model.get_weights()}
