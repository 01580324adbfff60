"""Iterable inputs: any Python iterable of batches (generators, tf.data, a torch DataLoader, grain).

Each item is one global batch, or, from ``strategy.distribute_datasets_from_function``, this process's
share of one (a :class:`PerProcessDataset`). A short item is padded to the fixed shape; the step cuts a
global item's padding off again (its real row count is known on every process), a per-process item's
stays in, masked.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrorax.inputs.batch import Batch, padded_batch_size, row_counts, take_rows
from mirrorax.inputs.checks import batch_weights, leaves, rows_shape, tree_numeric
from mirrorax.inputs.position import InputState
from mirrorax.inputs.source import no_targets
from mirrorax.inputs.streams import Stream, len_or_none

if TYPE_CHECKING:
    from mirrorax.inputs.reading import FitReading
    from mirrorax.inputs.source import InputContext
    from mirrorax.mesh import BatchMesh

__all__ = ["IterableSource", "IterStream", "PerProcessDataset", "agreed_items", "padding_index", "empty_like",
           "per_process_pipeline"]

PyTree = Any


class PerProcessDataset:
    """Marks an iterable as yielding this process's rows only (not the global batch): what
    ``strategy.distribute_datasets_from_function`` reads.

    Iterating it yields this process's share of each global batch. How its items make up a share is
    decided by what the pipeline function asked its ``context``, as TF reads them:

    * batched by ``context.get_per_replica_batch_size(global)`` (TF's tutorials): each item is one
      replica's batch, and each of this process's replicas takes its own, so a share is
      ``context.replicas_per_pipeline`` consecutive items (their rows joined; the last share of a pass
      may hold fewer, or shorter, items, padded as any short batch);
    * otherwise (``context.get_per_pipeline_batch_size(global)``, or no size asked): each item is the
      whole share.

    Args:
      iterable: the pipeline (a ``tf.data.Dataset``, a generator, a list of batches, ...).
      context: the :class:`~mirrorax.inputs.source.InputContext` the pipeline function was given.
    """

    def __init__(self, iterable: Any, context: InputContext) -> None:
        self.iterable = iterable
        self.context = context
        asked = set(context.asked)
        self.per_replica = asked == {"replica"} and context.replicas_per_pipeline > 1
        self.size_asked = bool(asked)

    @property
    def items_per_share(self) -> int:
        """How many of the pipeline's items make up one share of a global batch."""
        return self.context.replicas_per_pipeline if self.per_replica else 1

    def __len__(self) -> int:
        return -(-len(self.iterable) // self.items_per_share)  # TypeError for a pipeline without a length

    def __iter__(self) -> Iterator[Any]:
        k = self.items_per_share
        if k == 1:
            return iter(self.iterable)
        return _joined(iter(self.iterable), k)

    def check_share(self, rows: int, global_batch: int | None) -> None:
        """Refuses a first item of ``rows`` rows that is one replica's batch of ``global_batch`` where the
        pipeline function asked for no size: read as the process's share, it would make every global batch
        ``replicas_per_pipeline`` times smaller than ``global_batch``, silently.

        Raises:
          ValueError: the item holds ``global_batch / num_replicas_in_sync`` rows, fewer than the share.
        """
        ctx = self.context
        if self.size_asked or global_batch is None or ctx.replicas_per_pipeline == 1:
            return
        share = global_batch // ctx.num_input_pipelines
        if rows < share and rows * ctx.num_replicas_in_sync == global_batch:
            raise ValueError(
                f"The per-process pipeline yielded a first batch of {rows} rows for a global batch of {global_batch}: "
                f"one replica's batch ({global_batch} / {ctx.num_replicas_in_sync} replicas), while each item is "
                f"read as this process's whole share ({share} rows), which would train on global batches "
                f"{ctx.replicas_per_pipeline} times smaller. Batch the pipeline with "
                f"ctx.get_per_replica_batch_size({global_batch}) (each replica then takes its own batch, as in "
                f"TF), or yield {share} rows per batch (ctx.get_per_pipeline_batch_size({global_batch})).")

    def __repr__(self) -> str:
        kind = "a replica's batch" if self.per_replica else "the process's share"
        return f"PerProcessDataset({type(self.iterable).__name__}, each item {kind}, context={self.context})"


def _joined(it: Iterator[Any], k: int) -> Iterator[Any]:
    """The items of ``it`` ``k`` at a time, each group's rows joined into one item of the same structure."""
    while True:
        group = list(itertools.islice(it, k))
        if not group:
            return
        yield group[0] if len(group) == 1 else _concatenate(group)


def _concatenate(group: list[Any]) -> Any:
    structures = {str(jax.tree.structure(item)) for item in group}
    if len(structures) > 1:
        raise ValueError(f"The per-process pipeline's batches of one global batch differ in structure: received "
                         f"{sorted(structures)}. Yield the same structure (e.g. (x, y)) in every batch.")
    return jax.tree.map(lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *group)


def per_process_pipeline(data: Any) -> PerProcessDataset | None:
    """The per-process pipeline ``data`` reads: ``data`` itself, or the one a distributed dataset places
    (what ``strategy.distribute_datasets_from_function`` returns, TF's form); ``None`` for any other input."""
    if isinstance(data, PerProcessDataset):
        return data
    inner = getattr(data, "per_process", None)
    return inner if isinstance(inner, PerProcessDataset) else None


class IterableSource:
    """Batches from any Python iterable of ``x``, ``(x, y)`` or ``(x, y, sample_weight)``.

    Generators, ``tf.data``, a torch ``DataLoader`` and grain loaders all reduce to this. Each item is
    one global batch (or, from ``strategy.distribute_datasets_from_function``, this process's share).
    A smaller item is padded to the fixed shape; a larger one is an error.
    """

    def __init__(self, iterable: Iterable[Any], *, float_dtype: Any = np.float32) -> None:
        pipeline = per_process_pipeline(iterable)
        self.per_process = pipeline is not None
        self.pipeline = pipeline
        self.iterable = iterable if pipeline is None else pipeline
        self.float_dtype = np.dtype(float_dtype)
        self._first: Any = None
        self._opened: tuple[Iterator[Any], Any] | None = None  # the pass peek() began, and its first item

    def peek(self) -> tuple[PyTree, PyTree, Any]:
        """The first item, split into ``(x, y, w)`` (for sizing and building); consumes nothing.

        The item is read from the pass the next iteration trains on, whose iterator stays open: that pass
        starts with it. So the input is iterated once per pass, as Keras iterates it: a tf.data pipeline's
        ``.cache()`` is filled by a whole pass (an iterator dropped half-read can leave it truncated), a
        reshuffling ``shuffle(seed=...)`` gives Keras's order, a generator loses no item. An iterable that
        can show its first batch without a pass (``first_batch()``: a Keras ``PyDataset``, read by index)
        is asked instead."""
        if self._first is None:
            look = getattr(self.iterable, "first_batch", None)
            if callable(look):
                raw = look()
            else:
                it = self._iter()
                try:
                    raw = next(it)
                except StopIteration:
                    raise ValueError(f"The input iterable yielded no batch: received an empty "
                                     f"{type(self.iterable).__name__}. Pass a non-empty dataset (a generator "
                                     "or iterator is spent after one pass: pass a fresh one).") from None
                self._opened = (it, raw)
            x, y, w = _split(raw)
            self._first = (tree_numeric(x, "x", self.float_dtype), tree_numeric(y, "y", self.float_dtype), w)
        return self._first

    def _iter(self) -> Iterator[Any]:
        """A pass: the one :meth:`peek` began (its first item again, then the rest), else a new iteration."""
        opened, self._opened = self._opened, None
        if opened is not None:
            it, first = opened
            return itertools.chain([first], it)
        return iter(self.iterable)

    @property
    def labels_checked(self) -> bool:
        """Always False: labels outside the classes are found in the step (``StepFunctions``), as
        reading every batch on the host would cost time on every step."""
        return False

    def default_batch_size(self, process_count: int) -> int:
        """The first batch's rows (times ``process_count`` for a per-process pipeline)."""
        rows = self.first_batch_rows()
        return rows * process_count if self.per_process else rows

    def require_targets(self, what: str) -> None:
        """Refuses batches without ``y`` for ``what`` (``"fit"``, ``"evaluate"``, ``"validation_data"``)."""
        if self.peek()[1] is None:
            raise no_targets(what, "batches of x alone")

    def sample(self, batch_size: int, mesh: BatchMesh, *, with_targets: bool = True) -> Batch:
        """The first item as an all-real :class:`Batch` (for building a model's variables)."""
        x, y, w = self.peek()
        n = row_counts(x)[0][1]
        return Batch(x, y if with_targets else None, np.ones(n, np.float32), np.ones(n, np.float32),
                     weighted=w is not None)

    def check_targets(self, adapter: Any) -> None:
        """Refuses a first batch whose targets do not fit the model's outputs and loss (shapes). Labels
        outside the classes are found in the step (``StepFunctions``): reading every batch here would cost
        host time on every step."""
        x, y, _ = self.peek()
        adapter.check_inputs(x)
        if y is not None:
            adapter.sparse_targets(y, check_shapes=True)

    def _signature(self, x: PyTree, y: PyTree) -> list[tuple[str, tuple[int, ...], str]]:
        # Sorted: dict keys in another order are the same batch (JAX flattens dicts by sorted key).
        return sorted((name, a.shape[1:], a.dtype.name) for name, a in leaves(x, "x") + leaves(y, "y"))

    def _check_like_first(self, x: PyTree, y: PyTree, index: int) -> None:
        """Every batch has the first one's arrays (names, shapes past the batch axis, dtypes): a change
        would compile the step again (or fail inside the model) instead of training."""
        fx, fy, _ = self.peek()
        want, got = self._signature(fx, fy if y is not None else None), self._signature(x, y)
        if want == got:
            return
        names_w, names_g = [n for n, _, _ in want], [n for n, _, _ in got]
        if names_w != names_g:
            raise ValueError(f"Batch {index} of the input holds the arrays {names_g}, the first batch {names_w}. "
                             "Every batch must have the same structure (x, y and sample_weight alike).")
        for (name, shape_w, dtype_w), (_, shape_g, dtype_g) in zip(want, got):
            if shape_w != shape_g:
                raise ValueError(f"Batch {index} of the input has {name} of shape {rows_shape(shape_g)}, the first "
                                 f"batch {rows_shape(shape_w)}. Every batch must "
                                 "have the same shape past the batch axis (only the number of rows may vary: "
                                 "short batches are padded). Pad or crop to one shape in the input pipeline.")
            if dtype_w != dtype_g:
                raise ValueError(f"Batch {index} of the input has {name} of dtype {dtype_g}, the first batch "
                                 f"{dtype_w}. Every batch must have the same dtypes; cast in the input pipeline "
                                 f"(e.g. .astype('{dtype_w}')).")

    def stream(self, batch_size: int, mesh: BatchMesh, *, shuffle: Any = False, seed: int = 0,
               with_targets: bool = True, reading: FitReading | None = None) -> IterStream:
        """One iteration per epoch (a one-shot iterator continues across epochs). ``shuffle``, ``seed`` and
        ``reading.order`` do not apply: an iterable yields batches in its own order."""
        return IterStream(self, batch_size, mesh, with_targets=with_targets,
                          ends_with_data=reading is not None and reading.ends_with_data)

    def track_position(self, process_count: int) -> InputState | None:
        """Wraps the iterable in place in an :class:`InputState`; ``None`` where positions are left to
        replay: one-shot iterators, and per-process pipelines of a multi-process job (each process's
        input has its own state; only process 0 writes ``meta``)."""
        if isinstance(self.iterable, (Iterator, InputState)) or (self.per_process and process_count > 1):
            return None
        tracker = InputState(self.iterable, opened=self._opened)  # the pass peek() began goes on there
        self._opened = None
        self.iterable = tracker
        return tracker

    def first_batch_rows(self) -> int:
        x, _, _ = self.peek()
        return row_counts(x)[0][1]

    def batches(self, batch_size: int, mesh: BatchMesh, *, with_targets: bool = True,
                skip: int = 0) -> Iterator[Batch]:
        padded = padded_batch_size(batch_size, mesh)
        rows = padded // mesh.process_count if self.per_process else padded
        it = self._iter()
        for _ in range(skip):
            next(it, None)
        template = None
        index = skip  # 1-based, as the user counts batches
        for item in agreed_items(it, mesh, self.per_process):
            index += 1
            if item is None:
                yield empty_like(template, "epoch")
                continue
            x, y, w = _split(item)
            x = tree_numeric(x, "x", self.float_dtype)
            y = tree_numeric(y, "y", self.float_dtype) if with_targets else None
            self._check_like_first(x, y, index)
            lengths = {rows for _, rows in row_counts(x) + row_counts(y)}
            if len(lengths) != 1:
                raise ValueError(f"A batch's arrays have different lengths {sorted(lengths)}; each item must hold "
                                 "one row per example in x, y and sample_weight.")
            n = lengths.pop()
            if index == 1 and self.pipeline is not None:
                self.pipeline.check_share(n, batch_size)
            if n > rows:
                raise ValueError(f"The input yielded a batch of {n} rows, more than batch_size={batch_size}"
                                 f" ({rows} rows per {'process' if self.per_process else 'step'}). Pass "
                                 "batch_size equal to the largest batch the iterable yields.")
            weighted = w is not None
            w = batch_weights(w, n, index, self.float_dtype) if weighted else np.ones(n, self.float_dtype)
            idx, valid = padding_index(n, padded, mesh, self.per_process)
            # A global item's padding sits at the end of the global batch: the step cuts it off (rows).
            template = Batch(take_rows(x, idx), take_rows(y, idx), w[idx], valid.astype(np.float32),
                             None if self.per_process else np.float32(n), None if self.per_process else n,
                             weighted)
            yield template


def agreed_items(it: Iterator[Any], mesh: BatchMesh, per_process: bool) -> Iterator[Any]:
    """The items of ``it`` until it ends; for the per-process pipelines of a multi-process job, until every
    process's ends, ``None`` standing for each batch this process lacks while another still has data."""
    multi_per_process = per_process and mesh.process_count > 1
    while True:
        item = next(it, None)
        if multi_per_process:
            # Processes agree each step whether anyone still has data, so no process waits in a
            # collective for a batch that another never sends.
            from mirrorax.cluster.consistency import any_process  # host-side: no wait on the steps

            if not any_process(item is not None):
                return
        elif item is None:
            return
        yield item


def padding_index(n: int, padded: int, mesh: BatchMesh, per_process: bool) -> tuple[np.ndarray,
                                                                                                np.ndarray]:
    """Which of an item's ``n`` rows fills each of this process's rows of a batch of ``padded`` rows (a
    padding row copies row 0), and which rows are real. A per-process item is this process's share; a
    global one is cut, each process taking its own rows."""
    if not per_process and mesh.process_count > 1:
        local = padded // mesh.process_count
        slot = np.arange(mesh.process_index * local, (mesh.process_index + 1) * local)
    else:
        slot = np.arange(padded // mesh.process_count if per_process else padded)
    valid = slot < n
    return np.where(valid, np.minimum(slot, n - 1), 0), valid


def empty_like(template: Batch | None, per: str) -> Batch:
    """An all-padding batch shaped like ``template``, for a process whose pipeline ended before another's
    (``per``: what every process needs at least one batch of, ``"epoch"`` or ``"pass"``)."""
    if template is None:
        raise RuntimeError("This process's input pipeline yielded no batch while another process still had "
                           "data, and there is no earlier batch to shape the padding. Give every process "
                           f"at least one batch per {per}.")
    return dataclasses.replace(template, mask=np.zeros_like(template.mask), num_real=None, rows=None)


def _split(item: Any) -> tuple[Any, Any, Any]:
    if isinstance(item, tuple):
        if len(item) == 1:
            return item[0], None, None
        if len(item) == 2:
            return item[0], item[1], None
        if len(item) == 3:
            return item
        raise ValueError(f"An input item must be x, (x,), (x, y) or (x, y, sample_weight); received a "
                         f"tuple of {len(item)} elements.")
    if isinstance(item, list) and len(item) in (2, 3) and not isinstance(item[0], (int, float)):
        return _split(tuple(item))
    return item, None, None


class IterStream(Stream):
    """Global batches from an :class:`IterableSource`; an epoch is one iteration (or ``count`` batches)."""

    def __init__(self, source: IterableSource, batch_size: int, mesh: BatchMesh,
                 with_targets: bool = True, ends_with_data: bool = False) -> None:
        self.source, self.batch_size, self.mesh = source, batch_size, mesh
        self.with_targets = with_targets
        self.per_process = source.per_process
        super().__init__(ends_with_data)
        self.batches_per_pass = len_or_none(source.iterable)
        self._continuing: Iterator[Batch] | None = None
        self._seen = 0  # batches taken from _continuing (a sized iterable under Keras's steps_per_epoch)

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        """The epoch's batches from batch ``start`` on (a resumed epoch skips what it already trained)."""
        it: Iterator[Batch]
        one_shot = isinstance(self.source.iterable, Iterator)
        # A one-shot iterator (a generator) continues across epochs, as in Keras; so does any iterable
        # under Keras's steps_per_epoch, until an iteration ends.
        continuing = one_shot or bool(self.ends_with_data and count)
        if continuing:
            if self._continuing is None:
                self._continuing = self.source.batches(self.batch_size, self.mesh,
                                                       with_targets=self.with_targets)
            it = self._continuing
        else:
            it = self.source.batches(self.batch_size, self.mesh, with_targets=self.with_targets)
        if start:
            it = itertools.islice(it, start, None)
        taken = 0
        for i, b in enumerate(it, start=start):
            self._reals.append(int(b.mask.sum()) * max(self.mesh.process_count, 1))
            yield b
            taken += 1
            if count and i + 1 >= count:
                break
        else:
            if not one_shot:
                self._continuing, self._seen = None, 0  # the iteration ended: the next epoch starts anew
            return
        if continuing and not one_shot and self.batches_per_pass:
            self._seen += taken
            if self._seen >= self.batches_per_pass:  # a sized iterable's pass is done (Keras's rule)
                self._continuing, self._seen = None, 0
