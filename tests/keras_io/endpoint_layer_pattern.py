"""keras-io: examples/keras_recipes/endpoint_layer_pattern.py (functional model, loss from add_loss,
fit on a dict with no targets).

Verbatim: LogisticEndpoint, the model and its compile. Changed: TF-only calls (``self.add_metric``,
which Keras 3 does not have, is dropped; ``tf.nn.softmax`` is ``keras.ops.softmax``); data (targets
are a function of the inputs, 764 features cut to 24, 200 rows), 2 epochs as written, a fixed seed;
predict on the inference-only model added.
"""

import keras
import numpy as np


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super(LogisticEndpoint, self).__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.accuracy_fn = keras.metrics.BinaryAccuracy(name="accuracy")

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            # Compute the training-time loss value and add it
            # to the layer using `self.add_loss()`.
            loss = self.loss_fn(targets, logits, sample_weight)
            self.add_loss(loss)

        # Return the inference-time prediction tensor (for `.predict()`).
        return keras.ops.softmax(logits)


def program(strategy_scope):
    rng = np.random.default_rng(2)
    features = rng.random((200, 24))
    w = rng.normal(size=(24, 1))
    with strategy_scope():
        inputs = keras.Input((24,), name="inputs")
        logits = keras.layers.Dense(1)(inputs)
        targets = keras.Input((1,), name="targets")
        sample_weight = keras.Input((1,), name="sample_weight")
        preds = LogisticEndpoint()(logits, targets, sample_weight)
        model = keras.Model([inputs, targets, sample_weight], preds)

        data = {
            "inputs": features,
            "targets": 1 / (1 + np.exp(-(features - 0.5) @ w)),
            "sample_weight": rng.random((200, 1)),
        }

        model.compile(keras.optimizers.Adam(1e-3))
    model.fit(data, epochs=2, verbose=0)

    with strategy_scope():
        inputs = keras.Input((24,), name="inputs")
        logits = keras.layers.Dense(1)(inputs)
        preds = LogisticEndpoint()(logits, targets=None, sample_weight=None)
        inference_model = keras.Model(inputs, preds)

    inference_model.set_weights(model.get_weights())
    preds = inference_model.predict(features[:50], verbose=0)
    return {"history": model.history.history, "weights": model.get_weights(), "predict": preds}
