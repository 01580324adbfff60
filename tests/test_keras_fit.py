"""The TF program unchanged: a Keras model made or compiled under ``strategy.scope()`` trains with its own
``fit`` / ``evaluate`` / ``predict`` / ``*_on_batch`` on every device of the strategy, and ends where
Keras's single-device ``fit`` ends (atol 1e-4 / rtol 1e-5 on weights after 2 Adam epochs, as in
``test_equivalence.py``)."""

import contextlib

import keras
import numpy as np
import pytest
from helpers import assert_weights_close, digits, flat_digits, strategy

import mirrorax as mx
from mirrorax import zoo

pytestmark = pytest.mark.multi_device

WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-4


def _cnn() -> keras.Model:
    keras.utils.set_random_seed(1)
    m = zoo.digits_cnn(width=8, dropout=0.1)  # BatchNorm + Dropout
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


@pytest.fixture(scope="module")
def keras_cnn_reference():
    x, y, xt, yt = digits(200)  # 200 rows, batch 48: the last batch has 8
    model = _cnn()
    hist = model.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0).history
    return model, hist, model.evaluate(xt, yt, batch_size=64, verbose=0), model.predict(xt, batch_size=64, verbose=0)


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
@pytest.mark.parametrize("n", [1, 2, 8])
def test_seed_program_under_scope_trains_on_every_device_with_keras_numbers(keras_cnn_reference, n):
    ref, ref_hist, ref_eval, ref_pred = keras_cnn_reference
    x, y, xt, yt = digits(200)
    s = strategy(n)
    with s.scope():
        model = _cnn()
    history = model.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    assert isinstance(history, keras.callbacks.History) and model.history is history
    assert history.epoch == [0, 1]
    assert_weights_close(model, ref, WEIGHT_RTOL, WEIGHT_ATOL)  # BatchNorm statistics included
    np.testing.assert_allclose(history.history["loss"], ref_hist["loss"], rtol=1e-5)
    assert history.history["accuracy"] == pytest.approx(ref_hist["accuracy"], abs=1e-7)
    # The variables are mirrored: one value on every device of the strategy.
    assert model.trainable_variables[0].value.sharding.device_set == set(s.devices)
    ev = model.evaluate(xt, yt, batch_size=64, verbose=0)
    assert isinstance(ev, list) and len(ev) == 2  # Keras's list, in model.metrics_names order
    np.testing.assert_allclose(ev, ref_eval, rtol=1e-5)
    assert model.evaluate(xt, yt, batch_size=64, verbose=0, return_dict=True)["accuracy"] == pytest.approx(ref_eval[1])
    pred = model.predict(xt, batch_size=64, verbose=0)
    assert isinstance(pred, np.ndarray) and pred.shape == (len(xt), 10)
    np.testing.assert_allclose(pred, ref_pred, rtol=1e-5, atol=1e-6)
    assert mx.keras.fit.trainer_of(model).compile_counts()["train"] == 2  # full batches and the short last one


def test_model_made_outside_any_scope_is_plain_keras():
    from keras.src.backend.jax.trainer import JAXTrainer

    init = JAXTrainer.__init__
    with strategy(2).scope():
        assert JAXTrainer.__init__ is not init  # wrapped while the scope is open
        inside = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert JAXTrainer.__init__ is init  # and restored when it closes: nothing global outlives it
    outside = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    outside.compile(optimizer="sgd", loss="mse")
    assert "fit" not in outside.__dict__ and mx.keras.fit.strategy_of(outside) is None
    assert "fit" in inside.__dict__
    outside.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)  # Keras's own loop, one device
    assert len(outside.trainable_variables[0].value.sharding.device_set) == 1


def test_compiled_under_scope_after_being_built_outside():
    x, y, _, _ = flat_digits(64)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    s = strategy(4)
    with s.scope():
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # called after the scope closed
    assert model.trainable_variables[0].value.sharding.device_set == set(s.devices)


@pytest.mark.slow  # two models and fits
def test_two_strategies_in_one_process():
    import jax

    x, y, _, _ = flat_digits(64)
    a, b = mx.MirroredStrategy(devices=jax.devices()[:2]), mx.MirroredStrategy(devices=jax.devices()[4:8])
    models = []
    for s in (a, b):
        with s.scope():
            keras.utils.set_random_seed(1)
            m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
            m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        models.append(m)
    for m in models:
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert models[0].trainable_variables[0].value.sharding.device_set == set(a.devices)
    assert models[1].trainable_variables[0].value.sharding.device_set == set(b.devices)
    assert_weights_close(models[0], models[1], 1e-5, 1e-6)  # the same run on other devices


@pytest.mark.slow
def test_train_on_batch_loop_equals_keras():
    x, y, _, _ = flat_digits(90)

    def build():
        keras.utils.set_random_seed(2)
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    ref = build()
    with strategy(4).scope():
        model = build()
    for i in range(0, 90, 30):  # 30 rows do not divide by 4: padded and masked
        want = ref.train_on_batch(x[i:i + 30], y[i:i + 30], return_dict=True)
        got = model.train_on_batch(x[i:i + 30], y[i:i + 30], return_dict=True)
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], [want[k] for k in want], rtol=1e-5)
    assert_weights_close(model, ref, 1e-5, 1e-6)
    np.testing.assert_allclose(model.test_on_batch(x[:30], y[:30]), ref.test_on_batch(x[:30], y[:30]), rtol=1e-5)
    np.testing.assert_allclose(model.predict_on_batch(x[:30]), ref.predict_on_batch(x[:30]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
def test_model_metrics_hold_the_last_totals_after_fit_and_evaluate_as_keras():
    """After fit (with validation: its totals are the last ones), evaluate and train_on_batch, the model's
    own metric objects hold what Keras's leave there (get_metrics_result, a metric's result())."""
    x, y, _, _ = flat_digits(90)

    def build():
        keras.utils.set_random_seed(4)
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    ref = build()
    with strategy(4).scope():
        model = build()

    def same():
        want, got = ref.get_metrics_result(), model.get_metrics_result()
        assert sorted(got) == sorted(want)
        np.testing.assert_allclose([float(got[k]) for k in want], [float(want[k]) for k in want], rtol=1e-5)
        assert float(want["loss"]) > 0  # (not the zeros the metrics were compiled with)

    for m in (ref, model):
        m.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, validation_data=(x[:30], y[:30]))
    same()
    for m in (ref, model):
        m.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    same()
    for m in (ref, model):
        m.evaluate(x[:50], y[:50], batch_size=16, verbose=0)
    same()
    for m in (ref, model):
        m.train_on_batch(x[:30], y[:30])
    same()


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
def test_fit_signature_validation_split_class_weight_and_validation_freq_match_keras():
    x, y, _, _ = flat_digits(120)
    weights = {c: 1.0 + 0.1 * c for c in range(10)}

    def build():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    kwargs = dict(batch_size=25, epochs=3, shuffle=False, verbose=0, validation_split=0.25, class_weight=weights,
                  validation_freq=2)
    ref = build()
    want = ref.fit(x, y, **kwargs).history
    with strategy(8).scope():
        model = build()
    got = model.fit(x, y, **kwargs).history
    assert sorted(got) == sorted(want)
    for k in want:  # val_* only at epochs 2 (validation_freq=2): one value
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    assert_weights_close(model, ref, 1e-5, 1e-6)


def test_unsupported_argument_is_a_clear_error():
    x, y, _, _ = flat_digits(32)
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="validation_split"):
        model.fit(iter([(x, y)]), validation_split=0.5, verbose=0)


@pytest.mark.slow
def test_run_eagerly_falls_back_to_keras_with_a_warning():
    x, y, _, _ = flat_digits(32)
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", run_eagerly=True)
    with pytest.warns(UserWarning, match="run_eagerly=True"):
        model.fit(x, y, batch_size=16, verbose=0)


def test_callbacks_can_stop_evaluate_and_predict_early():
    x, y, _, _ = flat_digits(96)
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    seen = {"test": 0, "predict": 0}

    class Stop(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            seen["test"] += 1
            self.model.stop_evaluating = True

        def on_predict_batch_end(self, batch, logs=None):
            seen["predict"] += 1
            self.model.stop_predicting = True

    model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[Stop()])
    out = model.predict(x, batch_size=16, verbose=0, callbacks=[Stop()])
    assert seen["test"] == 1  # 6 batches, stopped after the first
    # predict's batch hooks run as outputs arrive, a step behind: a step dispatched before the stop was
    # seen counts neither in the hooks nor in the outputs, as in Keras.
    assert seen["predict"] == 1 and len(out) == 16


def test_progress_is_keras_own(capsys):
    x, y, _, _ = flat_digits(64)
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=2, verbose=2, validation_data=(x, y))
    out = capsys.readouterr().out
    import re

    assert re.findall(r"^Epoch \d/2$", out, re.M) == ["Epoch 1/2", "Epoch 2/2"], out
    assert len(re.findall(r"^4/4 - .* - accuracy: [0-9.]+ - loss: [0-9.]+ - val_accuracy: ", out, re.M)) == 2, out


def _tanh_dense(seed: int = 4, **compile_kwargs) -> keras.Model:
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(10, activation="softmax")])
    m.compile(**dict(dict(optimizer="sgd", loss="sparse_categorical_crossentropy"), **compile_kwargs))
    return m


class _Batches(keras.callbacks.Callback):
    """Which batch indices each epoch's on_train_batch_begin saw."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[list[int]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([])

    def on_train_batch_begin(self, batch, logs=None):
        self.epochs[-1].append(batch)


class _Rows(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i):
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[s], self.y[s]


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
@pytest.mark.parametrize("steps_per_epoch", [3, 6])
@pytest.mark.parametrize("kind", ["arrays", "py_dataset"])
def test_steps_per_epoch_ends_where_the_data_ends_as_in_keras(kind, steps_per_epoch):
    # 80 rows, batch 16: 5 batches a pass. Keras: steps_per_epoch=3 gives epochs of 3, 2, 3, 2 batches
    # (an epoch continues the pass but ends with it); 6 gives 5 an epoch. A short epoch warns.
    x, y, _, _ = flat_digits(80)
    data = (x, y) if kind == "arrays" else (_Rows(x, y, 16), None)
    kwargs = dict(batch_size=16 if kind == "arrays" else None, epochs=4, steps_per_epoch=steps_per_epoch,
                  shuffle=False, verbose=0)
    ref, want = _tanh_dense(), _Batches()
    with pytest.warns(UserWarning, match="ran out of data"):
        ref_hist = ref.fit(*data, callbacks=[want], **kwargs).history
    with strategy(4).scope():
        model = _tanh_dense()
    got = _Batches()
    with pytest.warns(UserWarning, match="ran out of data"):
        hist = model.fit(*data, callbacks=[got], **kwargs).history
    assert got.epochs == want.epochs
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    assert_weights_close(model, ref, 1e-5, 1e-6)
    # evaluate's steps beyond the data: one pass, as Keras (never a second count of the same rows)
    with pytest.warns(UserWarning, match="ran out of data"):
        want_eval = ref.evaluate(x, y, batch_size=16, steps=9, verbose=0)
    with pytest.warns(UserWarning, match="ran out of data"):
        got_eval = model.evaluate(x, y, batch_size=16, steps=9, verbose=0)
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-5)



@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
def test_keras_debugging_caps_on_epochs_and_steps_apply():
    x, y, _, _ = flat_digits(96)  # 6 batches of 16: two capped epochs of 3
    runs = []
    for scoped in (False, True):
        with strategy(2).scope() if scoped else contextlib.nullcontext():
            model = _tanh_dense()
        seen = _Batches()
        try:
            keras.config.set_max_epochs(2)
            keras.config.set_max_steps_per_epoch(3)
            with pytest.warns(UserWarning, match="Limiting"):
                hist = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[seen]).history
            with pytest.warns(UserWarning, match="Limiting steps_per_epoch to 3"):
                ev = model.evaluate(x, y, batch_size=16, verbose=0)
        finally:
            keras.config.set_max_epochs(None)
            keras.config.set_max_steps_per_epoch(None)
        runs.append((seen.epochs, hist["loss"], ev, model.get_weights()))
    (want_batches, want_loss, want_ev, want_w), (got_batches, got_loss, got_ev, got_w) = runs
    assert got_batches == want_batches == [[0, 1, 2], [0, 1, 2]]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_ev, want_ev, rtol=1e-5)
    for a, b in zip(got_w, want_w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Ends(_Batches):
    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1].append(("end", batch))


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
@pytest.mark.parametrize("steps_per_execution", [3, 101])
def test_batch_hooks_once_per_execution_a_short_last_one_too(steps_per_execution):
    # 100 rows, batch 16: 7 batches an epoch. 3: executions of 3, 3 and 1; 101: one execution of 7.
    x, y, _, _ = flat_digits(100)
    runs = []
    for scoped in (False, True):
        with strategy(4).scope() if scoped else contextlib.nullcontext():
            model = _tanh_dense(steps_per_execution=steps_per_execution)
        seen = _Ends()
        hist = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[seen]).history
        runs.append((seen.epochs, hist["loss"], model.get_weights()))
    (want, want_loss, want_w), (got, got_loss, got_w) = runs
    assert got == want
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(got_w, want_w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
def test_metric_function_of_one_number_per_batch_counts_once_per_batch():
    def batch_constant(y_true, y_pred):  # no value per example: padding and weights cannot apply
        return 0.5

    def batch_mean(y_true, y_pred):
        return keras.ops.mean(y_pred)

    # (Full batches: a padded one would show its padding rows to batch_mean, which no mask can reach.)
    x, y, _, _ = flat_digits(32)
    runs = []
    for scoped in (False, True):
        with strategy(4).scope() if scoped else contextlib.nullcontext():
            model = _tanh_dense(metrics=[batch_constant, batch_mean, "accuracy"])
        hist = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
        runs.append((hist, model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)))
    (want_hist, want_eval), (got_hist, got_eval) = runs
    assert sorted(got_eval) == sorted(want_eval)
    for k in want_eval:
        np.testing.assert_allclose(got_eval[k], want_eval[k], rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(got_hist[k], want_hist[k], rtol=1e-5, err_msg=k)


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
def test_predict_moves_a_layers_random_stream_on_as_keras():
    class TestTimeDropout(keras.layers.Layer):  # random in inference too: its seed state must advance
        def __init__(self):
            super().__init__()
            self.seed = keras.random.SeedGenerator(7)

        def call(self, x):
            return keras.random.dropout(x, rate=0.5, seed=self.seed)

    x = np.ones((30, 8), np.float32)
    outs = []
    for scoped in (False, True):
        with strategy(4).scope() if scoped else contextlib.nullcontext():
            inputs = keras.Input((8,))
            model = keras.Model(inputs, TestTimeDropout()(inputs))
        first = model.predict(x, batch_size=16, verbose=0)
        outs.append((first, model.predict(x, batch_size=16, verbose=0)))
    (want_1, want_2), (got_1, got_2) = outs
    assert np.mean(np.abs(got_1 - got_2)) > 0.01  # the second call draws new masks
    # (the masks themselves depend on the batch's shape: a padded global batch draws other ones)
    assert want_1.shape == got_1.shape and np.mean(np.abs(want_1 - want_2)) > 0.01


class _KeepsCounting(keras.metrics.MeanSquaredError):
    """A metric whose reset_state does nothing: its mean runs on across epochs."""

    def __init__(self):
        super().__init__(name="mse_all_epochs")

    def reset_state(self):
        pass


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.values: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(float(logs["mse_all_epochs"]))


@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
def test_a_metrics_own_reset_state_is_kept_across_epochs_as_keras():
    x, y, _, _ = flat_digits(48)
    y = np.eye(10, dtype=np.float32)[y]
    runs = []
    for scoped in (False, True):
        with strategy(4).scope() if scoped else contextlib.nullcontext():
            model = _tanh_dense(loss="mse", metrics=[_KeepsCounting(), "mae"])
        logs = _BatchLogs()
        hist = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[logs]).history
        runs.append((logs.values, hist))
    (want_batches, want), (got_batches, got) = runs
    np.testing.assert_allclose(got_batches, want_batches, rtol=1e-5)
    for k in want:  # mae resets each epoch; mse_all_epochs does not
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)



@pytest.mark.slow  # Keras's conformance: the same training scoped and plain
def test_steps_per_epoch_rounds_up_to_whole_executions_as_keras():
    # 6 batches a pass; steps_per_execution=2, steps_per_epoch=3: Keras runs 2 executions (4 batches),
    # then the 2 left in the pass (a short epoch: "ran out of data").
    x, y, _, _ = flat_digits(96)
    runs = []
    for scoped in (False, True):
        with strategy(2).scope() if scoped else contextlib.nullcontext():
            model = _tanh_dense(steps_per_execution=2)
        seen = _Ends()
        with pytest.warns(UserWarning, match="ran out of data"):
            hist = model.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=3, shuffle=False, verbose=0,
                             callbacks=[seen]).history
        runs.append((seen.epochs, hist["loss"], model.get_weights()))
    (want, want_loss, want_w), (got, got_loss, got_w) = runs
    assert got == want
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(got_w, want_w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Overriding(keras.Sequential):
    """A user's model whose fit / evaluate / predict do something of their own, then call Keras's."""

    calls: list[str]

    def fit(self, *args, **kwargs):
        self.calls.append("fit")
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        self.calls.append("evaluate")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self.calls.append("predict")
        return super().predict(*args, **kwargs)


def test_a_class_that_overrides_fit_runs_its_override_and_trains_on_mirrorax():
    from keras.src.backend.jax.trainer import JAXTrainer

    keras_fit = JAXTrainer.fit
    x, y, _, _ = flat_digits(64)

    def build():
        keras.utils.set_random_seed(5)
        m = _Overriding([keras.Input((64,)), keras.layers.Dense(8, activation="tanh"),
                         keras.layers.Dense(10, activation="softmax")])
        m.calls = []
        m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return m

    ref = build()
    s = strategy(8)
    with s.scope():
        model = build()
        got = [model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]]  # inside the scope
    got.append(model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"])  # and after it
    want = [ref.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"] for _ in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_weights_close(model, ref, WEIGHT_RTOL, WEIGHT_ATOL)
    probs = np.asarray(ref(x))  # the reference's outputs, eagerly (no more programs to compile)
    loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(y, probs)))
    assert model.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=16, verbose=0), probs, rtol=1e-5, atol=1e-6)
    assert model.calls == ["fit", "fit", "evaluate", "predict"] and ref.calls == ["fit", "fit"]  # the overrides ran
    # Their super() calls ran on mirrorax: its programs, its layout on the 8 devices.
    assert mx.keras.fit.trainer_of(model).compile_counts() == {"train": 1, "train_many": 0, "evaluate": 1,
                                                               "predict": 1}
    assert model.trainable_variables[0].value.sharding.device_set == set(s.devices)
    assert JAXTrainer.fit is keras_fit  # Keras's fit is its own again once the override returned
    assert keras.Model.fit is keras_fit


@pytest.mark.slow  # a tiny Gemma's fit compiles for ~6 s on 2 loaded cores
def test_keras_hub_task_fit_preprocesses_and_trains_on_mirrorax():
    """keras_hub's tasks inherit PipelineModel's fit / evaluate, which build a dataset (and would map the
    preprocessor over it) and call Keras's: that call trains on the strategy's devices."""
    keras_hub = pytest.importorskip("keras_hub")

    x_rng = np.random.default_rng(0)
    tokens = x_rng.integers(1, 32, size=(16, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), bool)}
    s = strategy(8)
    with s.scope():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(vocabulary_size=32, num_layers=1, num_query_heads=2,
                                                  num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                                                  head_dim=8)
        lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = lm.fit(x, tokens[:, 1:], batch_size=8, epochs=2, shuffle=False, verbose=0)
    loss = history.history["loss"]
    assert len(loss) == 2 and loss[1] < loss[0]
    assert np.isfinite(lm.evaluate(x, tokens[:, 1:], batch_size=8, verbose=0)).all()
    counts = mx.keras.fit.trainer_of(lm).compile_counts()
    assert counts["train"] == 1 and counts["evaluate"] == 1  # mirrorax's programs, not Keras's
    assert all(v.value.sharding.device_set == set(s.devices) for v in lm.trainable_variables)


def test_tf_tensors_give_keras_numbers_in_fit_evaluate_and_predict():
    """tf.Tensor inputs are arrays, as Keras's data adapters read them: fit(tf_x, tf_y) in Keras's shuffle
    order, evaluate and predict; and keras.io's one-row inference ("Structured data classification from
    scratch"): predict on a dict of ``tf.convert_to_tensor([value])``."""
    tf = pytest.importorskip("tensorflow")
    x, y, xt, yt = flat_digits(100)
    tx, ty, txt, tyt = (tf.constant(a) for a in (x, y, xt, yt))
    ref = _tanh_dense()
    ref_hist = ref.fit(tx, ty, batch_size=32, epochs=2, verbose=0).history  # shuffle=True
    with strategy(4).scope():
        model = _tanh_dense()
    hist = model.fit(tx, ty, batch_size=32, epochs=2, verbose=0).history
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    assert_weights_close(model, ref, 1e-5, 1e-6)
    np.testing.assert_allclose(model.evaluate(txt, tyt, verbose=0), ref.evaluate(txt, tyt, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(txt, verbose=0), ref.predict(txt, verbose=0), rtol=1e-5, atol=1e-6)

    def functional():
        keras.utils.set_random_seed(2)
        inputs = {"age": keras.Input((1,), name="age"), "thal": keras.Input((3,), name="thal", dtype="int32")}
        h = keras.layers.concatenate([inputs["age"], keras.ops.cast(inputs["thal"], "float32")])
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(4)(h)))

    sample = {"age": tf.convert_to_tensor([60]), "thal": tf.convert_to_tensor([[0, 1, 0]])}  # (1,) and (1, 3)
    with strategy(4).scope():
        scoped = functional()
    want = functional().predict(sample, verbose=0)
    got = scoped.predict(sample, verbose=0)
    assert got.shape == (1, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.slow  # a process of its own (tests/jobs/cached_pipeline.py), pinned to one core
def test_cached_pipeline_evaluate_and_predict_read_every_row_as_keras_pinned_to_one_core():
    """A ``.cache()``d tf.data pipeline after a seeded reshuffle: evaluate and predict under the scope read it
    in one pass, as Keras's own calls do (the look at the first batch is that pass's), so they use every row,
    in Keras's order, and the cache is whole afterwards: 20 of 20 trials on one core. Reading a batch from an
    iterator of its own and dropping it (as mirrorax did) started the source twice and reshuffled, and on one
    core could leave the cache completed with the rows read so far (evaluate averaging 32 of 150 rows)."""
    import json
    import os
    import subprocess

    from jobs.procs import clean_env, python

    script = os.path.join(os.path.dirname(__file__), "jobs", "cached_pipeline.py")
    proc = subprocess.run(python(script, "20"), capture_output=True, text=True, timeout=280,
                          env=clean_env(JAX_NUM_CPU_DEVICES="4"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trials = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(trials) == 20
    for trial in trials:
        plain, scoped = trial["plain"], trial["scoped"]
        assert (scoped["generator_runs"], scoped["rows_after"], len(scoped["predict"])) == (1, 400, 400)
        assert (plain["generator_runs"], plain["rows_after"]) == (1, 400)
        np.testing.assert_allclose(scoped["evaluate"], plain["evaluate"], rtol=1e-5)
        np.testing.assert_allclose(scoped["predict"], plain["predict"], rtol=1e-5, atol=1e-6)


class _Counted:
    """An array-like that counts its conversions: what a lazily loaded or memory-mapped array pays for each."""

    def __init__(self, a):
        self.a, self.reads = a, 0

    def __array__(self, dtype=None, copy=None):
        self.reads += 1
        return self.a if dtype is None else self.a.astype(dtype)


def test_x_is_read_once_by_fit_evaluate_and_predict_under_a_scope():
    """Keras's fit, evaluate and predict under a scope classify x once and make it a source once; the row count
    and the batches Keras's callbacks are told come from that source, not from another look at x."""
    x, y, _, _ = flat_digits(90)
    with strategy(2).scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    for given in ({}, {"steps_per_epoch": 2}):
        counted = _Counted(x)
        history = model.fit(counted, y, batch_size=None, epochs=2, verbose=0, **given)
        assert counted.reads == 1, given
        assert len(history.history["loss"]) == 2
    counted = _Counted(x)
    logs = model.evaluate(counted, y, batch_size=32, verbose=0, return_dict=True)
    assert counted.reads == 1
    assert logs == pytest.approx(model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True), rel=1e-6)
    counted = _Counted(x)
    out = model.predict(counted, verbose=0)
    assert counted.reads == 1 and out.shape == (90, 10)
    np.testing.assert_allclose(out, model.predict(x, verbose=0), rtol=1e-6)


def _gan():
    keras.utils.set_random_seed(0)
    disc = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1, activation="sigmoid")])
    disc.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"])
    gen = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8)])
    disc.trainable = False
    z = keras.Input((4,))
    gan = keras.Model(z, disc(gen(z)))
    gan.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    return disc, gen, gan


def _train_gan(disc, gen, gan, steps=5, batch=10):
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        real = rng.normal(1.0, 0.5, (batch, 8)).astype(np.float32)
        fake = gen.predict(rng.normal(size=(batch, 4)).astype(np.float32), verbose=0)
        labels = np.concatenate([np.ones((batch, 1)), np.zeros((batch, 1))]).astype(np.float32)
        d_loss, _ = disc.train_on_batch(np.concatenate([real, fake]), labels)
        g_loss = gan.train_on_batch(rng.normal(size=(batch, 4)).astype(np.float32), np.ones((batch, 1), np.float32))
        losses.append((d_loss, g_loss))
    return np.array(losses)


def test_a_gan_of_models_sharing_layers_trains_with_train_on_batch_as_keras():
    """The classic Keras GAN: a discriminator, a generator, and a combined model holding both, trained in turns
    with train_on_batch and the generator's predict. Each model has its own trainer over the same variables:
    what one trainer donates, another held (the generator's predict state, taken from its variables, was run on
    deleted buffers and the process crashed); each adopts the others' new values."""
    ref_models = _gan()
    want = _train_gan(*ref_models)
    with strategy(3).scope():  # 20 and 10 rows over 3 devices: padded and masked
        models = _gan()
    got = _train_gan(*models)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for model, ref in zip(models, ref_models):
        assert_weights_close(model, ref, 1e-5, 1e-6)
