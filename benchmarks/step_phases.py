"""Where a step's host time goes, phase by phase, for each door of the CPU proxy (``benchmarks/host_proxy.py``).

Each mirrorax door of the proxy runs in a process of its own with the functions of each phase wrapped in a
timer that counts a call's own time (time in a nested timed call counts to that call's phase): the batch's
placement (the transfer), the batch's bookkeeping (a dataset's item read and wrapped, its pieces remembered, a
fit's host batch cut), the held objects (an NNX step's objects matched, checked unchanged, their leaves read
and written back), the dispatch (the compiled program called: JAX's C++ dispatch, and on a CPU host the step's
execution where the client runs it inline), the window's wait for the previous step, and the rest of the
step's Python (the loops and the hooks). The timers cost about 0.3 us a timed call, which the figures include.
On one device of one process (the proxy's) a batch is not placed: its rows go to the step as the host's arrays
and the dispatch transfers them in JAX's C++ (DESIGN.md), so their transfer is the dispatch's and the placement
phase is empty; on several devices, or with ``Trainer(prefetch=k)``, the rows are placed first.

Run: ``python -m benchmarks.step_phases`` (about 1 min), or ``--systems strategy_jit_donated,trainer``. On an
accelerator, ``--workload cnn --batch 32`` times the Flax NNX table's systems (``benchmarks/nnx_loops.py``:
``flax_split_merge``, ``strategy_jit``, ``strategy_jit_loader``, ``trainer``) on its workloads instead, on
the first device; there the window's wait is the host waiting for the device (a device-bound step), and the
rest is what the host spends per step.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

PHASES: dict[str, tuple[str, ...]] = {
    "placement": ("mirrorax.inputs.placement:RowsPlacer.__call__", "mirrorax.inputs.placement:put_rows"),
    "batch bookkeeping": ("mirrorax.inputs.distributed:DistributedDataset._place",
                          "mirrorax.inputs.distributed:_Full.match", "mirrorax.steps.distributed_batch:remember_pieces",
                          "mirrorax.inputs.placement:to_global", "mirrorax.inputs.arrays:ArraySource._batch"),
    "held objects": tuple(f"mirrorax.steps.held:HeldCall.{m}" for m in
                          ("matches", "unchanged", "rest", "read", "fresh", "write", "objects_back")),
    "dispatch": ("mirrorax.steps.dispatch:StrategyFunction.call_fast",
                 "mirrorax.steps.dispatch:StrategyFunction.__call__"),
    "window wait": ("mirrorax.steps.dispatch:wait",),
}
SYSTEMS = ("strategy_jit", "strategy_jit_donated", "strategy_jit_arrays", "strategy_jit_functional", "trainer",
           "keras_trainer", "keras_scope")


class _Timers:
    """Each phase's own time: a timed call's time less that of the timed calls it made."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {p: 0.0 for p in PHASES}
        self._stack: list[list[float]] = []

    def wrap(self, phase: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[0]
                self.total[phase] += spent - frame[1]
                if self._stack:
                    self._stack[-1][1] += spent
        return timed

    def install(self) -> None:
        for phase, targets in PHASES.items():
            for target in targets:
                module_name, _, path = target.partition(":")
                owner: Any = importlib.import_module(module_name)
                *parents, name = path.split(".")
                for p in parents:
                    owner = getattr(owner, p)
                setattr(owner, name, self.wrap(phase, getattr(owner, name)))
        # The Trainer calls its compiled program through the closure StrategyFunction._caller makes.
        from mirrorax.steps import dispatch

        caller = dispatch.StrategyFunction._caller
        dispatch.StrategyFunction._caller = lambda s, jitted: self.wrap("dispatch", caller(s, jitted))  # type: ignore


def one(system: str, steps: int, warmup: int, workload: str = "proxy", batch: int = 0) -> dict[str, Any]:
    if workload == "proxy":
        from benchmarks import host_proxy

        x, y, labels = host_proxy._data(host_proxy.BATCH * max(steps, warmup))
        loop = host_proxy._keras(system, x, labels) if system.startswith("keras") else host_proxy._nnx(system, x, y)
    else:  # the NNX table's system on its workload, on the first device
        import jax

        from benchmarks import nnx_loops

        x, y = nnx_loops.make_data(workload, batch * 256)
        loop = nnx_loops.System(system, workload, x, y, batch, jax.devices()[:1]).call
    timers = _Timers()
    timers.install()
    loop(warmup)
    timers.total = {p: 0.0 for p in PHASES}
    start = time.perf_counter()
    loop(steps)
    total = time.perf_counter() - start
    phases = {p: t / steps * 1e6 for p, t in timers.total.items()}
    phases["other Python"] = total / steps * 1e6 - sum(phases.values())
    return {"system": system, "workload": workload, "batch": batch, "us_per_step": total / steps * 1e6,
            "phases": phases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--workload", default="proxy", help="proxy (the CPU proxy's, default), or guide, cnn, transformer")
    p.add_argument("--batch", type=int, default=32, help="the global batch of --workload (not the proxy's)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="a JSON file for the results")
    args = p.parse_args(argv)
    if args.one:
        os.environ.setdefault("KERAS_BACKEND", "jax")
        print(json.dumps(one(args.one, args.steps, args.warmup, args.workload, args.batch)))
        return 0
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    if args.workload == "proxy":  # the proxy is the CPU's
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    systems = args.systems if args.workload == "proxy" or args.systems != ",".join(SYSTEMS) else \
        "flax_split_merge,strategy_jit,strategy_jit_loader,trainer"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for system in [s for s in systems.split(",") if s]:
        cmd = [sys.executable, "-m", "benchmarks.step_phases", "--one", system, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--workload", args.workload, "--batch", str(args.batch)]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{system} failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  {system}: {rows[-1]['us_per_step']:.0f} us/step", file=sys.stderr, flush=True)
    names = [*PHASES, "other Python"]
    print("| system | " + " | ".join(names) + " | us/step |")
    print("|---|" + "---:|" * (len(names) + 1))
    for r in rows:
        cells = " | ".join(f"{r['phases'][n]:.1f}" for n in names)
        print(f"| {r['system']} | {cells} | {r['us_per_step']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
