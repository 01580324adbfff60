"""``Trainer``: fit / evaluate / predict a model on every device of a :class:`MirroredStrategy`.

The Trainer is orchestration on parts below it: the state on the devices (:mod:`mirrorax.fit.device_state`),
the compiled steps (:mod:`mirrorax.fit.functions`, public ``strategy.jit`` functions), fit's preparation
(:mod:`mirrorax.fit.fit_plan`: its arguments read once into one record) and the loop that runs fit's epochs,
evaluate and predict on them (:mod:`mirrorax.fit.loop`), with at most the strategy's ``max_in_flight`` steps
outstanding; metric values come to the host only when shown. ``fit`` is: prepare, resume, run the epochs,
finish.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import IO, Any, Literal, NoReturn

from mirrorax import front_end
from mirrorax._checks import check_int
from mirrorax._host import host_tree
from mirrorax.checkpoint import resume as resume_lib
from mirrorax.cluster import preemption
from mirrorax.fit import fit_plan, planner
from mirrorax.fit.device_state import DeviceState
from mirrorax.fit.functions import NonFiniteMode, StepFunctions
from mirrorax.fit.loop import Loop
from mirrorax.fit.progress import format_logs, resolve_verbose
from mirrorax.fit.utilisation import Utilisation
from mirrorax.fit.utilisation import utilisation as utilisation_of
from mirrorax.inputs.make import class_weights
from mirrorax.inputs.reading import FitReading
from mirrorax.models.adapters import adapt
from mirrorax.models.base import ModelAdapter
from mirrorax.results import History
from mirrorax.steps import first_call as _first_call
from mirrorax.strategy import MirroredStrategy, get_strategy
from mirrorax.train_state import TrainState

__all__ = ["Trainer"]

PyTree = Any


class Trainer:
    """Trains a model with synchronous data parallelism over a :class:`MirroredStrategy`.

    ``batch_size`` is always the *global* batch: N devices give the single-device result. The steps of
    ``fit``, ``evaluate`` and ``predict`` go through the strategy's dispatch window: at most
    ``MirroredStrategy(max_in_flight=k)`` of them are outstanding (2 by default: the host never waits for
    the step it just dispatched).

    Args:
      model: a compiled Keras 3 model (JAX backend) or a :class:`mirrorax.FunctionalModel`.
      strategy: the strategy; default: the enclosing ``strategy.scope()``, else every device.
      loss, optimizer, metrics: complete or override the model's compile settings (``optimizer`` may
        be an optax ``GradientTransformation``).
      steps_per_execution: train steps per dispatch (run with ``lax.scan``); pays when per-step host
        overhead dominates (small models, many devices). ``"auto"`` (as tf.keras 2.x): ``fit`` measures the
        host's cost per dispatch against the devices' per step and fuses ``k`` steps a dispatch while that pays
        (``k = 1`` where the devices are the limit; see ``docs/utilisation.md``); the numbers are those of
        ``steps_per_execution=1``, batch callbacks are called once per execution, as with a fixed ``k``.
      accumulation_steps: split each global batch into this many micro-batches (gradient accumulation:
        the same update as the whole batch, with a fraction of the activation memory).
      prefetch: batches placed on the devices ahead of the running step, on a background thread (0: place
        synchronously, between the dispatch of a step and the wait for the one before, so the copy
        overlaps the devices' work anyway). ``"auto"`` is 0: placing holds Python's lock for most of its
        time, so a second thread only takes turns with the dispatching one (the figures are in
        ``benchmarks/README.md``, "Why the code is as it is"). A thread pays for inputs whose batches are slow
        to make on the host and release the lock meanwhile. With 0 on one device of one process a batch is
        not placed at all: the step takes the host's rows and its dispatch transfers them, as ``jax.jit`` does.
      on_nonfinite: ``"raise"``, ``"skip"`` (drop the update, count it in the history) or ``"ignore"``.
      donate: donate the state buffers to each train step (no copy of the state per step).
      mixed_precision: ``"bfloat16"`` (bf16 compute, float32 variables) or ``"float16"`` (also dynamic
        loss scaling), for Keras models and Flax NNX modules (an NNX module's layers' ``dtype``; its loss
        scaled by :func:`mirrorax.models.loss_scale.dynamic_loss_scale`); ``None`` keeps the model's own
        dtype policy.
      reading: how ``fit`` reads the data (a :class:`mirrorax.FitReading`: where an epoch of
        ``steps_per_epoch`` ends, the order of each pass over arrays); default: the model's front-end's, else
        mirrorax's (exactly ``steps_per_epoch`` batches, passes shuffled by ``(seed, pass)``). A Keras model's
        own ``fit`` under a scope reads as Keras's ``fit`` does (``mirrorax.keras.order.KERAS_FIT``).
      max_in_flight: not the Trainer's: a value raises ``TypeError`` naming the strategy's
        ``MirroredStrategy(max_in_flight=k)``, which bounds the trainer's steps.

    Example:
      >>> strategy = mx.MirroredStrategy()
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
      ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
      >>> trainer = mx.Trainer(model)
      >>> history = trainer.fit(x, y, batch_size=64, epochs=2, verbose=0)
    """

    def __init__(self, model: Any, strategy: MirroredStrategy | None = None, *, loss: Any = None,
                 optimizer: Any = None, metrics: Any = None, steps_per_execution: int | Literal["auto"] = 1,
                 accumulation_steps: int = 1, prefetch: int | Literal["auto"] = "auto",
                 on_nonfinite: NonFiniteMode = "raise", donate: bool = True,
                 mixed_precision: Literal["bfloat16", "float16"] | None = None,
                 reading: FitReading | None = None, max_in_flight: None = None) -> None:
        if max_in_flight is not None:
            raise TypeError(f"Trainer takes no max_in_flight; received max_in_flight={max_in_flight!r}. The dispatch "
                            "bound is the strategy's, shared by fit, evaluate, predict, strategy.jit and "
                            f"strategy.run: pass mx.MirroredStrategy(max_in_flight={max_in_flight!r}) as the "
                            "Trainer's strategy.")
        if strategy is not None and not isinstance(strategy, MirroredStrategy):
            raise TypeError(f"strategy must be a mirrorax.MirroredStrategy; received {strategy!r} (of type "
                            f"{type(strategy).__name__}). Pass e.g. mx.MirroredStrategy() (every device) or "
                            "mx.MirroredStrategy(devices=jax.devices('gpu')[:2]).")
        if reading is not None and not isinstance(reading, FitReading):
            raise TypeError(f"reading must be a mirrorax.FitReading; received {reading!r} (of type "
                            f"{type(reading).__name__}). Pass e.g. mx.FitReading(ends_with_data=True), or leave it "
                            "out for the model's own reading.")
        if prefetch == "auto":
            prefetch = 0
        auto_steps = isinstance(steps_per_execution, str) and steps_per_execution == "auto"
        if isinstance(steps_per_execution, str) and not auto_steps:
            raise ValueError(f"steps_per_execution must be an integer >= 1 or 'auto'; received "
                             f"{steps_per_execution!r}. Pass e.g. 8, or 'auto' to let fit choose as it runs.")
        for name, value, low in (("steps_per_execution", 1 if auto_steps else steps_per_execution, 1),
                                 ("accumulation_steps", accumulation_steps, 1),
                                 ("prefetch", prefetch, 0)):
            check_int(name, value, low)
        self.strategy = strategy or get_strategy()
        self._model = model
        self.adapter: ModelAdapter = adapt(model, loss=loss, optimizer=optimizer, metrics=metrics,
                                           mixed_precision=mixed_precision)
        kind = front_end.of(model)
        self.reading: FitReading = reading or (kind.reading if kind is not None else None) or FitReading()
        self.steps_per_execution = steps_per_execution
        self.accumulation_steps = accumulation_steps
        self.prefetch = int(prefetch)  # "auto" is resolved above
        self.steps = StepFunctions(self.adapter, self.strategy, donate=donate, on_nonfinite=on_nonfinite,
                                   accumulation_steps=accumulation_steps, placed_ahead=self.prefetch > 0)
        self.device_state = DeviceState(self.adapter, self.strategy)
        self.loop = Loop(self.device_state, self.steps, model, prefetch=self.prefetch,
                         steps_per_execution=1 if auto_steps else int(steps_per_execution), auto_steps=auto_steps)
        self.stream: IO[str] = sys.stdout
        planner.remember_trainer(model, self)  # mx.plan(model) plans this trainer's own step
        # NaN/inf in array inputs are refused up front unless non-finite steps are to be skipped or
        # ignored: then the user has chosen to train on past them.
        self.refuses_nonfinite = on_nonfinite == "raise"

    # -- state -------------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The model trained (its callbacks' ``Callback.model``, its ``stop_training`` flag)."""
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model
        self.loop.model = model
        planner.remember_trainer(model, self)

    @property
    def utilisation(self) -> list[Utilisation]:
        """Where the time of each epoch of the last ``fit`` went: a :class:`mirrorax.Utilisation` per epoch (MFU, the
        devices' busy share, the input's wait share), as each epoch's progress line ends; ``[]`` before a fit."""
        try:
            return utilisation_of(self)
        except ValueError:
            return []

    @property
    def state(self) -> TrainState | None:
        """The training state on the devices, a :class:`mirrorax.TrainState` (``state.params``,
        ``state.model_state``, ``state.optimizer``, ``state.metrics``, ``state.step`` and the other
        counters; ``state["params"]`` reads the same), or ``None`` before the first fit, evaluate or
        predict."""
        return self.device_state.value

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
        from mirrorax.checkpoint.checkpointer import Checkpointer, CheckpointError

        if "://" not in os.fspath(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise CheckpointError(f"No checkpoint directory {os.fspath(checkpoint_dir)!r}. Pass the checkpoint_dir "
                                  "that fit(checkpoint_dir=...) wrote.")
        trainer = cls(model, strategy, **trainer_kwargs)
        held = trainer.device_state
        with Checkpointer(checkpoint_dir, keep=None, read_only=True) as ckpt:
            meta = ckpt.read_meta()
            if meta is None or "sample_spec" not in meta:
                raise CheckpointError(f"{ckpt.directory} holds no mirrorax checkpoint (steps: {ckpt.all_steps()}).")
            held.ensure(resume_lib.sample_from_spec(meta["sample_spec"]))
            restored = ckpt.restore_latest(held.abstract())
            if restored is None:
                raise CheckpointError(f"{ckpt.directory} holds no readable checkpoint.")
            held.value = restored[1]
        held.write_back()
        return trainer

    def host_state(self) -> TrainState:
        """A host copy of the training state: a :class:`mirrorax.TrainState` of numpy arrays."""
        if self.device_state.value is None:
            raise RuntimeError("The trainer has no state yet; call fit, evaluate or predict first.")
        return host_tree(self.device_state.value)

    # -- fit ---------------------------------------------------------------------------------------
    @_first_call.with_room  # the frame stack's room for the whole call: mirrorax.steps.first_call
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
        return self._fit(fit_plan.FitArgs(
            x, y, batch_size=batch_size, epochs=epochs, validation_data=validation_data,
            validation_batch_size=validation_batch_size, validation_steps=validation_steps,
            validation_freq=validation_freq, shuffle=shuffle, seed=seed, sample_weight=sample_weight,
            steps_per_epoch=steps_per_epoch, initial_epoch=initial_epoch, callbacks=callbacks, verbose=verbose,
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints))

    @_first_call.with_room  # the frame stack's room for the whole call: mirrorax.steps.first_call
    def fit_with(self, args: fit_plan.FitArgs) -> History:
        """:meth:`fit` on its arguments read into one record (a :class:`mirrorax.fit.fit_plan.FitArgs`, what a
        Keras model's own ``fit`` under a scope builds): prepare, resume, run the epochs, finish."""
        return self._fit(args)

    def _fit(self, args: fit_plan.FitArgs) -> History:  # (fit's body: the callers give it the room)
        plan = fit_plan.prepare(self.device_state, self.steps, self.model, args, out=self.stream,
                                steps_per_execution=self.loop.steps_per_execution,
                                refuse_nonfinite=self.refuses_nonfinite, reading=self.reading)
        stopped: preemption.Preempted | None = None
        training_logs: dict[str, float] = {}
        try:
            training_logs = self.loop.fit(fit_plan.resume(plan, self.device_state))
            plan.saving.finish(self.device_state.live, plan.epochs)  # (a restarted script passes through this fit)
        except preemption.Preempted as stop:
            stopped = stop
        finally:
            try:
                self.device_state.write_back()
                self._finalize_optimizer(args.epochs)
                plan.saving.close()  # the snapshots and checkpoints on disk, the directory's lock released
            finally:
                # Only now: a second SIGTERM while the checkpoint is written must not end the process.
                plan.watch.close()
        if stopped is not None:
            # Said only now that the checkpoint is on disk (close waited for the write).
            _raise_stopped(stopped, plan.watch, self.strategy.is_primary)
        plan.hooks.call("on_train_end", training_logs)
        if hasattr(self.model, "stop_training"):
            self.model.stop_training = False
        return plan.history

    def _finalize_optimizer(self, epochs: int) -> None:
        """Keras's end of ``fit``: ``optimizer.finalize_variable_values`` (``use_ema=True`` puts the moving
        averages into the model's weights), on the values just lent back; adopted as a model change."""
        optimizer: Any = getattr(self.model, "optimizer", None)
        if epochs <= 0 or getattr(self.adapter, "optax", None) is not None or \
                not callable(getattr(optimizer, "finalize_variable_values", None)):
            return
        optimizer.finalize_variable_values(self.model.trainable_weights)

    # -- evaluate / predict ------------------------------------------------------------------------
    @_first_call.with_room  # the frame stack's room for the whole call: mirrorax.steps.first_call
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
        one = fit_plan.prepare_pass(self.adapter, self.model, self.strategy.process_count, "evaluate", x, y,
                                    sample_weight, batch_size=batch_size, steps=steps, callbacks=callbacks,
                                    refuse_nonfinite=self.refuses_nonfinite)
        logs = self.loop.evaluate(one.source, one.batch_size, steps=one.steps, hooks=one.hooks,
                                  warn_short=self.reading.ends_with_data)
        if self.strategy.is_primary and resolve_verbose(verbose, self.stream):
            self.stream.write(f"evaluate - {format_logs(logs)}\n")
        return logs

    @_first_call.with_room  # the frame stack's room for the whole call: mirrorax.steps.first_call
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
        one = fit_plan.prepare_pass(self.adapter, self.model, self.strategy.process_count, "predict", x,
                                    batch_size=batch_size, steps=steps, callbacks=callbacks,
                                    refuse_nonfinite=self.refuses_nonfinite)
        return self.loop.predict(one.source, one.batch_size, steps=one.steps, hooks=one.hooks,
                                 warn_short=self.reading.ends_with_data)

    # -- one batch (Keras's *_on_batch) ------------------------------------------------------------
    def train_on_batch(self, x: Any, y: Any = None, *, sample_weight: Any = None, class_weight: Any = None
                       ) -> dict[str, float]:
        """One train step on one global batch (padded to the device count); its loss and metrics.

        The metrics cover this batch only (as Keras's ``train_on_batch``). The step is ``fit``'s, prepared and run
        as ``fit`` runs it: a label outside the classes raises ``ValueError`` and a non-finite loss
        :class:`NonFiniteLossError` (unless ``on_nonfinite`` says otherwise), the update not applied.

        Example:
          >>> logs = trainer.train_on_batch(x[:64], y[:64])
        """
        if class_weight is not None:
            sample_weight = class_weights(y, class_weight, sample_weight)
        one = fit_plan.prepare_pass(self.adapter, self.model, self.strategy.process_count, "train", x, y,
                                    sample_weight, batch_size="all", refuse_nonfinite=self.refuses_nonfinite)
        logs = self.loop.train_on_batch(one.source, one.batch_size)
        self.device_state.write_back()
        return logs

    def test_on_batch(self, x: Any, y: Any = None, *, sample_weight: Any = None) -> dict[str, float]:
        """Loss and metrics of one batch in inference mode (Keras's ``test_on_batch``)."""
        one = fit_plan.prepare_pass(self.adapter, self.model, self.strategy.process_count, "evaluate", x, y,
                                    sample_weight, batch_size="all", refuse_nonfinite=self.refuses_nonfinite)
        return self.loop.evaluate(one.source, one.batch_size)

    def compile_counts(self) -> dict[str, int]:
        """Programs compiled per step kind: one per placed shape and real row count (a full batch and a
        short last batch: two)."""
        return self.steps.compile_counts()


def _raise_stopped(stopped: preemption.Preempted, watch: preemption.Watch, primary: bool) -> NoReturn:
    """Says why fit stopped early and raises it: ``stopped`` for SIGTERM, ``KeyboardInterrupt`` for Ctrl-C
    on one process (stopped, and saved, as a preemption)."""
    if watch.interrupted:
        message = (stopped.message.replace("preempted (SIGTERM)", "interrupted (Ctrl-C)")
                   .replace(f"; exiting with status {preemption.PREEMPTED_EXIT_CODE}", "")
                   .replace(" on SIGTERM", " on Ctrl-C"))
        preemption.announce(message, primary)
        raise KeyboardInterrupt(message)
    preemption.announce(stopped.message, primary)
    raise stopped
