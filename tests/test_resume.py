"""Exact resume after a real SIGKILL of a real training process, onto another device count.

Tolerance: final weights and per-epoch losses rtol=1e-5, atol=1e-6 (the resumed run replays the same
batches from the same state; only float reassociation across device counts differs); accuracies exact.
"""

import os
import signal
import subprocess
import threading

import numpy as np
import pytest
from jobs.procs import clean_env, launcher, python

SCRIPT = os.path.join(os.path.dirname(__file__), "jobs", "train_ckpt.py")
JOB = ["--epochs", "4", "--every", "3"]  # 28 steps; checkpoints at steps 3, 6, 7 (epoch end), 9, ...
pytestmark = pytest.mark.multi_device


def _env():
    return clean_env()


def _run(args, timeout=240):
    out = subprocess.run(python(SCRIPT, *args, *JOB), capture_output=True, text=True, timeout=timeout,
                         env=_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _run_and_kill(args, kill_at_step, timeout=240):
    """Runs the job until it holds after step ``kill_at_step`` (its handshake), then SIGKILLs it there."""
    proc = subprocess.Popen(python(SCRIPT, *args, *JOB, "--hold-at", str(kill_at_step)),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("HOLD"):
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        timer.cancel()
    assert seen and seen[-1] == f"HOLD {kill_at_step}\n", "".join(seen)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The job run through once, one process on 4 devices: what every resumed run must end with."""
    ref = tmp_path_factory.mktemp("uninterrupted") / "ref.npz"
    _run(["-", str(ref), "--devices", "4"])
    return dict(np.load(ref))


def _assert_same(got, want):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert list(got["accuracy"]) == list(want["accuracy"])


@pytest.mark.slow  # starts processes
def test_sigkill_mid_epoch_then_resume_on_other_device_count(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    got = tmp_path / "got.npz"
    # killed after 11 of 28 steps (epoch 2, batch 4): checkpoints exist at steps 3, 6, 7 (epoch end), 9
    _run_and_kill([str(ckpt), str(tmp_path / "never.npz"), "--devices", "4"], kill_at_step=11)
    assert not (tmp_path / "never.npz").exists()
    out = _run([str(ckpt), str(got), "--devices", "2"])  # the same call again, on 2 devices
    assert "Resumed from checkpoint step" in out, out
    _assert_same(dict(np.load(got)), uninterrupted)


@pytest.mark.multi_process
@pytest.mark.slow  # starts processes
def test_launcher_restart_resumes_after_a_worker_is_killed(tmp_path, uninterrupted):
    """2 processes x 2 devices; rank 1 SIGKILLs itself at step 11 of 28 on the first attempt only."""
    got = tmp_path / "got.npz"
    # The sleep lets the checkpoints of steps 3-9 reach the disk before the kill (each process writes
    # its part: a hold in one process would stall the other's save).
    cmd = [*launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--max-restarts", "1"), "--",
           *python(SCRIPT), str(tmp_path / "ckpt"), str(got), *JOB,
           "--kill-rank", "1", "--kill-at-step", "11", "--sleep", "0.05"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "rank 1 failed (killed by signal SIGKILL)" in text and "restart 1 of 1" in text, text[-4000:]
    assert "[rank 0] Resumed from checkpoint step" in text, text[-4000:]
    _assert_same(dict(np.load(got)), uninterrupted)


def test_trainer_load_restores_for_evaluate_and_predict(tmp_path):
    from helpers import dense, flat_digits, strategy

    import mirrorax as mx

    x, y, xt, yt = flat_digits(100)
    model = dense()
    t = mx.Trainer(model, strategy(8))
    t.fit(x, y, batch_size=32, epochs=2, verbose=0, checkpoint_dir=tmp_path / "ck")
    fresh = dense(seed=99)  # other initial weights: everything must come from the checkpoint
    loaded = mx.Trainer.load(tmp_path / "ck", fresh, strategy(2))
    np.testing.assert_allclose(loaded.predict(xt, batch_size=64), t.predict(xt, batch_size=64), rtol=1e-6, atol=1e-7)
    assert loaded.evaluate(xt, yt, batch_size=64) == pytest.approx(t.evaluate(xt, yt, batch_size=64), rel=1e-6)
    for a, b in zip(fresh.get_weights(), model.get_weights()):  # written back into the model
        np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(mx.CheckpointError, match="No checkpoint directory"):
        mx.Trainer.load(tmp_path / "missing", dense(), strategy(1))
