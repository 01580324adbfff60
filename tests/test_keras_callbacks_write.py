"""Callbacks that write to the model or its optimizer act as under Keras's own ``fit`` (issue 17, 7-9).

Every Keras callback that writes optimizer or model values (``LearningRateScheduler``,
``ReduceLROnPlateau``, ``EarlyStopping(restore_best_weights=True)``, ``SwapEMAWeights``,
``BackupAndRestore``, ``TerminateOnNaN``, a ``LambdaCallback`` calling ``set_weights`` and
``learning_rate.assign``, a callback doing the same through ``Callback.model`` at batch ends) alone
alone under a scope of 1 device and in every pair under 4 devices, against plain Keras: the learning rate at each
epoch start, the weights at each epoch end, the History and the final weights, rtol 1e-4. Also: the
order of every batch hook (train, test, predict, with ``steps_per_execution`` 1 and 3), and the layout
of the variables after any assignment.

The model is a small tanh net on learnable targets (well conditioned); 96 rows at batch 24 are four
full batches on 1, 3 and 4 devices.
"""

import importlib.util
import itertools

import jax
import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx

pytestmark = pytest.mark.multi_device

RTOL = 1e-4
ROWS, BATCH, EPOCHS = 96, 24, 4
FIT = dict(batch_size=BATCH, shuffle=False, verbose=0)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS + 48, 8)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(8, 2)).astype("float32"))
    return x[:ROWS], y[:ROWS], x[ROWS:], y[ROWS:]


def _build(ema: bool = False, spe: int = 1) -> keras.Model:
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.2, use_ema=True, ema_momentum=0.5) if ema else keras.optimizers.SGD(0.2)
    m.compile(optimizer=opt, loss="mse", steps_per_execution=spe)
    return m


class _Record(keras.callbacks.Callback):
    """Last in the list: the rate each epoch trains with, and the weights each epoch leaves."""

    def __init__(self, out: dict):
        super().__init__()
        self.out = out

    def on_epoch_begin(self, epoch, logs=None):
        self.out.setdefault("lr", []).append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.out.setdefault("weights", []).append(self.model.get_weights())


class _NanRateAt(keras.callbacks.Callback):
    """Sets the rate to NaN at an epoch's start: its second batch's loss is NaN (for TerminateOnNaN)."""

    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.optimizer.learning_rate.assign(float("nan"))


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def _writers(model: keras.Model):
    """A LambdaCallback writing through the model it closes over, as a user writes one."""
    def batch_end(batch, logs):
        model.optimizer.learning_rate.assign(0.2 / (1.0 + 0.05 * batch))

    def epoch_end(epoch, logs):
        model.set_weights([w * 0.9 for w in model.get_weights()])

    return keras.callbacks.LambdaCallback(on_train_batch_end=batch_end, on_epoch_end=epoch_end)


class _BatchWriter(keras.callbacks.Callback):
    """Writes through ``Callback.model`` (which syncs the state first): Keras keeps these writes."""

    def on_train_batch_end(self, batch, logs=None):
        lr = self.model.optimizer.learning_rate
        lr.assign(lr * 0.95)
        if batch == 2:
            self.model.set_weights([w * 0.95 for w in self.model.get_weights()])


# Each callback kind: what it is made of (fresh for each fit), given the model and a directory.
KINDS = {
    "scheduler": lambda m, d: [keras.callbacks.LearningRateScheduler(lambda e, lr: lr if e < 2 else lr * 0.9)],
    # min_delta so large that no epoch after the first improves: a reduction (or the stop) every epoch
    "plateau": lambda m, d: [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                               min_delta=10.0)],
    "early_stopping": lambda m, d: [keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=10.0,
                                                                  restore_best_weights=True)],
    "swap_ema": lambda m, d: [keras.callbacks.SwapEMAWeights(swap_on_epoch=True)],
    "backup": lambda m, d: [keras.callbacks.BackupAndRestore(str(d / "backup"))],
    "terminate_on_nan": lambda m, d: [keras.callbacks.TerminateOnNaN(), _NanRateAt(2)],
    # (Keras loses the batch-end rate of this one: the variable it assigns is not the step's state.)
    "lambda": lambda m, d: [_writers(m)],
    "batch_writer": lambda m, d: [_BatchWriter()],
}


def _train(model: keras.Model, kinds: tuple[str, ...], directory) -> dict:
    """Trains ``model`` as the combination says; what the run left (see :class:`_Record`)."""
    x, y, xv, yv = _data()

    def callbacks(out):
        return [cb for k in kinds for cb in KINDS[k](model, directory)] + [_Record(out)]

    fit = dict(FIT, epochs=EPOCHS, validation_data=(xv, yv))
    if "backup" in kinds:  # interrupted at epoch 2, then run again: it resumes from the backup
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(x, y, callbacks=callbacks({}) + [_Interrupt()], **fit)
    out: dict = {}
    out["history"] = model.fit(x, y, callbacks=callbacks(out), **fit).history
    out["final"] = model.get_weights()
    return out


_KERAS_RUNS: dict = {}


def _keras_run(kinds: tuple[str, ...], tmp_path_factory) -> dict:
    """Plain Keras's run of a combination (the same for every device count: made once)."""
    if kinds not in _KERAS_RUNS:
        _KERAS_RUNS[kinds] = _train(_build(ema="swap_ema" in kinds), kinds, tmp_path_factory.mktemp("keras"))
    return _KERAS_RUNS[kinds]


def _assert_same_run(got: dict, want: dict) -> None:
    np.testing.assert_allclose(got["lr"], want["lr"], rtol=RTOL, err_msg="rate at epoch start")
    assert sorted(got["history"]) == sorted(want["history"])
    for k in want["history"]:
        np.testing.assert_allclose(got["history"][k], want["history"][k], rtol=RTOL, err_msg=k)
    assert len(got["weights"]) == len(want["weights"])
    for e, (g, w) in enumerate(zip(got["weights"] + [got["final"]], want["weights"] + [want["final"]])):
        for i, (a, b) in enumerate(zip(g, w)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6, err_msg=f"weight {i} after epoch {e}")


def _run_both(kinds: tuple[str, ...], devices: int, tmp_path, tmp_path_factory) -> tuple[dict, dict]:
    want = _keras_run(kinds, tmp_path_factory)
    with strategy(devices).scope():
        model = _build(ema="swap_ema" in kinds)
    return _train(model, kinds, tmp_path), want


def test_scheduler_after_plateau_keeps_both_changes():
    """The issue's case: ReduceLROnPlateau's halving at an epoch end, then the scheduler's * 0.9 at the next
    epoch's start; both reach the step (mirrorax lost the scheduler's)."""
    x, y, _, _ = _data()
    rates = []
    for model in (_build(), None):
        if model is None:
            with strategy(4).scope():
                model = _build()
        cbs = KINDS["scheduler"](model, None) + KINDS["plateau"](model, None)
        rates.append(model.fit(x, y, epochs=5, callbacks=cbs, **FIT).history["learning_rate"])
    np.testing.assert_allclose(rates[0], [0.2, 0.2, 0.09, 0.0405, 0.018225], rtol=1e-6)
    np.testing.assert_allclose(rates[1], rates[0], rtol=1e-6)


# Each kind alone on one device (a mesh of one: nothing to mirror), and in every pair on 4 devices: every
# kind runs on several devices in 7 pairs. (Alone on 3 devices repeated the pairs' code path: the same
# 4 full batches, 8 rows a device instead of 6, nothing padded.)
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_writing_callback_alone(kind, tmp_path, tmp_path_factory):
    got, want = _run_both((kind,), 1, tmp_path, tmp_path_factory)
    _assert_same_run(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("kinds", list(itertools.combinations(sorted(KINDS), 2)), ids="+".join)
def test_every_pair_of_writing_callbacks(kinds, tmp_path, tmp_path_factory):
    got, want = _run_both(kinds, 4, tmp_path, tmp_path_factory)
    _assert_same_run(got, want)


# -- the order of the batch hooks ------------------------------------------------------------------

_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end",
                "on_predict_batch_begin", "on_predict_batch_end")


class _Sequence(keras.callbacks.Callback):
    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls
        for name in _BATCH_HOOKS:
            setattr(self, name, lambda batch, logs=None, name=name: self.calls.append((name, batch)))


@pytest.mark.parametrize("spe", [1, 3])
def test_batch_hooks_come_in_keras_order(spe):
    """begin(k), end(k), begin(k+1): in fit (with validation), evaluate and predict; with
    steps_per_execution 3, four batches are an execution of three and a short one."""
    x, y, xv, yv = _data()
    runs = []
    for scoped in (False, True):
        if scoped:
            with strategy(4).scope():
                model = _build(spe=spe)
        else:
            model = _build(spe=spe)
        calls: list = []
        model.fit(x, y, epochs=1, validation_data=(xv, yv), callbacks=[_Sequence(calls)], **FIT)
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[_Sequence(calls)])
        model.predict(x, batch_size=BATCH, verbose=0, callbacks=[_Sequence(calls)])
        runs.append(calls)
    assert runs[1] == runs[0]
    assert ("on_predict_batch_begin", 0) in runs[0]


# -- the variables' layout after assignments --------------------------------------------------------

def _devices_of(model: keras.Model) -> set:
    return {len(v.value.sharding.device_set) for v in model.weights + model.optimizer.variables}


def test_variables_stay_on_every_device_after_any_assignment(tmp_path):
    x, y, _, _ = _data()
    s = strategy(3)
    with s.scope():
        model = _build()
    assert {len(v.value.sharding.device_set) for v in model.weights} == {3}  # mirrored from compile on
    model.set_weights([w + 0.01 for w in model.get_weights()])
    assert {len(v.value.sharding.device_set) for v in model.weights} == {3}
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0, restore_best_weights=True)
    writes = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: model.set_weights(model.get_weights()))
    model.fit(x, y, epochs=3, callbacks=[stop, writes], **FIT)
    assert stop.stopped_epoch > 0  # the best weights were restored with set_weights
    assert _devices_of(model) == {3}
    model.optimizer.learning_rate = 0.01
    model.save_weights(str(tmp_path / "w.weights.h5"))
    model.load_weights(str(tmp_path / "w.weights.h5"))
    assert _devices_of(model) == {3}
    for v in model.weights:
        assert v.value.sharding.is_equivalent_to(s.replicated, v.value.ndim)


def test_lending_the_same_state_again_is_free_until_the_model_changes(monkeypatch):
    """fit lends the state to the variables at its start, at each epoch's end and in its finally: a state
    lent already, whose variables still hold it, is not walked again; one a user replaced is lent again."""
    x, y, _, _ = _data()
    trainer = mx.Trainer(_build(), strategy(2))
    trainer.fit(x, y, epochs=1, **FIT)
    device, model = trainer.device_state, trainer.model
    adapter = device.adapter
    walks = []
    written = adapter._written_variables
    monkeypatch.setattr(adapter, "_written_variables", lambda: walks.append(1) or written())
    held = [v.value for v in model.weights]
    device.write_back()
    assert walks == [] and all(v.value is a for v, a in zip(model.weights, held))
    model.layers[0].kernel.assign(np.zeros((8, 8), "float32"))  # the user changes the model between fits
    device.write_back()  # the state is lent again: the trainer's values, not the zeros (Keras's own fit
    assert len(walks) == 1 and model.layers[0].kernel.value is held[0]  # would adopt them at its start)
    trainer.fit(x, y, epochs=1, **FIT)  # fit's start adopts nothing it did not see change
    np.testing.assert_allclose(trainer.evaluate(x, y, batch_size=BATCH)["loss"],
                               model.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-6)


def test_sharded_variables_stay_sharded_after_set_weights():
    s = mx.MirroredStrategy(devices=jax.devices()[:4], shard="all")
    with s.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(128), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    kernel = model.weights[0]
    want = s.state_sharding(tuple(kernel.shape), "params")
    assert want.spec != jax.sharding.PartitionSpec()  # large enough to be split
    model.set_weights([w * 0.5 for w in model.get_weights()])
    assert kernel.value.sharding.is_equivalent_to(want, 2)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(48, 256)), rng.normal(size=(48, 2)), epochs=1, **FIT)
    model.set_weights(model.get_weights())
    assert kernel.value.sharding.is_equivalent_to(want, 2)


# -- TensorBoard ----------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", [("tensorboard",), ("tensorflow", "tensorboard")])
def test_tensorboard_message_names_every_missing_package(missing, monkeypatch, tmp_path):
    """tensorflow-cpu 2.21 no longer installs tensorboard, without which tf.summary.scalar raises
    TBNotInstalledError at the first epoch end: fit says at once to install both."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else find_spec(name, *a))
    x, y, _, _ = _data()
    with strategy(2).scope():
        model = _build()
    with pytest.raises(ImportError, match=r"missing here: .*tensorboard.*pip install tensorflow-cpu tensorboard"):
        model.fit(x, y, epochs=1, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))], **FIT)
    assert not (tmp_path / "train").exists()  # before any training
