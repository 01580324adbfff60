"""The main job and the device listing, run as a user runs them."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.multi_device, pytest.mark.slow]


def _run(args, tmp_path, timeout=300):
    # The CLI turns on its compilation cache in MIRRORAX_CACHE_DIR: the session's (tests/conftest.py).
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path / "xla")
    env = dict(os.environ, MIRRORAX_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "mirrorax.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


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


def test_mirrorax_devices_lists_simulated_devices(tmp_path):
    out = _run(["devices", "--cpu-devices", "3"], tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 device(s) in all" in out.stdout and out.stdout.count("local\n") == 3


def test_missing_data_file_is_a_clear_error(tmp_path):
    out = _run(["train", "--cpu-devices", "2", "--data", str(tmp_path / "nope.npz")], tmp_path, timeout=120)
    assert out.returncode != 0 and "no such file" in out.stderr


def test_mnist_npz_path(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz", x_train=rng.integers(0, 255, (64, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, 64), x_test=rng.integers(0, 255, (16, 28, 28), dtype=np.uint8),
             y_test=rng.integers(0, 10, 16))
    out = _run(["train", "--cpu-devices", "2", "--data", str(tmp_path / "mnist.npz"), "--epochs", "1",
                "--batch-size", "32"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "64 training and 16 test images of 28x28" in out.stdout


def test_mirrorax_train_checkpoint_dir_resumes(tmp_path):
    # One epoch on the 8 devices of the first test (its programs come from the compilation cache), then
    # the same command for two epochs on 2 devices: it trains the second only.
    ckpt = str(tmp_path / "run")
    first = _run(["train", "--cpu-devices", "8", "--epochs", "1", "--checkpoint-dir", ckpt], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Resumed" not in first.stdout
    again = _run(["train", "--cpu-devices", "2", "--epochs", "2", "--checkpoint-dir", ckpt], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resumed from checkpoint step 23" in again.stdout  # 1 epoch x 23 steps, now on 2 devices
    assert re.findall(r"^Epoch (\d+)/2", again.stdout, re.M) == ["2"]


def test_mirrorax_plan_prints_the_per_device_cost_and_the_largest_batches(tmp_path):
    out = _run(["plan", "--cpu-devices", "4", "--model", "mlp", "--batch-size", "256", "--shard", "all",
                "--device-memory", "64MB"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "mirrorax plan: 4 device(s), shard='all', global batch 256" in text
    for row in ("parameters", "optimizer state", "activations / temporaries", "step peak", "collectives per step"):
        assert row in text, text
    sizes = {m: re.search(rf"shard={m}: (\d+|none)", text).group(1) for m in ("None", "'optimizer'", "'all'")}
    assert all(v != "none" and int(v) >= 4 for v in sizes.values()), text
