"""The devices of a job as a mesh, and every layout on it.

A :class:`BatchMesh` is a :class:`jax.sharding.Mesh` over every device of the job. By default it has one
axis, ``"batch"``; given a mesh of several named axes (:func:`hybrid_mesh`, or a Keras ``LayoutMap``'s
``DeviceMesh``) it keeps them. Every global batch is split over the *batch axes* (``P("batch")``, or
``P(("replica", "shard"))`` over both axes of a 2-D mesh), and a stack of batches
(``steps_per_execution``) on its second axis. Variables are replicated (``NamedSharding(mesh, P())``)
unless a layout map lays them out (Keras's ``LayoutMap``: a regex on the variable's path -> the mesh
axes of each dimension) or the ``shard=`` policy splits them over the *shard axis* (the innermost axis:
on a 2-D mesh that is hybrid sharding, HSDP: split within a row, replicated across rows)
(:meth:`BatchMesh.state_sharding`). :meth:`BatchMesh.place` puts a tree on the devices with given
layouts, process 0's values on every process. The strategy (:class:`mirrorax.MirroredStrategy`) is one
of these, with the dispatch window and the custom-loop API: these attributes are the strategy's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mirrorax.cluster.join as cluster
from mirrorax._host import host_value
from mirrorax.cluster.consistency import broadcast_from_primary

__all__ = ["BATCH_AXIS", "SHARD_MIN_SIZE", "SHARD_MODES", "AxisName", "BatchMesh", "ShardMode", "check_shard",
           "hybrid_mesh", "validate_devices"]

BATCH_AXIS = "batch"

#: A mesh axis name, or several (a batch split over both axes of a 2-D mesh: ``("replica", "shard")``),
#: as ``PartitionSpec`` entries and ``jax.lax.psum`` take them.
AxisName = str | tuple[str, ...]

ShardMode = Literal["optimizer", "all"] | None
SHARD_MODES: tuple[ShardMode, ...] = (None, "optimizer", "all")
_SHARDED_ROLES = {"optimizer": ("optimizer",), "all": ("params", "optimizer")}
#: Variables with fewer elements stay replicated in the sharded modes: their collectives' fixed cost is
#: more than splitting saves (a 128x128 kernel is 64 KiB in float32). Measured at 8 devices with
#: ``benchmarks/shard_threshold.py``: splitting is 1.1-1.6x slower below this size, at parity
#: ("optimizer") or faster ("all") from it (docs/plan.md has the numbers).
SHARD_MIN_SIZE = 16384


class BatchMesh:
    """Every device of a job as a mesh, with the layouts of state and batches.

    Args:
      devices: the devices (see :class:`mirrorax.MirroredStrategy`); ``None`` means ``jax.devices()``. They
        form a one-axis mesh (axis ``"batch"``).
      shard: the state layout mode: ``None`` (replicated), ``"optimizer"`` or ``"all"``: split over the
        shard axis (:attr:`shard_axis`).
      mesh: instead of ``devices``, a ``jax.sharding.Mesh`` or ``keras.distribution.DeviceMesh`` whose named
        axes are kept (e.g. :func:`hybrid_mesh`): the batch is split over ``batch_axes``, ``shard=``
        splits over its last axis and replicates over the others (HSDP).
      batch_axes: the mesh axes every global batch is split over; default: every axis of ``mesh``, the
        first axis of a layout map's mesh.
      layout_map: a ``keras.distribution.LayoutMap`` (or any mapping of variable path -> axes with a
        ``device_mesh``): its mesh is the mesh, each variable whose path it matches is laid out as it
        says, the others replicated; ``shard=`` then splits over the batch axis.

    Raises:
      ValueError: ``devices`` is empty, has duplicates, mixes platforms, has several long axes or gives
        the processes unequal shares; ``shard`` is not a mode; several of ``devices``, ``mesh`` and
        ``layout_map``; an axis name the mesh lacks; processes that share a slice of the batch.
      TypeError: ``devices`` is not one of the accepted kinds.

    Example:
      >>> mesh = BatchMesh(jax.devices()[:2])
      >>> mesh.batch_sharding.spec
      PartitionSpec('batch',)
    """

    def __init__(self, devices: Any = None, *, shard: ShardMode = None, mesh: Any = None,
                 batch_axes: str | Sequence[str] | None = None, layout_map: Any = None) -> None:
        check_shard(shard)
        self._shard = shard
        given = [name for name, v in (("devices", devices), ("mesh", mesh), ("layout_map", layout_map))
                 if v is not None]
        if len(given) > 1:
            raise ValueError(f"Pass one of devices, mesh and layout_map; received {' and '.join(given)}. A layout "
                             "map brings its own mesh (layout_map.device_mesh).")
        self._layouts: Callable[[str], tuple[Any, ...] | None] | None = None
        if layout_map is not None:
            mesh = getattr(layout_map, "device_mesh", None)
            if mesh is None:
                raise ValueError(f"layout_map has no device_mesh (received {layout_map!r}): make it as "
                                 "keras.distribution.LayoutMap(keras.distribution.DeviceMesh(shape, axis_names, "
                                 "devices)).")
            self._layouts = _layout_lookup(layout_map)
        if mesh is None:
            self._devices = validate_devices(devices)
            self._mesh = jax.make_mesh((len(self._devices),), (BATCH_AXIS,),
                                       axis_types=(jax.sharding.AxisType.Auto,), devices=self._devices)
            if batch_axes not in (None, BATCH_AXIS, (BATCH_AXIS,), [BATCH_AXIS]):
                raise ValueError(f"batch_axes={batch_axes!r} names axes of a mesh; a list of devices makes one axis, "
                                 f"{BATCH_AXIS!r}. Pass mesh=jax.make_mesh(...) (or mx.hybrid_mesh(...)) with "
                                 "those axes, or leave batch_axes out.")
        else:
            self._mesh = _named_mesh(mesh)
            self._devices = tuple(self._mesh.devices.flat)
        names = tuple(self._mesh.axis_names)
        if batch_axes is None:
            axes: tuple[str, ...] = names[:1] if layout_map is not None else names
        else:
            axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        unknown = [a for a in axes if a not in names]
        if not axes or unknown or len(set(axes)) != len(axes):
            raise ValueError(f"batch_axes must name distinct axes of the mesh {names}; received {batch_axes!r}. "
                             f"E.g. batch_axes={names!r} (the batch split over every device) or "
                             f"batch_axes={names[0]!r}.")
        self._batch_axes = axes
        self._batch_axis: AxisName = axes[0] if len(axes) == 1 else axes
        # shard= splits what the layout leaves replicated: the batch axis under a layout map (ZeRO over the
        # data-parallel replicas), else the innermost axis (one axis: every device; 2-D: HSDP).
        self._shard_axis = axes[-1] if layout_map is not None else names[-1]
        self._replicated = NamedSharding(self._mesh, P())
        self._batch_sharding = NamedSharding(self._mesh, P(self._batch_axis))
        self._stacked_batch_sharding = NamedSharding(self._mesh, P(None, self._batch_axis))
        self._local_devices = tuple(d for d in self._devices if d.process_index == jax.process_index())
        counts: dict[int, int] = {}
        for d in self._devices:
            counts[d.process_index] = counts.get(d.process_index, 0) + 1
        if len(set(counts.values())) > 1:
            raise ValueError(f"Every process must contribute the same number of devices; received "
                             f"{dict(sorted(counts.items()))} (process -> devices). Pass devices=None or an "
                             "equal share per process.")
        self._processes = tuple(sorted(counts))
        self._check_process_rows()

    def _check_process_rows(self) -> None:
        """Each process must hold slices of the batch no other process holds (it feeds its own rows)."""
        if len(self._processes) < 2:
            return
        names = tuple(self._mesh.axis_names)
        procs = np.vectorize(lambda d: d.process_index, otypes=[int])(self._mesh.devices)
        # Every device's slice of the batch: its position along the batch axes.
        other = tuple(i for i, n in enumerate(names) if n not in self._batch_axes)
        order = [names.index(a) for a in self._batch_axes]
        per_slice = np.transpose(procs, order + list(other)).reshape(self.num_replicas_in_sync, -1)
        shared = [i for i, row in enumerate(per_slice) if len(set(row.tolist())) > 1]
        if shared:
            raise ValueError(f"Slice {shared[0]} of the batch (over the batch axes {self._batch_axes} of the mesh "
                             f"{dict(self._mesh.shape)}) lies on the devices of processes "
                             f"{sorted(set(per_slice[shared[0]].tolist()))}; each process feeds its own rows, so "
                             "each slice of the batch must lie within one process. Put the processes along a "
                             "batch axis (mx.hybrid_mesh() does: one process per row).")

    # -- devices and processes ---------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        """The ``jax.sharding.Mesh`` the job trains on: one axis ``"batch"``, or the axes of the mesh (or
        layout map) it was given."""
        return self._mesh

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Every device of the mesh (of the strategy), in mesh order."""
        return self._devices

    @property
    def local_devices(self) -> tuple[jax.Device, ...]:
        """This process's devices of the mesh."""
        return self._local_devices

    @property
    def num_replicas_in_sync(self) -> int:
        """How many slices each global batch is split into: the device count (under a layout map, the
        size of its batch axis: the data-parallel replicas)."""
        return math.prod(self._mesh.shape[a] for a in self._batch_axes)

    @property
    def process_index(self) -> int:
        """This process's position among the processes that hold the mesh's devices (0 speaks: progress,
        files)."""
        return self._processes.index(jax.process_index())

    @property
    def process_count(self) -> int:
        """How many processes hold devices of the mesh (feed the strategy)."""
        return len(self._processes)

    @property
    def is_primary(self) -> bool:
        """True on the process that prints and writes files (process 0)."""
        return self.process_index == 0

    @property
    def process_axes(self) -> tuple[str, ...]:
        """The mesh axes along which the process changes: what a collective over them sends between
        processes (hosts). ``()`` on one process; the outer axis of :func:`mirrorax.hybrid_mesh`."""
        procs = np.vectorize(lambda d: d.process_index, otypes=[int])(self._mesh.devices)
        return tuple(name for k, name in enumerate(self._mesh.axis_names)
                     if bool((procs != np.take(procs, [0], axis=k)).any()))

    # -- layouts -------------------------------------------------------------------------------------
    @property
    def batch_axis(self) -> AxisName:
        """The mesh axis every global batch is split over (``"batch"``), or the tuple of them when it is
        split over several (``("replica", "shard")``), as ``PartitionSpec`` and ``jax.lax.psum`` take it."""
        return self._batch_axis

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes every global batch is split over, as a tuple (``("batch",)`` by default)."""
        return self._batch_axes

    @property
    def shard_axis(self) -> str:
        """The mesh axis ``shard=`` splits the state over (replicated over the others): the last axis
        (``"batch"`` on one axis; the inner axis of a 2-D mesh: HSDP), the batch axis under a layout map."""
        return self._shard_axis

    @property
    def has_layout_map(self) -> bool:
        """Whether a layout map lays out the variables its paths match."""
        return self._layouts is not None

    @property
    def replicated(self) -> NamedSharding:
        """``NamedSharding(mesh, P())``: the layout of variables and optimizer state."""
        return self._replicated

    @property
    def batch_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P(batch_axis))`` (``P("batch")`` by default): the layout of every global
        batch (split on axis 0)."""
        return self._batch_sharding

    @property
    def stacked_batch_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P(None, batch_axis))``: several global batches stacked on a new leading axis
        (one call running ``steps_per_execution`` steps), each split over the devices."""
        return self._stacked_batch_sharding

    @property
    def shard(self) -> ShardMode:
        """The state layout mode: ``None`` (replicated), ``"optimizer"`` or ``"all"``."""
        return self._shard

    def state_sharding(self, shape: Sequence[int], role: str, path: str | None = None,
                       axes: Sequence[Any] | None = None) -> NamedSharding:
        """Where a state variable of ``shape`` lives.

        First as the variable's own annotation ``axes`` says (Flax's ``nnx.with_partitioning``: the mesh axes
        of each dimension), else as the layout map says for ``path`` (the variable's path, e.g.
        ``"dense/kernel"``; Keras's ``LayoutMap`` lookup), replicated where it matches none. Then, when the
        mode shards its ``role`` (``"params"`` or ``"optimizer"``) and it has at least :data:`SHARD_MIN_SIZE`
        elements, split over :attr:`shard_axis` on its largest axis still whole that divides by that axis's size.

        Raises:
          ValueError: the layout map's entry for ``path`` does not fit ``shape``.

        Example:
          >>> MirroredStrategy(shard="all").state_sharding((1024, 512), "params").spec  # on 8 devices
          PartitionSpec('batch', None)
        """
        spec: list[Any] = [None] * len(shape)
        if axes is not None:
            padded = tuple(axes) + (None,) * (len(shape) - len(axes))
            spec = self._checked_layout(str(path), shape, padded, source="Its sharding annotation")
        elif self._layouts is not None and path is not None:
            axes = self._layouts(path)
            if axes is not None:
                spec = self._checked_layout(path, shape, axes)
        n = self._mesh.shape[self._shard_axis]
        used = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}
        if (self._shard is not None and role in _SHARDED_ROLES[self._shard] and math.prod(shape) >= SHARD_MIN_SIZE
                and n > 1 and self._shard_axis not in used):
            free = [i for i, d in enumerate(shape) if spec[i] is None and d % n == 0 and d >= n]
            if free:
                spec[max(free, key=lambda i: (shape[i], -i))] = self._shard_axis
        if all(entry is None for entry in spec):
            return self._replicated
        return NamedSharding(self._mesh, P(*spec))

    def annotated_sharding(self, shape: Sequence[int], axes: Sequence[Any], path: str) -> NamedSharding:
        """Where a variable whose own annotation names its mesh axes lives (Flax's ``nnx.with_partitioning``:
        one axis name, a tuple of them or ``None`` per dimension; missing trailing entries: whole), checked
        against the mesh as a layout map's entries are; :attr:`replicated` when nothing is split.

        Raises:
          ValueError: ``axes`` names an axis the mesh lacks, or splits a dimension it does not divide
            (the message names ``path``).
        """
        return self.state_sharding(shape, "variable", path, axes)

    def _checked_layout(self, path: str, shape: Sequence[int], axes: tuple[Any, ...],
                        source: str = "The layout map") -> list[Any]:
        sizes = dict(self._mesh.shape)
        if len(axes) != len(shape):
            raise ValueError(f"{source} gives the variable {path!r} of shape {tuple(shape)} the layout {axes} "
                             f"({len(axes)} axes for {len(shape)} dimensions). Give one entry per dimension "
                             "(None: not split).")
        for dim, entry in zip(shape, axes):
            names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
            unknown = [a for a in names if a not in sizes]
            if unknown:
                fix = (" Give the strategy a mesh with that axis (MirroredStrategy(mesh=...), the mesh the model was "
                       "annotated for), or annotate with the mesh's axes." if source != "The layout map" else "")
                raise ValueError(f"{source} gives the variable {path!r} the layout {axes}, naming axis "
                                 f"{unknown[0]!r}; the mesh has axes {tuple(sizes)}.{fix}")
            ways = math.prod(sizes[a] for a in names)
            if dim % ways:
                raise ValueError(f"{source} splits the variable {path!r} of shape {tuple(shape)} as {axes}: "
                                 f"a dimension of {dim} over {ways} devices, which does not divide. Pick a layout "
                                 "whose split axes divide the dimensions, or leave that dimension whole (None).")
        return list(axes)

    def state_layout(self, tree: Any, role: str, paths: Mapping[str, str] | None = None,
                     axes: Mapping[str, Sequence[Any]] | None = None) -> Any:
        """:meth:`state_sharding` for every leaf of ``tree`` (a tree of arrays or shapes); ``paths``: for a
        dict ``tree``, each key's variable path (what a layout map matches); ``axes``: variables' own
        annotations by key, applied to every leaf held under that key in a dict anywhere in ``tree`` (a
        parameter, and its optimizer slots, e.g. Adam's ``mu[key]``)."""
        if axes:
            def one(path: tuple[Any, ...], a: Any) -> NamedSharding:
                key = next((k.key for k in reversed(path)
                            if isinstance(k, jax.tree_util.DictKey) and k.key in axes), None)
                if key is None or len(axes[key]) > np.ndim(a):
                    return self.state_sharding(np.shape(a), role, paths.get(key) if paths and key else None)
                return self.state_sharding(np.shape(a), role, str(key), axes[key])

            return jax.tree_util.tree_map_with_path(one, tree)
        if paths and isinstance(tree, Mapping):
            return {k: self.state_sharding(np.shape(v), role, paths.get(k)) for k, v in tree.items()}
        return jax.tree.map(lambda a: self.state_sharding(np.shape(a), role), tree)

    # -- placing values ------------------------------------------------------------------------------
    def place(self, tree: Any, shardings: Any, *, broadcast: bool = True, take: bool = False) -> Any:
        """``tree`` placed with ``shardings`` (one ``NamedSharding`` for every leaf, e.g. :attr:`replicated`, or
        a matching tree of them), in buffers of its own.

        ``broadcast``: on several processes every process takes process 0's values (the replicas really are
        one state, even where each process initialised its own differently); ``False`` for values that every
        process already holds alike (e.g. read from one checkpoint).

        ``take``: the caller hands its device buffers over (a model whose variables let go of them, as
        Keras's own ``fit`` donates its variables; a state that a step may donate later): a leaf already laid
        out as asked is used as it is, and one laid out otherwise is moved with no copy on the devices it
        already holds, so that placing a state never holds two copies of it (a buffer given twice is copied
        once, to be donated safely).
        """
        if broadcast and self.process_count > 1:
            tree = broadcast_from_primary(tree)
        leaves, treedef = jax.tree.flatten(tree)
        targets: list[NamedSharding]
        if isinstance(shardings, NamedSharding):
            targets = [shardings] * len(leaves)
        else:
            targets = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]  # jaxlib: no PyTreeDef stub
        on_device = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
        if take and self.process_count == 1 and on_device:
            seen: set[int] = set()
            shared = []  # the second and later places of a buffer given more than once
            for i in on_device:
                if id(leaves[i]) in seen:
                    shared.append(i)
                seen.add(id(leaves[i]))
            again = set(shared)
            moved = [i for i in on_device if i not in again and leaves[i].sharding != targets[i]]
            for i, a in zip(moved, jax.device_put([leaves[i] for i in moved], [targets[i] for i in moved])):
                leaves[i] = a
            on_device = shared  # the rest is placed; a buffer given twice is copied below
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

    def __repr__(self) -> str:
        kinds = sorted({d.platform for d in self._devices})
        shape = "" if self._mesh.axis_names == (BATCH_AXIS,) else f"mesh={dict(self._mesh.shape)}, "
        return (f"BatchMesh({shape}num_replicas_in_sync={self.num_replicas_in_sync}, processes={self.process_count}, "
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
            f"devices is {what}: several axes of devices; devices= takes a 1-D list of devices. Pass "
            f"devices=mesh.devices.reshape(-1) (all {devices.size} devices as data-parallel replicas), "
            "mesh=<a jax.sharding.Mesh or DeviceMesh with named axes> (the batch split over its axes, shard= "
            "over the last: HSDP), or layout_map=<the keras.distribution.LayoutMap you would give "
            "ModelParallel> for model parallelism.")
    return list(devices.reshape(-1))


def _named_mesh(mesh: Any) -> Mesh:
    """A ``jax.sharding.Mesh`` (axes of type Auto) of ``mesh``: a ``jax.sharding.Mesh`` or a Keras
    ``DeviceMesh`` (its devices as objects or Keras's names)."""
    names = getattr(mesh, "axis_names", None)
    grid = getattr(mesh, "devices", None)
    if names is None or not isinstance(grid, np.ndarray):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a keras.distribution.DeviceMesh (named axes over an "
                        f"array of devices); received {mesh!r} (of type {type(mesh).__name__}). Build one with "
                        "mx.hybrid_mesh(...) or jax.make_mesh(shape, axis_names).")
    names = tuple(str(n) for n in names)
    if len(set(names)) != len(names) or len(names) != grid.ndim:
        raise ValueError(f"mesh has axis names {names} for {grid.ndim} axes of devices; give each axis one "
                         "distinct name.")
    devices = validate_devices(list(grid.reshape(-1)))
    return Mesh(np.array(devices, dtype=object).reshape(grid.shape), names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _layout_lookup(layout_map: Any) -> Callable[[str], tuple[Any, ...] | None]:
    """``path -> axes`` (a tuple, an entry per dimension) as ``layout_map[path]`` gives them (Keras's
    ``LayoutMap``: the exact key, else the one key that ``re.fullmatch`` es), ``None`` where none does."""
    def lookup(path: str) -> tuple[Any, ...] | None:
        layout = layout_map[path]
        if layout is None:
            return None
        return tuple(getattr(layout, "axes", layout))

    return lookup


def hybrid_mesh(inner: int | None = None, *, axis_names: tuple[str, str] = ("replica", "shard"),
                devices: Sequence[Any] | None = None) -> Mesh:
    """A 2-D ``jax.sharding.Mesh`` for hybrid sharding: rows of ``inner`` devices, one process's devices
    together (the outer axis follows process boundaries: one host = one row by default, as
    ``jax.experimental.mesh_utils.create_hybrid_device_mesh`` lays out slices).

    ``MirroredStrategy(mesh=hybrid_mesh(), shard="all")`` is HSDP: the batch is split over every device
    (both axes), the large variables over the inner axis only and replicated over the outer one, so
    parameters are gathered within a host and only each shard's gradient all-reduce crosses hosts.

    Args:
      inner: devices per row (the inner axis); default: each process's device count. It must divide
        the device count, and either divide each process's device count or be a multiple of it.
      axis_names: the (outer, inner) axis names.
      devices: the devices (default ``jax.devices()``), in any of the forms ``MirroredStrategy`` takes.

    Joins a multi-process job first when the environment describes one, as ``MirroredStrategy`` does.

    Returns:
      A mesh of shape ``(devices // inner, inner)``, devices ordered by process, then as given.

    Raises:
      ValueError: ``inner`` does not divide the devices, or would split a row across processes unevenly.

    Example:
      >>> mesh = hybrid_mesh(4)   # 8 devices on one process: a 2x4 mesh
      >>> dict(mesh.shape)
      {'replica': 2, 'shard': 4}
    """
    cluster.maybe_initialize_from_env()  # before JAX lists the devices: a job's devices span its processes
    found = validate_devices(devices)
    procs = sorted({d.process_index for d in found})
    local = len(found) // len(procs)
    if inner is None:
        inner = local
    if not isinstance(inner, int) or isinstance(inner, bool) or inner < 1 or len(found) % inner:
        raise ValueError(f"inner must be a positive int that divides the {len(found)} devices; received {inner!r}. "
                         f"E.g. inner={local} (one row per process).")
    if local % inner and inner % local:
        raise ValueError(f"inner={inner} would split a row across processes unevenly ({local} devices per "
                         f"process); pick a divisor or a multiple of {local}.")
    if len(axis_names) != 2 or len(set(axis_names)) != 2:
        raise ValueError(f"axis_names must be two distinct names (outer, inner); received {axis_names!r}.")
    ordered = sorted(found, key=lambda d: procs.index(d.process_index))  # stable: each process's own order
    grid = np.array(ordered, dtype=object).reshape(len(found) // inner, inner)
    return Mesh(grid, tuple(axis_names), axis_types=(jax.sharding.AxisType.Auto,) * 2)


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
