"""keras-io: guides/functional_api.py ("Models with multiple inputs and outputs": the ticket
priority/department model).

Verbatim: the model and its compile (dict losses and loss_weights). Changed: data (targets computed
from the tags so they are learnable; 200 rows instead of 1280, so the last batch of 32 has 8 rows),
sizes (vocabulary 10000 -> 50, embeddings 64 -> 8, LSTMs 128/32 -> 8/4, sequences 10/100 -> 6/8),
epochs 2 as written, a fixed seed; evaluate and predict added.
"""

import keras
import numpy as np
from keras import layers


def program(strategy_scope):
    num_tags = 12  # Number of unique issue tags
    num_words = 50  # Size of vocabulary obtained when preprocessing text data
    num_departments = 4  # Number of departments for predictions

    with strategy_scope():
        title_input = keras.Input(
            shape=(None,), name="title"
        )  # Variable-length sequence of ints
        body_input = keras.Input(shape=(None,), name="body")  # Variable-length sequence of ints
        tags_input = keras.Input(
            shape=(num_tags,), name="tags"
        )  # Binary vectors of size `num_tags`

        # Embed each word in the title into a 64-dimensional vector
        title_features = layers.Embedding(num_words, 8)(title_input)
        # Embed each word in the text into a 64-dimensional vector
        body_features = layers.Embedding(num_words, 8)(body_input)

        # Reduce sequence of embedded words in the title into a single 128-dimensional vector
        title_features = layers.LSTM(8)(title_features)
        # Reduce sequence of embedded words in the body into a single 32-dimensional vector
        body_features = layers.LSTM(4)(body_features)

        # Merge all available features into a single large vector via concatenation
        x = layers.concatenate([title_features, body_features, tags_input])

        # Stick a logistic regression for priority prediction on top of the features
        priority_pred = layers.Dense(1, name="priority")(x)
        # Stick a department classifier on top of the features
        department_pred = layers.Dense(num_departments, name="department")(x)

        # Instantiate an end-to-end model predicting both priority and department
        model = keras.Model(
            inputs=[title_input, body_input, tags_input],
            outputs={"priority": priority_pred, "department": department_pred},
        )

        model.compile(
            optimizer=keras.optimizers.RMSprop(1e-3),
            loss={
                "priority": keras.losses.BinaryCrossentropy(from_logits=True),
                "department": keras.losses.CategoricalCrossentropy(from_logits=True),
            },
            loss_weights={"priority": 1.0, "department": 0.2},
        )

    # Dummy input data
    rng = np.random.default_rng(3)
    title_data = rng.integers(num_words, size=(200, 6))
    body_data = rng.integers(num_words, size=(200, 8))
    tags_data = rng.integers(2, size=(200, num_tags)).astype("float32")

    # Dummy target data, learnable from the tags
    priority_targets = tags_data[:, :6].mean(axis=1, keepdims=True)
    dept_targets = np.eye(num_departments)[(tags_data[:, :2] @ np.array([2, 1])).astype(int)]

    inputs = {"title": title_data, "body": body_data, "tags": tags_data}
    targets = {"priority": priority_targets, "department": dept_targets}
    model.fit(inputs, targets, epochs=2, batch_size=32, verbose=0)
    return {
        "history": model.history.history,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(inputs, targets, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(inputs, batch_size=32, verbose=0),
    }
