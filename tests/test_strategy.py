"""The edges of issue 17: what a Keras program hands the strategy is taken, or refused with the way on.

Devices as keras.io's distribution guide gives them (a numpy array, a ``jax.sharding.Mesh``, a Keras
``DeviceMesh``, Keras's device names); a global ``keras.distribution`` under the scope; Keras on another
backend, said at ``scope()``; no plan line in ``model.fit``'s output under the scope.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import jax
import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx
from mirrorax.keras.fit import trainer_of

pytestmark = pytest.mark.multi_device


@pytest.fixture
def no_distribution():
    """Restores Keras's global distribution (none) after a test that sets one."""
    yield
    keras.distribution.set_distribution(None)


# -- devices ------------------------------------------------------------------------------------

def test_devices_as_a_numpy_array_a_mesh_or_keras_names():
    four = jax.devices()[:4]
    for devices in (np.array(four), np.array(four).reshape(1, 4), jax.make_mesh((4,), ("d",), devices=four),
                    keras.distribution.DeviceMesh((4,), ["batch"], devices=[f"cpu:{d.id}" for d in four]),
                    [f"cpu:{d.id}" for d in four]):
        s = mx.MirroredStrategy(devices=devices)
        assert s.devices == tuple(four), devices


def test_a_mesh_with_several_long_axes_is_refused_with_the_reshape():
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=keras.distribution.list_devices())
    with pytest.raises(ValueError, match=r"devices is a mesh of shape \(2, 4\) with axes \('batch', 'model'\): "
                                         r"several axes of devices.*devices=mesh.devices.reshape\(-1\) \(all 8 "
                                         r"devices as data-parallel replicas\).*ModelParallel"):
        mx.MirroredStrategy(devices=mesh)
    with pytest.raises(ValueError, match=r"devices is a mesh of shape \(4, 2\): several axes"):
        mx.MirroredStrategy(devices=np.array(jax.devices()).reshape(4, 2))


def test_the_strategy_is_its_mesh_with_no_attribute_of_the_mesh_redefined():
    from mirrorax.mesh import BatchMesh

    s = strategy(4)
    assert isinstance(s, BatchMesh) and s.batch_mesh is s
    # The mesh's attributes are the strategy's own, not copies that forward to it (issue 49).
    mesh_attributes = {n for n in vars(BatchMesh) if not n.startswith("_")}
    assert mesh_attributes and not mesh_attributes & set(vars(mx.MirroredStrategy))
    assert s.num_replicas_in_sync == 4 and s.batch_sharding.spec == jax.sharding.PartitionSpec("batch")
    for name in ("mesh", "devices", "num_replicas_in_sync", "replicated", "state_sharding", "place"):
        assert inspect.getdoc(getattr(mx.MirroredStrategy, name)), name


def test_an_unknown_device_name_is_refused():
    with pytest.raises(ValueError, match=r"devices names 'cpu:99', which JAX does not have; available: \['cpu:0'"):
        mx.MirroredStrategy(devices=["cpu:99"])


# -- a global keras.distribution ----------------------------------------------------------------

def _model_parallel():
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_model_parallel_set_before_the_scope_is_refused_at_scope(no_distribution):
    keras.distribution.set_distribution(_model_parallel())
    with pytest.raises(ValueError, match=r"keras.distribution is set to ModelParallel .* at scope\(\) under "
                                         r"MirroredStrategy.scope\(\).*ignore its layout map.*"
                                         r"keras.distribution.set_distribution\(None\).*Keras's own fit without "
                                         r"the scope for model parallelism"):
        with strategy(2).scope():
            pass


def test_model_parallel_set_inside_the_scope_is_refused_at_model_creation(no_distribution):
    with strategy(2).scope():
        keras.distribution.set_distribution(_model_parallel())
        with pytest.raises(ValueError, match=r"set to ModelParallel .* at creating a model under "
                                             r"MirroredStrategy.scope\(\)"):
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def test_a_distribution_set_after_compile_is_refused_at_fit(no_distribution):
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    with _model_parallel().scope():
        with pytest.raises(ValueError, match=r"set to ModelParallel .* at fit, evaluate or predict under"):
            model.fit(np.zeros((8, 3)), np.zeros((8, 1)), verbose=0)


def test_data_parallel_asks_for_what_the_scope_does_and_is_honoured(no_distribution):
    # Replicated variables and split batches: the model trains under the scope, on its devices.
    with keras.distribution.DataParallel().scope(), strategy(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        model.fit(np.zeros((8, 3)), np.zeros((8, 1)), verbose=0)
    assert trainer_of(model).strategy.num_replicas_in_sync == 2


# -- Keras on another backend -------------------------------------------------------------------

_OTHER_BACKEND = textwrap.dedent("""
    import os
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras
    import mirrorax as mx
    strategy = mx.MirroredStrategy()  # a pure-JAX user's strategy needs no Keras
    try:
        with strategy.scope():
            pass
    except RuntimeError as e:
        print("REFUSED:", e)
""")


@pytest.mark.slow  # a subprocess that imports TensorFlow
def test_keras_on_another_backend_is_refused_at_scope():
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        env["KERAS_BACKEND"] = "numpy"
    script = _OTHER_BACKEND.replace('"tensorflow"', repr(env["KERAS_BACKEND"]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    backend = env["KERAS_BACKEND"]
    assert (f"REFUSED: MirroredStrategy.scope() trains Keras models on the JAX backend, but Keras runs on "
            f"'{backend}' here (KERAS_BACKEND='{backend}')") in out.stdout, out.stdout
    assert "Set KERAS_BACKEND=jax before importing keras" in out.stdout


# -- the plan line ------------------------------------------------------------------------------

@pytest.mark.slow  # a fit (tests/test_plan.py checks every verbose)
def test_model_fit_under_the_scope_prints_no_plan_at_verbose_1(capsys):
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    capsys.readouterr()
    model.fit(np.zeros((8, 3)), np.zeros((8, 1)), batch_size=8, verbose=1)
    out = capsys.readouterr().out
    assert "plan:" not in out and "1/1" in out, out  # Keras's bar, and nothing of mirrorax's
