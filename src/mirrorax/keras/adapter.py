"""Keras 3 models (JAX backend) as pure functions, with ``compile()`` honoured.

The loss is Keras's own ``compute_loss_and_updates`` (compiled loss, regularisation losses, loss
scaling of a ``LossScaleOptimizer``), called with ``sample_weight * mask * rows / real_rows``: Keras
divides a ``sum_over_batch_size`` loss by the number of rows, so this makes it the mean over the real
examples of the global batch. Metrics get ``sample_weight * mask``, the loss tracker the real example
count, so every metric is exact over all replicas. BatchNormalization layers compute their batch
statistics over the real rows only (``_masked_moments``), so padding never moves them.

After ``fit`` the trained arrays are lent to the model's variables (``write_back``); during ``fit`` the
variables let go of them (``release``) and Keras callbacks read the newest values through
``Callback.model``, which calls ``model.jax_state_sync()`` on what ``expose`` offered: Keras's own JAX
trainer works the same way, so training holds one copy of the state.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax._host import host_value
from mirrorax.keras import _internals as internals
from mirrorax.keras import custom as keras_custom
from mirrorax.keras import metrics as keras_metrics
from mirrorax.keras.targets import check_target_shape, fits, loss_entries, output_spec, resolve, shape_text
from mirrorax.models.base import ModelAdapter, SparseTarget, real_count
from mirrorax.steps.dispatch import ARRAY_TYPE

__all__ = ["KerasAdapter", "check_keras_backend", "keep_layout"]

PyTree = Any


def check_keras_backend() -> Any:
    """Imports Keras and checks that it runs on JAX.

    Raises:
      RuntimeError: Keras runs on another backend; the message says how to switch.
    """
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(
            f"mirrorax trains Keras models on the JAX backend; Keras runs on {keras.backend.backend()!r} here "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set KERAS_BACKEND=jax before importing "
            "keras: `export KERAS_BACKEND=jax`, or os.environ['KERAS_BACKEND'] = 'jax' at the top of the script.")
    return keras


def _named(variables: Sequence[Any]) -> list[str]:
    """Stable, readable keys: ``"003/sequential/dense/kernel"``.

    Keras makes names unique per process (``dense_3``, ``adam_2``), so the same model built in another
    process or after another model gets other paths; the numeric suffixes are dropped and the position
    keeps keys unique, so a checkpoint of one instance restores into another.
    """
    return [f"{i:03d}/" + re.sub(r"_\d+(?=[/_]|$)", "", v.path) for i, v in enumerate(variables)]


class KerasAdapter(ModelAdapter):
    """Adapts a Keras 3 model: compiled optimizer (or an optax ``GradientTransformation``), loss, metrics.

    Args:
      model: a Keras 3 model. If it is not compiled, ``loss`` is required and the model is compiled
        with ``loss``, ``optimizer`` (default ``"adam"``) and ``metrics``.
      loss, optimizer, metrics: override or complete the model's compile settings. ``optimizer`` may be a
        Keras optimizer, its name, or an optax ``GradientTransformation``.
      mixed_precision: ``"bfloat16"`` or ``"float16"``: every layer but the output layers computes in
        that type while variables stay float32 (Keras's ``mixed_*`` dtype policies); ``"float16"`` also
        wraps the optimizer in ``keras.optimizers.LossScaleOptimizer`` (dynamic loss scaling).
      predict_only: an uncompiled model is accepted for ``predict`` alone (as Keras's ``predict`` needs
        no ``compile``); building it for targets then raises the not-compiled error.

    Raises:
      RuntimeError: Keras is not on the JAX backend.
      ValueError: the model is not compiled and no loss is given.
    """

    def __init__(self, model: Any, *, loss: Any = None, optimizer: Any = None, metrics: Any = None,
                 mixed_precision: str | None = None, predict_only: bool = False) -> None:
        keras = check_keras_backend()
        self.keras = keras
        if not (internals.is_keras_trainer(model) and isinstance(model, keras.layers.Layer)):  # keras.Model is both
            raise TypeError(f"Expected a keras.Model; received {model!r:.80} (of type {type(model).__name__}). "
                            "Build it with keras.Sequential, the functional API or a keras.Model subclass.")
        self.model = model
        self.optax = None
        if optimizer is not None and _is_optax(optimizer):
            self.optax, optimizer = optimizer, None
        # Compiled without a loss is fine when the model's losses are its own (add_loss, compute_loss).
        compiled = getattr(model, "compiled", False)
        self.predict_only = predict_only and not compiled and loss is None
        if not compiled and loss is None and not self.predict_only:
            raise ValueError(
                f"The model {model.name!r} is not compiled and no loss was given, so mirrorax does not know "
                "what to minimise. Call model.compile(optimizer='adam', loss='sparse_categorical_crossentropy', "
                "metrics=['accuracy']) first, or pass Trainer(model, loss=...).")
        if (not compiled and not self.predict_only) or loss is not None or optimizer is not None or \
                metrics is not None:
            model.compile(
                optimizer=(optimizer if optimizer is not None
                           else (model.optimizer if compiled and model.optimizer else "adam")),
                loss=loss if loss is not None else model.loss,
                metrics=metrics if metrics is not None else keras_metrics.compiled_metric_args(model),
            )
        if mixed_precision is not None:
            _set_mixed_precision(model, mixed_precision, keras, optax=self.optax is not None)
        self.batch_dependent = any(isinstance(layer, keras.layers.BatchNormalization) for layer in _layers(model))
        # The variables' type (float32 under mixed precision, float64 with floatx float64 and x64 on);
        # JAX stores float64 as float32 without x64, so the canonical type is what the devices hold.
        self.float_dtype = np.dtype(jax.dtypes.canonicalize_dtype(
            np.result_type(np.float32, np.dtype(model.dtype_policy.variable_dtype))))
        self._output_spec: Any = None
        self._built = ""  # "", "layers" (built from x alone) or "full" (with y: losses and metrics too)
        self._lent_values: list[tuple[Any, Any]] = []  # (variable, the array write_back lent it)
        self._lent_state: Any = None  # the state those arrays are the leaves of (None: other arrays, or none)
        self._exposed: list[tuple[Any, Any]] = []
        self._exposed_state: dict[str, Any] | None = None
        self._metric_stash: list[tuple[Any, Any]] = []  # (metric variable, its value before release)
        # Metric results in one dispatch: eagerly, Keras's result() ops cost ~1.4 ms per call on an MLP,
        # paid at the end of every fit, evaluate and epoch. One program per process for every model with
        # the same metrics (a program per model cost each new model's first fit a compile).
        self._results_fn: Any = keras_metrics.ResultsProgram(self._metric_values)
        self._result_names: list[str] = []
        # The model's own train_step / test_step / predict_step, when its class overrides them.
        self.custom = {k: keras_custom.overrides(model, k) for k in ("train_step", "test_step", "predict_step")}
        if self.custom["train_step"] and self.optax is not None:
            raise ValueError(f"{type(model).__name__} overrides train_step, which applies the model's Keras "
                             f"optimizer itself; received an optax optimizer ({type(self.optax).__name__}). "
                             "Compile the model with a Keras optimizer, or drop the train_step override.")
        self._extras: dict[str, Any] = {}  # metrics-state slots of the custom steps' own logs
        self._tracing: str | None = None  # the step kind being traced (its custom logs go to batch logs)

    def needs_targets(self, what: str) -> bool:
        """As Keras's own ``fit`` / ``evaluate``: targets are needed only to feed a compiled loss through
        Keras's own steps. A model compiled without a loss (its losses from ``add_loss``), one with its
        own ``compute_loss``, or its own ``train_step`` (fit) / ``test_step`` (evaluate) takes inputs
        alone."""
        model = self.model
        if self.predict_only:
            return True
        if internals.compile_loss(model) is None:
            return False
        if type(model).compute_loss is not internals.keras_trainer().compute_loss:
            return False
        return not self.custom["train_step" if what == "fit" else "test_step"]

    # -- building ----------------------------------------------------------------------------------
    def build(self, sample: dict[str, PyTree]) -> None:
        model = self.model
        y = sample.get("y")
        # Inputs alone build the whole model (metrics too) where the loss needs no targets.
        full = y is not None or not self.needs_targets("fit")
        if self._built == "full" or (self._built and not full):
            return
        if y is not None and self.predict_only:
            raise ValueError(f"The model {model.name!r} is not compiled, so mirrorax does not know what to "
                             "minimise. Call model.compile(optimizer='adam', loss='mse') first.")
        self.check_inputs(sample["x"])
        if not full:
            # predict before any fit/evaluate: build the layers only (metrics need targets to build).
            if not all(layer.built for layer in internals.flatten_layers(model)):
                model(jax.tree.map(lambda a: np.asarray(a)[:1], sample["x"]), training=False)
        else:
            # Targets against the outputs first: Keras builds its metrics from the first targets it sees
            # ("accuracy" becomes sparse or one-hot accuracy), so wrong ones must not reach it.
            self._output_spec = output_spec(model, sample["x"], self.keras)
            self.sparse_targets(y, check_shapes=True)
            internals.symbolic_build(model, (sample["x"], y, None))  # weights shape no variable
            self.sparse_targets(y, check_shapes=True)  # several outputs: with Keras's list of losses
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        self._names = {
            "params": _named(model.trainable_variables),
            "model_state": _named(model.non_trainable_variables),
            "optimizer": _named(optimizer.variables) if self.optax is None and optimizer is not None else [],
            "metrics": _named(model.metrics_variables),
        }
        model.reset_metrics()
        self._metrics_init = [np.asarray(v.value) for v in model.metrics_variables]
        if full and (self.custom["train_step"] or self.custom["test_step"]):
            self._extras = self._find_extra_logs(sample)
        self._built = "full" if full else "layers"

    def _find_extra_logs(self, sample: dict[str, PyTree]) -> dict[str, Any]:
        """Traces the custom steps abstractly once: which scalar logs they add to the metric results."""
        model = self.model
        known = set(self._metric_results(list(self._metrics_init)))
        params = [v.value for v in model.trainable_variables]
        model_state = [v.value for v in model.non_trainable_variables]
        metrics = list(self._metrics_init)
        batch = {k: v for k, v in sample.items() if k != "num_real"}
        slots: dict[str, Any] = {}
        if self.custom["train_step"]:
            opt_vars = [v.value for v in model.optimizer.variables]
            logs = jax.eval_shape(lambda p, s, o, m, b: keras_custom.call_train_step(model, p, s, o, m, b)[0],
                                  params, model_state, opt_vars, metrics, batch)
            slots.update(keras_custom.extra_slots("train", keras_custom.scalar_log_names(logs, known)))
        if self.custom["test_step"]:
            logs = jax.eval_shape(lambda p, s, m, b: keras_custom.call_test_step(model, p, s, m, b)[0],
                                  params, model_state, metrics, batch)
            slots.update(keras_custom.extra_slots("test", keras_custom.scalar_log_names(logs, known)))
        return slots

    def _pack(self, group: str, values: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self._names[group], values))

    def _unpack(self, group: str, tree: dict[str, Any]) -> list[Any]:
        return [tree[n] for n in self._names[group]]

    def initial_state(self) -> dict[str, PyTree]:
        values = dict(self.model_values(), metrics=self.initial_metrics())
        if self.optax is not None:
            values["optimizer"] = self.optax.init(values["params"])
        return values

    def initial_metrics(self, previous: PyTree | None = None) -> PyTree:
        values = [a.copy() for a in self._metrics_init]
        metrics = keras_metrics.all_metrics(self.model.metrics)
        if previous is not None and any(keras_metrics.resets_itself(m) for m in metrics):
            # A metric with its own reset_state (one that keeps counting across epochs): Keras resets
            # the variables in place, so the reset starts from the values they hold.
            refs = self.model.metrics_variables
            for v, a in zip(refs, self._unpack("metrics", previous)):
                v.assign(np.asarray(host_value(a)))
            self.model.reset_metrics()
            values = [np.asarray(v.value) for v in refs]
        return dict(self._pack("metrics", values), **{k: np.asarray(v) for k, v in self._extras.items()})

    # -- the pure functions ----------------------------------------------------------------------
    def _loss_and_updates(self, params, model_state, metrics, opt_vars, batch, training):
        mask, real, summed = batch["mask"], real_count(batch), self._summed_loss()
        loss_weight = self._loss_weight(batch["sample_weight"], mask, batch["y"], mask.shape[0], real, summed)
        with _masked_batch_norm(self.model, mask, self.keras), _loss_trackers_count(self.model, real), \
                self._watch_losses(mask, real, summed):
            return self.model.compute_loss_and_updates(
                self._unpack("params", params), self._unpack("model_state", model_state),
                self._unpack("metrics", metrics), batch["x"], batch["y"], loss_weight,
                training=training, optimizer_variables=opt_vars)

    def _loss_weight(self, sample_weight, mask, y, rows, real, summed=False):
        # Keras divides by the number of rows: scale the weights so the loss is the mean over real rows
        # (not a loss reduced by "sum": the padding's zero weight leaves the real rows' sum).
        # Every factor in the model's float type: a float64 model's loss stays float64 throughout.
        dt = self.float_dtype
        loss_weight = sample_weight.astype(dt) * mask.astype(dt)
        if not summed:  # (summed: _summed_loss)
            loss_weight = loss_weight * (rows / jnp.maximum(real.astype(dt), 1.0))
        if hasattr(y, "ndim") and y.ndim > 1:
            # Keras does not broadcast (batch,) weights over per-timestep losses: (batch, 1, ...) does.
            loss_weight = loss_weight.reshape((-1,) + (1,) * (y.ndim - 1))
        return loss_weight

    def _summed_loss(self) -> bool:
        """Whether every compiled loss is reduced by ``"sum"`` (a loss given as a string or a function
        is Keras's default, ``"sum_over_batch_size"``)."""
        cl = internals.compile_loss(self.model)
        user = None if cl is None else internals.user_loss(cl)
        losses = jax.tree.leaves(user, is_leaf=lambda v: not isinstance(v, (dict, list, tuple)))
        return bool(losses) and all(getattr(loss, "reduction", None) == "sum" for loss in losses)

    @contextlib.contextmanager
    def _watch_losses(self, row_mask: Any, real: Any, summed: bool) -> Iterator[None]:
        """While Keras computes the loss: whether it is the compiled loss alone (no regularisation or
        ``add_loss`` terms, no ``compute_loss`` of the model's own) of outputs without a Keras mask, recorded
        for :meth:`_rows_loss`. (A masked loss divides by the batch's count of unmasked entries, so it does
        not add up over rows; and the outputs a train step gets back from the gradient's trace have lost
        their masks, so the loss is where they can be seen.) There the loss's weight is given to each output
        as Keras's loss of it takes it (:func:`_per_output`; ``row_mask`` and ``real``: the batch's padding
        mask and its count of real rows; ``summed``: :meth:`_summed_loss`)."""
        model = self.model
        self._compiled_loss_only = False
        if type(model).compute_loss is not internals.keras_trainer().compute_loss or \
                internals.compile_loss(model) is None:
            yield
            return
        keras_compute_loss = model.compute_loss

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            y_pred = kwargs["y_pred"] if "y_pred" in kwargs else args[2] if len(args) > 2 else None
            self._compiled_loss_only = not model.losses and keras_metrics.unmasked(y_pred)
            if "sample_weight" in kwargs:
                kwargs["sample_weight"] = _per_output(kwargs["sample_weight"], y_pred, row_mask, real, summed)
            elif len(args) > 3:
                args = (*args[:3], _per_output(args[3], y_pred, row_mask, real, summed), *args[4:])
            return keras_compute_loss(*args, **kwargs)

        model.compute_loss = compute_loss
        try:
            yield
        finally:
            del model.compute_loss

    def _rows_loss(self, y: Any, y_pred: Any) -> Callable[[Any, Any, Any, Any, Any], Any] | None:
        """The compiled loss of some rows, to be summed over the replicas (``None`` when it does not add
        up so): one output, one loss reduced by ``sum_over_batch_size``, no other loss terms."""
        cl = internals.compile_loss(self.model)
        one = jax.tree_util.treedef_is_leaf
        if not self._compiled_loss_only or not one(jax.tree.structure(y)) or not one(jax.tree.structure(y_pred)):
            return None
        flat = internals.flat_losses(cl)
        if not flat or len(flat) != 1 or getattr(flat[0][1], "reduction", None) != "sum_over_batch_size":
            return None

        def loss(y_t, y_p, sample_weight, mask, real):
            # Over r rows of the global batch's R: sum(l * w * R / real) / R, the global loss's share.
            return cl(y_t, y_p, self._loss_weight(sample_weight, mask, y_t, mask.shape[0], real))
        return loss

    def train_step(self, state, batch):
        """The model's own ``train_step`` (its class overrides it): ``(params, optimizer, model_state,
        metrics, loss)`` after one update on the global batch."""
        self._tracing = "train"
        logs, (params, model_state, opt, metrics) = keras_custom.call_train_step(
            self.model, self._unpack("params", state.params), self._unpack("model_state", state.model_state),
            self._unpack("optimizer", state.optimizer), self._unpack("metrics", state.metrics), batch)
        metrics = dict(self._pack("metrics", metrics), **keras_custom.store_logs("train", logs, state.metrics))
        loss = jnp.asarray(logs.get("loss", 0.0), jnp.float32).reshape(())
        return (self._pack("params", params), self._pack("optimizer", opt), self._pack("model_state", model_state),
                metrics, loss)

    def grads(self, state, batch, loss_scale=1.0):
        self._tracing = None
        if self.optax is not None:
            # Keras's loss code maps its (unused) optimizer's variables; zeros made while tracing are
            # folded away. Holding the variables' values instead kept a whole single-device copy of each
            # (Adam: two per weight) on one device for the life of the trainer.
            opt_vars = [jnp.zeros(v.shape, v.dtype) for v in self.model.optimizer.variables]
        else:
            opt_vars = self._unpack("optimizer", state.optimizer)

        def loss_fn(params):
            scaled, aux = self._loss_and_updates(params, state.model_state, state.metrics, opt_vars, batch, True)
            return scaled * loss_scale, aux

        (_, (loss, y_pred, model_state, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        # (A loss summed per replica below replaces Keras's: the global one is then unused, and JAX
        # drops its reduction.)
        metrics, loss = self._update_metrics(metrics, loss, batch, y_pred)
        return grads, loss, self._pack("model_state", model_state), metrics

    def apply_gradients(self, state, grads):
        if self.optax is not None:
            import optax

            updates, opt_state = self.optax.update(grads, state.optimizer, state.params)
            return optax.apply_updates(state.params, updates), opt_state
        new_params, new_opt = self.model.optimizer.stateless_apply(
            self._unpack("optimizer", state.optimizer), self._unpack("params", grads),
            self._unpack("params", state.params))
        return self._pack("params", new_params), self._pack("optimizer", new_opt)

    def evaluate(self, state, metrics, batch):
        self._tracing = "test"
        if self.custom["test_step"]:
            logs, (_, _, new) = keras_custom.call_test_step(
                self.model, self._unpack("params", state.params), self._unpack("model_state", state.model_state),
                self._unpack("metrics", metrics), batch)
            return dict(self._pack("metrics", new), **keras_custom.store_logs("test", logs, metrics))
        _, (loss, y_pred, _, new_metrics) = self._loss_and_updates(
            state.params, state.model_state, metrics, None, batch, False)
        return self._update_metrics(new_metrics, loss, batch, y_pred)[0]

    def predict(self, state, x):
        return self.predict_with_state(state, x)[0]

    def predict_with_state(self, state, x):
        if self.custom["predict_step"]:
            return keras_custom.call_predict_step(self.model, self._unpack("params", state.params),
                                                  self._unpack("model_state", state.model_state), x), \
                state.model_state
        kwargs = {"training": False} if internals.call_has_training_arg(self.model) else {}
        y_pred, model_state = self.model.stateless_call(self._unpack("params", state.params),
                                                        self._unpack("model_state", state.model_state), x,
                                                        **kwargs)
        return y_pred, self._pack("model_state", model_state)

    def check_inputs(self, x):
        try:
            inputs = self.model.inputs
            struct = internals.inputs_struct(self.model)
        except (AttributeError, ValueError):  # a subclassed model, or a Sequential without keras.Input
            return
        if not inputs:
            return
        if isinstance(x, dict):
            names = sorted(struct) if isinstance(struct, dict) else [getattr(t, "name", "?") for t in inputs]
            # Keras takes its inputs by name from a dict holding more keys (unless its inputs are a dict).
            if len(inputs) == 1 and not isinstance(struct, dict):
                if not set(names) <= set(x):
                    raise ValueError(f"x is a dict with keys {sorted(x)}, but the model has one input (named "
                                     f"{names[0]!r}). Pass the array itself: fit(x[{next(iter(x))!r}], ...).")
            elif not set(names) <= set(x) or (isinstance(struct, dict) and set(x) != set(names)):
                raise ValueError(f"x is a dict with keys {sorted(x)}, but the model's inputs are {names}. Pass a "
                                 "dict with exactly those keys.")
            return
        if len(inputs) != 1 or not hasattr(x, "shape") or not hasattr(inputs[0], "shape"):
            return  # several inputs: Keras names the mismatch itself
        want, got = tuple(inputs[0].shape[1:]), tuple(x.shape[1:])
        if not fits(_as_functional_adjusts(got, want), want):
            dims = ["any" if d is None else str(d) for d in want]
            example = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
            raise ValueError(f"x has shape {shape_text(x.shape)} but the model takes inputs of shape "
                             f"{shape_text((None,) + want)}: every example must have shape {example}. Reshape x, "
                             f"or build the model with keras.Input({got}).")

    def sparse_targets(self, y, check_shapes=False):
        if y is None or self._output_spec is None:
            return []
        out = []
        nested = isinstance(y, (dict, list, tuple))
        for entry in loss_entries(self.model, self._output_spec, self.keras):
            try:
                y_p = resolve(entry.path, self._output_spec)
                y_t = resolve(entry.path, y) if nested else y
            except (KeyError, IndexError, TypeError):
                continue  # a structure Keras reconciles itself (a list of targets for dict outputs)
            if y_t is None or not hasattr(y_t, "shape") or not hasattr(y_p, "shape"):
                continue
            name = "y" + "".join(f"[{p!r}]" for p in entry.path) if nested else "y"
            fn = getattr(entry.loss, "fn", entry.loss)
            kwargs = internals.fn_and_kwargs(entry.loss)[1]
            if check_shapes:
                check_target_shape(name, y_t, y_p, entry, fn, self.keras)
            if fn is self.keras.losses.sparse_categorical_crossentropy and kwargs.get("axis", -1) == -1 \
                    and y_p.shape[-1] is not None:
                out.append(SparseTarget(name, y_t, int(y_p.shape[-1]), kwargs.get("ignore_class"), fn.__name__))
        return out

    def _update_metrics(self, metrics, loss, batch, y_pred):
        """The metrics after this batch, and the batch's loss (:func:`keras_metrics.update`)."""
        values = metrics if isinstance(metrics, list) else self._unpack("metrics", metrics)
        rows_loss = self._rows_loss(batch["y"], y_pred)
        out, loss = keras_metrics.update(self.model, values, loss, batch, y_pred, rows_loss)
        extras = {k: v for k, v in metrics.items() if k.startswith(keras_custom.EXTRA_PREFIX)} \
            if isinstance(metrics, dict) else {}
        return dict(self._pack("metrics", out), **extras), loss

    def keep_metrics(self, metrics) -> None:
        # As Keras's fit/evaluate leave them: model.get_metrics_result() and each metric's result() after
        # fit give the last epoch's (or evaluation's) values, not the zeros they were compiled with.
        variables = self.model.metrics_variables
        values = [np.asarray(a) for a in self._unpack("metrics", metrics)]
        for v, a in zip(variables, values):
            if tuple(v.shape) != a.shape:
                raise ValueError(f"The metric variable {v.path} has shape {tuple(v.shape)}; the trainer's total "
                                 f"has shape {a.shape}. This is a bug in mirrorax: please report it.")
        # One transfer for all of them (Variable.assign converts and places each value on its own).
        for v, a in zip(variables, jax.device_put([a.astype(v.dtype) for a in values])):
            internals.set_variable_value(v, a)
        self._metric_stash = []

    def metric_results(self, metrics) -> dict[str, float]:
        return dict(self._keras_metric_results(metrics), **keras_custom.extra_logs(metrics, host=True))

    def _keras_metric_results(self, metrics) -> dict[str, float]:
        values = [np.asarray(v) for v in self._unpack("metrics", metrics)]
        if self._results_fn is not None:
            try:
                results = jax.device_get(self._results_fn(values))
            except TypeError:  # JAX tracer errors too: a metric's result() branches on values: compute eagerly
                self._results_fn = None
            else:
                return {k: float(v) for k, v in zip(self._result_names, results)}
        return {k: float(np.asarray(v)) for k, v in self._metric_results(values).items()}

    def metric_logs(self, metrics) -> dict[str, Any]:
        # Called in the step's own program, right after the step was traced (``_tracing`` names it).
        extras = keras_custom.extra_logs(metrics, self._tracing) if self._tracing else {}
        try:
            return dict(self._metric_results(self._unpack("metrics", metrics)), **extras)
        except (TypeError, jax.errors.ConcretizationTypeError):  # a result() that branches on values
            return extras

    def _metric_values(self, values: list[Any]) -> list[Any]:
        logs = self._metric_results(values)
        self._result_names = list(logs)  # set while tracing: a jitted function returns no strings
        return list(logs.values())

    def _metric_results(self, values: list[Any]) -> dict[str, Any]:
        model = self.model
        with self.keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, values))):
            logs = model.get_metrics_result()
        return {k: v for k, v in logs.items() if np.ndim(v) == 0}

    def write_back(self, state) -> None:
        # Lends each variable the trained, replicated array itself (TF's MirroredVariable: one value on
        # every device of the strategy): no device-to-host round trip and no second buffer (Keras's own
        # JAX trainer hands its state back the same way). The variables let go of them (release) before
        # the trainer donates them to the next step.
        # A variable that already holds the very array (lent at fit start, again at the epoch's end and in
        # fit's finally) is left alone: Keras's assign costs ~20 us a variable, which a 219M-parameter LM's
        # 600 variables paid three times a fit call (a fit of 16 steps of 0.12 s lost 1.5%).
        # The same state lent again (fit lends at its start, at each epoch's end and in its finally: the
        # last two the same state) with every variable still holding what it was lent: nothing to do, and
        # no walk of Keras's layers (~1 ms for 600 variables) and of the arrays. One process only: across
        # processes the walk below may gather split leaves, a program every process must run alike.
        if state is self._lent_state and self._lent_values and jax.process_count() == 1 \
                and not self.model_changed():
            return
        pairs = []
        # Outside Keras's scopes (as fit is) a variable may be handed its array directly (see _lend).
        direct = not internals.in_stateless_scope() and internals.autocast_scope() is None
        for v, a in zip(self._written_variables(), _local_replicas(self._written_values(state))):
            if internals.variable_value(v) is not a:
                keep_layout(v, getattr(a, "sharding", None))
                _lend(v, a, direct)
            pairs.append((v, internals.variable_value(v)))
        self._lent_values, self._lent_state = pairs, state

    def state_paths(self) -> dict[str, dict[str, str]]:
        groups = self._group_variables()
        trainable = list(groups["params"])
        out = {}
        for g in ("params", "model_state", "optimizer"):
            if g == "optimizer" and self.optax is not None:
                continue
            out[g] = dict(zip(self._names[g], layout_paths(groups[g], trainable)))
        return out

    def model_changed(self) -> bool:
        return any(internals.variable_value(v) is not a or a.is_deleted() for v, a in self._lent_values)

    def model_values(self) -> dict[str, PyTree]:
        self._lent_values, self._lent_state = [], None
        groups = self._group_variables()
        return {g: self._pack(g, [v.value for v in groups[g]]) for g in self.written_groups}

    def release(self) -> None:
        # As Keras's own JAX trainer does during fit: the variables hold nothing while the trainer's
        # donated state moves on, so training keeps one copy of the state, not two. Callbacks still
        # read the newest values through Callback.model, which calls model.jax_state_sync() (see
        # expose); a variable read any other way mid-fit raises instead of returning stale numbers.
        for v in self._written_variables():
            internals.set_variable_value(v, None)
        # The metrics' totals live in the trainer's state meanwhile (keep_metrics hands them back); their
        # values from before are put back by conceal if the loop ends without new totals.
        if not self._metric_stash:
            self._metric_stash = [(v, internals.variable_value(v)) for v in self.model.metrics_variables]
        for v in self.model.metrics_variables:
            internals.set_variable_value(v, None)
        self._lent_values, self._lent_state = [], None

    def expose(self, state) -> None:
        m = self.model
        # Viewed as the model's variables hold them (this process's devices): Keras's sync assigns them,
        # and an assignment places the value with the variable's layout (see keep_layout).
        leaves = {g: self._unpack(g, getattr(state, g)) for g in self.written_groups}
        local = iter(_local_replicas([a for g in self.written_groups for a in leaves[g]]))
        values = {g: [next(local) for _ in leaves[g]] for g in self.written_groups}
        names = {"params": "trainable_variables", "model_state": "non_trainable_variables",
                 "optimizer": "optimizer_variables"}
        exposed = {names[g]: v for g, v in values.items()}
        # A callback reading the metrics mid-epoch gets the running totals.
        exposed["metrics_variables"] = self._unpack("metrics", state.metrics)
        internals.set_jax_state(m, exposed, synced=False)
        self._exposed_state = internals.jax_state(m)  # Keras wraps it (a TrackedDict): keep what it holds
        self._exposed = list(zip(self._written_variables(), [a for v in values.values() for a in v]))

    def exposure_read(self) -> bool:
        m = self.model
        if internals.jax_state(m) is self._exposed_state and not internals.jax_state_synced(m):
            return False  # untouched (Keras's own fit or evaluate in a callback replaces or clears it)
        self._lent_values = list(self._exposed)  # a callback read them: Keras's sync put them there
        self._lent_state = None
        return True

    def conceal(self) -> None:
        m = self.model
        if self._exposed_state is not None and internals.jax_state(m) is self._exposed_state:
            internals.set_jax_state(m, None, synced=True)
        self._exposed, self._exposed_state = [], None
        for v, before in self._metric_stash:
            if internals.variable_value(v) is None:
                internals.set_variable_value(v, before)
        self._metric_stash = []

    @property
    def written_groups(self) -> tuple[str, ...]:
        # An optax state lives only in the trainer; a Keras optimizer's variables are the model's.
        return ("params", "model_state") if self.optax is not None else ("params", "model_state", "optimizer")

    def _group_variables(self) -> dict[str, list[Any]]:
        """The model's variables of each state group, in the state's order."""
        m = self.model
        return {"params": m.trainable_variables, "model_state": m.non_trainable_variables,
                "optimizer": m.optimizer.variables if getattr(m, "optimizer", None) is not None else []}

    def _written_variables(self) -> list[Any]:
        groups = self._group_variables()
        return [v for g in self.written_groups for v in groups[g]]

    def _written_values(self, state) -> list[Any]:
        return [a for g in self.written_groups for a in self._unpack(g, getattr(state, g))]


def layout_paths(variables: Sequence[Any], trainable: Sequence[Any]) -> list[str]:
    """The path a layout map matches for each of ``variables``: its own, or for an optimizer's slot
    (named ``"<its variable's path with '/' as '_'>_<slot>"`` by ``add_variable_from_reference``) the
    path of that variable among ``trainable``, as Keras lays a slot out like its variable."""
    by_prefix = {v.path.replace("/", "_") + "_": v.path for v in trainable}
    out = []
    for v in variables:
        name = getattr(v, "name", "")
        refs = [p for prefix, p in by_prefix.items() if name.startswith(prefix)]
        out.append(max(refs, key=len) if refs and v.path not in by_prefix.values() else v.path)
    return out


def _lend(variable: Any, value: Any, direct: bool) -> None:
    """``variable.assign(value)``; for an array of the variable's dtype already laid out as the variable is
    (``keep_layout``), what that assign comes to (``_direct_assign``: the value held), without its
    conversion, shape check and placement, which cost a large model's write-back more than its step.
    ``direct``: no ``StatelessScope`` (where assign records instead) nor ``AutocastScope`` (where a
    variable's dtype reads as the scope's) is open; asked once per write-back, not per variable."""
    layout = internals.variable_layout(variable)
    if direct and type(value) is ARRAY_TYPE and (layout is value.sharding or layout == value.sharding) and \
            _dtype_name(value.dtype) == internals.variable_dtype(variable) and \
            value.shape == internals.variable_shape(variable):
        internals.set_variable_value(variable, value)
    else:
        variable.assign(value)


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
    return str(dtype.name)  # (numpy computes a dtype's name anew on every read: ~10 us)



def keep_layout(variable: Any, sharding: jax.sharding.Sharding | None) -> None:
    """Makes ``variable`` place every value assigned to it with ``sharding`` (and its value now).

    Keras's JAX variables put an assigned value where their ``_layout`` says (``_direct_assign``), so
    ``set_weights``, ``load_weights``, ``EarlyStopping(restore_best_weights=True)`` or a callback's
    ``learning_rate.assign`` keep a strategy model's variables on the strategy's devices, as TF's
    ``MirroredVariable`` stays mirrored, instead of leaving them on the default device.
    """
    if sharding is None or internals.variable_layout(variable) == sharding:
        return
    internals.set_variable_layout(variable, sharding)
    value = internals.variable_value(variable)
    if value is not None and not (isinstance(value, jax.Array) and value.is_deleted()):  # (donated: replaced next)
        internals.assign_direct(variable, value)


def _as_functional_adjusts(got: tuple[Any, ...], want: tuple[Any, ...]) -> tuple[Any, ...]:
    """An input's per-example shape as a Keras functional model adjusts it to its ``keras.Input``
    (``Functional._adjust_input_rank``): a trailing axis of 1 dropped, or added where the input ends in 1."""
    if len(got) == len(want) + 1 and got[-1:] == (1,):
        return got[:-1]
    if len(got) == len(want) - 1 and want[-1:] == (1,):
        return got + (1,)
    return got


def _local_replicas(arrays: Sequence[Any]) -> list[Any]:
    """``arrays`` where this process can read each whole: a replicated array spanning other processes'
    devices becomes the same buffers viewed as an array over this process's devices only (no copy).

    A sharded leaf (``shard="optimizer"`` / ``"all"``) on one process stays sharded: the variable reads
    it whole anyway (``numpy()``, Keras ops), and a whole copy per device would undo the sharding's
    memory saving before step 1 and at every epoch's end. Across processes, where no process holds every
    shard, the model gets it whole: every split leaf is gathered by ONE program, which every process runs
    at the same point (the same leaves, in the state's order), after the steps that made them have
    finished, and which is waited for. A ``device_put`` per leaf (a gather program each, hundreds for a
    transformer's state, dispatched behind the fit's last steps) deadlocked XLA:CPU's collectives across
    2 processes: one process blocked in a gather its peer had queued but not run (benchmarks/README.md).
    """
    if jax.process_count() == 1:
        return list(arrays)  # every array is whole in this process (the views below would be the arrays)
    out = list(arrays)
    split = [i for i, a in enumerate(out)
             if isinstance(a, jax.Array) and not a.is_fully_replicated and not a.is_fully_addressable]
    if split:
        inputs = [out[i] for i in split]
        jax.block_until_ready(inputs)  # no gather queued behind the steps still running (see above)
        # The trainer lays out every state leaf with a NamedSharding; only that kind has update().
        targets = tuple(cast(jax.sharding.NamedSharding, a.sharding).update(spec=jax.sharding.PartitionSpec())
                        for a in inputs)
        for i, a in zip(split, jax.block_until_ready(_gather_program(targets)(*inputs))):
            out[i] = a
    return [_local_view(a) for a in out]


@functools.lru_cache(maxsize=16)
def _gather_program(targets: tuple[jax.sharding.NamedSharding, ...]) -> Callable[..., Any]:
    """One compiled program that returns its arguments laid out as ``targets`` (replicated)."""
    return jax.jit(lambda *xs: xs, out_shardings=targets)


def _local_view(a: Any) -> Any:
    """A replicated ``a`` viewed over this process's devices only (no copy); anything else as it is."""
    if not isinstance(a, jax.Array) or a.is_fully_addressable or not a.is_fully_replicated:
        return a
    shards = a.addressable_shards
    mesh = jax.sharding.Mesh(np.array([s.device for s in shards]), ("batch",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_single_device_arrays(a.shape, sharding, [s.data for s in shards])


MIXED_PRECISION = ("bfloat16", "float16")


def _set_mixed_precision(model: Any, kind: str, keras: Any, *, optax: bool) -> None:
    if kind not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION} or None; received {kind!r}.")
    outputs = {id(op) for op in map(internals.history_operation, getattr(model, "outputs", None) or [])
               if op is not None}
    layers = [layer for layer in _layers(model) if not hasattr(layer, "layers")]
    if not outputs and layers:
        outputs = {id(layers[-1])}
    for layer in layers:
        if id(layer) not in outputs:  # outputs (softmax, logits) stay float32 for a stable loss
            layer.dtype_policy = f"mixed_{kind}"
    if kind == "float16":
        if optax:
            raise ValueError(f"mixed_precision={kind!r} needs loss scaling, which mirrorax does through a Keras "
                             "optimizer; received an optax optimizer. Use mixed_precision='bfloat16' (no loss "
                             "scaling needed) or a Keras optimizer.")
        if not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            model.optimizer = keras.optimizers.LossScaleOptimizer(model.optimizer)


def _is_optax(opt: Any) -> bool:
    return callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None)) and \
        not type(opt).__module__.startswith("keras")


def _layers(model: Any) -> Iterator[Any]:
    return iter(internals.flatten_layers(model, include_self=False, recursive=True))


@contextlib.contextmanager
def _loss_trackers_count(model: Any, count: Any) -> Iterator[None]:
    """While a step is traced, Keras's per-output loss trackers weigh the batch by its real rows.

    Keras's ``CompileLoss`` weighs each output's loss by the batch's rows (``y_pred.shape[0]``): a batch
    cut to its real rows has exactly those, but a padded one (per-process pipelines) would weigh its
    padding too, and the parts of the logged loss would no longer add up to it.
    """
    trackers = [m for m in (getattr(internals.compile_loss(model), "metrics", None) or []) if m is not None]
    for metric in trackers:
        def update_state(values: Any, sample_weight: Any = None, _original: Any = metric.update_state) -> Any:
            return _original(values, sample_weight=count)

        metric.update_state = update_state
    try:
        yield
    finally:
        for metric in trackers:
            del metric.update_state


@contextlib.contextmanager
def _masked_batch_norm(model: Any, mask: Any, keras: Any) -> Iterator[None]:
    """While a step is traced, BatchNormalization layers take batch statistics over real rows only.

    On a full batch the masked moments are Keras's plain ones, operation for operation (a select that
    keeps every row, the same sums, the same divisor), and they cost one fused select: no branch and
    no second pass over the activations for the count.
    """
    patched = []
    for layer in _layers(model):
        original = internals.batch_norm_moments(layer) if isinstance(layer, keras.layers.BatchNormalization) else None
        if original is not None:
            axes = internals.batch_norm_reduction_axes(layer)

            def moments(inputs, user_mask, _original=original, _axes=axes):
                if user_mask is not None:
                    m = jnp.broadcast_to(jnp.reshape(mask, (-1,) + (1,) * (inputs.ndim - 2)), inputs.shape[:-1])
                    return _original(inputs, m * user_mask.astype(m.dtype))
                return _masked_moments(inputs, mask, _axes)

            internals.set_batch_norm_moments(layer, moments)
            patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            internals.set_batch_norm_moments(layer, None)


def _masked_moments(x: Any, mask: Any, axes: tuple[int, ...]) -> tuple[Any, Any]:
    """``keras.ops.moments(x, axes)`` over the rows where ``mask`` (one 0/1 per row) is 1.

    Written as ``jnp.mean`` / ``jnp.var`` compute them (sum, then divide by the count; the variance
    from the centred squares), so a full batch gives Keras's numbers exactly.
    """
    dtype = x.dtype
    if dtype in (jnp.float16, jnp.bfloat16):  # as keras.ops.moments: statistics in float32
        x = x.astype(jnp.float32)
    keep = jnp.reshape(mask > 0, (-1,) + (1,) * (x.ndim - 1))
    per_row = math.prod(x.shape[a] for a in axes if a % x.ndim != 0)
    count = jnp.sum(mask).astype(x.dtype) * per_row
    mean = jnp.sum(jnp.where(keep, x, 0), axes, keepdims=True) / count
    var = jnp.sum(jnp.where(keep, jnp.square(x - mean), 0), axes, keepdims=True) / count
    mean, var = jnp.squeeze(mean, axes), jnp.squeeze(var, axes)
    if dtype in (jnp.float16, jnp.bfloat16):
        limit = jnp.finfo(jnp.float16)
        mean, var = (jnp.clip(v, limit.min, limit.max).astype(dtype) for v in (mean, var))
    return mean, var


def _per_output(weight: Any, y_pred: Any, row_mask: Any, real: Any, summed: bool = False) -> Any:
    """The loss's per-row ``weight`` (the user's weights times the padding mask, scaled by rows / real
    rows unless the losses are ``summed``: :meth:`KerasAdapter._loss_weight`) as Keras's loss of each
    output takes it.

    Keras multiplies the weight by an output's per-example losses and its Keras mask without broadcasting
    a ``(batch,)`` weight over their other axes: with several outputs it is shaped ``(batch, 1, ...)`` to
    each one's mask's rank, or its losses' (the output's rank less its last axis). And Keras divides a
    masked output's loss by the count of its unmasked entries, the padding rows' among them: a padded batch
    (a per-process pipeline's) has its weight rescaled so that the loss is the real rows' masked mean.
    One unmasked output (its weight already shaped by its target) and weights that are not one array
    pass unchanged.
    """
    leaves = jax.tree.leaves(y_pred)
    if not hasattr(weight, "shape") or (len(leaves) < 2 and all(internals.keras_mask(p) is None for p in leaves)):
        return weight
    rows = weight.reshape(-1)

    def shaped(p: Any) -> Any:
        mask = internals.keras_mask(p)
        if mask is None:  # shaped to the losses' rank: the output's less its last axis
            return rows.reshape((-1,) + (1,) * (max(getattr(p, "ndim", 2) - 1, 1) - 1))
        w = keras_metrics.against_mask(rows, p)
        if summed:  # (a summed loss keeps the real rows' unmasked entries' sum)
            return w
        m = mask.astype(w.dtype)
        valid_real = jnp.sum(m * row_mask.astype(w.dtype).reshape(w.shape))
        # (rows / real, the factor in weight, is replaced by all entries unmasked / the real rows' ones)
        return w * (jnp.sum(m) / jnp.maximum(valid_real, 1.0)) * (jnp.asarray(real, w.dtype) / row_mask.shape[0])

    return jax.tree.map(shaped, y_pred)
