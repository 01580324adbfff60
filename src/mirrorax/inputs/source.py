"""The one protocol every input implements: what the trainer, streams and checkpoints ask of a source.

A source turns what a user passed (arrays, an iterable of batches, a per-process pipeline) into this
process's rows of fixed-shape global batches. Everything that differs between kinds of input lives
behind :class:`Source`; the trainer never asks which kind it holds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mirrorax.inputs.batch import Batch
    from mirrorax.inputs.position import InputState
    from mirrorax.inputs.reading import FitReading
    from mirrorax.inputs.streams import Stream
    from mirrorax.mesh import BatchMesh

__all__ = ["InputContext", "Source", "no_targets"]


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a per-process input pipeline needs to know (``tf.distribute.InputContext``'s meaning).

    Which of the two sizes the pipeline function asks for says how its batches are read
    (``strategy.distribute_datasets_from_function``): batched by :meth:`get_per_replica_batch_size`, as
    in TF, each replica takes its own batch, so one global batch is one batch of every replica;
    batched by :meth:`get_per_pipeline_batch_size`, each batch is this process's whole share.

    Attributes:
      num_input_pipelines: how many pipelines feed the job (one per process).
      input_pipeline_id: this pipeline's index, ``0 <= id < num_input_pipelines``.
      num_replicas_in_sync: the global device count.
      asked: the sizes asked for, in order (``"replica"``, ``"pipeline"``).
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1
    asked: list[str] = dataclasses.field(default_factory=list, repr=False, compare=False)

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size of one replica (device) for a global batch of ``global_batch_size``.

        A pipeline batched by it yields one replica's batch at a time, as TF's do: each replica takes
        its own, so the global batch is ``global_batch_size``.

        Raises:
          ValueError: ``global_batch_size`` does not divide by the replica count.

        Example:
          >>> InputContext(2, 0, 8).get_per_replica_batch_size(256)
          32
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide by num_replicas_in_sync="
                f"{self.num_replicas_in_sync}. Use a multiple of {self.num_replicas_in_sync}.")
        self.asked.append("replica")
        return global_batch_size // self.num_replicas_in_sync

    def get_per_pipeline_batch_size(self, global_batch_size: int) -> int:
        """Rows of each global batch that this pipeline produces (``global / num_input_pipelines``): a
        pipeline batched by it yields this process's whole share of a global batch at a time."""
        if global_batch_size % self.num_input_pipelines:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide by num_input_pipelines="
                f"{self.num_input_pipelines}. Use a multiple of {self.num_input_pipelines}.")
        self.asked.append("pipeline")
        return global_batch_size // self.num_input_pipelines

    @property
    def replicas_per_pipeline(self) -> int:
        """The replicas this pipeline feeds (``num_replicas_in_sync / num_input_pipelines``)."""
        return max(1, self.num_replicas_in_sync // self.num_input_pipelines)


class Source(Protocol):
    """A source of global batches (:class:`~mirrorax.inputs.arrays.ArraySource`,
    :class:`~mirrorax.inputs.iterables.IterableSource`).

    Attributes:
      per_process: each process yields only its own rows of a global batch
        (``strategy.distribute_datasets_from_function``), not the whole batch.
    """

    per_process: bool

    @property
    def labels_checked(self) -> bool:
        """Whether every label was checked against its classes on the host (then the step need not look)."""
        ...

    def default_batch_size(self, process_count: int) -> int:
        """The global batch when the user gives none (Keras's 32 for arrays; the first batch's rows for an
        iterable, times ``process_count`` for a per-process pipeline)."""
        ...

    def require_targets(self, what: str) -> None:
        """Refuses a source without targets for ``what`` (``"fit"``, ``"evaluate"``, ``"validation_data"``)."""
        ...

    def check_targets(self, adapter: Any) -> None:
        """Refuses inputs and targets that do not fit the model, before anything is compiled."""
        ...

    def sample(self, batch_size: int, mesh: BatchMesh, *, with_targets: bool = True) -> Batch:
        """One batch of this process's rows, all real (for building a model's variables)."""
        ...

    def stream(self, batch_size: int, mesh: BatchMesh, *, shuffle: Any = False, seed: int = 0,
               with_targets: bool = True, reading: FitReading | None = None) -> Stream:
        """The stream of this source's global batches of ``batch_size``: which batches each epoch takes.

        ``shuffle`` / ``seed``: the order of each pass over arrays (an iterable keeps its own order).
        ``reading``: how ``fit`` reads the data (:class:`mirrorax.FitReading`: where an epoch ends, and an
        order of the passes over arrays drawn when each starts, such as Keras's ``fit``'s); default mirrorax's."""
        ...

    def track_position(self, process_count: int) -> InputState | None:
        """Starts recording the input's own position within an epoch, for checkpoints (the
        :class:`~mirrorax.inputs.position.InputState`), or ``None`` where a resumed epoch needs none
        (arrays are positioned by index) or cannot have one (one-shot iterators, per-process pipelines
        of a multi-process job: they are replayed)."""
        ...


def no_targets(what: str, given: str) -> ValueError:
    """The error for ``what`` (``"fit"``, ``"evaluate"``, ``"train_on_batch"``, ``"validation_data"``) given inputs
    alone."""
    form = {"fit": "fit(x, y)", "evaluate": "evaluate(x, y)", "train_on_batch": "train_on_batch(x, y)"
            }.get(what, "(x_val, y_val)")
    return ValueError(f"{what} needs targets to compute the loss; received {given} (y is None). Pass {form}, "
                      "or an iterable that yields (x, y) or (x, y, sample_weight) batches.")
