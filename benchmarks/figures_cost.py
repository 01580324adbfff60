"""What each epoch's figures cost (MFU, device busy, input wait: ``mirrorax.fit.meter``): steps/s with them on
against off (``MIRRORAX_FIGURES=0``).

The figures are a few clock reads a dispatch and a step timed on idle devices at dispatch 2, 5, 11, 23, ... of
an epoch; the worst case is the step with nothing but host work, where every microsecond of the host shows.
So, by default: Keras's ``Dense(10)`` on 2 inputs at a global batch of 8 on one CPU device (``--inputs 784
--hidden 512 --batch 256``: an MLP step with some device work). One trainer in one process fits one epoch of
``--steps`` steps three ways a round, figures off, on, and off again, the order reversed every other round, over
``--rounds`` rounds after a warm-up round; the fits of a round run back to back, so the host's drift (this VM's
speed moves by up to 2x between minutes) moves them together. Reported: the median steps/s of each, the median of
the rounds' on/off ratios, and beside it the same of off-again/off (two runs of the same code: the A/A, what
this host can tell apart), the main thread's CPU time per step, the machine's load average before and after;
then the clock's own cost in a loop of no work (its hooks and its wrapper around the batches, for the loop's two
ways of placing: one step a dispatch on the loop's thread, and stacked or placed ahead on a thread), which the
noise of a shared host cannot hide.

Run: ``python -m benchmarks.figures_cost`` (about a minute), ``--rounds 60`` for a longer look.
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


def _trainer(inputs: int, hidden: int) -> Any:
    import jax
    import keras

    import mirrorax as mx

    keras.utils.set_random_seed(0)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
    layers = [keras.layers.Dense(hidden, activation="relu")] if hidden else []
    with strategy.scope():
        model = keras.Sequential([keras.Input((inputs,)), *layers, keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return mx.Trainer(model, strategy)


def _fit(trainer: Any, x: Any, y: Any, batch: int, figures: bool) -> tuple[float, float]:
    """One fit of one epoch: (steps/s, the main thread's CPU seconds per step)."""
    import jax

    os.environ["MIRRORAX_FIGURES"] = "1" if figures else "0"  # read as each fit starts
    wall, cpu = time.perf_counter(), time.thread_time()
    trainer.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    jax.block_until_ready(trainer.state)
    steps = len(x) // batch
    return steps / (time.perf_counter() - wall), (time.thread_time() - cpu) / steps


def clock_alone(steps: int = 200_000) -> dict[str, float]:
    """The epoch's clock without a step: seconds a step that ``EpochMeter``'s hooks and its wrapper around the
    batches add to a loop of no work (the same loop without them subtracted), the median of 7 runs; for the
    loop's two ways of placing: ``"one_by_one"`` (one step a dispatch on the loop's thread: fit's common case)
    and ``"wrapped"`` (stacked batches or a placing thread: the input's reads and the placed batches timed)."""
    import types

    from mirrorax.fit.epoch import EpochRun
    from mirrorax.fit.meter import EpochMeter, FitMeter
    from mirrorax.steps.dispatch import InFlight

    device = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    strategy = types.SimpleNamespace(devices=[device], is_primary=True, process_count=1)
    owner = type("Model", (), {})()  # what the records are kept for

    def place(batch: Any) -> Any:
        return batch

    def loop(way: str, metered: bool) -> float:
        fit = FitMeter(owner, strategy, None, steps_per_execution=1, auto=False, prefetch=0, source=None, epochs=1)
        run = EpochRun(None, InFlight(2))
        meter = EpochMeter(fit, run, 0)
        meter.probe_at = ()  # (a probe waits for a step: there is none here)
        fit.note_batch = lambda *a: None  # type: ignore[method-assign]
        items = (None for _ in range(steps + 1))
        if way == "one_by_one":  # inputs.prefetch.device_batches' own generator, or the meter's in its place
            placed = meter.one_by_one(items, place) if metered else ((0, place(b)) for b in items)
        else:
            placed = ((0, place(b)) for b in (meter.reading(items) if metered else items))
            placed = meter.placing(placed) if metered else placed
        start = time.perf_counter()
        for _ in range(steps):
            if metered:
                meter.before_step(run)
            next(placed, None)
            run.before, run.steps = run.steps, run.steps + 1
            if metered:
                meter.after_step(run)
        return (time.perf_counter() - start) / steps

    return {way: statistics.median(loop(way, True) - loop(way, False) for _ in range(7))
            for way in ("one_by_one", "wrapped")}


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inputs", type=int, default=2)
    p.add_argument("--hidden", type=int, default=0, help="a hidden layer's width (0: none)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--clock-steps", type=int, default=200_000, help="steps of the loop of no work")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, args.inputs)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    trainer = _trainer(args.inputs, args.hidden)
    kinds = ("off", "on", "off again")
    for kind in kinds:  # warm-up: the compile, the first epoch's probes
        _fit(trainer, x, y, args.batch, kind == "on")
    load = os.getloadavg()
    runs: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    records: dict[str, list[Any]] = {}
    for r in range(args.rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            runs[kind].append(_fit(trainer, x, y, args.batch, kind == "on"))
            records[kind] = list(trainer.utilisation)
    after = os.getloadavg()
    assert records["on"] and not records["off"], "the switch did not switch"

    def ratio(kind: str) -> tuple[float, float, float]:
        rs = [a[0] / b[0] for a, b in zip(runs[kind], runs["off"])]
        return statistics.median(rs), min(rs), max(rs)

    cpu = {kind: statistics.median(c for _, c in runs[kind]) for kind in kinds}
    model = f"Dense({args.hidden}, relu) then " if args.hidden else ""
    print(f"{args.rounds} rounds of {args.steps}-step fits, {model}Dense(10) on {args.inputs} inputs, batch "
          f"{args.batch}, one CPU device")
    for kind in kinds:
        sps = [s for s, _ in runs[kind]]
        print(f"  figures {kind:9s}: {statistics.median(sps):,.0f} steps/s (min {min(sps):,.0f}, max {max(sps):,.0f}), "
              f"main thread {1e6 * cpu[kind]:.1f} us CPU a step")
    for kind, what in (("on", "on/off"), ("off again", "off again/off (the A/A: the same code twice)")):
        med, lo, hi = ratio(kind)
        print(f"  {what}: steps/s {med:.4f} (median of the rounds' ratios; rounds {lo:.3f}-{hi:.3f}), CPU a step "
              f"{cpu[kind] / cpu['off']:.4f}")
    print(f"  last epoch with the figures: {records['on'][-1]}")
    alone = clock_alone(args.clock_steps)
    step = 1 / statistics.median(s for s, _ in runs["off"])
    for way, seconds in alone.items():
        print(f"  the clock alone ({way}; a loop of no work): {1e6 * seconds:.2f} us a step, "
              f"{100 * seconds / step:.2f}% of this step with the figures off")
    print(f"  load average (1, 5, 15 min) before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after: "
          f"{after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
