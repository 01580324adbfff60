"""Test set-up shared by every test module.

Simulated devices are configured here, once, before anything imports JAX's backend: every test sees
8 CPU devices, and a test that wants fewer builds its strategy from ``jax.devices()[:n]``.
"""

import atexit
import json
import os
import resource
import shutil
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's compile options (LLVM's expensive passes skipped, its optimisation off, XLA's older fusion
# emitters: jobs.procs), in the environment, so that every process a test starts compiles alike.
# MIRRORAX_TEST_USER_CODEGEN=1 compiles as a user's programs do.
from jobs.procs import suite_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ.get("XLA_FLAGS", ""))
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

# MIRRORAX_TEST_CPU_LOG=DIR: each test's CPU and wall in DIR/tests.jsonl (pytest_runtest_* below), each
# forked job's CPU in DIR/jobs.jsonl (jobs/zygote.py); tests/tools/cpu_report.py DIR prints the profile.
CPU_LOG = os.environ.get("MIRRORAX_TEST_CPU_LOG")
if CPU_LOG:
    os.makedirs(CPU_LOG, exist_ok=True)
    os.environ.setdefault("ZYGOTE_CPU_LOG", os.path.join(CPU_LOG, "jobs.jsonl"))

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


# With two xdist workers (addopts in pyproject.toml: a module per worker) the suite ends when the worker
# that took the last long module ends. xdist hands modules out by their number of tests, most first, so
# that the long modules with few tests (the CLI, the benchmark harness, the resume and float64 jobs) came
# last and one worker ran them while the other had nothing left. Longest first instead (the modules'
# measured wall, largest first: MIRRORAX_TEST_CPU_LOG above); the rest by number of tests, as
# xdist would. Only the order of modules changes: a module's tests stay together and in their order.
LONGEST_FIRST = [  # the modules' wall in a full run (tests/tools/cpu_report.py), 2026-12-03, over ~30 s
    "test_elastic.py",  # (2026-12-06: ~7 min, its Ray cluster's restarts)
    "test_mesh2d.py", "test_keras_io.py", "test_docs.py", "test_multiprocess.py", "test_plan.py", "test_cli.py",
    "test_faults_launch.py", "test_keras_fit.py", "test_benchmarks_smoke.py", "test_custom_loops.py",
    "test_preemption.py", "test_front_ends.py", "test_launch.py", "test_bad_inputs.py", "test_checkpoint.py",
    "test_nnx_multiprocess.py",
    "test_keras_callbacks_write.py", "test_resume.py", "test_cluster.py", "test_equivalence.py", "test_keras_rows.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], item.path.name))


_CPU_START: dict[str, tuple[float, float, float]] = {}


def _cpu_now() -> tuple[float, float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_runtest_setup(item):
    if CPU_LOG:
        _CPU_START[item.nodeid] = _cpu_now()


def pytest_runtest_logreport(report):
    if not CPU_LOG or report.when != "teardown" or report.nodeid not in _CPU_START:
        return
    (wall0, own0, kids0), (wall1, own1, kids1) = _CPU_START.pop(report.nodeid), _cpu_now()
    with open(os.path.join(CPU_LOG, "tests.jsonl"), "a") as log:  # setup to teardown, one line per test
        log.write(json.dumps({"id": report.nodeid, "wall": wall1 - wall0, "self": own1 - own0,
                              "kids": kids1 - kids0}) + "\n")
