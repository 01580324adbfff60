"""Flax's guide "Scale up on multiple devices" on mirrorax: the port.

The program of ``flax_scale_up_original.py`` (the guide's training program as Flax runs it, ``jax.jit`` on a 2x4
mesh) with the one line a port changes: ``@strategy.jit`` in place of ``@jax.jit``, beside the import and the
strategy line (``mx.MirroredStrategy(mesh=auto_mesh)``: the guide's own mesh). Everything else is the guide's:
its annotations (``nnx.with_partitioning``, ``sharding=``, the layer axis ``nnx.vmap`` adds), its batch placed
with ``jax.device_put(..., P('data', None))``, its ``with_sharding_constraint``, its step that returns the model.
``tests/test_nnx.py`` counts the changed lines and checks that the annotated kernels and their Adam moments
stay split as annotated and that the losses and weights are those of the same program on 1 device.

One difference in the numbers is the step's: ``@strategy.jit`` writes the ``nnx.Optimizer`` back (its Adam
moments and step count), as ``@nnx.jit`` does, where the guide's ``@jax.jit`` keeps only the model it
returns, so from the third loss on the port's are Adam's with its moments (0.646, 0.485, 0.350 against the
guide's 0.649, 0.523, 0.384). The port on 1 device is the guide's program under ``@nnx.jit``, bitwise.

Run: ``python examples/flax_scale_up.py`` (8 CPU devices made when none are set up, as the guide does), or
``main(mesh_shape=(1, 1), devices=jax.devices()[:1])``.

The original is https://flax.readthedocs.io/en/latest/guides/flax_gspmd.html (google/flax,
``docs_nnx/guides/flax_gspmd.md``, Apache-2.0, as of flax 0.12.8), with edits made to both files alike so
that they can be compared and tested (see the original's docstring).
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

import mirrorax as mx

# Ignore this if you are already running on a TPU or GPU
if not jax._src.xla_bridge.backends_are_initialized():
  jax.config.update('jax_num_cpu_devices', 8)


def main(mesh_shape=(2, 4), devices=None):
  # Create an auto-mode mesh of two dimensions and annotate each axis with a name.
  auto_mesh = jax.make_mesh(mesh_shape, ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
  strategy = mx.MirroredStrategy(mesh=auto_mesh)

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

  @strategy.jit
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
