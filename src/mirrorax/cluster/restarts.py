"""``mirrorax launch``'s restarts: which processes the next attempt starts, and the snapshots they resume from.

The processes sit in *slots* (``MIRRORAX_SLOT``; their ranks are their places among the slots left). A group
that fails restarts on the same slots (``--max-restarts``); with ``--min-nprocs M`` below ``--nprocs``, a slot
that failed :data:`SLOT_FAILURES` times keeps failing (a bad device, a host that kills it) and the group
restarts without it, as long as ``M`` are left. The restarted processes resume from the newest snapshot
(``MIRRORAX_SNAPSHOT_DIR``, made here for the launch and removed when it ends) or checkpoint, and are told
which process the last group lost (``MIRRORAX_ELASTIC_LOST``): ``fit`` says it in its restart line.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import socket
import sys
import tempfile

__all__ = ["DIR_ENV", "LOST_ENV", "SECONDS_ENV", "STEPS_ENV", "node_name", "Restarts", "SLOT_FAILURES", "SLOT_ENV",
           "default_max_restarts"]

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
        self.min_nprocs, self.max_restarts = min_nprocs, max_restarts
        self.failures: collections.Counter[int] = collections.Counter()
        self.made: str | None = None  # the snapshot directory made for this launch (removed at its end)
        self.lost = ""  # what the last attempt lost, for the next one's processes
        if max_restarts and not env.get(DIR_ENV):
            self.made = tempfile.mkdtemp(prefix="mirrorax-snapshots-")
            env[DIR_ENV] = self.made

    def after_failure(self, rank: int | None, how: str) -> str:
        """Process ``rank`` of the last attempt failed (``how``: its words); returns what the launcher says about
        the next attempt, and sets :attr:`lost` (what the children are told)."""
        if rank is None or not 0 <= rank < len(self.slots):
            self.lost = ""
            return f"restarting the group of {len(self.slots)}"
        slot = self.slots[rank]
        self.failures[slot] += 1
        self.lost = f"process {rank} (slot {slot}: {how})"
        if self.failures[slot] >= SLOT_FAILURES and len(self.slots) > self.min_nprocs:
            self.slots = [s for s in self.slots if s != slot]
            self.lost += f", its failure {self.failures[slot]}: left out"
            return (f"slot {slot} failed {self.failures[slot]} times: restarting on the {len(self.slots)} "
                    f"process(es) left (--min-nprocs {self.min_nprocs})")
        return f"restarting the group of {len(self.slots)}"

    def env(self, rank: int) -> dict[str, str]:
        """What the process of ``rank`` is told besides the job: its slot and what the last group lost."""
        return {SLOT_ENV: str(self.slots[rank]), LOST_ENV: self.lost}

    def close(self) -> None:
        """Removes the snapshot directory made for this launch."""
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)
            self.made = None


def default_max_restarts(nprocs: int, min_nprocs: int) -> int:
    """``--max-restarts`` when not given: none, or with ``--min-nprocs`` enough to leave out each slot it may
    drop (each after :data:`SLOT_FAILURES` failures) plus one more."""
    return 0 if min_nprocs >= nprocs else SLOT_FAILURES * (nprocs - min_nprocs) + 1

