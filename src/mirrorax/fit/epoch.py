"""The loop's hooks: each per-step concern of ``fit``, ``evaluate`` and ``predict`` its own small unit.

The loop (:mod:`mirrorax.fit.loop`) is plain: dispatch a step, place the next batch, push the step into the
strategy's window, then ask each hook in turn what the step means for it, in the way levanter's
``Trainer`` runs its hooks. The hooks:

* :class:`BatchCallbacks`: Keras's ``on_train_batch_begin`` / ``on_train_batch_end``, once per execution;
* :class:`EvalBatchCallbacks`, :class:`PredictBatchCallbacks`: the same for ``evaluate`` and ``predict``;
* :class:`HaltWatch`: a glance, twice a second, at a finished step's sticky "training froze" flag (a
  non-finite step under ``on_nonfinite="raise"``, a label outside the classes);
* :class:`ProgressHook`: the progress line;
* the fit's saving hook (:class:`mirrorax.fit.saving.SavingHook`): the step reached noted, what each tier
  saves, and on SIGTERM (the same step on every process) a checkpoint and the stop.

A hook sees the loop's :class:`EpochRun` (the state after the step, the window of steps in flight, the
counts) and returns ``None`` to go on or an :class:`Outcome` that ends the loop. Hooks that need the
devices to be done first (a checkpoint, a flag read) drain the window themselves; the others never wait.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mirrorax.steps.dispatch import InFlight

if TYPE_CHECKING:
    from mirrorax.fit.functions import StepFunctions
    from mirrorax.fit.hooks import Callbacks
    from mirrorax.fit.progress import Progress

__all__ = ["Outcome", "EpochRun", "EpochHook", "BatchCallbacks", "EvalBatchCallbacks", "PredictBatchCallbacks",
           "HaltWatch", "ProgressHook", "frozen"]

PyTree = Any


class Outcome(enum.Enum):
    """How an epoch ended early."""

    STOP = "stop"  # a callback set model.stop_training (stop_evaluating, stop_predicting)
    HALT = "halt"  # training froze: a non-finite step (on_nonfinite="raise") or a bad label
    PREEMPT = "preempt"  # SIGTERM: saved (where asked) and stopping on every process


class EpochRun:
    """What the loop (an epoch, an evaluation, a prediction) knows after dispatching a step (the step
    itself may still be running).

    Attributes:
      state: the training state after the step (on its way: reading it waits for the step). The train
        loop keeps it as its leaves between steps (:meth:`leaves`, :meth:`set_leaves`: the compiled step
        takes and gives them so) and makes the ``TrainState`` only when it is read.
      window: the strategy's window of steps in flight.
      start_batch: the epoch's first batch (non-zero when resuming mid-epoch).
      first_step: the state's step counter when the epoch started.
      total: batches in the epoch (``None``: until the data ends).
      metrics: the metric accumulators an evaluation carries from step to step (``None`` otherwise).
      steps: steps done in this call (after the newest); before: steps done before the newest.
      samples: real examples trained on in this call.
      aux: the newest step's outputs besides the state (its logs and flags, device values).
      last: whether the newest step used the epoch's last batch.
      last_done: the ``aux`` of this loop's newest finished step (``None`` before the first).
      relook: a hook replaced the state: the loop looks its program up again.
    """

    def __init__(self, state: PyTree, window: InFlight, start_batch: int = 0, first_step: int = 0,
                 total: int | None = None, metrics: PyTree = None) -> None:
        self._state: PyTree = state
        self._leaves: list[Any] | None = None
        self._treedef: Any = None
        self.window = window
        self.start_batch, self.first_step, self.total, self.metrics = start_batch, first_step, total, metrics
        self.steps = self.before = self.samples = 0
        self.aux: Any = None
        self.last = False
        self.last_done: Any = None
        self.relook = False

    @property
    def state(self) -> PyTree:
        if self._state is None and self._leaves is not None:
            self._state = self._treedef.unflatten(self._leaves)
        return self._state

    @state.setter
    def state(self, state: PyTree) -> None:
        self._state, self._leaves = state, None

    def leaves(self, treedef: Any) -> list[Any]:
        """The state's leaves, in ``treedef``'s order (the state must have that structure)."""
        if self._leaves is None or (self._treedef is not treedef and self._treedef != treedef):
            self._leaves, self._treedef = treedef.flatten_up_to(self.state), treedef
        return self._leaves

    def set_leaves(self, leaves: list[Any], treedef: Any) -> None:
        """The state after a step, as the leaves of a ``treedef`` state (made a ``TrainState`` when read)."""
        self._state, self._leaves, self._treedef = None, leaves, treedef

    def retire(self, aux: Any) -> None:
        """The window's ``on_done`` for this loop's steps: ``aux`` is the newest finished step's."""
        self.last_done = aux

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

    def before_step(self, run: EpochRun) -> Outcome | None:
        """Called before a step is dispatched; an outcome ends the loop before it."""
        return None

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
      logs: a step's ``aux`` -> its batch logs (:meth:`mirrorax.fit.functions.StepFunctions.batch_logs`).
    """

    def __init__(self, hooks: Callbacks, steps_per_execution: int, end_hook: Any, model: Any,
                 logs: Callable[[Any], Any]) -> None:
        self.hooks, self.spe, self.end_hook, self.model = hooks, steps_per_execution, end_hook, model
        self.logs = logs
        self.begin = hooks.listens["train_begin"]
        self.end = hooks.listens["train_end"]

    def before_step(self, run: EpochRun) -> Outcome | None:
        if self.begin and run.steps % self.spe == 0:
            self.hooks.call("on_train_batch_begin", run.start_batch + run.steps)
        return None

    def after_step(self, run: EpochRun) -> Outcome | None:
        if not self.end or not (run.steps % self.spe == 0 or run.last):
            return None
        # As Keras: an execution ends at begin + steps_per_execution - 1, a short last one too; a dispatch of
        # more steps than that ("auto" fused them) at its own last batch.
        index = run.start_batch + max(run.before - run.before % self.spe + self.spe, run.steps) - 1
        run.state = self.end_hook(index, self.logs(run.aux), run.state)
        run.relook = True  # a callback may have placed new values
        return Outcome.STOP if getattr(self.model, "stop_training", False) else None


class EvalBatchCallbacks(EpochHook):
    """Keras's ``on_test_batch_begin`` / ``on_test_batch_end`` in ``evaluate``, once per execution (a short
    last one too), as Keras; a callback's ``model.stop_evaluating`` ends the evaluation.

    Args:
      hooks: the callbacks. steps_per_execution: steps per execution.
      end_hook: ``(index, logs, run) -> state``: runs ``on_test_batch_end`` with the run's state and
        metrics exposed to the model; returns the state to go on from.
      model: the Keras model (its ``stop_evaluating`` flag) or any object.
    """

    def __init__(self, hooks: Callbacks, steps_per_execution: int,
                 end_hook: Callable[[int, Any, EpochRun], PyTree], model: Any) -> None:
        self.hooks, self.spe, self.end_hook, self.model = hooks, steps_per_execution, end_hook, model
        self.begin = hooks.listens["test_begin"]
        self.end = hooks.listens["test_end"]

    def before_step(self, run: EpochRun) -> Outcome | None:
        if self.begin and run.steps % self.spe == 0:
            self.hooks.call("on_test_batch_begin", run.steps)
        return None

    def after_step(self, run: EpochRun) -> Outcome | None:
        if not self.end or not (run.steps % self.spe == 0 or run.last):
            return None
        run.state = self.end_hook(run.before - run.before % self.spe + self.spe - 1, run.aux["logs"], run)
        run.relook = True
        return Outcome.STOP if getattr(self.model, "stop_evaluating", False) else None


class PredictBatchCallbacks(EpochHook):
    """Keras's ``on_predict_batch_begin`` in ``predict``, once per execution, and its ``model.stop_predicting``
    (the outputs, and ``on_predict_batch_end`` with them, come as each step leaves the window: see
    :mod:`mirrorax.fit.loop`).

    Keras calls ``on_predict_batch_end(k)`` before ``on_predict_batch_begin(k + 1)``: when both hooks
    listen, the window is drained before each execution's begin hook, so that the order shows as Keras's.
    """

    def __init__(self, hooks: Callbacks, steps_per_execution: int, model: Any) -> None:
        self.hooks, self.spe, self.model = hooks, steps_per_execution, model
        self.begin = hooks.listens["predict_begin"]
        self.end = hooks.listens["predict_end"]

    def before_step(self, run: EpochRun) -> Outcome | None:
        if self.begin and run.steps % self.spe == 0:
            if self.end and run.steps:
                run.window.drain()
                if getattr(self.model, "stop_predicting", False):
                    return Outcome.STOP
            self.hooks.call("on_predict_batch_begin", run.steps)
        return None

    def after_step(self, run: EpochRun) -> Outcome | None:
        return Outcome.STOP if getattr(self.model, "stop_predicting", False) else None


class HaltWatch(EpochHook):
    """Looks, at most every ``interval`` seconds, at the newest finished step's ``halted`` flag.

    The flag is sticky (every later step carries it), so a glance now and then finds a frozen run
    without waiting on any step. Looked at in every ``on_nonfinite`` mode: a bad label halts whatever
    that mode says.
    """

    def __init__(self, halted: Callable[[Any], bool], interval: float = 0.5) -> None:
        self.halted = halted  # a finished step's aux -> its flag (StepFunctions.halted)
        self.interval = interval
        self.last_look = time.perf_counter()

    def after_step(self, run: EpochRun) -> Outcome | None:
        done = run.last_done
        if done is None or time.perf_counter() - self.last_look <= self.interval:
            return None
        self.last_look = time.perf_counter()
        return Outcome.HALT if self.halted(done) else None


def frozen(state: PyTree, steps: StepFunctions) -> bool:
    """With every step done: whether training froze (a non-finite step under "raise", or a bad label): a state
    never to save."""
    return bool(steps.on_nonfinite == "raise" and int(state.host_counters()["skipped"])) or \
        steps.labels_halted(state)


class ProgressHook(EpochHook):
    """The progress line (Keras's format), redrawn at most twice a second."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def after_step(self, run: EpochRun) -> Outcome | None:
        self.progress.update(run.in_epoch, run.samples)
        return None
