"""Keras's data arguments as the Trainer's batches, read as Keras's data adapters read them.

A Keras model's ``fit`` under a scope (:mod:`mirrorax.keras.fit`) takes what Keras's ``fit`` takes: arrays,
a ``keras.utils.PyDataset``, a generator or any iterable of batches, with ``class_weight``. What Keras reads
before training (the first batch, to build a model; a ``PyDataset``'s epoch hooks) is read here at the same
moments, so the random state and the dataset's hooks are where Keras leaves them
(:mod:`mirrorax.keras.order` draws the order).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = ["ClassWeighted", "BuildRead", "keras_build_read", "build_read", "as_batches", "num_batches"]


class ClassWeighted:
    """Batches ``(x, y[, sample_weight])`` with ``class_weight`` folded into their sample weights."""

    def __init__(self, data: Any, class_weight: Any) -> None:
        self.data, self.class_weight = data, class_weight
        look = getattr(data, "first_batch", None)
        if callable(look):  # the data shows its first batch without a pass (see _Batches): so do these
            self.first_batch = lambda: self._weighted(look())

    def __iter__(self) -> Any:
        for item in self.data:
            yield self._weighted(item)

    def _weighted(self, item: Any) -> Any:
        import keras

        from mirrorax.inputs.make import class_weights

        x, y, w = keras.utils.unpack_x_y_sample_weight(item)
        return x, y, class_weights(np.asarray(y), self.class_weight, w)

    def __len__(self) -> int:
        return len(self.data)


class BuildRead:
    """The batch Keras reads to build a model before its first pass (``Trainer._symbolic_build`` in ``fit``
    and ``evaluate``, ``predict``'s read for unbuilt layers), and the iterator it came from.

    Keras reads it from an iterator of its own and drops that iterator when its epoch iterator resets,
    before the first pass makes a new one. The trainer's look at the first batch is this batch (no other
    read), and the iterator is held until the first pass begins (:class:`_Batches`), so the input sees the
    iterators Keras makes, in Keras's order: a reshuffling ``shuffle`` gives Keras's passes, and what a
    ``.cache()`` keeps of the dropped iterator's reading is what it keeps in Keras.

    Attributes:
      batch: the batch read. iterator: the iterator it came from (``None`` for a ``PyDataset``, read by
        index).
    """

    def __init__(self, batch: Any, iterator: Any = None) -> None:
        self.batch, self.iterator = batch, iterator


def keras_build_read(model: Any, x: Any, shuffle: Any, batch_size: int, rows: int | None) -> BuildRead | None:
    """What Keras's ``fit`` reads before training, for the random state and the dataset's hooks and
    iterators to be where Keras leaves them: the first batch, to build a model not built yet (its order
    drawn and dropped), then the reset of its iterator (a ``PyDataset``'s ``on_epoch_end``). ``rows``: the
    examples of ``x`` when it holds arrays (its source's count: ``x`` itself is not looked at then), else ``None``.

    Returns:
      The batch read (the trainer's look at the first batch then reads nothing more), or ``None``: none
      read (arrays, a built model, a generator).
    """
    from mirrorax.keras import order as keras_order

    builds = keras_order.keras_builds(model)
    if rows is not None:
        if builds:
            keras_order.build_read(shuffle, rows, batch_size)
        return None
    if not _is_py_dataset(x):
        return build_read(x) if builds else None
    first = None
    if builds:
        x.on_epoch_begin()
        n = x.num_batches
        first = BuildRead(x[keras_order.batch_indices(n, bool(shuffle))[0] if n else 0])
    x.on_epoch_end()
    return first


def build_read(x: Any) -> BuildRead | None:
    """Keras's read of a batch to build a model, from an iterator of its own, for an input Keras reads
    that way: a tf.data pipeline, a torch ``DataLoader``, a grain loader (``None`` for anything else: a
    generator keeps its first item for the pass, as Keras keeps it; a ``PyDataset`` is read by index in
    :func:`keras_build_read`; an empty input is refused where it is first read)."""
    if not (_is_tf_dataset(x) or _is_keras_loader(x)):
        return None
    it = iter(x)
    try:
        return BuildRead(next(it), it)
    except StopIteration:
        return None


def _is_tf_dataset(x: Any) -> bool:
    """Keras's ``is_tf_dataset``: a ``tf.data.Dataset`` (or TF's distributed datasets)."""
    return any(c.__name__ in ("DatasetV2", "DistributedDataset", "DistributedDatasetsFromFunction")
               and "tensorflow.python." in c.__module__ for c in type(x).__mro__)


def _is_keras_loader(x: Any) -> bool:
    """A torch ``DataLoader`` or a grain dataset or loader: what Keras's data adapters iterate besides
    tf.data, ``PyDataset``s and generators."""
    return any(c.__name__ == "DataLoader" and "torch.utils.data" in c.__module__
               or c.__name__ in ("MapDataset", "IterDataset", "DataLoader") and "grain" in c.__module__
               for c in type(x).__mro__)


def _is_py_dataset(data: Any) -> bool:
    return hasattr(data, "__getitem__") and hasattr(data, "num_batches") and hasattr(data, "on_epoch_end")


def as_batches(x: Any, shuffle: Any = False, build: BuildRead | None = None) -> Any:
    """``x`` as an iterable of batches: a one-shot iterator (a generator) stays itself, so the batch the
    trainer peeks at to build the model is still trained on. ``build``: the batch Keras read to build the
    model (:func:`keras_build_read`), the trainer's look at the first batch."""
    from collections.abc import Iterator

    return x if isinstance(x, Iterator) else _Batches(x, shuffle, build)


class _Batches:
    """A Keras ``PyDataset`` (or any other iterable of batches) as one iteration per epoch, as Keras's
    data adapter reads it: the dataset's ``on_epoch_begin``, its batches (in the order of
    ``random.shuffle`` when ``shuffle`` and it has a length), its ``on_epoch_end``.

    The trainer's look at the first batch (for shapes) is :meth:`first_batch` where there is one without
    a pass: the batch Keras read to build the model (``build``), or a ``PyDataset``'s batch 0, by index.
    Otherwise the look is the first batch of the first pass (``IterableSource.peek``). The iterator Keras
    read its batch from is dropped when the first pass begins, as Keras drops it.
    """

    def __init__(self, data: Any, shuffle: Any = False, build: BuildRead | None = None) -> None:
        self.data, self.shuffle = data, bool(shuffle)
        self._held = None
        if build is not None:  # held here alone: dropped when the first pass begins
            self._held, build.iterator = build.iterator, None
        if build is not None:
            batch = build.batch
            self.first_batch = lambda: batch
        elif _is_py_dataset(data):
            self.first_batch = lambda: data[0]

    def __iter__(self) -> Any:
        self._held = None  # Keras's build iterator: dropped before the pass makes its own
        data = self.data
        if not _is_py_dataset(data):
            yield from data
            return
        from mirrorax.keras.order import batch_indices

        n = data.num_batches
        data.on_epoch_begin()
        # Drawn here, when the pass's first batch is read: where Keras draws it.
        indices = itertools.count() if n is None else batch_indices(n, self.shuffle)
        workers = int(getattr(data, "workers", 1) or 0)
        processes = bool(getattr(data, "use_multiprocessing", False))
        if workers > 1 or (workers > 0 and processes):  # as Keras's adapter decides to read ahead
            yield from _read_ahead(data, indices, workers, processes, int(getattr(data, "max_queue_size", 10) or 10))
        else:
            for index in indices:
                try:
                    item = data[index]
                except IndexError:
                    break
                yield item
        data.on_epoch_end()

    def __len__(self) -> int:
        n = getattr(self.data, "num_batches", None)
        if n is not None:
            return int(n)
        return len(self.data)


def _read_ahead(data: Any, indices: Any, workers: int, processes: bool, ahead: int) -> Any:
    """``data[i]`` for each of ``indices``, in their order, read by a pool of ``workers`` threads (processes with
    ``processes``: a ``PyDataset``'s ``use_multiprocessing``) up to ``ahead`` batches before they are taken, as
    Keras's ``OrderedEnqueuer`` reads them; an ``IndexError`` ends the pass (an endless dataset's end)."""
    import collections
    import multiprocessing
    import multiprocessing.dummy

    if processes:  # each worker holds the dataset (inherited, or sent once), as Keras's pool initializer does
        pool: Any = multiprocessing.Pool(workers, initializer=_hold, initargs=(data,))
        read: Any = _held_item
    else:
        pool, read = multiprocessing.dummy.Pool(workers), data.__getitem__
    it = iter(indices)
    try:
        pending = collections.deque(pool.apply_async(read, (i,)) for i in itertools.islice(it, max(ahead, 1)))
        while pending:
            try:
                item = pending.popleft().get()
            except IndexError:
                break
            following = next(it, None)
            if following is not None:
                pending.append(pool.apply_async(read, (following,)))
            yield item
    finally:
        # Closed, not terminated: the reads still pending (at most ``ahead``) finish and the workers leave by
        # themselves. A terminate signals them, and one that has not yet run its initializer still has fit's
        # SIGTERM handler: it would not leave, and the join would wait for ever.
        pool.close()
        pool.join()


_HELD: Any = None


def _hold(data: Any) -> None:
    """A reading process's dataset (its pool's initializer). SIGTERM ends it again: a forked process inherits
    fit's SIGTERM handler (a preemption watch), which would keep the pool's ``terminate`` waiting on it."""
    import signal

    global _HELD
    _HELD = data
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _held_item(index: int) -> Any:
    return _HELD[index]


def num_batches(x: Any, batch_size: int, rows: int | None) -> int | None:
    """The batches of a pass over ``x`` (``None``: unknown); ``rows``: the examples of ``x`` when it holds arrays
    (its source's count), else ``None`` (then ``x``'s length, if it has one)."""
    if rows is not None:
        return -(-rows // batch_size)
    try:
        return len(x)
    except TypeError:
        return None
