"""The model adapters (``mirrorax.models``): one contract for a Keras model and a functional (JAX/optax) one.

``adapt(model)`` turns either into pure functions over a :class:`mirrorax.TrainState`; the engine needs
nothing else from a model. Each test below runs the same contract on both kinds (a 4 -> 3 logits layer,
SGD, sparse cross-entropy, accuracy): the state's groups and shapes, train steps that lower the loss with
the metric sums that follow them, evaluate and predict, the write-back into the user's model, and the
errors for a model or targets mirrorax cannot train.
"""

import jax
import keras
import numpy as np
import optax
import pytest
from helpers import strategy

import mirrorax as mx
from mirrorax.inputs.arrays import ArraySource
from mirrorax.models.adapters import adapt

KINDS = ["keras", "functional"]
ROWS, FEATURES, CLASSES = 16, 4, 3


def _model(kind: str):
    if kind == "keras":
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
        m.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return m
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(0, 0.3, (FEATURES, CLASSES)).astype(np.float32), "b": np.zeros(CLASSES, np.float32)}
    return mx.FunctionalModel(lambda p, x: x @ p["w"] + p["b"], params,
                              loss="sparse_categorical_crossentropy_from_logits", optimizer=optax.sgd(0.5),
                              metrics=["accuracy"])


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)


class Run:
    """A model, its adapter built on one global batch, the initial state, and the state after 4 steps."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.model = _model(kind)
        self.adapter = adapt(self.model)
        x, y = _data()
        self.batch = ArraySource(x, y).sample(ROWS, strategy(1).batch_mesh).tree()
        self.adapter.build(self.batch)
        self.initial = mx.TrainState.create(**self.adapter.initial_state())
        adapter = self.adapter

        @jax.jit
        def step(state, batch):
            grads, loss, model_state, metrics = adapter.grads(state, batch)
            params, opt = adapter.apply_gradients(state, grads)
            return state.replace(params=params, optimizer=opt, model_state=model_state, metrics=metrics), loss

        state, self.losses = self.initial, []
        for _ in range(4):
            state, loss = step(state, self.batch)
            self.losses.append(float(loss))
        self.trained = state


@pytest.fixture(scope="module", params=KINDS)
def run(request):
    # One build and one compiled step per kind for the module: the tests read different parts of it.
    return Run(request.param)


def test_initial_state_has_the_groups_and_the_model_shapes(run):
    assert set(run.adapter.initial_state()) == {"params", "model_state", "optimizer", "metrics"}
    shapes = sorted(np.shape(a) for a in jax.tree.leaves(run.initial.params))
    assert shapes == [(CLASSES,), (FEATURES, CLASSES)]
    assert run.adapter.metric_results(jax.device_get(run.initial.metrics)).keys() >= {"loss", "accuracy"}
    assert int(run.initial.step) == 0 and int(run.initial.skipped) == 0


def test_train_steps_lower_the_loss_and_sum_the_metrics(run):
    assert all(b < a for a, b in zip(run.losses, run.losses[1:])), run.losses
    results = run.adapter.metric_results(jax.device_get(run.trained.metrics))
    # The accumulators hold the whole run of steps: the loss is the mean of the steps' (equal-sized) losses.
    np.testing.assert_allclose(results["loss"], np.mean(run.losses), rtol=1e-5)
    assert 0.0 <= results["accuracy"] <= 1.0


def test_evaluate_and_predict(run):
    out = jax.jit(run.adapter.predict)(run.trained, run.batch["x"])
    assert out.shape == (ROWS, CLASSES)
    metrics = jax.jit(run.adapter.evaluate)(run.trained, run.adapter.initial_metrics(), run.batch)
    results = run.adapter.metric_results(jax.device_get(metrics))
    assert results["loss"] < run.losses[0]  # inference after training scores better than the first step
    labels = np.asarray(run.batch["y"])
    np.testing.assert_allclose(results["accuracy"], np.mean(np.asarray(out).argmax(-1) == labels), rtol=1e-6)


def test_targets_of_the_wrong_shape_name_both_shapes(run):
    with pytest.raises(ValueError, match=r"y has shape \((16|n), 2\) but the model's output has shape \((16|n), 3\)"):
        run.adapter.sparse_targets(np.zeros((ROWS, 2), np.int32), check_shapes=True)


def test_write_back_hands_the_trained_values_to_the_model(run):
    trained = jax.device_put(run.trained, strategy(1).replicated)
    run.adapter.write_back(trained)
    held = run.model.trainable_weights if run.kind == "keras" else jax.tree.leaves(run.model.params)
    got = sorted((np.asarray(w) for w in held), key=np.shape)
    want = sorted((np.asarray(a) for a in jax.tree.leaves(trained.params)), key=np.shape)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_models_mirrorax_cannot_train_are_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"received <object object.*\(of type object\).*FunctionalModel"):
        adapt(object())
    uncompiled = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    with pytest.raises(ValueError, match=r"not compiled and no loss was given.*model\.compile"):
        adapt(uncompiled)
    with pytest.raises(TypeError, match=r"apply_fn must be callable; received 'relu' \(of type str\)"):
        mx.FunctionalModel("relu", {}, loss="mse", optimizer=optax.sgd(0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Unknown loss 'hinge'; known: \["):
        adapt(mx.FunctionalModel(lambda p, x: x, {}, loss="hinge", optimizer=optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"received mixed_precision='float16' with a FunctionalModel"):
        adapt(_model("functional"), mixed_precision="float16")
