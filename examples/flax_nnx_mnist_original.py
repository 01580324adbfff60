"""Flax's NNX "MNIST tutorial", as Flax runs it (``@nnx.jit``, one device): the original.

Kept to diff ``flax_nnx_mnist.py`` (the same program on mirrorax) against, and run by its test on one
device: the program of https://flax.readthedocs.io/en/latest/mnist_tutorial.html (google/flax,
``docs_nnx/mnist_tutorial.md``, Apache-2.0, as of flax 0.12.8), with edits made to both files alike so
that they can be compared and tested:

* the program is a function ``main`` whose arguments pick the devices (used by the port), the sizes and
  the steps, and which returns the metrics and the weights;
* MNIST-shaped synthetic data (uint8 28x28 digits, labels 0-9) stands in for the Hugging Face download,
  behind the same ``load_dataset('mnist')`` / ``.shuffle(seed=0)`` / slicing the tutorial uses;
* ``make_batches`` keeps a final short batch (the tutorial drops it), so that the port shows one computed
  on its real rows;
* the metrics go to a ``metrics_history`` dict (and are printed, as the tutorial's earlier version did),
  not to TensorBoard, and the predictions of the last test batch are kept instead of plotted; the export
  to a SavedModel is left out.
"""
# fmt: off
# ruff: noqa: E111, E114, E501, F841

import jax
import numpy as np


class MnistSplit:
  """One split of MNIST-shaped data, read as a Hugging Face ``datasets`` split is: ``ds[i:j]`` gives a dict of
  lists (``'image'``: 28x28 uint8 arrays, ``'label'``: ints), ``shuffle(seed=...)`` a shuffled copy."""

  def __init__(self, images, labels):
    self.images, self.labels = images, labels

  def __len__(self):
    return len(self.labels)

  def __getitem__(self, rows):
    return {'image': list(self.images[rows]), 'label': list(self.labels[rows])}

  def shuffle(self, seed):
    order = np.random.default_rng(seed).permutation(len(self))
    return MnistSplit(self.images[order], self.labels[order])


def load_dataset(name, num_train=60000, num_test=10000, seed=0):
  """MNIST-shaped data in place of the download: a noisy 28x28 pattern per class."""
  rng = np.random.default_rng(seed)
  patterns = rng.uniform(0, 255, (10, 28, 28))
  def make(n):
    labels = rng.integers(0, 10, n)
    images = np.clip(patterns[labels] + rng.normal(0, 60, (n, 28, 28)), 0, 255).astype(np.uint8)
    return MnistSplit(images, labels)
  return {'train': make(num_train), 'test': make(num_test)}


def main(devices=None, train_steps=1200, eval_every=200, batch_size=32, num_train=60000, num_test=10000, verbose=True):
  dataset = load_dataset('mnist', num_train, num_test)
  train_ds = dataset['train'].shuffle(seed=0)
  test_ds = dataset['test']

  def make_batches(ds, batch_size):
    """Yield batches of normalized (image, label) numpy arrays."""
    for i in range(0, len(ds), batch_size):
      batch = ds[i : i + batch_size]
      images = np.stack([
        np.array(img, dtype=np.float32)[..., None] / 255.0
        for img in batch['image']
      ])
      yield {'image': images, 'label': np.array(batch['label'])}

  from functools import partial

  from flax import nnx  # The Flax NNX API.

  class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, rngs: nnx.Rngs):
      self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
      self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
      self.dropout1 = nnx.Dropout(rate=0.025)
      self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
      self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
      self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
      self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
      self.dropout2 = nnx.Dropout(rate=0.025)
      self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
      x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
      x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
      x = x.reshape(x.shape[0], -1)  # flatten
      x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
      x = self.linear2(x)
      return x

  # Instantiate the model.
  model = CNN(rngs=nnx.Rngs(0))

  import jax.numpy as jnp  # JAX NumPy

  y = model(jnp.ones((1, 28, 28, 1)), nnx.Rngs(0))

  import optax

  learning_rate = 0.005
  momentum = 0.9

  optimizer = nnx.Optimizer(
    model, optax.adamw(learning_rate, momentum), wrt=nnx.Param
  )
  metrics = nnx.MultiMetric(
    accuracy=nnx.metrics.Accuracy(),
    loss=nnx.metrics.Average('loss'),
  )

  def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch['image'], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch['label']
    ).mean()
    return loss, logits

  @nnx.jit
  def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.

  @nnx.jit
  def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.

  train_model = nnx.view(model, deterministic=False, use_running_average=False)
  eval_model = nnx.view(model, deterministic=True, use_running_average=True)

  @nnx.jit
  def pred_step(model: CNN, batch):
    logits = model(batch['image'], None)
    return logits.argmax(axis=1)

  metrics_history = {
    'train_loss': [],
    'train_accuracy': [],
    'test_loss': [],
    'test_accuracy': [],
    'test_predictions': [],
  }

  rngs = nnx.Rngs(0)

  for step, batch in enumerate(make_batches(train_ds, batch_size)):
    if step >= train_steps:
      break

    # Run the optimization for one step and make a stateful update to the following:
    # - The train state's model parameters
    # - The optimizer state
    # - The training loss and accuracy batch metrics
    train_step(train_model, optimizer, metrics, rngs, batch)

    if step > 0 and (step % eval_every == 0 or step == train_steps - 1):  # Evaluation period passed.
      # Log the training metrics.
      for metric, value in metrics.compute().items():  # Compute the metrics.
        metrics_history[f'train_{metric}'].append(float(value))  # Record the metrics.
      metrics.reset()  # Reset the metrics for the test set.

      # Compute the metrics on the test set after each training epoch.
      for test_batch in make_batches(test_ds, batch_size):
        eval_step(eval_model, metrics, test_batch)

      # Keep the predicted labels of a single test batch
      pred = pred_step(eval_model, test_batch)
      metrics_history['test_predictions'].append(np.asarray(pred))

      # Log the test metrics.
      for metric, value in metrics.compute().items():
        metrics_history[f'test_{metric}'].append(float(value))  # Record the metrics.
      metrics.reset()  # Reset the metrics for the next training epoch.

      if verbose:
        print(
          f"[train] step: {step}, "
          f"loss: {metrics_history['train_loss'][-1]}, "
          f"accuracy: {metrics_history['train_accuracy'][-1] * 100}"
        )
        print(
          f"[test] step: {step}, "
          f"loss: {metrics_history['test_loss'][-1]}, "
          f"accuracy: {metrics_history['test_accuracy'][-1] * 100}"
        )

  metrics_history['weights'] = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model))]
  metrics_history['rng_count'] = int(rngs.default.count[...])
  return metrics_history


if __name__ == '__main__':
  main()
