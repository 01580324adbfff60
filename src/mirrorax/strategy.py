"""``MirroredStrategy``: the devices a job trains on (a :class:`mirrorax.mesh.BatchMesh`), its dispatch window
and the public API.

A strategy is a :class:`jax.sharding.Mesh` over every device of the job: one axis (``"batch"``) by
default, or the named axes of a mesh given (``mesh=``, ``layout_map=``). Variables are replicated
(``NamedSharding(mesh, P())``) unless ``shard=`` or a layout map splits them; every global batch is split
over the batch axes (``NamedSharding(mesh, P("batch"))``). The train step is written once for the global
batch and jitted with these shardings, so XLA inserts the cross-device reduction of gradients and metrics itself.

Its devices, mesh, layouts and placement are the attributes of :class:`mirrorax.mesh.BatchMesh`, which a
strategy is (documented there once); this module adds the dispatch window and the custom-loop API. It
stands on the mesh (:mod:`mirrorax.mesh`), the dispatch window (:mod:`mirrorax.steps.dispatch`) and
the inputs (:mod:`mirrorax.inputs`); nothing below imports it back. What happens when a scope opens
beyond making the strategy current (e.g. ``mirrorax.keras.fit`` routing Keras models) is registered from above
with :func:`on_scope`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import mirrorax.cluster.join as cluster
from mirrorax._host import host_value
from mirrorax.cluster.resolver import ClusterResolver
from mirrorax.inputs.distributed import DistributedDataset
from mirrorax.inputs.iterables import PerProcessDataset
from mirrorax.inputs.source import InputContext
from mirrorax.mesh import BatchMesh, ShardMode, check_shard
from mirrorax.steps.binding import JitFunction
from mirrorax.steps.dispatch import InFlight, OutShardings, check_out_shardings
from mirrorax.steps.replica import ReduceOp, RowValues, leaves_with_rows, resolve_op
from mirrorax.steps.stateful import StatefulFunction, check_not_tf_function

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy", "InputContext", "get_strategy", "current_scope",
           "on_scope"]

ScopeHook = Callable[["MirroredStrategy"], None]

_scope = threading.local()
_scope_hooks: list[tuple[ScopeHook, ScopeHook | None]] = []


class MirroredStrategy(BatchMesh):
    """Synchronous data parallelism over every device of the job.

    A strategy is a :class:`mirrorax.mesh.BatchMesh` (the devices and every layout on them: :attr:`mesh`,
    :attr:`devices`, :attr:`num_replicas_in_sync`, :attr:`replicated`, :attr:`batch_sharding`,
    :meth:`state_sharding`, :meth:`place`, ...) with one dispatch window (:attr:`in_flight`) and the
    custom-loop API (:meth:`replicate`, :meth:`experimental_distribute_dataset`, :meth:`jit`, :meth:`run`,
    :meth:`reduce`, :meth:`gather`, :meth:`scope`).

    Creating one joins a multi-process job first when the environment describes one
    (``MIRRORAX_COORDINATOR``/``MIRRORAX_NUM_PROCESSES``/``MIRRORAX_PROCESS_ID``, ``TF_CONFIG``, or what
    ``jax.distributed`` detects: SLURM, Open MPI, Kubernetes).

    Args:
      devices: the devices to use; ``None`` means every device of the job (``jax.devices()``). Devices
        may be given as ``jax.Device`` objects, integer ids or Keras's names (``"cpu:0"``, as
        ``keras.distribution.list_devices()`` gives them), in a sequence or a numpy array; or as a
        ``jax.sharding.Mesh`` or ``keras.distribution.DeviceMesh`` (its devices). An array or mesh with
        more than one axis longer than 1 is refused here: pass it as ``mesh=`` or ``layout_map=``.
      shard: how the training state is laid out over the same devices (the maths, and so the result,
        is the same in every mode; what changes is the memory each device holds):

        * ``None``: replicated: every device holds the whole state (parameters, gradients, optimizer
          state), as TF's ``MirroredStrategy``.
        * ``"optimizer"``: the optimizer state and its update are split over the devices (each updates its
          slice of every large variable; the new values are gathered): ZeRO-1 / weight-update sharding.
        * ``"all"``: the parameters are split too, gathered for compute and never stored whole: ZeRO-3 /
          FSDP.

        A variable with fewer than :data:`mirrorax.mesh.SHARD_MIN_SIZE` elements, or no axis that divides by the
        device count, stays replicated; so does non-trainable state (BatchNorm statistics). On a mesh of
        several axes the split is over :attr:`shard_axis` only (the last axis), the state replicated over the
        others: hybrid sharding (HSDP); under a layout map it is over the batch axis.
      mesh: instead of ``devices``, a ``jax.sharding.Mesh`` or ``keras.distribution.DeviceMesh`` with named
        axes, e.g. :func:`mirrorax.hybrid_mesh` (2-D: one row per host). Every global batch is split over
        ``batch_axes`` (default: every axis, i.e. every device holds its own rows).
      batch_axes: the mesh axes the batch is split over (a name or a tuple of names); default: every axis
        of ``mesh``, the first axis of a layout map's mesh (Keras's ``batch_dim_name``).
      layout_map: a ``keras.distribution.LayoutMap`` (as ``keras.distribution.ModelParallel`` takes it, e.g.
        ``GemmaBackbone.get_layout_map(device_mesh)``): its ``device_mesh`` is the strategy's mesh and each
        variable whose path a key matches (``re.fullmatch``) is laid out as its layout says (optimizer slots
        as their variable); the others are replicated; the batch is split over ``batch_axes``.
      max_in_flight: calls of :meth:`jit` / :meth:`run` functions allowed to be outstanding (>= 1): after
        dispatching call ``i`` the host waits for call ``i - max_in_flight + 1``.

    Raises:
      ValueError: ``devices`` is empty, has duplicates, mixes platforms or has several long axes; ``shard``
        is not a mode; more than one of ``devices``, ``mesh`` and ``layout_map``; ``batch_axes`` names an
        axis the mesh lacks; a slice of the batch would lie on several processes.

    Example:
      >>> strategy = MirroredStrategy()
      >>> strategy.num_replicas_in_sync == len(jax.devices())
      True
    """

    def __init__(self, devices: Sequence[jax.Device | int | str] | np.ndarray | Mesh | Any | None = None, *,
                 shard: ShardMode = None, max_in_flight: int = 2, mesh: Mesh | Any | None = None,
                 batch_axes: str | Sequence[str] | None = None, layout_map: Any = None) -> None:
        check_shard(shard)
        self._window = InFlight(max_in_flight)  # validates max_in_flight before anything starts
        self._run_functions: dict[Any, StatefulFunction] = {}
        cluster.maybe_initialize_from_env()  # before JAX lists the devices: a job's devices span its processes
        super().__init__(devices, shard=shard, mesh=mesh, batch_axes=batch_axes, layout_map=layout_map)

    @property
    def batch_mesh(self) -> BatchMesh:
        """The :class:`mirrorax.mesh.BatchMesh` this strategy is (the strategy itself): its devices and every
        layout, what the inputs and the dispatch of steps are written against."""
        return self

    @property
    def max_in_flight(self) -> int:
        """Calls allowed to be outstanding in :attr:`in_flight` (the ``max_in_flight`` argument)."""
        return self._window.depth

    @property
    def in_flight(self) -> InFlight:
        """The strategy's one dispatch window (:class:`mirrorax.steps.dispatch.InFlight`).

        Every call of a :meth:`jit` or :meth:`run` function is pushed into it: after dispatching call
        ``i`` the host waits for call ``i - max_in_flight + 1``. A loop that calls a compiled
        ``program`` itself (``strategy.jit(fn).program(*args)``) pushes its calls here too, with
        ``push(aux, ready, on_done)``, and ``drain()`` s it where it needs every call done.
        """
        return self._window

    # -- the custom-loop API -----------------------------------------------------------------------
    def replicate(self, tree: Any, *, copy: bool = False) -> Any:
        """``tree`` on every device (``NamedSharding(mesh, P())``), as one state.

        As ``jax.device_put`` does, an array already on the strategy's devices keeps its buffers: one
        laid out so is used as it is, one on some of them is moved with no copy where it already lies.
        The state is then never twice on a device (the keras.io guide's replicated Keras variables: a
        219M-parameter LM held 5,218 MiB on a TPU with copies, against the hand-written loop's 2,708), and
        a step that donates it frees the arrays given, as it would after ``jax.device_put``: pass
        ``copy=True`` to keep them. On several processes every replica holds process 0's values
        (broadcast, always a copy): the replicas really are one state, even when each process
        initialised its own model differently.

        Args:
          tree: a pytree of arrays (numpy, ``jax.Array``, Python numbers).
          copy: buffers of its own, never the caller's (a donated step then cannot delete them).

        Returns:
          The same structure of replicated ``jax.Array`` s.

        Example:
          >>> state = strategy.replicate({"params": params, "opt": optimizer.init(params)})
        """
        return self.place(tree, self.replicated, take=not copy)

    def experimental_distribute_dataset(self, data: Any, *, batch_size: int | None = None, shuffle: bool = False,
                                        seed: int = 0, drop_remainder: bool = False) -> DistributedDataset:
        """Global batches of ``data``, split over the devices, as :class:`mirrorax.DistributedBatch` es.

        Args:
          data: an iterable of global batches (numpy, ``tf.data``, grain, a torch ``DataLoader``; any
            structure per item), a tuple/dict of arrays cut into global batches of ``batch_size``, or the
            result of :meth:`distribute_datasets_from_function` (each process's own rows).
          batch_size: the global batch, for arrays (over all devices and processes).
          shuffle: shuffle arrays every pass, by ``(seed, pass)``: the same order on any device count.
          seed: the shuffle seed.
          drop_remainder: leave out a batch with fewer than ``batch_size`` rows, as ``tf.data``'s
            ``batch(..., drop_remainder=True)`` does (arrays: each pass's short last batch; an iterable:
            any short item). ``False`` (default): every example is used, as by ``tf.data``. A short batch
            is placed padded (the fixed shape) and a step sees what TF's would: in the global view
            (:meth:`jit`) the batch cut to its real rows; per replica (:meth:`run`) the padding stays,
            masked (Keras metrics and :func:`mirrorax.compute_average_loss` leave it out; a
            :class:`mirrorax.PaddingIgnoredWarning` names a result that lets it in). Not for
            :meth:`distribute_datasets_from_function` on several processes (batch there).

        Returns:
          A :class:`mirrorax.DistributedDataset`: each ``iter()`` is one pass; each batch has the same
          fixed shape (padded, with ``mask``, ``num_real`` and, where the host knows it, the static count
          ``rows``): a step compiles once for the full batches and once for a short one. Its arrays,
          unpacked in the loop (``for x, y in dist``), reach a step as the whole batch's do (a dataset of
          one array yields that array). On one device of one process nothing needs splitting: the arrays
          stay the host's (numpy; a short batch its real rows), and the step's dispatch transfers them as
          ``jax.jit`` does a numpy argument.

        Example:
          >>> dist = strategy.experimental_distribute_dataset((x, y), batch_size=256, shuffle=True)
          >>> for batch in dist:
          ...     state, loss = step(state, batch)
        """
        return DistributedDataset(self, data, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                  drop_remainder=drop_remainder, window=self._window)

    distribute_dataset = experimental_distribute_dataset

    def jit(self, fn: Callable[..., Any] | None = None, *, donate_argnums: int | Sequence[int] = (),
            donate_argnames: str | Sequence[str] | None = None, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] | None = None, out_shardings: OutShardings = None,
            stateful: bool = True) -> Any:
        """``fn`` compiled for the global view on this strategy's devices; usable as a decorator.

        ``fn`` sees whole global batches; XLA partitions it over the batch axis and inserts the
        all-reduce. Compiled once per input signature. Replicated arguments stay replicated, batch
        arguments stay split. Every call is pushed into :attr:`in_flight`: at most ``max_in_flight`` calls
        are outstanding, without the caller writing any waits.

        A :class:`mirrorax.DistributedBatch` argument that knows its real rows (arrays, iterables of global
        batches) reaches ``fn`` cut to them, as TF's short last batch is: ``fn`` is the single-device
        program on those rows (a plain mean, a Keras metric, BatchNormalization and every per-example
        value see the real rows only; one program per row count). An output with one row per example
        then holds those rows only (replicated); :meth:`gather` gives them once.

        A drop-in for ``@jax.jit`` and ``@nnx.jit`` where they stand: on a function or a method (``self``, e.g. a
        Flax NNX module, bound first), called with positional and keyword arguments, with static and donated
        arguments named by position or by name (:class:`mirrorax.steps.binding.JitFunction`).

        Args:
          fn: the step, e.g. ``step(state, batch) -> (state, loss)``.
          donate_argnums: arguments whose buffers the call may reuse (the state: no copy per step).
          donate_argnames: the same, by parameter name (``jax.jit``'s: either names the argument however it is
            passed).
          static_argnums: arguments that are Python values the program is specialised on (hashable; one program
            per distinct value), as ``jax.jit``'s.
          static_argnames: the same, by parameter name.
          out_shardings: where the outputs live. ``None``: an output shaped like an argument keeps that
            argument's layout, batch-shaped outputs stay split, the rest is replicated (found by tracing
            ``fn`` once more per signature). Else a ``jax.sharding.Sharding`` or a pytree of them (a prefix
            of the outputs' tree, as ``jax.jit`` takes), or a callable that takes the positional
            arguments and returns one, called once per signature (the arguments may be
            ``jax.ShapeDtypeStruct`` s there). A callable may return ``None`` for the default rules.
          stateful: let ``fn`` change objects in place, their state threaded through the program by the
            split/merge protocol (:mod:`mirrorax.steps.split_merge`, :mod:`mirrorax.steps.stateful`): Keras variables it
            reads and assigns (``model(x)``, ``optimizer.apply_gradients``, ``metric.update_state``), found by
            tracing ``fn`` once per signature (:mod:`mirrorax.keras.stateful`), and objects among its
            arguments, as ``@nnx.jit`` steps take Flax NNX modules, ``nnx.Optimizer``, metrics and
            ``nnx.Rngs`` (:mod:`mirrorax.nnx`): passed in as state, bound in the trace and written back
            after each call, kept on the devices. ``False`` skips both, for a step whose whole state is
            explicit.

        Returns:
          A :class:`mirrorax.steps.binding.JitFunction` over a
          :class:`mirrorax.steps.stateful.StatefulFunction`: call it like ``fn``; ``.program(*args)`` gives the
          compiled program of one signature (of a step that changes no object in place) for a loop that
          pushes into :attr:`in_flight` itself; ``.lower(*args)`` gives ``jax.jit``'s lowering.

        Raises:
          TypeError: ``out_shardings`` is neither ``None``, a callable nor a pytree of shardings; ``fn`` is
            a ``tf.function`` (a call with a Keras variable as an argument raises one too).

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

        def step(f: Callable[..., Any], donated: tuple[int, ...]) -> StatefulFunction:
            return StatefulFunction(self, self._window, f, donate_argnums=donated, out_shardings=out_shardings,
                                    objects=stateful)

        def make(f: Callable[..., Any]) -> JitFunction:
            return JitFunction(f, step, donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                               static_argnums=static_argnums, static_argnames=static_argnames)

        return make if fn is None else make(fn)

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

        Every replica holds as many rows, so a short batch's padding rows reach ``fn``, 0 in
        ``batch.mask``: each Keras metric's ``update_state`` with one value per row is given the mask as
        its ``sample_weight`` (times its own), :func:`mirrorax.compute_average_loss` leaves them out, and
        :meth:`gather`, :meth:`experimental_local_results` and ``reduce(..., axis=0)`` drop them from an
        output with one row per example. A result reduced over the rows without the mask is named by a
        :class:`mirrorax.PaddingIgnoredWarning`.

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
            check_not_tf_function(fn, "strategy.run")
            @functools.wraps(fn)
            def per_replica(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
                return fn(*a, **k)

            wrapped = self._run_functions[fn] = StatefulFunction(
                self, self._window, per_replica, per_replica=True, where="strategy.run")
        return wrapped(tuple(args), dict(kwargs or {}))

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """``value`` (a pytree) reduced over the replicas, as host numpy, the same on every process.

        A per-replica value (from :meth:`run`, or any array split over the batch axis) is taken apart into
        its replicas' values (a ``(num_replicas,)`` array: one scalar each; else equal slices of axis 0)
        and those are combined element-wise. A replicated value counts as the same value on every
        replica (TF's rule for mirrored values): ``"sum"`` multiplies it by ``num_replicas_in_sync``.
        With ``axis``, each replica's value is also reduced along that axis (e.g. ``axis=0`` over examples).

        Args:
          op: ``"sum"``, ``"mean"`` or ``"max"`` (any case: TF's ``"SUM"``), :class:`mirrorax.ReduceOp`, or
            ``tf.distribute.ReduceOp.SUM`` / ``MEAN``.
          value: the pytree to reduce.
          axis: an axis of each replica's value to reduce too, or ``None``. A value with one row per example
            of a batch with padding (a step's output, the batch, an array unpacked from it) takes ``axis=0``
            only: the op over its real rows (TF's reduction over the replicas and the examples; ``"mean"``
            divides by the real rows).

        Raises:
          ValueError: ``op`` is not a known reduction; a value with one row per example of a batch with padding
            and an ``axis`` other than 0.

        Example:
          >>> total = strategy.reduce("sum", per_replica_loss)
        """
        kind = resolve_op(op)
        ops: dict[str, Callable[..., Any]] = {"sum": np.sum, "mean": np.mean, "max": np.max}
        combine = ops[kind]

        def one(v: Any, rows: RowValues | None) -> Any:
            if rows is not None:  # one row per example of a batch with padding: its real rows
                if axis != 0:
                    raise ValueError(
                        f"reduce({kind!r}, value, axis={axis!r}) received a value with one row per example of a "
                        f"batch with padding (shape {tuple(np.shape(v))}): its replicas hold different numbers of "
                        "real rows, so they cannot be combined element-wise. Reduce over the examples too "
                        f"(strategy.reduce({kind!r}, value, axis=0)), or take the rows with strategy.gather(value).")
                return combine(self._real_rows(v, rows), axis=0)
            per = self._per_replica_values(v)
            out = combine(per, axis=0)
            return combine(out, axis=axis) if axis is not None else out

        leaves, treedef = leaves_with_rows(value, self.num_replicas_in_sync)
        return jax.tree.unflatten(treedef, [one(v, rows) for v, rows in leaves])

    def gather(self, value: Any, axis: int = 0) -> Any:
        """The replicas' values of ``value`` (a pytree) concatenated along ``axis``, as host numpy on every process.

        For a batch-split array and ``axis=0`` this is the global array itself. An output a :meth:`run` or
        :meth:`jit` step returned with one row per example of a batch with padding gives its real rows only,
        in order (the padding rows are dropped); so does such a batch, or an array unpacked from it
        (``x, y = batch``: ``strategy.gather(y)``). A replicated value is concatenated
        ``num_replicas_in_sync`` times, as TF does for mirrored values.

        Raises:
          ValueError: ``axis`` is not 0 for a value with one row per example of a batch with padding.

        Example:
          >>> predictions = strategy.gather(strategy.run(predict_fn, args=(params, batch)))
        """
        def one(v: Any, rows: RowValues | None) -> Any:
            if rows is not None:
                if axis != 0:
                    raise ValueError(
                        f"gather(value, axis={axis!r}) received a value with one row per example of a batch with "
                        f"padding (shape {tuple(np.shape(v))}): its replicas hold different numbers of real rows. "
                        "Gather it along its examples: strategy.gather(value, axis=0).")
                return self._real_rows(v, rows)
            per = self._per_replica_values(v)
            if per.ndim == 1:  # one scalar per replica
                return per
            return np.concatenate(list(per), axis=axis)

        leaves, treedef = leaves_with_rows(value, self.num_replicas_in_sync)
        return jax.tree.unflatten(treedef, [one(v, rows) for v, rows in leaves])

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's replicas' values of ``value`` (a pytree), one host-numpy tree per local replica,
        in mesh order (TF's ``strategy.experimental_local_results``).

        A per-replica value (from :meth:`run`) gives each replica's own scalar or rows (of a batch with
        padding, its real rows only: possibly none), and so does a batch of :meth:`experimental_distribute_dataset`
        or an array unpacked from it (TF's input guide prints its batches so); a replicated one gives the same
        value once per replica.

        Example:
          >>> per_replica_loss = strategy.run(train_step, args=(batch,))
          >>> strategy.experimental_local_results(per_replica_loss)   # (loss of replica 0, of replica 1, ...)
        """
        mine = [i for i, d in enumerate(self.devices) if d in set(self.local_devices)]
        leaves, treedef = leaves_with_rows(value, self.num_replicas_in_sync)
        per = [self._replica_rows(v, rows) if rows is not None else self._per_replica_values(v) for v, rows in leaves]
        return tuple(jax.tree.unflatten(treedef, [p[i] for p in per]) for i in mine)

    @staticmethod
    def _real_rows(v: Any, rows: RowValues) -> np.ndarray:
        """The real rows of ``v``, which holds one row per example of a batch with padding as ``rows`` says."""
        host = host_value(v)
        return host if rows.mask is None else host[host_value(rows.mask) > 0]

    def _replica_rows(self, v: Any, rows: RowValues) -> list[np.ndarray]:
        """Each replica's real rows of ``v`` (see :meth:`_real_rows`), in mesh order."""
        host, k = host_value(v), rows.per_replica
        real = np.ones(len(host), bool) if rows.mask is None else host_value(rows.mask) > 0
        return [host[r * k:(r + 1) * k][real[r * k:(r + 1) * k]] for r in range(self.num_replicas_in_sync)]

    def _per_replica_values(self, v: Any) -> np.ndarray:
        """``(num_replicas, ...)``: each replica's value of ``v``."""
        n = self.num_replicas_in_sync
        spec = getattr(v.sharding, "spec", None) if isinstance(v, jax.Array) and v.ndim else None
        split = spec is not None and len(spec) > 0 and spec[0] == self.batch_axis
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

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """This process's task in the job, as TF's strategy reports it: ``task_type`` (``"chief"``,
        ``"worker"``; ``None`` on one process without ``TF_CONFIG``), ``task_id`` and ``cluster_spec()``
        (``.as_dict()``), from ``TF_CONFIG`` or, in a job started any other way (``mirrorax launch``,
        SLURM), one ``worker`` per process. See :mod:`mirrorax.cluster.resolver`.

        Example:
          >>> r = strategy.cluster_resolver
          >>> is_chief = r.task_type in (None, "chief") or (r.task_type == "worker" and r.task_id == 0)
        """
        return ClusterResolver.for_this_process()

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any]) -> DistributedDataset:
        """This process's input pipeline ``dataset_fn(ctx)`` (``ctx`` an :class:`InputContext`), distributed.

        Each process reads only its own pipeline: TF's ``dataset_fn`` shards by
        ``ctx.num_input_pipelines`` / ``ctx.input_pipeline_id``. How its batches make up a global batch
        follows what the function asked ``ctx``:

        * batched by ``ctx.get_per_replica_batch_size(global_batch)`` (TF's way): each batch is one
          replica's, and each replica takes its own, so a global batch holds ``global_batch`` rows (each
          process's ``num_replicas_in_sync / num_input_pipelines`` consecutive batches);
        * batched by ``ctx.get_per_pipeline_batch_size(global_batch)``, or by a size of its own: each batch
          is this process's whole share of a global batch.

        A pipeline that asked for neither size and whose first batch holds one replica's rows of the
        ``batch_size`` given to ``fit`` or :meth:`experimental_distribute_dataset` is refused, naming both
        ways. Every process must yield its batches in step: a process whose pipeline ended while another's
        has data gets padding, masked.

        Returns:
          A :class:`mirrorax.DistributedDataset`: iterate it (``iter``, ``next``, ``for``) for
          :class:`mirrorax.DistributedBatch` es to pass to :meth:`run` or :meth:`jit`, as TF's; or pass it
          to ``Trainer.fit`` / ``model.fit`` (with ``batch_size=`` the global batch) or
          :meth:`experimental_distribute_dataset`.

        Example:
          >>> def dataset_fn(ctx):
          ...     batch = ctx.get_per_replica_batch_size(64)
          ...     return tf.data.Dataset.from_tensor_slices((x, y)).shard(
          ...         ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch)
          >>> iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
          >>> per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        """
        context = self.input_context()
        pipeline = PerProcessDataset(dataset_fn(context), context)
        return DistributedDataset(self, pipeline, window=self._window)

    def __repr__(self) -> str:
        kinds = sorted({d.platform for d in self.devices})
        shape = "" if self.mesh.axis_names == ("batch",) else f"mesh={dict(self.mesh.shape)}, "
        return (f"MirroredStrategy({shape}num_replicas_in_sync={self.num_replicas_in_sync}, "
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


def on_scope(enter: ScopeHook, leave: ScopeHook | None = None) -> None:
    """Registers ``enter(strategy)``, called each time a strategy's :meth:`~MirroredStrategy.scope` opens
    (the strategy already current), and ``leave(strategy)``, called when it closes (still current).

    For the layers above the strategy, which the strategy does not import: ``mirrorax.keras.fit`` registers the
    Keras checks and the routing of models made in a scope when it is imported (``import mirrorax``
    does). Hooks run in registration order on entry, in reverse order on exit; an ``enter`` that raises
    closes the scope again (the ``leave`` of the hooks already entered run) and ``scope()`` raises it.
    Registering the same pair twice has no effect.
    """
    if (enter, leave) not in _scope_hooks:
        _scope_hooks.append((enter, leave))


@contextlib.contextmanager
def _enter(strategy: MirroredStrategy) -> Iterator[MirroredStrategy]:
    stack = getattr(_scope, "stack", None)
    if stack is None:
        stack = _scope.stack = []
    stack.append(strategy)
    entered: list[ScopeHook | None] = []
    try:
        for enter, leave in list(_scope_hooks):
            enter(strategy)
            entered.append(leave)
        yield strategy
    finally:
        try:
            for leave in reversed(entered):
                if leave is not None:
                    leave(strategy)
        finally:
            stack.pop()
