"""``MirroredStrategy``: the devices a job trains on, and how values are laid out on them.

A strategy is a one-axis :class:`jax.sharding.Mesh` (axis ``"batch"``) over every device of the job.
Variables are replicated (``NamedSharding(mesh, P())``); every global batch is split over the batch axis
(``NamedSharding(mesh, P("batch"))``). The train step is written once for the global batch and jitted
with these shardings, so XLA inserts the cross-device reduction of gradients and metrics itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mirrorax import cluster, consistency
from mirrorax._host import host_value
from mirrorax.dispatch import InFlight, OutShardings, StrategyFunction, check_out_shardings
from mirrorax.replica import ReduceOp, resolve_op

if TYPE_CHECKING:
    from mirrorax.inputs.distributed import DistributedDataset
    from mirrorax.inputs.iterables import PerProcessDataset

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy", "InputContext", "get_strategy"]

BATCH_AXIS = "batch"

ShardMode = Literal["optimizer", "all"] | None
SHARD_MODES: tuple[ShardMode, ...] = (None, "optimizer", "all")
_SHARDED_ROLES = {"optimizer": ("optimizer",), "all": ("params", "optimizer")}
#: Variables with fewer elements stay replicated in the sharded modes: their collectives' fixed cost is
#: more than splitting saves (a 128x128 kernel is 64 KiB in float32). Measured at 8 devices with
#: ``benchmarks/shard_threshold.py``: splitting is 1.1-1.6x slower below this size, at parity
#: ("optimizer") or faster ("all") from it (docs/plan.md has the numbers).
SHARD_MIN_SIZE = 16384

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
        may be given as ``jax.Device`` objects, integer ids or Keras's names (``"cpu:0"``, as
        ``keras.distribution.list_devices()`` gives them), in a sequence or a numpy array; or as a
        ``jax.sharding.Mesh`` or ``keras.distribution.DeviceMesh`` (its devices). An array or mesh with
        more than one axis longer than 1 (model parallelism) is refused.
      shard: how the training state is laid out over the same devices (the maths, and so the result,
        is the same in every mode; what changes is the memory each device holds):

        * ``None``: replicated: every device holds the whole state (parameters, gradients, optimizer
          state), as TF's ``MirroredStrategy``.
        * ``"optimizer"``: the optimizer state and its update are split over the devices (each updates its
          slice of every large variable; the new values are gathered): ZeRO-1 / weight-update sharding.
        * ``"all"``: the parameters are split too, gathered for compute and never stored whole: ZeRO-3 /
          FSDP.

        A variable with fewer than :data:`SHARD_MIN_SIZE` elements, or no axis that divides by the
        device count, stays replicated; so does non-trainable state (BatchNorm statistics).
      max_in_flight: calls of :meth:`jit` / :meth:`run` functions allowed to be outstanding (>= 1): after
        dispatching call ``i`` the host waits for call ``i - max_in_flight + 1``.

    Raises:
      ValueError: ``devices`` is empty, has duplicates, mixes platforms or has several long axes; ``shard``
        is not a mode.

    Example:
      >>> strategy = MirroredStrategy()
      >>> strategy.num_replicas_in_sync == len(jax.devices())
      True
    """

    def __init__(self, devices: Sequence[jax.Device | int | str] | np.ndarray | Mesh | Any | None = None, *,
                 shard: ShardMode = None, max_in_flight: int = 2) -> None:
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES}: None (replicated), 'optimizer' (ZeRO-1: optimizer "
                             f"state split over the devices) or 'all' (ZeRO-3 / FSDP: parameters too); received "
                             f"{shard!r}.")
        self._shard = shard
        self._window = InFlight(max_in_flight)  # validates max_in_flight before anything starts
        self._run_functions: dict[Any, StrategyFunction] = {}
        cluster.maybe_initialize_from_env()
        self._devices = _validate_devices(devices)
        self._mesh = jax.make_mesh((len(self._devices),), (BATCH_AXIS,),
                                   axis_types=(jax.sharding.AxisType.Auto,), devices=self._devices)
        self._replicated = NamedSharding(self._mesh, P())
        self._batch_sharding = NamedSharding(self._mesh, P(BATCH_AXIS))
        self._stacked_batch_sharding = NamedSharding(self._mesh, P(None, BATCH_AXIS))  # steps_per_execution
        local = [d for d in self._devices if d.process_index == jax.process_index()]
        self._local_devices = tuple(local)
        counts: dict[int, int] = {}
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

    @property
    def max_in_flight(self) -> int:
        """Calls allowed to be outstanding in :attr:`in_flight` (the ``max_in_flight`` argument)."""
        return self._window.depth

    @property
    def in_flight(self) -> InFlight:
        """The strategy's one dispatch window (:class:`mirrorax.dispatch.InFlight`).

        Every call of a :meth:`jit` or :meth:`run` function is pushed into it: after dispatching call
        ``i`` the host waits for call ``i - max_in_flight + 1``. A loop that calls a compiled
        ``program`` itself (``strategy.jit(fn).program(*args)``) pushes its calls here too, with
        ``push(aux, ready, on_done)``, and ``drain()`` s it where it needs every call done.
        """
        return self._window

    @property
    def shard(self) -> ShardMode:
        """The state layout mode: ``None`` (replicated), ``"optimizer"`` or ``"all"``."""
        return self._shard

    def state_sharding(self, shape: Sequence[int], role: str) -> NamedSharding:
        """Where a state variable of ``shape`` lives: split over the batch axis on its largest axis that
        divides by the device count, when the mode shards its ``role`` (``"params"`` or ``"optimizer"``)
        and it has at least :data:`SHARD_MIN_SIZE` elements; replicated otherwise.

        Example:
          >>> MirroredStrategy(shard="all").state_sharding((1024, 512), "params").spec  # on 8 devices
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

    def place(self, tree: Any, shardings: Any, *, broadcast: bool = True) -> Any:
        """``tree`` placed with ``shardings`` (a matching tree of ``NamedSharding``), in buffers of its own.

        ``broadcast``: on several processes every process takes process 0's values (see :meth:`replicate`).
        """
        if broadcast and self.process_count > 1:
            tree = consistency.broadcast_from_primary(tree)
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

    @property
    def batch_axis(self) -> str:
        """The mesh axis name every global batch is split over (``"batch"``)."""
        return BATCH_AXIS

    # -- the custom-loop API -----------------------------------------------------------------------
    def replicate(self, tree: Any) -> Any:
        """A copy of ``tree`` on every device (``NamedSharding(mesh, P())``), as one state.

        The copy never aliases the caller's buffers (a donated step cannot delete them). On several
        processes every replica holds process 0's values (broadcast): the replicas really are one state,
        even when each process initialised its own model differently.

        Args:
          tree: a pytree of arrays (numpy, ``jax.Array``, Python numbers).

        Returns:
          The same structure of replicated ``jax.Array`` s.

        Example:
          >>> state = strategy.replicate({"params": params, "opt": optimizer.init(params)})
        """
        return self._replicate(tree, broadcast=True)

    def _replicate(self, tree: Any, *, broadcast: bool) -> Any:
        return self.place(tree, jax.tree.map(lambda _: self._replicated, tree), broadcast=broadcast)

    def experimental_distribute_dataset(self, data: Any, *, batch_size: int | None = None, shuffle: bool = False,
                                        seed: int = 0) -> DistributedDataset:
        """Global batches of ``data``, split over the devices, as :class:`mirrorax.DistributedBatch` es.

        Args:
          data: an iterable of global batches (numpy, ``tf.data``, grain, a torch ``DataLoader``; any
            structure per item), a tuple/dict of arrays cut into global batches of ``batch_size``, or the
            result of :meth:`distribute_datasets_from_function` (each process's own rows).
          batch_size: the global batch, for arrays (over all devices and processes).
          shuffle: shuffle arrays every pass, by ``(seed, pass)``: the same order on any device count.
          seed: the shuffle seed.

        Returns:
          A :class:`mirrorax.DistributedDataset`: each ``iter()`` is one pass; each batch has the same
          fixed shape (padded, with ``mask`` and ``num_real``), so a step compiles once.

        Example:
          >>> dist = strategy.experimental_distribute_dataset((x, y), batch_size=256, shuffle=True)
          >>> for batch in dist:
          ...     state, loss = step(state, batch)
        """
        from mirrorax.inputs.distributed import DistributedDataset

        return DistributedDataset(self, data, batch_size=batch_size, shuffle=shuffle, seed=seed)

    distribute_dataset = experimental_distribute_dataset

    def jit(self, fn: Callable[..., Any] | None = None, *, donate_argnums: int | Sequence[int] = (),
            out_shardings: OutShardings = None) -> Any:
        """``fn`` compiled for the global view on this strategy's devices; usable as a decorator.

        ``fn`` sees whole global batches; XLA partitions it over the batch axis and inserts the
        all-reduce. Compiled once per input signature. Replicated arguments stay replicated, batch
        arguments stay split. Every call is pushed into :attr:`in_flight`: at most ``max_in_flight`` calls
        are outstanding, without the caller writing any waits.

        Args:
          fn: the step, e.g. ``step(state, batch) -> (state, loss)``.
          donate_argnums: arguments whose buffers the call may reuse (the state: no copy per step).
          out_shardings: where the outputs live. ``None``: an output shaped like an argument keeps that
            argument's layout, batch-shaped outputs stay split, the rest is replicated (found by tracing
            ``fn`` once more per signature). Else a ``jax.sharding.Sharding`` or a pytree of them (a prefix
            of the outputs' tree, as ``jax.jit`` takes), or a callable that takes the positional
            arguments and returns one, called once per signature (the arguments may be
            ``jax.ShapeDtypeStruct`` s there). A callable may return ``None`` for the default rules.

        Returns:
          A :class:`mirrorax.dispatch.StrategyFunction`: call it like ``fn``; ``.program(*args)`` gives the
          compiled program of one signature for a loop that pushes into :attr:`in_flight` itself;
          ``.lower(*args)`` gives ``jax.jit``'s lowering.

        Raises:
          TypeError: ``out_shardings`` is neither ``None``, a callable nor a pytree of shardings.

        Example:
          >>> @strategy.jit(donate_argnums=0)
          ... def step(state, batch):
          ...     loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
          ...     return update(state, grads), loss
          >>> # layouts known ahead: the state keeps the one it came with, the loss is replicated
          >>> step = strategy.jit(step_fn, donate_argnums=0, out_shardings=lambda state, batch: (
          ...     jax.tree.map(lambda a: a.sharding, state), strategy.replicated))
        """
        check_out_shardings(out_shardings)
        if fn is None:
            return lambda f: StrategyFunction(self, f, donate_argnums=donate_argnums, out_shardings=out_shardings)
        return StrategyFunction(self, fn, donate_argnums=donate_argnums, out_shardings=out_shardings)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Runs ``fn`` once per replica on that replica's rows (TF's ``strategy.run``).

        Inside ``fn``, :func:`mirrorax.get_replica_context` gives ``replica_id_in_sync_group``,
        ``num_replicas_in_sync`` and ``all_reduce``. Batch-split arguments (a ``DistributedBatch``) arrive
        as the replica's rows, others whole. The gradient of a replicated argument (the state) comes out
        already summed over the replicas (JAX inserts the all-reduce, as TF's ``apply_gradients`` does):
        with :func:`mirrorax.compute_average_loss` it is the gradient of the global mean, with no
        ``all_reduce`` to write. Outputs ``fn`` made equal on every replica (all-reduced values, a state
        updated from those gradients) come back replicated; the others as global
        arrays holding one slice per replica (a scalar per replica gives a ``(num_replicas,)`` array), for
        :meth:`reduce` and :meth:`gather`. Compiled once per ``fn`` and signature (pass the same
        function each step); the same dispatch bound as :meth:`jit`.

        Example:
          >>> def replica_step(state, batch):
          ...     # loss_fn ends in mx.compute_average_loss: this replica's share of the global mean
          ...     loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)  # grads: summed already
          ...     return update(state, grads), loss
          >>> state, per_replica_loss = strategy.run(replica_step, args=(state, batch))
          >>> strategy.reduce("sum", per_replica_loss)
        """
        wrapped = self._run_functions.get(fn)
        if wrapped is None:
            wrapped = self._run_functions[fn] = StrategyFunction(
                self, lambda a, k: fn(*a, **k), per_replica=True)
        return wrapped(tuple(args), dict(kwargs or {}))

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """``value`` (a pytree) reduced over the replicas, as host numpy, the same on every process.

        A per-replica value (from :meth:`run`, or any array split over the batch axis) is taken apart into
        its replicas' values (a ``(num_replicas,)`` array: one scalar each; else equal slices of axis 0)
        and those are combined element-wise. A replicated value counts as the same value on every
        replica (TF's rule for mirrored values): ``"sum"`` multiplies it by ``num_replicas_in_sync``.
        With ``axis``, each replica's value is also reduced along that axis (e.g. ``axis=0`` over examples).

        Args:
          op: ``"sum"``, ``"mean"`` or ``"max"`` (or :class:`mirrorax.ReduceOp`).
          value: the pytree to reduce.
          axis: an axis of each replica's value to reduce too, or ``None``.

        Example:
          >>> total = strategy.reduce("sum", per_replica_loss)
        """
        kind = resolve_op(op)
        ops: dict[str, Callable[..., Any]] = {"sum": np.sum, "mean": np.mean, "max": np.max}
        combine = ops[kind]

        def one(v: Any) -> Any:
            per = self._per_replica_values(v)
            out = combine(per, axis=0)
            return combine(out, axis=axis) if axis is not None else out

        return jax.tree.map(one, value)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """The replicas' values of ``value`` (a pytree) concatenated along ``axis``, as host numpy on every process.

        For a batch-split array and ``axis=0`` this is the global array itself (padding rows included:
        use the batch's ``mask`` to drop them). A replicated value is concatenated ``num_replicas_in_sync``
        times, as TF does for mirrored values.

        Example:
          >>> predictions = strategy.gather(strategy.run(predict_fn, args=(params, batch)))
        """
        def one(v: Any) -> Any:
            per = self._per_replica_values(v)
            if per.ndim == 1:  # one scalar per replica
                return per
            return np.concatenate(list(per), axis=axis)

        return jax.tree.map(one, value)

    def _per_replica_values(self, v: Any) -> np.ndarray:
        """``(num_replicas, ...)``: each replica's value of ``v``."""
        n = self.num_replicas_in_sync
        spec = getattr(v.sharding, "spec", None) if isinstance(v, jax.Array) and v.ndim else None
        split = spec is not None and len(spec) > 0 and spec[0] == BATCH_AXIS
        host = host_value(v)
        if split:
            if host.shape[0] == n and host.ndim == 1:
                return host
            return host.reshape((n, host.shape[0] // n) + host.shape[1:])
        return np.broadcast_to(host, (n,) + host.shape)

    def scope(self) -> contextlib.AbstractContextManager[MirroredStrategy]:
        """Makes this the strategy that :func:`get_strategy` and ``Trainer(model)`` use.

        A Keras model created or compiled inside the scope belongs to this strategy, as in TF: its own
        ``fit``, ``evaluate``, ``predict`` and ``*_on_batch`` then train on every device of the strategy
        (through a :class:`mirrorax.Trainer`), inside the scope or after it. Models made outside any
        scope are untouched.

        Example:
          >>> with MirroredStrategy().scope() as s:
          ...     assert get_strategy() is s
        """
        return _enter(self)

    def input_context(self) -> InputContext:
        """This process's :class:`InputContext`."""
        return InputContext(self.process_count, self.process_index, self.num_replicas_in_sync)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any]) -> PerProcessDataset:
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
        from mirrorax.inputs.iterables import PerProcessDataset

        return PerProcessDataset(dataset_fn(self.input_context()), self.input_context())

    def __repr__(self) -> str:
        kinds = sorted({d.platform for d in self._devices})
        return (f"MirroredStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"processes={self.process_count}, platform={','.join(kinds)})")


MultiWorkerMirroredStrategy = MirroredStrategy
"""The TF name for a strategy whose devices span several processes or hosts; the same class here."""


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


def current_scope() -> MirroredStrategy | None:
    """The strategy of the innermost enclosing ``scope()`` of this thread, or ``None`` (no default)."""
    stack = getattr(_scope, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _enter(strategy: MirroredStrategy) -> Iterator[MirroredStrategy]:
    from mirrorax import _keras_env, keras_fit

    _keras_env.check_scope()  # Keras on another backend, a keras.distribution: said here, not at fit
    stack = getattr(_scope, "stack", None)
    if stack is None:
        stack = _scope.stack = []
    stack.append(strategy)
    keras_fit.enter(strategy)  # models made or compiled in the scope belong to it (see keras_fit)
    try:
        yield strategy
    finally:
        keras_fit.leave()
        stack.pop()


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


def _validate_devices(devices: Any) -> tuple[jax.Device, ...]:
    all_devices = jax.devices()
    if devices is None:
        return tuple(all_devices)
    devices = _device_list(devices)
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a sequence of jax.Device (or device ids, or names like 'cpu:0'), a numpy "
                        f"array of them, a jax.sharding.Mesh, a keras.distribution.DeviceMesh or None; received "
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
