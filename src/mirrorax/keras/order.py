"""Keras's own shuffle order, for a Keras model's ``fit`` under a scope: the rows Keras would train on.

Keras's ``fit`` on JAX draws its order from the program's global random state when a pass over the data
starts (``keras.utils.set_random_seed`` seeds it): arrays from numpy
(``np.random.permutation(num_samples)``, or with ``shuffle="batch"`` one
``np.random.permutation(rows)`` per batch, ``ArrayDataAdapter``), a ``keras.utils.PyDataset`` from
Python's ``random`` (``random.shuffle`` of its batch indices, ``PyDatasetAdapter``). Drawing the same
numbers at the same moments gives Keras's order on any device count, and leaves the global state where
Keras leaves it, so whatever else the program draws (a callback) stays in step.

Every process of a multi-process job runs the same program, so a seeded one draws the same order on each;
the order is still taken from process 0 (one small broadcast per pass), so an unseeded job trains on one
order too: process 0's.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from mirrorax.cluster.consistency import broadcast_from_primary
from mirrorax.inputs.reading import FitReading
from mirrorax.keras import _internals as internals

__all__ = ["KERAS_ORDER", "KERAS_FIT", "KerasOrder", "pass_order", "build_read", "batch_indices", "keras_builds",
           "random_state", "set_random_state"]


def pass_order(shuffle: Any, num_examples: int, batch_size: int) -> np.ndarray | None:
    """The example order of a pass that starts now, drawn as Keras's ``ArrayDataAdapter`` draws it.

    Args:
      shuffle: Keras's ``shuffle``: falsy (in order), ``"batch"`` (rows permuted within each batch) or
        truthy (one permutation of every example).
      num_examples: the examples of a pass. batch_size: the global batch.

    Returns:
      The order (process 0's on every process), or ``None`` for the rows in order.
    """
    if not shuffle:
        return None
    if shuffle == "batch":
        # Keras draws one permutation per batch as it reads it; drawn together here (a pass's batches
        # are read ahead), the same numbers in the same sequence.
        order = np.concatenate([np.random.permutation(min(batch_size, num_examples - start)) + start
                                for start in range(0, num_examples, batch_size)])
    else:
        order = np.random.permutation(num_examples)
    return np.asarray(broadcast_from_primary(order))


def build_read(shuffle: Any, num_examples: int, batch_size: int) -> None:
    """The draw of the batch Keras's ``fit`` reads to build an unbuilt model (``Trainer._symbolic_build``
    reads the first batch of a pass it then drops): the same numbers, taken from the global state and
    dropped."""
    if shuffle == "batch":
        np.random.permutation(min(batch_size, num_examples))
    elif shuffle:
        np.random.permutation(num_examples)


def batch_indices(num_batches: int, shuffle: bool) -> list[int]:
    """A ``PyDataset``'s batch indices for a pass that starts now, as Keras's ``PyDatasetAdapter`` orders
    them (``random.shuffle`` on Python's global state; process 0's on every process)."""
    indices = list(range(num_batches))
    if not shuffle:
        return indices
    random.shuffle(indices)
    return [int(i) for i in broadcast_from_primary(np.asarray(indices, np.int64))]


def keras_builds(model: Any, *, predict: bool = False) -> bool:
    """Whether Keras's ``fit`` (or ``evaluate``) would read a batch to build ``model`` first: its layers,
    compiled metrics or compiled loss are not built yet (``Trainer._symbolic_build``'s test). A fit after
    the first (Keras's or mirrorax's: both build them) reads none. ``predict``: Keras's ``predict``
    reads one only for unbuilt layers."""
    layers = all(layer.built for layer in internals.flatten_layers(model))
    if predict:
        return not layers
    metrics = internals.compile_metrics(model)
    loss = internals.compile_loss(model)
    return not layers or (metrics is not None and not metrics.built) or (loss is not None and not loss.built)


def random_state() -> dict[str, Any]:
    """numpy's and Python's global generators' states, as JSON: what Keras draws its orders from. A restarted
    fit sets them back (:func:`set_random_state`) to draw the order the interrupted fit drew."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss)],
            "python": [version, list(internal), gauss_next]}


def set_random_state(saved: dict[str, Any]) -> None:
    """Sets numpy's and Python's global generators to a :func:`random_state`."""
    kind, keys, pos, has_gauss, gauss = saved["numpy"]
    np.random.set_state((kind, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = saved["python"]
    random.setstate((version, tuple(internal), gauss_next))


class KerasOrder:
    """Keras's ``fit``'s order of a pass over arrays (a :class:`mirrorax.inputs.reading.PassOrder`): drawn from
    numpy's global state when the pass starts (:func:`pass_order`), its state the global generators'."""

    def draw(self, shuffle: Any, num_examples: int, batch_size: int) -> np.ndarray | None:
        return pass_order(shuffle, num_examples, batch_size)

    def state(self) -> dict[str, Any]:
        return random_state()

    def restore(self, state: dict[str, Any]) -> None:
        set_random_state(state)


KERAS_ORDER = KerasOrder()
#: How a Keras model's own ``fit`` under a scope reads its data: ``steps_per_epoch`` an upper bound (an epoch
#: ends where the data does, with Keras's warning), each pass in Keras's order.
KERAS_FIT = FitReading(ends_with_data=True, order=KERAS_ORDER)
