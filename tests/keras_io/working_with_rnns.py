"""keras-io: guides/working_with_rnns.py ("Using CuDNN kernels when available": LSTM + BatchNormalization
on sequences of rows, sparse labels, SGD).

Verbatim: build_model, compile and fit (validation_data, batch_size, epochs=1). Changed: data (260
sequences of 6 steps x 5 features, the label the step with the largest feature sum, instead of MNIST
rows), sizes (input_dim 28 -> 5, units 64 -> 8, output_size 10 -> 6, batch 64 as written), a fixed
seed; evaluate and predict added.
"""

import keras
import numpy as np

batch_size = 64
# Each MNIST image batch is a tensor of shape (batch_size, 28, 28).
# Each input sequence will be of size (28, 28) (height is treated like time).
input_dim = 5

units = 8
output_size = 6  # labels are from 0 to 9


# Build the RNN model
def build_model(allow_cudnn_kernel=True):
    # CuDNN is only available at the layer level, and not at the cell level.
    # This means `LSTM(units)` will use the CuDNN kernel,
    # while RNN(LSTMCell(units)) will run on non-CuDNN kernel.
    if allow_cudnn_kernel:
        # The LSTM layer with default options uses CuDNN.
        lstm_layer = keras.layers.LSTM(units, input_shape=(None, input_dim))
    else:
        # Wrapping a LSTMCell in a RNN layer will not use CuDNN.
        lstm_layer = keras.layers.RNN(
            keras.layers.LSTMCell(units), input_shape=(None, input_dim)
        )
    model = keras.models.Sequential(
        [
            lstm_layer,
            keras.layers.BatchNormalization(),
            keras.layers.Dense(output_size),
        ]
    )
    return model


def program(strategy_scope):
    rng = np.random.default_rng(8)
    x = rng.random((260, 6, input_dim)).astype("float32")
    y = np.argmax(x.sum(axis=2), axis=1)
    x_train, y_train, x_test, y_test = x[:200], y[:200], x[200:], y[200:]
    with strategy_scope():
        model = build_model(allow_cudnn_kernel=True)

        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer="sgd",
            metrics=["accuracy"],
        )

    model.fit(
        x_train, y_train, validation_data=(x_test, y_test), batch_size=batch_size, epochs=1, verbose=0
    )
    return {
        "history": model.history.history,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x_test, y_test, verbose=0),
        "predict": model.predict(x_test, verbose=0),
    }
