"""Keras's own shuffle order under the scope: with ``keras.utils.set_random_seed`` and fit's default
``shuffle=True``, a model trained under ``mx.MirroredStrategy().scope()`` on 1, 3 or 4 devices trains on the
batches plain Keras trains on, so it ends with plain Keras's weights and History (issue 17, item 5).

Rows divide into full batches on 3 and 4 devices (96 rows, batch 24; 120 with ``validation_split``), so
these tests compare the order alone. The model is small and well conditioned (tanh, learnable targets):
a batch in another order moves the weights by far more than the tolerance (see
``test_the_order_decides_the_weights``).
"""

from __future__ import annotations

import random

import jax
import keras
import numpy as np
import pytest
from helpers import built

import mirrorax as mx

pytestmark = pytest.mark.multi_device

ROWS, BATCH = 96, 24
DEVICES = [1, 3, 4]


def _data(rows: int = ROWS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    w = rng.normal(size=(5, 2)).astype(np.float32)
    return x, np.tanh(x @ w).astype(np.float32)  # learnable targets


def _model() -> keras.Model:
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    m.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
    return m


class _Draws(keras.callbacks.Callback):
    """Draws from numpy's and Python's global random state at every epoch's start and (``per_batch``) every
    batch's (as a user's callback may): the data order must still be Keras's, and these draws Keras's too."""

    def __init__(self, per_batch: bool = True) -> None:
        super().__init__()
        self.per_batch = per_batch
        self.seen: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen += [float(np.random.random()), random.random()]

    def on_train_batch_begin(self, batch, logs=None):
        if self.per_batch:
            self.seen.append(float(np.random.random()))


def _train(n: int | None, fit_kwargs: dict, data=None, epochs: int = 3, fits: int = 1, per_batch: bool = True):
    """Weights, History and the callback's draws after ``fits`` fits, plain Keras (``n=None``) or under the
    scope of ``n`` devices, from the same seed."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    m = built(_model, n)
    x, y = _data() if data is None else data
    draws = _Draws(per_batch)
    histories = []
    for _ in range(fits):
        args = (x,) if y is None else (x, y)
        kw = {"epochs": epochs, **fit_kwargs}
        histories.append(m.fit(*args, verbose=0, callbacks=[draws], **kw).history)
    return m.get_weights(), histories, draws.seen


def _assert_same(plain, scoped) -> None:
    (w0, h0, d0), (w1, h1, d1) = plain, scoped
    for i, (a, b) in enumerate(zip(w0, w1)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")
    assert len(h0) == len(h1)
    for a, b in zip(h0, h1):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, err_msg=key)
    assert d1 == d0  # the program's own draws: the global states stayed in step with Keras's


CASES = {
    "shuffle": {"batch_size": BATCH},
    "validation_split": {"batch_size": BATCH, "validation_split": 0.2},
    "shuffle_batch": {"batch_size": BATCH, "shuffle": "batch"},
    # 4 batches a pass: epochs of 3, 1, 3 batches, the first pass starting at the fit's first epoch
    "steps_per_epoch": {"batch_size": BATCH, "steps_per_epoch": 3, "initial_epoch": 1, "epochs": 4},
    "steps_per_epoch_no_batch_size": {"steps_per_epoch": 4},  # Keras's batch: 96 rows / 4 steps = 24
}


@pytest.fixture(scope="module")
def plain_runs():
    cache: dict = {}

    def run(name: str, runner=None, **kw):
        if name not in cache:
            cache[name] = runner(None) if runner else _train(None, **kw)
        return cache[name]

    return run


@pytest.mark.slow  # 3 epochs, scoped and plain
@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # steps_per_epoch: Keras's, and ours alike
@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_arrays_train_in_keras_order(plain_runs, case, n):
    kw = dict(CASES[case])
    data = _data(120) if case == "validation_split" else None  # 96 training rows after the split
    # shuffle="batch": a pass's per-batch permutations are drawn together when it starts (its batches
    # are read ahead), so a callback drawing between batches would see other numbers than under Keras.
    per_batch = case != "shuffle_batch"
    plain = plain_runs(case, fit_kwargs=kw, data=data, per_batch=per_batch)
    _assert_same(plain, _train(n, kw, data=data, per_batch=per_batch))


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 4])
def test_second_fit_continues_keras_order(plain_runs, n):
    """A fit after the first reads no batch to build the model (Keras's _symbolic_build): the order
    still follows Keras's draws."""
    kw = {"batch_size": BATCH}
    plain = plain_runs("two_fits", fit_kwargs=kw, epochs=2, fits=2)
    _assert_same(plain, _train(n, kw, epochs=2, fits=2))


class _Crash(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


@pytest.mark.slow
@pytest.mark.parametrize("n", [4])
def test_backup_and_restore_resumes_as_keras(tmp_path, n):
    """Interrupted at epoch 2 and run again with BackupAndRestore (a new model, the program's random state
    going on): the resumed epochs draw their orders as Keras's do, from where the state is."""
    def run(n, directory):
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        strategy = mx.MirroredStrategy(devices=jax.devices()[:n]) if n else None
        x, y = _data()
        draws = _Draws()
        for crash in (True, False):
            if strategy is None:
                m = _model()
            else:
                with strategy.scope():
                    m = _model()
            backup = keras.callbacks.BackupAndRestore(str(directory))
            callbacks = [backup, draws] + ([_Crash()] if crash else [])
            try:
                history = m.fit(x, y, batch_size=BATCH, epochs=4, verbose=0, callbacks=callbacks).history
            except RuntimeError:
                assert crash
        return m.get_weights(), [history], draws.seen

    _assert_same(run(None, tmp_path / "plain"), run(n, tmp_path / "scoped"))


class _Rows(keras.utils.PyDataset):
    """A PyDataset of 4 batches of 24 rows (Keras's own default of 1 worker)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = _data()
        self.events: list[str] = []

    def __len__(self):
        return ROWS // BATCH

    def __getitem__(self, index):
        self.events.append(f"get{index}")
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]

    def on_epoch_begin(self):
        self.events.append("begin")

    def on_epoch_end(self):
        self.events.append("end")


@pytest.mark.slow
@pytest.mark.parametrize("n", DEVICES)
def test_py_dataset_shuffles_as_keras(plain_runs, n):
    """fit(PyDataset, shuffle=True): batches in the order of Keras's random.shuffle, and the dataset's
    hooks and reads in Keras's sequence."""
    def run(n):
        data = _Rows()
        return _train(n, {}, data=(data, None)), data.events

    plain, events = plain_runs("py_dataset", fit_kwargs={}, data=None, runner=run)
    scoped, scoped_events = run(n)
    _assert_same(plain, scoped)
    assert scoped_events == events


@pytest.mark.parametrize("shuffle", [True, "batch", False])
def test_pass_order_is_keras_array_adapter_order(shuffle):
    """The order of a pass is the rows Keras's ArrayDataAdapter yields from the same random state (100
    rows in batches of 32: a short last batch), and leaves the state where Keras's leaves it."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    from mirrorax.keras.order import pass_order

    np.random.seed(3)
    adapter = ArrayDataAdapter(np.arange(100), batch_size=32, shuffle=shuffle)
    want = np.concatenate([np.asarray(b[0] if isinstance(b, tuple) else b) for b in adapter.get_numpy_iterator()])
    after_keras = np.random.random()
    np.random.seed(3)
    got = pass_order(shuffle, 100, 32)
    np.testing.assert_array_equal(np.arange(100) if got is None else got, want)
    assert np.random.random() == after_keras


def test_the_order_decides_the_weights():
    """The control: the same training in mirrorax's own (seed, pass) order ends elsewhere than Keras's, by
    far more than the tolerance (so the tests above would fail on a branch without Keras's order)."""
    kw = {"batch_size": BATCH}
    plain = _train(None, kw, epochs=2)
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    with mx.MirroredStrategy(devices=jax.devices()[:4]).scope():
        m = _model()
    x, y = _data()
    mx.Trainer(m).fit(x, y, epochs=2, verbose=0, **kw)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(plain[0], m.get_weights()))
    assert diff > 1e-3


def test_trainer_shuffle_batch_permutes_rows_within_each_batch():
    """The explicit Trainer's shuffle="batch": each batch's own rows, permuted by (seed, pass)."""
    from mirrorax.inputs.arrays import ArraySource

    source = ArraySource(np.zeros((100, 2), np.float32))
    order = source.order("batch", 0, 1, 32)
    for start in range(0, 100, 32):
        assert sorted(order[start:start + 32]) == list(range(start, min(start + 32, 100)))
    assert not np.array_equal(order, np.arange(100))
    np.testing.assert_array_equal(order, source.order("batch", 0, 1, 32))  # a function of (seed, pass)
    assert not np.array_equal(order, source.order("batch", 0, 2, 32))
