"""keras-io: examples/keras_recipes/float8_training_and_inference_with_transformer.py (Keras mixed
precision, `keras.config.set_dtype_policy("mixed_bfloat16")`, for the whole program; KerasHub's
TokenAndPositionEmbedding and TransformerDecoder; text files read by `text_dataset_from_directory` with
a seeded reshuffle and a validation split, a WordPiece vocabulary trained on them, pipelines ending in
`.shuffle(512).prefetch(tf.data.AUTOTUNE).cache()`; the same model trained again after
`model.quantize("float8")`).

Verbatim: the dtype policy, the hyperparameters (batch 32, 3 epochs, vocabulary 20000, sequence length
200, hidden 32, 2 heads, intermediate 32, dropout 0.1), the three `text_dataset_from_directory` calls
(`validation_split=0.2`, `seed=42`), the lowercasing maps, `train_word_piece` and its reserved tokens,
the WordPieceTokenizer, `format_dataset` and `make_dataset`, `build_model`, both compiles, fits
(validation_data) and evaluates, `model.quantize("float8")`; every pass the program makes over a
pipeline before training (the samples it prints, `train_sentences`, the tokenized example), as each one
advances the seeded reshuffle. Changed: data (180 train / 140 test reviews written to a temporary folder,
their sentiment in their words, instead of IMDB: short last batches of 16, 4 and 12 rows, each a
multiple of the 4 devices, as Keras's DataParallel, this program's rounding baseline, cannot place a
batch the devices do not divide), verbose, the prints and `model.summary()`, the float8 variables' dump;
the policy set inside `program`; predict added, and each pipeline's rows counted after use.

The baseline is Keras's own `keras.distribution.DataParallel` on the same 4 devices (`run.py`'s
`DATA_PARALLEL`): bfloat16 gradients summed per device round differently from one device's sum.
"""

import os
import shutil
import tempfile

import keras
import keras_hub
import numpy as np
import tensorflow as tf

_NEUTRAL = [f"word{i}" for i in range(400)]
_TONE = {"pos": ["good", "great", "superb", "loved", "fine"], "neg": ["bad", "awful", "boring", "hated", "poor"]}


def _write_reviews(root, rng, per_class):
    for label in ("pos", "neg"):
        os.makedirs(os.path.join(root, label))
        for i in range(per_class):
            n = int(rng.integers(60, 300))
            words = rng.choice(_NEUTRAL, n).astype(object)
            marked = rng.random(n) < 0.08
            words[marked] = rng.choice(_TONE[label], int(marked.sum()))
            with open(os.path.join(root, label, f"{i}_{label}.txt"), "w") as f:
                f.write(" ".join(words).capitalize() + ".")


def program(strategy_scope):
    rng = np.random.default_rng(8)
    dataset_dir = tempfile.mkdtemp(prefix="aclImdb_")
    try:
        _write_reviews(os.path.join(dataset_dir, "train"), rng, 90)
        _write_reviews(os.path.join(dataset_dir, "test"), rng, 70)
        return _program(strategy_scope, dataset_dir)
    finally:
        shutil.rmtree(dataset_dir)


def _program(strategy_scope, dataset_dir):
    keras.config.set_dtype_policy("mixed_bfloat16")

    EPOCHS = 3
    BATCH_SIZE = 32
    VOCABULARY_SIZE = 20000
    MAX_SEQUENCE_LENGTH = 200
    MODEL_KWARGS = dict(
        vocabulary_size=VOCABULARY_SIZE,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        hidden_dim=32,  # Hidden size for each token
        num_heads=2,  # Number of attention heads
        intermediate_dim=32,  # Intermediate size in feedforward network
        dropout=0.1,  # Dropout rate
    )

    train_ds = keras.utils.text_dataset_from_directory(
        os.path.join(dataset_dir, "train"),
        batch_size=BATCH_SIZE,
        validation_split=0.2,
        subset="training",
        seed=42,
    )
    val_ds = keras.utils.text_dataset_from_directory(
        os.path.join(dataset_dir, "train"),
        batch_size=BATCH_SIZE,
        validation_split=0.2,
        subset="validation",
        seed=42,
    )
    test_ds = keras.utils.text_dataset_from_directory(
        os.path.join(dataset_dir, "test"), batch_size=BATCH_SIZE
    )

    train_ds = train_ds.map(lambda x, y: (tf.strings.lower(x), y))
    val_ds = val_ds.map(lambda x, y: (tf.strings.lower(x), y))
    test_ds = test_ds.map(lambda x, y: (tf.strings.lower(x), y))

    # The recipe prints three samples of one batch: the pass stays, the prints go.
    for text_batch, label_batch in train_ds.take(1):
        pass

    def train_word_piece(ds, vocab_size, reserved_tokens):
        word_piece_ds = ds.unbatch().map(lambda x, y: x)
        vocab = keras_hub.tokenizers.compute_word_piece_vocabulary(
            word_piece_ds.batch(1000).prefetch(2),
            vocabulary_size=vocab_size,
            reserved_tokens=reserved_tokens,
        )
        return vocab

    reserved_tokens = ["[PAD]", "[UNK]"]
    train_sentences = [element[0] for element in train_ds]  # noqa: F841 - as written
    vocab = train_word_piece(train_ds, VOCABULARY_SIZE, reserved_tokens)

    tokenizer = keras_hub.tokenizers.WordPieceTokenizer(
        vocabulary=vocab,
        lowercase=False,
        sequence_length=MAX_SEQUENCE_LENGTH,
    )

    input_sentence_ex = train_ds.take(1).get_single_element()[0][0]
    input_tokens_ex = tokenizer(input_sentence_ex)
    tokenizer.detokenize(input_tokens_ex)

    def format_dataset(sentence, label):
        sentence = tokenizer(sentence)
        return ({"input_ids": sentence}, label)

    def make_dataset(dataset):
        dataset = dataset.map(format_dataset, num_parallel_calls=tf.data.AUTOTUNE)
        return dataset.shuffle(512).prefetch(tf.data.AUTOTUNE).cache()

    train_ds = make_dataset(train_ds)
    val_ds = make_dataset(val_ds)
    test_ds = make_dataset(test_ds)

    def build_model(
        vocabulary_size=20000,
        max_sequence_length=200,
        hidden_dim=32,
        num_heads=2,
        intermediate_dim=32,
        dropout=0.1,
    ):
        token_id_input = keras.layers.Input(shape=(None,), dtype="int32", name="input_ids")
        x = keras_hub.layers.TokenAndPositionEmbedding(
            vocabulary_size=vocabulary_size,
            sequence_length=max_sequence_length,
            embedding_dim=hidden_dim,
        )(token_id_input)
        x = keras.layers.Dropout(rate=dropout)(x)
        x = keras_hub.layers.TransformerDecoder(
            intermediate_dim=intermediate_dim,
            num_heads=num_heads,
            dropout=dropout,
        )(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        x = keras.layers.Dropout(dropout)(x)
        x = keras.layers.Dense(intermediate_dim, activation="relu")(x)
        x = keras.layers.Dropout(dropout)(x)
        outputs = keras.layers.Dense(1, activation="sigmoid")(x)
        return keras.Model(inputs=token_id_input, outputs=outputs)

    # First mixed_bfloat16, then the same model quantized to float8.
    with strategy_scope():
        model = build_model(**MODEL_KWARGS)
        model.compile(
            optimizer="adam",
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
    history = model.fit(train_ds, epochs=EPOCHS, validation_data=val_ds, verbose=0)
    result = model.evaluate(test_ds, verbose=0)
    mixed = {"history": history.history, "weights": model.get_weights(), "evaluate": result,
             "predict": model.predict(test_ds, verbose=0)}

    with strategy_scope():
        model = build_model(**MODEL_KWARGS)
        model.quantize("float8")
        model.compile(
            optimizer="adam",
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
    history = model.fit(train_ds, epochs=EPOCHS, validation_data=val_ds, verbose=0)
    result = model.evaluate(test_ds, verbose=0)
    float8 = {"history": history.history, "weights": model.get_weights(), "evaluate": result,
              "predict": model.predict(test_ds, verbose=0)}
    return {
        "mixed_bfloat16": mixed,
        "float8": float8,
        # Every pipeline whole after use: its cache holds every row.
        "rows": [sum(int(tf.shape(y)[0]) for _, y in ds) for ds in (train_ds, val_ds, test_ds)],
    }
