"""Keras 3 models (JAX backend) as pure functions, with ``compile()`` honoured.

The loss is Keras's own ``compute_loss_and_updates`` (compiled loss, regularisation losses, loss
scaling of a ``LossScaleOptimizer``), called with ``sample_weight * mask * rows / real_rows``: Keras
divides a ``sum_over_batch_size`` loss by the number of rows, so this makes it the mean over the real
examples of the global batch. Metrics get ``sample_weight * mask``, the loss tracker the real example
count, so every metric is exact over all replicas. BatchNormalization layers compute their batch
statistics over the real rows only (their masked-moments path), so padding never moves them.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax.models.base import ModelAdapter, real_count

__all__ = ["KerasAdapter", "check_keras_backend"]

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

    Raises:
      RuntimeError: Keras is not on the JAX backend.
      ValueError: the model is not compiled and no loss is given.
    """

    def __init__(self, model: Any, *, loss: Any = None, optimizer: Any = None, metrics: Any = None,
                 mixed_precision: str | None = None) -> None:
        keras = check_keras_backend()
        self.keras = keras
        if not isinstance(model, keras.Model):
            raise TypeError(f"Expected a keras.Model; received {type(model).__name__}.")
        self.model = model
        self.optax = None
        if optimizer is not None and _is_optax(optimizer):
            self.optax, optimizer = optimizer, None
        compiled = getattr(model, "compiled", False) and getattr(model, "_compile_loss", None) is not None
        if not compiled and loss is None:
            raise ValueError(
                f"The model {model.name!r} is not compiled and no loss was given, so mirrorax does not know "
                "what to minimise. Call model.compile(optimizer='adam', loss='sparse_categorical_crossentropy', "
                "metrics=['accuracy']) first, or pass Trainer(model, loss=...).")
        if not compiled or loss is not None or optimizer is not None or metrics is not None:
            model.compile(
                optimizer=optimizer if optimizer is not None else (model.optimizer if compiled and model.optimizer else "adam"),
                loss=loss if loss is not None else model.loss,
                metrics=metrics if metrics is not None else _compiled_metric_args(model),
            )
        if mixed_precision is not None:
            _set_mixed_precision(model, mixed_precision, keras, optax=self.optax is not None)
        self.batch_dependent = any(isinstance(l, keras.layers.BatchNormalization) for l in _layers(model))
        self._built = False

    # -- building ----------------------------------------------------------------------------------
    def build(self, sample: dict[str, PyTree]) -> None:
        model = self.model
        y = sample.get("y")
        if self._built == "full" or (self._built and y is None):
            return
        if y is None:
            # predict before any fit/evaluate: build the layers only (metrics need targets to build).
            if not all(layer.built for layer in model._flatten_layers()):
                model(jax.tree.map(lambda a: np.asarray(a)[:1], sample["x"]), training=False)
        else:
            model._symbolic_build(data_batch=(sample["x"], y, None))  # weights shape no variable
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        self._names = {
            "params": _named(model.trainable_variables),
            "model_state": _named(model.non_trainable_variables),
            "optimizer": _named(model.optimizer.variables) if self.optax is None else [],
            "metrics": _named(model.metrics_variables),
        }
        model.reset_metrics()
        self._metrics_init = [np.asarray(v.value) for v in model.metrics_variables]
        self._opt_vars_const = [v.value for v in model.optimizer.variables] if model.optimizer else []
        self._built = "full" if y is not None else "layers"

    def _pack(self, group: str, values: Sequence[Any]) -> dict[str, Any]:
        return dict(zip(self._names[group], values))

    def _unpack(self, group: str, tree: dict[str, Any]) -> list[Any]:
        return [tree[n] for n in self._names[group]]

    def initial_state(self) -> dict[str, PyTree]:
        m = self.model
        state = {
            "params": self._pack("params", [v.value for v in m.trainable_variables]),
            "model_state": self._pack("model_state", [v.value for v in m.non_trainable_variables]),
            "metrics": self.initial_metrics(),
        }
        if self.optax is not None:
            state["optimizer"] = self.optax.init(state["params"])
        else:
            state["optimizer"] = self._pack("optimizer", [v.value for v in m.optimizer.variables])
        return state

    def initial_metrics(self) -> PyTree:
        return self._pack("metrics", [a.copy() for a in self._metrics_init])

    # -- the pure functions ----------------------------------------------------------------------
    def _loss_and_updates(self, params, model_state, metrics, opt_vars, batch, training):
        mask = batch["mask"]
        rows = mask.shape[0]
        real = real_count(batch)
        # Keras divides by the number of rows: scale the weights so the loss is the mean over real rows.
        loss_weight = batch["sample_weight"] * mask * (rows / jnp.maximum(real, 1.0))
        y = batch["y"]
        if hasattr(y, "ndim") and y.ndim > 1:
            # Keras does not broadcast (batch,) weights over per-timestep losses: (batch, 1, ...) does.
            loss_weight = loss_weight.reshape((-1,) + (1,) * (y.ndim - 1))
        with _masked_batch_norm(self.model, mask, real >= rows, self.keras):
            return self.model.compute_loss_and_updates(
                self._unpack("params", params), self._unpack("model_state", model_state),
                self._unpack("metrics", metrics), batch["x"], batch["y"], loss_weight,
                training=training, optimizer_variables=opt_vars)

    def grads(self, state, batch, loss_scale=1.0):
        opt_vars = self._opt_vars_const if self.optax is not None else self._unpack("optimizer", state["optimizer"])

        def loss_fn(params):
            scaled, aux = self._loss_and_updates(params, state["model_state"], state["metrics"], opt_vars, batch, True)
            return scaled * loss_scale, aux

        (_, (loss, y_pred, model_state, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        metrics = self._update_metrics(metrics, loss, batch, y_pred)
        return grads, loss, self._pack("model_state", model_state), metrics

    def apply_gradients(self, state, grads):
        if self.optax is not None:
            import optax

            updates, opt_state = self.optax.update(grads, state["optimizer"], state["params"])
            return optax.apply_updates(state["params"], updates), opt_state
        new_params, new_opt = self.model.optimizer.stateless_apply(
            self._unpack("optimizer", state["optimizer"]), self._unpack("params", grads),
            self._unpack("params", state["params"]))
        return self._pack("params", new_params), self._pack("optimizer", new_opt)

    def evaluate(self, state, metrics, batch):
        _, (loss, y_pred, _, new_metrics) = self._loss_and_updates(
            state["params"], state["model_state"], metrics, None, batch, False)
        return self._update_metrics(new_metrics, loss, batch, y_pred)

    def predict(self, state, x):
        kwargs = {"training": False} if self.model._call_has_training_arg else {}
        y_pred, _ = self.model.stateless_call(self._unpack("params", state["params"]),
                                              self._unpack("model_state", state["model_state"]), x, **kwargs)
        return y_pred

    def _update_metrics(self, metrics, loss, batch, y_pred):
        model = self.model
        refs = model.metrics_variables
        values = metrics if isinstance(metrics, list) else self._unpack("metrics", metrics)
        with self.keras.StatelessScope(state_mapping=list(zip(refs, values))) as scope:
            model._loss_tracker.update_state(loss, sample_weight=real_count(batch))
            if model._compile_metrics is not None:
                _update_compile_metrics(model._compile_metrics, batch["y"], y_pred, batch["mask"],
                                        batch["sample_weight"] * batch["mask"])
        out = []
        for ref, v in zip(refs, values):
            new = scope.get_current_value(ref)
            out.append(v if new is None else new)
        return self._pack("metrics", out)

    def metric_results(self, metrics) -> dict[str, float]:
        model = self.model
        values = [np.asarray(v) for v in self._unpack("metrics", metrics)]
        with self.keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, values))):
            logs = model.get_metrics_result()
        return {k: float(np.asarray(v)) for k, v in logs.items() if np.ndim(v) == 0}

    def write_back(self, state) -> None:
        from mirrorax.step import host_value

        m = self.model
        groups = [(m.trainable_variables, "params"), (m.non_trainable_variables, "model_state")]
        if self.optax is None:
            groups.append((m.optimizer.variables, "optimizer"))
        for variables, group in groups:
            for v, a in zip(variables, self._unpack(group, state[group])):
                v.assign(host_value(a))  # one variable at a time: no second copy of the whole state


MIXED_PRECISION = ("bfloat16", "float16")


def _set_mixed_precision(model: Any, kind: str, keras: Any, *, optax: bool) -> None:
    if kind not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION} or None; received {kind!r}.")
    outputs = {id(t._keras_history.operation) for t in getattr(model, "outputs", None) or []
               if hasattr(t, "_keras_history")}
    layers = [l for l in _layers(model) if not hasattr(l, "layers")]
    if not outputs and layers:
        outputs = {id(layers[-1])}
    for layer in layers:
        if id(layer) not in outputs:  # outputs (softmax, logits) stay float32 for a stable loss
            layer.dtype_policy = f"mixed_{kind}"
    if kind == "float16":
        if optax:
            raise ValueError("mixed_precision='float16' needs loss scaling, which mirrorax does through a Keras "
                             "optimizer; received an optax optimizer. Use mixed_precision='bfloat16' (no loss "
                             "scaling needed) or a Keras optimizer.")
        if not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            model.optimizer = keras.optimizers.LossScaleOptimizer(model.optimizer)


def _update_compile_metrics(cm: Any, y: Any, y_pred: Any, mask: Any, weights: Any) -> None:
    """``CompileMetrics.update_state``, with padding masked out of the *unweighted* metrics too.

    Keras feeds ``metrics=`` without sample weights and ``weighted_metrics=`` with them; padding rows
    must count in neither, so the former get the mask and the latter ``sample_weight * mask``.
    """
    if not all(hasattr(cm, a) for a in ("_flat_metrics", "_flat_weighted_metrics", "_flatten_y")):
        cm.update_state(y, y_pred, weights)  # an unknown Keras version: weighted metrics stay exact
        return
    if not cm.built:
        cm.build(y, y_pred)
    ys, ps = cm._flatten_y(y), cm._flatten_y(y_pred)
    for m, y_t, y_p in zip(cm._flat_metrics, ys, ps):
        if m:
            m.update_state(y_t, y_p, sample_weight=mask)
    for m, y_t, y_p in zip(cm._flat_weighted_metrics, ys, ps):
        if m:
            m.update_state(y_t, y_p, sample_weight=weights)


def _compiled_metric_args(model: Any) -> Any:
    cm = getattr(model, "_compile_metrics", None)
    if cm is None:
        return None
    return getattr(cm, "_user_metrics", None)


def _is_optax(opt: Any) -> bool:
    return callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None)) and \
        not type(opt).__module__.startswith("keras")


def _layers(model: Any) -> Iterator[Any]:
    return iter(model._flatten_layers(include_self=False, recursive=True))


@contextlib.contextmanager
def _masked_batch_norm(model: Any, mask: Any, full: Any, keras: Any) -> Iterator[None]:
    """While a step is traced, BatchNormalization layers take batch statistics over real rows only.

    ``full`` (a replicated boolean: no padding in this batch) selects Keras's plain moments at run
    time, so the masked computation costs nothing on the full batches that are nearly all of them.
    """
    patched = []
    for layer in _layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and hasattr(layer, "_moments"):
            original = layer._moments

            def moments(inputs, user_mask, _original=original):
                m = jnp.reshape(mask, (-1,) + (1,) * (inputs.ndim - 2))
                m = jnp.broadcast_to(m, inputs.shape[:-1])
                if user_mask is not None:
                    return _original(inputs, m * user_mask.astype(m.dtype))
                return jax.lax.cond(full, lambda: _original(inputs, None), lambda: _original(inputs, m))

            layer._moments = moments
            patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            del layer._moments
