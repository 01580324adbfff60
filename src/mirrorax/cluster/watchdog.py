"""Step progress, reported to ``mirrorax launch``'s watchdog through one small file per process.

A process started by ``mirrorax launch`` finds ``MIRRORAX_PROGRESS_DIR`` in its environment. The loop
calls :func:`beat` at each place where a step can wait (reading the input, the step on the devices,
the hooks and callbacks); a thread of this process writes ``"<count> <phase>"`` to
``<dir>/rank<R>`` when that changed (at most every :data:`WRITE_SECONDS`), so a rank blocked anywhere
in Python still reports where it last got to. The launcher reads the files: a group in which no rank
moved for ``--watchdog`` seconds while one waits in a watched phase is stuck, and the rank furthest
behind is named (see ``mirrorax.cluster.launch``). Nothing is written without the variable, and :func:`beat`
is two assignments: no I/O, no lock, no device sync on the step's path.

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
from typing import Any

__all__ = ["beat", "start", "joined", "read", "describe", "leaving", "exit_code_mid_training", "waiting_for_peers",
           "in_checkpoint", "WATCHED", "WAITING", "ENDS_BY_ITSELF", "PROGRESS_DIR_ENV", "LAUNCHER_PID_ENV", "JOINING",
           "IDLE", "INPUT", "STEP", "HOOKS", "PEERS", "COMPILING", "CHECKPOINT", "EXITING"]

PROGRESS_DIR_ENV = "MIRRORAX_PROGRESS_DIR"
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
