"""Real multi-process training: 2 processes x 2 simulated CPU devices, through ``mirrorax launch``.

* Same result as one process: 2x2 gives the weights, history, evaluate and predict of 1x4 and 1x1
  (rtol 1e-5, atol 1e-6; measured differences are <= 1.2e-7), and every process returns the same numbers.
* Per-process pipelines (``distribute_datasets_from_function``) with a short last batch give the
  result of unshuffled arrays on one device.
* One voice: only rank 0 prints progress.
* Failure never hangs: a rank killed or raising mid-training stops the group, with and without the
  launcher, within the bounds asserted below.
"""

from __future__ import annotations

import re
import time

import jax
import numpy as np
import pytest
from jobs import train_dense, train_unseeded
from jobs.procs import clean_env, free_port, launcher, python, run_all

import mirrorax as mx

pytestmark = [pytest.mark.multi_process, pytest.mark.slow]

RTOL, ATOL = 1e-5, 1e-6
SCRIPT = "tests/jobs/train_dense.py"


def _launch_2x2(tmp_path, timeout: float = 150, script: str = SCRIPT, **env: str):
    cmd = launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--failure-timeout", "20", "--",
                   *python(script))
    start = time.monotonic()
    codes, outs, _ = run_all([cmd], [clean_env(MP_OUT=str(tmp_path), **env)], timeout=timeout)
    return codes[0], outs[0], time.monotonic() - start


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=f"{what}: {key}")


@pytest.mark.timeout(240)
def test_two_processes_match_one_process_and_speak_with_one_voice(tmp_path):
    code, out, _ = _launch_2x2(tmp_path, MP_PIPELINE="1")
    assert code == 0, out
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    pipelines = [dict(np.load(tmp_path / f"pipeline{r}.npz")) for r in range(2)]

    # Every process returns the same history, evaluate results and full predictions.
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
        assert ranks[0]["predict"].shape == (train_dense.ROWS, train_dense.CLASSES)
    for key in pipelines[0]:
        np.testing.assert_array_equal(pipelines[0][key], pipelines[1][key], err_msg=key)

    # The same as one process with 4 devices, and as one device.
    for n in (4, 1):
        strategy = mx.MirroredStrategy(devices=jax.devices()[:n])
        _assert_same(ranks[0], train_dense.train(strategy), f"2x2 vs 1x{n}")
    _assert_same(pipelines[0], train_dense.train_unshuffled(mx.MirroredStrategy(devices=jax.devices()[:1]),
                                                            pipeline=False), "2x2 pipelines vs 1x1 arrays")

    # One voice: progress lines come from rank 0 only.
    assert "process 1 of 2: 4 replicas in sync" in out
    assert re.search(r"^\[rank 0\] Epoch 3/3 ", out, re.M), out
    assert not re.search(r"^\[rank 1\] .*Epoch", out, re.M), out


def _death_time(out: str) -> float:
    return float(re.search(r"dies now \(\w+\) at ([\d.]+)", out).group(1))


@pytest.mark.timeout(120)
def test_launcher_stops_the_group_when_a_rank_is_killed(tmp_path):
    code, out, _ = _launch_2x2(tmp_path, timeout=100, MP_DIE="kill:1:1", MP_EPOCHS="500")
    ended = time.time()
    assert code == 137 and "rank 1 failed (killed by signal SIGKILL)" in out, out
    assert "process 1 dies now (kill)" in out  # the tail of the failed rank
    assert ended - _death_time(out) < 15, out


@pytest.mark.timeout(120)
def test_launcher_names_the_rank_that_raised(tmp_path):
    code, out, _ = _launch_2x2(tmp_path, timeout=100, MP_DIE="raise:1:1", MP_EPOCHS="500")
    ended = time.time()
    assert code == 1 and "rank 1 failed (exit code 1)" in out, out
    assert "RuntimeError: injected failure in process 1" in out
    assert "[rank 0] mirrorax: process 1 of 2 failed (RuntimeError: injected failure in process 1)" in out, out
    assert ended - _death_time(out) < 15, out


def _direct_2x2(tmp_path, **env: str):
    """The two processes started by hand (as a scheduler would), no launcher to clean up."""
    port = free_port()
    envs = [clean_env(MIRRORAX_COORDINATOR=f"127.0.0.1:{port}", MIRRORAX_NUM_PROCESSES="2",
                      MIRRORAX_PROCESS_ID=str(i), MIRRORAX_CPU_DEVICES="2", MP_OUT=str(tmp_path),
                      MP_EPOCHS="500", **env) for i in range(2)]
    return run_all([python(SCRIPT)] * 2, envs, timeout=100)


@pytest.mark.timeout(120)
def test_without_launcher_survivor_of_a_killed_peer_exits_within_the_heartbeat(tmp_path):
    codes, outs, times = _direct_2x2(tmp_path, MP_DIE="kill:1:1", MIRRORAX_HEARTBEAT_TIMEOUT="5")
    ended = time.time() - (max(times) - times[0])
    assert codes[1] == -9 and codes[0] not in (0, -999), (codes, outs[0][-3000:])
    # The survivor either sees the broken collective at once or JAX's heartbeat names the dead task.
    assert ended - _death_time(outs[1]) < 5 + 10, outs[0][-3000:]
    assert "unhealthy" in outs[0] or "process 0 of 2 failed" in outs[0], outs[0][-3000:]


@pytest.mark.timeout(120)
def test_without_launcher_a_raise_stops_every_process_and_names_it(tmp_path):
    codes, outs, times = _direct_2x2(tmp_path, MP_DIE="raise:1:1")
    assert codes == [1, 1], (codes, outs)
    assert "mirrorax: process 1 of 2 failed (RuntimeError: injected failure in process 1); process 0 stops too" \
        in outs[0], outs[0][-3000:]
    assert abs(times[0] - times[1]) < 5, times


@pytest.mark.timeout(240)
def test_unseeded_model_trains_as_one_state_from_process_0s_weights(tmp_path):
    """Each process draws other initial weights and sets other weights between fits: every replica
    must hold process 0's values (broadcast), or the all-reduce averages the gradients of different
    models. The result equals one process of 4 devices started from process 0's values."""
    code, out, _ = _launch_2x2(tmp_path, script="tests/jobs/train_unseeded.py")
    assert code == 0, out
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    n = len([k for k in ranks[0] if k.startswith("init_")])
    # The precondition that makes this test able to fail: the processes' own values differ.
    assert not np.allclose(ranks[0]["init_0"], ranks[1]["init_0"])
    assert not np.allclose(ranks[0]["reset_0"], ranks[1]["reset_0"])
    for i in range(n):
        np.testing.assert_array_equal(ranks[0][f"final_{i}"], ranks[1][f"final_{i}"], err_msg=f"weight {i}")
    start = [ranks[0][f"init_{i}"] for i in range(n)]
    reset = [ranks[0][f"reset_{i}"] for i in range(n)]
    want = train_unseeded.replay(mx.MirroredStrategy(devices=jax.devices()[:4]), start, reset)
    for i in range(n):
        np.testing.assert_allclose(ranks[0][f"final_{i}"], want[i], rtol=RTOL, atol=ATOL, err_msg=f"weight {i}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", [1, 0])
def test_launcher_says_that_a_frozen_rank_stopped_answering(frozen):
    """A SIGSTOPped rank (Ctrl-Z, a debugger, a stuck host) neither exits nor answers: the heartbeat
    (10 s here) makes the other abort, and the launcher names the frozen rank, not the one that aborted."""
    cmd = launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--failure-timeout", "20", "--",
                   *python("tests/jobs/psum.py"))
    codes, outs, times = run_all([cmd], [clean_env(MP_FAIL=f"stop:{frozen}", MP_FAIL_STEP="3")], timeout=100)
    out = outs[0]
    report = out[out.index("mirrorax launch: rank"):]
    assert codes[0] not in (0, -999) and times[0] < 60, (codes, times, out[-3000:])
    assert report.startswith(f"mirrorax launch: rank {frozen} stopped answering (its process was stopped"), report
    assert f"process {frozen} fails now (stop)" in report, report  # the frozen rank's own last words
    assert "stopped by the launcher" not in out and "@ 0x" not in report, report
    assert "[Gloo]" not in out, out[-3000:]


@pytest.mark.timeout(240)
def test_sharded_state_on_two_processes_matches_one_process(tmp_path):
    """shard="all" over 2 processes x 2 devices: the 2048-wide kernel (and its Adam slots) are split
    across the processes' devices; the result is the replicated one of 1 process x 4 devices."""
    code, out, _ = _launch_2x2(tmp_path, MP_SHARD="all", MP_WIDTH="2048", MP_EPOCHS="2")
    assert code == 0, out
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    want = train_dense.train(mx.MirroredStrategy(devices=jax.devices()[:4]), epochs=2, width=2048)
    _assert_same(ranks[0], want, "2x2 shard='all' vs 1x4 replicated")
