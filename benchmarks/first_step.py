"""Time to first step: from the ``model.fit(...)`` call to its first step's completion, mirrorax against Keras.

mirrorax: ``model.fit`` of a model built and compiled under ``mx.MirroredStrategy(devices=...).scope()``;
Keras: plain ``model.fit`` (``keras.distribution.DataParallel`` at N > 1 devices), on the same model, data
and global batch. Everything the call does before its first step is timed (the inputs' checks, the state
placed on the devices, the plan, the step's trace and compile); the model's build and ``compile()`` are
not. Both stop at the same mark: a callback's ``on_train_batch_end`` at batch 0 reads ``logs["loss"]`` as
a float (which waits for the step) and takes the time.

Each measurement is a fresh process (JAX's and Keras's caches empty, as a user's first ``fit``); the two
systems alternate within each round (ABBA over the rounds), and the figures are medians over the rounds,
with the median of the per-round ratios. Wall time and the process's CPU time (all threads) are both
reported: on a shared host, CPU time is the less disturbed of the two.

Run: ``python -m benchmarks.first_step --devices 1,8 --rounds 7`` (about a minute per round on 2 cores);
``--profile`` prints where mirrorax's time goes (one process, cProfile, top functions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SYSTEMS = ("mirrorax", "keras")


def child(system: str, devices: int, workload: str, profile: bool) -> dict[str, Any]:
    """One measurement in this (fresh) process: build, compile, then time ``fit`` to its first step."""
    os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras

    from benchmarks import workloads

    wl = workloads.get(workload)
    devs = jax.devices()[:devices]
    if system == "mirrorax":
        import mirrorax as mx

        with mx.MirroredStrategy(devices=devs).scope():
            model = workloads.build_keras_model(wl)
            model.compile(**workloads.compile_args(wl))
    else:
        if devices > 1:
            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devs))
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl))
    x, y = workloads.make_data(wl, wl.batch * 4, seed=0)
    mark: dict[str, float] = {}

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == 0:
                float(logs["loss"])  # waits for the step's outputs
                mark["wall"], mark["cpu"] = time.perf_counter(), time.process_time()
                self.model.stop_training = True

    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=wl.batch, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0,
              callbacks=[FirstStep()])
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    return {"system": system, "devices": devices, "wall": mark["wall"] - t0, "cpu": mark["cpu"] - c0}


def measure(system: str, devices: int, workload: str) -> dict[str, Any]:
    """Runs :func:`child` in a fresh process and returns its result."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-m", "benchmarks.first_step", "--child", system, "--devices",
                          str(devices), "--workload", workload], capture_output=True, text=True, env=env,
                         timeout=600, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{system} at {devices} device(s) failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="1,8", help="device counts, comma-separated (default 1,8)")
    p.add_argument("--rounds", type=int, default=7, help="fresh processes per system and device count")
    p.add_argument("--workload", default="cnn", help="a workload of benchmarks/workloads.py (default cnn)")
    p.add_argument("--profile", action="store_true", help="profile one mirrorax process instead")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    counts = [int(n) for n in args.devices.split(",")]
    if args.child or args.profile:
        print(json.dumps(child(args.child or "mirrorax", counts[0], args.workload, args.profile)))
        return
    for n in counts:
        got: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in SYSTEMS}
        for r in range(args.rounds):
            for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                res = measure(system, n, args.workload)
                for k in ("wall", "cpu"):
                    got[system][k].append(res[k])
        print(f"{args.workload}, {n} device(s), {args.rounds} fresh processes each, time to first step (s):")
        for k in ("wall", "cpu"):
            mine, theirs = got["mirrorax"][k], got["keras"][k]
            ratios = [m / t for m, t in zip(mine, theirs)]
            print(f"  {k:4}: mirrorax {statistics.median(mine):.3f} (" + " ".join(f"{v:.2f}" for v in mine) + "), "
                  f"keras {statistics.median(theirs):.3f} (" + " ".join(f"{v:.2f}" for v in theirs) + "); "
                  f"mirrorax / keras: median of rounds {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
