"""The one benchmark command: every workload x system x device count, interleaved, as a table and a plot.

Run from the repository root::

    python -m benchmarks.run                      # full run (about 35-40 min on 2 CPU cores)
    python -m benchmarks.run --quick              # a few minutes: fewer steps, one round
    python -m benchmarks.run --workloads mlp,cnn --devices 1,2,4,8 --systems mirrorax,jax,keras_fit,tf,torch

Each measurement is its own process (``python -m benchmarks.peers.<module> ...``) because a backend's
device count is fixed when it starts. Systems are run round-robin at each device count and the rounds
repeat over the whole workload (the order rotating each round), so machine drift hits every system alike.
A process does a warm-up (compilation) and ``--repeats`` timed runs; the table gives the median over every
timed run of every round, its min-max, the speed ratio ``mirrorax / system``, the peak RSS and the
status: ``ok``, ``abort`` (killed by a signal, e.g. XLA's "Expected N threads to join the rendezvous"),
``error`` or ``timeout``. A system that failed is not run again at that device count (``--retry-failed``).

Writes ``<out>/results.md``, ``<out>/results.png``, ``<out>/results.json`` and a log per process under
``<out>/logs/``; ``<out>`` defaults to ``benchmarks/results/<UTC time>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run.py` works too
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import report, workloads  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class System:
    """A system the harness can time.

    Attributes:
      name: the ``--systems`` name.
      module: the process to run (``python -m <module>``).
      label: the name in tables and plots.
      requires: a module that must be importable, else the system is skipped.
      install: how to install it (shown when skipped).
    """

    name: str
    module: str
    label: str
    requires: str
    install: str = ""


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("mirrorax", "benchmarks.peers.mirrorax_trainer", "mirrorax Trainer.fit", "mirrorax",
           "pip install -e ."),
    System("mirrorax_optimizer", "benchmarks.peers.mirrorax_optimizer", "mirrorax Trainer.fit, shard='optimizer'",
           "mirrorax", "pip install -e ."),
    System("mirrorax_all", "benchmarks.peers.mirrorax_all", "mirrorax Trainer.fit, shard='all'", "mirrorax",
           "pip install -e ."),
    System("keras_scope", "benchmarks.peers.keras_scope", "mirrorax: model.fit under strategy.scope()", "mirrorax",
           "pip install -e ."),
    System("guide_api", "benchmarks.peers.guide_api", "mirrorax: keras.io guide loop on strategy.jit", "mirrorax",
           "pip install -e ."),
    System("jax", "benchmarks.peers.jax_loop", "hand-written JAX loop", "jax"),
    System("keras_fit", "benchmarks.peers.keras_fit", "Keras 3 model.fit (DataParallel)", "keras"),
    System("tf", "benchmarks.peers.tf_mirrored", "tf.distribute.MirroredStrategy", "tensorflow",
           "pip install tensorflow-cpu"),
    System("torch", "benchmarks.peers.torch_ddp", "PyTorch DDP (gloo)", "torch", "pip install torch==2.13.0"),
)}
"""The systems by ``--systems`` name, in table order."""

_RENDEZVOUS = re.compile(r"Expected \d+ threads to join the rendezvous[^\n]*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="mlp,cnn,transformer",
                   help="comma-separated: mlp,cnn,transformer (or a,b,c); default all")
    p.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts; default 1,2,4,8")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated among {','.join(SYSTEMS)}")
    p.add_argument("--rounds", type=int, default=None, help="processes per (workload, devices, system); "
                   "default per workload (mlp, cnn 2; transformer 1; 1 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per process; default 3 (2 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per timed run (default per workload)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default per workload)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default per workload)")
    p.add_argument("--bf16", action="store_true", help="mixed bfloat16 precision (every system)")
    p.add_argument("--steps-per-execution", type=int, default=1,
                   help="passed to mirrorax's Trainer (only mirrorax; default 1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per process (default per workload)")
    p.add_argument("--quick", action="store_true", help="fewer steps, rounds and repeats (a few minutes)")
    p.add_argument("--retry-failed", action="store_true", help="run a failed system again in later rounds")
    p.add_argument("--idle-wait", type=float, default=20.0,
                   help="before each process, wait up to this many seconds for the host to be < 25%% busy "
                        "(other work skews the numbers; after a wait in vain, only until it is seen idle "
                        "again); 0 disables")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results/<UTC time>)")
    args = p.parse_args(argv)
    try:
        args.workloads = [workloads.get(w.strip()).name for w in args.workloads.split(",") if w.strip()]
        args.devices = sorted({int(d) for d in args.devices.split(",") if d.strip()})
    except ValueError as e:
        p.error(str(e))
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; expected among {list(SYSTEMS)}")
    if any(d < 1 for d in args.devices):
        p.error(f"--devices must be positive; received {args.devices}")
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.out is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        args.out = os.path.join(REPO, "benchmarks", "results", stamp)
    return args


def available(system: System) -> str | None:
    """``None`` if the system can run here, else why not (with the install command)."""
    if importlib.util.find_spec(system.requires) is None:
        hint = f" ({system.install})" if system.install else ""
        return f"skipped: {system.requires} not installed{hint}"
    return None


def _cpu_times() -> tuple[float, float]:
    """``(total, busy)`` CPU seconds of the whole host so far, summed over cores (``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:8]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    return sum(fields) / hz, (sum(fields) - fields[3] - fields[4]) / hz


def _cpu_busy(interval: float = 0.5) -> float:
    """The share of the host's CPU time spent busy over the next ``interval`` seconds."""
    t0, b0 = _cpu_times()
    time.sleep(interval)
    t1, b1 = _cpu_times()
    return (b1 - b0) / max(t1 - t0, 1e-9)


def wait_idle(threshold: float, limit_s: float) -> float:
    """Waits (up to ``limit_s``) until the host is less than ``threshold`` busy; returns the last reading.

    Other work on the machine (a test suite, a build) slows whichever system runs beside it, and on
    a few cores that swamps the differences being measured.
    """
    start = time.monotonic()
    busy = _cpu_busy()
    while busy > threshold and time.monotonic() - start < limit_s:
        busy = _cpu_busy(2.0)
    return busy


def run_one(cmd: list[str], log_path: str, json_path: str, timeout: float) -> dict[str, Any]:
    """Runs one measurement process; returns its result, or a failure record.

    The process runs in a session of its own, so a timeout kills its children too (PyTorch's ranks);
    its peak RSS comes from ``wait4`` when the process could not report one itself.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    start = time.monotonic()
    cpu0 = _cpu_times()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    cpu1 = _cpu_times()
    # CPU time the rest of the host used meanwhile (busy time not spent by this process or its children).
    others = (cpu1[1] - cpu0[1]) - (usage.ru_utime + usage.ru_stime)
    result: dict[str, Any] = {}
    if os.path.exists(json_path):
        with open(json_path) as f:
            result = json.load(f)
    result.setdefault("peak_rss_mb", usage.ru_maxrss / 1024.0)
    result["rc"], result["wall_s"], result["log"] = rc, round(wall, 2), os.path.relpath(log_path, REPO)
    result["other_load"] = round(max(others, 0.0) / max(cpu1[0] - cpu0[0], 1e-9), 3)
    if timed_out:
        result.update(status="timeout", note=f"killed after {timeout:.0f} s")
    elif rc != 0 and result.get("status", "ok") == "ok":
        with open(log_path, errors="replace") as f:
            text = f.read()
        found = _RENDEZVOUS.search(text)
        why = found.group(0) if found else (text.strip().splitlines() or ["(no output)"])[-1][:300]
        kind = "abort" if rc < 0 or rc == 134 else "error"
        sig = f"signal {-rc}" if rc < 0 else f"rc {rc}"
        result.update(status=kind, note=f"{sig}: {why}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status (0 unless nothing could run)."""
    args = parse_args(argv)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    skipped: dict[str, str] = {}
    systems = []
    for name in args.systems:
        why = available(SYSTEMS[name])
        if why:
            skipped[name] = why
            print(f"{name}: {why}", flush=True)
        else:
            systems.append(name)
    plan = []
    for w in args.workloads:
        wl = workloads.get(w)
        rounds = args.rounds or (1 if args.quick else wl.rounds)
        for r in range(rounds):
            for i, n in enumerate(args.devices):
                k = (r + i) % max(len(systems), 1)
                for s in systems[k:] + systems[:k]:
                    plan.append((wl, r, n, s))
    print(f"{len(plan)} runs: workloads {args.workloads}, devices {args.devices}, systems {systems}, "
          f"{args.rounds or 'per-workload'} round(s) x {args.repeats} timed run(s); output {args.out}", flush=True)

    runs: list[dict[str, Any]] = []
    failed: set[tuple[str, int, str]] = set()
    host_was_idle = True
    t_start = time.monotonic()
    for idx, (wl, r, n, s) in enumerate(plan, 1):
        if (wl.name, n, s) in failed and not args.retry_failed:
            continue
        steps = args.steps or (wl.quick_steps if args.quick else wl.steps)
        warmup = wl.warmup if args.warmup is None else args.warmup
        batch = args.batch or wl.batch
        stem = f"{wl.name}_{s}_{n}dev_r{r}"
        json_path = os.path.join(args.out, "logs", stem + ".json")
        # (the timed steps: --steps, else the workload's, which a peer on an accelerator raises to its
        # accel_steps: a few steps there time a fit call's set-up, not its steps)
        cmd = [sys.executable, "-m", SYSTEMS[s].module, "--workload", wl.name, "--devices", str(n),
               *(["--steps", str(args.steps)] if args.steps else ["--quick"] if args.quick else []),
               "--warmup", str(warmup), "--repeats", str(args.repeats), "--batch", str(batch), "--json-out",
               json_path]
        if args.bf16:
            cmd.append("--bf16")
        if s.startswith("mirrorax") and args.steps_per_execution > 1:
            cmd += ["--steps-per-execution", str(args.steps_per_execution)]
        # A host that stayed busy through a whole wait is likely to stay busy: stop waiting long until
        # it has been seen idle again (the `other_load` of each run still records the contention).
        busy = wait_idle(0.25, args.idle_wait if host_was_idle else 0.0) if args.idle_wait > 0 else None
        host_was_idle = busy is None or busy <= 0.25
        res = run_one(cmd, os.path.join(args.out, "logs", stem + ".log"), json_path,
                      args.timeout or wl.timeout_s * (0.5 if args.quick else 1.0))
        res.update(system=s, workload=wl.name, devices=n, round=r, batch=batch, host_busy_before=busy)
        res.setdefault("steps", steps)  # (the peer's own count, where it wrote one)
        runs.append(res)
        if res["status"] != "ok":
            failed.add((wl.name, n, s))
        rates = res.get("samples_per_s") or []
        shown = f"{sorted(rates)[len(rates) // 2]:,.0f} samples/s" if rates else res.get("note", "")
        print(f"[{idx}/{len(plan)} {time.monotonic() - t_start:5.0f}s] {wl.name:11s} {n} dev  {s:9s} "
              f"round {r}: {res['status']:7s} {shown}  ({res['wall_s']:.1f} s"
              + (f", host {busy:.0%} busy before" if busy is not None and busy > 0.25 else "")
              + (f", other processes took {res['other_load']:.0%} of the CPU" if res["other_load"] > 0.1 else "")
              + ")", flush=True)

    summary = report.summarize(runs, args, skipped, SYSTEMS)
    paths = report.write(summary, args.out)
    print()
    print(report.markdown(summary))
    print("wrote " + ", ".join(paths))
    return 0 if any(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
