"""What each epoch's figures cost (MFU, device busy, input wait: ``mirrorax.fit.meter``): steps/s with them on
against off (``MIRRORAX_FIGURES=0``).

The figures are a few clock reads a dispatch and a step timed on idle devices at dispatch 2, 5, 11, 23, ... of
an epoch; the worst case is the step with nothing but host work, where every microsecond of the host shows.
So: Keras's ``Dense(10)`` on 2 inputs at a global batch of 8 on one CPU device, ``mx.Trainer(...).fit`` of
``--steps`` steps (one epoch), two trainers in one process, one with the figures and one without, alternating
fits ABBA over ``--rounds`` rounds after a warm-up fit each. Reported: the median steps/s of each, the median of
the per-round ratios, and the main thread's CPU time per step (the host's own work, which other processes'
load moves least), with the machine's load average before and after; then the clock's own cost, its hooks and
wrappers in a loop of no work (what a step pays that the noise of a shared host hides).

Run: ``python -m benchmarks.figures_cost`` (about 2 minutes), ``--steps 8192 --rounds 20`` for a longer look.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
os.environ.setdefault("KERAS_BACKEND", "jax")


def _trainer() -> Any:
    import jax
    import keras

    import mirrorax as mx

    keras.utils.set_random_seed(0)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return mx.Trainer(model, strategy)


def _fit(trainer: Any, x: Any, y: Any, figures: bool) -> tuple[float, float]:
    """One fit of one epoch: (steps/s, the main thread's CPU seconds per step)."""
    import jax

    os.environ["MIRRORAX_FIGURES"] = "1" if figures else "0"  # read as each fit starts
    wall, cpu = time.perf_counter(), time.thread_time()
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    jax.block_until_ready(trainer.state)
    steps = len(x) // 8
    return steps / (time.perf_counter() - wall), (time.thread_time() - cpu) / steps


def clock_alone(steps: int = 200_000) -> float:
    """The epoch's clock without a step: seconds a step that ``EpochMeter``'s hooks and wrappers add to a loop of
    no work (the loop's own bookkeeping subtracted), the median of 5 runs."""
    import types

    from mirrorax.fit.epoch import EpochRun
    from mirrorax.fit.meter import EpochMeter, FitMeter
    from mirrorax.steps.dispatch import InFlight

    device = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    strategy = types.SimpleNamespace(devices=[device], is_primary=True, process_count=1)
    owner = type("Model", (), {})()  # what the records are kept for

    def loop(metered: bool) -> float:
        fit = FitMeter(owner, strategy, None, steps_per_execution=1, auto=False, prefetch=0, source=None, epochs=1)
        run = EpochRun(None, InFlight(2))
        meter = EpochMeter(fit, run, 0)
        meter.probe_at = ()  # (a probe waits for a step: there is none here)
        items = ((0, None) for _ in range(steps))
        placed = meter.placing(meter.reading(items)) if metered else items
        fit.note_batch = lambda *a: None  # type: ignore[method-assign]
        start = time.perf_counter()
        for _ in range(steps):
            if metered:
                meter.before_step(run)
            next(placed, None)
            run.before, run.steps = run.steps, run.steps + 1
            if metered:
                meter.after_step(run)
        return (time.perf_counter() - start) / steps

    return statistics.median(loop(True) - loop(False) for _ in range(5))


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * args.steps, 2)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    on, off = _trainer(), _trainer()
    _fit(on, x, y, True)
    _fit(off, x, y, False)
    load = os.getloadavg()
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for figures in ((True, False) if r % 2 == 0 else (False, True)):  # ABBA
            runs[figures].append(_fit(on if figures else off, x, y, figures))
    after = os.getloadavg()
    assert on.utilisation and not off.utilisation, "the switch did not switch"
    ratios = [a[0] / b[0] for a, b in zip(runs[True], runs[False])]
    cpu = {f: statistics.median(c for _, c in runs[f]) for f in runs}
    print(f"{args.rounds} rounds of {args.steps}-step fits, Dense(10) on 2 inputs, batch 8, one CPU device")
    for figures in (True, False):
        sps = [s for s, _ in runs[figures]]
        print(f"  figures {'on ' if figures else 'off'}: {statistics.median(sps):,.0f} steps/s (min {min(sps):,.0f}, "
              f"max {max(sps):,.0f}), main thread {1e6 * cpu[figures]:.1f} us CPU a step")
    print(f"  on/off: steps/s ratio {statistics.median(ratios):.4f} (median of the rounds' ratios; rounds "
          f"{min(ratios):.3f}-{max(ratios):.3f}), CPU a step {cpu[True] / cpu[False]:.4f}")
    print(f"  last on epoch: {on.utilisation[-1]}")
    alone = clock_alone()
    share = alone * statistics.median(s for s, _ in runs[False])
    print(f"  the clock alone (a loop of no work): {1e6 * alone:.2f} us a step, {100 * share:.2f}% of this step "
          "with the figures off")
    print(f"  load average (1, 5, 15 min) before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after: "
          f"{after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
