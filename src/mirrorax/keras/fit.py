"""The TF program unchanged: a Keras model made or compiled under ``strategy.scope()`` trains on mirrorax.

As in TF, a model remembers the strategy it was built (or compiled) under: its own ``fit``,
``evaluate``, ``predict``, ``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` then run on
a :class:`mirrorax.Trainer` for that model and strategy (one engine, the Trainer's guarantees: global
batch, short batches computed on their real rows, exact metrics, bounded dispatch, donation), whether
they are called inside the scope or after it. Models made outside any scope are untouched. A class
that overrides one of them (keras_hub's tasks override all six to preprocess) keeps its override, and
the override's ``super().fit(...)`` lands on mirrorax for that model.

How: while a scope is open (and only then), Keras's model constructor and ``compile`` are wrapped so
that a model created or compiled in it gets the strategy and these six methods as attributes of its
own; leaving the last open scope restores Keras's functions. Nothing global outlives the scope. An
override runs with Keras's six methods wrapped by a dispatcher (:func:`_through_override`) that sends
this thread's call for that model to mirrorax and every other call to Keras; the last override in flight
restores them when it returns.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from mirrorax.keras import _internals as internals
from mirrorax.keras import data as keras_data
from mirrorax.keras import env as _keras_env
from mirrorax.keras import order as keras_order
from mirrorax.models.base import attach_strategy, strategy_of
from mirrorax.strategy import MirroredStrategy, on_scope

if TYPE_CHECKING:
    from mirrorax.trainer import Trainer

__all__ = ["strategy_of", "steps_per_execution", "trainer_of", "enter", "leave"]

_lock = threading.Lock()
_open_scopes = 0
_saved: dict[str, Any] = {}
_overriding = 0  # calls of a class's override of a routed method in flight, all threads
_calls = threading.local()  # .models: the models whose override runs on this thread, innermost last
_ROUTED = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


def enter(strategy: MirroredStrategy) -> None:
    """Called when a scope opens: wraps Keras's model constructor and ``compile`` (first open scope)."""
    global _open_scopes
    with _lock:
        _open_scopes += 1
        if _open_scopes > 1:
            return
        try:
            JAXTrainer, KerasTrainer = internals.jax_trainer(), internals.keras_trainer()
        except ImportError:  # no Keras, or Keras on another backend: nothing to attach to
            return
        _saved["init"] = JAXTrainer.__init__
        _saved["compile"] = KerasTrainer.compile
        JAXTrainer.__init__ = _wrap(JAXTrainer.__init__, "creating a model")
        KerasTrainer.compile = _wrap(_auto_steps(KerasTrainer.compile), "compile")


def leave() -> None:
    """Called when a scope closes: the last one restores Keras's functions."""
    global _open_scopes
    with _lock:
        _open_scopes -= 1
        if _open_scopes or not _saved:
            return
        JAXTrainer, KerasTrainer = internals.jax_trainer(), internals.keras_trainer()
        JAXTrainer.__init__ = _saved.pop("init")
        KerasTrainer.compile = _saved.pop("compile")


def _check_scope(strategy: MirroredStrategy) -> None:
    _keras_env.check_scope()  # Keras on another backend, a keras.distribution: said at scope(), not at fit


def _leave(strategy: MirroredStrategy) -> None:
    leave()


# The strategy does not import this module (it is above it): a scope opening tells it through these.
on_scope(_check_scope)
on_scope(enter, _leave)  # models made or compiled in the scope belong to it


def _wrap(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        from mirrorax.strategy import current_scope

        strategy = current_scope()  # this thread's scope; another thread's models stay plain Keras
        if strategy is not None:
            _keras_env.check_distribution(what)  # set after the scope opened: before the model is made
        result = original(self, *args, **kwargs)
        if strategy is not None:
            _attach(self, strategy)
        return result

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


_SPE_AT = 6  # steps_per_execution's position among Keras's compile arguments (after self)


def _auto_steps(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's ``compile``, taking ``steps_per_execution="auto"`` as tf.keras 2.x did (Keras 3 takes an int
    only): Keras is given 1 (its own functions compare the setting with numbers) and the model remembers
    ``"auto"`` for its fit under the scope (``mirrorax.fit.auto_steps``). A later compile replaces it."""

    @functools.wraps(compile_)
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        auto = kwargs.get("steps_per_execution") == "auto"
        if auto:
            kwargs["steps_per_execution"] = 1
        elif len(args) > _SPE_AT and args[_SPE_AT] == "auto":  # compile(optimizer, loss, ..., "auto")
            args, auto = (*args[:_SPE_AT], 1, *args[_SPE_AT + 1:]), True
        result = compile_(self, *args, **kwargs)
        object.__setattr__(self, "_mirrorax_auto_steps", auto)
        return result

    return compile


def steps_per_execution(model: Any) -> int | Literal["auto"]:
    """A Keras model's steps per execution as its fit under a scope runs them: ``"auto"`` where it was compiled
    so (under a scope, or with Keras's own compile, which stores the string), else Keras's int."""
    own = model.steps_per_execution
    if model.__dict__.get("_mirrorax_auto_steps") or (isinstance(own, str) and own == "auto"):
        return "auto"
    return int(own or 1)


def _attach(model: Any, strategy: MirroredStrategy) -> None:
    import keras

    # A model is a layer mixed with a Trainer (keras.Model is one; Keras's own tests build others).
    if not (internals.is_keras_trainer(model) and isinstance(model, keras.layers.Layer)):
        return
    attach_strategy(model, strategy)
    _mirror_variables(model, strategy)
    for name in _ROUTED:
        # A method the model's class overrides runs, and its super() call comes back to mirrorax.
        overridden = _keras_own(getattr(type(model), name)) is not _keras_own(getattr(keras.Model, name))
        method = _through_override(name) if overridden else _METHODS[name]
        object.__setattr__(model, name, types.MethodType(method, model))


def _keras_own(method: Any) -> Any:
    """Keras's own function behind ``method`` (itself, or what a dispatcher stands in for)."""
    return getattr(method, "mirrorax_keras_own", method)


def _through_override(name: str) -> Callable[..., Any]:
    """The routed ``name`` of a model whose class overrides it: the override runs (keras_hub's
    preprocessing, a user's extra callback) while Keras's own ``name`` (what its ``super()`` call
    reaches) is a dispatcher that sends this model's calls on this thread to mirrorax."""

    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _overriding
        JAXTrainer = internals.jax_trainer()
        with _lock:
            _overriding += 1
            if _overriding == 1:
                for n in _ROUTED:
                    setattr(JAXTrainer, n, _dispatcher(n, getattr(JAXTrainer, n)))
        models = _calls.__dict__.setdefault("models", [])
        models.append(self)
        try:
            return getattr(type(self), name).__get__(self, type(self))(*args, **kwargs)
        finally:
            models.pop()
            with _lock:
                _overriding -= 1
                if not _overriding:
                    for n in _ROUTED:
                        setattr(JAXTrainer, n, _keras_own(getattr(JAXTrainer, n)))

    routed.__name__ = routed.__qualname__ = name
    return routed


def _dispatcher(name: str, own: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's ``own`` ``name``, sending the models whose override runs on this thread to mirrorax."""

    @functools.wraps(own)
    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(m is self for m in getattr(_calls, "models", ())):
            return _METHODS[name](self, *args, **kwargs)
        return own(self, *args, **kwargs)  # another model, or another thread: Keras's own

    dispatch.mirrorax_keras_own = own  # type: ignore[attr-defined]
    return dispatch


def _mirror_variables(model: Any, strategy: MirroredStrategy) -> None:
    """Lays the variables the model has so far (at ``compile``: its weights) out on the strategy's
    devices, as ``fit`` will (replicated; split where the strategy's ``shard=`` splits that variable),
    and keeps every later assignment there. Variables made later get their layout at the first fit,
    evaluate or predict (``KerasAdapter.write_back``). A model being constructed has none yet."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mirrorax.keras.adapter import keep_layout, layout_paths

    if strategy.process_count > 1:  # each process's model holds whole values on its own devices
        local = NamedSharding(Mesh(np.array(strategy.local_devices), ("batch",)), PartitionSpec())
    optimizer = getattr(model, "optimizer", None)
    try:
        groups = [(model.trainable_variables, "params"), (model.non_trainable_variables, "model_state")]
    except AttributeError:  # JAXTrainer.__init__ runs before Model sets its layers up
        return
    if optimizer is not None and getattr(optimizer, "built", False):
        groups.append((optimizer.variables, "optimizer"))
    trainable = list(model.trainable_variables)
    for variables, role in groups:
        for v, path in zip(variables, layout_paths(variables, trainable)):
            if strategy.process_count > 1:
                keep_layout(v, local)
            else:
                keep_layout(v, strategy.state_sharding(tuple(v.shape), role, path))


def trainer_of(model: Any) -> Trainer:
    """The :class:`mirrorax.Trainer` behind a strategy model's ``fit`` (made on first use; a new one after
    ``compile`` is called again, as Keras rebuilds its train function then).

    Its ``on_nonfinite`` is ``"ignore"``: Keras's own ``fit`` trains on through a non-finite loss and
    shows it in the batch logs, where ``keras.callbacks.TerminateOnNaN`` stops training (the seed
    program's own guard). The Trainer's ``"raise"`` default would turn that program's stop into an
    exception; ``mx.Trainer(model, on_nonfinite="raise")`` remains the explicit way to get one."""
    _keras_env.check_distribution("fit, evaluate or predict")
    strategy = strategy_of(model)
    per_execution = steps_per_execution(model)
    key = (id(strategy), id(getattr(model, "optimizer", None)), id(internals.compile_loss(model)),
           id(internals.compile_metrics(model)), per_execution)
    cached = model.__dict__.get("_mirrorax_trainer")
    if cached is not None and cached[0] == key:
        return cached[1]
    from mirrorax.keras.adapter import KerasAdapter
    from mirrorax.trainer import Trainer

    # Keras's predict needs no compile: an uncompiled model gets an adapter for predict alone.
    adapter = KerasAdapter(model, predict_only=True)
    # Keras's reading of the data: steps_per_epoch an upper bound, Keras's own shuffle order.
    trainer = Trainer(adapter, strategy, steps_per_execution=per_execution,
                      on_nonfinite="ignore", reading=keras_order.KERAS_FIT)
    trainer.model = model  # callbacks, stop_training and the progress bar act on the Keras model
    object.__setattr__(model, "_mirrorax_trainer", (key, trainer))
    return trainer


def _eager_fallback(model: Any, name: str) -> Callable[..., Any] | None:
    """Keras's own method when the model runs eagerly (a debugging mode mirrorax does not distribute)."""
    if not getattr(model, "run_eagerly", False):
        return None
    import keras

    warnings.warn(f"{type(model).__name__}.{name}: run_eagerly=True runs Keras's own single-device loop "
                  "(a debugging mode); compile with run_eagerly=False to train on every device.", stacklevel=3)
    return types.MethodType(_keras_own(getattr(keras.Model, name)), model)  # not an override: it called us


# -- the routed methods (bound to the model) ------------------------------------------------------------

def _fit(self: Any, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
         verbose: Any = "auto", callbacks: Any = None, validation_split: float = 0.0, validation_data: Any = None,
         shuffle: bool | Literal["batch"] = True, class_weight: Any = None, sample_weight: Any = None,
         initial_epoch: int = 0, steps_per_epoch: int | None = None, validation_steps: int | None = None,
         validation_batch_size: int | None = None, validation_freq: int = 1) -> Any:
    """Keras's ``Model.fit``, on every device of the model's strategy (see ``mirrorax.keras.fit``)."""
    self._assert_compile_called("fit")
    fallback = _eager_fallback(self, "fit")
    if fallback is not None:
        return fallback(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
                        validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
                        class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
                        steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                        validation_batch_size=validation_batch_size, validation_freq=validation_freq)
    import keras

    from mirrorax.fit.fit_plan import FitArgs, pass_source
    from mirrorax.inputs.arrays import ArraySource
    from mirrorax.inputs.make import is_array_tree
    from mirrorax.keras import callbacks as keras_callbacks

    trainer = trainer_of(self)
    arrays = is_array_tree(x)
    max_epochs = keras.config.max_epochs()
    if max_epochs and max_epochs < epochs:
        warnings.warn(f"Limiting epochs to {max_epochs}", stacklevel=2)  # Keras's debugging cap, its words
        epochs = max_epochs
    steps_per_epoch = _capped_steps(steps_per_epoch)
    validation_steps = _capped_steps(validation_steps)
    if validation_split and validation_data is None:
        if not arrays:
            raise ValueError(f"validation_split={validation_split} needs x as arrays (it holds out the last share of "
                             f"the rows, as Keras does); received x of type {type(x).__name__}. Pass "
                             "validation_data=... instead.")
        (x, y, sample_weight), validation_data = internals.train_validation_split(
            (x, y, sample_weight), validation_split)
    # x classified once (arrays or batches) and made the fit's source here, once, as Keras reads it; what
    # Keras's fit reads besides (the row count, the batches of a pass) is the source's, and the trainer's
    # preparation takes the source as it is.
    rows: int | None = None
    if arrays:
        if class_weight is not None:
            from mirrorax.inputs.make import class_weights

            sample_weight = class_weights(y, class_weight, sample_weight)
        source = pass_source(trainer.adapter, "fit", x, y, sample_weight, refuse_nonfinite=trainer.refuses_nonfinite,
                             arrays=True)
        rows = source.num_examples if isinstance(source, ArraySource) else None
        if batch_size is None and steps_per_epoch and rows is not None:
            batch_size = -(-rows // steps_per_epoch)  # Keras's ArrayDataAdapter: the steps cover the rows once
        keras_data.keras_build_read(self, x, shuffle, batch_size or 32, rows)
    else:
        x = keras_data.as_batches(x, shuffle, keras_data.keras_build_read(self, x, shuffle, batch_size or 32, None))
        if class_weight is not None:  # batches (a PyDataset, a generator): each weighted as Keras's adapters do
            from collections.abc import Iterator

            weighted = keras_data.ClassWeighted(x, class_weight)
            x = iter(weighted) if isinstance(x, Iterator) else weighted  # a generator stays one-shot
        source = pass_source(trainer.adapter, "fit", x, y, sample_weight, refuse_nonfinite=trainer.refuses_nonfinite,
                             arrays=False)
    if (validation_data is not None and not isinstance(validation_data, tuple)
            and is_array_tree(validation_data)):
        raise ValueError("validation_data must be a tuple (x_val, y_val) or (x_val, y_val, sample_weight), or an "
                         f"iterable of such batches; received {type(validation_data).__name__}.")
    keras_callbacks.check_available(callbacks)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        steps = steps_per_epoch or keras_data.num_batches(x, batch_size or 32, rows)
        callbacks = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                                 verbose=verbose, epochs=epochs, steps=steps, model=self)
    if steps_per_epoch and trainer.steps_per_execution != "auto":
        # Keras runs whole executions: an epoch's steps_per_epoch rounds up to a multiple of them ("auto" runs
        # the epoch's steps as given, whatever it fuses).
        per_execution = int(trainer.steps_per_execution)
        steps_per_epoch = -(-steps_per_epoch // per_execution) * per_execution
    # verbose=0: Keras's own progress bar (a callback) speaks, and fit prints no plan line, as Keras's fit
    # prints none. What a user must know (the step will not fit a device's memory) still raises;
    # mx.plan(model, x, y) prints the plan on request.
    trainer.fit_with(FitArgs(source, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=callbacks,
                             validation_data=validation_data, shuffle=shuffle, initial_epoch=initial_epoch,
                             steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                             validation_batch_size=validation_batch_size, validation_freq=validation_freq))
    return self.history


def _evaluate(self: Any, x: Any = None, y: Any = None, batch_size: int | None = None, verbose: Any = "auto",
              sample_weight: Any = None, steps: int | None = None, callbacks: Any = None, return_dict: bool = False,
              **kwargs: Any) -> Any:
    """Keras's ``Model.evaluate``, on every device of the model's strategy."""
    self._assert_compile_called("evaluate")
    fallback = _eager_fallback(self, "evaluate")
    if fallback is not None:
        return fallback(x, y, batch_size=batch_size, verbose=verbose, sample_weight=sample_weight, steps=steps,
                        callbacks=callbacks, return_dict=return_dict, **kwargs)
    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}. evaluate takes x, y, batch_size, verbose, "
                         "sample_weight, steps, callbacks and return_dict (as Keras's Model.evaluate).")
    trainer = trainer_of(self)
    source, batch_size, steps, callbacks = _one_pass(self, trainer, x, y, sample_weight, batch_size, verbose, steps,
                                                     callbacks, predict=False)
    logs = trainer.evaluate(source, batch_size=batch_size, steps=steps, callbacks=callbacks)
    return logs if return_dict else self._flatten_metrics_in_order(logs)


def _predict(self: Any, x: Any, batch_size: int | None = None, verbose: Any = "auto", steps: int | None = None,
             callbacks: Any = None) -> Any:
    """Keras's ``Model.predict``, on every device of the model's strategy."""
    fallback = _eager_fallback(self, "predict")
    if fallback is not None:
        return fallback(x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks)
    trainer = trainer_of(self)
    source, batch_size, steps, callbacks = _one_pass(self, trainer, x, None, None, batch_size, verbose, steps,
                                                     callbacks, predict=True)
    return trainer.predict(source, batch_size=batch_size, steps=steps, callbacks=callbacks)


def _one_pass(model: Any, trainer: Trainer, x: Any, y: Any, sample_weight: Any, batch_size: int | None, verbose: Any,
              steps: int | None, callbacks: Any, predict: bool) -> tuple[Any, int | None, int | None, Any]:
    """``evaluate``'s and ``predict``'s arguments as Keras reads them for one pass: ``x`` classified once and made
    the pass's source once (a dataset or generator read as Keras's adapters read it), the batch size (32 for
    arrays), the steps, and the callbacks as Keras's ``CallbackList`` with its progress bar (its steps: the
    source's batches)."""
    import keras

    from mirrorax.fit.fit_plan import pass_source
    from mirrorax.inputs.arrays import ArraySource
    from mirrorax.inputs.make import is_array_tree
    from mirrorax.keras import callbacks as keras_callbacks

    arrays = is_array_tree(x)
    if not arrays:
        build = keras_data.build_read(x) if keras_order.keras_builds(model, predict=predict) else None
        x = keras_data.as_batches(x, build=build)
    source = pass_source(trainer.adapter, "predict" if predict else "evaluate", x, y, sample_weight,
                         refuse_nonfinite=trainer.refuses_nonfinite, arrays=arrays)
    batch_size = batch_size or (32 if arrays else None)
    steps = _capped_steps(steps)
    keras_callbacks.check_available(callbacks)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        rows = source.num_examples if isinstance(source, ArraySource) else None
        callbacks = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                                                 steps=steps or keras_data.num_batches(x, batch_size or 32, rows),
                                                 model=model)
    return source, batch_size, steps, callbacks


def _train_on_batch(self: Any, x: Any, y: Any = None, sample_weight: Any = None, class_weight: Any = None,
                    return_dict: bool = False) -> Any:
    """Keras's ``Model.train_on_batch``: one step on every device of the model's strategy."""
    self._assert_compile_called("train_on_batch")
    fallback = _eager_fallback(self, "train_on_batch")
    if fallback is not None:
        return fallback(x, y, sample_weight=sample_weight, class_weight=class_weight, return_dict=return_dict)
    logs = trainer_of(self).train_on_batch(x, y, sample_weight=sample_weight, class_weight=class_weight)
    return logs if return_dict else self._flatten_metrics_in_order(logs)


def _test_on_batch(self: Any, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False) -> Any:
    """Keras's ``Model.test_on_batch``, on every device of the model's strategy."""
    self._assert_compile_called("test_on_batch")
    fallback = _eager_fallback(self, "test_on_batch")
    if fallback is not None:
        return fallback(x, y, sample_weight=sample_weight, return_dict=return_dict)
    logs = trainer_of(self).test_on_batch(x, y, sample_weight=sample_weight)
    return logs if return_dict else self._flatten_metrics_in_order(logs)


def _predict_on_batch(self: Any, x: Any) -> Any:
    """Keras's ``Model.predict_on_batch``, on every device of the model's strategy."""
    fallback = _eager_fallback(self, "predict_on_batch")
    if fallback is not None:
        return fallback(x)
    from mirrorax.fit.fit_plan import prepare_pass

    trainer = trainer_of(self)
    one = prepare_pass(trainer.adapter, self, trainer.strategy.process_count, "predict", x, batch_size="all",
                       refuse_nonfinite=False)
    return trainer.predict(one.source, batch_size=one.batch_size)


def _capped_steps(steps: int | None) -> int | None:
    """``steps`` under ``keras.config.set_max_steps_per_epoch`` (Keras's debugging cap on fit, evaluate
    and predict), with Keras's warning."""
    import keras

    cap = keras.config.max_steps_per_epoch()
    if cap and (not steps or cap < steps):
        warnings.warn(f"Limiting steps_per_epoch to {cap}", stacklevel=3)
        return cap
    return steps


_METHODS: dict[str, Callable[..., Any]] = {
    "fit": _fit, "evaluate": _evaluate, "predict": _predict, "train_on_batch": _train_on_batch,
    "test_on_batch": _test_on_batch, "predict_on_batch": _predict_on_batch,
}
