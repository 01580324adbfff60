"""A Keras model's own ``train_step`` / ``test_step`` / ``predict_step``, run inside mirrorax's steps.

When a model's class overrides one of them (the JAX backend's stateless signature:
``train_step(self, state, data) -> (logs, state)`` with ``state = (trainable_variables,
non_trainable_variables, optimizer_variables, metrics_variables)``), the jitted step calls it on the
global batch, as Keras's own loop would on one device. The override gets ``data`` packed as Keras's
data adapters pack it (``keras.utils.pack_x_y_sample_weight``): ``x`` (``(x,)`` for a tuple or list of
inputs) without targets, ``(x, y)`` without sample weights, ``(x, y, sample_weight)`` with them (or with
``class_weight``), so ``x, y = data`` works where it works in Keras. Given weights arrive as
``user weight * mask * rows / real_rows``, the weights the adapter gives Keras's loss: a
``compute_loss(..., sample_weight)`` in it is the mean over the real rows. While it is traced, the
model's ``compute_metrics`` and loss tracker count real rows only (unless the class overrides
``compute_metrics`` too), so its metrics stay exact. (Without weights the override sees every row of the
batch it is given: the rows of a short last batch must be real ones, not padding, for Keras's numbers.)

Logs the override adds (``logs["my_metric"] = ...``, scalars) ride in the metrics state as two slots
per name, ``~<kind>/<name>`` (the last value) and ``~<kind>/<name>#set``, and come back with the
metric results of the step kind that wrote them, as Keras returns a custom step's last logs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from mirrorax.inputs.batch import UNWEIGHTED
from mirrorax.keras import _internals as internals
from mirrorax.models.base import real_count

__all__ = ["overrides", "extra_slots", "call_train_step", "call_test_step", "call_predict_step",
           "data_of", "pack_inputs", "extra_logs", "store_logs", "EXTRA_PREFIX"]

EXTRA_PREFIX = "~"
_SET = "#set"


def overrides(model: Any, name: str) -> bool:
    """Whether ``model``'s class overrides Keras's JAX ``train_step`` / ``test_step`` / ``predict_step``."""
    return getattr(type(model), name, None) is not getattr(internals.jax_trainer(), name)


def extra_slots(kind: str, names: list[str]) -> dict[str, Any]:
    """The metrics-state slots holding the custom logs ``names`` of a step kind, at their reset values."""
    slots: dict[str, Any] = {}
    for n in names:
        slots[f"{EXTRA_PREFIX}{kind}/{n}"] = jnp.zeros((), jnp.float32)
        slots[f"{EXTRA_PREFIX}{kind}/{n}{_SET}"] = jnp.zeros((), jnp.float32)
    return slots


def store_logs(kind: str, logs: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``old``'s extra slots, with those of ``kind`` that ``logs`` holds set to the new values."""
    out = {k: v for k, v in old.items() if k.startswith(EXTRA_PREFIX)}
    for name, value in logs.items():
        key = f"{EXTRA_PREFIX}{kind}/{name}"
        if key in out:
            out[key] = jnp.asarray(value, jnp.float32).reshape(())
            out[key + _SET] = jnp.ones((), jnp.float32)
    return out


def extra_logs(metrics: dict[str, Any], kind: str | None = None, *, host: bool = False) -> dict[str, Any]:
    """The custom logs held in ``metrics``: set ones on the host (``host``), or those of ``kind`` (traced)."""
    out = {}
    for key, value in metrics.items():
        if not key.startswith(EXTRA_PREFIX) or key.endswith(_SET):
            continue
        k, name = key[len(EXTRA_PREFIX):].split("/", 1)
        if host:
            if float(metrics[key + _SET]):
                out[name] = float(value)
        elif k == kind:
            out[name] = value
    return out


def _weights(batch: dict[str, Any]) -> Any:
    # As the adapter's loss: Keras divides by the rows, so this is the mean over the real rows.
    mask = batch["mask"]
    w = batch["sample_weight"] * mask * (mask.shape[0] / jnp.maximum(real_count(batch), 1.0))
    ndim = getattr(batch.get("y"), "ndim", 0)
    if ndim > 1:
        w = w.reshape((-1,) + (1,) * (ndim - 1))
    return w


@contextlib.contextmanager
def exact_metrics(model: Any, batch: dict[str, Any]) -> Iterator[None]:
    """While an override is traced: its metric updates count real rows, with the user's weights."""
    from mirrorax.keras.metrics import update_compile_metrics

    mask = batch["mask"]
    tracker = internals.loss_tracker(model)
    patched = []
    if type(model).compute_metrics is internals.keras_trainer().compute_metrics and \
            internals.compile_metrics(model) is not None:
        def compute_metrics(x, y, y_pred, sample_weight=None):
            update_compile_metrics(internals.compile_metrics(model), y, y_pred, mask, batch["sample_weight"] * mask)
            return model.get_metrics_result()

        object.__setattr__(model, "compute_metrics", compute_metrics)
        patched.append((model, "compute_metrics"))
    if tracker is not None:
        original = tracker.update_state

        rows = mask.shape[0]

        def update_state(values, sample_weight=None):
            # Keras's own steps weigh the loss by the batch's row count (``x.shape[0]``), which counts any
            # padding: that weight becomes the real count. A weight of the step's own (``None``: each
            # batch counts once, as keras.io's JAX guide updates it) is Keras's, and stays.
            if isinstance(sample_weight, int) and sample_weight == rows:
                sample_weight = real_count(batch)
            return original(values, sample_weight=sample_weight)

        object.__setattr__(tracker, "update_state", update_state)
        patched.append((tracker, "update_state"))
    try:
        yield
    finally:
        for obj, name in patched:
            object.__delattr__(obj, name)


def data_of(batch: dict[str, Any]) -> Any:
    """A global batch as Keras's own ``fit`` / ``evaluate`` hands it to ``train_step`` / ``test_step``."""
    if batch.get("y") is None:
        return pack_inputs(batch["x"])
    if UNWEIGHTED in batch:
        return batch["x"], batch["y"]
    return batch["x"], batch["y"], _weights(batch)


def pack_inputs(x: Any) -> Any:
    """Inputs alone as Keras packs them (``pack_x_y_sample_weight(x)``): a tuple or list wrapped in a
    1-tuple, anything else as it is."""
    return (x,) if isinstance(x, (tuple, list)) else x


def call_train_step(model: Any, params: list, model_state: list, opt_vars: list, metrics: list,
                    batch: dict[str, Any]) -> tuple[dict[str, Any], tuple]:
    """The model's own ``train_step`` on a global batch: ``(logs, (params, model_state, opt, metrics))``."""
    with exact_metrics(model, batch):
        logs, state = model.train_step((params, model_state, opt_vars, metrics), data_of(batch))
    return _check_logs(model, "train_step", logs), tuple(state)


def call_test_step(model: Any, params: list, model_state: list, metrics: list, batch: dict[str, Any]
                   ) -> tuple[dict[str, Any], tuple]:
    """The model's own ``test_step`` on a global batch: ``(logs, (params, model_state, metrics))``."""
    with exact_metrics(model, batch):
        logs, state = model.test_step((params, model_state, metrics), data_of(batch))
    return _check_logs(model, "test_step", logs), tuple(state)


def call_predict_step(model: Any, params: list, model_state: list, x: Any) -> Any:
    """The model's own ``predict_step`` on a global batch of inputs: its outputs."""
    outputs, _ = model.predict_step((params, model_state), pack_inputs(x))
    return outputs


def _check_logs(model: Any, name: str, logs: Any) -> dict[str, Any]:
    if not isinstance(logs, dict):
        raise TypeError(f"{type(model).__name__}.{name} must return (logs, state) with logs a dict (the JAX "
                        f"backend's stateless signature); received logs of type {type(logs).__name__}.")
    return logs


def scalar_log_names(logs: dict[str, Any], known: set[str]) -> list[str]:
    """The names of ``logs`` (abstract values) that are scalars and not metric results."""
    # A dict (a CompileMetrics' result, as keras.io's guide logs it) is no scalar: its metrics are in known.
    return [k for k, v in logs.items() if k not in known and not isinstance(v, dict)
            and tuple(getattr(v, "shape", jnp.shape(v))) == ()]


def abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct``s of a tree of arrays (for ``jax.eval_shape``)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)
