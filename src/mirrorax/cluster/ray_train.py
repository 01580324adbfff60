"""mirrorax on Ray Train: each Ray Train worker is one JAX process of one ``jax.distributed`` job.

``pip install "mirrorax[ray]"``. Inside a Ray Train worker, ``mx.MirroredStrategy()`` joins the job Ray's
worker group is (:func:`job_from_ray`): the process's rank and the group's size from Ray's train context, the
coordinator on world rank 0's node at a port free there, told to the others through Ray's own collective. No
variable is set by hand, and it works with Ray's own ``ray.train.v2.jax.JaxTrainer`` (which starts
``jax.distributed`` itself on TPUs and GPUs only: then mirrorax uses the job Ray started).

With ``ScalingConfig(num_workers=(min, max))`` and ``FailureConfig(max_failures=N)``, Ray restarts the
group on the workers left when one is lost, and grows it back at its next resize when capacity returns;
each worker group is a new JAX job. Every fit resumes from the newest snapshot any node holds
(:mod:`mirrorax.checkpoint.snapshot`; in a Ray worker ``MIRRORAX_SNAPSHOT_DIR`` defaults to
``<tmp>/mirrorax-snapshots/<run name>`` on each node) or checkpoint, with the same global batch and example
order, so the run ends with the numbers of an uninterrupted one.

:class:`JaxTrainer` is Ray's with four conveniences: simulated CPU devices per worker, the snapshot
settings, the snapshots removed from every node when the run succeeds (one worker per node, by Ray's node
id: nodes may share an address), and a run that lost workers and stays below its minimum ends after
``wait_for_workers_s`` (:mod:`mirrorax.cluster.ray_wait`), saying how to resume. :func:`checkpoint_dir` is a
directory in the storage ``RunConfig`` names, for ``fit(checkpoint_dir=...)``.

This module imports Ray only when used: ``import mirrorax`` never does; without Ray, using it says how to
install it (``pip install "mirrorax[ray]"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from mirrorax.cluster.discovery import ClusterInfo, coordination_client, make_info
from mirrorax.cluster.ray_wait import DEFAULT_DEADLINE_S, BelowMinimumWorkers, WaitForWorkers, room
from mirrorax.cluster.restarts import CACHE_DIR, DIR_ENV, SECONDS_ENV, STEPS_ENV, compile_cache, group_file, node_name

# JaxTrainer is made on first use (module __getattr__): defining it imports Ray.
__all__ = ["job_from_ray", "checkpoint_dir", "in_ray_worker", "JaxTrainer", "SNAPSHOT_ROOT",  # noqa: F822
           "BelowMinimumWorkers"]

#: Where snapshots go on each node of a Ray job, under the run's name, unless ``MIRRORAX_SNAPSHOT_DIR`` says.
SNAPSHOT_ROOT = os.path.join(tempfile.gettempdir(), "mirrorax-snapshots")


def _ray(module: str) -> Any:
    """``import module`` (a part of Ray), or a ``ModuleNotFoundError`` that says how to install Ray Train."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (e.name == "ray" or e.name.startswith("ray.")):
            raise
        raise ModuleNotFoundError(
            f"mirrorax.cluster.ray_train runs mirrorax on Ray Train, which is not installed here (importing {module} "
            f"failed: {e}). Install it with: pip install \"mirrorax[ray]\"", name=e.name) from None


def _context() -> Any | None:
    """Ray Train's context of this worker, or ``None`` outside a Ray Train worker (Ray not even imported)."""
    if "ray.train" not in sys.modules:  # a Ray Train worker imported it to run us: nothing else pays a look
        return None
    try:
        import ray.train

        return ray.train.get_context()
    except (RuntimeError, ImportError, AttributeError):
        return None


def in_ray_worker() -> bool:
    """Whether this process is a Ray Train worker (inside a training function)."""
    return _context() is not None


def job_from_ray() -> ClusterInfo | None:
    """The JAX job of this Ray Train worker's group, or ``None`` outside one (or in a group of one).

    The first call in a worker agrees on the coordinator with the other workers (Ray's
    ``broadcast_from_rank_zero``: every worker of the group must call it, as ``MirroredStrategy()`` does) and
    records the job as ``MIRRORAX_COORDINATOR`` / ``MIRRORAX_NUM_PROCESSES`` / ``MIRRORAX_PROCESS_ID``, which
    later calls read. It also sets this run's snapshot directory (``MIRRORAX_SNAPSHOT_DIR``, unless set).
    """
    ctx = _context()
    if ctx is None:
        return None
    os.environ.setdefault(DIR_ENV, os.path.join(SNAPSHOT_ROOT, _safe(ctx.get_experiment_name())))
    size, rank = int(ctx.get_world_size()), int(ctx.get_world_rank())
    if size <= 1 or os.environ.get("MIRRORAX_COORDINATOR"):  # alone, or agreed already (the variables say it)
        return None
    broadcast_from_rank_zero = _ray("ray.train.collective").broadcast_from_rank_zero
    address = broadcast_from_rank_zero(_coordinator() if rank == 0 else None)
    os.environ.update(MIRRORAX_COORDINATOR=address, MIRRORAX_NUM_PROCESSES=str(size), MIRRORAX_PROCESS_ID=str(rank))
    return make_info(address, size, rank, None, "ray")


def _coordinator() -> str:
    """``host:port`` of this node (Ray's address for it) at a port free here: process 0's coordinator."""
    host = _ray("ray").util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"


def checkpoint_dir(name: str = "mirrorax-checkpoints") -> str:
    """A directory in the storage ``RunConfig(storage_path=...)`` names, under the run's name, for
    ``fit(checkpoint_dir=...)`` (a local or shared path, ``gs://`` or ``s3://``).

    Raises:
      RuntimeError: outside a Ray Train worker, or on a storage Orbax cannot write.
    """
    ctx = _context()
    if ctx is None:
        raise RuntimeError("mirrorax.cluster.ray_train.checkpoint_dir() names a directory in a Ray Train run's "
                           "storage; "
                           f"call it inside the training function. Received: no Ray Train context (in_ray_worker() is "
                           f"{in_ray_worker()}).")
    storage = ctx.get_storage()
    path = f"{storage.experiment_fs_path}/{name}"
    kind = storage.storage_filesystem.type_name
    schemes = {"local": "", "gcs": "gs://", "s3": "s3://"}
    if kind not in schemes:
        raise RuntimeError(f"Ray's storage here is a {kind!r} file system; mirrorax's checkpoints (Orbax) are "
                           "written to a local or shared path, gs:// or s3://. Pass fit(checkpoint_dir=...) yourself.")
    return schemes[kind] + path


def _remove_snapshots(rank: int) -> None:
    """The run succeeded: each node's snapshots of it are removed, by one worker per node (the lowest world rank
    on it): nodes are told apart by Ray's node id (:func:`~mirrorax.cluster.restarts.node_name`), not by address,
    which several nodes may share (simulated nodes on one host, containers behind one address)."""
    base = os.environ.get(DIR_ENV)
    if not base:
        return
    node = node_name()
    if _cleaner(rank, node):
        shutil.rmtree(os.path.join(base, node), ignore_errors=True)
        shutil.rmtree(os.path.join(base, CACHE_DIR), ignore_errors=True)  # (the job's: a removal twice is harmless)
        with contextlib.suppress(OSError):
            os.remove(group_file(base, node))


def _cleaner(rank: int, node: str) -> bool:
    """Whether the worker of world ``rank`` on ``node`` is its node's first: every worker tells the others its
    node through the job's coordination service. Without a joined job (one worker, or a function that never
    built a strategy), every worker cleans its own node (a removal twice is harmless)."""
    client = coordination_client()
    ctx = _context()
    size = int(ctx.get_world_size()) if ctx is not None else 1
    if client is None or size <= 1:
        return True
    try:
        client.key_value_set(f"mirrorax/ray/node/{rank}", node)
        others = [client.blocking_key_value_get(f"mirrorax/ray/node/{r}", 60_000) for r in range(rank)]
    except Exception:  # noqa: BLE001 - a worker gone after the barrier: clean this node anyway
        return True
    return node not in others


# The JAX options a worker is given through its environment, and their types.
_JAX_OPTIONS: dict[str, Callable[[str], Any]] = {
    "JAX_PLATFORMS": str, "JAX_COMPILATION_CACHE_DIR": str, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": float,
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": int}


def _wrapped(fn: Callable[..., Any], env: dict[str, str]) -> Callable[..., Any]:
    """``fn`` run with ``env`` set first, and the run's snapshots removed from every node when it succeeded."""

    def train_loop_per_worker(*config: Any) -> Any:
        os.environ.update(env)
        ctx = _context()
        if ctx is not None:  # this run's snapshots, and beside them its compilation cache
            os.environ.setdefault(DIR_ENV, os.path.join(SNAPSHOT_ROOT, _safe(ctx.get_experiment_name())))
            compile_cache(os.environ, os.environ[DIR_ENV])
        jax = sys.modules.get("jax")
        if jax is not None:  # imported already: its options are read from its config, not the environment
            for var, kind in _JAX_OPTIONS.items():
                if var in os.environ:
                    jax.config.update(var.lower(), kind(os.environ[var]))
        result = fn(*config)
        train = _ray("ray.train")
        train.collective.barrier()  # every worker is done with them
        _remove_snapshots(int(train.get_context().get_world_rank()))
        return result

    return train_loop_per_worker


def _per_worker(scaling: Any) -> dict[str, float]:
    """One worker's resources, as Ray's ``ScalingConfig`` asks for them (its defaults: a CPU, a GPU with
    ``use_gpu``, a TPU with ``use_tpu``; an accelerator type is a constraint, not a count)."""
    per = {k: float(v) for k, v in (scaling.resources_per_worker or {}).items() if v}
    if not per:
        per = {"TPU": 1.0} if scaling.use_tpu else {"GPU": 1.0} if scaling.use_gpu else {"CPU": 1.0}
    if scaling.use_gpu:
        per.setdefault("GPU", 1.0)
    return per


def _say(line: str | None) -> None:
    if line:
        sys.stdout.write(f"{line}\n")
        sys.stdout.flush()


@functools.cache
def _trainer_class() -> type:
    RayJaxTrainer = _ray("ray.train.v2.jax").JaxTrainer  # noqa: N806 - a class
    ControllerCallback = _ray("ray.train.v2._internal.execution.callback").ControllerCallback  # noqa: N806
    ElasticScalingPolicy = _ray("ray.train.v2._internal.execution.scaling_policy.elastic").ElasticScalingPolicy  # noqa: N806

    class WaitCallback(ControllerCallback):  # type: ignore[misc, valid-type]
        """On Ray Train's controller: its state at every update, to :class:`~mirrorax.cluster.ray_wait.WaitForWorkers`
        (a line it has to say goes to the controller's output, which the driver shows)."""

        def __init__(self, wait: WaitForWorkers) -> None:
            self.wait = wait

        def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
            _say(self.wait.observe(type(current_state).__name__, _ray("ray").nodes, time.monotonic()))



    class LiveNodesPolicy(ElasticScalingPolicy):  # type: ignore[misc, valid-type]
        """Ray's elastic policy, counting the workers the live nodes hold: Ray reads the cluster's resources from
        a view that still counts a node just lost, for seconds. With it, a group of the old size was started and
        waited for its start timeout (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s), and a running group of the
        right size was ended to "grow" onto the lost node."""

        said = -1

        def _count_possible_workers(self, reserved_resources: Any) -> int:
            counted = super()._count_possible_workers(reserved_resources)
            live = room(_ray("ray").nodes(), _per_worker(self.scaling_config), self.scaling_config.max_workers)
            if live < counted and live != self.said:
                _say(f"mirrorax: Ray Train's view of the cluster counts {counted} workers; its live nodes hold {live}: "
                     f"{live} it is (a node was lost).")
            self.said = live if live < counted else -1
            return min(counted, live)

    class JaxTrainer(RayJaxTrainer):  # type: ignore[misc, valid-type]
        """Ray Train's ``JaxTrainer`` for a mirrorax program: every worker one JAX process of one job.

        Args (besides Ray's own, all passed on):
          train_loop_per_worker: the training function (it builds ``mx.MirroredStrategy()``, which joins).
          cpu_devices_per_worker: simulated CPU devices per worker (``JAX_PLATFORMS=cpu``): for CPU clusters
            and tests. ``None``: each worker uses what JAX finds.
          snapshot_dir: each node's snapshot directory (default ``<tmp>/mirrorax-snapshots/<run name>``).
          snapshot_seconds, snapshot_steps: how often (default every 30 s).
          wait_for_workers_s: how long a run that lost workers waits for room for its minimum
            (``ScalingConfig(num_workers=(min, max))``) before it ends with :class:`BelowMinimumWorkers`, its
            snapshots and checkpoints kept (default 300).

        Raises:
          BelowMinimumWorkers: from :meth:`fit`, when the run ended so.

        Example:
          >>> from ray.train import FailureConfig, RunConfig, ScalingConfig
          >>> trainer = JaxTrainer(train_fn, scaling_config=ScalingConfig(num_workers=(2, 4)),
          ...                      run_config=RunConfig(failure_config=FailureConfig(max_failures=3)))
          >>> trainer.fit()
        """

        def __init__(self, train_loop_per_worker: Callable[..., Any], *, cpu_devices_per_worker: int | None = None,
                     snapshot_dir: str | None = None, snapshot_seconds: float | None = None,
                     snapshot_steps: int | None = None, wait_for_workers_s: float = DEFAULT_DEADLINE_S,
                     **kwargs: Any) -> None:
            env: dict[str, str] = {}
            if cpu_devices_per_worker is not None:  # (applied by mx.MirroredStrategy() before JAX's backend starts)
                env.update(JAX_PLATFORMS="cpu", MIRRORAX_CPU_DEVICES=str(int(cpu_devices_per_worker)))
            for var, value in ((DIR_ENV, snapshot_dir), (SECONDS_ENV, snapshot_seconds), (STEPS_ENV, snapshot_steps)):
                if value is not None:
                    env[var] = str(value)
            train = _ray("ray.train")
            scaling = kwargs.get("scaling_config") or train.ScalingConfig()
            wait = WaitForWorkers(scaling.min_workers, scaling.max_workers, _per_worker(scaling), wait_for_workers_s)
            run = kwargs.get("run_config") or train.RunConfig()
            kwargs["run_config"] = dataclasses.replace(run, callbacks=[*(run.callbacks or []), WaitCallback(wait)])
            super().__init__(_wrapped(train_loop_per_worker, env), **kwargs)

        def _create_default_callbacks(self) -> list[Any]:
            # Without datasets, Ray Train's dataset callback still started an actor process at every group start
            # (importing Ray Data, seconds of CPU), and each worker's context waited for it: 7.7 s of a restart's
            # 14 s of group start on the loaded 2-core host.
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if type(c).__name__ != "DatasetsCallback"]

        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            policy: Any = kwargs.get("scaling_policy")
            if type(policy) is ElasticScalingPolicy:  # counting the live nodes' workers
                kwargs["scaling_policy"] = LiveNodesPolicy(policy.scaling_config)
            return super()._initialize_and_run_controller(**kwargs)

        def fit(self) -> Any:
            """Ray's ``fit``; a run that ended below its minimum of workers raises :class:`BelowMinimumWorkers`."""
            try:
                return super().fit()
            except Exception as e:
                failure = getattr(e, "controller_failure", None)
                if isinstance(failure, BelowMinimumWorkers):
                    raise BelowMinimumWorkers(str(failure)) from None
                raise

    return JaxTrainer


def __getattr__(name: str) -> Any:
    if name == "JaxTrainer":  # made on first use: defining it imports Ray
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
