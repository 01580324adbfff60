"""Run in a fresh process: the plan's per-device peak against the process's own memory growth in fit.

On CPU the simulated devices share this process's memory, so a step on ``N`` devices should grow the
process by about ``N`` times the plan's per-device peak. The model's own copy of the weights, made
before fit, is resident at the baseline and is let go of when fit takes the values over, so it is
subtracted from the prediction. Prints one JSON line.

It sets glibc's mmap threshold to 64 KiB first (``mallopt``, what ``MALLOC_MMAP_THRESHOLD_=65536`` does at
a process's start, so that it holds in a forked ``python`` too): glibc then returns every freed buffer to
the OS at once, and the RSS counts live memory rather than blocks its heap kept after they were freed.

Usage: python plan_memory.py SHARD DEVICES
"""

import ctypes
import gc
import json
import os
import sys
import threading

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 65536):
    sys.exit("plan_memory.py: mallopt(M_MMAP_THRESHOLD) failed: the RSS would count freed blocks")

SHARD = None if sys.argv[1] == "none" else sys.argv[1]
DEVICES = int(sys.argv[2])
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = str(DEVICES)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import mirrorax as mx  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak(threading.Thread):
    """The largest RSS seen, sampled every millisecond."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.done = rss(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, rss())


def main() -> None:
    keras.utils.set_random_seed(0)
    width = 2048  # ~12.6M parameters: 50 MB, 150 MB with Adam's two slots; the state dominates the step
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width),
                              keras.layers.Dense(16)])
    model.compile(optimizer="adam", loss="mse")
    batch = 8 * DEVICES
    x = np.random.default_rng(0).normal(size=(batch, width)).astype(np.float32)
    y = np.zeros((batch, 16), np.float32)
    trainer = mx.Trainer(model, mx.MirroredStrategy(shard=SHARD))
    plan = mx.plan(trainer, x, y, batch_size=batch, search=False)  # compiles the step fit runs: not measured
    model_copy = sum(np.asarray(v).nbytes for v in model.weights + model.optimizer.variables)
    gc.collect()
    base = rss()
    peak = Peak()
    peak.start()
    trainer.fit(x, y, batch_size=batch, epochs=3, verbose=0)
    peak.done.set()
    peak.join()
    d0 = jax.devices()[0]
    held = {g: sum(sh.data.nbytes for a in jax.tree.leaves(trainer.state[g]) for sh in a.addressable_shards
                   if sh.device == d0) for g in ("params", "optimizer", "model_state")}
    print(json.dumps({"shard": SHARD, "devices": DEVICES, "peak_bytes": plan.peak_bytes,
                      "temp_bytes": plan.temp_bytes, "state_bytes": plan.state_bytes,
                      "planned": {"params": plan.param_bytes, "optimizer": plan.optimizer_bytes,
                                  "model_state": plan.model_state_bytes},
                      "held": held, "model_copy": model_copy, "growth": peak.peak - base,
                      "compiles": trainer.compile_counts()["train"]}))


if __name__ == "__main__":
    main()
