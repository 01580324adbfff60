"""Is the device busy, or waiting for the host? Each system's steps on a timeline (one profiled chunk each).

For each system of ``benchmarks.accelerator`` (built the same way, on one device), after a warm-up: two
unprofiled chunks of ``--steps`` steps (their seconds), then one chunk under ``jax.profiler`` with a
Perfetto trace, read back here. Printed per system, per step: the step program's time on the device
(``XLA Modules`` events of the device's trace), the device's idle time between two steps, and the host's
time in the call that launches a step (the jitted function's call on the Python thread). A device idle
between steps for about as long as it computes one means the loop is bound by the host: there a faster
program changes nothing and every microsecond of host work per step shows in samples/s.

    python -m benchmarks.step_timeline --workload transformer --systems jax,mirrorax,keras_scope --steps 300
    python -m benchmarks.step_timeline --workload transformer --rounds 4   # with the per-step ratios first

``--rounds R``: before the profiles, R rounds of one ``--round-steps``-step chunk per system, the systems in
alternating order (ABBA), as ``benchmarks.accelerator`` times them; printed per system: the median chunk
and the median of per-round ratios to the first system's (the hand loop's, by default).

The host's times include the Python profiler's own cost (every Python call is traced); compare systems
with each other, not with unprofiled chunks. On a CPU backend the device rows are absent (the CPU client
has no device timeline); the host rows are there.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.tpu_compile import STEP_PROGRAM  # noqa: E402  (each system's step program, by name)

# Patterns of the names the systems' step programs carry (jax.jit's module and function names).
STEP_NAMES = tuple(sorted(set(STEP_PROGRAM.values())))


def summarize(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per timeline (``"<process> | <thread>"``) holding one event per step: the steps' durations and the
    gaps between them, in microseconds (medians and means), from a Chrome/Perfetto trace's events.

    A timeline counts when it has complete events (``"ph": "X"``) named after a step program
    (a pattern of :data:`STEP_NAMES`, ``tpu_compile.STEP_PROGRAM``'s); the device's ``XLA Modules`` timeline
    has one per step, the host's Python thread one per jitted call. Events nested in a longer one of the
    same name (a C++ call traced inside the Python call) are dropped, so that each step counts once.
    """
    names: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            tid = e.get("tid") if e["name"] == "thread_name" else None
            names[(e.get("pid"), tid)] = str(e.get("args", {}).get("name", ""))
    lines: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and any(re.search(p, str(e.get("name", ""))) for p in STEP_NAMES):
            pid, tid = e.get("pid"), e.get("tid")
            where = f"{names.get((pid, None), pid)} | {names.get((pid, tid), tid)}"
            lines[where].append(e)
    out = {}
    for where, es in lines.items():
        es.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        outer: list[dict[str, Any]] = []
        for e in es:
            if outer and e["ts"] < outer[-1]["ts"] + outer[-1].get("dur", 0):
                continue  # inside the previous step's event
            outer.append(e)
        durs = [float(e.get("dur", 0)) for e in outer]
        gaps = [b["ts"] - (a["ts"] + a.get("dur", 0)) for a, b in zip(outer, outer[1:])]
        out[where] = {"steps": len(outer), "busy_median_us": statistics.median(durs),
                      "busy_mean_us": statistics.mean(durs),
                      "gap_median_us": statistics.median(gaps) if gaps else 0.0,
                      "gap_mean_us": statistics.mean(gaps) if gaps else 0.0,
                      "span_ms": (outer[-1]["ts"] + outer[-1].get("dur", 0) - outer[0]["ts"]) / 1e3}
    return out


def read_trace(directory: str) -> list[dict[str, Any]]:
    """The events of the newest Perfetto trace ``jax.profiler`` wrote under ``directory``."""
    found = sorted(glob.glob(os.path.join(directory, "**", "*perfetto_trace.json.gz"), recursive=True))
    if not found:
        raise FileNotFoundError(f"jax.profiler wrote no *perfetto_trace.json.gz under {directory}.")
    with gzip.open(found[-1]) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def measure(workload: str, systems: list[str], steps: int, out: str | None = None, *, rounds: int = 0,
            round_steps: int = 1000) -> dict[str, Any]:
    """Builds each system on one device, warms it up, times ``rounds`` interleaved rounds of
    ``round_steps``-step chunks (none by default), then per system two chunks and a profiled third."""
    import jax
    import keras

    from benchmarks import accelerator as acc
    from benchmarks import workloads

    wl = workloads.get(workload)
    plan = acc.PLANS[workload]
    if plan.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    devices = jax.devices()[:1]
    x, y = workloads.make_data(wl, wl.batch * max(steps, plan.warmup, round_steps if rounds else 0))
    acc._process_warmup(devices)
    runners = {s: acc.build(s, wl, x, y, devices) for s in systems}
    for runner in runners.values():
        runner.call(1)
        runner.call(plan.warmup)
    results: dict[str, Any] = {s: {} for s in systems}
    if rounds:
        timed: dict[str, list[float]] = {s: [] for s in systems}
        for r in range(rounds):
            for s in systems if r % 2 == 0 else systems[::-1]:
                t0 = time.perf_counter()
                runners[s].call(round_steps)
                timed[s].append(time.perf_counter() - t0)
        ref = timed[systems[0]]
        for s in systems:
            ratios = [a / b for a, b in zip(ref, timed[s])]
            results[s].update(rounds_s=timed[s], round_steps=round_steps, ratio_to_first=statistics.median(ratios))
            print(f"{workload} {s}: {1e3 * statistics.median(timed[s]) / round_steps:.4f} ms a step over {rounds} "
                  f"rounds of {round_steps} steps; / {systems[0]}: {statistics.median(ratios):.4f} (per round "
                  + " ".join(f"{v:.3f}" for v in ratios) + ")", flush=True)
    for s, runner in runners.items():
        chunks = []
        for _ in range(2):
            t0 = time.perf_counter()
            runner.call(steps)
            chunks.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d, create_perfetto_trace=True)
            t0 = time.perf_counter()
            runner.call(steps)
            profiled = time.perf_counter() - t0
            jax.profiler.stop_trace()
            lines = summarize(read_trace(d))
        results[s].update(chunk_s=chunks, profiled_chunk_s=profiled, timelines=lines)
        print(f"{workload} {s}: {steps} steps in {min(chunks):.4f} s ({1e3 * min(chunks) / steps:.3f} ms a step), "
              f"profiled {profiled:.4f} s", flush=True)
        for where, v in lines.items():
            print(f"  {where}: {v['steps']} steps, busy {v['busy_median_us']:.1f} us, "
                  f"idle between steps {v['gap_median_us']:.1f} us (medians)", flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"workload": workload, "steps": steps, "device_kind": devices[0].device_kind,
                       "systems": results}, f, indent=1)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="transformer")
    p.add_argument("--systems", default="jax,mirrorax,keras_scope,guide_api")
    p.add_argument("--steps", type=int, default=300, help="steps per chunk (one fit call)")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds of unprofiled chunks first (default 0)")
    p.add_argument("--round-steps", type=int, default=1000, help="steps per chunk of those rounds (default 1000)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    measure(args.workload, args.systems.split(","), args.steps, args.out, rounds=args.rounds,
            round_steps=args.round_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
