"""One dispatched loop, shared by ``fit``'s epochs, ``evaluate`` and ``predict``.

Each step is a program of :class:`~mirrorax.fit.functions.StepFunctions` (public ``strategy.jit`` functions),
looked up once per kind of batch (its placed shape and real rows) and called directly; each call is
pushed into the strategy's one dispatch window (``strategy.in_flight``), so ``MirroredStrategy(
max_in_flight=k)`` bounds the Trainer's steps as it bounds a custom loop's. Per step the loop:
dispatches, places the next batch while the devices work, pushes (waiting for the step ``k - 1``
before), then asks its hooks (:mod:`mirrorax.fit.epoch`) what the step means for them. Values come to the
host only where a hook or the end of the loop needs them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from mirrorax import front_end
from mirrorax._host import host_tree, host_value
from mirrorax.cluster import consistency, preemption
from mirrorax.cluster.watchdog import COMPILING, HOOKS, IDLE, INPUT, STEP, beat, leaving
from mirrorax.fit import epoch as epoch_lib
from mirrorax.fit.device_state import DeviceState
from mirrorax.fit.fit_plan import FitPlan
from mirrorax.fit.functions import StepFunctions
from mirrorax.fit.hooks import Callbacks
from mirrorax.fit.meter import FitMeter
from mirrorax.fit.planner import fit_flops
from mirrorax.fit.progress import Progress
from mirrorax.inputs.batch import Batch
from mirrorax.inputs.prefetch import Prefetcher, device_batches, one_by_one
from mirrorax.inputs.source import Source
from mirrorax.inputs.streams import ran_out_of_data, within_pass
from mirrorax.results import NonFiniteLossError
from mirrorax.steps import first_call as _first_call
from mirrorax.train_state import TrainState

__all__ = ["Loop", "preempted"]

PyTree = Any
# (run, k, batch) -> (aux, ready): dispatches one step (k > 0: k stacked steps) and returns what the window
# keeps for it and what to wait on.
Dispatch = Callable[[epoch_lib.EpochRun, int, Batch], tuple[Any, Any]]


class Loop:
    """The loops of one model's training on one strategy.

    Args:
      device: the state on the devices (and the model it is lent to).
      steps: the compiled steps.
      model: the user's model (its ``stop_training`` / ``stop_evaluating`` / ``stop_predicting`` flags).
      prefetch: batches placed ahead on a background thread (0: synchronously, between dispatches).
      steps_per_execution: steps per dispatch in ``fit``; batch hooks once per execution everywhere.
      auto_steps: ``steps_per_execution="auto"``: ``fit`` picks the steps per dispatch as it runs
        (:mod:`mirrorax.fit.meter`); ``steps_per_execution`` is then 1.
    """

    def __init__(self, device: DeviceState, steps: StepFunctions, model: Any, *, prefetch: int,
                 steps_per_execution: int, auto_steps: bool = False) -> None:
        self.device = device
        self.steps = steps
        self.strategy = steps.strategy
        self.adapter = steps.adapter
        self.model = model
        self.prefetch = prefetch
        self.steps_per_execution = steps_per_execution
        self.auto_steps = auto_steps
        self.meter: FitMeter | None = None  # the running fit's figures (mirrorax.fit.meter)

    def device_batches(self, host: Iterator[Batch], group: int | Callable[[int], int], per_process: bool
                       ) -> Iterator[tuple[int, Batch]] | Prefetcher:
        """``host``'s batches placed on the devices (``group`` stacked per dispatch when > 1; a function: of the
        epoch's batch index a group starts at)."""
        return device_batches(host, group, self.strategy, prefetch=self.prefetch, per_process=per_process,
                              host_rows=self.steps.host_rows)

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, run: epoch_lib.EpochRun, batches: Callable[[], Iterator[tuple[int, Batch]]], dispatch: Dispatch,
            hooks: list[epoch_lib.EpochHook], *, on_done: Callable[[Any], None] | None = None,
            count: Callable[[int], int] | None = None) -> epoch_lib.Outcome | None:
        """Dispatches a step per batch of ``batches()`` until they end or a hook returns an outcome; then
        waits for every step. Returns that outcome (``None``: the data ended).

        The first step's ``before_step`` hooks run before ``batches()`` is called (Keras's fit calls
        ``on_train_batch_begin(0)`` before it reads the epoch's first batch). ``on_done(aux)`` runs as
        each step leaves the window; ``count(k)`` adds the examples of a dispatch to ``run.samples``.
        """
        window = run.window
        outcome: epoch_lib.Outcome | None = None
        placed: Any = None
        failed = True
        # Each beat tells mirrorax launch's watchdog where this process would be stuck (_watchdog).
        try:
            beat(HOOKS)
            outcome = _before_step(hooks, run)
            beat(INPUT)
            placed = batches()
            upcoming = next(placed, None) if outcome is None else None
            while upcoming is not None:
                k, batch = upcoming
                beat(STEP)
                aux, ready = dispatch(run, k, batch)
                # Place the next batch while this step and the previous one run, then wait for the
                # previous one: the host's copy overlaps the devices' work instead of following it.
                beat(INPUT)
                upcoming = next(placed, None)
                beat(STEP)
                window.push(aux, ready, on_done)
                run.before, run.steps = run.steps, run.steps + max(k, 1)
                if count is not None:
                    run.samples += count(k)
                run.last = upcoming is None
                beat(HOOKS)
                outcome = _after_step(hooks, run)
                if outcome is None and upcoming is not None:
                    outcome = _before_step(hooks, run)  # the next step's, once this one's are done
                if outcome is not None:
                    break
            beat(STEP)
            window.drain()
            failed = False
        except SystemExit as e:
            if not isinstance(e, preemption.Preempted):
                leaving(e.code)  # sys.exit in a callback or the input: one process leaves mid-step
            raise
        finally:
            beat(IDLE)
            if callable(getattr(placed, "close", None)):  # a Prefetcher's thread (or a meter's wrapper around it)
                placed.close()
            if failed:  # the strategy's window outlives this loop: leave none of its steps in it
                with contextlib.suppress(Exception):
                    window.drain()
        return outcome

    # -- fit ---------------------------------------------------------------------------------------
    def fit(self, plan: FitPlan) -> dict[str, float]:
        """The epochs of a prepared fit (:mod:`mirrorax.fit.fit_plan`), in Keras's order: ``on_train_begin``, then
        per epoch its callbacks, its steps, its validation, its checkpoint; returns the last finished epoch's
        logs (``{}``: none).

        Raises:
          Preempted: SIGTERM (or Ctrl-C) was seen, once the checkpoint is started.
        """
        device, hooks = self.device, plan.hooks
        if hasattr(self.model, "stop_training"):
            self.model.stop_training = False  # as Keras's fit: a flag left by an interrupted run
        # The fit's figures (MFU, busy and input shares; "auto"'s steps per dispatch): mirrorax.fit.meter.
        self.meter = FitMeter(self.model, self.strategy, fit_flops(self.steps),
                              steps_per_execution=self.steps_per_execution, auto=self.auto_steps,
                              prefetch=self.prefetch, source=plan.source, epochs=plan.epochs,
                              batch_size=plan.batch_size, previous=self.meter)
        hooks.call("on_train_begin")
        if plan.resumed:  # Keras's History (emptied by on_train_begin) holds the epochs run before the restart
            hooks.restore_history(plan.history)
        # A callback may say where to resume in on_train_begin (Keras's BackupAndRestore: Keras's fit reads
        # the epoch only then); its restored weights are adopted at on_epoch_begin.
        kind = front_end.of(self.model)
        restored = None
        if not plan.resumed and kind is not None and kind.initial_epoch is not None:
            restored = kind.initial_epoch(self.model)
        if restored:
            plan = plan.starting_at(restored)
        training_logs: dict[str, float] = {}
        for epoch in range(plan.start.epoch, plan.epochs):
            hooks.call("on_epoch_begin", epoch)
            device.adopt_callback_changes()  # e.g. a learning rate a callback set
            start_batch = plan.start.batch if epoch == plan.start.epoch else 0
            logs, progress, steps, samples = self.epoch(plan, epoch, start_batch)
            if plan.reading.ends_with_data and plan.steps_per_epoch and start_batch + steps < plan.steps_per_epoch \
                    and not getattr(self.model, "stop_training", False):
                ran_out_of_data()
            device.write_back()  # Keras syncs the model before validation: on_test_begin may read it
            if plan.validation is not None and plan.validate(epoch):
                vlogs = self.evaluate(plan.validation, plan.validation_batch_size, steps=plan.validation_steps,
                                      hooks=hooks, warn_short=plan.reading.ends_with_data)
                logs.update({f"val_{k}": v for k, v in vlogs.items()})
            sps = progress.finish(steps, samples, logs)
            plan.history.append(epoch, logs, sps)
            if consistency.debug_checks():
                consistency.check_replicas(device.value)
            following = plan.stream.epoch_span(epoch + 1 - plan.first_epoch, plan.steps_per_epoch)[0]
            plan.saving.epoch_end(device.live, epoch + 1, functools.partial(plan.stream.order_state, following))
            hooks.call("on_epoch_end", epoch, logs)
            training_logs = logs
            device.adopt_callback_changes()
            if getattr(self.model, "stop_training", False):
                break
            # One more look per epoch (the same on every process): a SIGTERM during the epoch's last
            # batch or its validation stops here, after the epoch-end checkpoint.
            if plan.watch.reached():
                raise preempted(device.value, plan.saving.checkpoint_dir, epoch + 1, 0)
        return training_logs

    def epoch(self, plan: FitPlan, epoch: int, start_batch: int = 0) -> tuple[dict[str, float], Progress, int, int]:
        """Epoch ``epoch`` of ``plan`` from its batch ``start_batch`` (non-zero: resumed mid-epoch): its logs,
        its progress line, the steps and the examples it trained on.

        The loop's hooks: the fit's saving (the step reached, the saves due, preemption), batch callbacks, the
        halt watch, progress (:mod:`mirrorax.fit.epoch`)."""
        stream, hooks = plan.stream, plan.hooks
        position, steps_per_epoch = stream.epoch_span(epoch - plan.first_epoch, plan.steps_per_epoch)
        positioned = plan.inputs is not None
        if plan.inputs is not None and start_batch:
            plan.inputs.position(start_batch, plan.start.input_state)
        device, steps = self.device, self.steps
        state = device.live
        self.adapter.release()  # the model's variables let go of the buffers the first step donates
        if not start_batch:  # (resuming mid-epoch keeps the checkpoint's accumulators: the logs stay exact)
            state = state.replace(metrics=device.fresh_metrics(state.metrics))
        device.value = None  # donated below; restored when the epoch ends or fails
        total = steps_per_epoch or stream.batches_per_pass
        if positioned and start_batch:
            # The input starts itself at start_batch (its own saved state, or replay): count from there.
            host = stream.batches(position, steps_per_epoch and steps_per_epoch - start_batch, start=0)
        else:
            host = stream.batches(position, steps_per_epoch, start=start_batch)
        run = epoch_lib.EpochRun(state, self.strategy.in_flight, start_batch, int(state.host_counters()["step"]), total)
        progress = Progress(plan.mode, total, epoch + 1, plan.epochs,
                            lambda: self.adapter.metric_results(host_tree(run.state.metrics)), stream=plan.out)
        # The epoch's clock: the first hook (right after each step's push), wrapped around its batches.
        meter = self.meter.epoch(run, epoch) if self.meter is not None else None
        loop_hooks: list[epoch_lib.EpochHook] = [h for h in (
            meter,
            plan.saving.hook(epoch, lambda batch: stream.order_state(position + batch), preempted=plan.watch.reached,
                             frozen=lambda state: epoch_lib.frozen(state, steps)),
            epoch_lib.BatchCallbacks(hooks, self.steps_per_execution, self._train_batch_end(hooks), self.model,
                                     steps.batch_logs),
            epoch_lib.HaltWatch(steps.halted),
            epoch_lib.ProgressHook(progress)) if h is not None]

        def placed() -> Iterator[tuple[int, Batch]]:
            # The epoch's first batch is read here, on this thread (not the prefetcher's): Keras's fit
            # draws a pass's order there (keras/order.py), so what a callback draws from the same
            # random state stays in step with it.
            first = next(host, None)
            rest = itertools.chain([first], host) if first is not None else iter(())
            if meter is None:
                return iter(self.device_batches(rest, self.steps_per_execution, stream.per_process))
            place = one_by_one(meter.fit.group, self.strategy, prefetch=self.prefetch, per_process=stream.per_process,
                               host_rows=self.steps.host_rows)
            if place is not None:  # one step a dispatch, placed here: one generator reads, places and times
                return meter.one_by_one(rest, place)
            return meter.placing(self.device_batches(meter.reading(rest), meter.fit.group, stream.per_process))

        dispatch = self._train_dispatch()

        try:
            outcome = self.run(run, placed, dispatch, loop_hooks, on_done=run.retire, count=stream.last_real)
            progress.stop()
            if meter is not None:
                meter.stop()
                meter.fit.end_epoch(meter, progress, hooks)
            if outcome is epoch_lib.Outcome.PREEMPT:
                device.value = run.state
                raise preempted(run.state, plan.saving.checkpoint_dir, epoch, run.in_epoch)
        finally:
            self.adapter.conceal()
            device.value = run.state
        halted = outcome is epoch_lib.Outcome.HALT
        offset = run.start_batch - run.first_step  # a step's counter + offset: its 1-based batch of the epoch
        logs = self._finish_training(run, halted, lambda step: f"epoch {epoch + 1}, batch {step + offset} of the epoch")
        return logs, progress, run.steps, run.samples

    def _train_dispatch(self) -> Dispatch:
        """The dispatch of train steps (an epoch's, a ``train_on_batch``'s): one program looked up per kind of batch.

        (steps per call (0: one), real rows) -> the compiled step for the loop's batches, and the state's
        structure: the loop keeps the state as its leaves from step to step (``EpochRun.leaves``), which the
        program takes and gives so (``dispatch.FlatProgram``: no TrainState built per step)."""
        steps = self.steps
        programs: dict[tuple[int, Any], tuple[Any, Any]] = {}

        def dispatch(run: epoch_lib.EpochRun, k: int, batch: Batch) -> tuple[Any, Any]:
            tree = batch.step_tree()
            if run.relook:  # a callback may have placed new values: look the signature up again
                programs.clear()
                run.relook = False
            kind = (k, tree.get("rows"))
            found = programs.get(kind)
            if found is None:  # one placed shape, full or short of real rows: one lookup per kind
                beat(COMPILING)  # until the first call returns; not watched: large models compile for minutes
                found = programs[kind] = (steps.train_many if k else steps.train).flat_program(run.state, tree)
                program, treedef = found
                # the first call traces and compiles (unless planned): see mirrorax.steps.first_call
                (leaves, run.aux), done = _first_call.run(program, run.leaves(treedef), tree)
            else:
                program, treedef = found
                (leaves, run.aux), done = program(run.leaves(treedef), tree)
            run.set_leaves(leaves, treedef)
            return run.aux, done

        return dispatch

    # -- one batch ---------------------------------------------------------------------------------
    def train_on_batch(self, source: Source, rows: int) -> dict[str, float]:
        """One train step on ``source``'s ``rows`` rows as one global batch (``train_on_batch``): fit's dispatch
        and finish (a bad label or, with ``on_nonfinite="raise"``, a non-finite loss raises with the update not
        applied); the logs cover this batch alone."""
        device = self.device
        batch = source.sample(rows, self.strategy)  # the whole input, one batch: the step's own
        device.ensure(batch)
        source.check_targets(self.adapter)
        self.steps.check_labels_in_step(not source.labels_checked)
        state = device.live
        state = state.replace(metrics=device.fresh_metrics(state.metrics))
        self.adapter.release()
        device.value = None  # donated to the step; restored below
        run = epoch_lib.EpochRun(state, self.strategy.in_flight, total=1)  # (no hook reads its step counter)
        try:
            self.run(run, lambda: iter(self.device_batches(iter([batch]), 1, source.per_process)),
                     self._train_dispatch(), [])
        finally:
            self.adapter.conceal()
            device.value = run.state
        return self._finish_training(run, False, lambda step: "the batch of this train_on_batch call")

    def _train_batch_end(self, hooks: Callbacks) -> Callable[[int, Any, TrainState], TrainState]:
        """``on_train_batch_end`` with the state exposed to the model's callbacks; returns the state to go
        on from (what a callback changed on the model adopted)."""
        device = self.device

        def end(index: int, logs: Any, state: TrainState) -> TrainState:
            state = device.batch_hook(hooks, "on_train_batch_end", index, logs, state)
            device.value = None  # donated by the next step
            return state

        return end

    def _finish_training(self, run: epoch_lib.EpochRun, halted: bool, where: Callable[[int], str]) -> dict[str, float]:
        """The logs of ``run``'s train steps (an epoch's), or the error a frozen run ends with (a bad label; a
        non-finite step under ``on_nonfinite="raise"``), the state then set to train on from the last applied
        step; ``where(step)``: the words for a step's place in the error."""
        device, steps, state = self.device, self.steps, run.state
        device.value, label_error = steps.take_bad_labels(state, where)
        if label_error is not None:
            device.write_back()
            raise label_error
        counters = state.host_counters()
        if steps.on_nonfinite == "raise" and (halted or int(counters["skipped"])):
            bad = int(counters["nonfinite_step"])
            device.value = steps.clear_nonfinite(state, bad)
            device.write_back()
            raise NonFiniteLossError(
                f"The loss became non-finite at step {bad} ({where(bad)}). The update of that step was not applied: "
                "the trainer, the model and any checkpoint hold the values from before it. Lower the learning rate, "
                "check the inputs for NaN/inf, or pass Trainer(..., on_nonfinite='skip') to drop such steps.")
        totals = host_tree(state.metrics)
        logs = self.adapter.metric_results(totals)
        self.adapter.keep_metrics(totals)
        if steps.on_nonfinite == "skip":
            logs["skipped_steps"] = float(counters["skipped"])
        return logs

    # -- evaluate ----------------------------------------------------------------------------------
    def evaluate(self, source: Source, batch_size: int, *, steps: int | None = None, hooks: Callbacks | None = None,
                 warn_short: bool = False) -> dict[str, float]:
        """Loss and metrics over ``source`` (at most ``steps`` batches, within one pass); ``hooks`` get
        Keras's ``on_test_*`` calls (``fit`` passes its own for validation). ``warn_short``: Keras's
        warning when ``steps`` asks for more batches than a pass has."""
        device, fns = self.device, self.steps
        device.ensure(source.sample(batch_size, self.strategy))
        source.check_targets(self.adapter)
        metrics = device.fresh_metrics()
        stream = source.stream(batch_size, self.strategy)
        within = within_pass(stream, steps, warn=warn_short)
        if hooks is not None:
            self.model.stop_evaluating = False  # as Keras: a test-batch callback may set it to stop early
            hooks.call("on_test_begin")
            device.adopt_callback_changes()
        run = epoch_lib.EpochRun(device.live, self.strategy.in_flight, metrics=metrics)
        loop_hooks: list[epoch_lib.EpochHook] = []
        if hooks is not None:
            def batch_end(index: int, logs: Any, run: epoch_lib.EpochRun) -> TrainState:
                assert hooks is not None
                return device.batch_hook(hooks, "on_test_batch_end", index, logs, run.state,
                                         exposed=run.state.replace(metrics=run.metrics))

            loop_hooks.append(epoch_lib.EvalBatchCallbacks(hooks, self.steps_per_execution, batch_end, self.model))
        programs: dict[Any, Any] = {}

        def dispatch(run: epoch_lib.EpochRun, k: int, batch: Batch) -> tuple[Any, Any]:
            tree = batch.step_tree()
            if run.relook:
                programs.clear()
                run.relook = False
            kind = tree.get("rows")
            program = programs.get(kind)
            if program is None:
                beat(COMPILING)  # until the first call returns; not watched: large models compile for minutes
                program = programs[kind] = fns.evaluate.program(run.state, run.metrics, tree)
                (run.metrics, run.aux), done = _first_call.run(program, run.state, run.metrics, tree)
                return run.aux, done
            (run.metrics, run.aux), done = program(run.state, run.metrics, tree)
            return run.aux, done

        # As Keras's evaluate: the model's variables hold nothing while the loop runs (the metrics'
        # totals are the loop's own); they are lent the values again at the end.
        self.adapter.release()
        try:
            self.run(run, lambda: iter(self.device_batches(stream.batches(0, within), 1, stream.per_process)),
                     dispatch, loop_hooks, on_done=fns.eval_watch())
        finally:
            self.adapter.conceal()
            device.value = run.state
            device.write_back()
        totals = host_tree(run.metrics)
        logs = self.adapter.metric_results(totals)
        self.adapter.keep_metrics(totals)
        if hooks is not None:
            hooks.call("on_test_end", logs)
            device.adopt_callback_changes()
        return logs

    # -- predict -----------------------------------------------------------------------------------
    def predict(self, source: Source, batch_size: int, *, steps: int | None = None, hooks: Callbacks | None = None,
                warn_short: bool = False) -> Any:
        """The model's outputs for every row of ``source`` (at most ``steps`` batches, within one pass), as
        numpy; ``hooks`` get Keras's ``on_predict_*`` calls."""
        device, fns, model = self.device, self.steps, self.model
        device.ensure(source.sample(batch_size, self.strategy, with_targets=False))
        source.check_targets(self.adapter)  # the inputs' shapes (no targets here)
        stream = source.stream(batch_size, self.strategy, with_targets=False)
        within = within_pass(stream, steps, warn=warn_short)
        outputs: list[Any] = []
        end = hooks is not None and hooks.listens["predict_end"]
        spe = self.steps_per_execution  # batch hooks once per execution, as Keras

        def collect(item: tuple[Any, Any]) -> None:
            if hooks is not None and getattr(model, "stop_predicting", False):
                # Dispatched before a callback's stop was seen (the window runs ahead): Keras would not
                # have run it, so neither its outputs nor its hooks count.
                return
            y, mask = item
            mask_h = host_value(mask) > 0
            outputs.append(jax.tree.map(lambda a: host_value(a)[mask_h], y))
            if end and hooks is not None and len(outputs) % spe == 0:
                hooks.call("on_predict_batch_end", len(outputs) - 1, {"outputs": _joined(outputs[-spe:])})

        if hooks is not None:
            model.stop_predicting = False  # as Keras: a predict-batch callback may set it to stop early
            hooks.call("on_predict_begin")
            device.adopt_callback_changes()
        run = epoch_lib.EpochRun(device.live, self.strategy.in_flight)
        loop_hooks: list[epoch_lib.EpochHook] = []
        if hooks is not None:
            loop_hooks.append(epoch_lib.PredictBatchCallbacks(hooks, spe, model))
        programs: dict[Any, Any] = {}

        def dispatch(run: epoch_lib.EpochRun, k: int, batch: Batch) -> tuple[Any, Any]:
            rows = batch.real_rows()
            program = programs.get(rows)
            if program is None:
                beat(COMPILING)  # until the first call returns; not watched: large models compile for minutes
                program = programs[rows] = fns.predict.program(run.state, batch.x, rows)
                (y, model_state), done = _first_call.run(program, run.state, batch.x, rows)
            else:
                (y, model_state), done = program(run.state, batch.x, rows)
            run.state = run.state.replace(model_state=model_state)
            return (y, batch.mask), done

        try:
            self.run(run, lambda: iter(self.device_batches(stream.batches(0, within), 1, stream.per_process)),
                     dispatch, loop_hooks, on_done=collect)
        finally:
            device.value = run.state
        if end and hooks is not None and len(outputs) % spe:
            n = len(outputs)
            hooks.call("on_predict_batch_end", n - n % spe + spe - 1, {"outputs": _joined(outputs[-(n % spe):])})
        if jax.tree.leaves(device.live.model_state):
            device.write_back()  # the model's random streams moved on (Keras's predict syncs them back too)
        if hooks is not None:
            hooks.call("on_predict_end")
            device.adopt_callback_changes()
        return jax.tree.map(lambda *a: np.concatenate(a), *outputs)


def preempted(state: TrainState | None, checkpoint_dir: str | None, epoch: int, batch: int) -> preemption.Preempted:
    """The stop of every process on SIGTERM, once the checkpoint (if any: ``checkpoint_dir``) is started."""
    step = int(state.host_counters()["step"]) if state is not None else 0
    code = preemption.PREEMPTED_EXIT_CODE
    if checkpoint_dir is not None:
        message = (f"mirrorax: preempted (SIGTERM): saved checkpoint step {step} (epoch {epoch + 1}, batch "
                   f"{batch}) in {checkpoint_dir}; exiting with status {code}. Run the same command again "
                   "to resume from it.")
    else:
        message = (f"mirrorax: preempted (SIGTERM) at step {step}: no checkpoint_dir, so the work since fit "
                   f"started is lost; exiting with status {code}. Pass fit(checkpoint_dir=...) to save on "
                   "SIGTERM and resume from there.")
    return preemption.Preempted(message, step=step, checkpoint_dir=checkpoint_dir)


def _joined(outputs: list[Any]) -> Any:
    """Per-batch outputs of one execution as one batch (what Keras's ``on_predict_batch_end`` gets)."""
    return outputs[0] if len(outputs) == 1 else jax.tree.map(lambda *a: np.concatenate(a), *outputs)


def _before_step(hooks: list[epoch_lib.EpochHook], run: epoch_lib.EpochRun) -> epoch_lib.Outcome | None:
    """Each hook's ``before_step`` in order, up to the first that ends the loop; that outcome, else ``None``."""
    for hook in hooks:
        outcome = hook.before_step(run)
        if outcome is not None:
            return outcome
    return None


def _after_step(hooks: list[epoch_lib.EpochHook], run: epoch_lib.EpochRun) -> epoch_lib.Outcome | None:
    """Each hook's ``after_step`` in order, up to the first that ends the loop; that outcome, else ``None``."""
    for hook in hooks:
        outcome = hook.after_step(run)
        if outcome is not None:
            return outcome
    return None
