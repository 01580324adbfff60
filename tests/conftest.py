"""Test set-up shared by every test module.

Simulated devices are configured here, once, before anything imports JAX's backend: every test sees
8 CPU devices, and a test that wants fewer builds its strategy from ``jax.devices()[:n]``.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling dominates the suite's time (each test compiles its own small steps), and much of a CPU
# compile is LLVM optimising the generated code. This flag skips LLVM's expensive passes; the HLO program
# and its float results stay as they are (checked: tests/jobs/float64_fit.py, Keras's float64 fit
# against the Trainer's, stays within 1.2e-16 with it). --xla_backend_optimization_level=0 was faster
# still but is not numerics-neutral: the same float64 comparison then differed by up to 1.2e-8.
_FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
# Many tests compile the same small programs (the same model, data and device count), and every job a
# test starts compiles what its neighbours already did (a reference run, the killed run, the resume).
# JAX's persistent compilation cache, one folder per pytest session, lets each program compile once:
# a hit loads the executable XLA built for the same program and options, so no number changes. Set in
# the environment, so that the processes tests start (jobs, the CLI, the launcher) share it too.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mirrorax-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Keras prints a progress bar per fit call otherwise; the tests check outputs, not bars.

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import gc  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_finish(session):
    """Moves everything alive once the test modules are imported (JAX, Keras, their modules: about 280,000
    objects) out of the garbage collector's reach: a full collection then walks only what the tests made
    since, about 0.3 s less per test. Nothing frozen is garbage: it is what the imports keep alive."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts with Keras's default names and seeds, so two tests never share layer names.

    One full garbage collection per test (after it), not two, so that no test sees the arrays of the one
    before (``jax.live_arrays()``); ``pytest_collection_finish`` keeps it cheap.
    """
    import keras

    keras.backend.clear_session(free_memory=False)
    yield
    keras.backend.clear_session()
