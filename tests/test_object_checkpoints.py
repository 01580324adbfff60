"""``mx.Checkpoint`` and ``mx.CheckpointManager`` on one process: TF's ``CheckpointManager`` (``max_to_keep``,
``latest_checkpoint``, ``checkpoints``), TF's state file, a program's last save. On 2 processes (objects made
outside the scope, TF's per-worker paths, a save at exit): ``tests/test_tf_multi_worker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx

tf = pytest.importorskip("tensorflow")


def _objects(seed: int):
    keras.utils.set_random_seed(seed)
    with strategy(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    epoch = keras.Variable(0, dtype="int32", name="epoch")  # outside the scope, as TF's tutorial makes it
    return model, epoch


def test_a_manager_keeps_its_newest_and_tfs_lookup_finds_the_latest(tmp_path):
    model, epoch = _objects(1)
    checkpoint = mx.Checkpoint(model=model, epoch=epoch)
    manager = mx.CheckpointManager(checkpoint, directory=tmp_path / "run", max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == [] and manager.restore_or_initialize() is None
    for e in range(3):
        epoch.assign(e + 1)
        path = manager.save()
        # the directory's first checkpoint is on disk when save returns, so TF's lookup finds it at once
        assert e > 0 or os.path.isdir(path)
    checkpoint.wait()
    prefix = str(tmp_path / "run" / "ckpt")
    assert manager.checkpoints == [f"{prefix}/2", f"{prefix}/3"] and manager.latest_checkpoint == f"{prefix}/3"
    assert sorted(p for p in os.listdir(prefix) if not p.startswith(".")) == ["2", "3"]  # max_to_keep=2
    assert checkpoint.save_counter == 3
    latest = tf.train.latest_checkpoint(str(tmp_path / "run"))  # TF's state file names the checkpoints' folder
    fresh, fresh_epoch = _objects(2)
    mx.Checkpoint(model=fresh, epoch=fresh_epoch).restore(latest)
    assert int(fresh_epoch.numpy()) == 3
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    again = mx.CheckpointManager(mx.Checkpoint(model=fresh, epoch=fresh_epoch), tmp_path / "run", max_to_keep=2)
    fresh_epoch.assign(0)
    assert again.restore_or_initialize() == f"{prefix}/3" and int(fresh_epoch.numpy()) == 3


def test_a_manager_after_a_restore_still_keeps_its_max(tmp_path):
    # TF's tutorial restores before its manager's first save: the directory's saver, opened by the restore to
    # keep every checkpoint, is reopened to keep the manager's max_to_keep.
    model, epoch = _objects(1)
    checkpoint = mx.Checkpoint(model=model, epoch=epoch)
    mx.CheckpointManager(checkpoint, tmp_path, max_to_keep=None).save()
    checkpoint.restore(tf.train.latest_checkpoint(str(tmp_path)))
    manager = mx.CheckpointManager(checkpoint, tmp_path, max_to_keep=1)
    for number in (5, 6):
        assert manager.save(checkpoint_number=number) == str(tmp_path / "ckpt" / str(number))
    checkpoint.wait()
    assert manager.checkpoints == [str(tmp_path / "ckpt" / "6")] and checkpoint.save_counter == 6


def test_write_takes_a_numbered_path_and_leaves_the_counter(tmp_path):
    model, epoch = _objects(1)
    checkpoint = mx.Checkpoint(model=model, epoch=epoch)
    assert checkpoint.write(tmp_path / "ckpt" / "7") == str(tmp_path / "ckpt" / "7") and checkpoint.save_counter == 0
    with pytest.raises(ValueError, match=r"Received '.*ckpt'.*save\(prefix\)"):
        checkpoint.write(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="CheckpointManager takes an mx.Checkpoint. Received 3"):
        mx.CheckpointManager(3, tmp_path, max_to_keep=1)
    with pytest.raises(ValueError, match="max_to_keep"):
        mx.CheckpointManager(checkpoint, tmp_path, max_to_keep=0)


_LAST_SAVE_FAILS = textwrap.dedent("""
    import os, resource, signal, sys
    os.environ["KERAS_BACKEND"] = "jax"
    import keras, numpy as np
    import mirrorax as mx
    checkpoint = mx.Checkpoint(step=keras.Variable(np.random.default_rng(0).normal(size=65536).astype("float32")))
    checkpoint.save(sys.argv[1])  # 256 KiB (that do not compress): the directory's first, on disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # files over 4 KiB: no room
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    checkpoint.save(sys.argv[1])  # the last act: its write fails at exit
    print("saved", flush=True)
""")


def test_a_last_save_that_fails_at_exit_says_so_last_and_exits_1(tmp_path):
    # The program's last save is finished at exit; when the disk is full the one-line CheckpointError is
    # the last thing said (no Orbax traceback from closing after it) and the exit status is 1, not 0.
    done = subprocess.run([sys.executable, "-c", _LAST_SAVE_FAILS, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mirrorax: CheckpointError: Checkpoint step 2 could not be written"), done.stderr[-3000:]
    assert "the newest good checkpoint is step 1" in last and "File too large" in last
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert sorted(p for p in os.listdir(tmp_path / "ckpt") if p[0].isdigit() and not p.startswith("2.")) == ["1"]


@pytest.mark.slow  # starts a process
def test_a_long_run_saving_every_step_keeps_its_threads_and_memory(tmp_path):
    # 310 saves, one after every step, sampled every 25 once 30 are done (each sample after the save is on
    # disk). Memory: in one malloc arena (MALLOC_ARENA_MAX=1) what a run keeps is what it holds; measured
    # +0.43 MB over 300 saves (TensorStore's leaks mended in _orbax_quirks were 14 KB a save: +3.9 MB). By
    # default glibc also fills an arena per thread of each save to a plateau (+5.6 MB over 2,000 saves, flat
    # after ~1,000): docs/checkpoints.md. Threads: the same Python threads at every sample; TensorStore's pool
    # starts workers on demand (each leaves after 20 s idle): bounded; the other threads at most one more
    # than at first (a save's last thread may still be leaving when sampled).
    out = tmp_path / "samples.json"
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    done = subprocess.run([sys.executable, "tests/jobs/save_often.py", str(tmp_path / "ckpt"), str(out), "310", "30"],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    samples = json.loads(out.read_text())
    assert [s["save"] for s in samples] == list(range(30, 311, 25))
    first = samples[0]
    growth = samples[-1]["rss_mb"] - first["rss_mb"]
    assert growth < 1.5, [round(s["rss_mb"], 2) for s in samples]

    def others(s):
        return sum(n for name, n in s["threads"].items() if not name.startswith("ts_pool"))

    for s in samples:
        assert s["python"] == first["python"], (s["save"], s["python"], first["python"])
        assert others(s) <= others(first) + 1, (s["save"], s["threads"], first["threads"])
        assert s["threads"].get("ts_pool_worker", 0) <= 32, s["threads"]


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_a_full_disk_during_a_managers_save_leaves_tfs_lookup_right_and_nothing_temporary(tmp_path):
    """Issue 56: a real full disk (a 4 MiB tmpfs in a mount namespace of the test's own) under the manager's
    last save: one line, exit status 1, TF's state file whole, no temporary directory, and after space is
    freed ``tf.train.latest_checkpoint`` leads to checkpoint 2."""
    if not _unshare_works():
        pytest.skip("needs a mount namespace (unshare -rm) to mount a small tmpfs; none here")
    from jobs.procs import SCRIPTS, clean_env

    mount = tmp_path / "disk"
    mount.mkdir()
    job = str(SCRIPTS / "full_disk.py")
    run = mount / "run"
    script = (f"mount -t tmpfs -o size=4m tmpfs {mount} || exit 90\n"
              f"{sys.executable} {job} save {run} 2>{tmp_path / 'err.txt'}; echo \"RC $?\"\n"
              f"ls -la {run} > {tmp_path / 'listing.txt'}; cp {run}/checkpoint {tmp_path}/state_file\n"
              f"{sys.executable} {job} check {run}\n")
    out = subprocess.run(["unshare", "-rm", "bash", "-c", script], capture_output=True, text=True, timeout=600,
                         env=clean_env())
    assert out.returncode == 0 and "RC 1\n" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FILLED No space left on device" in out.stdout, out.stdout
    err = (tmp_path / "err.txt").read_text()
    lines = [line for line in err.splitlines() if line.strip()]
    # The save's one line, and nothing before it: no traceback (ours, Orbax's threads'), no OSError.
    assert len(lines) == 1 and lines[0].startswith("mirrorax: CheckpointError: Checkpoint step 3 could not be "
                                                   "written to "), err[-3000:]
    assert "No space left on device" in lines[0] and "the newest good checkpoint is step 2" in lines[0]
    assert (tmp_path / "state_file").read_text() == ('model_checkpoint_path: "ckpt"\n'
                                                    'all_model_checkpoint_paths: "ckpt"\n')
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line[:6] in ("LATEST", "RESTOR", "FILES "))
    assert said["LATEST"] == f"{run}/ckpt" and said["RESTORED"] == "2", out.stdout
    files = said["FILES"].split()
    assert "ckpt/2" in files and "ckpt/1" in files and "ckpt/3" not in files, files
    assert not [f for f in files if "tmp" in f], files  # no <step>.orbax-checkpoint-tmp*, no .checkpoint.tmp-*
