"""Test set-up shared by every test module.

Simulated devices are configured here, once, before anything imports JAX's backend: every test sees
8 CPU devices, and a test that wants fewer builds its strategy from ``jax.devices()[:n]``.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling dominates the suite's time (each test compiles its own small steps), and much of a CPU
# compile is LLVM optimising the generated code. This flag skips LLVM's expensive passes; the HLO program
# and its float results stay as they are (checked: tests/scripts/float64_fit.py, Keras's float64 fit
# against the Trainer's, stays within 1.2e-16 with it). --xla_backend_optimization_level=0 was faster
# still but is not numerics-neutral: the same float64 comparison then differed by up to 1.2e-8.
_FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
# Keras prints a progress bar per fit call otherwise; the tests check outputs, not bars.

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts with Keras's default names and seeds, so two tests never share layer names.

    One full garbage collection per test (after it), not two: each took about 0.28 s late in a run.
    """
    import keras

    keras.backend.clear_session(free_memory=False)
    yield
    keras.backend.clear_session()
