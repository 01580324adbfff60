"""Flax's NNX example "VAE" (``examples/nnx_toy_examples/05_vae.py``) on mirrorax: the port.

The program of ``flax_vae_original.py`` (the example as Flax runs it, on one device) with the lines a port
changes: ``@strategy.jit`` for its three ``@nnx.jit``, and each epoch's random batches drawn as before but
read through ``strategy.experimental_distribute_dataset`` (a dataset of one array: each batch is an array);
``tests/test_nnx.py`` counts them and checks 1, 3, 4 and 8 devices against the original on one device. Its
encoder creates a ``Loss`` variable in ``__call__`` (popped in the loss function) and draws noise from an
``nnx.Rngs`` stream it holds, as under ``@nnx.jit``.

Run: ``python examples/flax_vae.py`` (the example's sizes: 20 epochs of 200 steps), or
``main(devices=jax.devices()[:3], epochs=2, steps_per_epoch=5, num_train=500, num_test=50)``. The original is
the program of
google/flax ``examples/nnx_toy_examples/05_vae.py`` (Apache-2.0, as of flax 0.12.8): its encoder, which
creates a ``Loss`` variable in ``__call__`` and draws its noise from an ``nnx.Rngs`` stream it holds, its
decoder, its ``nnx.Optimizer``, its ``@nnx.jit`` steps (the training step pops the ``Loss`` variables inside
the loss function), its loop of random batches and its reconstructions and samples, verbatim, with edits made
to both files alike so that they can be compared and tested:

* the program is a function ``main`` whose arguments pick the devices (used by the port) and the sizes
  (``epochs``, ``steps_per_epoch``, ``batch_size``, the number of images), and which returns each epoch's
  mean loss, the reconstructions, the samples and the weights;
* MNIST-shaped synthetic digits (a noisy 28x28 pattern per class, uint8) stand in for the Hugging Face
  download, binarized as the example does;
* the figures are not drawn (the reconstructions and the samples are returned instead), and the prints are
  kept.
"""
# fmt: off
# ruff: noqa: B007, E111, E114, E501, F841, I001, UP035

import typing as tp

import numpy as np

import mirrorax as mx


def load_dataset(name, num_train=60000, num_test=10000, seed=0):
  """MNIST-shaped data in place of the download: ``dataset[split]['image']`` as 28x28 uint8 images."""
  rng = np.random.default_rng(seed)
  patterns = rng.uniform(0, 255, (10, 28, 28))
  def make(n):
    labels = rng.integers(0, 10, n)
    return {'image': list(np.clip(patterns[labels] + rng.normal(0, 60, (n, 28, 28)) - 80, 0, 255).astype(np.uint8))}
  return {'train': make(num_train), 'test': make(num_test)}


def main(devices=None, epochs=20, steps_per_epoch=200, batch_size=64, num_train=60000, num_test=10000, verbose=True):
  import jax
  import jax.numpy as jnp
  import optax

  strategy = mx.MirroredStrategy(devices)

  from flax import nnx

  np.random.seed(42)
  latent_size = 32
  image_shape: tp.Sequence[int] = (28, 28)

  dataset = load_dataset('mnist', num_train, num_test)
  X_train = np.array(np.stack(dataset['train']['image']), dtype=np.uint8)
  X_test = np.array(np.stack(dataset['test']['image']), dtype=np.uint8)
  # Now binarize data
  X_train = (X_train > 0).astype(jnp.float32)
  X_test = (X_test > 0).astype(jnp.float32)

  if verbose:
    print('X_train:', X_train.shape, X_train.dtype)
    print('X_test:', X_test.shape, X_test.dtype)

  class Loss(nnx.Variable):
    pass

  class Encoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
      self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
      self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
      self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
      self.rngs = rngs

    def __call__(self, x: jax.Array) -> jax.Array:
      x = x.reshape((x.shape[0], -1))  # flatten
      x = self.linear1(x)
      x = jax.nn.relu(x)

      mean = self.linear_mean(x)
      std = jnp.exp(self.linear_std(x))

      self.kl_loss = Loss(
        jnp.mean(
          0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, axis=-1)
        )
      )
      key = self.rngs.noise()
      z = mean + std * jax.random.normal(key, mean.shape)
      return z

  class Decoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
      self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
      self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
      z = self.linear1(z)
      z = jax.nn.relu(z)
      logits = self.linear2(z)
      return logits

  class VAE(nnx.Module):
    def __init__(
      self,
      din: int,
      hidden_size: int,
      latent_size: int,
      output_shape: tp.Sequence[int],
      *,
      rngs: nnx.Rngs,
    ):
      self.output_shape = output_shape
      self.encoder = Encoder(din, hidden_size, latent_size, rngs=rngs)
      self.decoder = Decoder(
        latent_size, hidden_size, int(np.prod(output_shape)), rngs=rngs
      )

    def __call__(self, x: jax.Array) -> jax.Array:
      z = self.encoder(x)
      logits = self.decoder(z)
      logits = jnp.reshape(logits, (-1, *self.output_shape))
      return logits

    def generate(self, z):
      logits = self.decoder(z)
      logits = jnp.reshape(logits, (-1, *self.output_shape))
      return nnx.sigmoid(logits)

  model = VAE(
    din=int(np.prod(image_shape)),
    hidden_size=256,
    latent_size=latent_size,
    output_shape=image_shape,
    rngs=nnx.Rngs(0, noise=1),
  )

  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @strategy.jit
  def train_step(model: VAE, optimizer: nnx.Optimizer, x: jax.Array):
    def loss_fn(model: VAE):
      logits = model(x)
      losses = nnx.pop(model, Loss)
      kl_loss = sum(jax.tree_util.tree_leaves(losses), 0.0)
      reconstruction_loss = jnp.mean(
        optax.sigmoid_binary_cross_entropy(logits, x)
      )
      loss = reconstruction_loss + 0.1 * kl_loss
      return loss

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)

    return loss

  @strategy.jit
  def forward(model: VAE, x: jax.Array) -> jax.Array:
    y_pred = model(x)
    return jax.nn.sigmoid(y_pred)

  @strategy.jit
  def sample(model: VAE, z: jax.Array) -> jax.Array:
    return model.generate(z)

  epoch_losses = []
  for epoch in range(epochs):
    losses = []
    batches = (X_train[np.random.randint(0, len(X_train), size=(batch_size,))] for step in range(steps_per_epoch))
    for x_batch in strategy.experimental_distribute_dataset(batches):

      loss = train_step(model, optimizer, x_batch)
      losses.append(np.asarray(loss))

    epoch_losses.append(float(np.mean(losses)))
    if verbose:
      print(f'Epoch {epoch} loss: {np.mean(losses)}')

  # get random samples
  idxs = np.random.randint(0, len(X_test), size=(5,))
  x_sample = X_test[idxs]

  # get predictions
  y_pred = forward(model, x_sample)

  # plot generative samples
  z_samples = np.random.normal(scale=1.5, size=(12, latent_size))
  samples = sample(model, z_samples)

  return {'losses': epoch_losses, 'reconstructions': np.asarray(y_pred), 'samples': np.asarray(samples),
          'weights': [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]}


if __name__ == '__main__':
  main()
