"""``Trainer``: fit / evaluate / predict a model on every device of a :class:`MirroredStrategy`.

The loop never waits on the devices unless it must: batches are placed ahead on a background thread,
steps are dispatched asynchronously with at most ``max_in_flight`` outstanding, and metric values come
to the host only when shown (progress refresh, end of epoch).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, Literal

import jax

from mirrorax import consistency, evaluation, preemption
from mirrorax import epoch as epoch_lib
from mirrorax import resume as resume_lib
from mirrorax._checks import check_int
from mirrorax.hooks import Callbacks
from mirrorax.input_checks import check_batch_size
from mirrorax.inputs.batch import Batch
from mirrorax.inputs.make import make_source, validation_source
from mirrorax.inputs.prefetch import Prefetcher, device_batches
from mirrorax.inputs.source import Source
from mirrorax.inputs.streams import Stream, ran_out_of_data
from mirrorax.models.adapters import adapt
from mirrorax.models.base import ModelAdapter
from mirrorax.progress import Progress, resolve_verbose
from mirrorax.results import History, NonFiniteLossError
from mirrorax.step import InFlight, NonFiniteMode, StepFunctions, host_tree, host_value
from mirrorax.strategy import MirroredStrategy, get_strategy
from mirrorax.train_state import TrainState

__all__ = ["Trainer", "History", "NonFiniteLossError"]

PyTree = Any


class Trainer:
    """Trains a model with synchronous data parallelism over a :class:`MirroredStrategy`.

    ``batch_size`` is always the *global* batch: N devices give the single-device result.

    Args:
      model: a compiled Keras 3 model (JAX backend) or a :class:`mirrorax.FunctionalModel`.
      strategy: the strategy; default: the enclosing ``strategy.scope()``, else every device.
      loss, optimizer, metrics: complete or override the model's compile settings (``optimizer`` may
        be an optax ``GradientTransformation``).
      steps_per_execution: train steps per dispatch (run with ``lax.scan``); pays when per-step host
        overhead dominates (small models, many devices).
      accumulation_steps: split each global batch into this many micro-batches (gradient accumulation:
        the same update as the whole batch, with a fraction of the activation memory).
      max_in_flight: dispatched steps allowed to be outstanding (>= 1; 2 overlaps host and devices).
      prefetch: batches placed on the devices ahead of the running step, on a background thread (0: place
        synchronously, between dispatches). ``"auto"``: 2 on accelerators, 0 on CPU devices, where the
        copy is a memcpy and a second Python thread only competes with XLA's for the cores (measured:
        synchronous placement is 5-8% faster on a 2-core host with 2-8 simulated devices).
      on_nonfinite: ``"raise"``, ``"skip"`` (drop the update, count it in the history) or ``"ignore"``.
      donate: donate the state buffers to each train step (no copy of the state per step).
      mixed_precision: ``"bfloat16"`` (bf16 compute, float32 variables) or ``"float16"`` (also dynamic
        loss scaling), for Keras models; ``None`` keeps the model's own dtype policy.

    Example:
      >>> strategy = mx.MirroredStrategy()
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
      ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
      >>> trainer = mx.Trainer(model)
      >>> history = trainer.fit(x, y, batch_size=64, epochs=2, verbose=0)
    """

    # fit's steps_per_epoch: exactly that many batches, array inputs continuing into a new pass (False),
    # or at most that many, an epoch ending where the data does (True: Keras's fit, see inputs/streams.py).
    _epochs_end_with_data = False
    # The data order: (seed, pass) for arrays, the same on any device count and replayed on resume
    # (False); or Keras's fit's own, drawn from numpy's global state when a pass starts, each fit's
    # passes counted from its first epoch as Keras's iterator counts them (True: inputs/keras_order.py).
    _keras_order = False

    def __init__(self, model: Any, strategy: MirroredStrategy | None = None, *, loss: Any = None,
                 optimizer: Any = None, metrics: Any = None, steps_per_execution: int = 1,
                 accumulation_steps: int = 1, max_in_flight: int = 2, prefetch: int | Literal["auto"] = "auto",
                 on_nonfinite: NonFiniteMode = "raise", donate: bool = True,
                 mixed_precision: Literal["bfloat16", "float16"] | None = None) -> None:
        if strategy is not None and not isinstance(strategy, MirroredStrategy):
            raise TypeError(f"strategy must be a mirrorax.MirroredStrategy; received {strategy!r} (of type "
                            f"{type(strategy).__name__}). Pass e.g. mx.MirroredStrategy() (every device) or "
                            "mx.MirroredStrategy(devices=jax.devices('gpu')[:2]).")
        if prefetch == "auto":
            prefetch = 0 if (strategy or get_strategy()).devices[0].platform == "cpu" else 2
        for name, value, low in (("steps_per_execution", steps_per_execution, 1),
                                 ("accumulation_steps", accumulation_steps, 1),
                                 ("max_in_flight", max_in_flight, 1), ("prefetch", prefetch, 0)):
            check_int(name, value, low)
        self.strategy = strategy or get_strategy()
        self.model = model
        self.adapter: ModelAdapter = adapt(model, loss=loss, optimizer=optimizer, metrics=metrics,
                                           mixed_precision=mixed_precision)
        self.steps_per_execution = steps_per_execution
        self.accumulation_steps = accumulation_steps
        self.max_in_flight = max_in_flight
        self.prefetch = int(prefetch)  # "auto" is resolved above
        self.steps = StepFunctions(self.adapter, self.strategy, donate=donate, on_nonfinite=on_nonfinite,
                                   accumulation_steps=accumulation_steps)
        self._state: TrainState | None = None
        self.stream: IO[str] = sys.stdout
        # NaN/inf in array inputs are refused up front unless non-finite steps are to be skipped or
        # ignored: then the user has chosen to train on past them.
        self._refuse_nonfinite = on_nonfinite == "raise"
        # Whether fit prints the plan's summary line; None: when verbose. (model.fit under a scope runs
        # this trainer with verbose=0 under Keras's own progress bar, and says here what its verbose was.)
        self._plan_line: bool | None = None

    # -- state -------------------------------------------------------------------------------------
    @property
    def state(self) -> TrainState | None:
        """The training state on the devices, a :class:`mirrorax.TrainState` (``state.params``,
        ``state.model_state``, ``state.optimizer``, ``state.metrics``, ``state.step`` and the other
        counters; ``state["params"]`` reads the same), or ``None`` before the first fit, evaluate or
        predict."""
        return self._state

    @property
    def _live_state(self) -> TrainState:
        """The state, which fit, evaluate and predict build (:meth:`_ensure_state`) before any step."""
        if self._state is None:
            raise RuntimeError("The trainer has no state yet: it is built by the first fit/evaluate/predict.")
        return self._state

    def _place(self, tree: PyTree, *, from_host: bool = True) -> PyTree:
        """Replicates ``tree`` onto the mesh in buffers of its own (:meth:`MirroredStrategy.replicate`).

        ``from_host``: the values come from this process's model (initial weights, weights set by the
        user), which may differ between processes: every replica then takes process 0's values.
        ``False`` for values that are equal everywhere by construction (metric accumulators' zeros).
        """
        return self.strategy._replicate(tree, broadcast=from_host)

    def _ensure_state(self, sample: Batch) -> None:
        # Building is incremental: a predict-only start builds layers; targets later add metrics, whose
        # accumulators are placed afresh for every epoch and evaluation anyway.
        self.adapter.build(sample.tree())
        if self._state is not None:
            self._state = self._adopt_model_changes(self._state)
            return
        # Process 0's values on every process, laid out as the strategy says; the train steps return the
        # state in the layout it went in with.
        self._state = self._place_state(self._initial_host_state())

    def _initial_host_state(self) -> TrainState:
        """The model's values plus the engine's counters at zero, on the host (built model required)."""
        return TrainState.create(**self.adapter.initial_state())

    def state_layout(self, state: TrainState | dict[str, PyTree]) -> TrainState | dict[str, PyTree]:
        """Where each leaf of a state (arrays or shapes) lives on the strategy's devices: a state of
        ``NamedSharding``s (for a dict of some of its groups, a dict of theirs)."""
        s = self.strategy
        groups = state.as_dict() if isinstance(state, TrainState) else state
        layouts = {k: s.state_layout(v, _SHARDED_GROUPS[k]) if k in _SHARDED_GROUPS
                   else jax.tree.map(lambda _: s.replicated, v) for k, v in groups.items()}
        return TrainState(**layouts) if isinstance(state, TrainState) else layouts

    def _place_state(self, tree: TrainState | dict[str, PyTree], *, from_host: bool = True) -> Any:
        """A state (or a dict of some of its groups) placed as the strategy lays it out (parameters and
        optimizer state split over the devices in the sharded modes, everything else replicated), with
        process 0's values; of the type given."""
        return self.strategy.place(tree, self.state_layout(tree), broadcast=from_host)

    @classmethod
    def load(cls, checkpoint_dir: str | os.PathLike[str], model: Any, strategy: MirroredStrategy | None = None,
             **trainer_kwargs: Any) -> Trainer:
        """A trainer holding the newest good checkpoint of ``checkpoint_dir``, for evaluate/predict/fit.

        The checkpoint's values are also written into ``model``. Works on any device or process count.

        Args:
          checkpoint_dir: a directory written by ``fit(checkpoint_dir=...)``.
          model: the same model (compiled as for training), freshly built.
          strategy, trainer_kwargs: as for :class:`Trainer`.

        Raises:
          CheckpointError: no such directory, or no checkpoint in it.
          CheckpointMismatchError: the checkpoint belongs to a different model.

        Example:
          >>> trainer = mx.Trainer.load("runs/mnist", model)
          >>> trainer.evaluate(x_test, y_test)
        """
        from mirrorax.checkpoint import Checkpointer, CheckpointError

        if "://" not in os.fspath(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise CheckpointError(f"No checkpoint directory {os.fspath(checkpoint_dir)!r}. Pass the checkpoint_dir "
                                  "that fit(checkpoint_dir=...) wrote.")
        trainer = cls(model, strategy, **trainer_kwargs)
        with Checkpointer(checkpoint_dir, keep=None) as ckpt:
            meta = ckpt.read_meta()
            if meta is None or "sample_spec" not in meta:
                raise CheckpointError(f"{ckpt.directory} holds no mirrorax checkpoint (steps: {ckpt.all_steps()}).")
            trainer._ensure_state(resume_lib.sample_from_spec(meta["sample_spec"]))
            restored = ckpt.restore_latest(trainer._abstract_state())
            if restored is None:
                raise CheckpointError(f"{ckpt.directory} holds no readable checkpoint.")
            trainer._state = restored[1]
        trainer._write_back()
        return trainer

    def host_state(self) -> TrainState:
        """A host copy of the training state: a :class:`mirrorax.TrainState` of numpy arrays."""
        if self._state is None:
            raise RuntimeError("The trainer has no state yet; call fit, evaluate or predict first.")
        return host_tree(self._state)

    def _write_back(self) -> None:
        if self._state is not None:
            self.adapter.write_back(self._state)

    def _batch_hook(self, hooks: Callbacks, name: str, index: int, logs: Any, state: TrainState, *,
                    exposed: TrainState | None = None) -> TrainState:
        """Calls batch hook ``name`` while ``state`` is this trainer's (its evaluate / predict / state read
        it) and ``exposed`` (default ``state``) is what Keras callbacks read through ``Callback.model``.
        Returns ``state`` with what the callbacks changed on the model adopted."""
        self.adapter.expose(state if exposed is None else exposed)
        self._state = state
        hooks.call(name, index, logs)
        state = self._live_state
        read = self.adapter.exposure_read()
        if read or self.strategy.process_count > 1:  # the processes decide together
            state = self._adopt_model_changes(state, model_has_values=read)
        if read:
            self.adapter.release()
        return state

    def _adopt_model_changes(self, state: TrainState, *, model_has_values: bool = True) -> TrainState:
        """``state``, continuing from the model's values where they were replaced since they were lent
        (``set_weights`` between fits or in a callback, Keras's own ``fit``): the model is the truth.

        In a multi-process job every process must call this at the same point: they agree whether any
        model changed, and then every replica takes process 0's model values (a change made on another
        process only is overridden, never half-applied). ``model_has_values``: False mid-epoch when no
        callback of this process read the model (its variables then hold nothing; the state stands in).
        """
        changed = model_has_values and self.adapter.model_changed()
        if self.strategy.process_count > 1:
            changed = consistency.any_process(changed)
        if not changed:
            return state
        if not model_has_values:
            values = {g: getattr(state, g) for g in self.adapter.written_groups}
            return state.replace(**self._place_state(values))
        state = state.replace(**self._place_state(self.adapter.model_values()))
        # Lent again at once: a change made after this one (LearningRateScheduler at on_epoch_begin after
        # ReduceLROnPlateau at on_epoch_end) is a change of the lent values too, and is adopted in turn.
        self.adapter.write_back(state)
        return state

    # -- data helpers ------------------------------------------------------------------------------
    def _batch_size(self, source: Source, batch_size: int | None) -> int:
        if batch_size is None:
            return source.default_batch_size(self.strategy.process_count)
        return check_batch_size(batch_size)

    def _device_batches(self, host: Iterator[Batch], group: int, per_process: bool
                        ) -> Iterator[tuple[int, Batch]] | Prefetcher:
        return device_batches(host, group, self.strategy.batch_mesh, prefetch=self.prefetch, per_process=per_process)

    # -- fit ---------------------------------------------------------------------------------------
    def fit(self, x: Any, y: Any = None, *, batch_size: int | None = None, epochs: int = 1,
            validation_data: Any = None, validation_batch_size: int | None = None,
            validation_steps: int | None = None, validation_freq: int | Sequence[int] = 1,
            shuffle: bool | Literal["batch"] = True,
            seed: int = 0, sample_weight: Any = None, steps_per_epoch: int | None = None,
            initial_epoch: int = 0, callbacks: Any = None, verbose: int | str = "auto",
            checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_every: int | str = "epoch",
            keep_checkpoints: int | None = 3) -> History:
        """Trains for ``epochs`` epochs over the global batches of ``(x, y)``.

        Args:
          x: inputs: an array, a tuple/list/dict of arrays, or an iterable of ``(x, y)`` /
            ``(x, y, sample_weight)`` batches (generators, tf.data, a torch DataLoader, grain).
          y: targets, when ``x`` holds arrays.
          batch_size: the *global* batch (over all devices and processes). Default 32 for arrays, the
            first batch's size for iterables.
          epochs: epochs to train (ending at epoch ``epochs``; see ``initial_epoch``).
          validation_data: ``(x_val, y_val)``, ``(x_val, y_val, w_val)`` or an iterable; evaluated after
            every epoch, its metrics recorded with a ``val_`` prefix.
          validation_batch_size: global batch for validation (default ``batch_size``).
          validation_steps: validation batches per evaluation (default: all of ``validation_data``).
          validation_freq: validate every this many epochs, or after the epochs listed (1-based, as Keras).
          shuffle: shuffle array inputs every epoch, with an order that depends only on ``seed`` and
            the epoch (never on the device or process count); ``"batch"``: the rows of each batch
            among themselves, as Keras's ``shuffle="batch"``. (A Keras model's own ``fit`` under a
            scope draws Keras's own order instead: see ``docs/keras_fit.md``.)
          seed: the shuffle seed.
          sample_weight: per-example weights, when ``x`` holds arrays.
          steps_per_epoch: batches per epoch (default: one pass over the data). Array inputs continue
            where the previous epoch stopped, starting a new shuffled pass when one ends. (A Keras
            model's own ``fit`` under a scope reads it as Keras does: an epoch also ends with a pass.)
          initial_epoch: the epoch to start at (as Keras).
          callbacks: Keras callbacks (or a ``keras.callbacks.CallbackList``), driven as Keras's own
            ``fit`` drives them (every ``on_*`` hook, batch logs, ``model.stop_training``); for a
            :class:`FunctionalModel`, plain objects with any of those methods.
          verbose: ``"auto"`` (bar on a terminal, a line per epoch otherwise), 0, 1 or 2.
          checkpoint_dir: save the whole training state here (Orbax, asynchronously) and, if it
            already holds checkpoints, resume from the newest good one: the same call after a crash
            continues where the run stopped and ends with the same weights and history.
          checkpoint_every: ``"epoch"``, or a number of steps (a checkpoint is also written at
            every epoch end).
          keep_checkpoints: how many of the newest checkpoints to keep (``None``: all).

        Returns:
          A :class:`History`.

        Raises:
          ValueError / TypeError: bad inputs, raised before any compilation.
          NonFiniteLossError: a step's loss was not finite (with ``on_nonfinite="raise"``).
          CheckpointError: ``checkpoint_dir`` is not writable (raised at once), or holds a checkpoint
            of a different model or of a run with another global batch.
        """
        mode = resolve_verbose(verbose, self.stream) if self.strategy.is_primary else 0
        check_int("epochs", epochs, low=0)
        check_int("initial_epoch", initial_epoch, low=0)
        check_int("seed", seed, low=0)
        if steps_per_epoch is not None:
            check_int("steps_per_epoch", steps_per_epoch)
        if validation_batch_size is not None:
            check_batch_size(validation_batch_size)
        every = resume_lib.check_every(checkpoint_every)
        source = make_source(x, y, sample_weight, float_dtype=self.adapter.float_dtype,
                             check_finite=self._refuse_nonfinite)
        if self.adapter.needs_targets("fit"):
            source.require_targets("fit")
        batch_size = self._batch_size(source, batch_size)
        val = validation_source(validation_data, float_dtype=self.adapter.float_dtype,
                                check_finite=self._refuse_nonfinite,
                                targets=self.adapter.needs_targets("evaluate"))
        ckpt = None
        if checkpoint_dir is not None:
            from mirrorax.checkpoint import Checkpointer

            ckpt = Checkpointer(checkpoint_dir, keep=keep_checkpoints)
        if callbacks is not None and not isinstance(callbacks, (list, tuple)) and \
                type(callbacks).__name__ != "CallbackList":  # (Keras's fit under a scope passes its own list)
            callbacks = [callbacks]  # one callback, not in a list: as Keras's own fit takes it
        sample = source.sample(batch_size, self.strategy.batch_mesh)
        self._ensure_state(sample)
        for s in (source, val):  # shapes against the outputs, labels against the classes: before compiling
            if s is not None:
                s.check_targets(self.adapter)
        # Labels the host has checked whole need no search and no guard in the step.
        self.steps.check_labels_in_step(not source.labels_checked)
        consistency.check_replicas(self._state)  # multi-process: every process holds process 0's values
        self._write_back()  # lent to the model: what callbacks change on it from here on is adopted
        # The plan's line (verbose), and will it fit? (only where a device's memory is known): the step is
        # compiled here, once, for the state just placed; step 1 runs that very program.
        announce = mode if self._plan_line is None else self._plan_line
        _plan_module().at_fit_start(self, sample, batch_size, announce=bool(announce) and self.strategy.is_primary)
        history = History()
        stream = source.stream(batch_size, self.strategy.batch_mesh, shuffle=shuffle, seed=seed,
                               ends_with_data=self._epochs_end_with_data, keras_order=self._keras_order)
        per_epoch = steps_per_epoch or stream.batches_per_pass
        hooks = Callbacks(callbacks, self.model, epochs=epochs, steps=per_epoch, verbose=0 if not mode else mode)
        should_validate = _validation_schedule(validation_freq)
        if self.strategy.process_count > 1:  # every process must take the same path through each step
            hooks.listens = {kind: consistency.any_process(v) for kind, v in hooks.listens.items()}
        run = {"batch_size": batch_size, "shuffle": "batch" if shuffle == "batch" else bool(shuffle), "seed": int(seed),
               "steps_per_epoch": steps_per_epoch}
        start_epoch, start_batch, input_state = initial_epoch, 0, None
        training_logs: dict[str, float] = {}
        inputs = None if ckpt is None else source.track_position(self.strategy.process_count)
        watch = preemption.Watch(self.strategy.process_count)
        stopped: preemption.Preempted | None = None
        try:
            watch.start()
            resumed = None
            if ckpt is not None:
                resumed = resume_lib.resume(ckpt, self._abstract_state(), run, history)
                if resumed is not None:
                    self._state, start_epoch, start_batch, step, input_state = resumed
                    if mode:
                        self.stream.write(f"Resumed from checkpoint step {step} in {ckpt.directory} "
                                          f"(epoch {start_epoch + 1}, batch {start_batch}).\n")
            saver = None if ckpt is None else resume_lib.Saver(
                ckpt, every, run, history, resume_lib.sample_spec(sample), inputs=inputs)
            if hasattr(self.model, "stop_training"):
                self.model.stop_training = False  # as Keras's fit: a flag left by an interrupted run
            hooks.call("on_train_begin")
            # keras.callbacks.BackupAndRestore says where to resume in on_train_begin (Keras's fit reads
            # model._initial_epoch only then); its restored weights are adopted at on_epoch_begin.
            if resumed is None and getattr(self.model, "_initial_epoch", None):
                start_epoch = int(self.model._initial_epoch)
            first_epoch = start_epoch if self._keras_order else 0
            for epoch in range(start_epoch, epochs):
                hooks.call("on_epoch_begin", epoch)
                self._state = self._adopt_model_changes(self._live_state)  # e.g. a learning rate a callback set
                position, count = stream.epoch_span(epoch - first_epoch, steps_per_epoch)
                if inputs is not None and start_batch:
                    inputs.position(start_batch, input_state)
                logs, progress, steps, samples = self._run_epoch(
                    stream, position, count, epoch, epochs, mode, start_batch=start_batch,
                    saver=saver, hooks=hooks, watch=watch, positioned=inputs is not None)
                if self._epochs_end_with_data and steps_per_epoch and start_batch + steps < steps_per_epoch \
                        and not getattr(self.model, "stop_training", False):
                    ran_out_of_data()
                start_batch = 0
                self._write_back()  # Keras syncs the model before validation: on_test_begin may read it
                if val is not None and should_validate(epoch):
                    vlogs = evaluation.evaluate_source(self, val, validation_batch_size or batch_size,
                                                       steps=validation_steps, hooks=hooks)
                    logs.update({f"val_{k}": v for k, v in vlogs.items()})
                sps = progress.finish(steps, samples, logs)
                history.append(epoch, logs, sps)
                if consistency.debug_checks():
                    consistency.check_replicas(self._state)
                if saver is not None:
                    saver.save(self._state, epoch + 1, 0)
                hooks.call("on_epoch_end", epoch, logs)
                training_logs = logs
                self._state = self._adopt_model_changes(self._state)
                if getattr(self.model, "stop_training", False):
                    break
                # One more look per epoch (the same on every process): a SIGTERM during the epoch's last
                # batch or its validation stops here, after the epoch-end checkpoint.
                if watch.reached():
                    raise self._preempted(ckpt, epoch + 1, 0)
        except preemption.Preempted as stop:
            stopped = stop
        finally:
            watch.close()
            self._write_back()
            self._finalize_optimizer(epochs)
            if ckpt is not None:
                ckpt.close()
        if stopped is not None:
            # Said only now that the checkpoint is on disk (close waited for the write).
            preemption.announce(stopped.message, self.strategy.is_primary)
            raise stopped
        hooks.call("on_train_end", training_logs)
        if hasattr(self.model, "stop_training"):
            self.model.stop_training = False
        return history

    def _finalize_optimizer(self, epochs: int) -> None:
        """Keras's end of ``fit``: ``optimizer.finalize_variable_values`` (``use_ema=True`` puts the moving
        averages into the model's weights), on the values just lent back; adopted as a model change."""
        optimizer: Any = getattr(self.model, "optimizer", None)
        if epochs <= 0 or getattr(self.adapter, "optax", None) is not None or \
                not callable(getattr(optimizer, "finalize_variable_values", None)):
            return
        optimizer.finalize_variable_values(self.model.trainable_weights)

    def _adopt_callback_changes(self) -> None:
        """After a hook that may change the lent model (``SwapEMAWeights`` at ``on_test_begin``): the state
        takes the model's values, and lends them back so that a later change is seen too."""
        self._state = self._adopt_model_changes(self._live_state)

    def _preempted(self, ckpt: Any, epoch: int, batch: int) -> preemption.Preempted:
        """The stop of every process on SIGTERM, once the checkpoint (if any) is started."""
        step = int(host_value(self._state.step)) if self._state is not None else 0
        code = preemption.PREEMPTED_EXIT_CODE
        if ckpt is not None:
            message = (f"mirrorax: preempted (SIGTERM): saved checkpoint step {step} (epoch {epoch + 1}, batch "
                       f"{batch}) in {ckpt.directory}; exiting with status {code}. Run the same command again "
                       "to resume from it.")
        else:
            message = (f"mirrorax: preempted (SIGTERM) at step {step}: no checkpoint_dir, so the work since fit "
                       f"started is lost; exiting with status {code}. Pass fit(checkpoint_dir=...) to save on "
                       "SIGTERM and resume from there.")
        return preemption.Preempted(message, step=step, checkpoint_dir=None if ckpt is None else ckpt.directory)

    def _abstract_state(self) -> TrainState:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self._state)

    def _run_epoch(self, stream: Stream, position: int, steps_per_epoch: int | None, epoch: int, epochs: int,
                   mode: int, *, start_batch: int = 0, saver: resume_lib.Saver | None = None,
                   hooks: Callbacks | None, watch: preemption.Watch | None = None,
                   positioned: bool = False) -> tuple[dict[str, float], Progress, int, int]:
        """One epoch: dispatch each step, place the next batch, then run the loop's hooks
        (:mod:`mirrorax.epoch`: batch callbacks, the halt watch, preemption, periodic saves, progress)."""
        state = self._live_state
        self.adapter.release()  # the model's variables let go of the buffers the first step donates
        if not start_batch:  # (resuming mid-epoch keeps the checkpoint's accumulators: the logs stay exact)
            state = state.replace(metrics=self._place(self.adapter.initial_metrics(state.metrics), from_host=False))
        self._state = None  # donated below; restored when the epoch ends or fails
        total = steps_per_epoch or stream.batches_per_pass
        if positioned and start_batch:
            # The input starts itself at start_batch (its own saved state, or replay): count from there.
            host = stream.batches(position, steps_per_epoch and steps_per_epoch - start_batch, start=0)
        else:
            host = stream.batches(position, steps_per_epoch, start=start_batch)
        run = epoch_lib.EpochRun(state, InFlight(self.max_in_flight), start_batch, int(host_value(state.step)), total)
        progress = Progress(mode, total, epoch + 1, epochs,
                            lambda: self.adapter.metric_results(host_tree(run.state.metrics)), stream=self.stream)
        callbacks = None if hooks is None else epoch_lib.BatchCallbacks(
            hooks, self.steps_per_execution, self._train_batch_end(hooks), self.model)
        loop_hooks: list[epoch_lib.EpochHook] = [h for h in (
            callbacks,
            epoch_lib.HaltWatch(),
            None if watch is None else epoch_lib.PreemptionStop(watch, saver, self.steps, epoch),
            None if saver is None else epoch_lib.PeriodicSave(saver, self.steps, epoch),
            epoch_lib.ProgressHook(progress)) if h is not None]
        outcome = None
        batches: Any = None
        # (steps per call (0: one), real rows) -> the compiled step for this epoch's batches
        programs: dict[tuple[int, Any], Any] = {}
        try:
            # As Keras: on_train_batch_begin(0), then the epoch's first batch is read, on this thread (not
            # the prefetcher's): Keras's fit draws a pass's order there (inputs/keras_order.py), so what a
            # callback draws from the same random state stays in step with it.
            for hook in loop_hooks:
                hook.before_step(run)
            first = next(host, None)
            host = itertools.chain([first], host) if first is not None else iter(())
            batches = iter(self._device_batches(host, self.steps_per_execution, stream.per_process))
            upcoming = next(batches, None)
            began = True  # the hooks before the first step have run
            while upcoming is not None and outcome is None:
                k, batch = upcoming
                if not began:
                    for hook in loop_hooks:
                        hook.before_step(run)
                began = False
                tree = batch.tree()
                kind = (k, tree.get("rows"))
                program = programs.get(kind)
                if program is None:  # one placed shape, full or short of real rows: one lookup per kind
                    program = programs[kind] = (self.steps.train_many if k else self.steps.train).program(
                        run.state, tree)
                (run.state, run.aux), done = program(run.state, tree)
                # Place the next batch while this step and the previous one run, then wait for the
                # previous one: the host's copy overlaps the devices' work instead of following it.
                upcoming = next(batches, None)
                run.window.push(run.aux, done)
                run.before, run.steps = run.steps, run.steps + max(k, 1)
                run.samples += stream.last_real(k)
                run.last = upcoming is None
                for hook in loop_hooks:
                    outcome = hook.after_step(run)
                    if outcome is not None:
                        break
                if callbacks is not None and callbacks.changed:
                    programs.clear()  # a callback may have placed new values: look the signature up again
                    callbacks.changed = False
            run.window.drain()
            progress.stop()
            if outcome is epoch_lib.Outcome.PREEMPT:
                self._state = run.state
                raise self._preempted(None if saver is None else saver.ckpt, epoch, run.in_epoch)
        finally:
            if isinstance(batches, Prefetcher):
                batches.close()
            self.adapter.conceal()
            self._state = run.state
        return self._finish_epoch(run, outcome is epoch_lib.Outcome.HALT, epoch), progress, run.steps, run.samples

    def _train_batch_end(self, hooks: Callbacks) -> Callable[[int, Any, TrainState], TrainState]:
        """``on_train_batch_end`` with the state exposed to the model's callbacks; returns the state to go
        on from (what a callback changed on the model adopted)."""
        def end(index: int, logs: Any, state: TrainState) -> TrainState:
            state = self._batch_hook(hooks, "on_train_batch_end", index, logs, state)
            self._state = None  # donated by the next step
            return state

        return end

    def _finish_epoch(self, run: epoch_lib.EpochRun, halted: bool, epoch: int) -> dict[str, float]:
        """The epoch's logs, or the error a frozen epoch ends with (a bad label; a non-finite step under
        ``on_nonfinite="raise"``), the state then set to train on from the last applied step."""
        state = run.state
        self._state, label_error = self.steps.take_bad_labels(state, epoch, run.start_batch - run.first_step)
        if label_error is not None:
            self._write_back()
            raise label_error
        if self.steps.on_nonfinite == "raise" and (halted or int(host_value(state.skipped))):
            bad = int(host_value(state.nonfinite_step))
            self._state = self.steps.clear_nonfinite(state, bad)
            self._write_back()
            raise NonFiniteLossError(
                f"The loss became non-finite at step {bad} (epoch {epoch + 1}, batch "
                f"{run.start_batch + bad - run.first_step} of the epoch). The update of that step was not applied: "
                "the trainer, the model and any checkpoint hold the values from before it. Lower the learning rate, "
                "check the inputs for NaN/inf, or pass Trainer(..., on_nonfinite='skip') to drop such steps.")
        totals = host_tree(state.metrics)
        logs = self.adapter.metric_results(totals)
        self.adapter.keep_metrics(totals)
        if self.steps.on_nonfinite == "skip":
            logs["skipped_steps"] = float(host_value(state.skipped))
        return logs

    # -- evaluate / predict ------------------------------------------------------------------------
    def evaluate(self, x: Any, y: Any = None, *, batch_size: int | None = None, sample_weight: Any = None,
                 verbose: int | str = 0, steps: int | None = None, callbacks: Any = None) -> dict[str, float]:
        """Loss and metrics over every example of ``(x, y)``, in inference mode.

        Exact over all replicas: sums and counts over the real examples, padding masked out.
        ``steps`` limits the batches (default: all); ``callbacks`` get Keras's ``on_test_*`` hooks.

        Returns:
          ``{"loss": ..., "<metric>": ...}`` as floats, the same on every process.

        Example:
          >>> trainer.evaluate(x_test, y_test, batch_size=256)
          {'accuracy': 0.97, 'loss': 0.09}
        """
        return evaluation.evaluate(self, x, y, batch_size=batch_size, sample_weight=sample_weight, verbose=verbose,
                                   steps=steps, callbacks=callbacks)

    def predict(self, x: Any, *, batch_size: int | None = None, verbose: int | str = 0, steps: int | None = None,
                callbacks: Any = None) -> Any:
        """The model's outputs for every row of ``x``, in input order.

        Every process returns the full result (all rows), gathered from all devices. ``steps`` limits
        the batches (default: all); ``callbacks`` get Keras's ``on_predict_*`` hooks.

        Returns:
          A numpy array with ``len(x)`` rows (a pytree of them for multi-output models).

        Example:
          >>> probs = trainer.predict(x_test, batch_size=256)
          >>> probs.shape[0] == len(x_test)
          True
        """
        return evaluation.predict(self, x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks)

    # -- one batch (Keras's *_on_batch) ------------------------------------------------------------
    def train_on_batch(self, x: Any, y: Any = None, *, sample_weight: Any = None, class_weight: Any = None
                       ) -> dict[str, float]:
        """One train step on one global batch (padded to the device count); its loss and metrics.

        The metrics cover this batch only (as Keras's ``train_on_batch``). A non-finite loss raises
        :class:`NonFiniteLossError` with the update not applied (unless ``on_nonfinite`` says otherwise).

        Example:
          >>> logs = trainer.train_on_batch(x[:64], y[:64])
        """
        return evaluation.train_on_batch(self, x, y, sample_weight=sample_weight, class_weight=class_weight)

    def test_on_batch(self, x: Any, y: Any = None, *, sample_weight: Any = None) -> dict[str, float]:
        """Loss and metrics of one batch in inference mode (Keras's ``test_on_batch``)."""
        return evaluation.test_on_batch(self, x, y, sample_weight=sample_weight)

    def compile_counts(self) -> dict[str, int]:
        """Programs compiled per step kind: one per placed shape and real row count (a full batch and a
        short last batch: two)."""
        return self.steps.compile_counts()


def _plan_module() -> Any:
    import importlib

    return importlib.import_module("mirrorax.plan")  # (mirrorax.plan the attribute is the function mx.plan)


# The state groups the sharded modes split over the devices, and the role each has for the strategy.
_SHARDED_GROUPS = {"params": "params", "optimizer": "optimizer"}


def _validation_schedule(freq: Any) -> Callable[[int], bool]:
    """Keras's ``validation_freq``: every ``freq`` epochs, or after the (1-based) epochs listed."""
    if isinstance(freq, (list, tuple, set)):
        wanted = {int(e) for e in freq}
        return lambda epoch: epoch + 1 in wanted
    check_int("validation_freq", freq)
    return lambda epoch: (epoch + 1) % int(freq) == 0
