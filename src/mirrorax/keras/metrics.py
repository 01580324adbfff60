"""Keras metrics on the global batch: padding masked out, and sums packed into one all-reduce operand.

Keras feeds ``metrics=`` without sample weights and ``weighted_metrics=`` with them; padding rows must
count in neither, so the former get the mask and the latter ``sample_weight * mask``
(:func:`update_compile_metrics`).

On several devices, the metrics whose update adds up over rows (Keras's own sum-based ones), and the
loss when it is the compiled loss alone, are summed per replica and packed into one all-reduce operand
(:mod:`mirrorax.batch_sums`); the others are updated on the global batch (:func:`update`).

The metrics' results (``result()`` of each, from the accumulators) are computed by one compiled program
per process for each distinct computation (:class:`ResultsProgram`), not one per model.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mirrorax.batch_sums as batch_sums
from mirrorax.keras import _internals as internals
from mirrorax.models.base import real_count
from mirrorax.steps.dispatch import Traced

__all__ = ["update", "update_compile_metrics", "all_metrics", "resets_itself", "compiled_metric_args",
           "ResultsProgram", "unmasked", "against_mask"]

PyTree = Any


def update(model: Any, values: list[Any], loss: Any, batch: dict[str, PyTree], y_pred: Any,
           rows_loss: Callable[..., Any] | None) -> tuple[list[Any], Any]:
    """``model.metrics_variables``' ``values`` after this batch, and the batch's loss.

    Args:
      loss: the loss Keras computed on the global batch.
      rows_loss: the loss of some rows, summing over the replicas to ``loss`` (``None`` when it does not
        add up so, a masked output's loss among them: the adapter tells); on several devices the returned
        loss is then that sum, and ``loss`` goes unused.
    """
    from keras import StatelessScope

    refs = model.metrics_variables
    cm = internals.compile_metrics(model)
    mask, weights = batch["mask"], batch["sample_weight"] * batch["mask"]
    # Outputs in a lower precision than float32 (a mixed_bfloat16 model's): the loss and metrics on the
    # global batch, as Keras computes them. Within one program XLA may keep such an output's value in
    # float32 on its way into the loss (excess precision); summed per replica, the output would be
    # rounded to its own type first, and the loss would not be Keras's.
    where = batch_sums.current() if _full_precision(y_pred) else None
    packed: list[Any] = []
    totals: list[Any] = []
    if where is not None:
        packed = [] if cm is None else _packable(cm, batch["y"], y_pred)
        own = [v for m in packed for v in m.variables]
        if rows_loss is not None or packed:
            def sums(rows: Any, real: Any) -> list[Any]:
                y, y_p, m, w, sw = rows
                head = [] if rows_loss is None else [rows_loss(y, y_p, sw, m, real)]
                return head + _metric_totals(cm, own, packed, y, y_p, m, w)

            totals = batch_sums.per_replica_sums(
                sums, (batch["y"], y_pred, mask, weights, batch["sample_weight"]), where, real_count(batch))
            if rows_loss is not None:
                loss, totals = totals[0].astype(jnp.result_type(loss)), totals[1:]
    with StatelessScope(state_mapping=list(zip(refs, values))) as scope:
        internals.loss_tracker(model).update_state(loss, sample_weight=real_count(batch))
        if cm is not None:
            update_compile_metrics(cm, batch["y"], y_pred, mask, weights,
                                   skip=set(map(id, packed)) if packed else None)
    out = []
    for ref, v in zip(refs, values):
        new = scope.get_current_value(ref)
        out.append(v if new is None else new)
    if packed:
        index = {id(ref): i for i, ref in enumerate(refs)}
        for v, total in zip(own, totals):
            i = index[id(v)]
            out[i] = values[i] + total.astype(values[i].dtype)
    return out, loss


def _metric_totals(cm: Any, own: list[Any], packed: list[Any], y: Any, y_pred: Any, mask: Any,
                   weights: Any) -> list[Any]:
    """The totals of ``packed`` metrics' variables ``own`` over some rows, from zero."""
    from keras import StatelessScope

    if not packed:
        return []
    zeros = [jnp.zeros(v.shape, v.dtype) for v in own]
    with StatelessScope(state_mapping=list(zip(own, zeros))) as local:
        update_compile_metrics(cm, y, y_pred, mask, weights, only=set(map(id, packed)))
    return [z if local.get_current_value(v) is None else local.get_current_value(v) for v, z in zip(own, zeros)]


def all_metrics(metrics: Sequence[Any]) -> Iterator[Any]:
    """``model.metrics`` and the metrics inside them (a CompileMetrics' lists)."""
    for m in metrics:
        if m is None:
            continue
        yield m
        inner = [*internals.flat_metrics(m), *internals.flat_weighted_metrics(m)]
        if type(m).__name__ == "MetricsList":
            inner += list(m.metrics)
        yield from all_metrics(inner)


def resets_itself(metric: Any) -> bool:
    """Whether ``metric``'s ``reset_state`` is its own (not Keras's, which zeroes the variables)."""
    owner = next((c for c in type(metric).__mro__ if "reset_state" in c.__dict__), None)
    return owner is not None and not internals.is_keras_builtin(owner)


def _known_layout(cm: Any) -> bool:
    """Whether a CompileMetrics has the flat metric lists this module reads (Keras 3's layout)."""
    return internals.has_flat_metrics(cm)


def _compile_metric_items(cm: Any, y: Any, y_pred: Any, mask: Any, weights: Any
                          ) -> Iterator[tuple[Any, Any, Any, Any]]:
    """``(metric, y_true, y_pred, weights)`` for each metric of a built CompileMetrics: ``metrics=`` get
    the mask, ``weighted_metrics=`` get ``sample_weight * mask``."""
    ys, ps = internals.flatten_y(cm, y), internals.flatten_y(cm, y_pred)
    for flat, w in ((internals.flat_metrics(cm), mask), (internals.flat_weighted_metrics(cm), weights)):
        for m, y_t, y_p in zip(flat, ys, ps):
            if not m:
                continue
            # An output's metrics come as one MetricsList: each metric is fed on its own (see below).
            for metric in m.metrics if type(m).__name__ == "MetricsList" else [m]:
                yield metric, y_t, y_p, w


def update_compile_metrics(cm: Any, y: Any, y_pred: Any, mask: Any, weights: Any, *,
                            skip: set[int] | None = None, only: set[int] | None = None) -> None:
    """``CompileMetrics.update_state``, with padding masked out of the *unweighted* metrics too.

    Keras feeds ``metrics=`` without sample weights and ``weighted_metrics=`` with them; padding rows
    must count in neither, so the former get the mask and the latter ``sample_weight * mask``.
    ``skip`` / ``only``: ids of metrics to leave out / to update alone.
    """
    if not _known_layout(cm):
        cm.update_state(y, y_pred, weights)  # an unknown Keras version: weighted metrics stay exact
        return
    if not cm.built:
        cm.build(y, y_pred)
    for metric, y_t, y_p, w in _compile_metric_items(cm, y, y_pred, mask, weights):
        if (skip is not None and id(metric) in skip) or (only is not None and id(metric) not in only):
            continue
        metric.update_state(y_t, y_p, sample_weight=against_mask(w, y_p) if _per_example(metric, y_t, y_p)
                            else None)


def against_mask(weights: Any, y_pred: Any) -> Any:
    """Per-row ``weights`` shaped to multiply the Keras mask ``y_pred`` carries (a sequence model's
    ``(batch, time)`` mask): Keras multiplies the two without broadcasting a ``(batch,)`` weight."""
    mask = internals.keras_mask(y_pred)
    if weights is None or mask is None or weights.ndim >= mask.ndim:
        return weights
    return weights.reshape(weights.shape + (1,) * (mask.ndim - weights.ndim))


def _full_precision(y_pred: Any) -> bool:
    """Whether no floating output is narrower than float32 (bfloat16 and float16 outputs are)."""
    return all(not jnp.issubdtype(p.dtype, jnp.floating) or jnp.finfo(p.dtype).bits >= 32
               for p in jax.tree.leaves(y_pred))


def unmasked(y_pred: Any) -> bool:
    """Whether no output carries a Keras mask (a masked loss or metric divides by a global count)."""
    return all(internals.keras_mask(p) is None for p in jax.tree.leaves(y_pred))


def _packable(cm: Any, y: Any, y_pred: Any) -> list[Any]:
    """The compiled metrics whose update adds up over rows (from zero, the totals of two sets of rows
    are the sum of each set's), which :mod:`mirrorax.batch_sums` may sum per replica: Keras's own
    sum-based metrics (means of a per-example function, confusion counts, AUC) whose ``update_state``
    is Keras's, fed per-example weights. A metric of a function that gives one number per batch, a
    subclass with its own ``update_state``, or outputs carrying a Keras mask stay in the global view."""
    if not _known_layout(cm):
        return []
    if not cm.built:
        cm.build(y, y_pred)
    if not unmasked(y_pred):
        return []
    adds_up = internals.sum_based_metric_updates()
    return [metric for metric, y_t, y_p, _ in _compile_metric_items(cm, y, y_pred, None, None)
            if getattr(type(metric), "update_state", None) in adds_up and _per_example(metric, y_t, y_p)]


def _per_example(metric: Any, y_t: Any, y_p: Any) -> bool:
    """Whether ``metric``'s function gives a value per example, which weights (and the padding mask) can
    weigh. A function that returns one number per batch (``lambda y, p: 0.0``) takes none: Keras counts
    it once per batch, and so does the global batch here (whose padding rows, in a short last batch, such
    a function sees: no mask reaches inside it)."""
    fn, kwargs = internals.fn_and_kwargs(metric)
    if fn is None:
        return True
    try:
        out = jax.eval_shape(lambda a, b: fn(a, b, **kwargs), *(jax.ShapeDtypeStruct(v.shape, v.dtype)
                                                               for v in (y_t, y_p)))
    except Exception:  # the call below meets the same error and reports it
        return True
    return all(len(o.shape) > 0 for o in jax.tree.leaves(out))


def compiled_metric_args(model: Any) -> Any:
    cm = internals.compile_metrics(model)
    if cm is None:
        return None
    return internals.user_metrics(cm)


# (a results program's jaxpr and constants) -> its compiled program, for every model of the process
_SHARED_RESULTS: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()


class ResultsProgram:
    """``fn(values)`` (a model's metric results from its accumulators' ``values``) as a compiled program that
    every model computing the same results shares.

    ``jax.jit(fn)`` compiles a program per model (``fn`` is a new function each time): ~30 ms on a CPU
    and more on an accelerator, paid before a new model's first ``fit`` returns, which Keras's own
    ``fit`` (its results computed op by op) does not pay. Here ``fn`` is traced once per signature of
    ``values``, and the trace's program (its jaxpr and constants, which say exactly what it computes) is
    looked up in a process-wide cache: a second model with the same metrics compiles nothing.

    Calling raises what tracing ``fn`` raises (``TypeError`` for a ``result()`` that branches on values).
    """

    _MAX_SHARED = 64  # distinct result computations kept (each a small program)
    _MAX_CONST_BYTES = 1 << 20  # larger constants are not keyed by their bytes: such a trace is not shared

    def __init__(self, fn: Callable[[list[Any]], list[Any]]) -> None:
        self._fn = fn
        self._programs: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, values: list[Any]) -> list[Any]:
        sig = tuple((np.shape(v), np.result_type(v)) for v in values)
        program = self._programs.get(sig)
        if program is None:
            program = self._programs[sig] = self._program(values)
        return program(values)

    def _program(self, values: list[Any]) -> Callable[..., Any]:
        traced = Traced.of(self._fn, (values,))
        key = self._key(traced.closed)
        if key is None:
            return jax.jit(traced.replay)
        program = _SHARED_RESULTS.get(key)
        if program is None:
            program = _SHARED_RESULTS[key] = jax.jit(traced.replay)
            if len(_SHARED_RESULTS) > self._MAX_SHARED:
                _SHARED_RESULTS.popitem(last=False)
        return program

    @classmethod
    def _key(cls, closed: Any) -> tuple[Any, ...] | None:
        """What the traced program computes: its jaxpr's text and its constants' values (``None``: too large)."""
        consts = []
        for c in closed.consts:
            a = np.asarray(c)
            if a.nbytes > cls._MAX_CONST_BYTES:
                return None
            consts.append((a.shape, str(a.dtype), a.tobytes()))
        return str(closed.jaxpr), tuple(consts)
