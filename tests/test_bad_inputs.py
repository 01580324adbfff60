"""Wrong inputs get a clear error (the argument, what was received, the fix) before any compilation where
the host can see them, and the same trainer and model train on correctly afterwards.

Labels outside the model's classes are found on the host for arrays and inside the step for iterables
(read when the host looks for non-finite steps): the step that holds one is not applied.
"""

import jax
import keras
import numpy as np
import pytest
from helpers import assert_weights_close, strategy

import mirrorax as mx
from mirrorax.inputs.arrays import ArraySource

pytestmark = pytest.mark.multi_device

CLASSES = 5


def model(loss="sparse_categorical_crossentropy", units=CLASSES, optimizer="sgd"):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(units, activation="softmax" if units > 1 else None)])
    m.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    return m


def data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, CLASSES, n).astype(np.int32)


class batches:  # noqa: N801 - reads as the function it stands for
    """A dataset of ``(x, y)`` batches, iterable once per epoch (a list of tuples would read as arrays)."""

    def __init__(self, x, y, bs=8):
        self.items = [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


def nothing_compiled(t):
    return t.compile_counts() == {"train": 0, "train_many": 0, "evaluate": 0, "predict": 0}


def trains_like_fresh(t, m, x, y):
    """The trainer that raised trains exactly as a fresh one from the same weights (plain SGD: no
    optimizer state but the weights)."""
    ref = model()
    ref.set_weights(m.get_weights())
    t.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    mx.Trainer(ref, strategy(2)).fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(m, ref, 1e-6, 1e-7)


# -- labels outside the classes ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [7, pytest.param(5, marks=pytest.mark.slow), pytest.param(-1, marks=pytest.mark.slow)])
def test_array_label_outside_classes_is_refused_before_compiling(bad):
    x, y = data()
    y_bad = y.copy()
    y_bad[13] = bad
    m = model()
    t = mx.Trainer(m, strategy(2))
    with pytest.raises(ValueError, match=rf"y holds the label {bad} at y\[13\] \(example 13\).*output has 5 "
                                         r"units.*labels 0\.\.4"):
        t.fit(x, y_bad, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=rf"label {bad} at y\[13\]"):
        t.evaluate(x, y_bad, batch_size=8)
    with pytest.raises(ValueError, match=rf"label {bad} at y\[13\]"):  # validation labels too, before training
        t.fit(x, y, validation_data=(x, y_bad), batch_size=8, verbose=0)
    assert nothing_compiled(t)
    trains_like_fresh(t, m, x, y)


def test_non_integer_float_labels_are_refused():
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(ValueError, match=r"non-integer label 2\.5 at y\[4\].*integer class indices 0\.\.4"):
        t.fit(x, np.where(np.arange(24) == 4, 2.5, y).astype(np.float32), batch_size=8, verbose=0)
    assert nothing_compiled(t)
    t.fit(x, y.astype(np.float32), batch_size=8, verbose=0)  # integer-valued floats are labels


def test_ignore_class_labels_are_allowed():
    x, y = data()
    y[::5] = -1
    m = model(loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))
    hist = mx.Trainer(m, strategy(2)).fit(x, y, batch_size=8, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()


def test_functional_model_labels_checked():
    import optax

    x, y = data()
    fm = mx.FunctionalModel(lambda p, xb: xb @ p["w"], {"w": np.zeros((4, CLASSES), np.float32)},
                            loss="sparse_categorical_crossentropy_from_logits", optimizer=optax.sgd(0.1))
    t = mx.Trainer(fm, strategy(2))
    with pytest.raises(ValueError, match=r"label 9 at y\[2\].*output has 5 units"):
        t.fit(x, np.where(np.arange(24) == 2, 9, y), batch_size=8, verbose=0)
    assert nothing_compiled(t)
    t.fit(x, y, batch_size=8, verbose=0)


def test_train_on_batch_refuses_a_label_outside_the_classes_and_trains_on():
    """train_on_batch is prepared as fit is: the batch's labels are checked on the host before its step. (Its own
    path used to leave the step's record of the bad label unread: that step and every later one froze silently,
    each returning a loss of 0.0 and changing nothing.)"""
    x, y = data(8)
    m = model()
    t = mx.Trainer(m, strategy(2))
    t.train_on_batch(x, y)
    before, step = m.get_weights(), int(t.host_state().step)
    y_bad = y.copy()
    y_bad[3] = 7
    with pytest.raises(ValueError, match=r"y holds the label 7 at y\[3\] \(example 3\).*output has 5 units"):
        t.train_on_batch(x, y_bad)
    assert int(t.host_state().step) == step
    for a, b in zip(m.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    logs = t.train_on_batch(x, y)  # trains on: as a fresh trainer from the same weights does
    ref = model()
    ref.set_weights(before)
    want = mx.Trainer(ref, strategy(2)).train_on_batch(x, y)
    assert logs["loss"] == pytest.approx(want["loss"], rel=1e-6) and logs["loss"] > 0.1
    assert_weights_close(m, ref, 1e-6, 1e-7)


@pytest.mark.parametrize("on_nonfinite", ["raise", pytest.param("skip", marks=pytest.mark.slow),
                                          pytest.param("ignore", marks=pytest.mark.slow)])
def test_iterable_label_outside_classes_stops_training_without_applying_that_step(on_nonfinite):
    x, y = data(48)
    y_bad = y.copy()
    y_bad[8 * 2 + 3] = 7  # the third batch, its row 3
    m = model(optimizer="adam")
    t = mx.Trainer(m, strategy(2), on_nonfinite=on_nonfinite)
    with pytest.raises(ValueError, match=r"y holds the label 7 in row 3 of the global batch of step 3 \(epoch 1, "
                                         r"batch 3 of the epoch\).*5 units.*not\s+applied"):
        t.fit(batches(x, y_bad), epochs=1, verbose=0)
    # Exactly the two good batches were applied (none after the bad one either), the counter says so.
    ref = model(optimizer="adam")
    ref_trainer = mx.Trainer(ref, strategy(2), on_nonfinite=on_nonfinite)
    ref_trainer.fit(batches(x[:16], y[:16]), epochs=1, verbose=0)
    assert_weights_close(m, ref, 1e-6, 1e-7)
    assert int(np.asarray(t.host_state()["step"])) == 2
    # The same trainer goes on as one that never saw the bad batch (Adam's moments and count included).
    t.fit(batches(x, y), epochs=2, verbose=0)
    ref_trainer.fit(batches(x, y), epochs=2, verbose=0)
    assert_weights_close(m, ref, 1e-6, 1e-7)


@pytest.mark.slow  # a speed property: the label search compiled out of the step
def test_array_labels_checked_on_the_host_leave_no_label_search_in_the_step():
    """In-memory labels are all checked before compiling, so the step does not search them; an iterable's
    labels are searched in the step. Either way (on_nonfinite="ignore" too) the update runs in one guard
    branch: its predicate is then the state's clean label record (the branch compiled 5-8 s faster on a
    TPU for a 219M-parameter LM than the same step without it, at the same speed), which waits for the
    loss behind an optimization barrier as the other modes' predicate (a test of the loss) does."""
    x, y = data(48)
    t = mx.Trainer(model(optimizer="adam"), strategy(2), on_nonfinite="ignore")

    def program(t: mx.Trainer) -> str:
        state = t.state
        spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        rows = {"x": jax.ShapeDtypeStruct((8, 4), np.float32), "y": jax.ShapeDtypeStruct((8,), np.int32),
                "sample_weight": jax.ShapeDtypeStruct((8,), np.float32),
                "mask": jax.ShapeDtypeStruct((8,), np.float32), "num_real": jax.ShapeDtypeStruct((), np.float32)}
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=t.strategy.batch_sharding if v.shape
                                         else t.strategy.replicated) for k, v in rows.items()}
        return str(t.steps.train.lower(spec, batch).as_text())

    def conditionals(text: str) -> int:
        return text.count("stablehlo.case") + text.count("stablehlo.if")

    t.fit(x, y, batch_size=8, verbose=0)
    arrays = program(t)
    t.fit(batches(x, y), epochs=1, verbose=0)
    iterable = program(t)
    assert conditionals(arrays) == 1 and conditionals(iterable) >= 1  # the guard (and the search's own)
    # The search: a comparison of every label with its target's classes, and the first bad row's record.
    assert arrays.count("stablehlo.compare") < iterable.count("stablehlo.compare")
    assert arrays.count("stablehlo.reduce") < iterable.count("stablehlo.reduce")
    assert "stablehlo.optimization_barrier" in arrays and "stablehlo.optimization_barrier" in iterable
    raising = mx.Trainer(model(optimizer="adam"), strategy(2))  # its predicate tests the loss: no barrier
    raising.fit(x, y, batch_size=8, verbose=0)
    assert "stablehlo.optimization_barrier" not in program(raising)


def test_iterable_label_outside_classes_in_evaluate():
    x, y = data()
    y_bad = y.copy()
    y_bad[9] = 11
    t = mx.Trainer(model(), strategy(2))
    t.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"label 11 in row 1 of batch 2 of the evaluated data.*5 units"):
        t.evaluate(batches(x, y_bad), batch_size=8)
    assert t.evaluate(batches(x, y), batch_size=8) == pytest.approx(t.evaluate(x, y, batch_size=8), rel=1e-6)


# -- validation_data, strategy, other arguments --------------------------------------------------------
@pytest.mark.parametrize("val, what", [
    pytest.param(lambda x, y: (x,), r"a tuple of 1 element\(s\)", marks=pytest.mark.slow),
    pytest.param(lambda x, y: (x, y, np.ones(len(x)), 1), r"a tuple of 4 element\(s\)", marks=pytest.mark.slow),
    (lambda x, y: x, r"received ndarray of inputs alone"),
])
def test_validation_data_of_the_wrong_arity(val, what):
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(ValueError, match=r"validation_data must be \(x_val, y_val\).*" + what):
        t.fit(x, y, validation_data=val(x, y), batch_size=8, verbose=0)
    assert nothing_compiled(t)
    t.fit(x, y, validation_data=(x, y), batch_size=8, verbose=0)


def test_strategy_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"strategy must be a mirrorax.MirroredStrategy; received 'gpu'"):
        mx.Trainer(model(), strategy="gpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(initial_epoch=-1), "initial_epoch must be an integer >= 0; received -1"),
    (dict(seed="a"), "seed must be an integer >= 0; received 'a'"),
    (dict(validation_batch_size=0), "batch_size must be a positive integer"),
    (dict(epochs=-1), "epochs must be an integer >= 0"),
])
def test_bad_fit_arguments(kwargs, match):
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(ValueError, match=match):
        t.fit(x, y, batch_size=8, verbose=0, **kwargs)
    assert nothing_compiled(t)


def test_targets_missing():
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(ValueError, match=r"fit needs targets.*received x alone"):
        t.fit(x, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"fit needs targets.*batches of x alone"):
        t.fit(iter([(x[:8],), (x[8:],)]), verbose=0)
    with pytest.raises(ValueError, match=r"evaluate needs targets"):
        t.evaluate(x, batch_size=8)
    assert nothing_compiled(t)


# -- values and dtypes ---------------------------------------------------------------------------------
def test_non_finite_values_are_refused_with_their_place():
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    xn = x.copy()
    xn[5, 2] = np.nan
    with pytest.raises(ValueError, match=r"x holds nan at x\[5, 2\] \(example 5\).*refuse NaN and inf"):
        t.fit(xn, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"x\['a'\] holds inf at x\['a'\]\[3, 0\]"):
        ArraySource({"a": np.where(np.arange(24)[:, None] == 3, np.inf, x)}, y)
    w = np.ones(24)
    w[7] = -np.inf
    with pytest.raises(ValueError, match=r"sample_weight holds -inf at sample_weight\[7\]"):
        t.fit(x, y, sample_weight=w, batch_size=8, verbose=0)
    reg = mx.Trainer(model(loss="mse", units=1), strategy(2))
    with pytest.raises(ValueError, match=r"y holds nan at y\[2\]"):
        reg.fit(x, np.where(np.arange(24) == 2, np.nan, 1.0), batch_size=8, verbose=0)
    assert nothing_compiled(t) and nothing_compiled(reg)
    assert t.predict(xn, batch_size=8).shape == (24, CLASSES)  # predict keeps NaN rows to themselves
    # Skipping non-finite steps is the user's choice to train on past such values: not refused.
    hist = mx.Trainer(model(), strategy(2), on_nonfinite="skip").fit(xn, y, batch_size=8, shuffle=False, verbose=0)
    assert hist.history["skipped_steps"] == [1.0]


@pytest.mark.parametrize("w, match", [
    (np.where(np.arange(24) == 6, -0.5, 1.0), r"negative weight -0.5 at example 6"),
    (np.ones((24, 3)), r"of shape \(n,\) or \(n, 1\); received shape \(24, 3\)"),
    (np.ones(23), r"sample_weight: 23"),
])
def test_bad_sample_weights(w, match):
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(ValueError, match=match):
        t.fit(x, y, sample_weight=w, batch_size=8, verbose=0)
    assert nothing_compiled(t)


def test_bad_dtypes():
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(TypeError, match=r"x must hold real numbers; received complex values"):
        t.fit(x.astype(np.complex64), y, batch_size=8, verbose=0)
    with pytest.raises(TypeError, match=r"y must hold numbers; received an array of dtype <U1"):
        t.fit(x, np.array(list("abcdefghijklmnopqrstuvwx")), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"x could not be made one array"):
        t.fit([[1.0, 2.0, 3.0, 4.0], [1.0]], [0, 1], batch_size=8, verbose=0)
    assert nothing_compiled(t)


def test_python_lists_of_numbers_are_arrays():
    x, y = data()
    a, b = model(), model()
    mx.Trainer(a, strategy(2)).fit(x.tolist(), y.tolist(), batch_size=8, shuffle=False, verbose=0)
    mx.Trainer(b, strategy(2)).fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert_weights_close(a, b, 1e-6, 1e-7)


# -- iterables that change between batches -------------------------------------------------------------
@pytest.mark.parametrize("change, match", [
    (lambda xb, yb: (xb[:, :3], yb), r"Batch 2 of the input has x of shape \(rows, 3\), the first batch "
                                     r"\(rows, 4\)"),
    # The same check of other kinds of change (each trains afterwards): the slow tier.
    pytest.param(lambda xb, yb: (xb, yb[:, None]), r"Batch 2 of the input has y of shape \(rows, 1\), the first "
                 r"batch \(rows,\)", marks=pytest.mark.slow),
    pytest.param(lambda xb, yb: (xb.astype(np.float16), yb), r"Batch 2 of the input has x of dtype float16, the "
                 r"first batch float32", marks=pytest.mark.slow),
    pytest.param(lambda xb, yb: ({"a": xb}, yb), r"Batch 2 of the input holds the arrays \[\"x\['a'\]\", 'y'\], "
                 r"the first batch \['x', 'y'\]", marks=pytest.mark.slow),
])
def test_iterable_that_changes_between_batches(change, match):
    x, y = data()
    items = batches(x, y)
    items.items[1] = change(*items.items[1])
    m = model()
    t = mx.Trainer(m, strategy(2))
    with pytest.raises(ValueError, match=match):
        t.fit(items, epochs=1, verbose=0)
    assert t.compile_counts()["train"] == 1  # no second program for the odd batch
    trains_like_fresh(t, m, x, y)


# -- targets that do not fit the outputs under the loss ------------------------------------------------
@pytest.mark.parametrize("loss, units, target, match", [
    ("categorical_crossentropy", CLASSES, lambda y: y,
     r"y has shape \(n,\) but the model's output has shape \(n, 5\): those look like integer class labels.*"
     r"sparse_categorical_crossentropy.*to_categorical\(y, 5\)"),
    ("sparse_categorical_crossentropy", CLASSES, lambda y: np.eye(CLASSES, dtype=np.float32)[y],
     r"y has shape \(n, 5\).*look like one-hot targets.*loss='categorical_crossentropy', or pass y.argmax"),
    ("categorical_crossentropy", CLASSES, lambda y: np.eye(6, dtype=np.float32)[y % 6],
     r"y has shape \(n, 6\) but the model's output has shape \(n, 5\)"),
    ("mse", CLASSES, lambda y: np.zeros((len(y), CLASSES, 2), np.float32),
     r"y has shape \(n, 5, 2\) but the model's output has shape \(n, 5\), and the loss mse cannot compare them"),
])
def test_targets_that_do_not_fit_the_output(loss, units, target, match):
    x, y = data()
    m = model(loss=loss, units=units)
    t = mx.Trainer(m, strategy(2))
    with pytest.raises(ValueError, match=match):
        t.fit(x, target(y), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=match):  # from an iterable too, at its first batch
        t.fit(batches(x, target(y)), verbose=0)
    assert nothing_compiled(t)
    good = np.eye(CLASSES, dtype=np.float32)[y] if loss != "sparse_categorical_crossentropy" else y
    hist = t.fit(x, good, batch_size=8, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()


def test_inputs_that_do_not_fit_the_model():
    x, y = data()
    m = model()
    t = mx.Trainer(m, strategy(2))
    match = r"x has shape \(n, 3\) but the model takes inputs of shape \(n, 4\).*keras.Input\(\(3,\)\)"
    with pytest.raises(ValueError, match=match):
        t.fit(x[:, :3], y, batch_size=8, verbose=0)
    assert nothing_compiled(t)
    t.fit(x, y, batch_size=8, verbose=0)
    for call in (lambda: t.fit(x[:, :3], y, batch_size=8, verbose=0), lambda: t.evaluate(x[:, :3], y, batch_size=8),
                 lambda: t.predict(x[:, :3], batch_size=8), lambda: t.fit(batches(x[:, :3], y), verbose=0)):
        with pytest.raises(ValueError, match=match):
            call()
    assert t.compile_counts() == {"train": 1, "train_many": 0, "evaluate": 0, "predict": 0}


def test_forgiving_forms_keras_also_takes():
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    stops = keras.callbacks.EarlyStopping(monitor="loss", patience=0)
    hist = t.fit(x, y, validation_data=[x, y], callbacks=stops, batch_size=8, epochs=1, verbose=0)
    assert "val_loss" in hist.history  # a list [x_val, y_val] and a single callback, as Keras takes them


def test_more_hurried_mistakes():
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(ValueError, match=r"sample_weight must be one array.*received a dict"):
        t.fit(x, y, sample_weight={"out": np.ones(24)}, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"y holds 4294967296, beyond int32"):
        t.fit(x, np.where(np.arange(24) == 3, 2 ** 32, y.astype(np.int64)), batch_size=8, verbose=0)
    binary = mx.Trainer(model(units=1), strategy(2))
    with pytest.raises(ValueError, match=r"label 1 .*output has 1 units.*binary_crossentropy"):
        binary.fit(x, y % 2, batch_size=8, verbose=0)
    assert nothing_compiled(t) and nothing_compiled(binary)


def test_dict_inputs_with_the_wrong_names():
    x, y = data()
    t = mx.Trainer(model(), strategy(2))
    with pytest.raises(ValueError, match=r"x is a dict with keys \['foo'\], but the model has one input.*"
                                         r"Pass the array itself"):
        t.fit({"foo": x}, y, batch_size=8, verbose=0)
    keras.utils.set_random_seed(0)
    ia, ib = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    two = keras.Model({"a": ia, "b": ib}, keras.layers.Dense(CLASSES, activation="softmax")(
        keras.layers.Concatenate()([ia, ib])))
    two.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    t2 = mx.Trainer(two, strategy(2))
    with pytest.raises(ValueError, match=r"keys \['a', 'c'\], but the model's inputs are \['a', 'b'\]"):
        t2.fit({"a": x, "c": x}, y, batch_size=8, verbose=0)
    assert nothing_compiled(t) and nothing_compiled(t2)
    t2.fit({"a": x, "b": x}, y, batch_size=8, verbose=0)


def test_nan_in_large_arrays_is_refused_with_nothing_changed():
    """Large arrays are scanned on a thread while fit builds the state; the scan is joined before a
    checkpoint, a callback or a step can change anything: the same refusal as a scan up front."""
    from mirrorax.inputs.checks import BACKGROUND_MIN_BYTES

    x = np.random.default_rng(0).normal(size=(1100, 1000)).astype(np.float32)
    assert x.nbytes >= BACKGROUND_MIN_BYTES
    x[1000, 999] = np.inf
    y = np.zeros(len(x), np.int32)
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((1000,)), keras.layers.Dense(CLASSES, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    before = [w.copy() for w in m.get_weights()]
    heard = []
    spy = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: heard.append("begin"))
    t = mx.Trainer(m, strategy(2))
    with pytest.raises(ValueError, match=r"x holds inf at x\[1000, 999\] \(example 1000\).*refuse NaN and inf"):
        t.fit(x, y, batch_size=100, callbacks=[spy], verbose=0)
    with pytest.raises(ValueError, match=r"x holds inf at x\[1000, 999\]"):  # a NaN is the first error, as before
        t.fit(x, np.full(len(x), 9, np.int32), batch_size=100, verbose=0)
    with pytest.raises(ValueError, match=r"x holds inf at x\[1000, 999\]"):  # in validation_data too
        t.fit(x[:8], y[:8], validation_data=(x, y), batch_size=100, verbose=0)
    assert heard == [] and nothing_compiled(t)
    assert int(m.optimizer.iterations.numpy()) == 0
    for a, b in zip(before, m.get_weights()):
        np.testing.assert_array_equal(a, b)
