"""``fit``'s preparation: its arguments read once into one record, :class:`FitPlan`, that the epochs run on.

``Trainer.fit`` is three moves: :func:`prepare` (check the arguments, make the sources and the stream,
build and place the state, check the targets, compile and plan the first step, open the checkpoint and
the callbacks), :func:`resume` (the newest good checkpoint, if any: the plan's start moves there) and the
epoch runner (``Loop.fit``, each epoch ``Loop.epoch``), which read what they need from the plan. Nothing
of the model, its state or its callbacks changes until ``prepare`` has returned: a refused input leaves
them as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import IO, Any, Literal

from mirrorax._checks import check_int
from mirrorax.checkpoint import resume as resume_lib
from mirrorax.checkpoint import snapshot
from mirrorax.cluster import consistency, preemption
from mirrorax.fit import elastic, planner
from mirrorax.fit.device_state import DeviceState
from mirrorax.fit.functions import StepFunctions
from mirrorax.fit.hooks import Callbacks
from mirrorax.fit.progress import resolve_verbose
from mirrorax.fit.saving import Saving, check_every
from mirrorax.inputs.arrays import ArraySource
from mirrorax.inputs.checks import check_batch_size
from mirrorax.inputs.make import is_array_tree, is_source, make_source, validation_source
from mirrorax.inputs.position import InputState
from mirrorax.inputs.reading import FitReading
from mirrorax.inputs.source import Source
from mirrorax.inputs.streams import Stream
from mirrorax.results import History

__all__ = ["FitArgs", "FitPlan", "PassPlan", "Start", "pass_source", "prepare", "prepare_pass", "resume"]


@dataclasses.dataclass(frozen=True)
class FitArgs:
    """``fit``'s arguments, as ``Trainer.fit`` documents them: built once where the call comes in
    (``Trainer.fit``, a Keras model's ``fit`` under a scope) and read by everything below.

    ``x`` may also be the training input made a source already (:func:`pass_source`, by a caller that read
    ``x`` itself: a Keras model's ``fit``), ``y`` and ``sample_weight`` then in it.
    """

    x: Any
    y: Any = None
    batch_size: int | None = None
    epochs: int = 1
    validation_data: Any = None
    validation_batch_size: int | None = None
    validation_steps: int | None = None
    validation_freq: int | Sequence[int] = 1
    shuffle: bool | Literal["batch"] = True
    seed: int = 0
    sample_weight: Any = None
    steps_per_epoch: int | None = None
    initial_epoch: int = 0
    callbacks: Any = None
    verbose: int | str = "auto"
    checkpoint_dir: Any = None
    checkpoint_every: int | str = "epoch"
    keep_checkpoints: int | None = 3


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a fit's epochs start: the epoch, the batch within it (a resumed run's), and the input's own
    saved position (``meta["input_state"]`` of the checkpoint resumed from)."""

    epoch: int
    batch: int = 0
    input_state: dict[str, Any] | None = None
    first_epoch: int | None = None  # a resumed fit's first epoch (Keras's order counts its passes from there)


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """One ``fit``: what its epochs run on, read once from its arguments by :func:`prepare`.

    Attributes:
      source: the training input; ``validation``: the validation input (``None``: no validation).
      stream: the training batches of every epoch (``Source.stream``).
      hooks: the user's callbacks, driven as Keras's fit drives them.
      watch: SIGTERM / Ctrl-C, watched from the start of ``prepare`` to the end of fit.
      history: the fit's history (a resumed run's earlier epochs restored into it).
      saving: what the fit saves, where and when (:class:`mirrorax.fit.saving.Saving`: the checkpoints of
        ``checkpoint_dir``, the snapshots of an elastic job, the record kept with them, and the resume).
      inputs: the input's own position, kept in checkpoints (``None``: found by index, or replayed).
      start: where the epochs start (:func:`resume` and Keras's ``BackupAndRestore`` move it).
      resumed: whether ``start`` is a checkpoint's (or a snapshot's).
      epochs, steps_per_epoch, batch_size: as given to fit (``batch_size`` resolved).
      validation_batch_size, validation_steps: the validation's batch and batches; ``validate(epoch)``:
        whether epoch ``epoch`` (0-based) ends with a validation.
      mode: the progress output's verbosity (0 off this process's primary); ``out``: where it goes.
      reading: how the data is read (:class:`mirrorax.FitReading`: where an epoch ends; an order drawn per
        pass, its passes counted from the fit's first epoch).
    """

    source: Source
    validation: Source | None
    stream: Stream
    hooks: Callbacks
    watch: preemption.Watch
    history: History
    saving: Saving
    inputs: InputState | None
    start: Start
    epochs: int
    steps_per_epoch: int | None
    batch_size: int
    validation_batch_size: int
    validation_steps: int | None
    validate: Callable[[int], bool]
    mode: int
    out: IO[str]
    reading: FitReading
    resumed: bool = False

    @property
    def first_epoch(self) -> int:
        """The epoch the stream's epochs are counted from: an order drawn per pass (Keras's) counts each fit's
        passes from its first epoch, as Keras's iterator does; mirrorax's from epoch 0 (a resumed run replays
        it)."""
        if self.reading.order is None:
            return 0
        return self.start.epoch if self.start.first_epoch is None else self.start.first_epoch

    def starting_at(self, epoch: int) -> FitPlan:
        """The same plan, starting at the beginning of ``epoch``."""
        return dataclasses.replace(self, start=Start(epoch))


def prepare(device: DeviceState, steps: StepFunctions, model: Any, args: FitArgs, *, out: IO[str],
            steps_per_execution: int, refuse_nonfinite: bool, reading: FitReading) -> FitPlan:
    """Reads ``fit``'s arguments (``args``) into a :class:`FitPlan`.

    Checks every argument, makes the sources (large arrays scanned for NaN/inf on a thread, joined last),
    places the state, checks the targets, compiles and plans the first step, opens the checkpoint
    directory and the callbacks. SIGTERM is watched from the start (one that comes while the step
    compiles stops fit at its first step); on an error the watch is closed again.

    Args:
      device, steps, model: the trainer's state on the devices, its step functions and its model.
      out: where progress goes; ``steps_per_execution``: the trainer's.
      refuse_nonfinite: refuse NaN/inf in array inputs (``on_nonfinite="raise"``).
      reading: how the data is read (see :class:`FitPlan`).

    Raises:
      ValueError / TypeError: bad inputs, raised before any compilation.
      CheckpointError: ``checkpoint_dir`` is not writable.
    """
    strategy, adapter = steps.strategy, steps.adapter
    mode = resolve_verbose(args.verbose, out) if strategy.is_primary else 0
    watch = preemption.Watch(strategy.process_count)
    watch.start()
    ready = False
    source: Source | None = None
    val: Source | None = None
    saving: Saving | None = None
    checkpoints: Any = None
    try:
        check_int("epochs", args.epochs, low=0)
        check_int("initial_epoch", args.initial_epoch, low=0)
        check_int("seed", args.seed, low=0)
        if args.steps_per_epoch is not None:
            check_int("steps_per_epoch", args.steps_per_epoch)
        if args.validation_batch_size is not None:
            check_batch_size(args.validation_batch_size)
        every = check_every(args.checkpoint_every)
        # The input read as every call reads its input (large arrays scanned for NaN/inf on a thread, joined
        # below before anything changes).
        one = prepare_pass(adapter, model, strategy.process_count, "fit", args.x, args.y, args.sample_weight,
                           batch_size=args.batch_size, refuse_nonfinite=refuse_nonfinite)
        source, batch_size = one.source, one.batch_size
        val = validation_source(args.validation_data, float_dtype=adapter.float_dtype,
                                check_finite=refuse_nonfinite, targets=adapter.needs_targets("evaluate"),
                                scan_in_background=True)
        checkpoints = Saving.open_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
        callbacks = args.callbacks
        if callbacks is not None and not isinstance(callbacks, (list, tuple)) and \
                type(callbacks).__name__ != "CallbackList":  # (Keras's fit under a scope passes its own list)
            callbacks = [callbacks]  # one callback, not in a list: as Keras's own fit takes it
        sample = source.sample(batch_size, strategy)
        device.ensure(sample)
        for s in (source, val):  # shapes against the outputs, labels against the classes: before compiling
            if s is not None:
                s.check_targets(adapter)
        # Labels the host has checked whole need no search in the step.
        steps.check_labels_in_step(not source.labels_checked)
        consistency.check_replicas(device.value)  # multi-process: every process holds process 0's values
        device.write_back()  # lent to the model: what callbacks change on it from here on is adopted
        # The plan's line (verbose, on process 0; with steps_per_execution > 1 fit runs another program and
        # says nothing), and will it fit? (only where a device's memory is known): the step is compiled
        # here, once, for the state just placed; step 1 runs that very program.
        planner.at_fit_start(model, steps, device, sample, batch_size, stream=out,
                             announce=bool(mode) and steps_per_execution == 1)
        history = History()
        stream = source.stream(batch_size, strategy, shuffle=args.shuffle, seed=args.seed,
                               reading=reading)
        per_epoch = args.steps_per_epoch or stream.batches_per_pass
        hooks = Callbacks(callbacks, model, epochs=args.epochs, steps=per_epoch, verbose=0 if not mode else mode)
        validate = _validation_schedule(args.validation_freq)
        if strategy.process_count > 1:  # every process must take the same path through each step
            hooks.listens = {kind: consistency.any_process(v) for kind, v in hooks.listens.items()}
        shuffle = "batch" if args.shuffle == "batch" else bool(args.shuffle)
        run: dict[str, Any] = {"batch_size": batch_size, "shuffle": shuffle, "seed": int(args.seed),
                               "steps_per_epoch": args.steps_per_epoch}
        configured = resume_lib.hyperparameters(device.value)  # as now, before a resume or a callback changes them
        if args.checkpoint_dir is not None:
            run["hyperparameters"] = configured
        # An elastic job's restart resumes from a snapshot, as from a checkpoint: the input's position is kept too.
        saved = args.checkpoint_dir is not None or snapshot.configured()
        inputs = source.track_position(strategy.process_count) if saved else None
        spec = resume_lib.sample_spec(sample)
        saving = Saving.open(
            resume_lib.Record(run, history, spec, inputs), checkpoints, every=every,
            job=lambda directory: elastic.job_identity(run=run, state=device.value, hyperparameters=configured,
                                                       model=model, source=source, spec=spec,
                                                       checkpoint_dir=directory))
        _wait_checked(source, val)  # the join: nothing of the model, the state or the callbacks changed yet
        ready = True
    except Exception:
        _wait_checked(source, val)  # a NaN the scan finds is the first error, as when it ran up front
        raise
    finally:
        if not ready:
            watch.close()
            if saving is not None:
                saving.close()  # its lock released: the same call again may take the directory
            elif checkpoints is not None:
                checkpoints.close()  # (Saving.open closes it when it fails)
    return FitPlan(source=source, validation=val, stream=stream, hooks=hooks, watch=watch, history=history,
                   saving=saving, inputs=inputs, start=Start(args.initial_epoch),
                   epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, batch_size=batch_size,
                   validation_batch_size=args.validation_batch_size or batch_size,
                   validation_steps=args.validation_steps, validate=validate, mode=mode, out=out, reading=reading)


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """One pass of ``evaluate`` or ``predict``, or one batch of ``train_on_batch`` / ``test_on_batch``, read once
    from its arguments by :func:`prepare_pass`: its input, its global batch, its batches (``None``: all) and its
    callbacks (``None``: none)."""

    source: Source
    batch_size: int
    steps: int | None
    hooks: Callbacks | None


PassKind = Literal["fit", "train", "evaluate", "predict"]


def pass_source(adapter: Any, kind: PassKind, x: Any, y: Any = None, sample_weight: Any = None, *,
                refuse_nonfinite: bool, arrays: bool | None = None) -> Source:
    """The input of ``fit``, of one pass (``evaluate``, ``predict``) or of one batch (``kind="train"``:
    ``train_on_batch``) as a :class:`~mirrorax.inputs.source.Source`, in the model's float type: ``predict``
    takes the inputs of ``(x, y)`` / ``(x, y, w)`` batches, and NaN inputs (which spoil only their own rows'
    outputs); the others refuse NaN/inf when ``refuse_nonfinite`` (``fit``: large arrays scanned on a thread,
    joined by :func:`prepare`) and require targets where the model needs them. ``arrays``: whether ``x`` holds
    arrays, when the caller has looked already (a Keras model's ``fit`` or ``evaluate`` under a scope)."""
    if arrays is None:
        arrays = is_array_tree(x)
    if kind == "predict":
        if not arrays and isinstance(x, tuple) and len(x) in (2, 3):
            x = x[0]  # the inputs of an (x, y) / (x, y, w) tuple
            arrays = is_array_tree(x)
        return make_source(x, float_dtype=adapter.float_dtype, check_finite=False, arrays=arrays)
    source = make_source(x, y, sample_weight, float_dtype=adapter.float_dtype, check_finite=refuse_nonfinite,
                         scan_in_background=kind == "fit", arrays=arrays)
    if adapter.needs_targets("fit" if kind == "train" else kind):
        source.require_targets("train_on_batch" if kind == "train" else kind)
    return source


def prepare_pass(adapter: Any, model: Any, process_count: int, kind: PassKind, x: Any, y: Any = None,
                 sample_weight: Any = None, *, batch_size: int | Literal["all"] | None, steps: int | None = None,
                 callbacks: Any = None, refuse_nonfinite: bool) -> PassPlan:
    """Reads the input arguments of ``fit`` (the start of :func:`prepare`), of ``evaluate``, ``predict`` (as
    ``Trainer.evaluate`` / ``predict`` document them) or of one batch (``train_on_batch``, ``test_on_batch``,
    ``predict_on_batch``) into a :class:`PassPlan`: the source
    (:func:`pass_source`; ``x`` may be one already, made by a caller that read ``x`` itself), the batch (the
    source's default, ``"all"``: the whole input as one batch, else checked), the steps checked, the callbacks
    (``on_test_*`` / ``on_predict_*``).

    Raises:
      ValueError / TypeError: bad inputs, raised before any compilation.
    """
    one_batch = batch_size == "all"
    if one_batch and not is_source(x) and not is_array_tree(x):
        raise TypeError(f"One batch must be arrays (an array, or a tuple/list/dict of arrays); received x of type "
                        f"{type(x).__name__}. Pass the batch itself, e.g. np.asarray(x).")
    source = x if is_source(x) else pass_source(adapter, kind, x, y, sample_weight, refuse_nonfinite=refuse_nonfinite,
                                                arrays=True if one_batch else None)
    if one_batch:
        if not isinstance(source, ArraySource):
            raise TypeError(f"One batch must be arrays; received a source of batches ({type(source).__name__}).")
        batch = source.num_examples
    elif batch_size is None:
        batch = source.default_batch_size(process_count)
    else:
        batch = check_batch_size(batch_size)
    if steps is not None:
        check_int("steps", steps)
    hooks = Callbacks(callbacks, model, epochs=1, steps=steps, verbose=0) if callbacks is not None else None
    return PassPlan(source, batch, steps, hooks)


def resume(plan: FitPlan, device: DeviceState) -> FitPlan:
    """``plan`` started where the newest good record of its saving stopped (a checkpoint of its directory, or an
    elastic job's snapshot), that record's state placed on ``device`` and its history restored into
    ``plan.history``; ``plan`` itself when there is nothing to resume from.

    Raises:
      CheckpointError: the record belongs to a run with another global batch, order or seed.
      CheckpointMismatchError: it belongs to a different model.
    """
    found = plan.saving.resume(device.abstract(), plan.history)
    if found is None:
        return plan
    resumed, kind, where = found
    device.value = resumed.state
    if plan.mode:
        plan.out.write(f"Resumed from {kind} step {resumed.step} in {where} "
                       f"(epoch {resumed.epoch + 1}, batch {resumed.batch_in_epoch}).\n")
    plan.saving.say_restart(resumed, kind, plan.epochs, len(resumed.state.counters.sharding.device_set))
    if resumed.order_state is not None and plan.reading.order is not None:  # the resumed pass's order, drawn again
        plan.reading.order.restore(resumed.order_state)
    # A resumed fit's data order counts its passes from where the interrupted fit counted them.
    start = Start(resumed.epoch, resumed.batch_in_epoch, resumed.input_state, first_epoch=plan.start.epoch)
    return dataclasses.replace(plan, start=start, resumed=True)


def _wait_checked(*sources: Source | None) -> None:
    """Joins the NaN/inf scans of array sources (run on a thread for large arrays), raising what they found.

    ``prepare`` joins them at its end, after the state is built, the targets checked and the first step
    compiled where the plan compiles it, and before a checkpoint is restored, a callback hears
    ``on_train_begin`` or a step runs: a refused input leaves the model, its optimizer and the callbacks
    as they were. (``ArraySource.batches`` waits too: no batch is ever read from unchecked arrays.)
    """
    for s in sources:
        if isinstance(s, ArraySource):
            s.wait_checked()


def _validation_schedule(freq: Any) -> Callable[[int], bool]:
    """Keras's ``validation_freq``: every ``freq`` epochs, or after the (1-based) epochs listed."""
    if isinstance(freq, (list, tuple, set)):
        wanted = {int(e) for e in freq}
        return lambda epoch: epoch + 1 in wanted
    check_int("validation_freq", freq)
    return lambda epoch: (epoch + 1) % int(freq) == 0
