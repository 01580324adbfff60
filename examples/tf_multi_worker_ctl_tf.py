"""TensorFlow's "Custom training loop with Keras and MultiWorkerMirroredStrategy" tutorial, as TensorFlow runs it.

Kept to diff ``tf_multi_worker_ctl.py`` (the same program on mirrorax) against, and run by nothing: the text
of https://www.tensorflow.org/tutorials/distribute/multi_worker_with_ctl (its ``mnist.py`` and ``main.py`` in
one file), with these edits made to both files alike so that they can be compared and tested: the program is
a function ``main`` whose arguments give the checkpoint directory, the global batch (the tutorial's 64 per
worker times its 2 workers, read from ``TF_CONFIG``), the epochs, the steps per epoch and the rows; seeded
synthetic MNIST-shaped data (8,910 rows: 70 global batches of 128, the last of 78) stands in for the
download; the shuffle and the weights are seeded; each epoch's accuracy and loss are also returned; and the
epoch counters are advanced before the save rather than after it (the tutorial saves ``epoch`` and
``step_in_epoch`` before advancing them, so its resumed run finds a finished epoch, trains no step of it and
divides its loss by zero batches).
"""
# fmt: off
# ruff: noqa: E111, E114, E501, UP031

import os
import sys

import numpy as np
import tensorflow as tf


def load_mnist(num_rows=8910, seed=0):
  """MNIST-shaped data (uint8 28x28 images, labels 0-9): a noisy pattern per class."""
  rng = np.random.default_rng(seed)
  patterns = rng.uniform(0, 255, (10, 28, 28))
  labels = rng.integers(0, 10, num_rows).astype(np.uint8)
  images = np.clip(patterns[labels] + rng.normal(0, 100, (num_rows, 28, 28)), 0, 255).astype(np.uint8)
  return (images, labels), None


def mnist_dataset(batch_size, num_rows=8910, seed=1):
  (x_train, y_train), _ = load_mnist(num_rows)
  # The `x` arrays are in uint8 and have values in the range [0, 255].
  # You need to convert them to float32 with values in the range [0, 1]
  x_train = x_train / np.float32(255)
  y_train = y_train.astype(np.int64)
  train_dataset = tf.data.Dataset.from_tensor_slices(
      (x_train, y_train)).shuffle(60000, seed=seed)
  return train_dataset

def dataset_fn(global_batch_size, input_context, num_rows=8910):
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  dataset = mnist_dataset(batch_size, num_rows)
  dataset = dataset.shard(input_context.num_input_pipelines,
                          input_context.input_pipeline_id)
  dataset = dataset.batch(batch_size)
  return dataset

def build_cnn_model():
  return tf.keras.Sequential([
      tf.keras.Input(shape=(28, 28)),
      tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
      tf.keras.layers.Conv2D(32, 3, activation='relu'),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(128, activation='relu'),
      tf.keras.layers.Dense(10)
  ])


def main(checkpoint_dir, global_batch_size=128, num_epochs=3, num_steps_per_epoch=70, num_rows=8910, seed=1):
  tf.keras.utils.set_random_seed(seed)

  # Checkpoint saving and restoring
  def _is_chief(task_type, task_id, cluster_spec):
    return (task_type is None
            or task_type == 'chief'
            or (task_type == 'worker'
                and task_id == 0
                and 'chief' not in cluster_spec.as_dict()))

  def _get_temp_dir(dirpath, task_id):
    base_dirpath = 'workertemp_' + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir

  def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
      dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)

  # Define Strategy
  strategy = tf.distribute.MultiWorkerMirroredStrategy()

  with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_cnn_model()

    multi_worker_dataset = strategy.distribute_datasets_from_function(
        lambda input_context: dataset_fn(global_batch_size, input_context, num_rows))
    optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.001)
    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
        name='train_accuracy')

  @tf.function
  def train_step(iterator):
    """Training step function."""

    def step_fn(inputs):
      """Per-Replica step function."""
      x, y = inputs
      with tf.GradientTape() as tape:
        predictions = multi_worker_model(x, training=True)
        per_batch_loss = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True,
            reduction=tf.keras.losses.Reduction.NONE)(y, predictions)
        loss = tf.nn.compute_average_loss(
            per_batch_loss, global_batch_size=global_batch_size)

      grads = tape.gradient(loss, multi_worker_model.trainable_variables)
      optimizer.apply_gradients(
          zip(grads, multi_worker_model.trainable_variables))
      train_accuracy.update_state(y, predictions)

      return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(
        tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

  epoch = tf.Variable(
      initial_value=tf.constant(0, dtype=tf.dtypes.int64), name='epoch')
  step_in_epoch = tf.Variable(
      initial_value=tf.constant(0, dtype=tf.dtypes.int64),
      name='step_in_epoch')

  task_type, task_id, cluster_spec = (strategy.cluster_resolver.task_type,
                                      strategy.cluster_resolver.task_id,
                                      strategy.cluster_resolver.cluster_spec())

  checkpoint = tf.train.Checkpoint(
      model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)

  write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                        cluster_spec)
  checkpoint_manager = tf.train.CheckpointManager(
      checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

  # Restoring the checkpoint
  latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
  if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)

  # Resume our CTL training
  history = []
  while epoch.numpy() < num_epochs:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0

    while step_in_epoch.numpy() < num_steps_per_epoch:
      total_loss += train_step(iterator)
      num_batches += 1
      step_in_epoch.assign_add(1)

    train_loss = total_loss / num_batches
    print('Epoch: %d, accuracy: %f, train_loss: %f.'
                  %(epoch.numpy(), train_accuracy.result(), train_loss))
    history.append((int(epoch.numpy()), float(train_accuracy.result()), float(train_loss)))

    train_accuracy.reset_states()

    epoch.assign_add(1)
    step_in_epoch.assign(0)

    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
      tf.io.gfile.rmtree(write_checkpoint_dir)

  return history


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else os.path.join('/tmp', 'ckpt'))
