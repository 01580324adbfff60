"""Snapshots: frequent, cheap copies of the training state on every node, beside the checkpoints.

A checkpoint goes to shared storage and takes a while to write; a lost worker would cost every step since
the last one. A snapshot is the whole state in each node's host memory or local disk
(``MIRRORAX_SNAPSHOT_DIR``; ``/dev/shm`` is memory), taken every ``MIRRORAX_SNAPSHOT_SECONDS`` (30) or
every ``MIRRORAX_SNAPSHOT_STEPS`` steps, so that a job restarted on its survivors loses only the steps
since the last one. Orbax's emergency (multi-tier) checkpointing is the model: local copies beside the
persistent ones, held by every node.

What a snapshot costs the step: a copy of the state on the first local device, dispatched without waiting
for the step, and for a state split over the devices (``shard=``) one all-gather, so that every node holds
every shard and any set of survivors holds the whole state. The copy to the host and the write run on one
writer thread per process, off the step's path (:mod:`mirrorax.checkpoint.snapshot_io`). The node's lowest process
writes; a node keeps its two newest complete snapshots per name, so memory and disk stay flat however long
the run. Each job's snapshots have a folder of their own (``<name>-<digest of the job>``): a job never
restores another's.

Every process decides the same steps (:mod:`mirrorax.checkpoint.policy`): every ``MIRRORAX_SNAPSHOT_STEPS``
steps, or, by the clock, process 0 measures its steps per second at each snapshot and tells the others the
next snapshot's step through JAX's coordination service (one key per snapshot, read at the snapshot:
nothing per step).

Restoring (:meth:`Snapshots.restore_latest`, every process together): each process reads its node's newest
complete snapshot that verifies (its records against their digest, its arrays against their checksums: a
damaged one is moved aside, with a warning, and the one before it taken), the processes agree on the newest
step any node holds, and the processes that hold it use their own copy while the others receive it from the
lowest holder (one collective). The state is then placed in the new job's layout: any process and device
count.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from mirrorax.checkpoint import snapshot_io as io
from mirrorax.checkpoint.errors import SnapshotError, SnapshotWarning
from mirrorax.checkpoint.policy import FIRST_STEPS, EveryNSeconds, EveryNSteps, SavePoint, SavePolicy
from mirrorax.checkpoint.record import Verify, job_differs
from mirrorax.checkpoint.snapshot_io import DIR_ENV, LOST_ENV, SECONDS_ENV, STEPS_ENV, node_name
from mirrorax.cluster.consistency import broadcast_from
from mirrorax.cluster.join import coordination_client
from mirrorax.cluster.preemption import announce
from mirrorax.cluster.restarts import restart_line
from mirrorax.cluster.watchdog import in_checkpoint, waiting_for_peers

__all__ = ["Snapshots", "SnapshotError", "SnapshotWarning", "DIR_ENV", "SECONDS_ENV", "STEPS_ENV", "LOST_ENV",
           "DEFAULT_SECONDS", "FIRST_STEPS", "node_name", "configured", "nodes", "group", "restart_line"]

#: Seconds between snapshots unless ``MIRRORAX_SNAPSHOT_SECONDS`` or ``MIRRORAX_SNAPSHOT_STEPS`` says.
DEFAULT_SECONDS = 30.0
AGREE_SECONDS = 600  # how long a process waits for the others at a snapshot or a restore

PyTree = Any


def configured() -> bool:
    """Whether ``MIRRORAX_SNAPSHOT_DIR`` asks for snapshots (``mirrorax launch`` and ``mirrorax.cluster.ray_train``
    set it)."""
    return bool(os.environ.get(DIR_ENV))


# -- the job's processes: which node each is on; exchanges through the coordination service ----------------------
_roster: list[str] = []
_rounds: dict[str, Iterator[int]] = {}  # per name, numbered alike on every process: each key is new


def _client() -> Any:
    client = coordination_client()
    if client is None:
        raise SnapshotError(
            f"Snapshots in a job of {jax.process_count()} processes agree through JAX's coordination service, "
            f"which this jax {jax.__version__} does not expose (jax._src.distributed.global_state.client; "
            "mirrorax is tested with jax 0.10). Unset MIRRORAX_SNAPSHOT_DIR to train without snapshots.")
    return client


def _key(name: str, what: str) -> str:
    return f"mirrorax/snapshot/{name}/{what}/{next(_rounds.setdefault(name, itertools.count()))}"


def _everyone(key: str, mine: Any) -> list[Any]:
    """Every process's ``mine`` (JSON), by process index."""
    n, pid = jax.process_count(), jax.process_index()
    if n == 1:
        return [mine]
    client = _client()
    client.key_value_set(f"{key}/{pid}", json.dumps(mine))
    with waiting_for_peers():
        return [mine if p == pid else json.loads(client.blocking_key_value_get(f"{key}/{p}", AGREE_SECONDS * 1000))
                for p in range(n)]


def _from(source: int, key: str, value: Any) -> Any:
    """Process ``source``'s ``value`` (JSON) on every process."""
    if jax.process_count() == 1:
        return value
    client = _client()
    if jax.process_index() == source:
        client.key_value_set(key, json.dumps(value))
        return value
    with waiting_for_peers():
        return json.loads(client.blocking_key_value_get(key, AGREE_SECONDS * 1000))


def nodes() -> list[str]:
    """The node of every process of the job, by process index (agreed once per process)."""
    if not _roster:
        _roster[:] = _everyone("mirrorax/snapshot/nodes", node_name())
    return _roster


def group(devices: int) -> dict[str, Any]:
    """The job as a snapshot records it: its processes, the devices its state is on, the node of each process."""
    return {"processes": jax.process_count(), "devices": devices, "nodes": list(nodes())}


def _writes() -> bool:
    """The node's lowest process writes its snapshots; the node's other processes read them."""
    roster = nodes()
    return roster.index(roster[jax.process_index()]) == jax.process_index()


class Snapshots:
    """Frequent snapshots of a training state on each node (host memory or local disk), restorable on any
    process and device count: what a job restarted on its survivors resumes from.

    ``fit`` takes them itself where ``MIRRORAX_SNAPSHOT_DIR`` is set (``mirrorax launch --min-nprocs`` and
    ``mirrorax.cluster.ray_train`` set it); a custom loop makes one and calls :meth:`maybe_save` after each step.
    Every process of a job calls :meth:`restore_latest`, :meth:`latest_step`, :meth:`maybe_save` and
    :meth:`save` at the same steps, as for :class:`mirrorax.Checkpointer`.

    A snapshot is read back only when verified whole (its records against their digest, number dtypes only,
    its arrays against their checksums, and ``verify``): one that is not is skipped with one
    :class:`SnapshotWarning` naming it, moved aside (``<step>.damaged``), and the node's snapshot before it
    is taken.

    Args:
      directory: where the snapshots go (each node in a subdirectory of its own); default
        ``MIRRORAX_SNAPSHOT_DIR``. Without one, snapshots are off: :meth:`maybe_save` does nothing and
        :meth:`restore_latest` returns ``None``.
      name: which of the program's runs these are (each ``fit`` of a script has its own): the same on every
        process and after a restart.
      every_seconds: seconds between snapshots (default ``MIRRORAX_SNAPSHOT_SECONDS``, else 30).
      every_steps: a snapshot at each step that is a multiple of this instead (``MIRRORAX_SNAPSHOT_STEPS``).
      job: what defines the job that takes them (JSON: its settings, e.g. ``{"learning_rate": 0.1}``), the same
        on every process and after a restart. Each job keeps its snapshots apart (``<name>-<digest>``) and
        never restores another's: finding only another job's, it starts afresh, with a
        :class:`SnapshotWarning` naming the setting that differs. ``None``: the snapshots are the run
        ``name``'s, whoever takes them.
      keep: the complete snapshots a node keeps (>= 1; 2: a damaged newest falls back to the one before).

    Raises:
      ValueError: ``every_steps`` < 1, ``every_seconds`` <= 0 (or such a variable), ``keep`` < 1.

    Example:
      >>> snapshots = mx.Snapshots("/dev/shm/run1", every_steps=50)
      >>> restored = snapshots.restore_latest(abstract_state)     # None: start afresh
      >>> start = 0 if restored is None else restored[0]
      >>> for step in range(start + 1, num_steps + 1):
      ...     state = train_step(state, batch_for(step))
      ...     snapshots.maybe_save(step, state)
      >>> snapshots.close()
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, name: str = "loop",
                 every_seconds: float | None = None, every_steps: int | None = None,
                 job: dict[str, Any] | None = None, keep: int = 2) -> None:
        self.base = os.fspath(directory) if directory is not None else (os.environ.get(DIR_ENV) or None)
        self.enabled = self.base is not None
        if self.base is not None:
            io.claim_launch_dir(self.base)  # (a launch's folder marked; those of killed launchers removed)
        self.name = str(name)
        self.job = None if job is None else json.loads(json.dumps(job))
        self.every_steps = every_steps if every_steps is not None else _env_number(STEPS_ENV, int)
        self.every_seconds = every_seconds if every_seconds is not None else (
            _env_number(SECONDS_ENV, float) or DEFAULT_SECONDS)
        if (self.every_steps is not None and not self.every_steps >= 1) or not self.every_seconds > 0:
            raise ValueError(f"Snapshots need every_steps >= 1 or every_seconds > 0; received every_steps="
                             f"{self.every_steps!r}, every_seconds={self.every_seconds!r}. Pass e.g. every_steps=100 "
                             "or every_seconds=30.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Snapshots keep at least 1 snapshot per node; received keep={keep!r}. Pass e.g. keep=2.")
        self.keep = keep
        #: When a snapshot is due: every ``every_steps`` steps, or every ``every_seconds`` by the clock (process 0's
        #: rate, agreed through the coordination service).
        self.policy: SavePolicy = EveryNSteps(int(self.every_steps)) if self.every_steps is not None else \
            EveryNSeconds(self.every_seconds, agree=lambda step: int(_from(0, _key(self.name, "next"), step)))
        self.last_step: int | None = None
        self._writer_here: bool | None = None  # whether this process writes its node's snapshots (asked once)
        self._reached: io.Reached | None = None
        self._loaded: tuple[int, dict[str, np.ndarray], dict[str, Any], dict[str, Any]] | None = None
        self.failure: BaseException | None = None  # the first write of these that failed (on the writer thread)
        self._said = False
        self._said_others = False
        self.last_held: dict[str, Any] = {}  # what held() agreed last (the newest step, who holds it, reached)
        self.say = True  # restore_latest says the restart on stderr (fit says its own, with the epoch)

    @functools.cached_property
    def directory(self) -> str:
        """This node's directory of these snapshots (``<base>/<node>/<name>``, ``-<digest of job>`` added)."""
        key = io.job_key(self.job)
        return os.path.join(self.base or "", node_name(), f"{self.name}-{key}" if key else self.name)

    @property
    def next_step(self) -> int | None:
        """By the clock: the next snapshot's step (agreed by every process; ``None`` before the first ask)."""
        return getattr(self.policy, "next_step", None)

    # -- when -------------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether a snapshot is due after step ``step`` (the same answer on every process). A yes is the decision:
        the caller takes it now (:meth:`save`), and by the clock the next one is planned from here."""
        if not self.enabled or step == self.last_step:
            return False
        point = SavePoint(step)
        if not self.policy.should_save(point):
            return False
        self.policy.saved(point)
        return True

    # -- taking one ---------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, state: PyTree, meta: dict[str, Any] | None = None, *, window: Any = None
                   ) -> bool:
        """Takes a snapshot of ``state`` after step ``step`` if one is due (:meth:`due`); True if it did."""
        self.reached(step)
        if self.due(step):
            self.save(step, state, meta, window=window)
            return True
        return False

    def reached(self, step: int) -> None:
        """Notes that the job reached step ``step``, so that a restart says exactly how many steps it lost: a
        store into a small file mapped into memory (no system call; it outlives a killed process)."""
        if self._writer_here is None:
            self._writer_here = self.enabled and _writes()
        if not self._writer_here:
            return
        if self._reached is None:
            try:
                os.makedirs(os.path.dirname(self.directory), exist_ok=True)
                self._reached = io.Reached(f"{self.directory}.reached")
            except OSError:
                self._writer_here = False  # (a directory that cannot be written: the snapshots say it)
                return
        self._reached.note(step)

    def save(self, step: int, state: PyTree, meta: dict[str, Any] | None = None, *, window: Any = None) -> None:
        """Takes a snapshot of ``state`` (a pytree of ``jax.Array``) after step ``step`` now: a copy on the
        devices; the copy to the host and the write happen on the writer thread. ``meta``: a JSON dict kept
        with it (e.g. the position in the data). ``window``: the strategy's ``in_flight``, drained before the
        gather of a split state."""
        if not self.enabled:
            return
        self._say_failure()
        named, _ = io.named_leaves(state)
        for path, a in named:
            if not isinstance(a, jax.Array):
                raise TypeError(f"Snapshots.save takes a pytree of jax.Array; received a leaf of type "
                                f"{type(a).__name__} at {path!r}. Place the state first (strategy.replicate, or the "
                                "state a strategy.jit step returns).")
        writes = self._writer_here = _writes()
        copies = io.on_one_device([a for _, a in named], window, copy=writes)
        if writes:
            for c in copies:
                c.copy_to_host_async()
            index = [{"path": p, "dtype": str(np.dtype(c.dtype)), "shape": list(c.shape), "key_impl": io.key_impl(a)}
                     for (p, a), c in zip(named, copies)]
            # The record as it is now (the caller goes on changing its lists), and JSON: said here, not later.
            devices = max((len(a.sharding.device_set) for _, a in named), default=0)
            record = {"step": step, "meta": json.loads(json.dumps(meta or {})), "group": group(devices),
                      "job": self.job}
            directory, keep = self.directory, self.keep
            io.writer().submit(lambda: self._write(directory, step, copies, index, record, keep))
        self.last_step = step

    def wait(self) -> None:
        """Waits until every snapshot taken is written (a failed write is a warning, not an error)."""
        if self.enabled:
            with in_checkpoint():
                io.writer().wait()
            self._say_failure()

    def close(self) -> None:
        """:meth:`wait` (the writer thread is the process's, kept for the next ones)."""
        self.wait()

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, *args: Any) -> None:
        """On the writer thread: one snapshot written, or its failure kept (said by the next call here)."""
        try:
            io.write(*args)
        except Exception as exc:  # noqa: BLE001 - a full disk, a bad path: said once, training goes on
            self.failure = self.failure or exc

    def _say_failure(self) -> None:
        failure = self.failure
        if failure is not None and not self._said:
            self._said = True
            warnings.warn(f"A snapshot could not be written to {self.directory}: {type(failure).__name__}: {failure}. "
                          "Training goes on; a restart would resume from an older snapshot or checkpoint. Point "
                          "MIRRORAX_SNAPSHOT_DIR at a local disk with room for the state.", SnapshotWarning,
                          stacklevel=3)

    # -- restoring -----------------------------------------------------------------------------------------------
    def held(self, verify: Verify | None = None) -> dict[str, Any]:
        """What the nodes hold, agreed by every process (every process calls it together): ``step`` (the newest
        good snapshot any node holds, ``None``: none), ``holders`` (the processes whose node holds it) and
        ``reached`` (the newest step the job that took it reached, ``-1``: unknown). ``verify``: the record's
        own check (see :meth:`restore_latest`)."""
        local = self._newest_here(verify, _writes())
        mine = {"step": -1 if local is None else local, "reached": self._reached_here()}
        every = _everyone(_key(self.name, "held"), mine)
        newest = max(e["step"] for e in every)
        self.last_held = {"step": None if newest < 0 else newest, "reached": max(e["reached"] for e in every),
                          "holders": [p for p, e in enumerate(every) if e["step"] == newest]}
        if newest < 0 and self.job is not None and jax.process_index() == 0 and not self._said_others:
            self._said_others = True
            self._say_other_jobs()
        return self.last_held

    def latest_step(self, verify: Verify | None = None) -> int | None:
        """The newest step any node holds a good snapshot of (every process calls it together)."""
        if not self.enabled:
            return None
        return self.held(verify)["step"]

    def restore_latest(self, abstract_state: PyTree, verify: Verify | None = None
                       ) -> tuple[int, PyTree, dict[str, Any]] | None:
        """``(step, state, meta)`` of the newest good snapshot any node holds, placed as ``abstract_state`` (a tree
        of ``jax.ShapeDtypeStruct`` with this run's shardings) says; ``None`` when there is none. Every process
        calls it together. ``meta`` is the dict given to :meth:`save`, with ``"group"`` (the job that took the
        snapshot: its processes, devices and nodes) and ``"reached"`` (the newest step that job reached).

        Args:
          abstract_state: the state's tree of ``jax.ShapeDtypeStruct`` with this run's shardings.
          verify: the record's own check, ``verify(meta, step)``: ``None`` when the ``meta`` given to
            :meth:`save` (verified against its digest already) is one to resume from, else the sentence saying
            what is wrong (a snapshot it refuses is damaged: skipped, moved aside, the one before taken).

        Raises:
          SnapshotError: the snapshot holds another model's state (a variable's path, shape or dtype).
        """
        if not self.enabled:
            return None
        held = self.held(verify)
        step = held["step"]
        if step is None:
            return None
        named, treedef = io.named_leaves(abstract_state)
        source = held["holders"][0]
        if len(held["holders"]) == jax.process_count():  # every node holds it: no transfer
            arrays, impls, record = self._checked(step, named, verify)
        else:
            mine = self._checked(step, named, verify) if jax.process_index() == source else None
            with waiting_for_peers():
                arrays = broadcast_from(mine[0] if mine is not None else
                                        {p: np.zeros(*io.stored_like(a)) for p, a in named}, source)
            impls, record = _from(source, _key(self.name, "record"), None if mine is None else [mine[1], mine[2]])
        self._loaded = None
        leaves = [io.place(arrays[p], a, impls.get(p)) for p, a in named]
        meta = dict(record.get("meta", {}))
        meta.update(group=record.get("group", {}), reached=held["reached"])
        held.update(group=meta["group"], meta=meta)
        if self.say:
            devices = max((len(a.sharding.device_set) for _, a in named), default=0)
            line = restart_line(f"{self.name!r}", f"snapshot step {step}", step, meta, devices, jax.process_count(),
                                nodes())
            announce(line, jax.process_index() == 0)
        return step, jax.tree.unflatten(treedef, leaves), meta

    def _checked(self, step: int, named: list[tuple[str, Any]], verify: Verify | None
                 ) -> tuple[dict[str, np.ndarray], dict[str, str | None], dict[str, Any]]:
        """Snapshot ``step`` of this node (read once), checked against the model's variables."""
        if self._loaded is not None and self._loaded[0] == step:
            arrays, entries, record = self._loaded[1:]
        else:
            arrays, entries, record = self._read(step, verify)
        for path, a in named:
            entry = entries.get(path)
            shape, dtype = io.stored_like(a)
            if entry is None or (tuple(entry["shape"]), entry["dtype"]) != (shape, str(np.dtype(dtype))):
                got = "missing" if entry is None else f"shape={tuple(entry['shape'])} dtype={entry['dtype']}"
                raise SnapshotError(
                    f"Snapshot step {step} in {self.directory} holds another model's state: variable {path!r} is "
                    f"{got} there but shape={shape} dtype={np.dtype(dtype)} here. Build the same model to resume "
                    f"from it, or delete {self.base} to start afresh.")
        extra = sorted(set(entries) - {p for p, _ in named})
        if extra:
            raise SnapshotError(f"Snapshot step {step} in {self.directory} holds variable {extra[0]!r}, which this "
                                f"model does not have. Build the same model, or delete {self.base} to start afresh.")
        return arrays, {p: e.get("key_impl") for p, e in entries.items()}, record

    def _read(self, step: int, verify: Verify | None
              ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]], dict[str, Any]]:
        """Snapshot ``step`` of this node, verified (:func:`mirrorax.checkpoint.snapshot_io.read`), and of this job:
        the folder is the job's own, so a record that names another was copied in (damage, as any other)."""
        with in_checkpoint():
            arrays, entries, record = io.read(self.directory, step, verify)
        if self.job is not None and record.get("job") != self.job:
            raise SnapshotError(f"snapshot {self.directory}/{step}: it names another job "
                                f"({job_differs(record.get('job') or {}, self.job)})")
        return arrays, entries, record

    def _newest_here(self, verify: Verify | None, writer: bool) -> int | None:
        """This node's newest complete snapshot that reads back whole and verified (kept for the restore); each
        damaged one on the way is skipped and the one before it tried; the node's writer (``writer``) says it in
        one warning and moves it aside (the node's other processes skip it too)."""
        for step in io.complete_steps(self.directory):
            if self._loaded is not None and self._loaded[0] == step:
                return step
            self._loaded = None
            try:
                arrays, entries, record = self._read(step, verify)
            except SnapshotError as damaged:
                if writer:
                    target = io.move_aside(self.directory, step)
                    warnings.warn(f"{damaged}: skipped, moved to {target}; the snapshot before it is tried.",
                                  SnapshotWarning, stacklevel=4)
                continue
            self._loaded = (step, arrays, entries, record)
            return step
        self._loaded = None
        return None

    def _reached_here(self) -> int:
        return io.Reached.read(f"{self.directory}.reached")

    def _say_other_jobs(self) -> None:
        """These snapshots' job holds none here: says so once for each other job's snapshots found beside them
        (another job with the same MIRRORAX_SNAPSHOT_DIR), naming the setting that differs."""
        assert self.job is not None
        for where, job in io.other_jobs(os.path.dirname(self.directory), self.name, self.directory):
            differs = job_differs(job, self.job) if job else "it names no job (an older mirrorax)"
            warnings.warn(f"Snapshots of another job in {where} are not this job's and are ignored ({differs}): "
                          f"{self.name} starts afresh. Its snapshots go to {self.directory}; give each job its own "
                          "MIRRORAX_SNAPSHOT_DIR to keep them apart by name.", SnapshotWarning, stacklevel=5)


def _env_number(name: str, kind: type) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise ValueError(f"{name} must be a positive number; received {raw!r}.")
    return value
