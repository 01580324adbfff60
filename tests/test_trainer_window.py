"""The Trainer stands on the strategy's public API: ``MirroredStrategy(max_in_flight=k)`` bounds the steps of
``Trainer.fit`` / ``evaluate`` / ``predict`` and of a Keras model's own ``fit`` under the scope, and the
results do not depend on ``k``. Also: ``mirrorax.fit.planner`` is the planning module, ``mx.plan`` its function."""

import importlib
import types

import jax
import numpy as np
import pytest
from helpers import dense, flat_digits

import mirrorax as mx
from mirrorax.steps.dispatch import InFlight

pytestmark = pytest.mark.multi_device

# (max_in_flight, devices). Three steps queued with collectives can abort XLA's CPU rendezvous on a small
# host, so the deep window runs on one device (no collectives); the shallow one on two.
WINDOWS = [(1, 2), (3, 1)]


@pytest.fixture
def pushes(monkeypatch):
    """Every push into any dispatch window: ``(window, steps still pending after the push)``."""
    seen: list[tuple[InFlight, int]] = []
    push = InFlight.push

    def recording(self, aux, ready=None, on_done=None):
        push(self, aux, ready, on_done)
        seen.append((self, self.pending))

    monkeypatch.setattr(InFlight, "push", recording)
    return seen


def _trainer_run(strategy):
    x, y, xt, yt = flat_digits(96)
    model = dense()
    trainer = mx.Trainer(model, strategy)
    history = trainer.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, validation_data=(xt[:64], yt[:64]))
    logs = trainer.evaluate(xt[:80], yt[:80], batch_size=32)  # 3 batches, the last one short
    probs = trainer.predict(xt[:80], batch_size=32)
    return model.get_weights(), history.history, logs, probs


@pytest.mark.parametrize("k, devices", WINDOWS)
def test_max_in_flight_bounds_trainer_fit_evaluate_and_predict(k, devices, pushes):
    s = mx.MirroredStrategy(devices=jax.devices()[:devices], max_in_flight=k)
    weights, history, logs, probs = _trainer_run(s)
    ours = [pending for window, pending in pushes if window is s.in_flight]
    # 2 epochs x 3 train steps, 2 validations x 2 steps, then 3 evaluate and 3 predict steps: each one
    # pushed into the strategy's window, none into a window of the Trainer's own.
    assert len(ours) == 6 + 4 + 3 + 3 == len(pushes)
    assert max(ours) <= k - 1
    if k > 1:
        assert max(ours) == k - 1  # the window is used to its depth: the host does not wait early

    pushes.clear()
    ref_weights, ref_history, ref_logs, ref_probs = _trainer_run(mx.MirroredStrategy(devices=jax.devices()[:devices]))
    for a, b in zip(weights, ref_weights):
        np.testing.assert_array_equal(a, b)  # the same programs on the same batches: bitwise equal
    assert history == ref_history and logs == ref_logs
    np.testing.assert_array_equal(probs, ref_probs)


def _keras_run(strategy):
    x, y, _, _ = flat_digits(96)
    with strategy.scope():
        model = dense()
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history


@pytest.mark.parametrize("k, devices", WINDOWS)
def test_max_in_flight_bounds_keras_fit_under_the_scope(k, devices, pushes):
    s = mx.MirroredStrategy(devices=jax.devices()[:devices], max_in_flight=k)
    weights, history = _keras_run(s)
    ours = [pending for window, pending in pushes if window is s.in_flight]
    assert len(ours) == 6 and max(ours) <= k - 1
    ref_weights, ref_history = _keras_run(mx.MirroredStrategy(devices=jax.devices()[:devices]))
    for a, b in zip(weights, ref_weights):
        np.testing.assert_array_equal(a, b)
    assert history == ref_history


def test_the_trainer_has_no_window_of_its_own():
    with pytest.raises(TypeError, match="max_in_flight"):
        mx.Trainer(dense(), mx.MirroredStrategy(devices=jax.devices()[:1]), max_in_flight=3)  # type: ignore[call-arg]
    assert not hasattr(mx.Trainer(dense(), mx.MirroredStrategy(devices=jax.devices()[:1])), "max_in_flight")


def test_planner_is_the_module_and_plan_the_function():
    planner = importlib.import_module("mirrorax.fit.planner")
    assert isinstance(planner, types.ModuleType)
    assert mx.plan is planner.plan and mx.Plan is planner.Plan
    assert isinstance(mx.plan, types.FunctionType)  # the package attribute is the function, not a module
