"""keras-io: examples/nlp/text_classification_with_transformer.py (a Transformer block layer with
MultiHeadAttention, LayerNormalization and Dropout; token and position embeddings).

Verbatim: TransformerBlock, TokenAndPositionEmbedding, the model, compile and fit (batch 32, 2 epochs,
validation_data). Changed: data (token sequences labelled by whether token 1 outnumbers token 2,
instead of IMDB; 200 train / 64 validation rows), sizes (vocab 20000 -> 30, maxlen 200 -> 10,
embed_dim 32 -> 8, ff_dim 32 -> 8, Dense 20 -> 8), verbose, a fixed seed; predict added.
"""

import keras
import numpy as np
from keras import layers, ops


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


vocab_size = 30  # Only consider the top 20k words
maxlen = 10  # Only consider the first 200 words of each movie review


def _data(rng, rows):
    x = rng.integers(1, vocab_size, size=(rows, maxlen))
    return x, ((x == 1).sum(axis=1) > (x == 2).sum(axis=1)).astype("int64")


def program(strategy_scope):
    rng = np.random.default_rng(9)
    (x_train, y_train), (x_val, y_val) = _data(rng, 200), _data(rng, 64)

    embed_dim = 8  # Embedding size for each token
    num_heads = 2  # Number of attention heads
    ff_dim = 8  # Hidden layer size in feed forward network inside transformer

    with strategy_scope():
        inputs = layers.Input(shape=(maxlen,))
        embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        x = embedding_layer(inputs)
        transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        x = transformer_block(x)
        x = layers.GlobalAveragePooling1D()(x)
        x = layers.Dropout(0.1)(x)
        x = layers.Dense(8, activation="relu")(x)
        x = layers.Dropout(0.1)(x)
        outputs = layers.Dense(2, activation="softmax")(x)

        model = keras.Model(inputs=inputs, outputs=outputs)

        model.compile(
            optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
    model.fit(
        x_train, y_train, batch_size=32, epochs=2, validation_data=(x_val, y_val), verbose=0
    )
    return {"history": model.history.history, "weights": model.get_weights(),
            "predict": model.predict(x_val, verbose=0)}
