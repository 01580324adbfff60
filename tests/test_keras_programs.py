"""Programs Keras accepts are accepted under the scope, as written, and give Keras's numbers.

Issue 17, items 1-3: a custom ``train_step`` that unpacks ``x, y = data`` (keras.io's JAX guide),
``fit(x)`` with the loss from ``add_loss`` (the endpoint-layer pattern), and targets whose rank Keras
aligns with the output's ((n,) binary labels against ``Dense(1, activation="sigmoid")``). Each runs in
plain Keras and under ``MirroredStrategy(devices[:n]).scope()`` for n = 1, 3, 4, same seed, and must
agree to rtol 1e-4. Rows divide into full batches on every device count (96 rows, batch 24) and
``shuffle=False``: padding a short last batch and Keras's shuffle order are other items of the issue.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from helpers import built, strategy

pytestmark = pytest.mark.multi_device

RTOL = 1e-4
ROWS, BATCH = 96, 24
DEVICES = [1, 3, 4]


def _fit(build, n: int | None, *data, method: str = "fit", **kwargs):
    """``build()``'s model trained by plain Keras (``n`` None) or under a scope of ``n`` devices: its
    History (or evaluate's dict) and weights."""
    keras.utils.set_random_seed(0)
    model = built(build, n)
    if method == "fit":
        logs = model.fit(*data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **kwargs).history
    else:
        model.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **kwargs)
        logs = model.evaluate(*data, batch_size=BATCH, verbose=0, return_dict=True)
    return logs, model.get_weights()


def _assert_same(reference, got) -> None:
    (logs_a, w_a), (logs_b, w_b) = reference, got
    assert set(logs_a) == set(logs_b), (logs_a, logs_b)
    for k in logs_a:
        np.testing.assert_allclose(logs_b[k], logs_a[k], rtol=RTOL, err_msg=k)
    for i, (a, b) in enumerate(zip(w_a, w_b)):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=1e-6, err_msg=f"weight {i}")


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


# -- 1. a custom train_step gets data as Keras packs it ---------------------------------------------

class UnpacksTwo(keras.Model):
    """keras.io's JAX guide's first train_step, written with ``x, y = data`` (as many examples are)."""

    seen: list = []  # len(data) at each trace, or "x" for inputs alone

    def _record(self, data):
        UnpacksTwo.seen.append(len(data) if isinstance(data, tuple) else "x")

    def train_step(self, state, data):
        self._record(data)
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data[:2]
        sample_weight = data[2] if len(data) == 3 else None

        def loss_fn(trainable, non_trainable, metrics_variables):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            loss, (_, non_trainable, metrics_variables) = self.stateless_compute_loss(
                trainable, non_trainable, metrics_variables, x=x, y=y, y_pred=y_pred,
                sample_weight=sample_weight, training=True)
            return loss, (y_pred, non_trainable, metrics_variables)

        (loss, (y_pred, non_trainable, metrics_variables)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, metrics_variables)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        new_metrics, logs = [], {}
        for metric in self.metrics:
            mv = metrics_variables[len(new_metrics):len(new_metrics) + len(metric.variables)]
            if metric.name == "loss":
                mv = metric.stateless_update_state(mv, loss)
            else:
                mv = metric.stateless_update_state(mv, y, y_pred, sample_weight=sample_weight)
            logs[metric.name] = metric.stateless_result(mv)
            new_metrics += mv
        return logs, (trainable, non_trainable, optimizer_variables, new_metrics)

    def test_step(self, state, data):
        self._record(data)
        return super().test_step(state, data)

    def predict_step(self, state, data):
        UnpacksTwo.seen.append("x" if hasattr(data, "shape") else type(data).__name__)
        return super().predict_step(state, data)


def _unpacks_two():
    x = keras.Input((5,))
    model = UnpacksTwo(x, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(x)))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


@pytest.mark.slow  # a Keras and a scoped fit per device count
@pytest.mark.parametrize("n", DEVICES)
def test_custom_train_step_unpacking_x_y_gives_keras_numbers(n):
    x, y = _data()
    _assert_same(_fit(_unpacks_two, None, x, y), _fit(_unpacks_two, n, x, y))


def test_a_custom_step_weighing_its_loss_tracker_itself_keeps_keras_weights():
    """keras.io's JAX guide updates the loss tracker with no sample_weight (each batch counts once) and
    Keras's own step with the batch's row count; a short last batch (100 rows, batch 24) tells them apart."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(100, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    _assert_same(_fit(_unpacks_two, None, x, y), _fit(_unpacks_two, 3, x, y))


@pytest.mark.slow  # several fits and traces
def test_custom_steps_get_data_packed_as_keras_packs_it():
    # (x, y) without weights, (x, y, sample_weight) with them or with class_weight: each traced anew
    # on one model; evaluate's test_step likewise; predict_step gets x itself, not (x,).
    x, y = _data()
    seen = {}
    for scope in (False, True):
        UnpacksTwo.seen = []
        keras.utils.set_random_seed(0)
        if scope:
            with strategy(4).scope():
                model = _unpacks_two()
        else:
            model = _unpacks_two()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, sample_weight=np.ones(ROWS))
        model.evaluate(x, y, batch_size=BATCH, verbose=0)
        model.predict(x, batch_size=BATCH, verbose=0)
        seen[scope] = UnpacksTwo.seen
    # (mirrorax traces the custom steps more often: once abstractly to find their logs.)
    assert seen[False] == [2, 3, 2, "x"], seen
    assert seen[True][-4:] == [2, 3, 2, "x"], seen  # one trace more for the weighted fit, as Keras


# -- 2. fit(x) with the loss from add_loss ------------------------------------------------------

class Endpoint(keras.layers.Layer):
    """The issue's endpoint layer (keras.io's endpoint_layer_pattern, the training guide's LogisticEndpoint)."""

    def call(self, t, logits):
        self.add_loss(keras.ops.mean(keras.ops.square(t - logits)))
        return logits


def _endpoint_model():
    x = keras.Input((3,), name="x")
    t = keras.Input((1,), name="t")
    model = keras.Model([x, t], Endpoint()(t, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(x))))
    model.compile(optimizer="adam")
    return model


def _endpoint_data():
    rng = np.random.default_rng(1)
    x = rng.random((ROWS, 3)).astype("float32")
    return {"x": x, "t": x.sum(1, keepdims=True)}


@pytest.mark.slow  # a Keras and a scoped fit per device count
@pytest.mark.parametrize("n", DEVICES)
def test_fit_without_targets_trains_on_add_loss_as_keras(n):
    data = _endpoint_data()
    _assert_same(_fit(_endpoint_model, None, data), _fit(_endpoint_model, n, data))


@pytest.mark.slow  # a Keras and a scoped fit
def test_evaluate_without_targets_gives_the_add_loss_as_keras():
    data = _endpoint_data()
    _assert_same(_fit(_endpoint_model, None, data, method="evaluate"),
                 _fit(_endpoint_model, 4, data, method="evaluate"))


class AutoEncoder(keras.Model):
    """A custom train_step on inputs alone (``x = data``), as the VAE and GAN examples write it."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(2, activation="tanh")
        self.decoder = keras.layers.Dense(4)
        self.tracker = keras.metrics.Mean(name="reconstruction")

    def call(self, x):
        return self.decoder(self.encoder(x))

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x = data

        def loss_fn(trainable):
            y, _ = self.stateless_call(trainable, non_trainable, x)
            return keras.ops.mean(keras.ops.square(y - x))

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        metrics_variables = self.tracker.stateless_update_state(metrics_variables, loss)
        return ({"reconstruction": self.tracker.stateless_result(metrics_variables)},
                (trainable, non_trainable, optimizer_variables, metrics_variables))


def _autoencoder():
    model = AutoEncoder()
    model.compile(optimizer="adam")
    model(np.zeros((1, 4), "float32"))
    return model


@pytest.mark.slow  # a Keras and a scoped fit
def test_custom_train_step_on_inputs_alone_gives_keras_numbers():
    x = np.random.default_rng(2).random((ROWS, 4)).astype("float32")
    _assert_same(_fit(_autoencoder, None, x), _fit(_autoencoder, 4, x))


def test_a_compiled_loss_without_targets_is_still_refused():
    # Keras itself fails here (deep in the loss, "None is not a valid value"): the refusal says why.
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"fit needs targets to compute the loss; received x alone"):
        model.fit(_data()[0], verbose=0)
    with pytest.raises(ValueError, match=r"evaluate needs targets"):
        model.evaluate(_data()[0], verbose=0)


# -- 3. targets, inputs and weights whose rank Keras aligns --------------------------------------

def _binary():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.slow  # a Keras and a scoped fit per device count
@pytest.mark.parametrize("n", DEVICES)
def test_rank_one_binary_targets_train_as_in_keras(n):
    x, _ = _data()
    y = (x[:, 0] > 0).astype("float32")  # (n,) against the (n, 1) sigmoid output: the IMDB examples
    _assert_same(_fit(_binary, None, x, y), _fit(_binary, n, x, y))


def _regression():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _classes():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.slow  # two Keras and two scoped fits
def test_other_rank_alignments_keras_accepts():
    x, y = _data()
    # x of shape (n,) into keras.Input((1,)) (Keras's functional models add the axis), (n,) targets
    # for mse on an (n, 1) output and (n, 1) sample weights.
    weights = np.linspace(0.5, 1.5, ROWS).reshape(-1, 1)
    _assert_same(_fit(_regression, None, x[:, 0], y[:, 0], sample_weight=weights),
                 _fit(_regression, 4, x[:, 0], y[:, 0], sample_weight=weights))
    # One-hot targets with a trailing axis of 1 more than the output: (n, 3, 1) against (n, 3).
    onehot = keras.utils.to_categorical((x[:, :2] > 0).sum(1), 3)[..., None]
    _assert_same(_fit(_classes, None, x, onehot), _fit(_classes, 4, x, onehot))


def test_targets_keras_refuses_are_refused_before_compiling():
    x, _ = _data()
    with strategy(2).scope():
        model = _binary()
    with pytest.raises(ValueError, match=r"y has shape \(n, 2\) but the model's output has shape \(n, 1\)"):
        model.fit(x, np.zeros((ROWS, 2), "float32"), verbose=0)


def _named_inputs():
    a, c = keras.Input((3,), name="a"), keras.Input((2,), name="c")
    model = keras.Model([a, c], keras.layers.Dense(1)(keras.layers.Concatenate()([a, c])))
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.slow  # a Keras and a scoped fit
def test_a_dict_of_inputs_with_more_keys_than_the_model_takes():
    # Keras takes a list-input model's inputs by name from a dict that holds more (a dataset's columns).
    rng = np.random.default_rng(3)
    x = {"a": rng.random((ROWS, 3)), "c": rng.random((ROWS, 2)), "label_text": rng.random((ROWS, 7))}
    y = x["a"].sum(1, keepdims=True)
    _assert_same(_fit(_named_inputs, None, x, y), _fit(_named_inputs, 4, x, y))
