"""The per-step cost of batch logs: ``model.fit`` under ``strategy.scope()`` with and without a batch callback.

Run from the repository root::

    PYTHONPATH=src python -m benchmarks.batch_logs            # 2 CPU devices, 200 steps, median of 3
    PYTHONPATH=src python -m benchmarks.batch_logs --devices 4 --steps 400 --repeats 5

Three runs of the same small MLP (64 -> 256 -> 256 -> 10, Adam, global batch 64), ``verbose=0``:

- ``none``: no callbacks (batch hooks are not called at all),
- ``ignores``: a callback whose ``on_train_batch_end`` ignores its logs (the hook is called each step;
  the logs stay device scalars nobody reads),
- ``reads``: a callback that reads ``float(logs["loss"])`` each step (the host waits for that step).

Each variant is warmed up (compilation) by one fit, then timed over ``--repeats`` fits of ``--steps``
steps; the table gives steps/s (median, min-max) and the cost per step relative to ``none``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices (default 2)")
    parser.add_argument("--steps", type=int, default=200, help="steps per timed fit (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="timed fits per variant (default 3)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    args = parser.parse_args(argv)

    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts; CPU only
    import keras
    import numpy as np

    import mirrorax as mx

    class Ignores(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    class Reads(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.last = 0.0

        def on_train_batch_end(self, batch, logs=None):
            self.last = float(logs["loss"])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=len(x))
    strategy = mx.MirroredStrategy(devices=jax.devices()[:args.devices])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    variants = {"none": lambda: [], "ignores": lambda: [Ignores()], "reads": lambda: [Reads()]}
    timings: dict[str, list[float]] = {k: [] for k in variants}
    for make in variants.values():  # warm-up: compile once, and the callback's path once
        model.fit(x[:4 * args.batch], y[:4 * args.batch], batch_size=args.batch, epochs=1, shuffle=False,
                  verbose=0, callbacks=make())
    for _ in range(args.repeats):  # round-robin: machine drift hits every variant alike
        for name, make in variants.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=make())
            timings[name].append(args.steps / (time.perf_counter() - start))

    base = statistics.median(timings["none"])
    print(f"model.fit under scope, {args.devices} devices ({jax.devices()[0].platform}), MLP 64-256-256-10, "
          f"batch {args.batch}, {args.steps} steps x {args.repeats} runs")
    print(f"{'variant':<10} {'steps/s (median)':>17} {'min-max':>17} {'us/step vs none':>16}")
    for name, rates in timings.items():
        med = statistics.median(rates)
        extra = (1 / med - 1 / base) * 1e6
        print(f"{name:<10} {med:>17.1f} {min(rates):>8.1f}-{max(rates):<8.1f} {extra:>+16.0f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
