"""``mirrorax launch``: run one command as N cooperating JAX processes on this machine.

Each child gets ``MIRRORAX_COORDINATOR=127.0.0.1:<free port>``, ``MIRRORAX_NUM_PROCESSES`` and
``MIRRORAX_PROCESS_ID``, so ``mx.MirroredStrategy()`` joins the job with no change to the script; with
``--cpu-devices-per-proc K`` it also gets K simulated CPU devices. Output is streamed with a
``[rank R]`` prefix (gloo's "[Gloo] Rank R is connected to ..." lines are dropped unless
``MIRRORAX_VERBOSE_COLLECTIVES=1``). When a child fails (non-zero exit or a signal) the launcher stops
the others (SIGTERM to each child's process group, SIGKILL after a grace period), prints which ranks
failed first (:mod:`mirrorax.cluster.verdict`: never a survivor of a lost peer) and the last lines they wrote,
and returns non-zero; ``--max-restarts`` restarts the whole group instead, and ``--min-nprocs`` leaves out a
process that keeps failing (:mod:`mirrorax.cluster.restarts`): the restarted group resumes from the newest
snapshot (:mod:`mirrorax.checkpoint.snapshot`) on the processes left, on processes that stood by, imported
(:mod:`mirrorax.cluster.standby`), with JAX's compilation cache on. A job that stops unfinished says why in
its last line.
SIGTERM to the launcher (preemption) is forwarded to every child, which then has ``--grace`` seconds to
save and exit (a second SIGTERM changes nothing); Ctrl-C sends SIGINT. A watchdog reads each
child's progress (:mod:`mirrorax.cluster.watchdog`): no progress for ``--watchdog`` seconds ends the group,
naming the rank furthest behind with its Python stack; a rank that exits while the others wait for it
ends the group within seconds. Children die with the launcher (``PR_SET_PDEATHSIG``). See
:func:`launch` for the exit status.

Example:
  $ mirrorax launch --nprocs 2 --cpu-devices-per-proc 4 -- python train.py --epochs 3
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence, Set
from typing import IO, Any

import mirrorax.cluster.standby as _standby
import mirrorax.cluster.verdict as verdict
import mirrorax.cluster.watchdog as _watchdog
from mirrorax._checks import check_int
from mirrorax.cluster.discovery import accelerators_present
from mirrorax.cluster.output import ChatterFilter, verbose
from mirrorax.cluster.preemption import PREEMPTED_EXIT_CODE
from mirrorax.cluster.restarts import Restarts, default_max_restarts

__all__ = ["add_parser", "run", "launch", "main"]

TAIL_LINES = 20
SETTLE_SECONDS = 2.0
INTERRUPT_GRACE_SECONDS = 5.0
TERM_GRACE_SECONDS = 30.0
#: The default of ``--watchdog``: seconds a group may go without any rank making progress.
WATCHDOG_SECONDS = 90.0
#: How long the others may wait in a step for a rank that exited (or is exiting) before the group ends.
EXIT_SETTLE_SECONDS = _watchdog.EXIT_SETTLE_SECONDS
#: The most processes ``mirrorax launch`` starts on one machine.
MAX_NPROCS = 1024
#: After a failure that the group restarts from, how long the others have after SIGTERM before SIGKILL: a survivor
#: waits in a collective for the lost peer (its handlers cannot run), and a restarted group resumes from a snapshot.
RESTART_GRACE_SECONDS = 0.5
#: The launcher's exit status when its watchdog ended a stuck group (as ``timeout``'s).
WATCHDOG_EXIT_CODE = 124
# Lines of a C++ stack trace (absl's "Check failure stack trace"): kept out of the report's tail.
_TRACE = re.compile(r"^\s*@\s+0x[0-9a-fA-F]+\s|^\*\*\* Check failure stack trace")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``launch`` on an ``argparse`` subparsers object (``args.func(args)`` runs it).

    Example:
      >>> parser = argparse.ArgumentParser(); add_parser(parser.add_subparsers())  # doctest: +ELLIPSIS
      ArgumentParser(...)
    """
    p = subparsers.add_parser(
        "launch", help="run a command as N JAX processes on this machine (multi-process training)",
        description="Run COMMAND as N processes of one JAX job on this machine; stop them all when one "
                    "fails. Example: mirrorax launch --nprocs 2 --cpu-devices-per-proc 4 -- python train.py")
    p.add_argument("--nprocs", "-n", type=int, required=True, help="how many processes to start")
    p.add_argument("--cpu-devices-per-proc", type=int, default=None, metavar="K",
                   help="give each process K simulated CPU devices (CPU-only machines)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="R",
                   help="restart the whole group up to R times after a failure (default 0; with --min-nprocs, "
                        "enough to leave out each process it may drop); restarts resume from the newest snapshot "
                        "(MIRRORAX_SNAPSHOT_DIR, made for the launch) or checkpoint")
    p.add_argument("--min-nprocs", type=int, default=None, metavar="M",
                   help="elastic: a process that failed twice is left out and the group restarts on the processes "
                        "left, with the same global batch and data order, while at least M are left (default: "
                        "--nprocs, none left out)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--failure-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="bound on how long processes outlive a dead peer (default 60; sets the "
                        "heartbeat timeout to half of it)")
    p.add_argument("--grace", type=float, default=TERM_GRACE_SECONDS, metavar="SECONDS",
                   help="after SIGTERM to the launcher, how long the processes have to save and exit "
                        f"before SIGKILL (default {TERM_GRACE_SECONDS:g}); SIGTERM is forwarded to them, a "
                        "second SIGTERM changes nothing, Ctrl-C (SIGINT) cuts the grace period short")
    p.add_argument("--watchdog", type=float, default=WATCHDOG_SECONDS, metavar="SECONDS",
                   help="end the group when no process made progress (a step, a batch, a callback) for this "
                        f"long, naming the rank furthest behind with its Python stack (default {WATCHDOG_SECONDS:g}; "
                        "0 turns it off; compiling and checkpoint saves do not count); raise it above the longest "
                        "input stall or step")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Runs ``mirrorax launch`` from parsed arguments; returns the exit status."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        return launch(command, args.nprocs, cpu_devices_per_proc=args.cpu_devices_per_proc,
                      max_restarts=args.max_restarts, min_nprocs=args.min_nprocs, port=args.port,
                      failure_timeout=args.failure_timeout, grace=args.grace, watchdog=args.watchdog)
    except ValueError as e:
        print(f"mirrorax launch: error: {e}", file=sys.stderr)
        return 2


def launch(cmd: Sequence[str], nprocs: int, *, cpu_devices_per_proc: int | None = None,
           max_restarts: int | None = None, min_nprocs: int | None = None, port: int | None = None,
           failure_timeout: float = 60.0, grace: float = TERM_GRACE_SECONDS, watchdog: float = WATCHDOG_SECONDS,
           env: Mapping[str, str] | None = None, out: IO[str] | None = None) -> int:
    """Runs ``cmd`` as ``nprocs`` processes of one job and waits for them.

    Args:
      cmd: the command every process runs, e.g. ``["python", "train.py"]``.
      nprocs: how many processes.
      cpu_devices_per_proc: simulated CPU devices per process (sets ``JAX_PLATFORMS=cpu``); refused
        on a machine with accelerators.
      max_restarts: how many times to restart the whole group after a failure; children that exit
        with ``PREEMPTED_EXIT_CODE`` count as one. Never after the launcher itself got SIGINT/SIGTERM.
        ``None``: 0, or with ``min_nprocs`` enough to leave out each process it may drop
        (:func:`mirrorax.cluster.restarts.default_max_restarts`). With restarts, the children get a snapshot
        directory (``MIRRORAX_SNAPSHOT_DIR``, removed when the launch ends) and resume from it.
      min_nprocs: elastic: a process (a slot) that failed twice is left out and the group restarts on the
        processes left, as long as ``min_nprocs`` are (``None``: ``nprocs``, none left out). The global
        batch and the data order do not depend on the process count: the run ends with the same numbers.
      port: the coordinator port; ``None`` picks a free one for every attempt.
      failure_timeout: seconds within which the processes stop after one dies: children get half of
        it as ``MIRRORAX_HEARTBEAT_TIMEOUT`` (unless ``env`` sets one); the launcher stops the rest at once.
      grace: after SIGTERM to the launcher, seconds the children (sent SIGTERM) have to exit before
        SIGKILL. A second SIGTERM changes nothing (a save in progress finishes); SIGINT ends the wait.
      watchdog: seconds the group may go without progress before the launcher ends it, naming the rank
        furthest behind and printing its Python stack; ``0`` turns the watchdog off. Each process reports
        its progress (:mod:`mirrorax.cluster.watchdog`); a rank that exits, or starts exiting, while the others
        wait for it in a step ends the group after ``EXIT_SETTLE_SECONDS``. Children also get
        ``MIRRORAX_INIT_TIMEOUT`` = ``watchdog`` + 30 (unless ``env`` sets it), so that a rank that never
        joins is named by the watchdog.
      env: the children's base environment (default ``os.environ``).
      out: where the children's prefixed output and the launcher's messages go (default stdout).

    Returns:
      0 when every process exits 0; else the failed rank's exit code (128 + signal when killed by a
      signal). After Ctrl-C (SIGINT): 130. After SIGTERM: ``PREEMPTED_EXIT_CODE`` (143, "preempted,
      requeue") when every process stopped with it (or was ended by the SIGTERM itself) or finished;
      0 when every one finished; else the code of the first that failed otherwise, 137 for one still
      running after ``grace`` (SIGKILLed). ``WATCHDOG_EXIT_CODE`` (124) when the watchdog ended a stuck
      group; a rank that exited 0 while the others still trained counts as failed with status 1.

    Raises:
      ValueError: bad arguments, a command that cannot be started, or ``cpu_devices_per_proc`` on a
        machine with accelerators.

    Example:
      >>> launch(["python", "-c", "print('hi')"], 2)  # doctest: +SKIP
      [rank 0] hi
      [rank 1] hi
      0
    """
    cmd = list(cmd)
    if not cmd:
        raise ValueError(f"No command to launch: received cmd={cmd!r}. Put it after --, e.g. "
                         "mirrorax launch --nprocs 2 -- python train.py")
    check_int("nprocs", nprocs, 1)
    if min_nprocs is None:
        min_nprocs = nprocs
    check_int("min_nprocs", min_nprocs, 1)
    if min_nprocs > nprocs:
        raise ValueError(f"min_nprocs must be at most nprocs ({nprocs}); received min_nprocs={min_nprocs}. Pass "
                         "e.g. --nprocs 4 --min-nprocs 2 to go on with 2 or 3 processes when some keep failing.")
    if max_restarts is None:
        max_restarts = default_max_restarts(nprocs, min_nprocs)
    check_int("max_restarts", max_restarts, 0)
    if nprocs > MAX_NPROCS:
        raise ValueError(
            f"nprocs must be at most {MAX_NPROCS} (every process runs on this machine); received {nprocs}. "
            "Start one process per accelerator or per few CPU cores, e.g. --nprocs 2 --cpu-devices-per-proc 4; "
            "for a job over several machines start the processes with your scheduler (srun, mpirun, TF_CONFIG).")
    if not watchdog >= 0:
        raise ValueError(f"watchdog must be >= 0 seconds (0 turns it off); received {watchdog!r}.")
    if cpu_devices_per_proc is not None:
        check_int("cpu_devices_per_proc", cpu_devices_per_proc)
        found = accelerators_present()
        if found:
            raise ValueError(
                f"--cpu-devices-per-proc simulates devices on the CPU, but this machine has accelerators "
                f"({', '.join(found)}). Drop the flag: each process then trains on its accelerators "
                "(or hide them yourself, e.g. CUDA_VISIBLE_DEVICES='', and set JAX_PLATFORMS=cpu).")
    if failure_timeout <= 0:
        raise ValueError(f"failure_timeout must be > 0 seconds; received {failure_timeout!r}.")
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds; received {grace!r}.")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535; received {port!r}.")
    out = out or sys.stdout
    base = dict(os.environ if env is None else env)
    restarts = Restarts(nprocs, min_nprocs, max_restarts, base)
    group = _Group(cmd, nprocs, base, cpu_devices_per_proc, failure_timeout, grace, out, watchdog, restarts)
    code, why = 1, ""
    try:
        with _forward_signals(group):
            for attempt in range(max_restarts + 1):
                group.nprocs = len(restarts.slots)
                group.restarts_left = attempt < max_restarts
                code = group.run(port if port is not None else free_port(), attempt)
                if code == 0 or group.interrupted:
                    return code
                if attempt == max_restarts:
                    why = restarts.used_up() if max_restarts else ""
                    break
                plan = restarts.after_failure(group.failures)
                if plan is None:
                    why = restarts.stopped
                    break
                group.say(f"{plan} (restart {attempt + 1} of {max_restarts})")
        if why:  # the last line: why the job ends unfinished, and how to go on from where it was
            kept = restarts.keep()
            resume = (f" Its snapshots are kept in {kept}: run again with MIRRORAX_SNAPSHOT_DIR={kept} to resume from "
                      "the newest." if kept else "")
            group.say(f"stopped: {why}; exit status {code}.{resume}")
        return code
    finally:
        group.close()
        restarts.close()


def free_port() -> int:
    """A TCP port that nothing listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Group:
    """One attempt at a time: start N children, stream their output, stop all when one fails."""

    def __init__(self, cmd: list[str], nprocs: int, env: dict[str, str], cpu_devices: int | None,
                 failure_timeout: float, term_grace: float, out: IO[str], watchdog: float = WATCHDOG_SECONDS,
                 restarts: Restarts | None = None) -> None:
        self.cmd, self.nprocs, self.env, self.cpu_devices = cmd, nprocs, env, cpu_devices
        self.restarts = restarts
        # The processes that failed first in the last attempt: rank, how (in words) and exit status (None: stopped).
        self.failures: list[tuple[int, str, int | None]] = []
        self.failure_timeout, self.term_grace, self.out = failure_timeout, term_grace, out
        self.grace = min(2.0, failure_timeout / 4)
        self.restarts_left = False  # a failure of this attempt is restarted from: the others are stopped sooner
        # With restarts, processes that stand by for the next attempt, started once a group trains.
        self.standby = _standby.command(cmd) if restarts is not None and restarts.max_restarts and \
            _standby.enabled(env) else None
        self.spares: list[subprocess.Popen[bytes]] = []
        self.verbose = verbose(env)
        self.children: list[subprocess.Popen[bytes]] = []
        self.interrupted: int | None = None
        self.hurry = False  # SIGINT after SIGTERM: stop waiting for the children to exit by themselves
        self.repeated = False  # a second SIGTERM: said once, changes nothing
        self.watchdog = watchdog
        self.progress_dir = ""
        self.capture: list[list[str] | None] = []  # per rank: its lines after the watchdog asked for its stack
        self.lock = threading.Lock()

    def say(self, message: str) -> None:
        with self.lock:
            self.out.write(f"mirrorax launch: {message}\n")
            self.out.flush()

    def base_env(self) -> dict[str, str]:
        """What every process of every attempt is given (a standby process starts with it)."""
        env = dict(self.env)
        env.update(PYTHONUNBUFFERED="1", MIRRORAX_LAUNCHED="1")  # the launcher filters the output: the child need not
        env.setdefault("MIRRORAX_HEARTBEAT_TIMEOUT", str(max(2, int(self.failure_timeout // 2))))
        # The watchdog's launcher; faulthandler prints the Python stack of a rank it sends SIGABRT.
        env[_watchdog.LAUNCHER_PID_ENV] = str(os.getpid())
        env.setdefault("PYTHONFAULTHANDLER", "1")
        if self.watchdog:
            env.setdefault("MIRRORAX_INIT_TIMEOUT", str(int(self.watchdog) + 30))
        if self.cpu_devices is not None:
            env.update(MIRRORAX_CPU_DEVICES=str(self.cpu_devices), JAX_NUM_CPU_DEVICES=str(self.cpu_devices),
                       JAX_PLATFORMS="cpu")
        return env

    def place(self, rank: int, port: int, attempt: int) -> dict[str, str]:
        """What the process of ``rank`` is told of its place in this attempt's group."""
        place = dict(MIRRORAX_COORDINATOR=f"127.0.0.1:{port}", MIRRORAX_NUM_PROCESSES=str(self.nprocs),
                     MIRRORAX_PROCESS_ID=str(rank), MIRRORAX_RESTART=str(attempt))
        if self.restarts is not None:  # its slot, and what the last attempt lost
            place.update(self.restarts.env(rank))
        place[_watchdog.PROGRESS_DIR_ENV] = self.progress_dir  # progress for the watchdog
        return place

    def child_env(self, rank: int, port: int, attempt: int) -> dict[str, str]:
        return {**self.base_env(), **self.place(rank, port, attempt)}

    def adopt(self, spares: list[subprocess.Popen[bytes]], rank: int, port: int, attempt: int
              ) -> subprocess.Popen[bytes] | None:
        """A standby process of ``spares`` given its place as ``rank`` (one that died is ended), or ``None``."""
        while spares:
            spare = spares.pop(0)
            if spare.poll() is None and spare.stdin is not None:
                try:
                    spare.stdin.write(json.dumps(self.place(rank, port, attempt)).encode() + b"\n")
                    spare.stdin.close()
                    return spare
                except OSError:  # it died just now
                    pass
            _end(spare)
        return None

    def stand_by(self, count: int) -> None:
        """Starts ``count`` standby processes for the next attempt (:mod:`mirrorax.cluster.standby`)."""
        assert self.standby is not None
        for _ in range(count):
            try:
                self.spares.append(subprocess.Popen(
                    _die_with(os.getpid(), self.standby), env=self.base_env(), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, stdin=subprocess.PIPE, start_new_session=True))
            except OSError:  # the next attempt starts its processes afresh
                break

    def close(self) -> None:
        """Ends the standby processes nobody needs (the launch ends)."""
        spares, self.spares = self.spares, []
        for spare in spares:
            _end(spare)

    def run(self, port: int, attempt: int) -> int:
        self.progress_dir = tempfile.mkdtemp(prefix="mirrorax-progress-")
        try:
            return self._run(port, attempt)
        finally:
            shutil.rmtree(self.progress_dir, ignore_errors=True)

    def _run(self, port: int, attempt: int) -> int:
        self.failures = []
        tails: list[collections.deque[str]] = [collections.deque(maxlen=TAIL_LINES) for _ in range(self.nprocs)]
        self.children, readers = [], []
        self.capture = [None] * self.nprocs
        self.lost: set[int] = set()  # ranks whose output said at some point that they lost a peer
        program = self.cmd[0]
        if shutil.which(program) is None:  # the children exec it through a small starter: check it here
            why = "Permission denied" if os.path.exists(program) else "No such file or directory"
            raise _cannot_run(program, why)
        spares, self.spares = self.spares, []
        for rank in range(self.nprocs):
            try:
                # Each child in its own session (its group is stopped as one), ended with the launcher.
                child = self.adopt(spares, rank, port, attempt) or subprocess.Popen(
                    _die_with(os.getpid(), self.cmd), env=self.child_env(rank, port, attempt), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                self.stop_all()
                raise _cannot_run(program, e.strerror or str(e)) from None
            self.children.append(child)
            reader = threading.Thread(target=self._pump, args=(rank, child, tails[rank]), daemon=True)
            reader.start()
            readers.append(reader)
        failed: tuple[int, int] | None = None
        stuck: tuple[int, str] | None = None
        progress = _watchdog.Progress(self.progress_dir, self.nprocs, self.watchdog)
        for spare in spares:  # (more than this group needs)
            _end(spare)
        while failed is None and self.interrupted is None and stuck is None:
            codes = [c.poll() for c in self.children]
            failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
            if all(c == 0 for c in codes):
                break
            if failed is None and self.watchdog:
                stuck = progress.check(codes)
            if self.standby is not None and self.restarts_left and not self.spares and progress.training():
                self.stand_by(len(self.restarts.slots) if self.restarts is not None else self.nprocs)
            time.sleep(0.05)
        if self.interrupted == signal.SIGTERM:
            return self.terminate(readers, tails)
        if stuck is not None and self.interrupted is None:
            return self.end_stuck(*stuck, readers, tails)
        # A process stopped (SIGSTOP, Ctrl-Z, a debugger) answers nothing; seen now, before it is killed.
        frozen = {r for r, c in enumerate(self.children) if c.poll() is None and _state(c.pid) in ("T", "t")}
        if failed is not None and (failed[1] > 0 or failed[1] in verdict.SURVIVOR_SIGNALS):
            # A process that raised exits 1; the others usually leave by themselves within a second, naming the
            # process that failed first (mirrorax.cluster.failure); let them, so that the report can name the right
            # rank.
            # An abort (or a crash in the collective) is how a survivor whose peer died ends: the peer's death
            # may reach us a moment after it (through a wrapper process, a later reap), and it is the one to name.
            self.wait_for(self.children, SETTLE_SECONDS)
        own = [c.poll() for c in self.children]
        during = self.stop_all()
        for reader in readers:
            reader.join(timeout=2.0)
        if self.interrupted is not None:
            self.say(f"interrupted by {signal.Signals(self.interrupted).name}; stopped all {self.nprocs} processes")
            return 128 + self.interrupted
        if failed is None:
            return 0
        # A death by an outside signal while the others were being stopped (several processes killed together
        # reach the launcher a few polls apart) is a failure of its own; a SIGTERM or SIGINT then was ours.
        seen = [o if o is not None or d is None or d in (0, -signal.SIGTERM, -signal.SIGINT) or d > 0 else d
                for o, d in zip(own, during)]
        found = verdict.causes(seen, tails, self.lost, verdict.first_failed(own, failed[0], self.lost), frozen)
        unhealthy = verdict.unhealthy(tails)
        hows = {r: self._how(r, seen[r], tails[r], frozen, unhealthy) for r in found}
        rank = found[0]
        what, code = hows[rank]
        code = code if code is not None else failed[1]
        self.failures = [(r, hows[r][0].removeprefix("failed (").removesuffix(")"), seen[r]) for r in found]
        also = ""
        if len(found) > 1:
            others = found[1:]
            also = (f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
                    f"{' and '.join(dict.fromkeys(hows[r][0] for r in others))} too")
        tail = "".join(f"    {line}\n" for line in tails[rank]) or "    (no output)\n"
        self.say(f"rank {rank} {what}{also}; stopped the other {self.nprocs - len(found)} process(es). "
                 f"Last lines of rank {rank}:\n{tail.rstrip()}")
        return 128 - code if code < 0 else code

    @staticmethod
    def _how(rank: int, code: int | None, tail: Sequence[str], frozen: Set[int], unhealthy: Set[int]
             ) -> tuple[str, int | None]:
        """How ``rank`` failed, in words, and its exit status (``None``: it ran until the launcher stopped it;
        a status 0 while the others trained counts as 1)."""
        if code:
            return f"failed ({verdict.describe(code)})", code
        if code == 0:  # it left by itself, status 0 (sys.exit(0) in a callback): never "stopped by us"
            said = verdict.own_words(tail)
            return f"exited (status 0{': ' + said if said else ''}) while the others still trained", 1
        if rank in frozen:
            return ("stopped answering (its process was stopped: SIGSTOP, Ctrl-Z or a debugger; the others "
                    "gave up on it when its heartbeats stopped)"), None
        if rank in unhealthy:
            return "stopped answering (it stopped sending heartbeats; the others gave up on it)", None
        return "failed (stopped by the launcher)", None

    def end_stuck(self, rank: int, why: str, readers: Sequence[threading.Thread],
                  tails: Sequence[collections.deque[str]]) -> int:
        """The watchdog's verdict: ``rank`` holds the group up. Its Python stack (faulthandler, on SIGABRT),
        then every process stopped, and a report naming it."""
        child = self.children[rank]
        code = child.poll()
        stack: list[str] = []
        if code is None:
            self.capture[rank] = stack
            try:
                os.kill(child.pid, signal.SIGABRT)  # PYTHONFAULTHANDLER=1: all its threads' stacks, then it ends
            except ProcessLookupError:
                pass
            self.wait_for([child], 5.0)
        self.stop_all()
        for reader in readers:
            reader.join(timeout=2.0)
        shown = [line for line in stack if not line.startswith(("Extension modules:", "[rank"))
                 and not _TRACE.match(line)][:80]
        if any(line.strip() for line in shown):
            where = "Its Python stack (every thread, most recent call first):\n" + "\n".join(f"    {x}" for x in shown)
        else:
            where = f"Last lines of rank {rank}:\n" + ("\n".join(f"    {x}" for x in tails[rank]) or "    (no output)")
        self.failures = [(rank, why, code)]
        self.say(f"rank {rank} {why}; stopped all {self.nprocs} processes. {where.rstrip()}")
        if code is not None:  # it exited by itself: its status, but never 0 (the job did not finish)
            return (128 - code if code < 0 else code) or 1
        return WATCHDOG_EXIT_CODE

    def terminate(self, readers: Sequence[threading.Thread], tails: Sequence[collections.deque[str]]) -> int:
        """After SIGTERM to the launcher: SIGTERM to every child, ``term_grace`` seconds to save and exit,
        SIGKILL for the rest; the exit status says whether the group can resume (see :func:`launch`)."""
        live = [c for c in self.children if c.poll() is None]
        self.say(f"received SIGTERM: forwarded it to the {len(live)} running process(es); they have "
                 f"{self.term_grace:g} s to save and exit (--grace)")
        for child in live:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.term_grace
        while any(c.poll() is None for c in live) and time.monotonic() < deadline and not self.hurry:
            if self.repeated:
                self.repeated = False
                self.say("received SIGTERM again: the processes keep their grace period (a checkpoint being "
                         "written is finished); press Ctrl-C (SIGINT) to kill them now")
            time.sleep(0.05)
        late = [r for r, c in enumerate(self.children) if c.poll() is None]
        for child in self.children:
            _signal_group(child, signal.SIGKILL)  # also reaps grandchildren left in the group
            child.wait()
        for reader in readers:
            reader.join(timeout=2.0)
        codes = [c.returncode for c in self.children]
        preempted = [r for r, c in enumerate(codes) if r not in late and c in (PREEMPTED_EXIT_CODE, -signal.SIGTERM)]
        failed = [r for r, c in enumerate(codes) if r in late or (c != 0 and r not in preempted)]
        if failed:
            rank = failed[0]
            if rank in late:
                when = "at the second signal" if self.hurry else f"{self.term_grace:g} s after SIGTERM (--grace)"
                what, code = f"was still running {when}: killed", 128 + signal.SIGKILL
            else:
                what, code = f"failed after SIGTERM ({verdict.describe(codes[rank])})", codes[rank]
            tail = "".join(f"    {line}\n" for line in tails[rank]) or "    (no output)\n"
            self.say(f"rank {rank} {what}. Last lines of rank {rank}:\n{tail.rstrip()}")
            return 128 - code if code < 0 else code
        if preempted:
            self.say(f"preempted: all {self.nprocs} processes stopped after SIGTERM; exit status "
                     f"{PREEMPTED_EXIT_CODE} (requeue the job to resume)")
            return PREEMPTED_EXIT_CODE
        self.say(f"all {self.nprocs} processes finished after SIGTERM")
        return 0

    def _pump(self, rank: int, child: subprocess.Popen[bytes], tail: collections.deque[str]) -> None:
        assert child.stdout is not None
        chatter = ChatterFilter()
        for raw in iter(child.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            captured = self.capture[rank]
            if captured is not None:  # the stack the watchdog asked for: in its report, not twice
                captured.append(line)
                continue
            self._show(rank, line if self.verbose else chatter.clean(line), tail)
        self._show(rank, chatter.flush(), tail)  # what gloo's last message cut off, if anything
        child.stdout.close()

    def _show(self, rank: int, line: str | None, tail: collections.deque[str]) -> None:
        if line is None:
            return
        if verdict.peer_lost(line):  # before the tail: every line a tail shows is counted here
            self.lost.add(rank)
        if not _TRACE.match(line):
            tail.append(line)
        prefix = f"[rank {rank}] " if self.nprocs > 1 else ""
        with self.lock:
            self.out.write(f"{prefix}{line}\n")
            self.out.flush()

    @staticmethod
    def wait_for(children: Sequence[subprocess.Popen[bytes]], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(c.poll() is None for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop_all(self) -> list[int | None]:
        """Stops every live child's process group: SIGINT after Ctrl-C (a chance to clean up), SIGTERM
        after a failure, then SIGKILL after the grace period (JAX's preemption notifier catches SIGTERM,
        and a process blocked in a collective cannot run Python handlers; :data:`RESTART_GRACE_SECONDS` when the
        group is restarted). Returns each child's status just before the SIGKILL (``None``: still running)."""
        live = [c for c in self.children if c.poll() is None]
        first = signal.SIGINT if self.interrupted else signal.SIGTERM
        for child in live:
            _signal_group(child, first)
        grace = min(self.grace, RESTART_GRACE_SECONDS) if self.restarts_left else self.grace
        self.wait_for(live, INTERRUPT_GRACE_SECONDS if self.interrupted else grace)
        before = [c.poll() for c in self.children]
        for child in self.children:
            _signal_group(child, signal.SIGKILL)  # also reaps grandchildren left in the group
            child.wait()
        return before


def _cannot_run(program: str, why: str) -> ValueError:
    return ValueError(f"Cannot run {program!r}: {why}. Give a command that exists, e.g. "
                      "`mirrorax launch --nprocs 2 -- python train.py`.")


def _has_prctl() -> bool:
    """Whether libc's ``prctl`` exists here (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL(None), "prctl")
    except OSError:
        return False


_PRCTL = _has_prctl()
# Runs in the child before the command, in a bare Python (no import of mirrorax or JAX: ~20 ms): SIGKILL when
# the launcher dies (PR_SET_PDEATHSIG = 1, kept across exec), never start if it already died, then exec.
# Not a ``preexec_fn``: that forks the launcher's Python (unsafe with its reader threads, and JAX warns on
# fork in a process that started it, as the tests' in-process launches do).
_DIE_WITH = ("import ctypes, os, signal, sys\n"
             "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
             "if os.getppid() != int(sys.argv[1]):\n    os._exit(1)\n"
             "try:\n    os.execvp(sys.argv[2], sys.argv[2:])\n"
             "except OSError as e:\n"
             "    print(f'mirrorax launch: cannot run {sys.argv[2]!r}: {e.strerror}', file=sys.stderr)\n"
             "    os._exit(127)\n")


def _die_with(launcher: int, cmd: Sequence[str]) -> list[str]:
    """``cmd`` started so that the child gets SIGKILL when the launcher dies (even by ``kill -9``), and never
    starts if the launcher already died (Linux; elsewhere ``cmd`` itself)."""
    if not _PRCTL:
        return list(cmd)
    return [sys.executable, "-S", "-c", _DIE_WITH, str(launcher), *cmd]


def _state(pid: int) -> str:
    """The one-letter state of a process (``R``, ``S``, ``T`` stopped, ...) from ``/proc``; ``""`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]  # after "pid (comm)": comm may hold spaces
    except (OSError, IndexError):
        return ""


def _end(child: subprocess.Popen[bytes]) -> None:
    """Kills ``child``'s process group and reaps it."""
    _signal_group(child, signal.SIGKILL)
    child.wait()


def _signal_group(child: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _forward_signals:
    """While the group runs, SIGINT/SIGTERM to the launcher mark it interrupted (the run loop then stops
    every child, with the same signal); a second signal cuts the wait short. Handlers can only be set
    from the main thread, elsewhere this does nothing."""

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.group.interrupted is None:
            self.group.interrupted = signum
        elif self.group.interrupted == signal.SIGTERM and signum == signal.SIGTERM:
            self.group.repeated = True  # a scheduler's repeated notice: the grace period stands
        else:
            self.group.hurry = True

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._handle)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mirrorax.cluster.launch --nprocs N -- COMMAND``: the launcher without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="mirrorax")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    add_parser(sub)
    args = parser.parse_args(["launch", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
