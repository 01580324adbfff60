"""keras-io: guides/writing_your_own_callbacks.py (Keras 3 version: EarlyStoppingAtMinLoss restores
the best weights with set_weights; CustomLearningRateScheduler assigns optimizer.learning_rate at
each epoch start).

Verbatim: get_model, LossAndErrorPrintingCallback (its prints silenced), EarlyStoppingAtMinLoss,
CustomLearningRateScheduler, LR_SCHEDULE, lr_schedule and both fits (batch 64). Changed: data (600
rows of 8 features with a learnable linear target of digit-like size instead of MNIST's 784 pixels
and labels: RMSprop(0.1) on 784 features oscillates, and an oscillating fit amplifies rounding), ``np.Inf`` (removed
in NumPy 2) -> ``np.inf``, epochs 30 -> 8 and 15 -> 8 (the schedule's changes at epochs 3 and 6 stay
inside), a fixed seed; the learning rate at each epoch end is recorded.
"""

import contextlib
import io

import keras
import numpy as np


# Define the Keras model to add callbacks to
def get_model():
    model = keras.Sequential()
    model.add(keras.layers.Dense(1))
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=0.1),
        loss="mean_squared_error",
        metrics=["mean_absolute_error"],
    )
    return model


class LossAndErrorPrintingCallback(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(
            "Up to batch {}, the average loss is {:7.2f}.".format(batch, logs["loss"])
        )

    def on_test_batch_end(self, batch, logs=None):
        print(
            "Up to batch {}, the average loss is {:7.2f}.".format(batch, logs["loss"])
        )

    def on_epoch_end(self, epoch, logs=None):
        print(
            "The average loss for epoch {} is {:7.2f} "
            "and mean absolute error is {:7.2f}.".format(
                epoch, logs["loss"], logs["mean_absolute_error"]
            )
        )


class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
    """Stop training when the loss is at its min, i.e. the loss stops decreasing.

    Arguments:
        patience: Number of epochs to wait after min has been hit. After this
        number of no improvement, training stops.
    """

    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        # best_weights to store the weights at which the minimum loss occurs.
        self.best_weights = None

    def on_train_begin(self, logs=None):
        # The number of epoch it has waited when loss is no longer minimum.
        self.wait = 0
        # The epoch the training stops at.
        self.stopped_epoch = 0
        # Initialize the best as infinity.
        self.best = np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("loss")
        if np.less(current, self.best):
            self.best = current
            self.wait = 0
            # Record the best weights if current results is better (less).
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                print("Restoring model weights from the end of the best epoch.")
                self.model.set_weights(self.best_weights)

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")


class CustomLearningRateScheduler(keras.callbacks.Callback):
    """Learning rate scheduler which sets the learning rate according to schedule.

    Arguments:
        schedule: a function that takes an epoch index
            (integer, indexed from 0) and current learning rate
            as inputs and returns a new learning rate as output (float).
    """

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_begin(self, epoch, logs=None):
        if not hasattr(self.model.optimizer, "learning_rate"):
            raise ValueError('Optimizer must have a "learning_rate" attribute.')
        # Get the current learning rate from model's optimizer.
        lr = self.model.optimizer.learning_rate
        # Call schedule function to get the scheduled learning rate.
        scheduled_lr = self.schedule(epoch, lr)
        # Set the value back to the optimizer before this epoch starts
        self.model.optimizer.learning_rate = scheduled_lr
        print(f"\nEpoch {epoch}: Learning rate is {float(np.array(scheduled_lr))}.")


LR_SCHEDULE = [
    # (epoch to start, learning rate) tuples
    (3, 0.05),
    (6, 0.01),
    (9, 0.005),
    (12, 0.001),
]


def lr_schedule(epoch, lr):
    """Helper function to retrieve the scheduled learning rate based on epoch."""
    if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
        return lr
    for i in range(len(LR_SCHEDULE)):
        if epoch == LR_SCHEDULE[i][0]:
            return LR_SCHEDULE[i][1]
    return lr


class _RecordLearningRate(keras.callbacks.Callback):  # not in the guide: what the test compares
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(float(np.array(self.model.optimizer.learning_rate)))


def program(strategy_scope):
    rng = np.random.default_rng(11)
    x_train = rng.random((600, 8)).astype("float32")
    y_train = x_train @ rng.uniform(1, 3, size=(8, 1))  # digit-like targets, 4 to 12

    out = {}
    with contextlib.redirect_stdout(io.StringIO()):
        with strategy_scope():
            model = get_model()
        model.fit(
            x_train,
            y_train,
            batch_size=64,
            epochs=8,
            verbose=0,
            callbacks=[LossAndErrorPrintingCallback(), EarlyStoppingAtMinLoss()],
        )
        out["early_stopping"] = {"history": model.history.history, "weights": model.get_weights()}

        with strategy_scope():
            model = get_model()
        rates = _RecordLearningRate()
        model.fit(
            x_train,
            y_train,
            batch_size=64,
            epochs=8,
            verbose=0,
            callbacks=[
                LossAndErrorPrintingCallback(),
                CustomLearningRateScheduler(lr_schedule),
                rates,
            ],
        )
        out["lr_schedule"] = {"history": model.history.history, "weights": model.get_weights(),
                              "learning_rates": rates.rates}
    return out
