"""What ``model.compile`` says is what mirrorax trains with; trained values go back into the model."""

import keras
import numpy as np
import optax
import pytest
from helpers import Compiles, assert_weights_close, dense, flat_digits, strategy

import mirrorax as mx

pytestmark = pytest.mark.multi_device


@pytest.mark.parametrize("loss", ["string", pytest.param("object", marks=pytest.mark.slow),
                                  pytest.param("callable", marks=pytest.mark.slow)])
def test_loss_kinds_match_keras(loss):
    x, y, _, _ = flat_digits(100)
    kinds = {
        "string": lambda: "sparse_categorical_crossentropy",
        "object": lambda: keras.losses.SparseCategoricalCrossentropy(),
        "callable": lambda: (lambda yt, yp: keras.losses.sparse_categorical_crossentropy(yt, yp) * 2.0),
    }
    ref = dense(loss=kinds[loss](), metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")])
    ref_hist = ref.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0).history
    model = dense(loss=kinds[loss](), metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")])
    hist = mx.Trainer(model, strategy(4)).fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0).history
    assert_weights_close(model, ref, 1e-5, 1e-5)
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    assert hist["acc"] == pytest.approx(ref_hist["acc"], abs=1e-7)


@pytest.mark.slow  # two fits to compare: Keras's and the Trainer's
def test_optax_optimizer_equals_keras_sgd():
    x, y, _, _ = flat_digits(100)
    ref = dense(optimizer=keras.optimizers.SGD(0.1))
    ref.fit(x, y, batch_size=25, epochs=2, shuffle=False, verbose=0)
    model = dense()
    mx.Trainer(model, strategy(8), optimizer=optax.sgd(0.1)).fit(x, y, batch_size=25, epochs=2, shuffle=False,
                                                                 verbose=0)
    assert_weights_close(model, ref, 1e-5, 1e-6)


def test_uncompiled_model_with_loss_given():
    x, y, _, _ = flat_digits(64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    trainer = mx.Trainer(model, strategy(2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    hist = trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert set(hist.history) == {"loss", "accuracy"}
    assert hist.history["loss"][1] < hist.history["loss"][0]


@pytest.mark.slow
def test_trained_weights_written_back_and_model_saves(tmp_path):
    x, y, xt, _ = flat_digits(100)
    model = dense()
    before = [w.copy() for w in model.get_weights()]
    trainer = mx.Trainer(model, strategy(8))
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert any(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))
    np.testing.assert_allclose(model.predict(xt, verbose=0), trainer.predict(xt, batch_size=64), rtol=1e-5, atol=1e-6)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(xt, verbose=0), model.predict(xt, verbose=0), rtol=1e-6)
    # a second fit continues from the trained state (optimizer state included), as Keras's does
    ref = dense()
    ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    again = dense()
    t2 = mx.Trainer(again, strategy(4))
    t2.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    t2.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(again, ref, 1e-5, 1e-5)


@pytest.mark.slow  # Keras and mirrorax training side by side
def test_sequence_model_per_timestep_loss_matches_keras():
    """Targets of shape (batch, time): the padding weights must broadcast over time steps."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (45, 6)).astype(np.int32)
    y = np.roll(x, -1, axis=1)

    def build():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 8),
                              keras.layers.Dense(20)])
        m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
        return m

    ref = build()
    ref_hist = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = build()
    hist = mx.Trainer(model, strategy(3)).fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert_weights_close(model, ref, 1e-5, 1e-6)
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    assert hist["accuracy"] == pytest.approx(ref_hist["accuracy"], abs=1e-7)


def _two_epochs(callbacks=()) -> keras.Model:
    x, y, _, _ = flat_digits(64)
    model = dense()
    mx.Trainer(model, strategy(2)).fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                                       callbacks=list(callbacks))
    return model


@pytest.mark.slow
def test_batch_callbacks_read_the_newest_weights_through_callback_model():
    """Mid-epoch, Keras callbacks see the weights after the step just taken (as with Keras's own fit)."""
    seen = []

    class Reader(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append([w.copy() for w in self.model.get_weights()])

    model, ref = _two_epochs([Reader()]), _two_epochs()
    assert len(seen) == 8
    assert not np.allclose(seen[0][0], seen[1][0])  # each batch's values, not a stale copy
    for a, b, c in zip(seen[-1], model.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(a, b)  # the last batch's read is the final state
        np.testing.assert_array_equal(b, c)  # reading changed nothing


@pytest.mark.slow  # Keras and mirrorax training side by side
def test_keras_evaluate_in_a_callback_does_not_disturb_training():
    """Keras's own evaluate donates the variables' arrays; the trainer continues from the same values."""
    x, y, _, _ = flat_digits(64)
    results = []

    class Evaluate(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                results.append(self.model.evaluate(x, y, batch_size=16, verbose=0))

        def on_epoch_end(self, epoch, logs=None):
            results.append(self.model.evaluate(x, y, batch_size=16, verbose=0))

    model, ref = _two_epochs([Evaluate()]), _two_epochs()
    assert len(results) == 4
    assert_weights_close(model, ref, 0, 0)


@pytest.mark.slow  # Keras and mirrorax training side by side
def test_weights_set_on_the_model_are_what_the_trainer_continues_from():
    """set_weights in a callback or between fits, or Keras's own fit: the model is the truth, as in Keras."""
    x, y, xt, yt = flat_digits(64)
    zeros = [np.zeros_like(w) for w in dense().get_weights()]
    start = [np.full_like(w, 0.01) for w in zeros]

    class Zero(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                self.model.set_weights(zeros)

    def run(fit):
        model = dense()
        fit(model, epochs=2, callbacks=[Zero()])
        zeroed_then_trained = [w.copy() for w in model.get_weights()]
        model.set_weights(start)
        fit(model, epochs=1)
        return model, zeroed_then_trained

    ref, ref_mid = run(lambda m, **kw: m.fit(x, y, batch_size=16, shuffle=False, verbose=0, **kw))
    trainers = {}

    def ours(m, **kw):
        trainers.setdefault(id(m), mx.Trainer(m, strategy(4))).fit(x, y, batch_size=16, shuffle=False, verbose=0, **kw)

    model, mid = run(ours)
    for a, b in zip(mid, ref_mid):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert_weights_close(model, ref, 1e-5, 1e-6)
    trainer = trainers[id(model)]
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # Keras's own fit donates the arrays the trainer lent
    np.testing.assert_allclose(list(trainer.evaluate(xt, yt, batch_size=32).values()),
                               model.evaluate(xt, yt, batch_size=32, verbose=0), rtol=1e-6)


@pytest.mark.parametrize("save_freq", ["epoch", pytest.param(4, marks=pytest.mark.slow)])
def test_keras_model_checkpoint_saves_the_trained_weights(tmp_path, save_freq):
    x, y, _, _ = flat_digits(64)  # 4 batches an epoch: the last save is of the final weights
    model = dense()
    path = str(tmp_path / "w.weights.h5")
    save = keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=save_freq)
    mx.Trainer(model, strategy(2)).fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[save])
    loaded = dense(seed=7)
    loaded.optimizer.build(loaded.trainable_variables)  # the file holds Adam's state too
    loaded.load_weights(path)
    assert_weights_close(loaded, model, 0, 0)


@pytest.mark.slow  # Keras and mirrorax training side by side
def test_trainer_evaluate_inside_a_batch_callback_sees_the_current_weights():
    x, y, _, _ = flat_digits(64)
    model = dense()
    trainer = mx.Trainer(model, strategy(2))
    seen = []

    class Validate(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(trainer.evaluate(x, y, batch_size=32))

    trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[Validate()])
    assert len(seen) == 8 and seen[0] != seen[1]
    assert seen[-1] == trainer.evaluate(x, y, batch_size=32)  # the last batch's view is the final state
    assert_weights_close(model, _two_epochs(), 0, 0)  # evaluating changed nothing


def test_models_with_the_same_metrics_share_their_results_program():
    """A new model's first fit compiled, besides its step, a program for its metric results (~30 ms on a
    CPU, more on a TPU), which Keras's own fit does not build: a second model of a kind compiles its step
    alone, and its logs are its own."""
    x, y, _, _ = flat_digits(96)
    s = strategy(2)
    with s.scope():
        first = dense(seed=1, inputs=64)
    first.fit(x, y, batch_size=32, epochs=1, verbose=0)
    with s.scope():
        second = dense(seed=2, inputs=64)
    with Compiles() as counted:
        history = second.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert counted.count == 1, counted.names  # the train step
    logs = second.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    p = second.predict(x, batch_size=32, verbose=0)
    assert logs["accuracy"] == pytest.approx(np.mean(p.argmax(-1) == y), abs=1e-6)
    assert logs["loss"] == pytest.approx(-np.mean(np.log(p[np.arange(len(y)), y])), rel=1e-5)
    assert history.history["loss"][0] != first.history.history["loss"][0]
