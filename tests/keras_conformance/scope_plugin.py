"""A pytest plugin that runs Keras's own tests with every model built inside a strategy scope.

Keras's test files live in the installed wheel, outside this directory, so a ``conftest.py`` here would
not reach them: ``run.py`` loads this module with ``pytest -p scope_plugin`` instead. It gives the run
8 simulated CPU devices (as ``tests/conftest.py`` does) and, when ``MIRRORAX_CONFORMANCE_SCOPE=1``,
enters ``mx.MirroredStrategy(devices=jax.devices()[:4]).scope()`` around every test (autouse), so each
model a test creates or compiles trains on mirrorax's engine. With ``MIRRORAX_CONFORMANCE_SCOPE=0`` the
same devices and settings run Keras's own loop: the baseline.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

SCOPED = os.environ.get("MIRRORAX_CONFORMANCE_SCOPE", "1") == "1"


@pytest.fixture(autouse=True)
def _mirrored_scope():
    """Every test runs inside a 4-device ``MirroredStrategy`` scope (when ``SCOPED``)."""
    if not SCOPED:
        yield
        return
    import mirrorax as mx

    with mx.MirroredStrategy(devices=jax.devices()[:4]).scope():
        yield
