"""``mirrorax launch``'s restarts: which processes the next attempt starts, and the snapshots they resume from.

The processes sit in *slots* (``MIRRORAX_SLOT``; their ranks are their places among the slots left). A group
that fails restarts on the same slots (``--max-restarts``); with ``--min-nprocs M`` below ``--nprocs``, a slot
that failed :data:`SLOT_FAILURES` times keeps failing (a bad device, a host that kills it) and the group
restarts without it, as long as ``M`` are left. The restarted processes resume from the newest snapshot
(``MIRRORAX_SNAPSHOT_DIR``, made here for the launch and removed when it ends) or checkpoint, and are told
which process the last group lost (``MIRRORAX_ELASTIC_LOST``): ``fit`` says it in its restart line
(:func:`restart_line`, from plain facts: the processes, the job before, the steps reached).

*The job before* is the group that last ran on the snapshot directory, whatever wrote the snapshot resumed
from: each job notes its group when it joins (:func:`note_group`, ``<node>.group.json`` beside each node's
snapshots), after reading the one noted before it. A group grown back after a loss says so (it had 3
processes, none lost), even when it resumes from a snapshot the 4 processes before the loss took.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from mirrorax.cluster.preemption import PREEMPTED_EXIT_CODE

__all__ = ["DIR_ENV", "LOST_ENV", "SECONDS_ENV", "STEPS_ENV", "node_name", "Restarts", "SLOT_FAILURES", "SLOT_ENV",
           "default_max_restarts", "restart_line", "note_group", "group_before", "group_file", "compile_cache",
           "CACHE_DIR"]

DIR_ENV = "MIRRORAX_SNAPSHOT_DIR"  # each node's snapshots go under it (mirrorax launch and Ray set it)
LOST_ENV = "MIRRORAX_ELASTIC_LOST"  # set by mirrorax launch for a restarted group: what the last one lost
SECONDS_ENV = "MIRRORAX_SNAPSHOT_SECONDS"  # a snapshot every so many seconds (mx.Snapshots)
STEPS_ENV = "MIRRORAX_SNAPSHOT_STEPS"  # or every so many steps

#: A slot that fails this many times keeps failing: with ``--min-nprocs``, the group restarts without it.
SLOT_FAILURES = 2
SLOT_ENV = "MIRRORAX_SLOT"


def node_name() -> str:
    """This node's name: the Ray node's id in a Ray worker (simulated nodes of one host differ), else the host
    name. Each node keeps its own snapshots, so the survivors of a lost node hold theirs."""
    ray = sys.modules.get("ray")
    # Only a process Ray started (or joined) asks: Ray's get_runtime_context() starts a local Ray instance in
    # any other process that imported ray (a notebook using Ray Data), a cluster nobody asked for.
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        with contextlib.suppress(Exception):  # not in a Ray worker: the host
            node = ray.get_runtime_context().get_node_id()
            if node:
                return f"ray-{node[:16]}"
    return socket.gethostname() or "localhost"


class Restarts:
    """The slots of the next attempt, and what the last one lost.

    Args:
      nprocs: the processes asked for (slots ``0..nprocs-1``).
      min_nprocs: the fewest processes to go on with.
      max_restarts: the restarts allowed, whatever their cause.
      env: the children's base environment: a snapshot directory is added to it when a restart may come.
    """

    def __init__(self, nprocs: int, min_nprocs: int, max_restarts: int, env: dict[str, str]) -> None:
        self.slots = list(range(nprocs))
        self.nprocs, self.min_nprocs, self.max_restarts = nprocs, min_nprocs, max_restarts
        self.failures: collections.Counter[int] = collections.Counter()
        self.attempts = 1  # the groups started so far
        self.made: str | None = None  # the snapshot directory made for this launch (removed at its end)
        self.lost = ""  # what the last attempt lost, for the next one's processes
        self.stopped = ""  # why the job cannot go on (after_failure returned None)
        if max_restarts and not env.get(DIR_ENV):
            self.made = tempfile.mkdtemp(prefix="mirrorax-snapshots-")
            env[DIR_ENV] = self.made
        if max_restarts:
            compile_cache(env, env[DIR_ENV])

    def after_failure(self, failed: Sequence[tuple[int, str, int | None]]) -> str | None:
        """The processes ``failed`` (rank, how in words, exit status) failed first in the last attempt (the others
        only followed them: never counted); returns what the launcher says about the next attempt, or ``None``
        when the job cannot go on (:attr:`stopped` says why). Sets :attr:`lost` (what the children are told).

        With ``min_nprocs`` below ``nprocs``, every slot that failed :data:`SLOT_FAILURES` times is left out; when
        that would leave fewer than ``min_nprocs`` slots, the job stops. A preempted process (its status
        ``PREEMPTED_EXIT_CODE``) is restarted, never counted against its slot.
        """
        failed = [f for f in failed if 0 <= f[0] < len(self.slots)]
        self.attempts += 1
        for rank, _, code in failed:
            if code != PREEMPTED_EXIT_CODE:
                self.failures[self.slots[rank]] += 1
        keeps = [s for s in self.slots if self.failures[s] >= SLOT_FAILURES] if self.min_nprocs < self.nprocs else []
        said = []
        for rank, how, _ in failed:
            slot = self.slots[rank]
            said.append(f"process {rank} (slot {slot}: {how})"
                        + (f", its failure {self.failures[slot]}: left out" if slot in keeps else ""))
        self.lost = " and ".join(said)
        if not keeps:
            return f"restarting the group of {len(self.slots)}"
        healthy = [s for s in self.slots if s not in keeps]
        # (Each reached SLOT_FAILURES at this failure: one left out earlier is no longer among the slots.)
        which = f"{_slots(keeps)} failed {SLOT_FAILURES} times{' each' if len(keeps) > 1 else ''}"
        if len(healthy) < self.min_nprocs:
            left = f"{len(healthy)} ({_slots(healthy)})" if healthy else "none"
            self.stopped = (f"fewer than --min-nprocs {self.min_nprocs} healthy processes remain: {left}; {which} (a "
                            f"slot that fails {SLOT_FAILURES} times is left out). Lower --min-nprocs to go on with "
                            "fewer processes")
            return None
        self.slots = healthy
        return f"{which}: restarting on the {len(self.slots)} process(es) left (--min-nprocs {self.min_nprocs})"

    def used_up(self) -> str:
        """Why the job stops when its last allowed attempt failed."""
        return (f"restarts used up: the group failed {self.attempts} times, and --max-restarts {self.max_restarts} "
                "allows no more. Raise --max-restarts to try again more times")

    def env(self, rank: int) -> dict[str, str]:
        """What the process of ``rank`` is told besides the job: its slot and what the last group lost."""
        return {SLOT_ENV: str(self.slots[rank]), LOST_ENV: self.lost}

    def keep(self) -> str | None:
        """The job stops unfinished: the snapshot directory made for it is kept if it holds any snapshot (returned,
        for a rerun to resume from: ``MIRRORAX_SNAPSHOT_DIR``), else removed (group notes and the compilation
        cache are no snapshot)."""
        made = self.made
        if made is not None and any(not f.endswith(".group.json") and os.path.relpath(d, made).split(os.sep)[0]
                                    != CACHE_DIR for d, _, files in os.walk(made) for f in files):
            self.made = None
            return made
        return None

    def close(self) -> None:
        """Removes the snapshot directory made for this launch (unless :meth:`keep` kept it)."""
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)
            self.made = None


#: The compilation cache's directory in an elastic job's snapshot directory (beside ``<node>/``, the snapshots).
CACHE_DIR = "compiled.xla"


def _slots(slots: Sequence[int]) -> str:
    return f"slot{'s' if len(slots) != 1 else ''} {', '.join(map(str, slots))}"


def compile_cache(env: Any, base: str) -> None:
    """JAX's persistent compilation cache for a job that may restart, in ``env`` (an environment, before JAX is
    imported): :data:`CACHE_DIR` in the snapshot directory ``base``, every program stored. A restarted process
    loads what a process before it compiled: on accelerators the programs process 0 compiled (JAX's key is the
    same in every process); on CPU devices each process's own (their keys name the process; an elastic job's
    processes each write theirs: :func:`mirrorax.cluster.cache_writes.cache_every_process`). One directory for
    the job, not one per node: a restarted group numbers its processes anew, and a process finds what the process of its
    number compiled whatever its node, where the nodes share the directory (simulated nodes of one host, a
    shared file system). A cache the environment names already (``JAX_COMPILATION_CACHE_DIR``) is kept."""
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(base, CACHE_DIR)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def default_max_restarts(nprocs: int, min_nprocs: int) -> int:
    """``--max-restarts`` when not given: none, or with ``--min-nprocs`` enough to leave out each slot it may
    drop (each after :data:`SLOT_FAILURES` failures) plus one more."""
    return 0 if min_nprocs >= nprocs else SLOT_FAILURES * (nprocs - min_nprocs) + 1



# -- the group before: noted by each job at its join, read by the next -----------------------------------------
_before: list[dict[str, Any]] = []  # the group noted before this job joined (empty: none, or not an elastic job)
GROUP_KEY = "mirrorax/group"


def group_file(base: str, node: str) -> str:
    """Where ``node`` notes the group that last ran on snapshot directory ``base``."""
    return os.path.join(base, f"{node}.group.json")


def note_group(client: Any, process_id: int, num_processes: int, local_devices: int | None,
               timeout_s: float = 300.0) -> None:
    """At a job's join, where ``MIRRORAX_SNAPSHOT_DIR`` is set: reads the group each node noted last (the newest of
    them is :func:`group_before`), then notes this job's on every node: its processes, devices (when known
    without starting JAX's backend: ``local_devices`` of each process) and the node of each process. Every process
    calls it together; process 0 gathers through the job's coordination service ``client``."""
    base = os.environ.get(DIR_ENV)
    if not base:
        return
    node = node_name()
    path = group_file(base, node)
    try:
        with open(path) as f:
            noted = json.load(f)
    except (OSError, ValueError):
        noted = None
    mine = {"node": node, "noted": noted, "devices": local_devices}
    if num_processes > 1:
        client.key_value_set(f"{GROUP_KEY}/{process_id}", json.dumps(mine))
        if process_id == 0:
            every = [mine] + [json.loads(client.blocking_key_value_get(f"{GROUP_KEY}/{p}", int(timeout_s * 1000)))
                              for p in range(1, num_processes)]
            client.key_value_set(f"{GROUP_KEY}/all", json.dumps(_group_of(every)))
        agreed = json.loads(client.blocking_key_value_get(f"{GROUP_KEY}/all", int(timeout_s * 1000)))
    else:
        agreed = _group_of([mine])
    _before[:] = [agreed["before"]] if agreed["before"] else []
    with contextlib.suppress(OSError):  # (every process of a node writes the same: the last rename stands)
        os.makedirs(base, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(agreed["now"], f)
        os.replace(tmp, path)


def _group_of(every: list[dict[str, Any]]) -> dict[str, Any]:
    """The group of the processes ``every`` (their nodes, devices and what each node noted): the one noted last
    before it, and its own."""
    noted = [e["noted"] for e in every if isinstance(e.get("noted"), dict)]
    before = max(noted, key=lambda g: float(g.get("at", 0)), default=None)
    counts = [c for e in every if isinstance(c := e.get("devices"), int)]
    now = {"processes": len(every), "nodes": [e["node"] for e in every], "at": time.time(),
           "devices": sum(counts) if len(counts) == len(every) else None}
    return {"before": before, "now": now}


def group_before() -> dict[str, Any] | None:
    """The group that last ran on this job's snapshot directory before it joined (``processes``, ``devices``:
    ``None`` when unknown, ``nodes``), or ``None``."""
    return _before[0] if _before else None


def restart_line(what: str, where: str, step: int, facts: dict[str, Any], devices: int, processes: int,
                 nodes: Sequence[str]) -> str:
    """A restart in one line: ``what`` (``"fit 2"``, ``"loop"``) continues on the job as it is now (``processes``
    processes on ``devices``, the node of each in ``nodes``) from ``where``; the job before (the group noted before
    this one joined, :func:`group_before`, else ``facts["group"]``: the group that took the snapshot; its
    ``processes``, ``devices`` and ``nodes``), which processes it lost (told by ``mirrorax launch``:
    ``MIRRORAX_ELASTIC_LOST``; else the processes whose node left), the steps lost (from step ``step`` back from
    ``facts["reached"]``)."""
    n = processes
    parts = [f"mirrorax: elastic restart: {what} continues on {n} process{'es' if n != 1 else ''} ({devices} devices) "
             f"from {where}"]
    taken = facts.get("group") or {}
    before, lost = group_before() or taken, os.environ.get(LOST_ENV, "")
    if before:
        was = int(before.get("processes", 0))
        had = before.get("devices")
        if had is None and taken.get("processes") == was and taken.get("nodes") == before.get("nodes"):
            had = taken.get("devices")  # the snapshot's group is that group: its devices
        parts.append(f"the job had {was} process{'es' if was != 1 else ''}"
                     + (f" ({had} devices)" if had is not None else ""))
        here = set(nodes)
        gone = [p for p, node in enumerate(before.get("nodes", [])) if node not in here]
        if not lost and gone:
            lost = ", ".join(f"process {p} (its node {before['nodes'][p]} left)" for p in gone)
        elif not lost and was > n:
            lost = f"{was - n} process(es)"
    if lost:
        parts.append(f"lost: {lost}")
    reached = int(facts.get("reached", -1))
    if reached >= step:
        parts.append(f"{reached - step} step{'s' if reached - step != 1 else ''} lost (it had reached step {reached})")
    return "; ".join(parts) + "."
