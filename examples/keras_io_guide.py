"""The keras.io guide "Multi-GPU distributed training with JAX", written on mirrorax's strategy.

The guide (https://keras.io/guides/distributed_training_with_jax/) trains a Keras convnet on MNIST with
a hand-written JAX loop: ``model.stateless_call`` for the forward pass, ``optimizer.stateless_apply``
for the update, and manual ``jax.sharding`` code (a ``Mesh``, two ``NamedSharding`` s, ``device_put``
of every batch and of the state). Here the strategy does that part:

- ``Mesh(devices, ("batch",))`` and two ``NamedSharding`` s -> ``strategy = mx.MirroredStrategy()``;
- ``jax.device_put(model.trainable_variables, var_replication)`` -> ``strategy.replicate(...)``;
- ``jax.device_put(x.numpy(), data_sharding)`` per batch -> ``strategy.experimental_distribute_dataset``;
- ``train_data.batch(64, drop_remainder=True)`` -> every example is used: the last batch is placed padded
  and the step, in the global view, is given its real rows only (as ``tf.data``'s short last batch);
  ``mx.compute_average_loss`` averages over them (and reads the same per replica);
- ``@jax.jit`` -> ``@strategy.jit(donate_argnums=0)`` (the state's buffers are reused, at most two steps
  are in flight);
- ``model.stateless_call(tv, ntv, x)`` -> ``model.stateless_call(tv, ntv, x, training=True)``.

The result does not depend on the device count: 2 epochs on 1 device and on 2, 3 or 4 devices, or on 2
processes (a batch of 64 does not divide by 3: every batch is placed padded to 66 rows; the last batch
holds 8 rows) give the same weights up to float32 rounding, BatchNormalization and Dropout included: the
step computes on the real rows only, so BatchNorm's statistics are theirs and Dropout's mask is drawn for
them, as on one device.

No download: the data are scikit-learn's bundled 8x8 digits, scaled up to MNIST's 28x28 pixels (0..255).
The convnet is the guide's, narrowed to two convolutions (a test runs it in seconds), with GELU in place of
ReLU (ReLU nets amplify float32 rounding into differences that hide a real one).

Run: ``python examples/keras_io_guide.py`` (every device), or ``main(num_devices=3)`` from Python.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

from typing import Any  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import mirrorax as mx  # noqa: E402


def get_model() -> keras.Model:
    """The guide's convnet, narrowed (two convolutions), GELU for ReLU: BatchNorm and Dropout kept."""
    inputs = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Conv2D(filters=12, kernel_size=3, strides=2, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.Activation("gelu")(x)
    x = keras.layers.Conv2D(filters=24, kernel_size=3, strides=2, padding="same", use_bias=False,
                            name="large_k")(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.Activation("gelu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


def get_dataset(num_train: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-shaped digits without a download: sklearn's 8x8 digits scaled up to 28x28, values 0..255."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.kron(d.images[:num_train], np.ones((3, 3)))  # 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))) * (255.0 / 16.0)
    return images.astype("float32")[..., None], d.target[:num_train].astype("int32")


def main(num_devices: int | None = None, epochs: int = 2, batch_size: int = 64, num_train: int = 200,
         seed: int = 1, verbose: bool = True) -> dict[str, Any]:
    """Trains the guide's convnet with a custom loop on ``num_devices`` devices (``None``: all of them).

    Returns:
      ``{"weights": model.get_weights(), "losses": the mean training loss of each epoch}``.
    """
    strategy = mx.MirroredStrategy(devices=None if num_devices is None else jax.devices()[:num_devices])
    if verbose:
        print(f"Running on {strategy.num_replicas_in_sync} devices: {strategy}")
    x_train, y_train = get_dataset(num_train)
    # Every example of every epoch is used; the step is given the last global batch's real rows only.
    train_data = strategy.experimental_distribute_dataset((x_train, y_train), batch_size=batch_size)

    keras.utils.set_random_seed(seed)
    model = get_model()
    optimizer = keras.optimizers.Adam(1e-3)
    # One loss per example: mx.compute_average_loss divides their sum by the global count of real rows.
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    model.build((None, 28, 28, 1))
    optimizer.build(model.trainable_variables)

    def compute_loss(trainable_variables, non_trainable_variables, batch):
        x, y = batch.data
        # training=True: the guide's loop leaves it out, which runs BatchNorm/Dropout in inference mode.
        y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x,
                                                               training=True)
        return mx.compute_average_loss(loss(y, y_pred), batch), non_trainable_variables

    compute_gradients = jax.value_and_grad(compute_loss, has_aux=True)

    # Written for the whole global batch: XLA splits it over the devices and sums the gradients.
    @strategy.jit(donate_argnums=0)
    def train_step(train_state, batch):
        trainable_variables, non_trainable_variables, optimizer_variables = train_state
        (loss_value, non_trainable_variables), grads = compute_gradients(
            trainable_variables, non_trainable_variables, batch)
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        return (trainable_variables, non_trainable_variables, optimizer_variables), loss_value

    # The guide's get_replicated_train_state(devices), without a mesh or a sharding.
    train_state = strategy.replicate(
        ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
         [v.value for v in optimizer.variables]))

    losses = []
    for epoch in range(epochs):
        epoch_losses = []
        for batch in train_data:
            train_state, loss_value = train_step(train_state, batch)
            epoch_losses.append(loss_value)  # read after the epoch: the host does not wait per step
        losses.append(float(np.mean([float(v) for v in epoch_losses])))
        if verbose:
            print(f"Epoch {epoch} loss: {losses[-1]:.4f}")

    # As in the guide: write the trained state back into the model.
    trainable_variables, non_trainable_variables, optimizer_variables = train_state
    for variable, value in zip(model.trainable_variables, trainable_variables):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable_variables):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_variables):
        variable.assign(value)
    return {"weights": model.get_weights(), "losses": losses}


if __name__ == "__main__":
    main()
