"""keras-io: examples/nlp/text_classification_from_scratch.py (text files on disk read by
`text_dataset_from_directory` with a seeded reshuffle and a validation split, a TextVectorization
layer mapped over the tf.data pipelines, each pipeline ending in `.cache().prefetch(buffer_size=10)`;
a 1D convnet).

Verbatim: the three `text_dataset_from_directory` calls (batch 32, `validation_split=0.2`, `seed=1337`,
the test set unseeded), `custom_standardization`, the TextVectorization layer and its `adapt`,
`vectorize_text`, the `.cache().prefetch(buffer_size=10)` pipelines, the model at its real sizes
(max_features 20000, embedding 128, sequence_length 500, Conv1D 128), compile, fit (3 epochs,
validation_data) and evaluate. Changed: data (190 train / 150 test reviews written to a temporary
folder, their sentiment in their words, with `<br />` tags and punctuation, instead of IMDB: short last
batches of 24, 6 and 22 rows), verbose, the TensorFlow backend line, the previews; `custom_standardization`
mapped over the raw pipelines and `standardize=None` (Keras 3.15 on JAX cannot run a `standardize`
callable inside tf.data); the end-to-end model of raw strings (TensorFlow-only) left out; predict added,
and each pipeline's rows counted after use.
"""

import os
import re
import shutil
import string
import tempfile

import keras
import numpy as np
import tensorflow as tf
from keras import layers

_NEUTRAL = [f"w{i}" for i in range(300)]
_TONE = {"pos": ["good", "great", "superb", "loved", "fine"], "neg": ["bad", "awful", "boring", "hated", "poor"]}


def _write_reviews(root, rng, per_class):
    for label in ("pos", "neg"):
        os.makedirs(os.path.join(root, label))
        for i in range(per_class):
            n = int(rng.integers(60, 400))
            words = rng.choice(_NEUTRAL, n).astype(object)
            marked = rng.random(n) < 0.08
            words[marked] = rng.choice(_TONE[label], int(marked.sum()))
            text = " ".join(words).replace(" w7 ", " w7<br /> ").replace(" w9 ", " w9! ")
            with open(os.path.join(root, label, f"{i}_{label}.txt"), "w") as f:
                f.write(text.capitalize() + ".")


def program(strategy_scope):
    rng = np.random.default_rng(11)
    dataset_dir = tempfile.mkdtemp(prefix="aclImdb_")
    try:
        _write_reviews(os.path.join(dataset_dir, "train"), rng, 95)
        _write_reviews(os.path.join(dataset_dir, "test"), rng, 75)
        return _program(strategy_scope, dataset_dir)
    finally:
        shutil.rmtree(dataset_dir)


def _program(strategy_scope, dataset_dir):
    batch_size = 32
    train_dir = os.path.join(dataset_dir, "train")
    test_dir = os.path.join(dataset_dir, "test")

    raw_train_ds = keras.utils.text_dataset_from_directory(
        train_dir,
        batch_size=batch_size,
        validation_split=0.2,
        subset="training",
        seed=1337,
        class_names=["pos", "neg"],
    )
    raw_val_ds = keras.utils.text_dataset_from_directory(
        train_dir,
        batch_size=batch_size,
        validation_split=0.2,
        subset="validation",
        seed=1337,
        class_names=["pos", "neg"],
    )
    raw_test_ds = keras.utils.text_dataset_from_directory(test_dir, batch_size=batch_size)

    def custom_standardization(input_data):
        lowercase = tf.strings.lower(input_data)
        stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
        return tf.strings.regex_replace(
            stripped_html, f"[{re.escape(string.punctuation)}]", ""
        )

    # Model constants.
    max_features = 20000
    embedding_dim = 128
    sequence_length = 500

    # Keras 3.15 on JAX cannot call a `standardize` callable inside a tf.data map (it converts the symbolic
    # tensor to numpy): the same function runs as a map of the raw pipelines instead.
    raw_train_ds, raw_val_ds, raw_test_ds = (
        ds.map(lambda x, y: (custom_standardization(x), y)) for ds in (raw_train_ds, raw_val_ds, raw_test_ds))
    vectorize_layer = keras.layers.TextVectorization(
        standardize=None,
        max_tokens=max_features,
        output_mode="int",
        output_sequence_length=sequence_length,
    )

    # Let's make a text-only dataset (no labels):
    text_ds = raw_train_ds.map(lambda x, y: x)
    # Let's call `adapt`:
    vectorize_layer.adapt(text_ds)

    def vectorize_text(text, label):
        text = tf.expand_dims(text, -1)
        return vectorize_layer(text), label

    # Vectorize the data.
    train_ds = raw_train_ds.map(vectorize_text)
    val_ds = raw_val_ds.map(vectorize_text)
    test_ds = raw_test_ds.map(vectorize_text)

    # Do async prefetching / buffering of the data for best performance on GPU.
    train_ds = train_ds.cache().prefetch(buffer_size=10)
    val_ds = val_ds.cache().prefetch(buffer_size=10)
    test_ds = test_ds.cache().prefetch(buffer_size=10)

    with strategy_scope():
        # A integer input for vocab indices.
        inputs = keras.Input(shape=(None,), dtype="int64")

        # Next, we add a layer to map those vocab indices into a space of dimensionality
        # 'embedding_dim'.
        x = layers.Embedding(max_features, embedding_dim)(inputs)
        x = layers.Dropout(0.5)(x)

        # Conv1D + global max pooling
        x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
        x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
        x = layers.GlobalMaxPooling1D()(x)

        # We add a vanilla hidden layer:
        x = layers.Dense(128, activation="relu")(x)
        x = layers.Dropout(0.5)(x)

        # We project onto a single unit output layer, and squash it with a sigmoid:
        predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)

        model = keras.Model(inputs, predictions)

        # Compile the model with binary crossentropy loss and an adam optimizer.
        model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])

    epochs = 3

    # Fit the model using the train and test datasets.
    model.fit(train_ds, validation_data=val_ds, epochs=epochs, verbose=0)

    evaluate = model.evaluate(test_ds, verbose=0)
    return {
        "history": model.history.history,
        "weights": model.get_weights(),
        "evaluate": evaluate,
        "predict": model.predict(test_ds, verbose=0),
        # Every pipeline whole after use: its cache holds every row.
        "rows": [sum(int(tf.shape(y)[0]) for _, y in ds) for ds in (train_ds, val_ds, test_ds)],
    }
