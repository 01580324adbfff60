"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, on mirrorax's strategy.

The tutorial (https://www.tensorflow.org/tutorials/distribute/custom_training) writes the step per
replica: each replica computes ``tf.nn.compute_average_loss`` on its rows (divided by the *global* batch),
adds ``tf.nn.scale_regularization_loss(model.losses)``, and ``strategy.run`` runs it on every replica;
``strategy.reduce(SUM, per_replica_losses)`` gives the batch loss. The same shape here:

- ``tf.distribute.MirroredStrategy()`` -> ``mx.MirroredStrategy()``;
- ``strategy.experimental_distribute_dataset(dataset)`` -> the same name, on arrays and a global batch
  size (or any iterable of global batches);
- ``tf.nn.compute_average_loss(loss, global_batch_size=...)`` -> ``mx.compute_average_loss(loss, batch)``
  (padding rows masked; divided by the global count of real rows);
- ``tf.nn.scale_regularization_loss(model.losses)`` -> ``sum(losses) / ctx.num_replicas_in_sync``;
- ``optimizer.apply_gradients`` (which sums the replicas' gradients) -> an optax update: inside
  ``strategy.run`` JAX has already summed the gradients of the replicated weights;
- ``strategy.run(train_step, args=(x,))`` -> ``strategy.run(train_step, args=(state, batch))``;
- ``strategy.reduce(SUM, per_replica_losses, axis=None)`` -> ``strategy.reduce("sum", per_replica_losses)``.

The same ``train_step`` also runs in the global view (``mode="jit"``: ``strategy.jit``, the whole batch at
once, no replica context): both give the same weights, on any device count.

No download: scikit-learn's bundled 8x8 digits stand in for Fashion-MNIST; tanh in place of ReLU keeps
the comparison between device counts well conditioned; SGD with momentum in place of Adam, because
Adam divides by the gradients' scale: a loop that summed its gradients twice would still look right.

Run: ``python examples/tf_custom_loop.py [run|jit]``, or ``main(num_devices=3, mode="run")`` from Python.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mirrorax as mx  # noqa: E402


def create_model() -> keras.Model:
    """The tutorial's convnet (L2 on the hidden Dense layer), narrowed for 8x8 images."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(8, 3, activation="tanh"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(10),
    ])


def get_data(num_train: int = 200, num_test: int = 100) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                  tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    y = d.target.astype(np.int32)
    return (x[:num_train], y[:num_train]), (x[num_train:num_train + num_test], y[num_train:num_train + num_test])


def main(num_devices: int | None = None, mode: str = "run", epochs: int = 2, global_batch_size: int = 64,
         num_train: int = 200, seed: int = 1, verbose: bool = True) -> dict[str, Any]:
    """The tutorial's loop on ``num_devices`` devices; ``mode="run"`` per replica, ``"jit"`` global view.

    Returns:
      ``{"weights": trainable weights (host), "train_loss", "train_accuracy", "test_loss",
      "test_accuracy": one value per epoch}``.
    """
    if mode not in ("run", "jit"):
        raise ValueError(f"mode must be 'run' (per replica) or 'jit' (global view); received {mode!r}.")
    strategy = mx.MirroredStrategy(devices=None if num_devices is None else jax.devices()[:num_devices])
    (x_train, y_train), (x_test, y_test) = get_data(num_train)
    train_dist_dataset = strategy.experimental_distribute_dataset((x_train, y_train), batch_size=global_batch_size)
    test_dist_dataset = strategy.experimental_distribute_dataset((x_test, y_test), batch_size=global_batch_size)

    keras.utils.set_random_seed(seed)
    with strategy.scope():  # as in TF; the model's values are placed by strategy.replicate below
        model = create_model()
    optimizer = optax.sgd(0.1, momentum=0.9)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(labels, predictions, batch, model_losses):
        per_example_loss = loss_object(labels, predictions)
        loss = mx.compute_average_loss(per_example_loss, batch)
        regularization = sum(model_losses)
        ctx = mx.get_replica_context()
        if ctx is not None:  # tf.nn.scale_regularization_loss: each replica adds its share
            regularization = regularization / ctx.num_replicas_in_sync
        return loss + regularization

    def train_step(state, batch):
        images, labels = batch.data

        def loss_fn(trainable):
            predictions, non_trainable, losses = model.stateless_call(
                trainable, state["non_trainable"], images, training=True, return_losses=True)
            return compute_loss(labels, predictions, batch, losses), (predictions, non_trainable)

        # Per replica, the gradient of the replicated weights comes out summed over the replicas (JAX
        # inserts the all-reduce that TF's optimizer.apply_gradients makes): the global batch's gradient.
        (loss, (predictions, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"])
        updates, opt = optimizer.update(grads, state["opt"], state["trainable"])
        state = {"trainable": optax.apply_updates(state["trainable"], updates), "non_trainable": non_trainable,
                 "opt": opt}
        correct = jnp.sum((jnp.argmax(predictions, axis=-1) == labels) * batch.mask)
        return state, loss, correct

    def test_step(state, batch):
        images, labels = batch.data
        predictions, _ = model.stateless_call(state["trainable"], state["non_trainable"], images)
        loss_sum = jnp.sum(loss_object(labels, predictions) * batch.mask)
        correct = jnp.sum((jnp.argmax(predictions, axis=-1) == labels) * batch.mask)
        return loss_sum, correct

    if mode == "run":
        def distributed_train_step(state, batch):
            return strategy.run(train_step, args=(state, batch))

        def distributed_test_step(state, batch):
            return strategy.run(test_step, args=(state, batch))

        def total(values):  # per-replica values of every step -> one number
            return sum(float(strategy.reduce("sum", v)) for v in values)
    else:
        distributed_train_step = strategy.jit(train_step, donate_argnums=0)
        distributed_test_step = strategy.jit(test_step)

        def total(values):  # the global view's values are already the whole batch's
            return sum(float(v) for v in values)

    trainable = [v.value for v in model.trainable_variables]
    state = strategy.replicate({"trainable": trainable,
                                "non_trainable": [v.value for v in model.non_trainable_variables],
                                "opt": optimizer.init(trainable)})
    history: dict[str, list[float]] = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    for epoch in range(epochs):
        # Per-step values are reduced after the epoch: the host never waits for the step it just started.
        losses, corrects = [], []
        for batch in train_dist_dataset:
            state, loss, correct = distributed_train_step(state, batch)
            losses.append(loss)
            corrects.append(correct)
        history["train_loss"].append(total(losses) / len(losses))
        history["train_accuracy"].append(total(corrects) / len(x_train))

        test_losses, test_corrects = [], []
        for batch in test_dist_dataset:
            loss_sum, correct = distributed_test_step(state, batch)
            test_losses.append(loss_sum)
            test_corrects.append(correct)
        history["test_loss"].append(total(test_losses) / len(x_test))
        history["test_accuracy"].append(total(test_corrects) / len(x_test))
        if verbose:
            print(f"Epoch {epoch + 1}, Loss: {history['train_loss'][-1]:.4f}, "
                  f"Accuracy: {100 * history['train_accuracy'][-1]:.2f}, Test Loss: {history['test_loss'][-1]:.4f}, "
                  f"Test Accuracy: {100 * history['test_accuracy'][-1]:.2f}")
    return {"weights": [np.asarray(w) for w in state["trainable"]], **history}


if __name__ == "__main__":
    main(mode=sys.argv[1] if len(sys.argv) > 1 else "run")
