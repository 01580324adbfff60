"""keras-io: guides/making_new_layers_and_models_via_subclassing.py ("Putting it all together: an
end-to-end example": the VAE, a subclassed Model with add_loss and a seeded Sampling layer).

Verbatim: Sampling, Encoder, Decoder, VariationalAutoEncoder, the optimizer and compile. Changed: data
(200 rows of 24 features on a 3-dimensional manifold instead of MNIST's 784; 200 is not a multiple of
the batch of 64, as 60000 is not), sizes (original_dim 784 -> 24, intermediate 64 -> 16, latent
32 -> 4), epochs 2 as written, a fixed seed; predict added.
"""

import keras
import numpy as np
from keras import layers, ops


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class Encoder(layers.Layer):
    """Maps MNIST digits to a triplet (z_mean, z_log_var, z)."""

    def __init__(self, latent_dim=32, intermediate_dim=64, name="encoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_mean = layers.Dense(latent_dim)
        self.dense_log_var = layers.Dense(latent_dim)
        self.sampling = Sampling()

    def call(self, inputs):
        x = self.dense_proj(inputs)
        z_mean = self.dense_mean(x)
        z_log_var = self.dense_log_var(x)
        z = self.sampling((z_mean, z_log_var))
        return z_mean, z_log_var, z


class Decoder(layers.Layer):
    """Converts z, the encoded digit vector, back into a readable digit."""

    def __init__(self, original_dim, intermediate_dim=64, name="decoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_output = layers.Dense(original_dim, activation="sigmoid")

    def call(self, inputs):
        x = self.dense_proj(inputs)
        return self.dense_output(x)


class VariationalAutoEncoder(keras.Model):
    """Combines the encoder and decoder into an end-to-end model for training."""

    def __init__(
        self,
        original_dim,
        intermediate_dim=64,
        latent_dim=32,
        name="autoencoder",
        **kwargs
    ):
        super().__init__(name=name, **kwargs)
        self.original_dim = original_dim
        self.encoder = Encoder(latent_dim=latent_dim, intermediate_dim=intermediate_dim)
        self.decoder = Decoder(original_dim, intermediate_dim=intermediate_dim)

    def call(self, inputs):
        z_mean, z_log_var, z = self.encoder(inputs)
        reconstructed = self.decoder(z)
        # Add KL divergence regularization loss.
        kl_loss = -0.5 * ops.mean(
            z_log_var - ops.square(z_mean) - ops.exp(z_log_var) + 1
        )
        self.add_loss(kl_loss)
        return reconstructed


def program(strategy_scope):
    rng = np.random.default_rng(4)
    codes = rng.normal(size=(200, 3))
    x_train = (1 / (1 + np.exp(-codes @ rng.normal(size=(3, 24))))).astype("float32")

    with strategy_scope():
        vae = VariationalAutoEncoder(24, 16, 4)

        optimizer = keras.optimizers.Adam(learning_rate=1e-3)
        vae.compile(optimizer, loss=keras.losses.MeanSquaredError())

    vae.fit(x_train, x_train, epochs=2, batch_size=64, verbose=0)
    return {"history": vae.history.history, "weights": vae.get_weights(),
            "predict": vae.predict(x_train[:10], verbose=0)}
