"""keras-io: guides/training_with_built_in_methods.py (Keras 3 version: get_compiled_model trained
with class_weight; with sample_weight; with the EarlyStopping(val_loss) callback and
validation_split). Its LogisticEndpoint model is training_guide_endpoint.py.

Verbatim: get_uncompiled_model, get_compiled_model, class_weight, the EarlyStopping callback.
Changed: data (784 features cut to 20, 10 classes from a fixed linear map, 500 rows instead of
MNIST's 50000; 500 is not a multiple of 64), sizes (Dense 64 -> 16, epochs 20 -> 4), verbose, a
fixed seed; evaluate and predict added.
"""

import keras
import numpy as np
from keras import layers


def get_uncompiled_model():
    inputs = keras.Input(shape=(20,), name="digits")
    x = layers.Dense(16, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(16, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    return model


def get_compiled_model():
    model = get_uncompiled_model()
    model.compile(
        optimizer="rmsprop",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    return model


def program(strategy_scope):
    rng = np.random.default_rng(12)
    x_train = rng.random((500, 20)).astype("float32")
    y_train = np.argmax((x_train - 0.5) @ rng.normal(size=(20, 10)), axis=1)
    out = {}

    class_weight = {
        0: 1.0,
        1: 1.0,
        2: 1.0,
        3: 1.0,
        4: 1.0,
        # Set weight "2" for class "5",
        # making this class 2x more important
        5: 2.0,
        6: 1.0,
        7: 1.0,
        8: 1.0,
        9: 1.0,
    }
    with strategy_scope():
        model = get_compiled_model()
    model.fit(x_train, y_train, class_weight=class_weight, batch_size=64, epochs=1, verbose=0)
    out["class_weight"] = {"history": model.history.history, "weights": model.get_weights()}

    sample_weight = np.ones(shape=(len(y_train),))
    sample_weight[y_train == 5] = 2.0
    with strategy_scope():
        model = get_compiled_model()
    model.fit(x_train, y_train, sample_weight=sample_weight, batch_size=64, epochs=1, verbose=0)
    out["sample_weight"] = {"history": model.history.history, "weights": model.get_weights()}

    with strategy_scope():
        model = get_compiled_model()
    callbacks = [
        keras.callbacks.EarlyStopping(
            # Stop training when `val_loss` is no longer improving
            monitor="val_loss",
            # "no longer improving" being defined as "no better than 1e-2 less"
            min_delta=1e-2,
            # "no longer improving" being further defined as "for at least 2 epochs"
            patience=2,
            verbose=0,
        )
    ]
    model.fit(x_train, y_train, epochs=4, batch_size=64, callbacks=callbacks, validation_split=0.2,
              verbose=0)
    out["early_stopping"] = {
        "history": model.history.history,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x_train, y_train, batch_size=64, verbose=0),
        "predict": model.predict(x_train[:40], verbose=0),
    }
    return out
