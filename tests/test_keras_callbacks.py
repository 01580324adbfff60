"""Keras's built-in callbacks under ``strategy.scope()`` act as under Keras's own single-device ``fit``.

Each test builds the same seeded model twice, one under a 4-device scope and one plain, runs the same
``fit`` (100 rows, batch 32: the last batch of 4 rows is padded and masked under the scope) and checks
the callback's effect: the stopping epoch, the learning-rate sequence, the files written, the weights
restored, the hooks called. tanh keeps the comparison well conditioned (rtol 1e-5 / atol 1e-6).
"""

import csv
import os

import h5py
import keras
import numpy as np
import pytest
from helpers import assert_weights_close, flat_digits, strategy

# Keras's own conformance: each test trains two models for several epochs.
pytestmark = [pytest.mark.multi_device, pytest.mark.slow]

RTOL, ATOL = 1e-5, 1e-6
ROWS, BATCH, DEVICES = 100, 32, 4


def _build(seed: int = 3, optimizer: object = "sgd", lr: float = 0.1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(10, activation="softmax")])
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": lr}})
    elif callable(optimizer):  # a factory: each model gets its own optimizer
        optimizer = optimizer()
    m.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def _pair(**kwargs):
    """The same model twice: (plain Keras, made under a 4-device scope)."""
    ref = _build(**kwargs)
    with strategy(DEVICES).scope():
        model = _build(**kwargs)
    return ref, model


def _data():
    x, y, xt, yt = flat_digits(ROWS)
    # Validation labels that disagree with the training labels: the validation loss rises as the
    # model learns, so monitors of val_loss trigger within a few epochs.
    return x / 16.0, y, xt[:60] / 16.0, (yt[:60] + 3) % 10


FIT = dict(batch_size=BATCH, shuffle=False, verbose=0)


def test_early_stopping_stops_at_the_same_epoch_and_restores_the_same_weights():
    x, y, xv, yv = _data()
    ref, model = _pair(optimizer="adam", lr=0.02)
    stops = []
    for m in (ref, model):
        stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)
        hist = m.fit(x, y, epochs=20, validation_data=(xv, yv), callbacks=[stop], **FIT).history
        stops.append((stop.stopped_epoch, stop.best_epoch, len(hist["loss"])))
    assert stops[0] == stops[1]
    assert 0 < stops[0][0] < 19  # it did stop early
    assert_weights_close(model, ref, RTOL, ATOL)  # the best epoch's weights, restored in on_train_end


def test_model_checkpoint_save_best_only_writes_the_same_files(tmp_path):
    x, y, xv, yv = _data()
    ref, model = _pair(optimizer="adam", lr=0.02)
    dirs = []
    for name, m in (("keras", ref), ("scope", model)):
        d = tmp_path / name
        d.mkdir()
        save = keras.callbacks.ModelCheckpoint(str(d / "{epoch:02d}.weights.h5"), monitor="val_loss",
                                               save_best_only=True, save_weights_only=True)
        m.fit(x, y, epochs=5, validation_data=(xv, yv), callbacks=[save], **FIT)
        dirs.append(d)
    names = sorted(os.listdir(dirs[0]))
    assert names == sorted(os.listdir(dirs[1]))
    assert 0 < len(names) < 5  # only the epochs that improved
    for n in names:
        want, got = _h5_arrays(dirs[0] / n), _h5_arrays(dirs[1] / n)
        assert sorted(want) == sorted(got)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL, err_msg=f"{n}:{k}")
    # And the file loads back into a plain model as the same weights.
    fresh = _build(optimizer="adam", lr=0.02)  # the file holds Adam's state too
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(str(dirs[1] / names[-1]))
    again = _build(optimizer="adam", lr=0.02)
    again.optimizer.build(again.trainable_variables)
    again.load_weights(str(dirs[0] / names[-1]))
    assert_weights_close(fresh, again, RTOL, ATOL)


def _h5_arrays(path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, np.asarray(v)) if isinstance(v, h5py.Dataset) else None)
    return out


class _LearningRates(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(float(np.asarray(self.model.optimizer.learning_rate)))


def test_reduce_lr_on_plateau_gives_the_same_rate_sequence_and_weights():
    x, y, xv, yv = _data()
    ref, model = _pair(optimizer="sgd", lr=0.2)
    rates, hists = [], []
    for m in (ref, model):
        seen = _LearningRates()
        reduce = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_lr=1e-3)
        hists.append(m.fit(x, y, epochs=5, validation_data=(xv, yv), callbacks=[reduce, seen], **FIT).history)
        rates.append(seen.rates)
    np.testing.assert_allclose(rates[1], rates[0], rtol=1e-7)
    assert len(set(rates[0])) > 2  # the rate did change, more than once
    np.testing.assert_allclose(hists[1]["learning_rate"], hists[0]["learning_rate"], rtol=1e-7)
    assert_weights_close(model, ref, RTOL, ATOL)


# LearningRateScheduler: test_keras_callbacks_write.py checks the rate at each epoch start and the weights
# after each epoch against Keras's, alone (1 device) and in every pair (4 devices).


def test_terminate_on_nan_stops_at_the_same_batch_as_keras():
    """Keras's ``fit`` does not raise on a non-finite loss; under the scope it does not either, so
    ``TerminateOnNaN`` sees the nan in the batch logs and stops where it stops under Keras."""
    x, y, _, _ = _data()
    x = x.copy()
    x[40] = np.nan  # epoch 1, batch 1 (rows 32-63)
    ref, model = _pair(optimizer="sgd", lr=0.1)
    seen = []
    for m in (ref, model):
        batches = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs, batches=batches: batches.append((b, bool(np.isnan(logs["loss"])))))
        hist = m.fit(x, y, epochs=3, callbacks=[keras.callbacks.TerminateOnNaN(), record], **FIT).history
        seen.append((batches, len(hist["loss"])))
    assert seen[0] == seen[1]
    assert seen[0] == ([(0, False), (1, True)], 1)


def test_csv_logger_writes_the_same_columns_and_values(tmp_path):
    x, y, xv, yv = _data()
    ref, model = _pair(optimizer="adam", lr=0.01)
    tables = []
    for name, m in (("keras", ref), ("scope", model)):
        path = tmp_path / f"{name}.csv"
        m.fit(x, y, epochs=3, validation_data=(xv, yv), callbacks=[keras.callbacks.CSVLogger(str(path))], **FIT)
        with open(path, newline="") as f:
            tables.append(list(csv.reader(f)))
    want, got = tables
    assert got[0] == want[0]  # header: epoch, accuracy, loss, val_accuracy, val_loss
    assert len(got) == len(want) == 4
    np.testing.assert_allclose(np.asarray(got[1:], float), np.asarray(want[1:], float), rtol=1e-5, atol=1e-7)


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_at_the_same_epoch_with_the_same_weights(tmp_path):
    x, y, _, _ = _data()
    ref, model = _pair(optimizer="adam", lr=0.01)
    epochs_run = []
    for name, m in (("keras", ref), ("scope", model)):
        backup = str(tmp_path / name)
        with pytest.raises(RuntimeError, match="interrupted"):
            m.fit(x, y, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(2)], **FIT)
        seen = []
        record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs, seen=seen: seen.append(e))
        hist = m.fit(x, y, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup), record], **FIT)
        epochs_run.append((seen, hist.epoch))
        assert not os.path.exists(backup)  # deleted at on_train_end, as under Keras
    assert epochs_run[0] == epochs_run[1] == ([2, 3], [2, 3])
    assert_weights_close(model, ref, RTOL, ATOL)


_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end")


def _recorder(calls: list) -> keras.callbacks.LambdaCallback:
    def hook(name):
        def call(*args, logs=None):
            if args and isinstance(args[-1], dict):
                args, logs = args[:-1], args[-1]
            index = args[0] if args else None
            calls.append((name, index, None if logs is None else sorted(logs),
                          None if not logs or "loss" not in logs else float(logs["loss"])))
        return call

    return keras.callbacks.LambdaCallback(**{n: hook(n) for n in _HOOKS})


def test_lambda_callback_hooks_are_called_in_keras_order_and_count():
    x, y, xv, yv = _data()
    ref, model = _pair(optimizer="sgd", lr=0.1)
    runs = []
    for m in (ref, model):
        calls = []
        m.fit(x, y, epochs=2, validation_data=(xv, yv), validation_batch_size=BATCH, callbacks=[_recorder(calls)],
              **FIT)
        runs.append(calls)
    want, got = runs
    assert [c[:3] for c in got] == [c[:3] for c in want]  # names, batch/epoch indices, log keys
    np.testing.assert_allclose([c[3] for c in got if c[3] is not None], [c[3] for c in want if c[3] is not None],
                               rtol=1e-5)
    names = [c[0] for c in want]
    assert names.count("on_train_batch_end") == 2 * 4 and names.count("on_test_batch_end") == 2 * 2


def test_batch_logs_come_to_the_host_only_when_a_callback_reads_them():
    """A batch callback that keeps its logs without reading them waits for no step (Keras's CallbackList
    would convert them first); read later, they hold Keras's own batch logs."""
    x, y, _, _ = _data()
    ref, model = _pair(optimizer="sgd", lr=0.1)
    kept = {}
    for name, m in (("ref", ref), ("scope", model)):
        logs_seen = kept.setdefault(name, [])
        keep = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs, seen=logs_seen: seen.append(logs))
        m.fit(x, y, epochs=1, callbacks=[keep], **FIT)
    assert len(kept["scope"]) == len(kept["ref"]) == 4
    assert all(type(logs).__name__ == "LazyLogs" and logs._pending for logs in kept["scope"])  # never read
    assert [sorted(logs) for logs in kept["scope"]] == [sorted(logs) for logs in kept["ref"]]
    for got, want in zip(kept["scope"], kept["ref"]):
        assert all(isinstance(v, float) for v in got.values())  # read now: Python floats, as Keras gives
        np.testing.assert_allclose([got[k] for k in sorted(want)], [want[k] for k in sorted(want)], rtol=1e-5)


def test_optimizer_ema_weights_are_swapped_in_at_the_end_of_fit():
    x, y, _, _ = _data()

    def opt():
        return keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=None)

    ref, model = _pair(optimizer=opt)
    for m in (ref, model):
        m.fit(x, y, epochs=3, **FIT)
    assert_weights_close(model, ref, RTOL, ATOL)  # the moving averages, as Keras's finalize_variable_values
    averages = [np.asarray(v) for v in model.optimizer._model_variables_moving_average]
    for w, a in zip(model.trainable_weights, averages):
        np.testing.assert_array_equal(np.asarray(w), a)


def test_swap_ema_weights_validates_with_the_averages():
    x, y, xv, yv = _data()

    ref, model = _pair(optimizer=lambda: keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.9))
    hists = []
    for m in (ref, model):
        hists.append(m.fit(x, y, epochs=3, validation_data=(xv, yv), callbacks=[keras.callbacks.SwapEMAWeights()],
                           **FIT).history)
    for k in hists[0]:  # val_* computed with the averages swapped in at on_test_begin
        np.testing.assert_allclose(hists[1][k], hists[0][k], rtol=1e-5, err_msg=k)
    assert_weights_close(model, ref, RTOL, ATOL)
    # predict too swaps at on_predict_begin (and Keras leaves what its on_predict_end leaves).
    want = ref.predict(xv, batch_size=BATCH, verbose=0, callbacks=[keras.callbacks.SwapEMAWeights()])
    got = model.predict(xv, batch_size=BATCH, verbose=0, callbacks=[keras.callbacks.SwapEMAWeights()])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert_weights_close(model, ref, RTOL, ATOL)


def test_tensorboard_without_tensorflow_says_what_to_install(tmp_path):
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("TensorFlow is installed: the TensorBoard callback works")
    x, y, _, _ = _data()
    with strategy(2).scope():
        model = _build()
    with pytest.raises(ImportError, match="pip install tensorflow-cpu"):
        model.fit(x, y, epochs=1, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))], **FIT)


def test_plain_object_callbacks_of_a_keras_model_in_the_trainer():
    """``mx.Trainer.fit`` takes plain objects with ``on_*`` methods for any model; for a Keras model
    they are wrapped into Keras callbacks (Keras's ``CallbackList`` calls every hook of every member)."""
    import mirrorax as mx

    class Plain:
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(batch)

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(("epoch", epoch, sorted(logs)))

    x, y, _, _ = _data()
    plain = Plain()
    mx.Trainer(_build(), strategy(2)).fit(x, y, epochs=1, callbacks=[plain], **FIT)
    assert plain.seen == [0, 1, 2, 3, ("epoch", 0, ["accuracy", "loss"])]
