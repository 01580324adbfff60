"""The main job and the device listing, run as a user runs them.

The main job reaching 95% and the device listing run as processes (``python -m mirrorax``, what a user of
a checkout without the console script types); the flags' behaviours (a missing file, an MNIST .npz, resuming
from ``--checkpoint-dir``, the plan) run through the same ``main`` in this process, on its 8 devices: each
process would pay the imports and compiles again for the same code path.
"""

import os
import re
import subprocess

import numpy as np
import pytest
from jobs.procs import clean_env, python

from mirrorax.cli import main

pytestmark = pytest.mark.multi_device


def _run(args, tmp_path, timeout=300):
    # The CLI turns on its compilation cache in MIRRORAX_CACHE_DIR: the session's (tests/conftest.py).
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path / "xla")
    return subprocess.run(python("-m", "mirrorax", *args), capture_output=True, text=True,
                          timeout=timeout, env=clean_env(MIRRORAX_CACHE_DIR=cache))


def _main(args, capsys):
    """``mirrorax ARGS`` in this process (its session compilation cache kept); returns stdout."""
    capsys.readouterr()
    assert main(args) == 0
    return capsys.readouterr().out


@pytest.mark.slow  # starts a process
def test_mirrorax_train_reaches_95_percent_on_8_simulated_devices(tmp_path):
    out = _run(["train", "--cpu-devices", "8"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "Devices: 8 x cpu" in text
    # Keras's own progress lines (verbose="auto" off a terminal: one per epoch), from model.fit under scope
    assert len(re.findall(r"^Epoch \d+/12$", text, re.M)) == 12
    assert len(re.findall(r"^23/23 - .* - accuracy: [0-9.]+ - loss: [0-9.]+ - val_accuracy: ", text, re.M)) == 12
    acc = float(re.search(r"Test accuracy: ([0-9.]+)", text).group(1))
    assert acc >= 0.95, text
    assert re.search(r"Throughput: [0-9,]+ samples/s", text)


@pytest.mark.slow  # starts a process
def test_mirrorax_devices_lists_simulated_devices(tmp_path):
    out = _run(["devices", "--cpu-devices", "3"], tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 device(s) in all" in out.stdout and out.stdout.count("local\n") == 3


def test_missing_data_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        main(["train", "--data", str(tmp_path / "nope.npz"), "--compilation-cache", "off"])


@pytest.mark.slow  # trains or compiles for more than a few seconds
def test_mnist_npz_path(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz", x_train=rng.integers(0, 255, (64, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, 64), x_test=rng.integers(0, 255, (16, 28, 28), dtype=np.uint8),
             y_test=rng.integers(0, 10, 16))
    out = _main(["train", "--data", str(tmp_path / "mnist.npz"), "--epochs", "1", "--batch-size", "32",
                 "--compilation-cache", "off"], capsys)
    assert "64 training and 16 test images of 28x28" in out
    assert "Test accuracy: " in out


@pytest.mark.slow  # trains or compiles for more than a few seconds
def test_mirrorax_train_checkpoint_dir_resumes(tmp_path, capsys):
    # One epoch, then the same command for two epochs: it trains the second only. (A resume onto another
    # device count: test_resume.py, test_sharding.py.)
    ckpt = str(tmp_path / "run")
    args = ["train", "--batch-size", "256", "--checkpoint-dir", ckpt, "--compilation-cache", "off"]
    first = _main([*args, "--epochs", "1"], capsys)
    assert "Resumed" not in first and "Test accuracy: " in first
    again = _main([*args, "--epochs", "2"], capsys)
    assert "Resumed from checkpoint step 6" in again  # 1 epoch x 6 steps (1437 rows at batch 256)
    assert re.findall(r"^Epoch (\d+)/2", again, re.M) == ["2"]


@pytest.mark.slow  # a plan search: several compiles per mode
def test_mirrorax_plan_prints_the_per_device_cost_and_the_largest_batches(capsys):
    text = _main(["plan", "--model", "mlp", "--batch-size", "256", "--shard", "all", "--device-memory", "64MB"],
                 capsys)
    assert "mirrorax plan: 8 device(s), shard='all', global batch 256" in text
    for row in ("parameters", "optimizer state", "activations / temporaries", "step peak", "collectives per step"):
        assert row in text, text
    sizes = {m: re.search(rf"shard={m}: (\d+|none)", text).group(1) for m in ("None", "'optimizer'", "'all'")}
    assert all(v != "none" and int(v) >= 8 for v in sizes.values()), text
