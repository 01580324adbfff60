"""float64 models train in float64: every factor of the loss (inputs, weights, mask, counts) in the model's
type, so the Trainer equals Keras's own float64 fit to float64 precision on any device count.

x64 is a process-wide JAX setting, so the comparison runs in a child process (tests/jobs/float64_fit.py)
and never leaks into the other tests. Measured: <= 1.2e-16 (1 and 4 devices, 1 and 3 SGD steps, a
classifier and a regressor, a FunctionalModel); before the float64 path the same runs differed by
1.8e-9 to 1.5e-8 (float32 inputs and loss weights).
"""

import json
import os
import subprocess

import pytest
from jobs.procs import clean_env, python

pytestmark = [pytest.mark.multi_device, pytest.mark.slow]

SCRIPT = os.path.join(os.path.dirname(__file__), "jobs", "float64_fit.py")


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run(python(SCRIPT), capture_output=True, text=True, timeout=280, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_float64_trainer_equals_keras_float64_fit(results):
    keras_runs = {k: v for k, v in results.items() if not k.startswith("functional")}
    assert len(keras_runs) == 8  # 2 losses x (1, 3 steps) x (1, 4 devices)
    for name, r in keras_runs.items():
        assert r["dtypes"] == ["float64"], name
        assert r["moved"] > 1e-2, name  # training moved the weights: the comparison means something
        assert r["diff"] <= 1e-12, (name, r["diff"])


def test_float64_functional_model_equals_plain_jax_step(results):
    for n in (1, 4):
        r = results[f"functional/1step/{n}dev"]
        assert r["dtypes"] == ["float64"] and r["moved"] > 1e-2
        assert r["diff"] <= 1e-12, (n, r["diff"])
