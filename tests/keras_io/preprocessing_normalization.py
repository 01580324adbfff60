"""keras-io: guides/preprocessing_layers.py ("Quick recipes: Normalizing numerical features": an
adapted Normalization layer inside the model).

Verbatim: the Normalization layer, its adapt, the model, compile and fit (default batch size, one
epoch). Changed: data (300 rows of 48 uint8-like features with a learnable 10-class label instead of
CIFAR-10), a fixed seed; evaluate and predict added.
"""

import keras
import numpy as np
from keras import layers


def program(strategy_scope):
    # Load some data
    rng = np.random.default_rng(5)
    x_train = rng.integers(0, 256, size=(300, 48)).astype("float32")
    y_train = np.argmax((x_train - 127.5) @ rng.normal(size=(48, 10)), axis=1)[:, None]
    x_train = x_train.reshape((len(x_train), -1))
    input_shape = x_train.shape[1:]
    classes = 10

    with strategy_scope():
        # Create a Normalization layer and set its internal state using the training data
        normalizer = layers.Normalization()
        normalizer.adapt(x_train)

        # Create a model that include the normalization layer
        inputs = keras.Input(shape=input_shape)
        x = normalizer(inputs)
        outputs = layers.Dense(classes, activation="softmax")(x)
        model = keras.Model(inputs, outputs)

        # Train the model
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x_train, y_train, verbose=0)
    return {
        "history": model.history.history,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x_train, y_train, verbose=0),
        "predict": model.predict(x_train[:40], verbose=0),
    }
