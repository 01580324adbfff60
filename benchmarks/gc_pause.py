"""Python's full garbage collection in a training process: how often a hand-written JAX loop meets one and
what it costs, in a process of the hand loop alone (``light``) or one that also holds the transformer's
Keras model, a ``model.fit`` under a scope and an ``mx.Trainer`` (``heavy``); then again after
``gc.freeze()``.

Run: ``JAX_NUM_CPU_DEVICES=1 python -m benchmarks.gc_pause light`` (or ``heavy``). Prints, per chunk of
2,000 steps of a tiny MLP (host-bound), steps/s, the time spent in the collector and the collections per
generation.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

N, BATCH, STEPS = 4096, 16, 2000


def hand_loop() -> Any:
    """The hand-written loop (``benchmarks.peers.jax_loop``) on a tiny MLP, one device."""
    import jax
    import keras
    import numpy as np

    from benchmarks.peers.jax_loop import HandLoop

    x = np.random.RandomState(0).randn(N, 8).astype("float32")
    y = (np.arange(N) % 4).astype("int32")
    mesh = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
    return HandLoop(model, keras.optimizers.Adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    mesh, [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)])


def load_the_process() -> list[Any]:
    """What a mirrorax process also holds: the transformer under a scope, fitted, and a Trainer's fit."""
    import jax

    import mirrorax as mx
    from benchmarks import workloads

    wl = workloads.get("transformer")
    x, y = workloads.make_data(wl, 64, seed=0)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    trainer = mx.Trainer(workloads.build_keras_model(wl), strategy, loss=workloads.compile_args(wl)["loss"],
                         optimizer="adam")
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    return [model, trainer]


def main(kind: str) -> None:
    loop = hand_loop()
    held = load_the_process() if kind == "heavy" else []
    loop.steps(50)
    spent = {"s": 0.0, "start": 0.0, "gens": [0, 0, 0]}

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            spent["start"] = time.perf_counter()
        else:
            spent["s"] += time.perf_counter() - spent["start"]
            spent["gens"][info["generation"]] += 1

    gc.callbacks.append(watch)
    print(f"{kind}: {len(gc.get_objects()):,} objects tracked ({len(held)} held)")
    for label in ("plain", "plain", "frozen", "frozen"):
        if label == "frozen" and gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
        spent.update(s=0.0, gens=[0, 0, 0])
        start = time.perf_counter()
        loop.steps(STEPS)
        rate = STEPS / (time.perf_counter() - start)
        print(f"{kind} {label}: {rate:7.0f} steps/s, collector {spent['s'] * 1e3:.1f} ms, collections per "
              f"generation {spent['gens']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "light")
