"""Array inputs: examples held in memory by every process, cut into global batches by index.

The data position is ``(pass, batch)``: pass ``k`` visits every example once, in the order of
``permutation(seed, k)``, which depends on neither the device nor the process count. Each process takes
only its own rows of every global batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrorax.inputs.batch import Batch, padded_batch_size, row_counts
from mirrorax.inputs.checks import FiniteScan, check_labels, check_weights, leaves, tree_numeric
from mirrorax.inputs.placement import shared_constant, shared_count
from mirrorax.inputs.reading import FitReading
from mirrorax.inputs.source import no_targets
from mirrorax.inputs.streams import Stream

if TYPE_CHECKING:
    from mirrorax.inputs.position import InputState
    from mirrorax.mesh import BatchMesh

__all__ = ["ArraySource", "ArrayStream"]

PyTree = Any


class ArraySource:
    """Examples held in memory by every process: numpy arrays or tuples/dicts of them.

    Args:
      x: inputs; y: targets (or ``None``); sample_weight: ``(n,)`` weights (or ``None``).
      float_dtype: the model's float type: float32/float64 arrays become it.
      check_finite: refuse NaN/inf in ``x``, ``y`` and ``sample_weight`` (fit and evaluate with
        ``on_nonfinite="raise"``; not predict). Negative and misshapen weights are refused regardless.
      scan_in_background: scan large ``x`` and ``y`` for NaN/inf on a thread
        (:class:`~mirrorax.inputs.checks.FiniteScan`): the caller joins it with :meth:`wait_checked`
        before anything changes (``fit`` does, before its callbacks start); :meth:`batches` joins it
        too, so no batch of unchecked data is ever read. :meth:`sample` does not wait (the first rows,
        for shapes: the state is built and the step compiled while the scan runs).

    Raises:
      ValueError: empty input, x, y and sample_weight of different lengths, NaN/inf, a sample_weight
        that is not one non-negative number per example.
      TypeError: non-numeric arrays.
    """

    per_process = False  # every process holds every example and takes its own rows of each batch

    def __init__(self, x: PyTree, y: PyTree = None, sample_weight: Any = None, *, float_dtype: Any = np.float32,
                 check_finite: bool = True, scan_in_background: bool = False) -> None:
        if x is None:
            raise ValueError(f"Expected x: an array, or a tuple/dict of arrays. Received: x={x!r}. Pass the "
                             "inputs as x (and the targets as y).")
        float_dtype = np.dtype(float_dtype)
        self.x = tree_numeric(x, "x", float_dtype)
        self.y = tree_numeric(y, "y", float_dtype)
        self.w = None if sample_weight is None else check_weights(sample_weight, float_dtype)
        lengths = [("x" + n, rows) for n, rows in row_counts(self.x)] + \
            [("y" + n, rows) for n, rows in row_counts(self.y)]
        if self.w is not None:
            lengths.append(("sample_weight", self.w.shape[0]))
        sizes = {rows for _, rows in lengths}
        if len(sizes) > 1:
            desc = ", ".join(f"{n}: {rows}" for n, rows in lengths)
            raise ValueError(f"x, y and sample_weight must have the same number of examples; received {desc}. "
                             "Pass arrays with one row per example.")
        self.num_examples = sizes.pop()
        if self.num_examples == 0:
            raise ValueError(f"The input is empty: received 0 examples "
                             f"({', '.join(f'{n}: {rows} rows' for n, rows in lengths)}). Pass at least one example.")
        self._scan = FiniteScan(leaves(self.x, "x") + leaves(self.y, "y"),
                                background=scan_in_background) if check_finite else None
        self._targets_checked = False

    @classmethod
    def of_rows(cls, tree: PyTree, num_examples: int) -> ArraySource:
        """A source of ``tree`` as inputs alone, taken as given: its arrays already numeric, checked and
        ``num_examples`` rows long (:class:`~mirrorax.inputs.distributed.DistributedDataset`'s data, any
        pytree, which it checks under JAX's rules rather than Keras's)."""
        self = cls.__new__(cls)
        self.x, self.y, self.w, self.num_examples = tree, None, None, num_examples
        self._targets_checked = False
        self._scan = None
        return self

    def wait_checked(self) -> None:
        """Waits for the NaN/inf scan of ``x`` and ``y`` (a thread's, with ``scan_in_background``) and
        raises what it found: the error the constructor raises without the thread."""
        if self._scan is not None:
            self._scan.wait()

    @property
    def labels_checked(self) -> bool:
        """Whether every label was checked against its classes here (then the step need not look)."""
        return self._targets_checked

    def check_targets(self, adapter: Any) -> None:
        """Refuses inputs and targets that do not fit the model (input shapes; target shapes under the
        loss; labels outside the classes), once per source, before anything is compiled."""
        if self._targets_checked:
            return
        try:
            adapter.check_inputs(self.x)
            if self.y is not None:
                check_labels(adapter.sparse_targets(self.y, check_shapes=True))
        except (ValueError, TypeError):
            self.wait_checked()  # a NaN is the first error, as when the scan ran in the constructor
            raise
        self._targets_checked = True

    def default_batch_size(self, process_count: int) -> int:
        """Keras's default global batch for arrays: 32."""
        return 32

    def require_targets(self, what: str) -> None:
        """Refuses arrays without ``y`` for ``what`` (``"fit"``, ``"evaluate"``, ``"validation_data"``)."""
        if self.y is not None:
            return
        given = "x alone"
        if isinstance(self.x, (list, tuple)) and all(isinstance(v, (list, tuple)) for v in self.x):
            given += (" (a list of (x, y) tuples reads as a list of input arrays, as in Keras: pass batches as "
                      "an iterator or generator, e.g. iter(batches))")
        raise no_targets(what, given)

    def sample(self, batch_size: int, mesh: BatchMesh, *, with_targets: bool = True) -> Batch:
        """This process's rows of the first batch of an unshuffled pass (for shapes and dtypes: read
        while a background scan may still be running)."""
        return next(self._batches(batch_size, mesh, shuffle=False, seed=0, pass_index=0,
                                  with_targets=with_targets))

    def stream(self, batch_size: int, mesh: BatchMesh, *, shuffle: Any = False, seed: int = 0,
               with_targets: bool = True, reading: FitReading | None = None) -> ArrayStream:
        """One endless stream of passes, pass ``k`` in the order of ``(seed, k)`` when ``shuffle``; with
        ``reading.order``, in the order it draws when the pass starts (Keras's ``fit``'s: ``shuffle`` as
        Keras's, also ``"batch"``)."""
        return ArrayStream(self, batch_size, mesh, shuffle, seed, with_targets=with_targets, reading=reading)

    def track_position(self, process_count: int) -> InputState | None:
        """``None``: a batch of arrays is found by its index (the pass's order is a function of the seed)."""
        return None

    def batches_per_pass(self, batch_size: int) -> int:
        return math.ceil(self.num_examples / batch_size)

    def order(self, shuffle: bool | str, seed: int, pass_index: int, batch_size: int = 1) -> np.ndarray:
        """The example order of pass ``pass_index``: the same on every process and device count
        (``shuffle="batch"``: each batch's rows permuted among themselves, as Keras's)."""
        if not shuffle:
            return np.arange(self.num_examples)
        rng = np.random.default_rng([int(seed), int(pass_index)])
        if shuffle == "batch":
            n = self.num_examples
            return np.concatenate([rng.permutation(min(batch_size, n - start)) + start
                                   for start in range(0, n, batch_size)])
        return rng.permutation(self.num_examples)

    def batches(self, batch_size: int, mesh: BatchMesh, *, shuffle: bool | str, seed: int,
                pass_index: int, start: int = 0, with_targets: bool = True,
                order: np.ndarray | None = None) -> Iterator[Batch]:
        """This process's rows of each global batch of pass ``pass_index``, from batch ``start`` on
        (``order``: the pass's order, drawn elsewhere, instead of ``(seed, pass_index)``'s). Waits for the
        NaN/inf scan first (:meth:`wait_checked`)."""
        self.wait_checked()
        yield from self._batches(batch_size, mesh, shuffle=shuffle, seed=seed, pass_index=pass_index,
                                 start=start, with_targets=with_targets, order=order)

    def full_leaf_batches(self, batch_size: int, *, shuffle: bool | str, seed: int,
                          pass_index: int) -> Iterator[list[np.ndarray]]:
        """The leaves of ``x`` (``jax.tree.leaves``' order) cut to each full batch of pass ``pass_index`` on one
        process of one device, the rows :meth:`batches` gives them (views when unshuffled), and nothing else: no
        weights, no mask, no :class:`Batch`. What a loop of small steps on one device pays per batch is the cut
        alone (a batch short of ``batch_size``, the pass's last, is :meth:`batches`' from its index on)."""
        self.wait_checked()
        leaves = jax.tree.leaves(self.x)
        full = self.num_examples // batch_size
        if not shuffle:
            for first in range(0, full * batch_size, batch_size):
                yield [a[first:first + batch_size] for a in leaves]
            return
        order = self.order(shuffle, seed, pass_index, batch_size)
        for first in range(0, full * batch_size, batch_size):
            idx = order[first:first + batch_size]
            yield [np.take(a, idx, axis=0) for a in leaves]

    def _batches(self, batch_size: int, mesh: BatchMesh, *, shuffle: bool | str, seed: int,
                 pass_index: int, start: int = 0, with_targets: bool = True,
                 order: np.ndarray | None = None) -> Iterator[Batch]:
        if order is None:
            order = self.order(shuffle, seed, pass_index, batch_size)
        else:
            shuffle = True  # rows are taken through the order
        padded = padded_batch_size(batch_size, mesh)
        local = padded // mesh.process_count
        lo = mesh.process_index * local
        ones = shared_constant(np.ones(local, np.float32))
        for b in range(start, self.batches_per_pass(batch_size)):
            first = b * batch_size
            real = order[first:first + batch_size]
            if lo + local <= len(real):  # every row of this process's share is a real example
                # Unshuffled rows are contiguous: views, not copies.
                idx = slice(first + lo, first + lo + local) if not shuffle else real[lo:lo + local]
                yield self._batch(idx, None, with_targets, len(real), ones)
                continue
            slot = np.arange(lo, lo + local)
            valid = slot < len(real)
            idx = np.where(valid, real[np.minimum(slot, len(real) - 1)], real[0])
            yield self._batch(idx, valid, with_targets, len(real), ones)

    def _batch(self, idx: np.ndarray | slice, valid: np.ndarray | None, with_targets: bool, num_real: int,
               ones: np.ndarray) -> Batch:
        """Rows ``idx``; ``valid`` marks the real ones (``None``: all real)."""
        pick = (lambda a: a[idx]) if isinstance(idx, slice) else (lambda a: np.take(a, idx, axis=0))

        def cut(tree: Any) -> Any:  # (a lone array, the common case, without the tree walk: once per batch)
            return pick(tree) if type(tree) is np.ndarray else jax.tree.map(pick, tree)

        if self.w is None:
            w = ones if valid is None else np.ones(len(valid), np.float32)
        else:
            w = pick(self.w)
        mask = ones if valid is None else valid.astype(np.float32)
        return Batch(cut(self.x), cut(self.y) if with_targets else None, w, mask, shared_count(num_real), num_real,
                     weighted=self.w is not None)


class ArrayStream(Stream):
    """Global batches from an :class:`ArraySource` as one endless stream of passes."""

    batches_per_pass: int

    def __init__(self, source: ArraySource, batch_size: int, mesh: BatchMesh,
                 shuffle: Any, seed: int, with_targets: bool = True, reading: FitReading | None = None) -> None:
        self.source, self.batch_size, self.mesh = source, batch_size, mesh
        self.shuffle, self.seed, self.with_targets = shuffle, seed, with_targets
        reading = reading or FitReading()
        super().__init__(reading.ends_with_data)
        self.batches_per_pass = source.batches_per_pass(batch_size)
        self.order = reading.order  # None: (seed, pass)'s order
        self._drawn: dict[int, np.ndarray | None] = {}  # the drawn order of the pass being read
        self._drawn_from: dict[int, dict[str, Any]] = {}  # the order's state before that draw

    def _order(self, pass_index: int) -> np.ndarray | None:
        """The order of pass ``pass_index``: ``None`` for ``(seed, pass)``'s; the reading's own (Keras's), drawn
        the first time the pass is read (when Keras draws it) and kept while it is read."""
        if self.order is None:
            return None
        if pass_index not in self._drawn:
            self._drawn_from = {pass_index: self.order.state()} if self.shuffle else {}
            self._drawn = {pass_index: self.order.draw(self.shuffle, self.source.num_examples, self.batch_size)}
        return self._drawn[pass_index]

    def order_state(self, position: int) -> dict[str, Any] | None:
        """With a reading's own order (Keras's), the state from which the pass holding stream ``position``
        is drawn (before its draw if it was drawn, else now): set back, a restarted fit draws that pass's order
        as the interrupted one did. ``None`` for mirrorax's order, a function of ``(seed, pass)``."""
        if self.order is None or not self.shuffle:
            return None
        return self._drawn_from.get(position // self.batches_per_pass) or self.order.state()

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        """Batches ``start..count`` (default: to the end of the pass) of the epoch at stream ``position``."""
        n = self.source.num_examples
        end = position + count if count else (position // self.batches_per_pass + 1) * self.batches_per_pass
        position += start
        while position < end:
            pass_index, start = divmod(position, self.batches_per_pass)
            for b in self.source.batches(self.batch_size, self.mesh, shuffle=self.shuffle, seed=self.seed,
                                         pass_index=pass_index, start=start, with_targets=self.with_targets,
                                         order=self._order(pass_index)):
                self._reals.append(min(self.batch_size, n - (position % self.batches_per_pass) * self.batch_size))
                yield b
                position += 1
                if position >= end:
                    return
