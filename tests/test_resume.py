"""Exact resume after a real SIGKILL of a real training process, onto another device count.

Tolerance: final weights and per-epoch losses rtol=1e-5, atol=1e-6 (the resumed run replays the same
batches from the same state; only float reassociation across device counts differs); accuracies exact.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_ckpt.py")
pytestmark = [pytest.mark.multi_device, pytest.mark.slow]


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def _run(args, timeout=240):
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                         env=_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _run_and_kill(args, kill_at_step, timeout=240):
    proc = subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=_env())
    deadline = time.time() + timeout
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("STEP") and int(line.split()[1]) >= 0 and \
                    sum(s.startswith("STEP") for s in seen) >= kill_at_step:
                proc.send_signal(signal.SIGKILL)
                break
            assert time.time() < deadline, "".join(seen)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


def test_sigkill_mid_epoch_then_resume_on_other_device_count(tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = tmp_path / "ref.npz"
    got = tmp_path / "got.npz"
    _run(["-", str(ref), "--devices", "4"])  # uninterrupted
    # killed after 11 of 28 steps (epoch 2, batch 4): checkpoints exist at steps 3, 6, 7 (epoch end), 9
    _run_and_kill([str(ckpt), str(tmp_path / "never.npz"), "--devices", "4", "--sleep", "0.05"], kill_at_step=11)
    assert not (tmp_path / "never.npz").exists()
    out = _run([str(ckpt), str(got), "--devices", "2"])  # the same call again, on 2 devices
    assert "Resumed from checkpoint step" in out, out
    a, b = np.load(ref), np.load(got)
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert list(b["accuracy"]) == list(a["accuracy"])


@pytest.mark.multi_process
def test_launcher_restart_resumes_after_a_worker_is_killed(tmp_path):
    """2 processes x 2 devices; rank 1 SIGKILLs itself at step 11 of 28 on the first attempt only."""
    ref, got = tmp_path / "ref.npz", tmp_path / "got.npz"
    _run(["-", str(ref), "--devices", "4"])  # uninterrupted, one process
    cmd = [sys.executable, "-m", "mirrorax.launch", "--nprocs", "2", "--cpu-devices-per-proc", "2",
           "--max-restarts", "1", "--", sys.executable, SCRIPT, str(tmp_path / "ckpt"), str(got),
           "--kill-rank", "1", "--kill-at-step", "11", "--sleep", "0.05"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "rank 1 failed (killed by signal SIGKILL)" in text and "restart 1 of 1" in text, text[-4000:]
    assert "[rank 0] Resumed from checkpoint step" in text, text[-4000:]
    a, b = np.load(ref), np.load(got)
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert list(b["accuracy"]) == list(a["accuracy"])


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
