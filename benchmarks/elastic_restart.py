"""Time from a lost worker to the first step on the survivors (issues 48, 57), under ``mirrorax launch
--min-nprocs`` and on Ray Train, phase by phase; on Ray, also from a node's return to the first step of the grown
group.

Run from the repository root::

    python -m benchmarks.elastic_restart                       # both, once
    python -m benchmarks.elastic_restart --only launch --repeat 3
    python -m benchmarks.elastic_restart --only ray            # needs pip install "mirrorax[ray]"

Both run ``tests/jobs/elastic_job.py``'s ``cnn`` phase (the CNN workload: ``mirrorax.zoo.digits_cnn()``, global
batch 256, Adam, ``model.fit`` under the scope; 4 processes x 2 CPU devices, a snapshot every 3 steps), whose
processes print the wall-clock time of each milestone of their start (``EJ_TIMES``) and of every step:

* ``launch``: ``mirrorax launch --nprocs 4 --min-nprocs 2``; process 1 SIGKILLs itself at step 160 (the group
  restarts with 4) and again at step 280 (it is left out: the group restarts with 3).
* ``ray``: ``tests/jobs/ray_elastic.py``'s cluster of simulated nodes; the worker of rank 2 is SIGKILLed at step
  160 and its node removed (the group goes on with 3); at step 200 of the smaller group a node is added (Ray's
  resize, every 2 s here, grows the group to 4).

The fit has 40 epochs of 8 steps: a loss comes once the group has trained for a while (under ``mirrorax
launch``, its standby processes have imported what they import: on 2 cores busy with 4 training processes,
about 20 s). A restart ends when its first step is done on
every process (each reads the step's loss).

Each restart is cut into phases along its critical path: from the event to the moment the last of the new
processes reached each milestone (the group waits for its slowest member at the join and at the first step):
the launcher (or Ray) noticing the loss and starting the new processes, their imports, the join, the compile,
the restore, and the first step. ``--env K=V`` passes settings to the job (e.g. ``MIRRORAX_STANDBY=0`` to time
the launcher without its standby processes).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

_LOG: list[str] = []  # --log: where each run's output lines go
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "tests", "jobs", "elastic_job.py")
#: The milestones the job's processes print, in order; each phase ends at one of them.
MILESTONES = ("imported", "joined", "compiled", "train_begin")
PHASES = ("noticed, new processes started", "imports", "join", "compile", "restore", "first step")


def _env(out: str, extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join([os.path.join(REPO, "src"), os.path.join(REPO, "tests")])
    env = dict(os.environ, EJ_OUT=out, EJ_PHASES="cnn", EJ_CNN_EPOCHS="40", EJ_TIMES="1", MIRRORAX_SNAPSHOT_STEPS="3",
               KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=path)
    env.update(extra)
    return env


def _stamped(cmd: list[str], env: dict[str, str]) -> list[tuple[float, str]]:
    """The command's output lines, each with the wall-clock time it arrived."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    if _LOG:
        with open(_LOG[0], "a") as f:
            f.writelines(f"{at:.3f} {line}\n" for at, line in lines)
    if proc.wait() != 0:
        sys.exit("the job failed:\n" + "\n".join(x for _, x in lines[-60:]))
    return lines


def _restart(lines: list[tuple[float, str]], event: float, started: str) -> dict[str, float]:
    """After an event at ``event``: when the new processes were started (``started``: the milestone that says it),
    reached each milestone (the last of them) and made their first step (the job's own clock)."""
    seen: dict[str, list[float]] = {}
    first_step = None
    for _, line in lines:
        m = re.search(r"TIME (\S+) (\w+)\S* ([\d.]+)", line)
        if m and float(m.group(3)) >= event - 0.5 and first_step is None:
            seen.setdefault(m.group(2), []).append(float(m.group(3)))
        m = re.search(r"PHASE cnn (\d+) (\d+) ([\d.]+)", line)
        if m and float(m.group(3)) > event and "first_step" in seen:  # (its first step is done on every process)
            first_step = max(seen["first_step"])
            processes = int(m.group(2))
            break
    if first_step is None or started not in seen:
        raise AssertionError(f"no restart after the event at {event}: {sorted(seen)}")
    marks = {"event": event, "started": max(seen[started]), "first_step": first_step, "processes": processes}
    for name in MILESTONES:
        marks[name] = max(seen.get(name, [marks["started"]]))
    return marks


def _phases(marks: dict[str, float]) -> list[float]:
    """Each phase's seconds along the critical path (the first: the event to the last new process started)."""
    points = [marks["event"], marks["started"], *(marks[m] for m in MILESTONES), marks["first_step"]]
    return [max(0.0, b - a) for a, b in zip(points, points[1:])]


def _table(rows: list[tuple[str, list[float], float]]) -> str:
    head = "| restart | " + " | ".join(PHASES) + " | kill to first step |\n|---|" + "---:|" * (len(PHASES) + 1)
    body = [f"| {name} | " + " | ".join(f"{p:.1f}" for p in phases) + f" | **{total:.1f}** |"
            for name, phases, total in rows]
    return "\n".join([head, *body])


def launch(extra: dict[str, str]) -> list[tuple[str, list[float], float]]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "mirrorax.cluster.launch", "--nprocs", "4", "--min-nprocs", "2",
               "--cpu-devices-per-proc", "2", "--", sys.executable, JOB]
        lines = _stamped(cmd, _env(out, {"EJ_EVENTS": "kill:cnn:160:slot1:4,kill:cnn:280:slot1:4", **extra}))
    kills = dict.fromkeys(m.groups() for _, x in lines if (m := re.search(r"^\[rank \d+\] KILL cnn (\d+) ([\d.]+)", x)))
    rows = []
    for step, at in kills:
        marks = _restart(lines, float(at), "script")
        phases = _phases(marks)
        rows.append((f"launch, killed at step {step} -> {marks['processes']} processes", phases,
                     marks["first_step"] - marks["event"]))
    return rows


def ray(extra: dict[str, str]) -> list[tuple[str, list[float], float]]:
    with tempfile.TemporaryDirectory() as out:
        lines = _stamped([sys.executable, os.path.join(REPO, "tests", "jobs", "ray_elastic.py"), out],
                         _env(out, {"EJ_EVENTS": "hold:cnn:160:rank2:4,wait:cnn:200:all:3",
                                    "RAY_DEDUP_LOGS": "0", **extra}))  # (every worker's milestones, not merged)
    rows = []
    for _, line in lines:
        m = re.search(r"EVENT .*(killed|added a node).* at ([\d.]+)$", line)
        if not m:
            continue
        marks = _restart(lines, float(m.group(2)), "function")
        what = "a worker SIGKILLed, its node removed" if m.group(1) == "killed" else "a node added (grow-back)"
        rows.append((f"Ray Train, {what} -> {marks['processes']} workers", _phases(marks),
                     marks["first_step"] - marks["event"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("launch", "ray"), default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each (default 1)")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="a setting for the job's processes")
    parser.add_argument("--log", default=None, metavar="FILE",
                        help="append every line the jobs print to FILE, each with its arrival time "
                             "(with --env EJ_TIMES=all: every compile's and cache read's duration too)")
    args = parser.parse_args()
    if args.log:
        _LOG.append(args.log)
    extra = dict(kv.split("=", 1) for kv in args.env)
    with open("/proc/loadavg") as f:
        print(f"load average before: {' '.join(f.read().split()[:3])}", flush=True)
    rows = []
    for _ in range(args.repeat):
        if args.only in (None, "launch"):
            rows += launch(extra)
        if args.only in (None, "ray"):
            rows += ray(extra)
    print(_table(rows))
    with open("/proc/loadavg") as f:
        print(f"load average after: {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
