"""``MirroredStrategy``: the devices a job trains on, and how values are laid out on them.

A strategy is a one-axis :class:`jax.sharding.Mesh` (axis ``"batch"``) over every device of the job.
Variables are replicated (``NamedSharding(mesh, P())``); every global batch is split over the batch axis
(``NamedSharding(mesh, P("batch"))``). The train step is written once for the global batch and jitted
with these shardings, so XLA inserts the cross-device reduction of gradients and metrics itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mirrorax import cluster

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy", "InputContext", "get_strategy", "has_strategy"]

BATCH_AXIS = "batch"

_scope = threading.local()


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a per-process input pipeline needs to know (``tf.distribute.InputContext``'s meaning).

    Attributes:
      num_input_pipelines: how many pipelines feed the job (one per process).
      input_pipeline_id: this pipeline's index, ``0 <= id < num_input_pipelines``.
      num_replicas_in_sync: the global device count.
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size of one replica (device) for a global batch of ``global_batch_size``.

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
        return global_batch_size // self.num_replicas_in_sync

    def get_per_pipeline_batch_size(self, global_batch_size: int) -> int:
        """Rows of each global batch that this pipeline produces (``global / num_input_pipelines``)."""
        if global_batch_size % self.num_input_pipelines:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide by num_input_pipelines="
                f"{self.num_input_pipelines}. Use a multiple of {self.num_input_pipelines}.")
        return global_batch_size // self.num_input_pipelines


class MirroredStrategy:
    """Synchronous data parallelism over every device of the job.

    Creating one joins a multi-process job first when the environment describes one
    (``MIRRORAX_COORDINATOR``/``MIRRORAX_NUM_PROCESSES``/``MIRRORAX_PROCESS_ID``, ``TF_CONFIG``, or what
    ``jax.distributed`` detects: SLURM, Open MPI, Kubernetes).

    Args:
      devices: the devices to use; ``None`` means every device of the job (``jax.devices()``). Devices
        may be given as ``jax.Device`` objects or as integer ids.

    Raises:
      ValueError: ``devices`` is empty, has duplicates, or mixes platforms.

    Example:
      >>> strategy = MirroredStrategy()
      >>> strategy.num_replicas_in_sync == len(jax.devices())
      True
    """

    def __init__(self, devices: Sequence[jax.Device | int] | None = None) -> None:
        cluster.maybe_initialize_from_env()
        self._devices = _validate_devices(devices)
        self._mesh = jax.make_mesh((len(self._devices),), (BATCH_AXIS,),
                                   axis_types=(jax.sharding.AxisType.Auto,), devices=self._devices)
        self._replicated = NamedSharding(self._mesh, P())
        self._batch_sharding = NamedSharding(self._mesh, P(BATCH_AXIS))
        local = [d for d in self._devices if d.process_index == jax.process_index()]
        self._local_devices = tuple(local)
        counts = {}
        for d in self._devices:
            counts[d.process_index] = counts.get(d.process_index, 0) + 1
        if len(set(counts.values())) > 1:
            raise ValueError(f"Every process must contribute the same number of devices; received "
                             f"{dict(sorted(counts.items()))} (process -> devices). Pass devices=None or an "
                             "equal share per process.")
        self._processes = tuple(sorted(counts))

    # -- what users read -------------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        """The one-axis ``jax.sharding.Mesh`` (axis ``"batch"``) this strategy trains on."""
        return self._mesh

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Every device of the strategy, in mesh order."""
        return self._devices

    @property
    def local_devices(self) -> tuple[jax.Device, ...]:
        """This process's devices of the strategy."""
        return self._local_devices

    @property
    def num_replicas_in_sync(self) -> int:
        """The global device count: how many slices each global batch is split into."""
        return len(self._devices)

    @property
    def process_index(self) -> int:
        """This process's position among the strategy's processes (0 speaks: progress, files)."""
        return self._processes.index(jax.process_index())

    @property
    def process_count(self) -> int:
        """How many processes feed the strategy."""
        return len(self._processes)

    @property
    def is_primary(self) -> bool:
        """True on the process that prints and writes files (process 0)."""
        return self.process_index == 0

    @property
    def replicated(self) -> NamedSharding:
        """``NamedSharding(mesh, P())``: the layout of variables and optimizer state."""
        return self._replicated

    @property
    def batch_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P("batch"))``: the layout of every global batch (split on axis 0)."""
        return self._batch_sharding

    def scope(self) -> contextlib.AbstractContextManager[MirroredStrategy]:
        """Makes this the strategy that :func:`get_strategy` and ``Trainer(model)`` use.

        Models may be built inside or outside the scope: the trainer places their values itself.

        Example:
          >>> with MirroredStrategy().scope() as s:
          ...     assert get_strategy() is s
        """
        return _enter(self)

    def input_context(self) -> InputContext:
        """This process's :class:`InputContext`."""
        return InputContext(self.process_count, self.process_index, self.num_replicas_in_sync)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any]) -> Any:
        """Builds this process's input pipeline: ``dataset_fn(ctx)``, with ``ctx`` an :class:`InputContext`.

        The pipeline yields this process's share of each global batch: ``(x, y)`` or ``(x, y, w)``
        with ``ctx.get_per_pipeline_batch_size(global_batch)`` rows. Pass the result to
        ``Trainer.fit(..., batch_size=global_batch)``; every process must yield the same number of
        batches per epoch or end at the same time (a short or missing batch is padded and masked).

        Example:
          >>> def fn(ctx):
          ...     rows = ctx.get_per_pipeline_batch_size(64)
          ...     return [(np.zeros((rows, 4)), np.zeros((rows,)))]
          >>> ds = MirroredStrategy().distribute_datasets_from_function(fn)
        """
        return _PerProcessDataset(dataset_fn(self.input_context()), self.input_context())

    def __repr__(self) -> str:
        kinds = sorted({d.platform for d in self._devices})
        return (f"MirroredStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"processes={self.process_count}, platform={','.join(kinds)})")


MultiWorkerMirroredStrategy = MirroredStrategy
"""The TF name for a strategy whose devices span several processes or hosts; the same class here."""


class _PerProcessDataset:
    """Marks an iterable as yielding this process's rows only (not the global batch)."""

    def __init__(self, iterable: Any, context: InputContext) -> None:
        self.iterable = iterable
        self.context = context

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


def get_strategy() -> MirroredStrategy:
    """The strategy of the innermost enclosing ``scope()``, else a default over every device.

    Example:
      >>> get_strategy().num_replicas_in_sync >= 1
      True
    """
    stack = getattr(_scope, "stack", None)
    if stack:
        return stack[-1]
    default = getattr(_scope, "default", None)
    if default is None:
        default = _scope.default = MirroredStrategy()
    return default


def has_strategy() -> bool:
    """True inside a ``strategy.scope()``."""
    return bool(getattr(_scope, "stack", None))


@contextlib.contextmanager
def _enter(strategy: MirroredStrategy) -> Iterator[MirroredStrategy]:
    stack = getattr(_scope, "stack", None)
    if stack is None:
        stack = _scope.stack = []
    stack.append(strategy)
    try:
        yield strategy
    finally:
        stack.pop()


def _validate_devices(devices: Sequence[jax.Device | int] | None) -> tuple[jax.Device, ...]:
    all_devices = jax.devices()
    if devices is None:
        return tuple(all_devices)
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a sequence of jax.Device (or device ids) or None; received "
                        f"{devices!r} (of type {type(devices).__name__}).")
    if len(devices) == 0:
        raise ValueError("devices=[] has no device. Pass None for every device, or e.g. jax.devices()[:2].")
    by_id = {d.id: d for d in all_devices}
    resolved = []
    for d in devices:
        if isinstance(d, int) and not isinstance(d, bool):
            if d not in by_id:
                raise ValueError(f"devices names device id {d}, which JAX does not have; available ids: "
                                 f"{sorted(by_id)}.")
            d = by_id[d]
        elif not isinstance(d, jax.Device):
            raise TypeError(f"devices must hold jax.Device objects or integer ids; received {d!r} "
                            f"(of type {type(d).__name__}).")
        resolved.append(d)
    ids = [d.id for d in resolved]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"devices lists device(s) {dupes} more than once (received ids {ids}). "
                         "Give each device once.")
    platforms = sorted({d.platform for d in resolved})
    if len(platforms) > 1:
        raise ValueError(f"devices mixes platforms {platforms}; one strategy runs on one platform. "
                         f"Pick the devices of one, e.g. jax.devices({platforms[0]!r}).")
    return tuple(resolved)
