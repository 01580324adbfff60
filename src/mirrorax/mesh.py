"""The devices of a job as a one-axis mesh, and every layout on it.

A :class:`BatchMesh` is a :class:`jax.sharding.Mesh` with one axis, ``"batch"``, over every device of the
job. Variables are replicated (``NamedSharding(mesh, P())``); every global batch is split over the batch
axis (``NamedSharding(mesh, P("batch"))``), and a stack of batches (``steps_per_execution``) on its second
axis. The ``shard=`` policy says which state variables are split instead (:meth:`BatchMesh.state_sharding`),
and :meth:`BatchMesh.place` puts a tree on the devices with given layouts, process 0's values on every
process. The strategy (:class:`mirrorax.MirroredStrategy`) stands on one of these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mirrorax._host import host_value
from mirrorax.consistency import broadcast_from_primary

__all__ = ["BATCH_AXIS", "SHARD_MIN_SIZE", "SHARD_MODES", "BatchMesh", "ShardMode", "check_shard",
           "validate_devices"]

BATCH_AXIS = "batch"

ShardMode = Literal["optimizer", "all"] | None
SHARD_MODES: tuple[ShardMode, ...] = (None, "optimizer", "all")
_SHARDED_ROLES = {"optimizer": ("optimizer",), "all": ("params", "optimizer")}
#: Variables with fewer elements stay replicated in the sharded modes: their collectives' fixed cost is
#: more than splitting saves (a 128x128 kernel is 64 KiB in float32). Measured at 8 devices with
#: ``benchmarks/shard_threshold.py``: splitting is 1.1-1.6x slower below this size, at parity
#: ("optimizer") or faster ("all") from it (docs/plan.md has the numbers).
SHARD_MIN_SIZE = 16384


class BatchMesh:
    """Every device of a job as a one-axis mesh (axis ``"batch"``), with the layouts of state and batches.

    Args:
      devices: the devices (see :class:`mirrorax.MirroredStrategy`); ``None`` means ``jax.devices()``.
      shard: the state layout mode: ``None`` (replicated), ``"optimizer"`` or ``"all"``.

    Raises:
      ValueError: ``devices`` is empty, has duplicates, mixes platforms, has several long axes or gives
        the processes unequal shares; ``shard`` is not a mode.
      TypeError: ``devices`` is not one of the accepted kinds.

    Example:
      >>> mesh = BatchMesh(jax.devices()[:2])
      >>> mesh.batch_sharding.spec
      PartitionSpec('batch',)
    """

    def __init__(self, devices: Any = None, *, shard: ShardMode = None) -> None:
        check_shard(shard)
        self._shard = shard
        self._devices = validate_devices(devices)
        self._mesh = jax.make_mesh((len(self._devices),), (BATCH_AXIS,),
                                   axis_types=(jax.sharding.AxisType.Auto,), devices=self._devices)
        self._replicated = NamedSharding(self._mesh, P())
        self._batch_sharding = NamedSharding(self._mesh, P(BATCH_AXIS))
        self._stacked_batch_sharding = NamedSharding(self._mesh, P(None, BATCH_AXIS))
        self._local_devices = tuple(d for d in self._devices if d.process_index == jax.process_index())
        counts: dict[int, int] = {}
        for d in self._devices:
            counts[d.process_index] = counts.get(d.process_index, 0) + 1
        if len(set(counts.values())) > 1:
            raise ValueError(f"Every process must contribute the same number of devices; received "
                             f"{dict(sorted(counts.items()))} (process -> devices). Pass devices=None or an "
                             "equal share per process.")
        self._processes = tuple(sorted(counts))

    # -- devices and processes ---------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        """The one-axis ``jax.sharding.Mesh`` (axis ``"batch"``)."""
        return self._mesh

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Every device, in mesh order."""
        return self._devices

    @property
    def local_devices(self) -> tuple[jax.Device, ...]:
        """This process's devices."""
        return self._local_devices

    @property
    def num_replicas_in_sync(self) -> int:
        """The global device count: how many slices each global batch is split into."""
        return len(self._devices)

    @property
    def process_index(self) -> int:
        """This process's position among the mesh's processes (0 speaks: progress, files)."""
        return self._processes.index(jax.process_index())

    @property
    def process_count(self) -> int:
        """How many processes hold devices of the mesh."""
        return len(self._processes)

    @property
    def is_primary(self) -> bool:
        """True on the process that prints and writes files (process 0)."""
        return self.process_index == 0

    # -- layouts -------------------------------------------------------------------------------------
    @property
    def batch_axis(self) -> str:
        """The mesh axis name every global batch is split over (``"batch"``)."""
        return BATCH_AXIS

    @property
    def replicated(self) -> NamedSharding:
        """``NamedSharding(mesh, P())``: the layout of variables and optimizer state."""
        return self._replicated

    @property
    def batch_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P("batch"))``: the layout of every global batch (split on axis 0)."""
        return self._batch_sharding

    @property
    def stacked_batch_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P(None, "batch"))``: several global batches stacked on a new leading axis
        (one call running ``steps_per_execution`` steps), each split over the devices."""
        return self._stacked_batch_sharding

    @property
    def shard(self) -> ShardMode:
        """The state layout mode: ``None`` (replicated), ``"optimizer"`` or ``"all"``."""
        return self._shard

    def state_sharding(self, shape: Sequence[int], role: str) -> NamedSharding:
        """Where a state variable of ``shape`` lives: split over the batch axis on its largest axis that
        divides by the device count, when the mode shards its ``role`` (``"params"`` or ``"optimizer"``)
        and it has at least :data:`SHARD_MIN_SIZE` elements; replicated otherwise.

        Example:
          >>> BatchMesh(shard="all").state_sharding((1024, 512), "params").spec  # on 8 devices
          PartitionSpec('batch', None)
        """
        if self._shard is None or role not in _SHARDED_ROLES[self._shard] or math.prod(shape) < SHARD_MIN_SIZE:
            return self._replicated
        n = self.num_replicas_in_sync
        axes = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
        if n == 1 or not axes:
            return self._replicated
        axis = max(axes, key=lambda i: (shape[i], -i))
        spec: list[str | None] = [None] * len(shape)
        spec[axis] = BATCH_AXIS
        return NamedSharding(self._mesh, P(*spec))

    def state_layout(self, tree: Any, role: str) -> Any:
        """:meth:`state_sharding` for every leaf of ``tree`` (a tree of arrays or shapes)."""
        return jax.tree.map(lambda a: self.state_sharding(np.shape(a), role), tree)

    # -- placing values ------------------------------------------------------------------------------
    def place(self, tree: Any, shardings: Any, *, broadcast: bool = True) -> Any:
        """``tree`` placed with ``shardings`` (a matching tree of ``NamedSharding``), in buffers of its own.

        ``broadcast``: on several processes every process takes process 0's values (see :meth:`replicate`).
        """
        if broadcast and self.process_count > 1:
            tree = broadcast_from_primary(tree)
        leaves, treedef = jax.tree.flatten(tree)
        targets = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]  # jaxlib has no PyTreeDef stub
        on_device = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
        if self.process_count == 1 and on_device:
            # Device to devices, no host copy. device_put(..., may_alias=False) still reuses the source's
            # buffer for the mesh's copy on the source's device (jax 0.10), so copy on that device first.
            own = jax.device_put([leaves[i] for i in on_device], [leaves[i].sharding for i in on_device],
                                 may_alias=False)
            for i, a in zip(on_device, jax.device_put(own, [targets[i] for i in on_device])):
                leaves[i] = a

        if self.process_count == 1:
            # Host values to devices in one transfer (one call per leaf costs ~3x the host time), copied
            # (may_alias=False: a donated step must not free the caller's memory).
            on_host = [i for i, a in enumerate(leaves) if not isinstance(a, jax.Array)]
            if on_host:
                placed = jax.device_put([np.asarray(leaves[i]) for i in on_host], [targets[i] for i in on_host],
                                        may_alias=False)
                for i, a in zip(on_host, placed):
                    leaves[i] = a

        def put(a: Any, sharding: NamedSharding) -> jax.Array:
            if isinstance(a, jax.Array) and a.sharding == sharding:
                return a
            if isinstance(a, jax.Array) and not a.is_fully_addressable:
                a = a.addressable_data(0) if a.is_fully_replicated else host_value(a)
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

        return jax.tree.unflatten(treedef, [put(a, t) for a, t in zip(leaves, targets)])

    def replicate(self, tree: Any, *, broadcast: bool = True) -> Any:
        """A copy of ``tree`` on every device (:attr:`replicated`), never aliasing the caller's buffers.

        ``broadcast``: on several processes every replica holds process 0's values. ``False`` for values
        that every process already holds alike (e.g. read from one checkpoint).
        """
        return self.place(tree, jax.tree.map(lambda _: self._replicated, tree), broadcast=broadcast)

    def __repr__(self) -> str:
        kinds = sorted({d.platform for d in self._devices})
        return (f"BatchMesh(num_replicas_in_sync={self.num_replicas_in_sync}, processes={self.process_count}, "
                f"platform={','.join(kinds)}, shard={self._shard!r})")


def check_shard(shard: Any) -> None:
    """Raises ``ValueError`` unless ``shard`` is one of :data:`SHARD_MODES`."""
    if shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}: None (replicated), 'optimizer' (ZeRO-1: optimizer "
                         f"state split over the devices) or 'all' (ZeRO-3 / FSDP: parameters too); received "
                         f"{shard!r}.")


# -- devices ---------------------------------------------------------------------------------------------
def _device_list(devices: Any) -> Any:
    """``devices`` as a flat sequence: a ``jax.sharding.Mesh``'s or Keras ``DeviceMesh``'s devices, a
    numpy array of devices (keras.io's distribution guide passes ``mesh.devices``) with at most one
    axis longer than 1."""
    source = devices
    if isinstance(devices, jax.sharding.Mesh) or (
            hasattr(devices, "axis_names") and isinstance(getattr(devices, "devices", None), np.ndarray)):
        devices = devices.devices  # a jax.sharding.Mesh, or keras.distribution.DeviceMesh
    if not isinstance(devices, np.ndarray):
        return devices
    long_axes = [n for n in devices.shape if n > 1]
    if len(long_axes) > 1:
        names = getattr(source, "axis_names", None)
        what = f"a mesh of shape {devices.shape}" + (f" with axes {tuple(names)}" if names else "")
        raise ValueError(
            f"devices is {what}: several axes of devices, as for model parallelism; MirroredStrategy "
            f"replicates the model on a 1-D list of devices. Pass devices=mesh.devices.reshape(-1) (all "
            f"{devices.size} devices as data-parallel replicas), or keep the mesh for "
            "keras.distribution.ModelParallel with Keras's own fit.")
    return list(devices.reshape(-1))


def _by_name(name: str, all_devices: Sequence[jax.Device]) -> jax.Device:
    """A device named as Keras names them (``keras.distribution.list_devices()``): ``"cpu:0"``."""
    platform, _, index = name.partition(":")
    for d in all_devices:
        if d.platform == platform.lower() and str(d.id) == (index or "0"):
            return d
    raise ValueError(f"devices names {name!r}, which JAX does not have; available: "
                     f"{[f'{d.platform}:{d.id}' for d in all_devices]}.")


def validate_devices(devices: Any) -> tuple[jax.Device, ...]:
    """``devices`` (as :class:`mirrorax.MirroredStrategy` accepts them) as a tuple of ``jax.Device``.

    Raises:
      TypeError: not a sequence or array of devices, ids or names, a mesh, or ``None``.
      ValueError: empty, an unknown id or name, duplicates, mixed platforms, several long axes.
    """
    all_devices = jax.devices()
    if devices is None:
        return tuple(all_devices)
    devices = _device_list(devices)
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a sequence of jax.Device (or device ids, or names like 'cpu:0'), a numpy "
                        f"array of them, a jax.sharding.Mesh, a keras.distribution.DeviceMesh or None; received "
                        f"{devices!r} (of type {type(devices).__name__}).")
    if len(devices) == 0:
        raise ValueError(f"devices={devices!r} has no device. Pass None for every device, or e.g. "
                         "jax.devices()[:2].")
    by_id = {d.id: d for d in all_devices}
    resolved = []
    for d in devices:
        if isinstance(d, int) and not isinstance(d, bool):
            if d not in by_id:
                raise ValueError(f"devices names device id {d}, which JAX does not have; available ids: "
                                 f"{sorted(by_id)}.")
            d = by_id[d]
        elif isinstance(d, str):
            d = _by_name(d, all_devices)
        elif not isinstance(d, jax.Device):
            raise TypeError(f"devices must hold jax.Device objects, integer ids or names like 'cpu:0'; received "
                            f"{d!r} (of type {type(d).__name__}).")
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
