"""What a custom step sees of a batch's padding, and what it returns of it.

A :class:`mirrorax.DistributedBatch` has one fixed shape: a short batch (the last of an uneven dataset, or
one whose size the device count does not divide) is padded with copies of real rows, 0 in its ``mask``.
TF's last batch is simply shorter. So that a step gives TF's numbers:

* **Global view** (``strategy.jit``): a batch whose real rows the host knows (arrays, iterables of global
  batches) reaches the step cut to them (:func:`mirrorax.steps.replica.real_rows_view`): the step is the
  single-device program on the real rows, whatever it does with them.
* **Per replica** (``strategy.run``, and the global view of a batch whose count only the devices know):
  each replica has as many rows, so the padding stays. Every Keras metric's ``update_state`` called in the
  step with one value per row is given the mask as its ``sample_weight`` (times the user's own), so its
  state counts the real rows only (:func:`masked_metric_updates`, through each front-end's
  ``metric_masking``: Keras's is :mod:`mirrorax.keras.masking`); :func:`mirrorax.compute_average_loss`
  and :func:`mirrorax.masked_mean` leave the padding out of losses.
* **Outputs.** An output with one row per example of a batch with padding is recorded
  (:func:`mirrorax.steps.replica.mark_rows`), so that ``strategy.gather``, ``experimental_local_results`` and
  ``reduce(..., axis=0)`` give its real rows only: in the global view the step's output holds those rows
  only; per replica it keeps the fixed shape and the record holds the mask.
* What remains ambiguous is warned once per step function (:class:`PaddingIgnoredWarning`), naming what
  the padding enters: an output reduced over the rows without the mask (a plain ``jnp.mean``, a
  BatchNormalization statistic per replica), or a metric whose ``update_state`` takes no ``sample_weight``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from mirrorax import front_end
from mirrorax.steps.replica import find_batch

__all__ = ["PaddingIgnoredWarning", "ReplicatedBatchWarning", "padding_outputs", "warn_padding", "warn_stray_rows",
           "warn_replicated_batch", "masked_metric_updates", "unmasked_metrics", "current_mask", "masked_update",
           "per_row_leaves", "even_out_shardings", "even_layouts"]


class PaddingIgnoredWarning(UserWarning):
    """A step sees the padding rows of a batch and lets them into a result.

    A :class:`mirrorax.DistributedBatch` keeps every example: the short last batch of an uneven dataset
    (and every batch whose size the device count does not divide) is padded with copies of real rows,
    marked 0 in ``mask``. A step in the global view (``strategy.jit``) never sees them when the host
    knows the real rows (arrays, iterables of global batches: it is given the batch cut to those). Per
    replica (``strategy.run``), and for per-process pipelines on several processes, each replica holds
    padding rows too: Keras metrics get the mask as their ``sample_weight``, and
    :func:`mirrorax.compute_average_loss` leaves them out, but a plain mean (``jnp.mean(loss)``), a
    BatchNormalization statistic or a metric whose ``update_state`` has no ``sample_weight`` counts them.

    Warned once per step function, the first time such a batch reaches a step whose traced program has an
    output reduced over the rows (not one row per example) that depends on the batch's data but not on its
    mask, or that updates such a metric; the message names them. Fix:
    :func:`mirrorax.compute_average_loss` (or the mask itself, e.g. :func:`mirrorax.masked_mean`), or
    ``experimental_distribute_dataset(..., drop_remainder=True)``.
    """


class ReplicatedBatchWarning(UserWarning):
    """A step was given what is almost certainly a global batch as host arrays, which it gets whole on every
    device (replicated), not split over them.

    A plain array argument of ``strategy.jit`` or ``strategy.run`` is placed on every device, as
    ``tf.distribute`` does with a plain tensor: right for constants and for the state, but for a batch it
    means that every device computes on all its rows (``strategy.jit``: the one-device numbers, with no
    speed-up) or that every replica takes the whole batch (``strategy.run``: each replica's share of the
    loss is then the whole batch's, and the summed gradient ``num_replicas_in_sync`` times too large).
    Warned once per step signature when at least two host arrays among the arguments (and their entries)
    share a leading axis (inputs and targets). Fix: iterate
    ``strategy.experimental_distribute_dataset(...)`` and pass its batches (or their pieces).
    """


def warn_stray_rows(where: str, name: str, paths: list[str]) -> None:
    """Warns (:class:`PaddingIgnoredWarning`) that the step ``name`` given to ``where`` was given arrays
    (``paths``) with a padded batch's rows and layout that are no piece of it: their padding rows reach the
    step."""
    warnings.warn(
        f"{where} received {', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''} with the rows of a padded batch "
        f"(the short last batch of an uneven dataset, or a batch size the device count does not divide) but no "
        f"piece of that batch beside {'them' if len(paths) > 1 else 'it'}: an array computed from a batch outside "
        f"the step is no longer its piece, so {name} sees its padding rows (copies of real rows). Compute it inside "
        "the step from the batch's pieces (for x, y in dist: step(x, y)), or pass a piece of its batch with it, so "
        "that the step is given the real rows only.", PaddingIgnoredWarning, stacklevel=4)


def warn_replicated_batch(where: str, name: str, found: list[tuple[str, tuple[int, ...]]], replicas: int,
                          per_replica: bool) -> None:
    """Warns (:class:`ReplicatedBatchWarning`) that the step ``name`` given to ``where`` was given arrays not
    split over the devices (host arrays, ``jnp`` arrays; ``found``: path and shape) that look like a global batch."""
    what = ", ".join(f"{p} of shape {s}" for p, s in found[:4]) + (", ..." if len(found) > 4 else "")
    if per_replica:
        effect = ("every replica runs on all of its rows: each one's share of the loss is the whole batch's, and "
                  f"the gradient summed over the {replicas} replicas is {replicas} times too large")
    else:
        effect = f"each of the {replicas} devices computes on all of its rows (the one-device numbers, no speed-up)"
    warnings.warn(
        f"{where} received arrays that look like a global batch ({what}), not split over the devices. A plain "
        f"array argument (numpy, or a jnp array made whole) is placed on "
        f"every device whole (replicated, as tf.distribute does with a plain tensor), so {effect}. Split the batch "
        f"over the devices: iterate strategy.experimental_distribute_dataset(data, batch_size=...) and pass its "
        f"batches (or their pieces: for x, y in dist: {name}(..., x, y)).", ReplicatedBatchWarning, stacklevel=4)


# -- which outputs let the padding in --------------------------------------------------------------------
# Primitives whose sub-program maps its inputs and outputs one to one (the rest count as a whole).
_CALLS = frozenset({"pjit", "jit", "shard_map", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _depends(jaxpr: Any, sources: list[bool]) -> list[bool]:
    """For each output of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), whether it depends on an input marked in
    ``sources``. Errs towards "depends" (a loop or branch passes any marked input to all its outputs)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    marked = {v for v, m in zip(jaxpr.invars, sources) if m}

    def hit(v: Any) -> bool:
        return not isinstance(v, jax_core.Literal) and v in marked

    for eqn in jaxpr.eqns:
        ins = [hit(v) for v in eqn.invars]
        if not any(ins):
            continue
        sub = next((p for p in eqn.params.values() if isinstance(p, (jax_core.Jaxpr, jax_core.ClosedJaxpr))
                    and len(getattr(p, "jaxpr", p).invars) == len(ins)
                    and len(getattr(p, "jaxpr", p).outvars) == len(eqn.outvars)), None)
        outs = _depends(sub, ins) if sub is not None and eqn.primitive.name in _CALLS else [True] * len(eqn.outvars)
        marked.update(v for v, m in zip(eqn.outvars, outs) if m)
    return [hit(v) for v in jaxpr.outvars]


def padding_outputs(jaxpr: Any, leaves: list[Any], batch: Any) -> list[int]:
    """The outputs of the program ``jaxpr`` (inputs: ``leaves``) that let ``batch``'s padding in: reduced over
    the rows (not one row per example, as a prediction is: the caller drops those rows), depending on the
    batch's data but not on its mask (a plain mean, a BatchNormalization statistic)."""
    data = {id(a) for a in jax.tree.leaves(batch.data)}
    rows = np.shape(batch.mask)[0]
    shapes = [v.aval.shape for v in getattr(jaxpr, "jaxpr", jaxpr).outvars]
    masked = _depends(jaxpr, [a is batch.mask for a in leaves])
    reached = _depends(jaxpr, [id(a) in data for a in leaves])
    return [i for i, (r, m, shape) in enumerate(zip(reached, masked, shapes))
            if r and not m and not (shape and shape[0] == rows)]


def warn_padding(where: str, name: str, real: int | None, rows: int, replicas: int | None, entered: list[str],
                 metrics: list[str]) -> None:
    """Warns (:class:`PaddingIgnoredWarning`) that the step ``name`` given to ``where`` saw a batch of ``rows``
    rows (``real`` of them real; ``None``: known to the devices only), per replica on ``replicas`` replicas
    (``None``: the global view), and that the padding enters the results named in ``entered`` and the
    state of the ``metrics``."""
    count = f"{real} real rows of {rows}" if real is not None else "its real rows known to the devices only"
    if replicas is not None:
        view = (f"each replica runs {name} on {rows // replicas} rows, the padding rows (copies of real rows, 0 in "
                "batch.mask) included")
    else:
        view = (f"{name} sees every row, the padding rows (copies of real rows, 0 in batch.mask) included: a "
                "per-process pipeline's real rows are known to the devices only, so the batch is not cut")
    what = [f"{', '.join(entered[:6])}{', ...' if len(entered) > 6 else ''} (reduced over the rows without "
            "the mask)"] if entered else []
    what += [f"the state of metric {m!r} (its update_state takes no sample_weight)" for m in metrics]
    warnings.warn(
        f"{where} received a padded batch ({count}: the short last batch of an uneven dataset, or a batch size "
        f"the device count does not divide), and {view}. Keras metrics get the mask as their sample_weight and "
        f"mx.compute_average_loss leaves the padding out, but it enters {'; '.join(what)}. Leave it out with "
        "mx.compute_average_loss(per_example_loss) or the batch's mask (e.g. mx.masked_mean), or drop the short "
        "batch: strategy.experimental_distribute_dataset(..., drop_remainder=True).",
        PaddingIgnoredWarning, stacklevel=4)


def per_row_leaves(out: Any, rows: int) -> list[bool]:
    """For each leaf of ``out`` (traced in a step whose batch has ``rows`` rows), whether it holds one row
    per example: its leading axis has the batch's rows."""
    return [bool(jnp.ndim(a)) and jnp.shape(a)[0] == rows for a in jax.tree.leaves(out)]


def even_out_shardings(given: Any, shapes: Callable[..., Any], replicated: Any, replicas: int) -> Callable[..., Any]:
    """``out_shardings`` (a sharding, a pytree of them or a callable of the arguments) for a step in the
    global view: as given, except for a batch cut to a count of rows the ``replicas`` do not divide, where
    an output the given layout would split unevenly is ``replicated`` (:func:`even_layouts`; ``shapes(*args)``
    gives the outputs' shapes then)."""
    def out_shardings(*args: Any) -> Any:
        user = given(*args) if callable(given) else given
        rows = getattr(find_batch(args), "rows", None)
        if user is None or rows is None or rows % replicas == 0:
            return user
        return even_layouts(user, shapes(*args), replicated)

    return out_shardings


def even_layouts(shardings: Any, shapes: Any, fallback: Any) -> Any:
    """``shardings`` (a prefix of ``shapes``' tree, as ``out_shardings`` is) with ``fallback`` for each leaf
    whose shape its sharding cannot split evenly (one row per real example of a batch cut to a count the
    devices do not divide: an array is split into equal parts only)."""
    def one(sharding: Any, shape: Any) -> Any:
        try:
            sharding.shard_shape(shape.shape)
        except (ValueError, AttributeError):  # (jax's IndivisibleError is a ValueError)
            return fallback
        return sharding

    try:
        full = jax.tree.broadcast(shardings, shapes)
    except (ValueError, TypeError):  # not a prefix of the outputs: jax.jit names the mismatch
        return shardings
    return jax.tree.map(one, full, shapes)


# -- metrics given the mask ------------------------------------------------------------------------------
_state = threading.local()  # .masks: a stack (None: no masking); .unmasked: the names collected


def _masks() -> list[Any]:
    stack = getattr(_state, "masks", None)
    if stack is None:
        stack = _state.masks = []
    return stack


def current_mask() -> Any:
    """The mask of the step tracing on this thread (:func:`masked_metric_updates`), or ``None``: no masking
    (not in a step, or a step that sees no padding)."""
    stack = _masks()
    return stack[-1] if stack else None


def masked_update(original: Callable[..., Any], metric: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  mask: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of ``metric.update_state`` (``original``: its own method, unbound) with ``mask`` in the
    sample weight (times the one passed), when its first argument holds one value per row of the step's
    batch; unchanged otherwise. A metric whose ``update_state`` takes no ``sample_weight`` is left as given
    and named to :func:`unmasked_metrics`. A front-end's metrics call this while its ``metric_masking``
    context is open (:class:`mirrorax.front_end.FrontEnd`)."""
    try:
        signature = inspect.signature(original)
        bound = signature.bind(metric, *args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    names = list(signature.parameters)
    first = bound.arguments.get(names[1]) if len(names) > 1 else None
    rows = np.shape(mask)[0]
    if first is None or not jnp.ndim(first) or jnp.shape(first)[0] != rows:
        return args, kwargs  # not one value per row (a scalar, another batch's values): left as given
    if "sample_weight" not in signature.parameters:
        unmasked = getattr(_state, "unmasked", None)
        if unmasked is not None:
            unmasked.append(getattr(metric, "name", type(metric).__name__))
        return args, kwargs
    weight = bound.arguments.get("sample_weight")
    if weight is None:
        weight = mask
    else:
        weight = jnp.asarray(weight)
        weight = weight * jnp.reshape(mask, (rows,) + (1,) * (weight.ndim - 1)).astype(weight.dtype) \
            if weight.ndim else weight * mask
    bound.arguments["sample_weight"] = weight
    return bound.args[1:], bound.kwargs


@contextlib.contextmanager
def masked_metric_updates(mask: Any) -> Iterator[None]:
    """While a step traces: each front-end's metric (Keras's) whose ``update_state``'s first argument has one
    value per row of ``mask`` is given ``mask`` as its sample weight (times the one passed), so its state
    counts the real rows only. ``mask=None``: no masking (a step that sees no padding, inside one that does).

    Each registered front-end's ``metric_masking`` context is open meanwhile (Keras's wraps its metrics'
    ``update_state`` methods while any step traces under this, on any thread; the wrappers act only on the
    thread whose step set a mask, through :func:`current_mask` and :func:`masked_update`).
    """
    with contextlib.ExitStack() as contexts:
        for kind in front_end.front_ends():
            if kind.metric_masking is not None:
                contexts.enter_context(kind.metric_masking())
        stack = _masks()
        stack.append(mask)
        try:
            yield
        finally:
            stack.pop()


@contextlib.contextmanager
def unmasked_metrics() -> Iterator[list[str]]:
    """Collects the names of the metrics :func:`masked_metric_updates` could not mask (their
    ``update_state`` takes no ``sample_weight``) while the block runs."""
    outer = getattr(_state, "unmasked", None)
    names: list[str] = []
    _state.unmasked = names
    try:
        yield names
    finally:
        _state.unmasked = outer
        if outer is not None:
            outer.extend(names)
