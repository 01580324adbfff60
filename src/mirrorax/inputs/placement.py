"""Placement: this process's rows of a batch as global arrays split over the devices.

Each process builds only its own rows of every global batch and places them with
``jax.make_array_from_process_local_data`` (one process: the transfer ``jax.device_put`` ends in).
This runs once per step on the thread that dispatches the steps: it is kept to the transfer itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrorax.inputs.batch import Batch

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["shared_constant", "shared_count", "is_shared", "cached_put", "put_rows", "to_global", "RowsPlacer",
           "host_rows"]


# Full, unweighted batches all carry the same ones (weights, mask) and the same count: one read-only
# host array each, placed on the devices once per layout instead of once per step.
_SHARED: dict[tuple[Any, ...], np.ndarray] = {}
_SHARED_IDS: set[int] = set()
_PLACED: dict[tuple[int, Any], jax.Array] = {}


def shared_constant(value: np.ndarray | np.generic) -> np.ndarray:
    """The one read-only array equal to ``value`` (by dtype, shape and contents), for reuse across steps."""
    value = np.asarray(value)
    key = (value.dtype.str, value.shape, value.tobytes())
    shared = _SHARED.get(key)
    if shared is None:
        if len(_SHARED) > 64:  # a run has a handful; anything more is not worth caching
            return value
        shared = _SHARED[key] = value.copy()
        shared.flags.writeable = False
        _SHARED_IDS.add(id(shared))
    return shared


_COUNTS: dict[int, np.ndarray] = {}  # n -> shared_constant(np.float32(n)), looked up by n


def shared_count(n: int) -> np.ndarray:
    """A batch's real-row count ``n`` as its :func:`shared_constant` (``float32``), looked up by ``n`` itself: once per
    batch on the thread that dispatches the steps, where hashing the value's bytes each time is what it spares."""
    count = _COUNTS.get(n)
    if count is None:
        count = shared_constant(np.float32(n))
        if is_shared(count):  # (not when shared_constant's own table is full)
            _COUNTS[n] = count
    return count


def is_shared(a: np.ndarray) -> bool:
    """Whether ``a`` is one of the arrays :func:`shared_constant` handed out."""
    # By identity: the shared arrays live as long as the process, so their ids are never reused.
    return id(a) in _SHARED_IDS


def cached_put(a: np.ndarray, sharding: Any, put: Any) -> jax.Array:
    """``put(a)``, placed once per ``sharding`` when ``a`` is a :func:`shared_constant`."""
    if not is_shared(a):
        return put(a)
    key = (id(a), sharding)
    placed = _PLACED.get(key)
    if placed is None:
        placed = _PLACED[key] = put(a)
    return placed


try:  # the transfer jax.device_put ends in, without its per-call Python (trees, avals, options)
    from jax._src.core import ShapedArray as _ShapedArray
    from jax._src.dispatch import ArrayCopySemantics as _CopySemantics
    from jax._src.interpreters.pxla import shard_args as _shard_args
    from jax._src.lib import xla_client as _xc
except ImportError:  # pragma: no cover - another JAX: device_put below
    _shard_args = None
    _xc = None  # type: ignore[assignment]


def _transfer() -> Any:
    """``put(aval, sharding, shards, devices, copy)``: JAX's own transfer of host shards into one global array;
    ``copy``: the host buffer read until the copy completes. JAX's default lets the CPU client alias a host
    array instead (zero copy), and a step's program then ran 13-18% slower on its inputs than on copies
    (measured on the CPU proxy, benchmarks/host_proxy.py), so :class:`RowsPlacer` asks a copy on the CPU and
    JAX's default elsewhere. ``None`` on a JAX without it (put_rows' other paths then)."""
    put = getattr(_xc, "batched_device_put", None)
    semantics = getattr(getattr(_xc, "HostBufferSemantics", None), "IMMUTABLE_UNTIL_TRANSFER_COMPLETES", None)
    if put is None or semantics is None:  # pragma: no cover - another jaxlib
        return None

    def transfer(aval: Any, sharding: Any, shards: list[Any], devices: list[Any], copy: bool = True) -> Any:
        if not copy:  # (JAX's default)
            return put(aval, sharding, shards, devices, True)
        return put(aval, sharding, shards, devices, True, False, semantics)

    return transfer


_batched_put = _transfer()


def put_rows(leaves: list[Any], sharding: Any, process_count: int, axis: int = 0) -> list[jax.Array]:
    """This process's rows of each leaf as global arrays split as ``sharding`` says (rows on ``axis``;
    with several processes each contributes its own rows, in process order).

    Called for every batch, on the thread that dispatches the steps: on a small host its time is time
    the devices' compute threads lose. On one process, ``jax.device_put`` spends about 200 us of host
    time per small batch in Python before the transfer itself; a :class:`RowsPlacer` per signature (kept
    here) does the same placement with the transfer alone.
    """
    n = len(leaves)
    if process_count > 1:
        return [jax.make_array_from_process_local_data(
            sharding, a, a.shape[:axis] + (a.shape[axis] * process_count,) + a.shape[axis + 1:]) for a in leaves]
    if _batched_put is not None and all(type(a) is np.ndarray for a in leaves):
        key = (sharding, *((a.shape, a.dtype) for a in leaves))
        placer = _PLACERS.get(key)
        if placer is None:
            if len(_PLACERS) >= 64:  # (a run has a handful of signatures: the full batches, a tail, a stack)
                _PLACERS.clear()
            placer = _PLACERS[key] = RowsPlacer([(a.shape, a.dtype) for a in leaves], sharding)
        return placer(leaves)
    if _shard_args is not None and all(type(a) is np.ndarray for a in leaves):
        try:
            # (device_put's default copy semantics: a host array may be read in place)
            return list(_shard_args([sharding] * n, [None] * n, [_CopySemantics.REUSE_INPUT] * n, leaves))
        except TypeError:  # pragma: no cover - a JAX whose shard_args takes other arguments
            pass
    return jax.device_put(leaves, [sharding] * n)


_PLACERS: dict[Any, RowsPlacer] = {}  # (sharding, each leaf's shape and dtype) -> its placer


class RowsPlacer:
    """Places host arrays of one signature (each leaf's shape and dtype) on one sharding, on one process: what
    JAX's transfer takes for each leaf (its abstract value, the devices, each one's slice of the rows) is
    worked out once, so that a loop of batches of that signature pays the transfer alone (about 4 us a leaf on
    a CPU host, where :func:`put_rows` spends 12-25 us in ``shard_args``' per-call Python).

    Args:
      specs: each leaf's ``(shape, dtype)``, in the order :meth:`__call__` takes the leaves.
      sharding: where every leaf goes (e.g. the batch sharding).
    """

    def __init__(self, specs: list[tuple[tuple[int, ...], Any]], sharding: Any) -> None:
        self._sharding = sharding
        self.dtypes = [np.dtype(d) for _, d in specs]  # (what each leaf must be given as)
        self._items: list[tuple[Any, list[Any], tuple[Any, ...] | None, bool]] = []
        for shape, dtype in specs:
            where = sharding.addressable_devices_indices_map(tuple(shape))
            devices, slices = list(where), tuple(where.values())
            whole = len(devices) == 1 and all(s == slice(None) for s in slices[0])
            aval = _ShapedArray(tuple(shape), np.dtype(dtype)) if _batched_put is not None else None
            # A slice that several devices hold (a batch split over some mesh axes only) is transferred as
            # JAX's default does: this jaxlib refuses a copy read until done for a host buffer sent twice.
            distinct = len({tuple((s.start, s.stop, s.step) for s in index) for index in slices}) == len(slices)
            # On an accelerator, JAX's default: the transfer jax.jit gives a numpy argument (the hand-written
            # loop's), which aliases nothing there. A copy read until done held the TPU v5e's host longer, the
            # more so the larger the batch (Flax's MNIST CNN, @strategy.jit against Flax's loop: 0.88 at batch
            # 32 and 0.78 at 256 with it, 1.03 at 32 without; benchmarks/README.md).
            copy = distinct and all(d.platform == "cpu" for d in devices)
            self._items.append((aval, devices, None if whole else slices, copy))

    def __call__(self, leaves: list[np.ndarray]) -> list[jax.Array]:
        """Each leaf (a numpy array of its signature) as a global array laid out as the sharding says."""
        if _batched_put is None:  # pragma: no cover - a JAX without the transfer: device_put
            return list(jax.device_put(leaves, [self._sharding] * len(leaves)))
        sharding = self._sharding
        return [_batched_put(aval, sharding, [a] if slices is None else [a[i] for i in slices], devices, copy)
                for a, (aval, devices, slices, copy) in zip(leaves, self._items)]


def host_rows(mesh: BatchMesh) -> bool:
    """Whether a compiled step on ``mesh`` may be given a batch's rows as the host's numpy arrays, for JAX's own
    dispatch to transfer them (as ``jax.jit`` does the numpy batch of Flax's own loop): one device of one process,
    where the rows need no split and no gathering, and no transfer guard set against the implicit transfer that
    is (one that logs or refuses it: the rows are placed as on several devices).

    The dispatch's transfer is JAX's C++; placing the rows first (:class:`RowsPlacer`) makes a ``jax.Array`` per
    leaf from Python, which on the CPU proxy (benchmarks/host_proxy.py, one process alternating the two) cost
    ``Trainer.fit`` a quarter of its host time a step: 89 against 67 us, Flax's loop 66.
    """
    if mesh.process_count != 1 or len(mesh.devices) != 1:
        return False
    guard = getattr(jax.config, "jax_transfer_guard_host_to_device", None) or getattr(jax.config,
                                                                                       "jax_transfer_guard", None)
    return guard in (None, "allow")


def _host(a: Any) -> Any:
    """``a`` as a step takes it from the host: a numpy array in JAX's dtype (``float64`` -> ``float32`` unless JAX
    runs in x64), as the program was compiled and planned for; anything else as it is."""
    if type(a) is not np.ndarray:
        return a
    wanted = jax.dtypes.canonicalize_dtype(a.dtype)
    return a if a.dtype == wanted else a.astype(wanted)


def _kept(batch: Batch, sharding: Any, put: Any) -> list[Any] | None:
    """``to_global(host=True)``'s ``x``, ``y``, ``sample_weight`` and ``mask``: the host's arrays (:func:`_host`),
    the shared constants placed once; ``None`` when a leaf is no numpy array (placed as ever, then)."""
    out: list[Any] = []
    for a in (batch.x, batch.y, batch.sample_weight, batch.mask):
        if type(a) is np.ndarray:  # (a lone array: no tree walk, once per step)
            out.append(cached_put(a, sharding, put) if is_shared(a) else _host(a))
            continue
        leaves, treedef = jax.tree.flatten(a)
        if not all(type(leaf) is np.ndarray for leaf in leaves):
            return None
        out.append(jax.tree.unflatten(treedef, [_host(leaf) for leaf in leaves]))
    return out


def to_global(batch: Batch, mesh: BatchMesh, *, stacked: bool = False, host: bool = False) -> Batch:
    """Places this process's rows as one global array per leaf, split over the batch axis.

    Args:
      batch: this process's rows; stacked: the batch has a leading steps axis (rows are axis 1).
      host: leave the rows that change from batch to batch (``x``, ``y``, a short batch's mask, weights) as
        the host's numpy arrays, for the step's dispatch to transfer: only where :func:`host_rows` says so
        (the batch's constants, its count and a full batch's mask, are placed once all the same).
    """
    sharding = mesh.stacked_batch_sharding if stacked else mesh.batch_sharding
    count = mesh.process_count
    axis = 1 if stacked else 0

    def put(a: np.ndarray) -> jax.Array:
        return put_rows([a], sharding, count, axis)[0]

    def put_replicated(a: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(a.shape, mesh.replicated, lambda idx: a[idx])

    num_real = None
    if batch.num_real is not None:
        value = np.asarray(batch.num_real, np.float32)
        num_real = cached_put(value, mesh.replicated, put_replicated)
    if host and not stacked:
        kept = _kept(batch, sharding, put)
        if kept is not None:
            x, y, sample_weight, mask = kept
            return Batch(x, y, sample_weight, mask, num_real, batch.rows, batch.weighted)
    # Every per-step leaf in one transfer: a device_put per leaf costs ~3x as much host time (measured
    # 530 against 145 us for an MLP batch's x and y on one CPU device), time the step cannot hide on
    # a small host.
    fresh: dict[str, Any] = {"x": batch.x, "y": batch.y}
    constants = {}  # weights and mask of full, unweighted batches: already on the devices
    for name in ("sample_weight", "mask"):
        a = np.asarray(getattr(batch, name))
        if is_shared(a):
            constants[name] = cached_put(a, sharding, put)
        else:
            fresh[name] = a
    leaves, treedef = jax.tree.flatten(fresh)
    placed = put_rows(leaves, sharding, count, axis)
    out = {**jax.tree.unflatten(treedef, placed), **constants}
    return Batch(out["x"], out["y"], out["sample_weight"], out["mask"], num_real, batch.rows, batch.weighted)
