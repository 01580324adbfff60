"""The epoch loop's hooks: each per-step concern of ``Trainer.fit`` its own small unit.

The epoch (``Trainer._run_epoch``) is a plain loop: dispatch a step, place the next batch, then ask each
hook in turn what the step means for it, in the way levanter's ``Trainer`` runs its hooks. The hooks:

* :class:`BatchCallbacks`: Keras's ``on_train_batch_begin`` / ``on_train_batch_end``, once per execution;
* :class:`HaltWatch`: a glance, twice a second, at a finished step's sticky "training froze" flag (a
  non-finite step under ``on_nonfinite="raise"``, a label outside the classes);
* :class:`PreemptionStop`: on SIGTERM, the same step on every process: checkpoint and stop;
* :class:`PeriodicSave`: the checkpoint every ``checkpoint_every`` steps;
* :class:`ProgressHook`: the progress line.

A hook sees the loop's :class:`EpochRun` (the state after the step, the window of steps in flight, the
counts) and returns ``None`` to go on or an :class:`Outcome` that ends the epoch. Hooks that need the
devices to be done first (a checkpoint, a flag read) drain the window themselves; the others never wait.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from mirrorax.dispatch import InFlight
from mirrorax.step import host_value

if TYPE_CHECKING:
    from mirrorax import preemption
    from mirrorax import resume as resume_lib
    from mirrorax.hooks import Callbacks
    from mirrorax.progress import Progress
    from mirrorax.step import StepFunctions

__all__ = ["Outcome", "EpochRun", "EpochHook", "BatchCallbacks", "HaltWatch", "PreemptionStop", "PeriodicSave",
           "ProgressHook"]

PyTree = Any


class Outcome(enum.Enum):
    """How an epoch ended early."""

    STOP = "stop"  # a callback set model.stop_training
    HALT = "halt"  # training froze: a non-finite step (on_nonfinite="raise") or a bad label
    PREEMPT = "preempt"  # SIGTERM: saved (where asked) and stopping on every process


@dataclasses.dataclass
class EpochRun:
    """What the epoch loop knows after dispatching a step (the step itself may still be running).

    Attributes:
      state: the training state after the step (on its way: reading it waits for the step).
      window: the steps in flight; ``window.last_done`` is the newest finished step's ``aux``.
      start_batch: the epoch's first batch (non-zero when resuming mid-epoch).
      first_step: the state's step counter when the epoch started.
      total: batches in the epoch (``None``: until the data ends).
      steps: steps done in this call (after the newest); before: steps done before the newest.
      samples: real examples trained on in this call.
      aux: the newest step's outputs besides the state (its logs and flags, device values).
      last: whether the newest step used the epoch's last batch.
    """

    state: PyTree
    window: InFlight
    start_batch: int
    first_step: int
    total: int | None
    steps: int = 0
    before: int = 0
    samples: int = 0
    aux: Any = None
    last: bool = False

    @property
    def in_epoch(self) -> int:
        """The batch index within the epoch after the newest step."""
        return self.start_batch + self.steps

    @property
    def mid_epoch(self) -> bool:
        """Whether batches of this epoch remain after the newest step."""
        return not self.last and (self.total is None or self.in_epoch < self.total)


class EpochHook:
    """One per-step concern of the epoch loop. Both methods do nothing unless overridden."""

    def before_step(self, run: EpochRun) -> None:
        """Called before a step is dispatched."""

    def after_step(self, run: EpochRun) -> Outcome | None:
        """Called after a step is dispatched and the next batch placed; an outcome ends the epoch."""
        return None


class BatchCallbacks(EpochHook):
    """Keras's batch hooks, once per execution (``steps_per_execution``), a short last one too, as Keras.

    Args:
      hooks: the fit's callbacks. steps_per_execution: steps per execution.
      end_hook: ``(index, logs, state) -> state``: runs ``on_train_batch_end`` with the state exposed to the
        model, and returns the state to go on from (a callback may have changed the model).
      model: the Keras model (its ``stop_training`` flag) or any object.
    """

    def __init__(self, hooks: Callbacks, steps_per_execution: int, end_hook: Any, model: Any) -> None:
        self.hooks, self.spe, self.end_hook, self.model = hooks, steps_per_execution, end_hook, model
        self.begin = hooks.listens["train_begin"]
        self.end = hooks.listens["train_end"]
        self.changed = False  # the state was replaced by a callback: the loop looks its program up again

    def before_step(self, run: EpochRun) -> None:
        if self.begin and run.steps % self.spe == 0:
            self.hooks.call("on_train_batch_begin", run.start_batch + run.steps)

    def after_step(self, run: EpochRun) -> Outcome | None:
        if not self.end or not (run.steps % self.spe == 0 or run.last):
            return None
        # As Keras: an execution ends at begin + steps_per_execution - 1, a short last one too.
        index = run.start_batch + run.before - run.before % self.spe + self.spe - 1
        run.state = self.end_hook(index, run.aux["logs"], run.state)
        self.changed = True
        return Outcome.STOP if getattr(self.model, "stop_training", False) else None


class HaltWatch(EpochHook):
    """Looks, at most every ``interval`` seconds, at the newest finished step's ``halted`` flag.

    The flag is sticky (every later step carries it), so a glance now and then finds a frozen run
    without waiting on any step. Looked at in every ``on_nonfinite`` mode: a bad label halts whatever
    that mode says.
    """

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.last_look = time.perf_counter()

    def after_step(self, run: EpochRun) -> Outcome | None:
        done = run.window.last_done
        if done is None or time.perf_counter() - self.last_look <= self.interval:
            return None
        self.last_look = time.perf_counter()
        return Outcome.HALT if np.any(host_value(done["halted"])) else None


def _frozen(run: EpochRun, steps: StepFunctions) -> bool:
    """With every step done: whether training froze (a non-finite step under "raise", or a bad label)."""
    return bool(steps.on_nonfinite == "raise" and int(host_value(run.state.skipped))) or \
        steps.labels_halted(run.state)


class PreemptionStop(EpochHook):
    """On SIGTERM (seen by every process at the same step): checkpoint here and stop. At the epoch's last
    batch the epoch ends normally instead, and ``fit`` stops after its epoch-end checkpoint."""

    def __init__(self, watch: preemption.Watch, saver: resume_lib.Saver | None, steps: StepFunctions,
                 epoch: int) -> None:
        self.watch, self.saver, self.steps, self.epoch = watch, saver, steps, epoch

    def after_step(self, run: EpochRun) -> Outcome | None:
        if not (self.watch.reached() and run.mid_epoch):
            return None
        run.window.drain()
        if self.steps.on_nonfinite == "raise" and int(host_value(run.state.skipped)):
            return Outcome.HALT  # the frozen step is the error to report, not the preemption
        if self.saver is not None:
            self.saver.save(run.state, self.epoch, run.in_epoch)
        return Outcome.PREEMPT


class PeriodicSave(EpochHook):
    """The checkpoint every ``checkpoint_every`` steps (the epoch-end one is ``fit``'s), never of a frozen
    state."""

    def __init__(self, saver: resume_lib.Saver, steps: StepFunctions, epoch: int) -> None:
        self.saver, self.steps, self.epoch = saver, steps, epoch

    def after_step(self, run: EpochRun) -> Outcome | None:
        if not (self.saver.due(run.first_step + run.before, run.first_step + run.steps)
                and (run.total is None or run.in_epoch < run.total)):
            return None
        run.window.drain()
        if _frozen(run, self.steps):
            return Outcome.HALT
        self.saver.save(run.state, self.epoch, run.in_epoch)
        return None


class ProgressHook(EpochHook):
    """The progress line (Keras's format), redrawn at most twice a second."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def after_step(self, run: EpochRun) -> Outcome | None:
        self.progress.update(run.in_epoch, run.samples)
        return None
