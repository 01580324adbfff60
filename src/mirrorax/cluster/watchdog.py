"""Step progress, reported to ``mirrorax launch``'s watchdog through one small file per process.

A process started by ``mirrorax launch`` finds ``MIRRORAX_PROGRESS_DIR`` in its environment. The loop
calls :func:`beat` at each place where a step can wait (reading the input, the step on the devices,
the hooks and callbacks); a thread of this process writes ``"<count> <phase>"`` to
``<dir>/rank<R>`` when that changed (at most every :data:`WRITE_SECONDS`), so a rank blocked anywhere
in Python still reports where it last got to. The launcher reads the files: a group in which no rank
moved for ``--watchdog`` seconds while one waits in a watched phase is stuck, and the rank furthest
behind is named (see ``mirrorax.cluster.launch``). Nothing is written without the variable, and :func:`beat`
is two assignments: no I/O, no lock, no device sync on the step's path.

The launcher's side reads the files (:class:`Progress`): whether a group is stuck and which rank holds it up,
and whether every rank trains (the launcher then starts its standby processes).

The same thread also ends this process's group when the launcher is gone (``MIRRORAX_LAUNCHER_PID``):
the launcher's ``PR_SET_PDEATHSIG`` kills its direct children at once; this covers a joined process
that is not one (started through ``bash -c`` or a script) and what it started. What a directly started
rank started itself outlives it (see docs/multiprocess.md).
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["beat", "start", "joined", "read", "describe", "leaving", "exit_code_mid_training", "waiting_for_peers",
           "Progress", "EXIT_SETTLE_SECONDS",
           "in_checkpoint", "WATCHED", "WAITING", "ENDS_BY_ITSELF", "PROGRESS_DIR_ENV", "LAUNCHER_PID_ENV", "JOINING",
           "IDLE", "INPUT", "STEP", "HOOKS", "PEERS", "COMPILING", "CHECKPOINT", "EXITING"]

PROGRESS_DIR_ENV = "MIRRORAX_PROGRESS_DIR"
#: How long the others may wait in a step for a rank that exited (or is exiting) before the launcher ends the group.
EXIT_SETTLE_SECONDS = 5.0
LAUNCHER_PID_ENV = "MIRRORAX_LAUNCHER_PID"
WRITE_SECONDS = 0.2

# Phases: where a process is, named by where it would be stuck if it stopped there.
JOINING = "joining"  # in jax.distributed.initialize, waiting for every process
IDLE = "idle"  # joined, outside fit/evaluate/predict (the script's own work): not watched
COMPILING = "compiling"  # compiling a step: not watched (a large model compiles for minutes)
INPUT = "input"  # reading the next batch from the input (the user's generator or dataset)
STEP = "step"  # waiting for a step on the devices, and so for its peers in the collectives
HOOKS = "hooks"  # in a batch callback or hook (Keras callbacks, progress; a checkpoint save is CHECKPOINT)
PEERS = "peers"  # waiting for its peers to agree (mirrorax.cluster.consistency, through the coordination service)
EXITING = "exiting"  # the script ended (or sys.exit): at the exit barrier, waiting for the others
CHECKPOINT = "checkpoint"  # saving, waiting for or restoring a checkpoint: not watched (a large state takes minutes)
#: Phases in which a process should move on within the watchdog's bound.
WATCHED = frozenset({JOINING, INPUT, STEP, HOOKS, PEERS})
#: Phases that wait for the other processes: on a tie, the rank named is one not in these.
WAITING = frozenset({STEP, PEERS})
#: Phases that end by themselves however long they take: while one rank is in one, the group is not stuck
#: (the others wait for it in a step).
ENDS_BY_ITSELF = frozenset({COMPILING, CHECKPOINT})

_WORDS = {
    None: "never joined the job (it did not reach mx.MirroredStrategy() or mx.initialize())",
    JOINING: "was joining the job (waiting in jax.distributed.initialize for every process)",
    IDLE: "was outside fit/evaluate/predict (in the script's own code)",
    COMPILING: "was compiling a step",
    INPUT: "was reading its next batch from the input (the input pipeline or generator did not return)",
    STEP: "was waiting for a step to finish (on its devices and its peers)",
    HOOKS: "was in a batch callback or hook (a Keras callback or the progress line)",
    PEERS: "was waiting for the other processes to agree (on a callback's request to stop, or a check)",
    CHECKPOINT: "was saving or restoring a checkpoint",
    EXITING: "was exiting (its script ended or called sys.exit) while the others were still training",
}

_count = 0
_phase = IDLE
_exit_code: Any = None
_started: dict[str, Any] = {}


def beat(phase: str) -> None:
    """Records progress into ``phase`` (a module constant); the writer thread reports it."""
    global _count, _phase
    _count += 1
    _phase = phase


class waiting_for_peers:
    """``with waiting_for_peers():`` the process waits for the others (then back to where it was)."""

    def __enter__(self) -> None:
        self.phase = _phase
        beat(PEERS)

    def __exit__(self, *exc: object) -> None:
        beat(self.phase)


class in_checkpoint:
    """``with in_checkpoint():`` the process saves, waits for or restores a checkpoint: the watchdog's
    bound applies to steps and input, not to the file system (then back to where it was)."""

    def __enter__(self) -> None:
        self.phase = _phase
        beat(CHECKPOINT)

    def __exit__(self, *exc: object) -> None:
        beat(self.phase)


def leaving(code: Any) -> None:
    """Records the status of a ``SystemExit`` raised out of the training loop (see
    :func:`exit_code_mid_training`)."""
    global _exit_code
    _exit_code = 0 if code is None else code


def exit_code_mid_training() -> Any:
    """The status of a ``SystemExit`` this process raised inside fit/evaluate/predict's loop, or
    ``None`` when it is not leaving from there (it finished, or never trained)."""
    return _exit_code


def describe(phase: str | None) -> str:
    """The words for a phase read back from a progress file (``None``: no file written)."""
    return _WORDS.get(phase, f"was in phase {phase!r}")


def read(path: str) -> tuple[int, str] | None:
    """``(count, phase)`` from a progress file, or ``None`` when it does not exist (yet)."""
    try:
        with open(path) as f:
            count, _, phase = f.read().strip().partition(" ")
        return int(count), phase
    except (OSError, ValueError):
        return None


def start(process_id: int) -> None:
    """Starts reporting (once per process) when ``mirrorax launch`` asked for it; else does nothing."""
    directory = os.environ.get(PROGRESS_DIR_ENV)
    if not directory or _started:
        return
    path = os.path.join(directory, f"rank{process_id}")
    stop = threading.Event()
    try:
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    except ValueError:
        launcher = 0

    def write() -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{_count} {_phase}\n")
        os.replace(tmp, path)

    def run() -> None:
        written = None
        while not stop.wait(WRITE_SECONDS):
            now = (_count, _phase)
            if now != written:
                try:
                    write()
                    written = now
                except OSError:  # the launcher removed the directory: it is gone or done
                    pass
            if launcher and not _alive(launcher):
                os.killpg(os.getpgid(0), signal.SIGKILL)  # the launcher died: take what we started along

    def at_exit() -> None:
        beat(EXITING)
        stop.set()
        try:
            write()
        except OSError:
            pass

    _started.update(path=path, stop=stop, at_exit=at_exit)
    beat(JOINING)
    threading.Thread(target=run, name="mirrorax-progress", daemon=True).start()


def joined() -> None:
    """This process joined the job: idle until a loop starts, and "exiting" from the moment the script
    ends (registered after ``jax.distributed``'s own exit handler, so it runs before that one waits)."""
    beat(IDLE)
    if _started:
        atexit.register(_started["at_exit"])


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# The phases of fit's training loop, and the beats of one step there (input, step, hooks: mirrorax.fit.loop).
_LOOP = frozenset({INPUT, STEP, HOOKS})
_STEP_BEATS = 6


class Progress:
    """The launcher's watchdog: reads each rank's progress file and says which rank holds the group up, if one
    does, and whether every rank trains.

    Two verdicts. *Left*: a rank exited (status 0: a non-zero one is a failure the launcher sees at once)
    or is exiting while another still waits in a watched phase, silent for ``EXIT_SETTLE_SECONDS``: the one
    that left first. *Stuck*: no rank moved for ``bound`` seconds and one waits in a watched phase: the rank
    furthest behind (fewest beats; on a tie one not waiting in a step), since the others wait for it in a
    collective. Phases that legitimately take long (compiling, the script's own code outside fit) are not
    watched: a group in which every rank is there, or in which one rank compiles, is never stuck.
    """

    def __init__(self, directory: str, nprocs: int, bound: float) -> None:
        now = time.monotonic()
        self.paths = [os.path.join(directory, f"rank{r}") for r in range(nprocs)]
        self.seen: list[tuple[int, str] | None] = [None] * nprocs
        self.changed = [now] * nprocs
        self.left: dict[int, float] = {}
        self.bound, self.next = bound, now
        self.in_loop: dict[int, int] = {}  # each rank's beat count when first seen in its training loop
        self.trained: set[int] = set()  # the ranks seen training
        self.next_training = now

    def check(self, codes: Sequence[int | None]) -> tuple[int, str] | None:
        now = time.monotonic()
        if now < self.next:
            return None
        self.next = now + 0.25
        for rank, path in enumerate(self.paths):
            got = read(path)
            if got is not None and got != self.seen[rank]:
                self.seen[rank], self.changed[rank] = got, now
            if (codes[rank] is not None or self.phase(rank) == EXITING) and rank not in self.left:
                self.left[rank] = now
        live = [r for r, c in enumerate(codes) if c is None]
        settle = min(self.bound, EXIT_SETTLE_SECONDS)
        waiting = [r for r in live if self.phase(r) in WATCHED and now - self.changed[r] >= settle]
        gone = sorted((t, r) for r, t in self.left.items() if now - t >= settle and r not in waiting)
        if gone and waiting:
            rank = gone[0][1]
            others = ", ".join(str(r) for r in waiting)
            how = (f"exited (status {codes[rank]})" if codes[rank] is not None else
                   "is exiting (its script ended or called sys.exit)")
            return rank, (f"{how} while rank(s) {others} still waited for it in a step (for "
                          f"{now - gone[0][0]:.0f} s)")
        if live and all(now - self.changed[r] >= self.bound for r in live) and \
                any(self.phase(r) in WATCHED for r in live) and \
                not any(self.phase(r) in ENDS_BY_ITSELF for r in live):  # compiling, a checkpoint
            rank = min(live, key=lambda r: (self.count(r), self.phase(r) in WAITING, r))
            return rank, (f"made no progress for {now - self.changed[rank]:.0f} s: it "
                          f"{describe(self.phase(rank))}, and the others waited for it "
                          f"(--watchdog {self.bound:g})")
        return None

    def training(self) -> bool:
        """Whether every rank trains: seen in its training loop (its input, a step, its hooks) a step's beats after
        it was first seen there, past its first step's compile."""
        now = time.monotonic()
        if now >= self.next_training:
            self.next_training = now + 0.5
            for rank, path in enumerate(self.paths):
                got = read(path)
                if got is None or got[1] not in _LOOP:
                    continue
                first = self.in_loop.setdefault(rank, got[0])
                if got[0] >= first + _STEP_BEATS:
                    self.trained.add(rank)
        return len(self.trained) == len(self.paths)

    def phase(self, rank: int) -> str | None:
        seen = self.seen[rank]
        return None if seen is None else seen[1]

    def count(self, rank: int) -> int:
        seen = self.seen[rank]
        return -1 if seen is None else seen[0]
