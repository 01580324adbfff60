"""A fit's saving, one object on its plan record: the two tiers it saves to, when each saves, and where a
resumed fit starts.

Two tiers behind one interface (:class:`Tier`: a store, the policy that says when it saves, how it saves):

* **durable**: the checkpoints (:class:`mirrorax.Checkpointer`, ``fit(checkpoint_dir=...)``), saved at each
  epoch's end, every ``checkpoint_every`` steps and at a preemption (SIGTERM), of a state that is not frozen;
* **local**: the snapshots (:class:`mirrorax.Snapshots`, ``MIRRORAX_SNAPSHOT_DIR``: an elastic job), every
  ``MIRRORAX_SNAPSHOT_STEPS`` steps or ``MIRRORAX_SNAPSHOT_SECONDS`` seconds and at the fit's end, without
  waiting for the step (:mod:`mirrorax.fit.elastic`).

When is a policy (:mod:`mirrorax.checkpoint.policy`), and both keep the same record beside the state
(:class:`mirrorax.checkpoint.resume.Record`: the position in the data, the run, the history), each with its
digest. The loop has one saving hook (:class:`SavingHook`); the epoch's end, the fit's end and its close are
one call each. :meth:`Saving.resume` takes the newest good record of either tier: each tier verifies its
records (their digests, arrays, and here the position against the step) and sets a damaged one aside with a
warning, falling back to the one before; a snapshot is newer than every checkpoint, or a checkpoint is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mirrorax.checkpoint import resume as resume_lib
from mirrorax.checkpoint.policy import AnyOf, EpochEnd, EveryNSteps, FitEnd, OnPreemption, SavePoint, SavePolicy
from mirrorax.checkpoint.record import position_wrong
from mirrorax.checkpoint.snapshot import Snapshots
from mirrorax.fit import elastic
from mirrorax.fit.epoch import EpochHook, EpochRun, Outcome
from mirrorax.results import History
from mirrorax.train_state import TrainState

__all__ = ["Tier", "Saving", "SavingHook", "check_every"]

PyTree = Any
Order = Callable[[], "dict[str, Any] | None"]  # the data order's state where the save is (snapshots keep it)


class Tier:
    """One tier of a fit's saving: a store (``"checkpoint"``: a :class:`mirrorax.Checkpointer`; ``"snapshot"``: a
    :class:`mirrorax.Snapshots`) and the policy that says when it saves.

    A checkpoint is of a state every step of which is done (the window drained, a frozen state never saved) and
    keeps no data order; a snapshot is taken without waiting for the step and keeps the data order's state."""

    def __init__(self, kind: str, store: Any, policy: SavePolicy) -> None:
        self.kind, self.store, self.policy = kind, store, policy
        self.durable = kind == "checkpoint"
        self.last: int | None = None

    def due(self, point: SavePoint) -> bool:
        """Whether this tier saves at ``point`` (never twice at one step)."""
        return point.step != self.last and self.policy.should_save(point)

    def save(self, point: SavePoint, state: TrainState, meta: dict[str, Any], window: Any) -> None:
        if self.durable:
            self.store.save(point.step, state, meta)
        else:
            self.store.save(point.step, state, meta, window=window)
        self.policy.saved(point)
        self.last = point.step

    def __repr__(self) -> str:
        return f"Tier({self.kind}, {self.policy!r})"


def check_every(every: Any) -> int | None:
    """``checkpoint_every``: ``"epoch"`` (``None``: the epoch's end only) or a number of steps >= 1."""
    if every == "epoch":
        return None
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ValueError(f"checkpoint_every must be 'epoch' or a number of steps >= 1; received {every!r}.")
    return int(every)


class Saving:
    """What a fit saves, where, and when: its tiers, the record kept with the state, the fit's place among the
    script's fits (its snapshots' name). Every process makes the same calls at the same steps.

    Args:
      record: makes the record of a step.
      checkpoints: the durable store (``None``: no ``checkpoint_dir``); ``every``: ``checkpoint_every`` in steps.
      snapshots: the local store (``None``: not an elastic job).
      ordinal: the fit's place among the script's fits.
    """

    def __init__(self, record: resume_lib.Record, checkpoints: Any = None, every: int | None = None,
                 snapshots: Snapshots | None = None, ordinal: int = 0) -> None:
        self.record, self.ordinal = record, ordinal
        self.checkpoints, self.snapshots = checkpoints, snapshots
        durable: list[SavePolicy] = [EpochEnd(), OnPreemption(), *([EveryNSteps(every)] if every else [])]
        self.tiers = [*([Tier("checkpoint", checkpoints, AnyOf(*durable))] if checkpoints is not None else []),
                      *([Tier("snapshot", snapshots, AnyOf(snapshots.policy, FitEnd()))] if snapshots is not None
                        else [])]

    @staticmethod
    def open_checkpoints(directory: Any, keep: int | None) -> Any:
        """The durable store of ``fit(checkpoint_dir=directory)`` (``None``: no directory), opened as early as can
        be: a directory that cannot be written, or that another live run holds, fails before anything compiles.

        Raises:
          CheckpointError: it is not writable, or another live run writes it.
        """
        if directory is None:
            return None
        from mirrorax.checkpoint.checkpointer import Checkpointer  # (Orbax: loaded by a fit that checkpoints)

        return Checkpointer(directory, keep=keep)

    @classmethod
    def open(cls, record: resume_lib.Record, checkpoints: Any, *, every: int | None,
             job: Callable[[str | None], dict[str, Any]]) -> Saving:
        """A fit's saving: ``checkpoints`` (:meth:`open_checkpoints`) and its snapshots when ``MIRRORAX_SNAPSHOT_DIR``
        asks for them (``job(checkpoint directory)``: the job they belong to, computed only then). On an error,
        ``checkpoints`` is closed."""
        ordinal = elastic.next_fit()
        directory = None if checkpoints is None else checkpoints.directory
        try:
            snapshots = elastic.fit_snapshots(ordinal, lambda: job(directory))
        except BaseException:
            if checkpoints is not None:
                checkpoints.close()
            raise
        return cls(record, checkpoints, every, snapshots, ordinal)

    @property
    def checkpoint_dir(self) -> str | None:
        """The durable tier's directory (``None``: no checkpoints)."""
        return None if self.checkpoints is None else self.checkpoints.directory

    # -- saving -------------------------------------------------------------------------------------------------
    def hook(self, epoch: int, order: Callable[[int], dict[str, Any] | None], *, preempted: Callable[[], bool],
             frozen: Callable[[TrainState], bool]) -> SavingHook:
        """The loop's saving hook for epoch ``epoch`` (see :class:`SavingHook`). ``order(batch)``: the data
        order's state to read from that batch of the epoch on; ``preempted()``: whether every process stops
        here (asked once per step, as JAX's preemption sync point wants); ``frozen(state)``: a state never to
        save."""
        return SavingHook(self, epoch, order, preempted, frozen)

    def reached(self, step: int) -> None:
        """Notes the step the job reached (a restart's "steps lost"): a store, every step."""
        if self.snapshots is not None:
            self.snapshots.reached(step)

    def save_due(self, point: SavePoint, state: TrainState | Callable[[], TrainState], epoch: int, batch: int,
                 order: Order, window: Any = None, frozen: Callable[[TrainState], bool] | None = None
                 ) -> Outcome | None:
        """Saves ``state`` to each tier due at ``point`` (batch ``batch`` of ``epoch``); a checkpoint first waits
        for every step in ``window`` and is never of a ``frozen`` state (``Outcome.HALT`` then). ``state`` may be a
        function giving it, called only when a tier is due (a loop holds its state as leaves between steps, and
        making the ``TrainState`` of them at every step cost the loop's host ~10 us a step)."""
        due = [tier for tier in self.tiers if tier.due(point)]
        if not due:
            return None
        if callable(state):
            state = state()
        if any(tier.durable for tier in due):
            if window is not None:
                window.drain()
            if frozen is not None and frozen(state):
                return Outcome.HALT
            # Named by the state's own counter, which a checkpoint's restore checks.
            point = SavePoint(int(state.host_counters()["step"]), point.epoch_end, point.preempted, point.fit_end)
        for tier in due:
            meta = self.record.meta(point.step, epoch, batch, None if tier.durable else order())
            tier.save(point, state, meta, window)
        return None

    def epoch_end(self, state: TrainState, next_epoch: int, order: Order) -> None:
        """An epoch ended (every step done, its history appended): what each tier saves there, as the start of
        epoch ``next_epoch``."""
        if self.tiers:
            point = SavePoint(int(state.host_counters()["step"]), epoch_end=True)
            self.save_due(point, state, next_epoch, 0, order)

    def finish(self, state: TrainState, epochs: int) -> None:
        """The fit ended (its epochs, or a callback's stop): its last snapshot, marked as past its last epoch, so
        that a restarted script passes through this fit at once; then waits until it is written."""
        if self.snapshots is not None:
            self.save_due(SavePoint(int(state.host_counters()["step"]), fit_end=True), state, epochs, 0, lambda: None)
            self.snapshots.wait()

    def close(self) -> None:
        """Waits for the snapshots being written, then for the checkpoints and closes them (their lock
        released). Raises a checkpoint's failed write (one line)."""
        try:
            if self.snapshots is not None:
                self.snapshots.wait()
        finally:
            if self.checkpoints is not None:
                self.checkpoints.close()

    # -- resuming -----------------------------------------------------------------------------------------------
    def resume(self, abstract: TrainState, history: History) -> tuple[resume_lib.Resumed, str, str] | None:
        """The newest good record of either tier, restored onto ``abstract`` (its history into ``history``), with
        its kind (``"checkpoint"``, ``"snapshot"``) and where it was; ``None``: nothing to resume from. Every
        process calls it together.

        Raises:
          CheckpointError: the record belongs to a run with another global batch, order or seed.
          CheckpointMismatchError, SnapshotError: it belongs to another model.
        """
        snapshots, checkpoints = self.snapshots, self.checkpoints
        held = snapshots.latest_step(position_wrong) if snapshots is not None else None
        newest_checkpoint = checkpoints.latest_step() if checkpoints is not None else None
        restored, kind = None, "snapshot"
        if checkpoints is not None and (held is None or (newest_checkpoint is not None and newest_checkpoint >= held)):
            restored, kind = checkpoints.restore_latest(abstract, verify=position_wrong), "checkpoint"
        if snapshots is not None and held is not None and (restored is None or restored[0] < held):
            restored, kind = snapshots.restore_latest(abstract, position_wrong), "snapshot"
        if restored is None:
            return None
        step, state, meta = restored
        where = self.checkpoint_dir if kind == "checkpoint" else snapshots.directory  # type: ignore[union-attr]
        resumed = resume_lib.accept(step, state, meta, f"{kind.capitalize()} step {step} in {where}",
                                    self.record.run, history)
        return resumed, kind, str(where)

    def say_restart(self, resumed: resume_lib.Resumed, kind: str, epochs: int, devices: int) -> None:
        """In an elastic job, the restart's line (see :mod:`mirrorax.fit.elastic`)."""
        elastic.say_restart(self.snapshots, self.ordinal, resumed.step, resumed.epoch, resumed.batch_in_epoch, kind,
                            resumed.epoch >= epochs, devices)

    def __repr__(self) -> str:
        return f"Saving(fit {self.ordinal}, {self.tiers!r})"


class SavingHook(EpochHook):
    """The loop's one saving hook. After each dispatched step (first of the hooks: a callback of the step may be
    where the process dies) it notes the step reached; before the next step is dispatched (so after the step's
    callbacks, which may change the state) it saves what each tier's policy asks for, mid-epoch (the epoch's
    end is :meth:`Saving.epoch_end`'s), and at a preemption saves and ends the epoch (``Outcome.PREEMPT``)."""

    def __init__(self, saving: Saving, epoch: int, order: Callable[[int], dict[str, Any] | None],
                 preempted: Callable[[], bool], frozen: Callable[[TrainState], bool]) -> None:
        self.saving, self.epoch, self.order, self.preempted, self.frozen = saving, epoch, order, preempted, frozen

    def after_step(self, run: EpochRun) -> Outcome | None:
        self.saving.reached(run.first_step + run.steps)
        return None

    def before_step(self, run: EpochRun) -> Outcome | None:
        if not run.steps:  # nothing dispatched in this loop yet
            return None
        preempted = self.preempted()
        if not run.mid_epoch:
            return None
        point = SavePoint(run.first_step + run.steps, preempted=preempted)
        batch = run.in_epoch
        if not preempted:
            return self.saving.save_due(point, lambda: run.state, self.epoch, batch, lambda: self.order(batch),
                                        run.window, self.frozen)
        run.window.drain()
        if self.frozen(run.state):
            return Outcome.HALT  # the frozen step is the error to report, not the preemption
        self.saving.save_due(point, run.state, self.epoch, batch, lambda: self.order(batch), run.window)
        return Outcome.PREEMPT
