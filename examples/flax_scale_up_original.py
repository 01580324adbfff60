"""Flax's guide "Scale up on multiple devices", as Flax runs it (``jax.jit`` on a 2x4 mesh): the original.

Kept to diff ``flax_scale_up.py`` (the same program on mirrorax) against, and run by its test: the training
program of https://flax.readthedocs.io/en/latest/guides/flax_gspmd.html (google/flax,
``docs_nnx/guides/flax_gspmd.md``, Apache-2.0, as of flax 0.12.8): its setup, its 2x4 mesh of 8 devices, its
``DotReluDot`` / ``MultiDotReluDot`` model annotated with ``nnx.with_partitioning`` and a ``sharding=``
variable (a stack of 2 layers of 1024 x 1024, made by ``nnx.vmap``), its ``nnx.Optimizer``, loss, step and
loop, verbatim, with edits made to both files alike so that they can be compared and tested:

* the program is a function ``main`` whose arguments pick the mesh (its shape and devices: the test runs it
  on 1 device too), which records the losses and returns them with the model and the optimizer;
* the mesh is made with ``axis_types=(AxisType.Auto, AxisType.Auto)``: the guide's "auto-mode mesh" (its own
  words), which ``jax.make_mesh`` no longer makes by default (jax 0.10 makes Explicit axes, on which the
  guide's ``jnp.dot`` of two arrays split on their contracted dimension is refused as ambiguous);
* the cells that train nothing are left out (one variable and one ``nnx.Linear`` sharded and shown, the
  timing, the checkpoint, the logical-axis and explicit-sharding variants), and the cell that sets 8 CPU
  devices prints nothing.

As the guide writes it, its ``@jax.jit`` step updates the ``nnx.Optimizer`` inside the trace only: the model
comes back (the step returns it), the optimizer's Adam moments and step count do not (after the loop
``optimizer.step`` is 0 and each step starts Adam afresh). ``@nnx.jit`` and ``@strategy.jit`` write both back.
"""
# fmt: off
# ruff: noqa: B007, E111, E114, E501, F401, F841, I001

from functools import partial

import jax
from jax import numpy as jnp
from jax.sharding import PartitionSpec as P, NamedSharding, AxisType
import optax
import flax
from flax import nnx

# Ignore this if you are already running on a TPU or GPU
if not jax._src.xla_bridge.backends_are_initialized():
  jax.config.update('jax_num_cpu_devices', 8)


def main(mesh_shape=(2, 4), devices=None):
  # Create an auto-mode mesh of two dimensions and annotate each axis with a name.
  auto_mesh = jax.make_mesh(mesh_shape, ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)

  nnx.use_eager_sharding(True)
  assert nnx.using_eager_sharding()

  rngs = nnx.Rngs(0)

  class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
      init_fn = nnx.initializers.lecun_normal()
      self.dot1 = nnx.Linear(
        depth, depth,
        kernel_init=nnx.with_partitioning(init_fn, (None, 'model')),
        use_bias=False,  # or use `bias_init` to give it annotation too
        rngs=rngs)
      self.w2 = nnx.Param(
        init_fn(rngs.params(), (depth, depth)),  # RNG key and shape for W2 creation
        sharding=('model', None),
      )

    def __call__(self, x: jax.Array):
      y = self.dot1(x)
      y = jax.nn.relu(y)
      y = jax.lax.with_sharding_constraint(y, P('data', 'model'))
      z = jnp.dot(y, self.w2[...])
      return z

  class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
      # Annotate the additional axis with sharding=None, meaning it will be
      # replicated across all devices.
      @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
      def create_sublayers(r):
        return DotReluDot(depth, r)
      self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
      def scan_over_layers(x, layer):
        return layer(x), None
      x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
      return x

  @jax.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model: DotReluDot):
      y_pred = model(x)
      return jnp.mean((y_pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, loss

  losses = []

  with jax.set_mesh(auto_mesh):
    # Training data
    input = jax.device_put(rngs.normal((8, 1024)), P('data', None))
    label = jax.device_put(rngs.normal((8, 1024)), P('data', None))
    # Model and optimizer
    model = MultiDotReluDot(1024, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    # The loop
    for i in range(5):
      model, loss = train_step(model, optimizer, input, label)
      print(loss)    # Model (over-)fitting to the labels quickly.
      losses.append(float(loss))

  return {'losses': losses, 'model': model, 'optimizer': optimizer}


if __name__ == '__main__':
  main()
