"""Plain JAX models: an ``apply`` function, its parameters, a loss and an optax optimizer.

``FunctionalModel`` is for code that is not Keras: flax ``nnx``/``linen`` ``apply`` functions, equinox
or hand-written ``jnp`` code all reduce to ``apply_fn(params, x) -> y_pred`` (or, with mutable
state such as BatchNorm statistics, ``apply_fn(params, model_state, x, training) -> (y_pred,
model_state)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mirrorax.batch_sums as batch_sums
from mirrorax._host import host_value
from mirrorax.models.base import ModelAdapter, SparseTarget, real_count
from mirrorax.models.loss_scale import loss_scale_of

__all__ = ["FunctionalModel"]

PyTree = Any
MetricFn = Callable[[Any, Any], Any]


def _accuracy(y_true: Any, y_pred: Any) -> Any:
    if y_pred.shape[-1] == 1 or y_pred.ndim == y_true.ndim and y_true.shape == y_pred.shape and y_pred.shape[-1] > 1:
        if y_pred.shape[-1] > 1:
            return (jnp.argmax(y_pred, -1) == jnp.argmax(y_true, -1)).astype(jnp.float32)
        return ((y_pred[..., 0] > 0.5) == (y_true.reshape(y_pred.shape[:-1]) > 0.5)).astype(jnp.float32)
    return (jnp.argmax(y_pred, -1) == y_true.astype(jnp.int32)).astype(jnp.float32)


def _sparse_ce_logits(y_true: Any, logits: Any) -> Any:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, y_true.astype(jnp.int32)[..., None], axis=-1)[..., 0]


def _mse(y_true: Any, y_pred: Any) -> Any:
    d = (y_pred - y_true.reshape(y_pred.shape)) ** 2
    return d.reshape(d.shape[0], -1).mean(-1)


_LOSSES: dict[str, Callable[[Any, Any], Any]] = {
    "sparse_categorical_crossentropy_from_logits": _sparse_ce_logits,
    "mse": _mse,
}
_METRICS: dict[str, MetricFn] = {"accuracy": _accuracy}


class FunctionalModel:
    """A model given as pure JAX functions.

    Args:
      apply_fn: ``apply_fn(params, x) -> y_pred``; or, when ``model_state`` is given,
        ``apply_fn(params, model_state, x, training) -> (y_pred, model_state)``.
      params: the initial parameters (any pytree of arrays).
      loss: ``loss(y_true, y_pred) -> per-example losses`` of shape ``(batch,)``, or one of
        ``"sparse_categorical_crossentropy_from_logits"``, ``"mse"``.
      optimizer: an optax ``GradientTransformation``.
      metrics: ``{"name": fn(y_true, y_pred) -> per-example values}`` or names (``"accuracy"``);
        each is reported as its mean over every example.
      model_state: non-trainable state threaded through ``apply_fn`` (e.g. BatchNorm statistics).

    Example:
      >>> def apply(p, x): return x @ p["w"] + p["b"]
      >>> m = FunctionalModel(apply, {"w": np.zeros((4, 3)), "b": np.zeros(3)},
      ...                     loss="sparse_categorical_crossentropy_from_logits",
      ...                     optimizer=optax.sgd(0.1), metrics=["accuracy"])
      >>> trainer = Trainer(m)
    """

    def __init__(self, apply_fn: Callable[..., Any], params: PyTree, *, loss: Any, optimizer: Any,
                 metrics: Any = (), model_state: PyTree = None) -> None:
        if not callable(apply_fn):
            raise TypeError(f"apply_fn must be callable; received {apply_fn!r:.80} (of type "
                            f"{type(apply_fn).__name__}). Pass a function apply_fn(params, x) -> outputs.")
        self.apply_fn = apply_fn
        self.params = jax.tree.map(np.asarray, params)
        self.model_state = None if model_state is None else jax.tree.map(np.asarray, model_state)
        self.loss = loss
        self.optimizer = optimizer
        self.metrics = metrics

    def state_axes(self) -> dict[str, tuple[Any, ...]]:
        """The parameters' own sharding annotations by key (see :meth:`ModelAdapter.state_axes`); none here."""
        return {}

    def adapter(self, *, loss: Any = None, optimizer: Any = None, metrics: Any = None) -> ModelAdapter:
        return _FunctionalAdapter(self, loss if loss is not None else self.loss,
                                  optimizer if optimizer is not None else self.optimizer,
                                  metrics if metrics is not None else self.metrics)


class _FunctionalAdapter(ModelAdapter):
    def __init__(self, model: FunctionalModel, loss: Any, optimizer: Any, metrics: Any) -> None:
        if isinstance(loss, str):
            if loss not in _LOSSES:
                raise ValueError(f"Unknown loss {loss!r}; known: {sorted(_LOSSES)}, or pass a callable "
                                 "loss(y_true, y_pred) -> per-example losses.")
            loss = _LOSSES[loss]
        if not callable(loss):
            raise ValueError(f"FunctionalModel needs a loss: a callable or one of {sorted(_LOSSES)}; "
                             f"received {loss!r}.")
        if optimizer is None or not callable(getattr(optimizer, "update", None)):
            raise ValueError(f"FunctionalModel needs an optax GradientTransformation as optimizer; received "
                             f"{optimizer!r}. Pass e.g. optimizer=optax.adam(1e-3).")
        if isinstance(metrics, Mapping):
            named = dict(metrics)
        else:
            named = {}
            for m in metrics or ():
                if isinstance(m, str):
                    if m not in _METRICS:
                        raise ValueError(f"Unknown metric {m!r}; known: {sorted(_METRICS)}, or pass "
                                         "{'name': fn(y_true, y_pred) -> per-example values}.")
                    named[m] = _METRICS[m]
                else:
                    named[getattr(m, "__name__", f"metric_{len(named)}")] = m
        self.model, self.loss_fn, self.opt, self.metric_fns = model, loss, optimizer, named
        self.stateful = model.model_state is not None
        self.sparse = self.loss_fn is _sparse_ce_logits
        # The parameters' float type (float64 only with x64 on: JAX stores float64 as float32 otherwise):
        # inputs, loss weights and metric sums follow it.
        floats = [np.asarray(a).dtype for a in jax.tree.leaves(model.params)
                  if np.issubdtype(np.asarray(a).dtype, np.floating)]
        self.float_dtype = np.dtype(jax.dtypes.canonicalize_dtype(np.result_type(np.float32, *floats)))
        self._output_shape: tuple[int, ...] | None = None

    def state_axes(self):
        return self.model.state_axes()

    def _apply(self, params, model_state, x, training):
        if self.stateful:
            return self.model.apply_fn(params, model_state, x, training)
        return self.model.apply_fn(params, x), model_state

    def initial_state(self):
        params = jax.tree.map(np.array, self.model.params)
        return {"params": params, "model_state": jax.tree.map(np.array, self.model.model_state) or {},
                "optimizer": jax.tree.map(np.asarray, self.opt.init(params)), "metrics": self.initial_metrics()}

    def initial_metrics(self, previous=None):
        names = ["loss", *self.metric_fns]
        dt = self.float_dtype
        return {n: {"total": np.zeros((), dt), "count": np.zeros((), dt)} for n in names}

    def build(self, sample):
        if sample.get("y") is None or not self.sparse or self._output_shape is not None:
            return
        spec = jax.eval_shape(lambda p, s, x: self._apply(p, s or None, x, False)[0], self.model.params,
                              self.model.model_state or {}, sample["x"])
        self._output_shape = tuple(spec.shape)

    def sparse_targets(self, y, check_shapes=False):
        if y is None or not self.sparse or self._output_shape is None:
            return []
        if check_shapes and tuple(np.shape(y)[1:]) not in (self._output_shape[1:-1], self._output_shape[1:-1] + (1,)):
            raise ValueError(f"y has shape {np.shape(y)} but the model's output has shape {self._output_shape}; "
                             "the loss sparse_categorical_crossentropy_from_logits takes one integer class label "
                             f"per output row (shape (n,) + {self._output_shape[1:-1]}).")
        return [SparseTarget("y", y, int(self._output_shape[-1]), None,
                             "sparse_categorical_crossentropy_from_logits")]

    def _accumulate(self, metrics, weighted, y, y_pred, batch):
        """The metrics' totals after this batch, and the batch's loss sum (``weighted``: each row's weighted
        loss). On several devices the sums are taken per replica in one all-reduce operand
        (:mod:`mirrorax.batch_sums`): they all add up over rows."""
        dt = self.float_dtype
        w = batch["sample_weight"].astype(dt) * batch["mask"].astype(dt)
        real = real_count(batch).astype(dt)
        fns = list(self.metric_fns.items())

        def sums(rows):
            weighted, y, y_pred, w = rows
            out = [jnp.sum(weighted)]
            for _, fn in fns:
                v = fn(y, y_pred).reshape(w.shape[0], -1).mean(-1)
                out += [jnp.sum(v * w).astype(dt), jnp.sum(w)]
            return out

        where = batch_sums.current()
        rows = (weighted, y, y_pred, w)
        totals = sums(rows) if where is None else batch_sums.per_replica_sums(sums, rows, where)
        # Sums keep their type: a metric carried through a scan or donated between steps must not change it.
        out = {"loss": {"total": metrics["loss"]["total"] + totals[0].astype(dt),
                        "count": metrics["loss"]["count"] + real}}
        for i, (name, _) in enumerate(fns):
            out[name] = {"total": metrics[name]["total"] + totals[1 + 2 * i],
                         "count": metrics[name]["count"] + totals[2 + 2 * i]}
        return out, totals[0]

    def _loss(self, params, state, batch, training):
        y_pred, model_state = self._apply(params, state.model_state or None, batch["x"], training)
        per = self.loss_fn(batch["y"], y_pred)
        dt = jnp.result_type(per.dtype, self.float_dtype)  # every factor of the loss in the model's type
        w = batch["sample_weight"].astype(dt) * batch["mask"].astype(dt)
        weighted = jnp.where(batch["mask"] > 0, per.astype(dt) * w, 0.0)
        loss = jnp.sum(weighted) / self._real(batch, dt)
        return loss, (weighted, y_pred, model_state if model_state is not None else {})

    @staticmethod
    def _real(batch, dt):
        return jnp.maximum(real_count(batch).astype(dt), 1.0)

    def grads(self, state, batch, loss_scale=1.0):
        # An optimizer that scales the loss (float16: models.loss_scale) keeps the scale in its state and
        # divides the gradients by it again.
        loss_scale = loss_scale * loss_scale_of(state.optimizer)

        def f(p):
            loss, aux = self._loss(p, state, batch, True)
            return loss * loss_scale, aux

        # The loss is taken again from the summed rows below: the forward's own sum is then unused (JAX
        # drops it), and the loss rides the metrics' all-reduce operand.
        (_, (weighted, y_pred, model_state)), g = jax.value_and_grad(f, has_aux=True)(state.params)
        metrics, loss_sum = self._accumulate(state.metrics, weighted, batch["y"], y_pred, batch)
        return g, loss_sum / self._real(batch, loss_sum.dtype), model_state, metrics

    def apply_gradients(self, state, grads):
        import optax

        updates, opt_state = self.opt.update(grads, state.optimizer, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    def evaluate(self, state, metrics, batch):
        _, (weighted, y_pred, _) = self._loss(state.params, state, batch, False)
        return self._accumulate(metrics, weighted, batch["y"], y_pred, batch)[0]

    def predict(self, state, x):
        return self._apply(state.params, state.model_state or None, x, False)[0]

    def metric_logs(self, metrics):
        return {n: m["total"] / jnp.maximum(m["count"], 1e-12) for n, m in metrics.items()}

    def metric_results(self, metrics):
        return {n: float(np.asarray(m["total"]) / max(float(np.asarray(m["count"])), 1e-12))
                for n, m in metrics.items()}

    def write_back(self, state):
        self.model.params = jax.tree.map(host_value, state.params)
        if self.stateful:
            self.model.model_state = jax.tree.map(host_value, state.model_state)
