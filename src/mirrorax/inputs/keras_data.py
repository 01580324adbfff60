"""Keras's data arguments as the Trainer's batches, read as Keras's data adapters read them.

A Keras model's ``fit`` under a scope (:mod:`mirrorax.keras_fit`) takes what Keras's ``fit`` takes: arrays,
a ``keras.utils.PyDataset``, a generator or any iterable of batches, with ``class_weight``. What Keras reads
before training (the first batch, to build a model; a ``PyDataset``'s epoch hooks) is read here at the same
moments, so the random state and the dataset's hooks are where Keras leaves them
(:mod:`mirrorax.inputs.keras_order` draws the order).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = ["ClassWeighted", "keras_build_read", "as_batches", "num_batches", "row_count"]


class ClassWeighted:
    """Batches ``(x, y[, sample_weight])`` with ``class_weight`` folded into their sample weights."""

    def __init__(self, data: Any, class_weight: Any) -> None:
        self.data, self.class_weight = data, class_weight

    def __iter__(self) -> Any:
        import keras

        from mirrorax.inputs.make import class_weights

        for item in self.data:
            x, y, w = keras.utils.unpack_x_y_sample_weight(item)
            yield x, y, class_weights(np.asarray(y), self.class_weight, w)

    def __len__(self) -> int:
        return len(self.data)


def keras_build_read(model: Any, x: Any, arrays: bool, shuffle: Any, batch_size: int) -> Any:
    """What Keras's ``fit`` reads before training, for the random state and the dataset's hooks to be
    where Keras leaves them: the first batch, to build a model not built yet (its order drawn and
    dropped), then the reset of its iterator (a ``PyDataset``'s ``on_epoch_end``).

    Returns:
      The batch read from a ``PyDataset`` (the trainer's look at the first batch then reads nothing
      more), else ``None``.
    """
    from mirrorax.inputs import keras_order

    builds = keras_order.keras_builds(model)
    if arrays:
        if builds:
            keras_order.build_read(shuffle, row_count(x), batch_size)
        return None
    if not _is_py_dataset(x):
        return None
    first = None
    if builds:
        x.on_epoch_begin()
        n = x.num_batches
        first = x[keras_order.batch_indices(n, bool(shuffle))[0] if n else 0]
    x.on_epoch_end()
    return first


def _is_py_dataset(data: Any) -> bool:
    return hasattr(data, "__getitem__") and hasattr(data, "num_batches") and hasattr(data, "on_epoch_end")


def as_batches(x: Any, shuffle: Any = False, first: Any = None) -> Any:
    """``x`` as an iterable of batches: a one-shot iterator (a generator) stays itself, so the batch the
    trainer peeks at to build the model is still trained on."""
    from collections.abc import Iterator

    return x if isinstance(x, Iterator) else _Batches(x, shuffle, first)


class _Batches:
    """A Keras ``PyDataset`` (or any other iterable of batches) as one iteration per epoch, as Keras's
    data adapter reads it: the dataset's ``on_epoch_begin``, its batches (in the order of
    ``random.shuffle`` when ``shuffle`` and it has a length), its ``on_epoch_end``.

    The first iteration is the trainer's look at the first batch (for shapes), which reads ``first``
    (the batch Keras's fit read, see :func:`keras_build_read`) or else batch 0, and nothing else.
    """

    def __init__(self, data: Any, shuffle: Any = False, first: Any = None) -> None:
        self.data, self.shuffle, self.first = data, bool(shuffle), first
        self._looked = False

    def __iter__(self) -> Any:
        data = self.data
        if not _is_py_dataset(data):
            yield from data
            return
        if not self._looked:
            self._looked = True
            yield data[0] if self.first is None else self.first
            return
        from mirrorax.inputs.keras_order import batch_indices

        n = data.num_batches
        data.on_epoch_begin()
        # Drawn here, when the pass's first batch is read: where Keras draws it.
        indices = itertools.count() if n is None else batch_indices(n, self.shuffle)
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


def num_batches(x: Any, batch_size: int | None) -> int | None:
    from mirrorax.inputs.make import is_array_tree

    if is_array_tree(x):
        import jax

        rows = int(np.shape(jax.tree.leaves(x)[0])[0])
        return -(-rows // (batch_size or 32))
    try:
        return len(x)
    except TypeError:
        return None


def row_count(x: Any) -> int:
    """The rows of a batch ``x`` (its first leaf's leading dimension, at least 1)."""
    import jax

    leaves = jax.tree.leaves(x)
    if not leaves:
        raise ValueError(f"predict_on_batch needs an array (or a structure of arrays); received {type(x).__name__}.")
    return max(1, int(np.shape(leaves[0])[0]))
