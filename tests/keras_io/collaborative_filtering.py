"""keras-io: examples/structured_data/collaborative_filtering_movielens.py (RecommenderNet: the
tensordot over the batch axis mixes every row of a batch).

Verbatim: RecommenderNet (``tf.tensordot``/``tf.nn.sigmoid`` as keras.io's Keras 3 version writes
them, ``ops.tensordot``/``ops.sigmoid``), compile and fit (batch 64, validation_data). Changed: data
(1000 ratings of 30 users x 40 movies from a low-rank score, 900 train / 100 validation: 900 is not a
multiple of 64), EMBEDDING_SIZE 50 -> 8, epochs 5 -> 2, verbose, a fixed seed; predict added.
"""

import keras
import numpy as np
from keras import layers, ops

EMBEDDING_SIZE = 8


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.num_users = num_users
        self.num_movies = num_movies
        self.embedding_size = embedding_size
        self.user_embedding = layers.Embedding(
            num_users,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = ops.tensordot(user_vector, movie_vector, 2)
        # Add all the components (including bias)
        x = dot_user_movie + user_bias + movie_bias
        # The sigmoid activation forces the rating to between 0 and 1
        return ops.sigmoid(x)


def program(strategy_scope):
    rng = np.random.default_rng(6)
    num_users, num_movies = 30, 40
    x = np.stack([rng.integers(num_users, size=1000), rng.integers(num_movies, size=1000)], axis=1)
    score = rng.normal(size=(num_users, 2)) @ rng.normal(size=(2, num_movies))
    y = 1 / (1 + np.exp(-score[x[:, 0], x[:, 1]]))
    x_train, x_val, y_train, y_val = x[:900], x[900:], y[:900], y[900:]

    with strategy_scope():
        model = RecommenderNet(num_users, num_movies, EMBEDDING_SIZE)
        model.compile(
            loss=keras.losses.BinaryCrossentropy(),
            optimizer=keras.optimizers.Adam(learning_rate=0.001),
        )

    model.fit(
        x=x_train,
        y=y_train,
        batch_size=64,
        epochs=2,
        verbose=0,
        validation_data=(x_val, y_val),
    )
    return {
        "history": model.history.history,
        "weights": model.get_weights(),
        "predict": model.predict(x_val[:10], verbose=0),
    }
