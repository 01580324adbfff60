"""What the non-finite guard costs a compiled train step: ``Trainer(on_nonfinite=...)`` modes alternated.

Each mode gets its own model and ``Trainer``; a 2-step ``fit`` compiles its train step and hands over the
program it runs (the one ``StepFunctions.train.flat_program`` returns), its last state and its batch. The
programs are then called directly, the modes alternated in pairs of ``--calls`` steps, so that neither
``fit``'s host work nor the load of the host (which moves a whole ``fit`` by tens of percent on a shared
2-core machine) stands between the two. Prints each mode's wall and CPU time a step per pair, the
quietest pair's and the median's, and the per-pair ratio against the last mode.

Run: ``KERAS_BACKEND=jax python -m benchmarks.guard_cost --workload transformer --devices 1 --pairs 12``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def _programs(box: dict[str, Any]) -> Iterator[None]:
    """While open, every program a ``StrategyFunction`` hands out records its last call in ``box`` (the
    state as the loop keeps it: its leaves)."""
    from mirrorax.steps import dispatch

    real = dispatch.StrategyFunction.flat_program

    def flat_program(self: Any, *args: Any) -> Any:
        compiled, treedef = real(self, *args)

        def call(leaves: Any, tree: Any) -> Any:
            out = compiled(leaves, tree)
            box.update(program=compiled, state=out[0][0], tree=tree)
            return out

        return call, treedef

    dispatch.StrategyFunction.flat_program = flat_program  # type: ignore[method-assign]
    try:
        yield
    finally:
        dispatch.StrategyFunction.flat_program = real  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.guard_cost --workload W --devices N``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices (sets JAX_NUM_CPU_DEVICES)")
    parser.add_argument("--modes", default="raise,ignore", help="on_nonfinite values, comma-separated")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--calls", type=int, default=1, help="steps per timed run")
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if args.devices > 1:
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices))

    import jax

    import mirrorax as mx
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    modes = args.modes.split(",")
    x, y = workloads.make_data(wl, wl.batch * 2)
    runs: dict[str, dict[str, Any]] = {}
    for mode in modes:
        strategy = mx.MirroredStrategy(devices=jax.devices()[:args.devices])
        with strategy.scope():
            model = workloads.build_keras_model(wl)
            model.compile(**workloads.compile_args(wl))
        trainer = mx.Trainer(model, strategy, on_nonfinite=mode)
        box: dict[str, Any] = {"trainer": trainer}
        with _programs(box):
            trainer.fit(x, y, batch_size=wl.batch, epochs=1, steps_per_epoch=2, verbose=0)
        runs[mode] = box

    def steps(box: dict[str, Any], n: int) -> None:
        state = box["state"]
        for _ in range(n):
            (state, aux), _ = box["program"](state, box["tree"])
            jax.block_until_ready(aux)
        box["state"] = state

    for box in runs.values():
        steps(box, 1)
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.pairs):
        for mode in modes:
            t0, c0 = time.perf_counter(), time.process_time()
            steps(runs[mode], args.calls)
            wall[mode].append((time.perf_counter() - t0) / args.calls * 1e3)
            cpu[mode].append((time.process_time() - c0) / args.calls * 1e3)
    base = modes[-1]
    for mode in modes:
        print(f"{mode:>8} wall ms/step: " + " ".join(f"{v:.0f}" for v in wall[mode]))
        print(f"{mode:>8}  cpu ms/step: " + " ".join(f"{v:.0f}" for v in cpu[mode]))
        ratios = [a / b for a, b in zip(wall[mode], wall[base])]
        print(f"{mode:>8} quietest {min(wall[mode]):.0f}, median {statistics.median(wall[mode]):.0f}, "
              f"cpu median {statistics.median(cpu[mode]):.0f} ms; wall / {base} per pair: median "
              f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
