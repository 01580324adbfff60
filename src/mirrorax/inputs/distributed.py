"""``strategy.experimental_distribute_dataset``: global batches as arrays split over the devices.

Iterating a :class:`DistributedDataset` yields :class:`~mirrorax.steps.distributed_batch.DistributedBatch` es: the
item's own structure (``(x, y)``, a dict, ...) as global ``jax.Array`` s split over the batch axis, padded to
one fixed shape, with a ``mask`` (1.0 for real rows, 0.0 for padding) and ``num_real`` (real rows of the
global batch); a dataset of one array yields that array. Padding rows are copies of a real row, so they are
harmless inputs. Each array is a piece of its batch (:func:`~mirrorax.steps.distributed_batch.remember_pieces`):
unpacked in the loop, it still reaches a step on its batch's real rows.

Where the host knows the global batch's real rows (arrays, iterables of global batches) the padding sits at
the end of the global batch and the count travels statically with the batch (``rows``, part of its tree
structure, as a shape is): a step in the global view (``strategy.jit``) is given the batch cut to its real
rows (:meth:`DistributedBatch.real_rows_only`), so it computes on exactly the rows TF's last batch holds.
Per replica (``strategy.run``) every replica has the same number of rows, so the padding stays, masked:
:func:`mirrorax.compute_average_loss`, :func:`mirrorax.masked_mean` and Keras metrics leave it out.

The rows are cut, shuffled, padded and masked by the Trainer's own sources (an array's by
:class:`~mirrorax.inputs.arrays.ArraySource`, an iterable's by the helpers
:class:`~mirrorax.inputs.iterables.IterableSource` uses), each batch held as a host
:class:`~mirrorax.inputs.batch.Batch` whose ``x`` is the item's structure (no targets, no weights), and
placed with :func:`~mirrorax.inputs.placement.put_rows`. What stays here is the data's reading under JAX's
rules: any pytree of arrays, each batch's item whole (never split into ``x``, ``y`` and ``sample_weight``).

Each process builds only its own rows of every global batch. The next batch is placed right after the
strategy dispatches a step (``strategy.jit`` / ``strategy.run``), before the host waits on the previous
step: the host's copy overlaps the devices' work, without a second thread.

On one device of one process (:func:`~mirrorax.inputs.placement.host_rows`) nothing is placed: a batch's data
is the host's numpy arrays (an iterable's items as they came, an array dataset's rows cut from read-only views
of the user's arrays, a short batch its real rows with nothing to pad), which the step's dispatch transfers as
``jax.jit`` does a numpy argument; they are no pieces (nothing of a padded batch can be taken for them).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrorax.inputs.arrays import ArraySource
from mirrorax.inputs.batch import Batch, padded_batch_size, take_rows
from mirrorax.inputs.iterables import PerProcessDataset, agreed_items, empty_like, padding_index, per_process_pipeline
from mirrorax.inputs.placement import (
    RowsPlacer,
    cached_put,
    host_rows,
    is_shared,
    put_rows,
    shared_constant,
    shared_count,
)
from mirrorax.steps.distributed_batch import DistributedBatch, remember_pieces

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh
    from mirrorax.steps.dispatch import InFlight

__all__ = ["DistributedBatch", "DistributedDataset"]

PyTree = Any


def _numeric(a: Any, what: str) -> np.ndarray:
    if hasattr(a, "numpy") and not isinstance(a, np.ndarray):
        a = a.numpy()  # tf.Tensor, torch.Tensor
    arr = np.asarray(a)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise TypeError(f"{what} must hold numbers; received an array of dtype {arr.dtype} (shape {arr.shape}). "
                        "Convert it first (e.g. np.asarray(..., dtype=np.float32)) or encode categories as integers.")
    if arr.ndim == 0:
        raise ValueError(f"{what} must have a leading example axis; received a scalar {arr!r}.")
    wanted = jax.dtypes.canonicalize_dtype(arr.dtype)  # float64 -> float32 unless JAX runs in x64
    return arr if arr.dtype == wanted else arr.astype(wanted)


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _tree(data: Any, what: str) -> PyTree:
    paths, treedef = jax.tree_util.tree_flatten_with_path(data)
    return jax.tree.unflatten(treedef, [_numeric(a, f"{what}{jax.tree_util.keystr(p)}") for p, a in paths])


def _rows(tree: PyTree, what: str) -> int:
    lengths = {jax.tree_util.keystr(p): a.shape[0] for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}
    if not lengths:
        raise ValueError(f"{what} must hold at least one array; received {tree!r}, which holds none. "
                         "Pass e.g. (x, y) or {'x': x}.")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"Every array of {what} must have the same number of rows; received {lengths}.")
    return next(iter(lengths.values()))


class _Full:
    """The signature of an iterable's full batches on one process (its tree, each leaf's shape and dtype), once
    one such batch was seen: a later item of that signature needs no check, cut, copy or padding, and is placed
    by a :class:`~mirrorax.inputs.placement.RowsPlacer` (a loop of small steps pays the transfer alone), or on one
    device kept as the host's arrays (:func:`~mirrorax.inputs.placement.host_rows`)."""

    __slots__ = ("treedef", "specs", "dtypes", "rows", "leaf", "record", "_mesh", "_host", "_placed")

    def __init__(self, treedef: Any, leaves: list[np.ndarray], rows: int, mesh: BatchMesh, mask: np.ndarray,
                 num_real: np.ndarray) -> None:
        self.treedef, self.rows, self._mesh = treedef, rows, mesh
        self.specs = [(a.shape, a.dtype) for a in leaves]
        self.dtypes = [jax.dtypes.canonicalize_dtype(a.dtype) for a in leaves]  # (JAX's: float64 -> float32)
        self.leaf = jax.tree_util.treedef_is_leaf(treedef)
        self._host = (mask, num_real)  # (shared constants: placed once, at the first placement)
        self._placed: tuple[RowsPlacer, jax.Array, jax.Array] | None = None
        self.record: Any = None  # (what the pieces of its batches share: one record for them all)

    def match(self, item: Any) -> list[np.ndarray] | None:
        """``item``'s leaves if it has this signature, else ``None``."""
        leaves, treedef = jax.tree.flatten(item)
        if treedef != self.treedef:
            return None
        for a, (shape, dtype) in zip(leaves, self.specs):
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
                return None
        return leaves

    def place(self, leaves: list[np.ndarray], on_host: bool = False) -> DistributedBatch:
        """The batch of ``leaves`` (a :meth:`match`) on the devices, or with ``on_host`` its leaves the host's arrays
        (in JAX's dtypes) for the step's dispatch to transfer."""
        if self._placed is None:
            s, (mask, num_real) = self._mesh, self._host
            specs = [(shape, d) for (shape, _), d in zip(self.specs, self.dtypes)]
            self._placed = (RowsPlacer(specs, s.batch_sharding),
                            cached_put(mask, s.batch_sharding, lambda a: put_rows([a], s.batch_sharding, 1)[0]),
                            cached_put(num_real, s.replicated, lambda a: s.place(a, s.replicated)))
        placer, placed_mask, placed_count = self._placed
        rows = [a if a.dtype == d else a.astype(d) for a, d in zip(leaves, self.dtypes)]
        data = rows if on_host else placer(rows)
        return DistributedBatch(self.treedef.unflatten(data), placed_mask, placed_count, False, self.rows)


class DistributedDataset:
    """Global batches of ``data`` on a mesh (see :meth:`MirroredStrategy.experimental_distribute_dataset`).

    Each ``iter()`` is one pass (an epoch): arrays are cut into global batches of ``batch_size`` (pass
    ``k`` shuffled by ``(seed, k)`` when ``shuffle``: an order that depends on neither the device nor
    the process count); an iterable yields one global batch per item (a short item is padded).
    With ``drop_remainder`` a short batch is not produced (``tf.data``'s ``batch(..., drop_remainder=True)``).
    ``len()`` is the number of batches per pass when known.

    Args:
      mesh: the devices and layouts (a strategy is one).
      data: arrays (a tuple/dict of them), an iterable of global batches, or a ``PerProcessDataset``.
      batch_size: the global batch, required for arrays.
      shuffle, seed: arrays only: pass ``k`` in the order drawn from ``(seed, k)``.
      drop_remainder: skip a batch with fewer than ``batch_size`` rows (arrays: the last one of each
        pass; an iterable: any short item). Not for per-process datasets on several processes.
      window: the dispatch window (``strategy.in_flight``) after whose next push the next batch is
        placed; ``None`` places each batch when it is asked for.
    """

    def __init__(self, mesh: BatchMesh, data: Any, *, batch_size: int | None = None,
                 shuffle: bool = False, seed: int = 0, drop_remainder: bool = False,
                 window: InFlight | None = None) -> None:
        self._mesh = mesh
        self._drop_remainder = bool(drop_remainder)
        self._window = window
        self._shuffle, self._seed = bool(shuffle), int(seed)
        self._passes = 0
        pipeline = per_process_pipeline(data)  # a per-process pipeline, or the result of distributing one
        data = data if pipeline is None else pipeline
        self._per_process = pipeline is not None
        self._source: ArraySource | None = None
        self._full: _Full | None = None  # an iterable's full batches' signature (one process)
        if _is_arrays(data):
            if batch_size is None:
                raise ValueError("batch_size is required when data holds arrays: it is the global batch "
                                 f"(over all devices and processes). Received: batch_size={batch_size!r}. "
                                 "Pass e.g. batch_size=256.")
            # Read-only views: a batch cut from them (a view on one device, where the step is given the host's
            # rows) cannot change the user's arrays in place; the user's own arrays stay as they were.
            arrays = jax.tree.map(_read_only, _tree(data, "data"))
            self._n = _rows(arrays, "data")
            if self._n == 0:
                raise ValueError(f"data is empty: received arrays of shapes "
                                 f"{[tuple(a.shape) for a in jax.tree.leaves(arrays)]} (0 rows). Pass at least "
                                 "one row.")
            self._source = ArraySource.of_rows(arrays, self._n)
            self._iterable = None
        else:
            if shuffle:
                raise ValueError(f"shuffle=True applies to arrays; received shuffle={shuffle!r} with data of type "
                                 f"{type(data).__name__}, which yields batches in its own order. Pass "
                                 "shuffle=False and shuffle at the source (e.g. tf.data's shuffle or a DataLoader's).")
            if not isinstance(data, Iterable) or isinstance(data, (str, bytes)):
                raise TypeError("data must be an iterable of global batches or a tuple/dict of arrays; received "
                                f"{data!r:.80} (of type {type(data).__name__}). Pass e.g. (x, y) with "
                                "batch_size=..., or a tf.data.Dataset of global batches.")
            self._n, self._iterable = 0, data
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer (the global batch); received {batch_size!r}.")
        self._batch_size = None if batch_size is None else int(batch_size)
        if self._drop_remainder and self._per_process and mesh.process_count > 1:
            raise ValueError("drop_remainder=True needs every process to see the global batch's size; received a "
                             f"per-process dataset on {mesh.process_count} processes, where each sees its own rows. "
                             "Batch in the input function with drop_remainder=True instead (e.g. tf.data's "
                             "ds.batch(per_process_batch, drop_remainder=True)).")

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def per_process(self) -> PerProcessDataset | None:
        """The per-process pipeline this dataset places (``strategy.distribute_datasets_from_function``), or
        ``None``: what ``Trainer.fit`` and ``experimental_distribute_dataset`` read when given this dataset."""
        return self._iterable if self._per_process else None  # type: ignore[return-value]

    @property
    def batch_size(self) -> int | None:
        """The global batch (``None`` for an iterable until its first item is seen)."""
        return self._batch_size

    def padded_rows(self, batch_size: int) -> int:
        """Rows of every placed batch: ``batch_size`` rounded up to a multiple of the device count."""
        return padded_batch_size(batch_size, self._mesh)

    def __len__(self) -> int:
        if self._source is not None:
            assert self._batch_size is not None  # arrays come with a batch size (checked at construction)
            if self._drop_remainder:
                return self._n // self._batch_size
            return self._source.batches_per_pass(self._batch_size)
        return len(self._iterable)  # type: ignore[arg-type]  # TypeError for iterables without a length

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[DistributedBatch]:
        pass_index = self._passes
        self._passes += 1
        # One device of one process: the batches stay the host's arrays, which the step's dispatch transfers
        # (nothing placed ahead then: no window to place after).
        on_host = host_rows(self._mesh)
        host: Iterator[Batch | list[np.ndarray]]
        if self._source is None:
            host = self._iterable_batches(on_host)
        else:
            host = self._host_array_batches(pass_index) if on_host else self._array_batches(pass_index)
        return _PlacingIterator(host, functools.partial(self._place, on_host=on_host),
                                None if on_host else self._window)

    def _array_batches(self, pass_index: int) -> Iterator[Batch]:
        assert self._source is not None and self._batch_size is not None
        batches = self._source.batches(self._batch_size, self._mesh, shuffle=self._shuffle, seed=self._seed,
                                       pass_index=pass_index, with_targets=False)
        # only a pass's last batch can be short
        return itertools.islice(batches, self._n // self._batch_size) if self._drop_remainder else batches

    def _host_array_batches(self, pass_index: int) -> Iterator[Batch | list[np.ndarray]]:
        """An array dataset's batches on one device (:func:`host_rows`): each full batch the leaves of its rows
        (:meth:`ArraySource.full_leaf_batches`, the signature :class:`_Full` holds), the short last one a
        :class:`Batch` (its real rows kept, the padding cut off)."""
        source, size = self._source, self._batch_size
        assert source is not None and size is not None
        if self._full is None and source.num_examples >= size:
            leaves, treedef = jax.tree.flatten(source.x)
            self._full = _Full(treedef, [a[:size] for a in leaves], size, self._mesh,
                               shared_constant(np.ones(size, np.float32)), shared_count(size))
        yield from source.full_leaf_batches(size, shuffle=self._shuffle, seed=self._seed, pass_index=pass_index)
        if source.num_examples % size and not self._drop_remainder:
            last = source.batches_per_pass(size) - 1
            yield from source.batches(size, self._mesh, shuffle=self._shuffle, seed=self._seed, pass_index=pass_index,
                                      start=last, with_targets=False)

    def _iterable_batches(self, on_host: bool = False) -> Iterator[Batch]:
        s = self._mesh
        known = not (self._per_process and s.process_count > 1)  # per-process: only the devices know the count
        template: Batch | None = None
        ones: np.ndarray | None = None
        fast = s.process_count == 1
        for index, item in enumerate(agreed_items(iter(self._iterable), s, self._per_process)):  # type: ignore[arg-type]
            if item is None:
                yield empty_like(template, "pass")
                continue
            full = self._full
            if full is not None and (leaves := full.match(item)) is not None:
                yield leaves  # type: ignore[misc]  # (placed by _place's fast path)
                continue
            rows = _tree(item, f"batch {index}")
            n = _rows(rows, f"batch {index}")
            if index == 0 and isinstance(self._iterable, PerProcessDataset):
                self._iterable.check_share(n, self._batch_size)
            if self._batch_size is None:
                self._batch_size = n * s.process_count if self._per_process else n
            if self._drop_remainder and n < self._batch_size:
                continue
            padded = self.padded_rows(self._batch_size)
            limit = padded // s.process_count if self._per_process else padded
            if n > limit:
                raise ValueError(f"Batch {index} has {n} rows, more than batch_size={self._batch_size} allows "
                                 f"({limit} rows per {'process' if self._per_process else 'global batch'}). Pass "
                                 "batch_size equal to the largest batch the iterable yields.")
            if on_host and n < padded:  # one device holds every row: the real rows alone, unpadded
                ones_n = shared_constant(np.ones(n, np.float32))
                template = Batch(rows, None, ones_n, ones_n, shared_count(n), n)
                yield template
                continue
            idx, valid = padding_index(n, padded, s, self._per_process)
            if valid.all():  # a full batch: the one mask already on the devices
                if ones is None or ones.shape != valid.shape:
                    ones = shared_constant(np.ones(valid.shape, np.float32))
                mask = ones
            else:
                mask = valid.astype(np.float32)
            # No weights: a DistributedBatch carries none (the field holds the mask, never placed).
            count = shared_count(n) if known else None
            if fast and mask is ones and n == padded and count is not None:
                leaves, treedef = jax.tree.flatten(item)
                if all(type(a) is np.ndarray for a in leaves):  # (tensors of other libraries: converted each time)
                    self._full = _Full(treedef, leaves, n, s, mask, count)
            # (on one device a full item is given as it came: the first as the later ones, the data's own arrays)
            kept = on_host and mask is ones and n == padded
            template = Batch(rows if kept else take_rows(rows, idx), None, mask, mask, count, n if known else None)
            yield template

    # -- placement ---------------------------------------------------------------------------------
    def _place(self, host: Batch | list[np.ndarray], on_host: bool = False) -> DistributedBatch:
        s = self._mesh
        if type(host) is list:  # a full batch of the signature _Full holds: its leaves
            signature = self._full
            assert signature is not None
            batch = signature.place(host, on_host)
            if not on_host:  # (host arrays are no piece: nothing of a padded batch can be taken for them)
                signature.record = remember_pieces(batch, signature.record)
            return batch.data if signature.leaf else batch
        assert isinstance(host, Batch)
        full = is_shared(host.mask)
        known = self._full
        if full and known is not None and host.rows == known.rows and host.num_real is not None:
            leaves = known.match(host.x)  # (an array source's full batch, most likely: of the signature known)
            if leaves is not None:
                return self._place(leaves, on_host)
        sharding = s.batch_sharding
        leaves, treedef = jax.tree.flatten(host.x)
        count = host.num_real
        if on_host and isinstance(host.rows, int) and (not full or host.rows < self.padded_rows(self._batch_size or 0)):
            return self._short_on_host(host, leaves, treedef)
        if full and s.process_count == 1 and count is not None and isinstance(host.rows, int) and all(
                type(a) is np.ndarray and a.dtype == jax.dtypes.canonicalize_dtype(a.dtype) for a in leaves):
            # (a full batch of a signature not known yet, the known one matched above: an array source's views,
            # placed as an iterable's are from here on)
            self._full = _Full(treedef, leaves, host.rows, s, host.mask, np.asarray(count))
            return self._place(leaves, on_host)
        if full:  # a full batch: its mask was placed once
            placed = put_rows(leaves, sharding, s.process_count)
            mask = cached_put(host.mask, sharding, self._put_rows)
        else:  # the rows and the mask in one transfer
            placed = put_rows([*leaves, host.mask], sharding, s.process_count)
            mask = placed.pop()
        if host.num_real is None:  # per-process pipelines: only the devices know the global count
            num_real = _sum_mask(mask)
        else:
            num_real = cached_put(np.asarray(host.num_real, np.float32), s.replicated,
                                  lambda a: s.place(a, s.replicated))
        padded = not full and not bool(np.all(host.mask))
        rows = host.rows if isinstance(host.rows, int) else None
        batch = DistributedBatch(jax.tree.unflatten(treedef, placed), mask, num_real, padded, rows)
        remember_pieces(batch)  # (a padded batch's arrays: pieces that keep its real rows in a step)
        # A dataset of one array gives that array (a piece of its batch): an array to the step and outside it.
        return batch.data if jax.tree_util.treedef_is_leaf(treedef) else batch

    def _short_on_host(self, host: Batch, leaves: list[Any], treedef: Any) -> Any:
        """A batch short of the global batch on one device (:func:`host_rows`): its real rows as the host's arrays
        (an array dataset's padding cut off), no padding (one device holds every row); its mask and count placed
        once per count. (Its leaves are numeric in JAX's dtypes already: ``_tree`` made them so, item or arrays.)"""
        s, n = self._mesh, int(host.rows)  # type: ignore[arg-type]  # (an int: checked by the caller)
        data = [a if len(a) == n else a[:n] for a in leaves]
        mask = cached_put(shared_constant(np.ones(n, np.float32)), s.batch_sharding, self._put_rows)
        count = cached_put(host.num_real, s.replicated, lambda a: s.place(a, s.replicated))  # (shared_count(n))
        batch = DistributedBatch(jax.tree.unflatten(treedef, data), mask, count, False, n)
        return batch.data if jax.tree_util.treedef_is_leaf(treedef) else batch

    def _put_rows(self, a: np.ndarray) -> jax.Array:
        s = self._mesh
        return put_rows([a], s.batch_sharding, s.process_count)[0]

    def __repr__(self) -> str:
        kind = f"arrays of {self._n} rows" if self._source is not None else type(self._iterable).__name__
        return f"DistributedDataset({kind}, batch_size={self._batch_size}, shuffle={self._shuffle})"


@jax.jit
def _sum_mask(mask: jax.Array) -> jax.Array:
    return mask.sum()


class _PlacingIterator:
    """Yields placed batches; places the next one right after the window's next push (the next dispatched
    step), or when asked for without a window."""

    _END = object()

    def __init__(self, host: Iterator[Batch | list[np.ndarray]], place: Any, window: InFlight | None) -> None:
        self._host, self._place, self._window = host, place, window
        self._ready: Any = None
        self._asked = False  # prepare() waits in the window: asked once, however many next() come first

    def _next_placed(self) -> Any:
        try:
            return self._place(next(self._host))
        except StopIteration:
            return self._END
        except Exception as e:  # noqa: BLE001 - re-raised by the next() that would have returned it
            return e

    def prepare(self) -> None:
        """Places the next batch now (the window calls this after the next dispatch)."""
        self._asked = False
        if self._ready is None:
            self._ready = self._next_placed()

    def __iter__(self) -> _PlacingIterator:
        return self

    def __next__(self) -> DistributedBatch:
        ready, self._ready = self._ready, None
        if ready is None:
            ready = self._next_placed()
        if ready is self._END:
            self._ready = self._END
            raise StopIteration
        if isinstance(ready, Exception):
            raise ready
        if self._window is not None and not self._asked:
            self._asked = True
            self._window.after_dispatch(self.prepare)
        return ready


def _is_arrays(x: Any) -> bool:
    if isinstance(x, (np.ndarray, jax.Array)) or (hasattr(x, "__array__") and not isinstance(x, Iterator)
                                                  and not type(x).__module__.startswith(("tensorflow", "torch.utils"))):
        return not isinstance(x, (str, bytes))
    if isinstance(x, Mapping):
        return len(x) > 0 and all(_is_arrays(v) for v in x.values())
    # A list of tuples or dicts is a list of batches; a list of arrays is one structure (multi-input).
    if isinstance(x, tuple) or isinstance(x, list) and x and not isinstance(x[0], (tuple, list, Mapping)):
        return len(x) > 0 and all(_is_arrays(v) for v in x)
    return False
