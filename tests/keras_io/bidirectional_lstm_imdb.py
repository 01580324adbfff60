"""keras-io: examples/nlp/bidirectional_lstm_imdb.py (two Bidirectional LSTMs, binary targets of
shape (n,) against a Dense(1, sigmoid) output).

Verbatim: the model and its compile and fit (batch 32, 2 epochs, validation_data). Changed: data
(integer sequences whose label is whether token 1 occurs more often than token 2, instead of IMDB;
200 train / 64 validation rows, sequences of 12), sizes (max_features 20000 -> 20, embedding
128 -> 8, LSTMs 64 -> 4), verbose, a fixed seed; predict added.
"""

import keras
import numpy as np
from keras import layers

max_features = 20  # Only consider the top 20k words
maxlen = 12  # Only consider the first 200 words of each movie review


def _data(rng, rows):
    x = rng.integers(1, max_features, size=(rows, maxlen)).astype("int32")
    y = ((x == 1).sum(axis=1) > (x == 2).sum(axis=1)).astype("int64")
    return x, y


def program(strategy_scope):
    rng = np.random.default_rng(7)
    (x_train, y_train), (x_val, y_val) = _data(rng, 200), _data(rng, 64)
    with strategy_scope():
        # Input for variable-length sequences of integers
        inputs = keras.Input(shape=(None,), dtype="int32")
        # Embed each integer in a 128-dimensional vector
        x = layers.Embedding(max_features, 8)(inputs)
        # Add 2 bidirectional LSTMs
        x = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(x)
        x = layers.Bidirectional(layers.LSTM(4))(x)
        # Add a classifier
        outputs = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model(inputs, outputs)

        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=32, epochs=2, validation_data=(x_val, y_val), verbose=0)
    return {"history": model.history.history, "weights": model.get_weights(),
            "predict": model.predict(x_val, verbose=0)}
