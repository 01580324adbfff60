"""What elastic snapshots cost the training loop (issue 48): the CNN benchmark with and without them.

Run from the repository root::

    python -m benchmarks.snapshot_cost                      # 1 and 8 devices, replicated and shard="all"
    python -m benchmarks.snapshot_cost --devices 8 --modes None --rounds 3

The workload is the benchmark's ``cnn`` (``mirrorax.zoo.digits_cnn()``, global batch 256, Adam) trained with
``mx.Trainer(...).fit(x, y, epochs=1, steps_per_epoch=S, shuffle=False)`` under
``MirroredStrategy(shard=mode)``, in these settings, interleaved (their order rotating every round):

* ``off``: no ``MIRRORAX_SNAPSHOT_DIR``: the plain fit;
* ``every step``: ``MIRRORAX_SNAPSHOT_STEPS=1``, a snapshot after every step. The writer thread holds one
  snapshot in hand: the loop then runs no faster than snapshots are written, so the extra time per step is
  the most a snapshot can cost the loop (its dispatch, the copy off the devices, and the writing competing
  for the host): ``cost = (T_every - T_off) / S``;
* ``every 1 s``: ``MIRRORAX_SNAPSHOT_SECONDS=1``, to check that the cost of the clock's schedule is the
  per-snapshot cost times the snapshots taken: ``predicted = cost * snapshots / T_off``.

Besides, every snapshot's time in ``Snapshots.save`` (what the loop waits for: the copy dispatched, a split
state's gather) and the writer thread's CPU time (the copy to the host, the checksums and the write; its
wall time also waits for the step before the copy) are measured. The issue's
figure, the cost at one snapshot every 30 s, is given two ways: ``cost / 30 s`` of the loop's time, and, a
bound that holds on any host, ``(save + write) / 30 s``: as if the whole write stalled the loop, which it
does not where a core is free for the writer (a fit of 30 s measured directly would show either under the
host's noise). A fit's time is from its first step to its last (a callback's clock): its start and end
(the restore look, the final snapshot) are left out. A device count is fixed when JAX starts: each count
runs in its own process (``--child``); the parent prints one markdown table of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"None": None, "all": "all"}
SETTINGS = {"off": {}, "every step": {"MIRRORAX_SNAPSHOT_STEPS": "1"}, "every 1 s": {"MIRRORAX_SNAPSHOT_SECONDS": "1"}}


def _child(devices: int, modes: list[str], rounds: int, steps: int) -> list[dict[str, Any]]:
    import jax
    import keras

    import mirrorax as mx
    from benchmarks import workloads
    from mirrorax.checkpoint import snapshot

    wl = workloads.get("cnn")
    x, y = workloads.make_data(wl, wl.batch * steps)
    taken: list[float] = []
    written: list[float] = []
    real_save, real_write = snapshot.Snapshots.save, snapshot.io.write

    def timed_save(self: Any, *args: Any, **kwargs: Any) -> None:  # the loop's time in a snapshot
        start = time.perf_counter()
        real_save(self, *args, **kwargs)
        taken.append(time.perf_counter() - start)

    def timed_write(*args: Any) -> None:  # the writer thread's CPU (its wall time includes waiting for the step)
        start = time.thread_time()
        real_write(*args)
        written.append(time.thread_time() - start)

    snapshot.Snapshots.save = timed_save  # type: ignore[method-assign]
    snapshot.io.write = timed_write

    class Clock(keras.callbacks.Callback):  # first step to last: a fit's own start and end left out
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == 0:
                self.first = time.perf_counter()
            self.last = time.perf_counter()

    results = []
    for mode in modes:
        keras.utils.set_random_seed(0)
        strategy = mx.MirroredStrategy(jax.devices()[:devices], shard=MODES[mode])
        with strategy.scope():
            model = workloads.build_keras_model(wl)
            model.compile(**workloads.compile_args(wl))
        trainer = mx.Trainer(model, strategy)
        trainer.fit(x, y, batch_size=wl.batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)  # compile
        state_mib = sum(a.nbytes for a in jax.tree.leaves(trainer.state)) / 2**20
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        counts: dict[str, list[int]] = {name: [] for name in SETTINGS}
        blocked: list[float] = []
        writes: list[float] = []
        for r in range(rounds + 1):  # round 0: a warm-up of every setting, not counted
            names = list(SETTINGS)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                where = tempfile.mkdtemp(prefix="snapshot_cost_")
                os.environ.pop(snapshot.DIR_ENV, None)
                for var in (snapshot.STEPS_ENV, snapshot.SECONDS_ENV):
                    os.environ.pop(var, None)
                if SETTINGS[name]:
                    os.environ.update(SETTINGS[name], **{snapshot.DIR_ENV: where})
                clock = Clock()
                taken.clear()
                written.clear()
                trainer.fit(x, y, batch_size=wl.batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
                            callbacks=[clock])
                shutil.rmtree(where, ignore_errors=True)
                if r:
                    times[name].append(clock.last - clock.first)
                    counts[name].append(max(len(taken) - 1, 0))  # (the fit's final snapshot is after its last step)
                    if name == "every step":
                        blocked.extend(taken[:-1])
                        writes.extend(written[:-1])
        off = statistics.median(times["off"])
        every = statistics.median(times["every step"])
        cost = (every - off) / (steps - 1)
        second = statistics.median(times["every 1 s"])
        snaps_1s = statistics.median(counts["every 1 s"])
        save_s, write_s = statistics.median(blocked), statistics.median(writes)
        results.append({"devices": devices, "mode": mode, "state_mib": state_mib, "step_ms": 1e3 * off / (steps - 1),
                        "cost_ms": 1e3 * cost, "blocked_ms": 1e3 * save_s, "write_ms": 1e3 * write_s,
                        "measured_1s": (second - off) / off, "predicted_1s": cost * snaps_1s / off,
                        "at_30s": cost / 30.0, "bound_30s": (save_s + write_s) / 30.0, "rounds": rounds,
                        "steps": steps})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,8")
    parser.add_argument("--modes", default="None,all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.child:
        print("RESULT " + json.dumps(_child(int(args.devices), modes, args.rounds, args.steps)), flush=True)
        return
    rows = []
    for devices in (int(d) for d in args.devices.split(",")):
        env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu", KERAS_BACKEND="jax",
                   PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), REPO, os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-m", "benchmarks.snapshot_cost", "--child", "--devices", str(devices),
                              "--modes", args.modes, "--rounds", str(args.rounds), "--steps", str(args.steps)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"the {devices}-device process failed:\n{out.stdout[-3000:]}")
        rows.extend(json.loads(line[len("RESULT "):]))
    print("| devices | shard | state MiB | step, ms | every step: extra per step, ms | in `save`, ms | writer CPU, "
          "ms | every 1 s: measured / predicted | every 30 s: cost / 30 s | every 30 s: (save + write) / 30 s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['devices']} | {r['mode']} | {r['state_mib']:.2f} | {r['step_ms']:.1f} | {r['cost_ms']:.2f} | "
              f"{r['blocked_ms']:.2f} | {r['write_ms']:.2f} | {100 * r['measured_1s']:.2f}% / "
              f"{100 * r['predicted_1s']:.2f}% | {100 * r['at_30s']:.4f}% | {100 * r['bound_30s']:.4f}% |")


if __name__ == "__main__":
    main()
