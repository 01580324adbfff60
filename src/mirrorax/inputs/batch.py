"""One global batch on the host, and the fixed shape every batch has.

Every batch that reaches a jitted step has the same shape: the global batch rounded up to a multiple of
the device count. Rows that hold no example (a short last batch, a batch that does not divide by the
device count) are *padding*: copies of a real row whose ``mask`` is 0, so they never enter the loss, the
gradients, the BatchNorm statistics or the metrics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from mirrorax.strategy import MirroredStrategy

__all__ = ["Batch", "padded_batch_size", "row_counts", "take_rows", "stack", "UNWEIGHTED"]

PyTree = Any

#: The key of :meth:`Batch.tree` present when the user gave no sample weights.
UNWEIGHTED = "unweighted"


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
      weighted: the user gave sample weights (or class weights). A model's own ``train_step`` then
        gets ``(x, y, sample_weight)``, otherwise ``(x, y)``, as from Keras's own ``fit``.
    """

    x: PyTree
    y: PyTree
    sample_weight: np.ndarray
    mask: np.ndarray
    num_real: Any = None
    weighted: bool = True

    def tree(self) -> dict[str, PyTree]:
        tree = {"x": self.x, "y": self.y, "sample_weight": self.sample_weight, "mask": self.mask}
        if self.num_real is not None:
            tree["num_real"] = self.num_real
        if not self.weighted:
            # A key without leaves: it changes the tree's structure, so a step traced for weighted
            # batches is traced again for unweighted ones (what a custom train_step is given differs).
            tree[UNWEIGHTED] = ()
        return tree


def padded_batch_size(batch_size: int, strategy: MirroredStrategy) -> int:
    """``batch_size`` rounded up to a multiple of the device count (the shape every step sees)."""
    n = strategy.num_replicas_in_sync
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
    x, y, w, mask = stacked
    return Batch(x, y, w, mask, np.stack([b.num_real for b in batches]) if known else None,
                 all(b.weighted for b in batches))
