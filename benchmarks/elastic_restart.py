"""Time from a lost worker to the first step on the survivors (issue 48), under ``mirrorax launch
--min-nprocs`` and on Ray Train; and, on Ray, from a node's return to the first step of the grown group.

Run from the repository root::

    python -m benchmarks.elastic_restart                 # both
    python -m benchmarks.elastic_restart --only launch   # (or ray: needs pip install "mirrorax[ray]")

Both run ``tests/jobs/elastic_job.py``'s ``model.fit`` (4 processes x 2 CPU devices, a snapshot every 3
steps), which prints the wall-clock time of every step:

* ``launch``: ``mirrorax launch --nprocs 4 --min-nprocs 2``; process 1 SIGKILLs itself at step 10 (the
  group restarts with 4) and again at step 12 (it is left out: the group restarts with 3).
* ``ray``: ``tests/jobs/ray_elastic.py``'s cluster of simulated nodes; the worker of rank 2 is SIGKILLed at
  step 10 and its node removed (the group goes on with 3); at step 13 of the smaller group a node is added
  (Ray's resize, every 2 s here, grows the group to 4).

Each time is from the event (the kill, the node's arrival) to the first step after it, with where it went:
the first lines the restarted processes print (joined, resumed) as they reach the benchmark.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "tests", "jobs", "elastic_job.py")


def _env(out: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([os.path.join(REPO, "src"), os.path.join(REPO, "tests")])
    env = dict(os.environ, EJ_OUT=out, EJ_PHASES="fit", MIRRORAX_SNAPSHOT_STEPS="3", KERAS_BACKEND="jax",
               JAX_PLATFORMS="cpu", PYTHONPATH=path)
    env.update(extra)
    return env


def _stamped(cmd: list[str], env: dict[str, str]) -> list[tuple[float, str]]:
    """The command's output lines, each with the wall-clock time it arrived."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    if proc.wait() != 0:
        sys.exit("the job failed:\n" + "\n".join(x for _, x in lines[-60:]))
    return lines


def _first_step(lines: list[tuple[float, str]], event: float) -> tuple[float, float, int, int]:
    """After an event at ``event``: when the restarted processes said they resumed (arrival), and their first
    step: its time (the job's own clock), step and process count."""
    resumed = next(i for i, (at, line) in enumerate(lines) if at >= event and "elastic restart" in line)
    for _, line in lines[resumed:]:
        m = re.search(r"PHASE fit (\d+) (\d+) ([\d.]+)", line)
        if m:
            return lines[resumed][0], float(m.group(3)), int(m.group(1)), int(m.group(2))
    raise AssertionError("no step after the restart")


def _after(lines: list[tuple[float, str]], t: float, pattern: str) -> float:
    return next(at for at, line in lines if at >= t and re.search(pattern, line))


def launch() -> None:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "mirrorax.cluster.launch", "--nprocs", "4", "--min-nprocs", "2",
               "--cpu-devices-per-proc", "2", "--", sys.executable, JOB]
        lines = _stamped(cmd, _env(out, EJ_EVENTS="kill:fit:10:slot1:4,kill:fit:12:slot1:4"))
    kills = dict.fromkeys(re.search(r"KILL fit (\d+) ([\d.]+)", x).groups()  # type: ignore[union-attr]
                          for _, x in lines if re.search(r"^\[rank \d+\] KILL fit", x))  # (a report repeats it)
    for step, at in kills:
        killed = float(at)
        restart = _after(lines, killed, "mirrorax launch: (restarting|slot)")
        resumed, first, s, n = _first_step(lines, killed)
        print(f"launch: killed at step {step}; first step on {n} processes (step {s}) {first - killed:.1f} s later "
              f"(the launcher restarted the group after {restart - killed:.1f} s; the processes had joined, "
              f"compiled and resumed after {resumed - killed:.1f} s)")


def ray() -> None:
    with tempfile.TemporaryDirectory() as out:
        lines = _stamped([sys.executable, os.path.join(REPO, "tests", "jobs", "ray_elastic.py"), out],
                         _env(out, EJ_EVENTS="hold:fit:10:rank2:4,wait:fit:13:all:3"))
    for _, line in lines:
        m = re.search(r"EVENT .*(killed|added a node).* at ([\d.]+)$", line)
        if not m:
            continue
        at = float(m.group(2))
        resumed, first, s, n = _first_step(lines, at)
        what = "a worker SIGKILLed (its node removed)" if m.group(1) == "killed" else "a node added"
        print(f"ray: {what}; first step on {n} workers (step {s}) {first - at:.1f} s later (the workers had joined, "
              f"compiled and resumed about {resumed - at:.1f} s after it, as their lines reached the driver)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("launch", "ray"), default=None)
    args = parser.parse_args()
    if args.only in (None, "launch"):
        launch()
    if args.only in (None, "ray"):
        ray()


if __name__ == "__main__":
    main()
