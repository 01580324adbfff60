"""Bad inputs and set-ups fail early, before any compilation, with a message that says how to fix them."""

import os
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest
from helpers import dense, flat_digits, strategy

import mirrorax as mx


@pytest.fixture
def trainer():
    return mx.Trainer(dense(), strategy(2))


def _assert_nothing_compiled(t):
    assert t.compile_counts() == {"train": 0, "train_many": 0, "evaluate": 0, "predict": 0}


def test_x_and_y_lengths_differ(trainer):
    x, y, _, _ = flat_digits(50)
    with pytest.raises(ValueError, match=r"same number of examples.*x: 50.*y: 49"):
        trainer.fit(x, y[:49], batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="sample_weight: 10"):
        trainer.fit(x, y, sample_weight=np.ones(10), batch_size=8, verbose=0)
    _assert_nothing_compiled(trainer)


def test_empty_input(trainer):
    with pytest.raises(ValueError, match="empty"):
        trainer.fit(np.zeros((0, 64), np.float32), np.zeros((0,), np.int32), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="yielded no batch"):
        trainer.fit(iter([]), batch_size=8, verbose=0)
    _assert_nothing_compiled(trainer)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True])
def test_bad_batch_size(trainer, bad):
    x, y, _, _ = flat_digits(20)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        trainer.fit(x, y, batch_size=bad, verbose=0)
    _assert_nothing_compiled(trainer)


def test_non_numeric_arrays(trainer):
    x = np.array([["a"] * 64] * 4)
    with pytest.raises(TypeError, match=r"x must hold numbers; received an array of dtype <U1"):
        trainer.fit(x, np.zeros(4, np.int32), batch_size=2, verbose=0)
    with pytest.raises(TypeError, match="y must hold numbers"):
        trainer.fit(np.zeros((4, 64), np.float32), np.array([object()] * 4), batch_size=2, verbose=0)
    _assert_nothing_compiled(trainer)


def test_not_compiled_and_no_loss():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"not compiled and no loss was given.*model.compile"):
        mx.Trainer(model, strategy(1))


def test_devices_duplicates_and_empty():
    d = jax.devices()
    with pytest.raises(ValueError, match=r"more than once \(received ids \[0, 1, 0\]\)"):
        mx.MirroredStrategy(devices=[d[0], d[1], d[0]])
    with pytest.raises(ValueError, match="has no device"):
        mx.MirroredStrategy(devices=[])
    with pytest.raises(ValueError, match="which JAX does not have"):
        mx.MirroredStrategy(devices=[0, 99])
    assert mx.MirroredStrategy(devices=[0, 3]).num_replicas_in_sync == 2


def test_devices_mixed_platforms(monkeypatch):
    from mirrorax import mesh as mesh_mod

    class FakeDevice:
        def __init__(self, i, platform):
            self.id, self.platform = i, platform

    fakes = [FakeDevice(0, "cpu"), FakeDevice(1, "gpu")]
    monkeypatch.setattr(mesh_mod.jax, "devices", lambda *a: fakes)
    monkeypatch.setattr(mesh_mod.jax, "Device", FakeDevice)
    with pytest.raises(ValueError, match=r"mixes platforms \['cpu', 'gpu'\]"):
        mesh_mod.validate_devices(fakes)


@pytest.mark.slow  # starts a process
def test_wrong_keras_backend_names_the_fix():
    code = ("import os; os.environ['KERAS_BACKEND']='numpy'\n"
            "import keras, mirrorax as mx\n"
            "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
            "m.compile(loss='mse')\n"
            "try:\n    mx.Trainer(m)\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, KERAS_BACKEND="numpy", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "ERR" in out.stdout and "KERAS_BACKEND=jax" in out.stdout, out.stdout + out.stderr


def test_bad_trainer_options():
    with pytest.raises(ValueError, match="steps_per_execution must be an integer >= 1; received 0"):
        mx.Trainer(dense(), strategy(1), steps_per_execution=0)
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        mx.Trainer(dense(), strategy(1), on_nonfinite="explode")
    with pytest.raises(TypeError, match="Keras 3 model or a mirrorax.FunctionalModel"):
        mx.Trainer(object(), strategy(1))
