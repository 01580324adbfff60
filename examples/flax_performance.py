"""Flax's NNX guide "Performance considerations" on mirrorax: the port.

The program of ``flax_performance_original.py`` (the guide as Flax runs it, on one device) with the lines a
port changes: ``@strategy.jit`` in place of ``@nnx.jit`` and of ``@jax.jit``, and each loop's batches read
through ``strategy.experimental_distribute_dataset`` (the loops unpack them: ``for x, y in ...``);
``tests/test_nnx.py`` counts them (5 beyond the imports and the strategy line) and checks 1, 3, 4 and 8
devices against the original on one device. The guide's three loops run as it writes them: the
``@strategy.jit`` step over the objects (which holds them between calls: the graph is walked once, not per
step), the same step through ``nnx.cached_partial``, and the functional loop over ``graphdef`` and ``state``.

Run: ``python examples/flax_performance.py``. The original is the program of https://flax.readthedocs.io/en/latest/guides/performance.html (google/flax,
``docs_nnx/guides/performance.md``, Apache-2.0, as of flax 0.12.8): its model, its ``nnx.Optimizer`` and
``nnx.MultiMetric``, its ``@nnx.jit`` step and loop, the same step cached with ``nnx.cached_partial``, and its
functional loop (``nnx.split`` before it, a plain ``jax.jit`` step over ``graphdef`` and ``state``,
``nnx.update`` after it), verbatim, with edits made to both files alike so that they can be compared and
tested:

* the program is a function ``main`` whose arguments pick the devices (used by the port) and the sizes, and
  which returns each loop's losses and the objects' final state;
* each loop runs over batches of learnable data (``make_batches``: host ``(x, y)`` arrays of 2 inputs and 3
  targets, the last batch short) in place of the guide's constant ``jnp.ones((32, 2)), jnp.zeros((32, 3))``,
  so that the numbers depend on which rows a step sees;
* the losses are kept (the guide computes them and drops them).
"""
# fmt: off
# ruff: noqa: E111, E114, E501, F841, I001

import numpy as np

import mirrorax as mx


def make_batches(num_rows, batch_size, seed):
  """Host (x, y) batches of learnable data: y is a smooth function of x, the last batch short."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_rows, 2)).astype(np.float32)
  y = np.stack([np.sin(x[:, 0]), np.cos(x[:, 1]), x[:, 0] * x[:, 1]], axis=1).astype(np.float32)
  return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, num_rows, batch_size)]


def main(devices=None, num_rows=200, batch_size=32):
  strategy = mx.MirroredStrategy(devices)
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import optax

  class Model(nnx.Module):
    def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
      self.linear = nnx.Linear(din, dmid, rngs=rngs)
      self.bn = nnx.BatchNorm(dmid, rngs=rngs)
      self.dropout = nnx.Dropout(0.2, rngs=rngs)
      self.linear_out = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
      x = nnx.relu(self.dropout(self.bn(self.linear(x))))
      return self.linear_out(x)

  model = Model(2, 64, 3, rngs=nnx.Rngs(0))  # eager initialization
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  metrics = nnx.MultiMetric(
    loss=nnx.metrics.Average('loss'),
  )

  @strategy.jit  # <== currently slow
  def train_step(model, optimizer, metrics, x, y):
    def loss_fn(model):
      y_pred = model(x)  # call methods directly
      return ((y_pred - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # in-place updates
    metrics.update(loss=loss)

    return loss

  losses = {'nnx_jit': [], 'cached_partial': [], 'functional': []}
  for x, y in strategy.experimental_distribute_dataset(make_batches(num_rows, batch_size, seed=0)):
    loss = train_step(model, optimizer, metrics, x, y)
    losses['nnx_jit'].append(float(loss))

  cached_train_step = nnx.cached_partial(train_step, model, optimizer, metrics)

  for x, y in strategy.experimental_distribute_dataset(make_batches(num_rows, batch_size, seed=1)):
    loss = cached_train_step(x, y)
    losses['cached_partial'].append(float(loss))

  # split before training loop
  graphdef, state = nnx.split((model, optimizer, metrics))

  @strategy.jit  # regular JAX
  def jax_train_step(graphdef, state, x, y):
    # merge at the beginning of the function
    model, optimizer, metrics = nnx.merge(graphdef, state)

    def loss_fn(model):
      y_pred = model(x)  # call methods directly
      return ((y_pred - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)

    state = nnx.state((model, optimizer, metrics))
    return loss, state

  for x, y in strategy.experimental_distribute_dataset(make_batches(num_rows, batch_size, seed=2)):
    loss, state = jax_train_step(graphdef, state, x, y)
    losses['functional'].append(float(loss))

  # update objects after training
  nnx.update((model, optimizer, metrics), state)

  return {**losses, 'metrics': {k: float(v) for k, v in metrics.compute().items()},
          'state': [np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
                    for a in jax.tree.leaves(nnx.state((model, optimizer)))]}


if __name__ == '__main__':
  print(main())
