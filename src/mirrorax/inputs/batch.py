"""One global batch on the host, and the fixed shape every batch is placed with.

Every batch is placed on the devices with one shape: the global batch rounded up to a multiple of the
device count, so every device holds as many rows. Rows that hold no example (a short last batch, a batch
that does not divide by the device count) are *padding*: copies of a real row whose ``mask`` is 0.

Where the host knows the global batch's real row count (array inputs, iterables of global batches) the
padding sits at the end of the global batch, and the count travels *statically* with the batch
(:class:`RealRows`, part of the compiled signature): the step cuts the batch to its real rows before
anything else (:func:`mirrorax.fit.functions.real_rows_only`), so the model sees exactly the rows Keras would show
it, as Keras's own jit retraces for a short batch. Only per-process pipelines, whose padding sits inside
each process's share and whose global count only the devices know, keep the padding in the step, masked
out of the loss, the gradients, the BatchNorm statistics and the metrics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["Batch", "RealRows", "padded_batch_size", "row_counts", "take_rows", "stack", "UNWEIGHTED"]

PyTree = Any

#: The key of :meth:`Batch.tree` present when the user gave no sample weights.
UNWEIGHTED = "unweighted"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RealRows:
    """The real rows of a placed batch whose padding sits at its end: a pytree with no leaves, so the count
    is part of the compiled signature (one program per count, as ``jax.jit`` retraces per shape).

    Attributes:
      count: the real rows of the global batch; for batches stacked for several steps per dispatch, a
        tuple with each step's count (a full batch: its whole row count).
    """

    count: int | tuple[int | None, ...]


@dataclasses.dataclass
class Batch:
    """One global batch as this process holds it (numpy) or as the devices hold it (jax arrays).

    Attributes:
      x: the inputs (an array or a tuple/list/dict of arrays).
      y: the targets, or ``None`` (predict).
      sample_weight: float32 ``(rows,)``: the user's weights, 1 where none were given.
      mask: float32 ``(rows,)``: 1 for a real example, 0 for padding.
      num_real: real examples in the whole global batch (all processes), when this process knows it
        (it then travels as a replicated scalar and spares the step a cross-device sum of the mask).
      rows: the same count as a Python int (a tuple per step when stacked), when the padding sits at the
        end of the global batch; ``None`` where only the devices know the count (per-process pipelines).
      weighted: the user gave sample weights (or class weights). A model's own ``train_step`` then
        gets ``(x, y, sample_weight)``, otherwise ``(x, y)``, as from Keras's own ``fit``.
    """

    x: PyTree
    y: PyTree
    sample_weight: np.ndarray
    mask: np.ndarray
    num_real: Any = None
    rows: int | tuple[int, ...] | None = None
    weighted: bool = True

    def real_rows(self) -> RealRows | None:
        """The static count the step cuts the batch to (a full batch: its whole row count, a cut that
        moves nothing), ``None`` when the count is unknown to the host (per-process pipelines).
        Meaningful on a placed (global) batch.

        A full batch carries its count too: its mask and real-row count are then constants the step's
        program folds away (no masked sums, no loss-weight scaling to compute), which cut the train
        step's trace and XLA compile by a quarter on the benchmark CNN (time to first step, issue 22)."""
        if self.rows is None:
            return None
        full = self.mask.shape[-1]
        if isinstance(self.rows, tuple):
            return RealRows(tuple(min(int(c), full) for c in self.rows))
        return RealRows(min(int(self.rows), full))

    def tree(self) -> dict[str, PyTree]:
        """The batch as a model adapter takes it: ``x``, ``y``, ``sample_weight``, ``mask`` (and ``num_real``,
        ``rows`` where known)."""
        tree = {"x": self.x, "y": self.y, "sample_weight": self.sample_weight, "mask": self.mask}
        if self.num_real is not None:
            tree["num_real"] = self.num_real
        rows = self.real_rows()
        if rows is not None:
            tree["rows"] = rows
        return self._mark_unweighted(tree)

    def step_tree(self) -> dict[str, PyTree]:
        """The batch as a compiled step takes it: :meth:`tree`, except that a batch that knows its real rows
        leaves out its mask and count, and its sample weights when the user gave none. The step makes them
        as constants (:func:`mirrorax.fit.functions.real_rows_only`); each array a compiled step takes costs host
        time at every call (~4 us an argument on this CPU host)."""
        rows = self.real_rows()
        if rows is None:
            return self.tree()
        tree = {"x": self.x, "y": self.y, "rows": rows}
        if self.weighted:
            tree["sample_weight"] = self.sample_weight
        return self._mark_unweighted(tree)

    def _mark_unweighted(self, tree: dict[str, PyTree]) -> dict[str, PyTree]:
        if not self.weighted:
            # A key without leaves: it changes the tree's structure, so a step traced for weighted
            # batches is traced again for unweighted ones (what a custom train_step is given differs).
            tree[UNWEIGHTED] = ()
        return tree


def padded_batch_size(batch_size: int, mesh: BatchMesh) -> int:
    """``batch_size`` rounded up to a multiple of the device count (the shape every step sees)."""
    n = mesh.num_replicas_in_sync
    return math.ceil(batch_size / n) * n


def row_counts(tree: Any) -> list[tuple[str, int]]:
    """``(name, rows)`` of every array of ``tree`` (``"[0]"``, ``"['a']"``, ...), in order."""
    out = []
    def visit(t: Any, name: str) -> None:
        if t is None:
            return
        if isinstance(t, Mapping):
            for k, v in t.items():
                visit(v, f"{name}[{k!r}]")
        elif isinstance(t, (tuple, list)):
            for i, v in enumerate(t):
                visit(v, f"{name}[{i}]")
        else:
            out.append((name, t.shape[0]))
    visit(tree, "")
    return out


def take_rows(tree: Any, idx: np.ndarray) -> Any:
    """Rows ``idx`` of every array of ``tree``."""
    return jax.tree.map(lambda a: np.take(a, idx, axis=0), tree)


def stack(batches: list[Batch]) -> Batch:
    """Stacks host batches on a new leading axis (for several steps per dispatch)."""
    fields = ("x", "y", "sample_weight", "mask")
    stacked: list[Any] = [None if getattr(batches[0], f) is None
               else jax.tree.map(lambda *a: np.stack(a), *[getattr(b, f) for b in batches]) for f in fields]
    known = all(b.num_real is not None for b in batches)
    rows = tuple(b.rows for b in batches if isinstance(b.rows, int))  # (stacked batches each hold one)
    x, y, w, mask = stacked
    return Batch(x, y, w, mask, np.stack([b.num_real for b in batches]) if known else None,
                 rows if len(rows) == len(batches) else None, all(b.weighted for b in batches))
