"""Elastic ``fit``: its snapshots, where a restarted fit resumes, and the line that says what happened.

Under ``mirrorax launch --min-nprocs`` or ``mirrorax.cluster.ray_train`` (``MIRRORAX_SNAPSHOT_DIR`` set), each
``fit`` of a script takes snapshots (:mod:`mirrorax.checkpoint.snapshot`) of its state and its position in the data
(the epoch, the batch, the history so far: a checkpoint's record), named by the fit's place among the
script's fits (``fit1``, ``fit2``, ...: the same in a restarted script). A fit that ends takes one last
snapshot: a restarted script passes through its earlier fits at once, each with its final state and
history, and continues the one that was running from its newest snapshot, or from a checkpoint when that is
newer. The data position counts global batches of the same global batch size, so the restarted fit trains
on the batches the uninterrupted one would have, on any process and device count.

Process 0 then says, on stderr, the job before and after, which processes were lost, the step resumed from
and the steps lost::

    mirrorax: elastic restart: fit 1 continues on 3 processes (6 devices) from snapshot step 40 (epoch 3,
    batch 5); the job had 4 processes (8 devices); lost: process 1 (slot 1: killed by signal SIGKILL), its
    failure 2: left out; 3 steps lost (it had reached step 43).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax

from mirrorax.checkpoint.resume import Saver
from mirrorax.checkpoint.snapshot import Snapshots, configured, nodes
from mirrorax.cluster import preemption
from mirrorax.cluster.restarts import restart_line
from mirrorax.fit.epoch import EpochHook, EpochRun, Outcome

__all__ = ["FitSnapshots", "SnapshotHook", "ReachedHook"]


_fits = itertools.count(1)  # the fits of this process, in order: the same in every process, and after a restart


class FitSnapshots:
    """One ``fit``'s snapshots: when, what they hold (a checkpoint's record: :meth:`Saver.meta`), and the choice
    between them and a checkpoint when the fit resumes.

    Args:
      snapshots: the store, named after the fit's place among the script's fits.
      saver: makes the record of a step (the run's settings, the history, the input's position).
    """

    def __init__(self, snapshots: Snapshots, saver: Saver) -> None:
        self.snapshots, self.saver = snapshots, saver
        snapshots.say = False  # said here, with the epoch and batch (:meth:`said`)
        self.ordinal = int(snapshots.name.removeprefix("fit") or 0)

    @classmethod
    def start(cls, saver: Saver) -> FitSnapshots | None:
        """The snapshots of the fit starting now, or ``None`` where ``MIRRORAX_SNAPSHOT_DIR`` asks for none."""
        ordinal = next(_fits)
        return cls(Snapshots(name=f"fit{ordinal}"), saver) if configured() else None

    def hooks(self, epoch: int, order: Callable[[int], dict[str, Any] | None]) -> tuple[ReachedHook, SnapshotHook]:
        """The epoch loop's hooks for epoch ``epoch``: the first of its hooks, and one after the checkpoint's.
        ``order(batch)``: what the data order needs to read from that batch of the epoch on (Keras's order:
        the global generators' state, :meth:`mirrorax.inputs.streams.Stream.order_state`)."""
        return ReachedHook(self.snapshots), SnapshotHook(self, epoch, order)

    def meta(self, step: int, epoch: int, batch: int, order: dict[str, Any] | None) -> dict[str, Any]:
        """A snapshot's record: a checkpoint's (:meth:`Saver.meta`), and the data order's state when it has one."""
        meta = self.saver.meta(step, epoch, batch)
        if order is not None:
            meta["order_state"] = order
        return meta

    def at_epoch_end(self, state: Any, step: int, next_epoch: int, order: dict[str, Any] | None) -> None:
        """After an epoch's checkpoint: a snapshot at the next epoch's start, if one is due."""
        if self.snapshots.due(step):
            self.snapshots.save(step, state, self.meta(step, next_epoch, 0, order))

    def finish(self, state: Any, step: int, epochs: int) -> None:
        """The fit ended (its epochs, or a callback's stop): its last snapshot, marked as past its last epoch, so
        that a restarted script passes through this fit at once; then waits until it is written."""
        self.snapshots.save(step, state, self.meta(step, epochs, 0, None))
        self.snapshots.wait()

    def source(self, ckpt: Any) -> Any:
        """What the fit resumes from: these snapshots when they hold a newer step than the checkpoints, else
        ``ckpt`` (``None``: nothing to resume). Every process calls it together."""
        newest = self.snapshots.latest_step()
        saved = ckpt.latest_step() if ckpt is not None else None
        if newest is None or (saved is not None and saved >= newest):
            return ckpt
        return self.snapshots

    def said(self, step: int, epoch: int, batch: int, kind: str, done: bool, devices: int) -> None:
        """Says the restart (resumed from ``kind`` step ``step``, at ``epoch``'s ``batch``, on ``devices``; ``done``:
        the fit had ended), from process 0: every process reaches the same conclusion."""
        if done:
            line = (f"mirrorax: elastic restart: fit {self.ordinal} had ended before it (its {kind} step {step}): its "
                    "final state and history are restored.")
        else:
            held = self.snapshots.last_held
            facts = {"reached": held.get("reached", -1), "group": held.get("group") if kind == "snapshot" else None}
            line = restart_line(f"fit {self.ordinal}", f"{kind} step {step} (epoch {epoch + 1}, batch {batch})", step,
                                facts, devices, jax.process_count(), nodes())
        preemption.announce(line, jax.process_index() == 0)


class ReachedHook(EpochHook):
    """Notes each step dispatched, first of the loop's hooks (a callback of the step may be where the process
    dies): a restart says how many steps it lost."""

    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots

    def after_step(self, run: EpochRun) -> Outcome | None:
        self.snapshots.reached(run.first_step + run.steps)
        return None


class SnapshotHook(EpochHook):
    """Takes a fit's snapshot after a step when one is due, after the step's callbacks and checkpoint (at an
    epoch's last step: at the epoch's end, with its history). Costs a comparison per step."""

    def __init__(self, fit: FitSnapshots, epoch: int, order: Callable[[int], dict[str, Any] | None]) -> None:
        self.fit, self.epoch, self.order = fit, epoch, order

    def after_step(self, run: EpochRun) -> Outcome | None:
        snapshots, step = self.fit.snapshots, run.first_step + run.steps
        if run.mid_epoch and snapshots.due(step):
            meta = self.fit.meta(step, self.epoch, run.in_epoch, self.order(run.in_epoch))
            snapshots.save(step, run.state, meta, window=run.window)
        return None
