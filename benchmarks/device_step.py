"""The device's own time per step and the compiled step's cost, for Flax's loop and mirrorax's NNX doors.

For each workload of the Flax NNX table (``benchmarks/nnx_loops.py``) at each batch, on the first device:

* **device time per step**: the step's body run ``--inner`` times inside one ``jax.jit`` program
  (``lax.fori_loop`` over Flax's split/merge step on one placed batch), so the host's per-step work is paid once
  per program, not per step: what a step costs the device alone. A loop whose steps/s is below
  ``1 / device time`` is paying for the host;
* **the compiled programs' cost** (``compiled.cost_analysis()``: FLOPs, bytes accessed) of Flax's loop's
  step and of ``@strategy.jit``'s (the same step, donated, as the NNX table runs it): more FLOPs or bytes in
  mirrorax's program would be device work a step adds;
* **a loop over placed batches**: Flax's loop fed batches already on the device, steps/s: the host's dispatch
  floor for that program (no transfer per step).

Run: ``python -m benchmarks.device_step --workloads cnn,transformer,guide --batches 32,256`` (about a minute
on one TPU v5e); prints a markdown table, ``--out`` a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def measure(workload: str, batch: int, inner: int, steps: int) -> dict[str, Any]:
    import jax
    from flax import nnx

    import mirrorax as mx
    from benchmarks import nnx_loops

    device = jax.devices()[0]
    x, y = nnx_loops.make_data(workload, batch)
    model, optimizer, metrics = nnx_loops.objects(workload)
    graphdef, state = nnx.split((model, optimizer, metrics))
    flax_step = nnx_loops.flax_loop_step(graphdef, nnx_loops.train_step)
    host_batch = (x, y)
    flax_cost = _cost(flax_step.lower(state, host_batch).compile())

    # Device time: `inner` steps in one program, the batch placed once.
    placed = jax.device_put(host_batch, device)

    @jax.jit
    def many(state: Any, batch: Any) -> Any:
        def body(_: int, state: Any) -> Any:
            model, optimizer, metrics = nnx.merge(graphdef, state)
            nnx_loops.train_step(model, optimizer, metrics, *batch)
            return nnx.state((model, optimizer, metrics))
        return jax.lax.fori_loop(0, inner, body, state)

    state = jax.device_put(state, device)
    state = jax.block_until_ready(many(state, placed))  # compile
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        state = jax.block_until_ready(many(state, placed))
        times.append(time.perf_counter() - t0)
    device_s = min(times) / inner

    # Flax's loop over placed batches: the host's dispatch floor for this program.
    box = [jax.block_until_ready(flax_step(state, placed))]
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            box[0] = flax_step(box[0], placed)
        jax.block_until_ready(box[0])
        rates.append(steps / (time.perf_counter() - t0))

    # @strategy.jit's program, as the NNX table runs it (donated, over a distributed batch).
    model, optimizer, metrics = nnx_loops.objects(workload)
    strategy = mx.MirroredStrategy(devices=[device])
    step = strategy.jit(nnx_loops.train_step, donate_argnums=(0, 1, 2))
    xb, yb = next(iter(strategy.experimental_distribute_dataset((x, y), batch_size=batch)))
    sjit_cost = _cost(step.lower(model, optimizer, metrics, xb, yb).compile())
    return {"workload": workload, "batch": batch, "device_kind": device.device_kind, "inner": inner,
            "device_us_per_step": device_s * 1e6, "placed_loop_steps_per_s": max(rates),
            "flax_cost": flax_cost, "strategy_jit_cost": sjit_cost}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | batch | device us/step | 1 / device time (steps/s) | Flax's loop, placed batches (steps/s) "
             "| GFLOP/step Flax / @strategy.jit | MB accessed/step Flax / @strategy.jit |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f, s = r["flax_cost"], r["strategy_jit_cost"]
        lines.append(f"| {r['workload']} | {r['batch']} | {r['device_us_per_step']:.1f} | "
                     f"{1e6 / r['device_us_per_step']:,.0f} | {r['placed_loop_steps_per_s']:,.0f} | "
                     f"{f['flops'] / 1e9:.3f} / {s['flops'] / 1e9:.3f} | "
                     f"{f['bytes'] / 1e6:.2f} / {s['bytes'] / 1e6:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="cnn,transformer,guide")
    p.add_argument("--batches", default="32,256")
    p.add_argument("--inner", type=int, default=200, help="steps in the one program that times the device")
    p.add_argument("--steps", type=int, default=1000, help="steps of the loop over placed batches")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    rows: list[dict[str, Any]] = []
    for w in [w for w in args.workloads.split(",") if w]:
        for b in [int(b) for b in args.batches.split(",") if b]:
            rows.append(measure(w, b, args.inner, args.steps))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)  # (a run cut short keeps what it measured)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    print("\n" + markdown(rows))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
