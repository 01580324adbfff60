"""The one door to Keras's internals: ``keras.src`` and the private members of Keras objects.

mirrorax runs Keras models as Keras's own ``fit`` runs them, which public Keras does not always say
how to do: the trainer classes whose ``fit`` and ``compile`` a scope routes, the compiled loss and
metrics a model holds, a variable's raw value and layout, a ``StatelessScope``'s switch. Every such
reach is a named function here, so a Keras release that moves one is mended in this module alone,
and ``tests/test_house.py`` fails on a reach anywhere else (an import of ``keras.src``, or a private
attribute of anything but ``self`` / ``cls``). Each function does exactly the reach its name says;
``keras.src`` is imported inside the functions, so importing this module imports no Keras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "keras_trainer", "jax_trainer", "is_keras_trainer", "stateless_scope", "in_stateless_scope",
    "set_stateless_scope", "global_distribution", "is_data_parallel", "is_model_parallel",
    "train_validation_split", "is_default", "pythonify_logs", "keras_mask", "loss_function_wrapper",
    "sum_based_metric_updates", "is_keras_builtin", "compile_loss", "compile_metrics", "loss_tracker",
    "flat_losses", "user_loss", "user_metrics", "flat_metrics", "flat_weighted_metrics", "has_flat_metrics",
    "flatten_y", "fn_and_kwargs", "flatten_layers", "symbolic_build", "call_has_training_arg", "inputs_struct",
    "history_operation", "batch_norm_moments", "set_batch_norm_moments", "batch_norm_reduction_axes",
    "variable_value", "set_variable_value", "variable_layout", "set_variable_layout", "variable_shape",
    "direct_assign", "assign_direct", "jax_state", "set_jax_state", "jax_state_synced", "runs_batch_ends_async",
    "initial_epoch",
]


# -- keras.src: classes and functions with no public name ------------------------------------------------
def keras_trainer() -> Any:
    """Keras's ``Trainer`` (``keras.Model``'s base beside ``Layer``): its ``compile``, ``compute_loss``,
    ``compute_metrics``. Raises ``ImportError`` without Keras."""
    from keras.src.trainers.trainer import Trainer

    return Trainer


def jax_trainer() -> Any:
    """Keras's JAX ``Trainer`` (its ``__init__``, ``fit`` and steps on the JAX backend). Raises
    ``ImportError`` without Keras, or with Keras on another backend."""
    from keras.src.backend.jax.trainer import JAXTrainer

    return JAXTrainer


def is_keras_trainer(obj: Any) -> bool:
    """Whether ``obj`` is a Keras trainer (``keras.Model``, or a layer mixed with a ``Trainer``)."""
    return isinstance(obj, keras_trainer())


def stateless_scope() -> Any:
    """The ``keras.StatelessScope`` open on this thread, or ``None``."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def in_stateless_scope() -> bool:
    """Whether a ``keras.StatelessScope`` is open on this thread."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope as inside

    return bool(inside())


def autocast_scope() -> Any:
    """The ``AutocastScope`` open on this thread (a variable read in it reads as its dtype), or ``None``."""
    from keras.src.backend.common.variables import get_autocast_scope

    return get_autocast_scope()


def set_stateless_scope(scope: Any) -> None:
    """Makes ``scope`` the open ``StatelessScope`` without entering or leaving one (the scope's own switch)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("stateless_scope", scope)


def global_distribution() -> Any:
    """The global ``keras.distribution`` (``set_distribution`` or its ``scope()``), or ``None``."""
    from keras.src.distribution import distribution_lib

    return distribution_lib.distribution()


def is_data_parallel(distribution: Any) -> bool:
    from keras.src.distribution import distribution_lib

    return isinstance(distribution, distribution_lib.DataParallel)


def is_model_parallel(distribution: Any) -> bool:
    from keras.src.distribution import distribution_lib

    return isinstance(distribution, distribution_lib.ModelParallel)


def train_validation_split(arrays: Any, validation_split: float) -> Any:
    """Keras's ``validation_split``: ``(train, validation)``, the last share of the rows held out."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def is_default(method: Any) -> bool:
    """Whether ``method`` is Keras's default no-op (a callback hook a callback does not implement)."""
    from keras.src import utils

    return bool(utils.is_default(method))


def pythonify_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """Logs as Keras's ``fit`` hands them to callbacks (scalars as Python floats)."""
    from keras.src.utils import python_utils

    return dict(python_utils.pythonify_logs(logs))


def keras_mask(x: Any) -> Any:
    """The Keras mask an output carries, or ``None``."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(x)


def loss_function_wrapper(fn: Any, name: str) -> Any:
    """A loss function wrapped as Keras's ``compile`` wraps one (ranks of targets and outputs aligned)."""
    from keras.src.losses.losses import LossFunctionWrapper

    return LossFunctionWrapper(fn, name=name)


def sum_based_metric_updates() -> set[Any]:
    """The ``update_state`` functions of Keras's metrics whose variables are sums over rows."""
    from keras.src.metrics import confusion_metrics as cm
    from keras.src.metrics import reduction_metrics as rm

    return {rm.Sum.update_state, rm.Mean.update_state, rm.MeanMetricWrapper.update_state,
            cm._ConfusionMatrixConditionCount.update_state, cm.Precision.update_state, cm.Recall.update_state,
            cm.SensitivitySpecificityBase.update_state, cm.AUC.update_state}


def is_keras_builtin(cls: type) -> bool:
    """Whether ``cls`` is one of Keras's own metrics classes (or its compile-time metric containers)."""
    return cls.__module__.startswith(("keras.src.metrics.", "keras.src.trainers.compile_utils"))


# -- a model's compiled loss and metrics -----------------------------------------------------------------
def compile_loss(model: Any) -> Any:
    """The model's ``CompileLoss`` (what ``compile(loss=...)`` made), or ``None``."""
    return getattr(model, "_compile_loss", None)


def compile_metrics(model: Any) -> Any:
    """The model's ``CompileMetrics`` (what ``compile(metrics=...)`` made), or ``None``."""
    return getattr(model, "_compile_metrics", None)


def loss_tracker(model: Any) -> Any:
    """The ``Mean`` metric behind the model's ``loss`` log."""
    return model._loss_tracker


def flat_losses(compiled_loss: Any) -> Any:
    """A built ``CompileLoss``'s ``(path, loss)`` entries, or ``None``."""
    return getattr(compiled_loss, "_flat_losses", None)


def user_loss(compiled_loss: Any) -> Any:
    """The ``loss=`` given to ``compile``, or ``None``."""
    return getattr(compiled_loss, "_user_loss", None)


def user_metrics(compiled_metrics: Any) -> Any:
    """The ``metrics=`` given to ``compile``, or ``None``."""
    return getattr(compiled_metrics, "_user_metrics", None)


def flat_metrics(container: Any) -> list[Any]:
    """A ``CompileMetrics``'s ``metrics=`` per output (empty for anything else)."""
    return list(getattr(container, "_flat_metrics", []))


def flat_weighted_metrics(container: Any) -> list[Any]:
    """A ``CompileMetrics``'s ``weighted_metrics=`` per output (empty for anything else)."""
    return list(getattr(container, "_flat_weighted_metrics", []))


def has_flat_metrics(compiled_metrics: Any) -> bool:
    """Whether a ``CompileMetrics`` has the flat metric lists read here (Keras 3's layout)."""
    return all(hasattr(compiled_metrics, a) for a in ("_flat_metrics", "_flat_weighted_metrics", "_flatten_y"))


def flatten_y(compiled_metrics: Any, y: Any) -> Any:
    """Targets or outputs flattened as a ``CompileMetrics`` pairs them with its metrics."""
    return compiled_metrics._flatten_y(y)


def fn_and_kwargs(wrapper: Any) -> tuple[Any, dict[str, Any]]:
    """The function a ``MeanMetricWrapper`` / ``LossFunctionWrapper`` calls (or ``None``), and its kwargs."""
    return getattr(wrapper, "_fn", None), getattr(wrapper, "_fn_kwargs", None) or {}


# -- a model's layers and build --------------------------------------------------------------------------
def flatten_layers(model: Any, include_self: bool = True, recursive: bool = True) -> list[Any]:
    """The model's layers (nested ones too, with ``recursive``), as Keras walks them."""
    return list(model._flatten_layers(include_self=include_self, recursive=recursive))


def symbolic_build(model: Any, data_batch: Any) -> None:
    """Builds the model, its compiled loss and metrics on shapes, as Keras's ``fit`` does first."""
    model._symbolic_build(data_batch=data_batch)


def call_has_training_arg(model: Any) -> bool:
    """Whether the model's ``call`` takes ``training``."""
    return bool(model._call_has_training_arg)


def inputs_struct(model: Any) -> Any:
    """The structure of a functional model's inputs, or ``None``."""
    return getattr(model, "_inputs_struct", None)


def history_operation(tensor: Any) -> Any:
    """The operation that made a symbolic tensor, or ``None``."""
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def batch_norm_moments(layer: Any) -> Callable[..., Any] | None:
    """A ``BatchNormalization`` layer's ``_moments(inputs, mask)``, or ``None`` where Keras has none."""
    return getattr(layer, "_moments", None)


def set_batch_norm_moments(layer: Any, moments: Callable[..., Any] | None) -> None:
    """Puts ``moments`` in place of the layer's own; ``None`` gives it its own back."""
    if moments is None:
        del layer._moments
    else:
        layer._moments = moments


def batch_norm_reduction_axes(layer: Any) -> tuple[int, ...]:
    return tuple(layer._reduction_axes)


# -- a variable's raw value and layout -------------------------------------------------------------------
def variable_value(variable: Any) -> Any:
    """The array a Keras variable holds (no scope consulted), or ``None``."""
    return getattr(variable, "_value", None)


def set_variable_value(variable: Any, value: Any) -> None:
    """Makes ``value`` the array the variable holds, as it is (no conversion, no placement)."""
    variable._value = value


def variable_layout(variable: Any) -> Any:
    """Where the variable puts an assigned value (its ``_layout``), or ``None``."""
    return getattr(variable, "_layout", None)


def set_variable_layout(variable: Any, layout: Any) -> None:
    variable._layout = layout


def variable_shape(variable: Any) -> tuple[int, ...]:
    return tuple(variable._shape)


def variable_dtype(variable: Any) -> str:
    """The variable's own dtype name, as ``variable.dtype`` reads outside an ``AutocastScope`` (without its
    look at the scope and its standardizing, ~3 us a read)."""
    return variable._dtype


def direct_assign(variable: Any) -> Callable[[Any], None] | None:
    """The variable's assign without conversion or shape check (placed by its layout), or ``None``."""
    return getattr(variable, "_direct_assign", None)


def has_direct_assign(variable_class: type) -> bool:
    """Whether variables of this class have the assign :func:`direct_assign` returns."""
    return hasattr(variable_class, "_direct_assign")


def assign_direct(variable: Any, value: Any) -> None:
    """Assigns ``value`` without conversion or shape check, placed by the variable's layout."""
    variable._direct_assign(value)


# -- a model's state as Keras's JAX trainer exposes it to callbacks ---------------------------------------
def jax_state(model: Any) -> Any:
    """The values Keras's JAX ``fit`` exposes while it runs (``None`` outside)."""
    return getattr(model, "_jax_state", None)


def jax_state_synced(model: Any) -> bool:
    return bool(getattr(model, "_jax_state_synced", True))


def set_jax_state(model: Any, state: Any, synced: bool) -> None:
    model._jax_state = state
    model._jax_state_synced = synced


def runs_batch_ends_async(callback_list: Any, kind: str) -> bool:
    """Whether a ``CallbackList`` runs its ``kind`` (``"train"`` or ``"test"``) batch-end hooks on its worker
    thread (every callback async-safe: Keras's own ``History`` / ``ProgbarLogger``)."""
    return bool(getattr(callback_list, f"_async_{kind}", False))


def initial_epoch(model: Any) -> int | None:
    """The epoch ``keras.callbacks.BackupAndRestore`` restored the model to, or ``None``."""
    value = getattr(model, "_initial_epoch", None)
    return int(value) if value else None
