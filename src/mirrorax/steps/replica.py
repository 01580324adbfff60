"""The per-replica view (``strategy.run``) and the losses that stay exact under padding.

Inside a function given to ``strategy.run``, :func:`get_replica_context` says which replica is running
and reduces values over all of them (``tf.distribute.get_replica_context()``'s meaning). Outside it
(in the global view of ``strategy.jit``, or plain Python) there is no replica context: ``None``.

:func:`compute_average_loss` is written once for both views: the sum of the real rows' losses divided by
the *global* count of real rows. In the global view that is the mean over the global batch; per replica
it is that replica's share of it, so the sum of the replicas' gradients is the gradient of the global
mean, as with TF's ``tf.nn.compute_average_loss``. JAX takes that sum itself: inside ``strategy.run`` the
gradient of a replicated value (the state) comes out already summed over the replicas, as TF's
``optimizer.apply_gradients`` sums them; it needs no ``all_reduce``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax.steps.distributed_batch import is_batch, piece_of

__all__ = ["ReduceOp", "ReplicaContext", "get_replica_context", "compute_average_loss", "masked_mean",
           "scale_regularization_loss", "batch_scope", "find_batch", "real_rows_view", "keep_padding_view",
           "RowValues", "mark_rows", "rows_of", "leaves_with_rows"]

PyTree = Any


class ReduceOp(enum.StrEnum):
    """How values of the replicas combine (``tf.distribute.ReduceOp``); the strings work too."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"


def resolve_op(op: Any, allowed: tuple[str, ...] = ("sum", "mean", "max")) -> str:
    """``op`` as one of ``allowed``: a :class:`ReduceOp`, a ``tf.distribute.ReduceOp`` or another enum
    member, or its string (``"sum"``, TF's ``"SUM"``: case-insensitive)."""
    value = op.value if isinstance(op, enum.Enum) else op
    if isinstance(value, str) and value.lower() in allowed:
        return value.lower()
    raise ValueError(f"Expected a reduce op among {list(allowed)} (or mx.ReduceOp.SUM/MEAN"
                     f"{'/MAX' if 'max' in allowed else ''}). Received: {op!r} (of type {type(op).__name__}).")


class ReplicaContext:
    """Which replica runs, and reductions over every replica; only inside ``strategy.run``.

    Attributes:
      num_replicas_in_sync: how many replicas run ``fn`` (the strategy's device count).
    """

    def __init__(self, axis_name: str | tuple[str, ...], num_replicas: int) -> None:
        self._axis = axis_name
        self.num_replicas_in_sync = num_replicas

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        """This replica's index, ``0 <= id < num_replicas_in_sync`` (a traced int32 scalar)."""
        return jax.lax.axis_index(self._axis)

    def varies(self, value: Any) -> bool:
        """Whether ``value`` (traced in ``fn``) may differ between the replicas (see :func:`varies_over`)."""
        return varies_over(value, self._axis)

    def all_reduce(self, op: ReduceOp | str, value: PyTree) -> PyTree:
        """``value`` (any pytree) reduced over every replica; the result is the same on all of them.

        The gradient of a replicated value (the state) needs no all-reduce: JAX already sums it over the
        replicas inside ``strategy.run`` (as TF's ``optimizer.apply_gradients`` does), so with
        :func:`compute_average_loss` it is the gradient of the global mean. Summing such a value again
        would multiply it by ``num_replicas_in_sync``, so ``"sum"`` of a value that is already the same
        on every replica raises; ``"mean"`` and ``"max"`` leave it as it is.

        Args:
          op: ``"sum"``, ``"mean"`` or ``"max"`` (or a :class:`ReduceOp`).
          value: a pytree of arrays, the replica's own values.

        Raises:
          ValueError: ``op`` is not a known reduction, or ``"sum"`` of a value that does not vary over the
            replicas.

        Example:
          >>> correct = mx.get_replica_context().all_reduce("sum", jnp.sum(hits * batch.mask))  # in run
        """
        kind = resolve_op(op)
        reduce = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax}[kind]
        if kind == "sum":
            paths = jax.tree_util.tree_flatten_with_path(value)[0]
            same = [jax.tree_util.keystr(p) or "value" for p, v in paths if not varies_over(v, self._axis)]
            if same:
                raise ValueError(
                    f"all_reduce('sum', value) received a value already the same on every replica (at "
                    f"{', '.join(same[:4])}{', ...' if len(same) > 4 else ''}): summing it would multiply it by "
                    "num_replicas_in_sync. A gradient of a "
                    "replicated value (the state) is already summed over the replicas by JAX inside strategy.run "
                    "(as TF's apply_gradients does): drop the all_reduce. For n times a value, write "
                    "ctx.num_replicas_in_sync * value.")
        return jax.tree.map(lambda v: reduce(v, self._axis), value)

    def __repr__(self) -> str:
        return f"ReplicaContext(num_replicas_in_sync={self.num_replicas_in_sync})"


def varies_over(value: Any, axis: str | tuple[str, ...]) -> bool:
    """Whether ``value`` (traced inside ``jax.shard_map``) may differ between the replicas of ``axis`` (a
    mesh axis name, or a tuple of them: varies over any).

    JAX types every value inside ``shard_map`` with the mesh axes it varies over (``jax.typeof(v).vma``):
    replicated inputs, their gradients and all-reduced values do not vary; the replica's rows do.
    """
    t = jax.typeof(value)
    vma = getattr(t, "vma", None)
    if vma is None:
        mat = getattr(t, "manual_axis_type", None)
        vma = getattr(mat, "varying", None)
    axes = (axis,) if isinstance(axis, str) else axis
    if vma is None:
        return "{V:" in str(t) and any(a in str(t) for a in axes)
    return any(a in vma for a in axes)


_local = threading.local()


def get_replica_context() -> ReplicaContext | None:
    """The :class:`ReplicaContext` while ``strategy.run`` traces ``fn``; ``None`` anywhere else.

    Example:
      >>> def fn(batch):
      ...     ctx = mx.get_replica_context()
      ...     return ctx.all_reduce("sum", jnp.sum(batch.mask))   # real rows of the global batch
      >>> strategy.run(fn, args=(batch,))
    """
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def replica_scope(context: ReplicaContext) -> Iterator[ReplicaContext]:
    """Makes ``context`` what :func:`get_replica_context` returns (while ``strategy.run`` traces)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(context)
    try:
        yield context
    finally:
        stack.pop()


def find_batch(args: Any) -> Any:
    """The one :class:`mirrorax.DistributedBatch` among ``args`` (any pytree), or ``None`` (none, or several)."""
    found = [leaf for leaf in jax.tree.leaves(args, is_leaf=is_batch) if is_batch(leaf)]
    return found[0] if len(found) == 1 else None


def real_rows_view(args: Any, sharding: Any) -> Any:
    """``args`` (any pytree) with each :class:`mirrorax.DistributedBatch` that knows its real rows cut to them:
    what a step in the global view is given (inside its trace; see ``DistributedBatch.real_rows_only``)."""
    return jax.tree.map(lambda b: b.real_rows_only(sharding) if is_batch(b) else b, args, is_leaf=is_batch)


def keep_padding_view(args: Any) -> Any:
    """``args`` with each :class:`mirrorax.DistributedBatch` without its static count, its padding kept: what
    ``strategy.run`` hands its replicas (as many rows on each), one program for every row count."""
    return jax.tree.map(lambda b: b.keep_padding() if is_batch(b) else b, args, is_leaf=is_batch)


@contextlib.contextmanager
def batch_scope(batch: Any) -> Iterator[None]:
    """Makes ``batch`` the step's batch while it traces: :func:`compute_average_loss` without a batch
    argument (TF's form) finds its mask here."""
    stack = getattr(_local, "batches", None)
    if stack is None:
        stack = _local.batches = []
    stack.append(batch)
    try:
        yield
    finally:
        stack.pop()


def _current_batch() -> Any:
    stack = getattr(_local, "batches", None)
    return stack[-1] if stack else None


def _batch_fields(batch: Any) -> tuple[Any, Any]:
    if not is_batch(batch) and jnp.ndim(batch):
        # An array the step was given (x of ``for x, y in dist``): a piece of the step's batch gives that batch;
        # any other array is a full batch's (its rows all real; per replica, as many on every replica).
        current = _current_batch()
        if current is not None and any(batch is leaf for leaf in jax.tree.leaves(current.data)):
            batch = current
        elif hasattr(batch, "shape"):
            rows = jnp.shape(batch)[0]
            ctx = get_replica_context()
            return jnp.ones((rows,), jnp.float32), rows * (ctx.num_replicas_in_sync if ctx is not None else 1)
    try:
        return batch.mask, batch.num_real
    except AttributeError:
        raise TypeError(f"Expected an mx.DistributedBatch (from strategy.experimental_distribute_dataset), whose "
                        f"mask and num_real say which rows are real, or an array of it as the step was given it "
                        f"(x of for x, y in dist). Received: {batch!r:.80} (of type {type(batch).__name__}). "
                        "Pass the batch (or one of its arrays) the step was given, or leave batch out inside a "
                        "step: the step's batch is used.") from None


def _per_row(values: Any, rows: int, what: str) -> Any:
    """``values`` reduced to one value per row (the mean over any further axes, e.g. time steps)."""
    values = jnp.asarray(values)
    if values.ndim == 0 or values.shape[0] != rows:
        raise ValueError(f"{what} must have one value per row of the batch (leading axis {rows}); received shape "
                         f"{values.shape}. Pass per-example values, e.g. a loss with reduction='none'.")
    return values.reshape(rows, -1).mean(axis=1) if values.ndim > 1 else values


def compute_average_loss(per_example_loss: Any, batch: Any = None, *, sample_weight: Any = None,
                         global_batch_size: int | None = None) -> jax.Array:
    """The mean of ``per_example_loss`` over the real rows of the *global* batch (padding masked out).

    ``sum(loss * mask * sample_weight) / batch.num_real``: in the global view (``strategy.jit``) the mean
    over the global batch; inside ``strategy.run`` this replica's share of it (its rows' sum over the
    global count), so that the replicas' gradients add up to the gradient of the global mean (JAX adds
    them: the gradient of a replicated value comes out summed over the replicas). A loss
    with more than one value per example (e.g. per time step) is first averaged over those axes. The
    result has the loss's dtype (float64 stays float64).

    TF's form works too: ``compute_average_loss(per_example_loss, global_batch_size=B)`` divides the
    real rows' sum by ``B``, as ``tf.nn.compute_average_loss`` does (a short last batch is then divided by
    the full ``B``, as in TF). Without ``batch``, the step's one ``DistributedBatch`` argument (found while
    ``strategy.jit`` / ``strategy.run`` trace the step) gives the mask, when its rows are the loss's rows.

    Args:
      per_example_loss: one loss per row of ``batch`` (shape ``(rows, ...)``).
      batch: the :class:`mirrorax.DistributedBatch` the loss was computed on; ``None``: the step's batch.
      sample_weight: optional per-row weights (still divided by the count of real rows, as Keras and
        TF do for ``sum_over_batch_size``).
      global_batch_size: TF's divisor. ``None``: the real rows of the global batch (``batch.num_real``);
        without any batch, the loss's rows times the replica count (TF's default).

    Example:
      >>> def loss_fn(params, batch):
      ...     x, y = batch.data
      ...     return mx.compute_average_loss(cross_entropy(y, apply(params, x)), batch)
      >>> mx.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)  # TF's form
    """
    rows = jnp.shape(per_example_loss)[0] if jnp.ndim(per_example_loss) else 0
    if batch is None:
        batch = _current_batch()
        if batch is not None and (jnp.ndim(batch.mask) != 1 or batch.mask.shape[0] != rows):
            batch = None  # the step's batch is not what this loss was computed on
    if batch is None and global_batch_size is None:
        ctx = get_replica_context()
        global_batch_size = rows * (ctx.num_replicas_in_sync if ctx is not None else 1)
    if batch is not None:
        mask, num_real = _batch_fields(batch)
    else:
        mask, num_real = jnp.ones((rows,), jnp.float32), None
    per_row = _per_row(per_example_loss, mask.shape[0], "per_example_loss")
    dtype = per_row.dtype
    weight = mask.astype(dtype)
    if sample_weight is not None:
        weight = weight * jnp.asarray(sample_weight).astype(dtype).reshape(mask.shape[0])
    # where, not a product alone: a NaN/inf in a padding row (a copy of a real row) must not leak.
    total = jnp.sum(jnp.where(mask > 0, per_row * weight, jnp.zeros((), dtype)))
    count = num_real if global_batch_size is None else global_batch_size
    return total / jnp.maximum(jnp.asarray(count).astype(dtype), jnp.ones((), dtype))


def scale_regularization_loss(regularization_loss: Any) -> jax.Array:
    """``tf.nn.scale_regularization_loss``: the sum of ``regularization_loss`` (a scalar or a list, e.g.
    ``model.losses``) divided by the replica count inside ``strategy.run``, as is outside it.

    Each replica adds its share, because the replicas' gradients are summed: the total is then added once.

    Example:
      >>> loss = mx.compute_average_loss(per_example_loss) + mx.scale_regularization_loss(model.losses)
    """
    terms = list(regularization_loss) if isinstance(regularization_loss, (list, tuple)) else [regularization_loss]
    total = sum((jnp.asarray(t) for t in terms), jnp.zeros((), jnp.float32))
    ctx = get_replica_context()
    return total / ctx.num_replicas_in_sync if ctx is not None else total


def masked_mean(values: Any, batch: Any = None) -> jax.Array:
    """The mean of per-row ``values`` over the real rows of the global batch (e.g. an accuracy).

    The same rule as :func:`compute_average_loss` (global count; per replica, the replica's share);
    ``batch=None``: the step's batch.

    Example:
      >>> accuracy = mx.masked_mean(jnp.argmax(logits, -1) == y, batch)
    """
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.float32)
    return compute_average_loss(values, batch)


# -- per-row values of a batch with padding --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RowValues:
    """How an array a step returned holds one row per example of a batch with padding.

    Attributes:
      per_replica: the rows each replica held (the batch's rows over ``num_replicas_in_sync``): replica
        ``r`` held rows ``r * per_replica`` on, and its real rows are the first of those.
      mask: ``None`` when the array holds the batch's real rows only (a step in the global view, given
        the batch cut to them); else the batch's ``mask``, split as the array is: the array keeps every
        row, padding included (a step per replica), and the mask says which rows are real.
    """

    per_replica: int
    mask: Any = None


_ROW_VALUES: dict[int, RowValues] = {}


def mark_rows(value: Any, rows: RowValues) -> None:
    """Records that ``value`` (a ``jax.Array`` a step returned) holds one row per example as ``rows``
    says, for as long as ``value`` lives (``strategy.gather`` and ``experimental_local_results`` then
    give its real rows only)."""
    key = id(value)
    _ROW_VALUES[key] = rows
    weakref.finalize(value, _ROW_VALUES.pop, key, None)


def rows_of(value: Any) -> RowValues | None:
    """What :func:`mark_rows` recorded for ``value``, or ``None``."""
    return _ROW_VALUES.get(id(value))


def leaves_with_rows(value: Any, num_replicas: int) -> tuple[list[tuple[Any, RowValues | None]], Any]:
    """The leaves of ``value`` (a pytree), each with how it holds one row per example of a batch with padding
    (``None``: it does not), and the tree's structure: what the host-side readers (``reduce``, ``gather``,
    ``experimental_local_results``) need to give real rows only.

    A leaf holds rows so when it is an output a step returned so (:func:`mark_rows`), a piece of such a batch
    (``x, y = batch`` outside a step), or in the data of such a batch given whole: a batch in ``value`` is
    taken as its data (TF's distributed batch is its data), with its mask.
    """
    of_batches: dict[int, RowValues] = {}

    def padded(mask: Any) -> RowValues:  # a padded batch's rows: split evenly over the replicas, as its mask
        return RowValues(int(np.shape(mask)[0]) // num_replicas, mask)

    def open_batch(x: Any) -> Any:
        if not is_batch(x):
            return x
        if x.has_padding:
            rows = padded(x.mask)
            for leaf in jax.tree.leaves(x.data):
                of_batches[id(leaf)] = rows
        return x.data

    leaves, treedef = jax.tree.flatten(jax.tree.map(open_batch, value, is_leaf=is_batch))

    def rows(v: Any) -> RowValues | None:
        found = of_batches.get(id(v)) or rows_of(v)
        if found is None:
            record = piece_of(v)
            if record is not None and not record.full:
                found = padded(record.mask)
        return found

    return [(v, rows(v)) for v in leaves], treedef
