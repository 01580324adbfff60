"""keras-io: examples/timeseries/timeseries_weather_forecasting.py (an LSTM regressor with the
EarlyStopping and ModelCheckpoint(save_best_only, weights) callbacks and validation data).

Verbatim: the model, compile, both callbacks and fit (batch 256, validation_data). Changed: data
(windows of a synthetic 7-feature series whose target is a linear function of the window's last
step, as numpy arrays instead of keras.utils.timeseries_dataset_from_array over the Jena climate
download), sizes (sequence 120 -> 8, LSTM 32 -> 8, 600 train / 200 validation windows, epochs 10 ->
3), the checkpoint path (a temporary folder), verbose, a fixed seed; predict added.
"""

import os
import tempfile

import keras
import numpy as np

learning_rate = 0.001
batch_size = 256
epochs = 3


def _windows(rng, rows):
    x = rng.normal(size=(rows, 8, 7)).astype("float32")
    return x, x[:, -1, :] @ np.linspace(-1, 1, 7)[:, None] * 0.5


def program(strategy_scope):
    rng = np.random.default_rng(13)
    (x_train, y_train), (x_val, y_val) = _windows(rng, 600), _windows(rng, 200)
    with strategy_scope():
        inputs = keras.layers.Input(shape=(x_train.shape[1], x_train.shape[2]))
        lstm_out = keras.layers.LSTM(8)(inputs)
        outputs = keras.layers.Dense(1)(lstm_out)

        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=learning_rate), loss="mse")

    with tempfile.TemporaryDirectory() as tmp:
        path_checkpoint = os.path.join(tmp, "model_checkpoint.weights.h5")
        es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5)

        modelckpt_callback = keras.callbacks.ModelCheckpoint(
            monitor="val_loss",
            filepath=path_checkpoint,
            verbose=0,
            save_weights_only=True,
            save_best_only=True,
        )

        history = model.fit(
            x_train,
            y_train,
            batch_size=batch_size,
            epochs=epochs,
            validation_data=(x_val, y_val),
            callbacks=[es_callback, modelckpt_callback],
            verbose=0,
        )
    return {"history": history.history, "weights": model.get_weights(),
            "predict": model.predict(x_val[:20], verbose=0)}
