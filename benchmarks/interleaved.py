"""An entry point of mirrorax against the hand-written loop, alternated in one process.

The harness (``benchmarks.run``) runs each system in its own process, which is the fair default; but on a
shared host whose speed drifts by 10-20% over minutes (measured here: the hand-written loop alone took
9.7-11.3 s per 100 CNN steps in one process), process-against-process ratios of a few percent are
within that drift. This script removes it: both loops live in one process (same data, same model
definition, each its own weights and optimizer) and alternate in short chunks (ABBA order), so drift
hits both alike; the ratio is taken per pair.

Each chunk of mirrorax's side is one whole ``fit`` call, its set-up included (the inputs' checks, the
source, the callbacks): the per-fit host work is in every chunk, in proportion to the chunk's steps.
``--steps`` is also the data's length in batches, so a chunk is one epoch over ``steps x batch`` rows:
``--workload mlp --steps 234 --pairs 6`` is the issue's measurement (one epoch of 59,904 rows per ``fit``).
Wall and CPU time (this process, all threads: less hit by other load on a shared host) are both
reported, as ratios per pair.

Run: ``python -m benchmarks.interleaved --workload cnn --devices 1`` (about 2 minutes for the CNN);
``--entry`` picks mirrorax's side: ``scope`` (``model.fit`` under the strategy's scope, the default),
``trainer`` (``mx.Trainer(model, strategy).fit``, its non-finite guard on) or ``guide`` (the keras.io
guide's loop on ``strategy.jit``, ``benchmarks/peers/guide_api.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any


def alternate(a: Any, b: Any, pairs: int, steps: int) -> tuple[tuple[list[float], list[float]], ...]:
    """Runs ``a(steps)`` and ``b(steps)`` ``pairs`` times each, alternating which goes first (ABBA), and
    returns ``((wall, cpu), (wall, cpu))`` seconds per chunk of ``a`` and of ``b``; the CPU time is this
    process's (all threads), less hit by other load than the wall time."""
    wall: dict[Any, list[float]] = {a: [], b: []}
    cpu: dict[Any, list[float]] = {a: [], b: []}
    for i in range(pairs):
        for f in (a, b) if i % 2 == 0 else (b, a):
            t0, c0 = time.perf_counter(), time.process_time()
            f(steps)
            wall[f].append(time.perf_counter() - t0)
            cpu[f].append(time.process_time() - c0)
    return (wall[a], cpu[a]), (wall[b], cpu[b])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="cnn", help="mlp or cnn (default cnn)")
    p.add_argument("--devices", type=int, default=1, help="simulated CPU devices (default 1)")
    p.add_argument("--steps", type=int, default=30, help="steps per chunk (default 30)")
    p.add_argument("--pairs", type=int, default=14, help="chunks of each loop (default 14)")
    p.add_argument("--entry", choices=("scope", "trainer", "guide"), default="scope",
                   help="model.fit under the strategy's scope (default), mx.Trainer(model).fit, or the "
                        "keras.io guide's loop on strategy.jit")
    args = p.parse_args(argv)
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax

    import mirrorax as mx
    from benchmarks import workloads
    from benchmarks.peers.guide_api import GuideLoop
    from benchmarks.peers.jax_loop import HandLoop

    wl = workloads.get(args.workload)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:args.devices])
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl))
    x, y = workloads.make_data(wl, wl.batch * args.steps, seed=0)

    trained = mx.Trainer(model, strategy) if args.entry == "trainer" else model
    label = {"scope": "model.fit under scope", "trainer": "Trainer.fit", "guide": "guide loop"}[args.entry]
    guide = GuideLoop(workloads.build_keras_model(wl), workloads.compile_args(wl)["optimizer"], strategy, x, y,
                      wl.batch) if args.entry == "guide" else None

    def fit(n: int) -> None:
        if guide is not None:
            guide.steps(n)
            return
        trained.fit(x, y, batch_size=wl.batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
        jax.block_until_ready(trained.state if args.entry == "trainer" else
                              [v.value for v in model.trainable_variables])

    # The hand-written loop of benchmarks/peers/jax_loop.py: donated replicated state, the next batch
    # placed while the step runs, at most 2 steps in flight.
    spec = workloads.compile_args(wl)
    batches = [(x[i:i + wl.batch], y[i:i + wl.batch]) for i in range(0, len(x), wl.batch)]
    hand = HandLoop(workloads.build_keras_model(wl), spec["optimizer"], spec["loss"], strategy.mesh, batches,
                    axis=strategy.batch_axis).steps

    fit(3)
    hand(3)  # compile both
    (fits, fit_cpu), (hands, hand_cpu) = alternate(fit, hand, args.pairs, args.steps)
    ratios = [h / f for f, h in zip(fits, hands)]
    cpu_ratios = [h / f for f, h in zip(fit_cpu, hand_cpu)]
    print(f"{args.workload}, {args.devices} device(s), {args.pairs} pairs of {args.steps} steps, "
          f"global batch {wl.batch}")
    print(f"{label + ',':22} s per chunk:", " ".join(f"{t:.2f}" for t in fits))
    print(f"{'hand-written loop,':22} s per chunk:", " ".join(f"{t:.2f}" for t in hands))
    print(f"speed, {label} / hand-written: median of pairs {statistics.median(ratios):.3f}, "
          f"total {sum(hands) / sum(fits):.3f}")
    print(f"CPU time, hand-written / {label}: median of pairs {statistics.median(cpu_ratios):.3f}, "
          f"total {sum(hand_cpu) / sum(fit_cpu):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
