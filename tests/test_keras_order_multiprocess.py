"""Keras's shuffle order on 2 processes x 2 simulated CPU devices (``mirrorax launch``): processes whose
numpy states differ (an unseeded program) all train on process 0's order, the result of one process of
4 devices drawing from process 0's state."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jobs import keras_order
from jobs.procs import clean_env, launcher, python, run_all

import mirrorax as mx

pytestmark = [pytest.mark.multi_process, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_processes_with_other_numpy_states_train_on_process_0s_order(tmp_path):
    cmd = launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--failure-timeout", "20", "--",
                   *python("tests/jobs/keras_order.py"))
    codes, outs, _ = run_all([cmd], [clean_env(MP_OUT=str(tmp_path))], timeout=240)
    assert codes[0] == 0, outs[0]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:4])
    want = keras_order.train(strategy, 1000)
    for key in want:
        np.testing.assert_allclose(ranks[0][key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # The control: process 1's own order would have trained to other weights.
    other = keras_order.train(strategy, 1001)
    assert not np.allclose(other["w0"], want["w0"], rtol=1e-3)
