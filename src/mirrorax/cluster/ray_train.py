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

:class:`JaxTrainer` is Ray's with three conveniences: simulated CPU devices per worker, the snapshot
settings, and the snapshots removed from every node when the run succeeds. :func:`checkpoint_dir` is a
directory in the storage ``RunConfig`` names, for ``fit(checkpoint_dir=...)``.

This module imports Ray only when used: ``import mirrorax`` never does.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from mirrorax.cluster.discovery import ClusterInfo, make_info
from mirrorax.cluster.restarts import DIR_ENV, SECONDS_ENV, STEPS_ENV, node_name

# JaxTrainer is made on first use (module __getattr__): defining it imports Ray.
__all__ = ["job_from_ray", "checkpoint_dir", "in_ray_worker", "JaxTrainer", "SNAPSHOT_ROOT"]  # noqa: F822

#: Where snapshots go on each node of a Ray job, under the run's name, unless ``MIRRORAX_SNAPSHOT_DIR`` says.
SNAPSHOT_ROOT = os.path.join(tempfile.gettempdir(), "mirrorax-snapshots")


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
    from ray.train.collective import broadcast_from_rank_zero

    address = broadcast_from_rank_zero(_coordinator() if rank == 0 else None)
    os.environ.update(MIRRORAX_COORDINATOR=address, MIRRORAX_NUM_PROCESSES=str(size), MIRRORAX_PROCESS_ID=str(rank))
    return make_info(address, size, rank, None, "ray")


def _coordinator() -> str:
    """``host:port`` of this node (Ray's address for it) at a port free here: process 0's coordinator."""
    import ray

    host = ray.util.get_node_ip_address()
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


def _remove_snapshots() -> None:
    """The run succeeded: this node's snapshots of it are removed (by the node's first worker)."""
    import ray.train

    base = os.environ.get(DIR_ENV)
    ctx = ray.train.get_context()
    if base and ctx.get_local_rank() == 0:
        import shutil

        shutil.rmtree(os.path.join(base, node_name()), ignore_errors=True)


def _wrapped(fn: Callable[..., Any], env: dict[str, str]) -> Callable[..., Any]:
    """``fn`` run with ``env`` set first, and the run's snapshots removed from every node when it succeeded."""

    def train_loop_per_worker(*config: Any) -> Any:
        os.environ.update(env)
        if "jax" in sys.modules and "JAX_PLATFORMS" in env:  # imported already: its platforms are read from config
            sys.modules["jax"].config.update("jax_platforms", env["JAX_PLATFORMS"])
        result = fn(*config)
        import ray.train

        ray.train.collective.barrier()  # every worker is done with them
        _remove_snapshots()
        return result

    return train_loop_per_worker


def _trainer_class() -> type:
    from ray.train.v2.jax import JaxTrainer as RayJaxTrainer

    class JaxTrainer(RayJaxTrainer):  # type: ignore[misc, valid-type]
        """Ray Train's ``JaxTrainer`` for a mirrorax program: every worker one JAX process of one job.

        Args (besides Ray's own, all passed on):
          train_loop_per_worker: the training function (it builds ``mx.MirroredStrategy()``, which joins).
          cpu_devices_per_worker: simulated CPU devices per worker (``JAX_PLATFORMS=cpu``): for CPU clusters
            and tests. ``None``: each worker uses what JAX finds.
          snapshot_dir: each node's snapshot directory (default ``<tmp>/mirrorax-snapshots/<run name>``).
          snapshot_seconds, snapshot_steps: how often (default every 30 s).

        Example:
          >>> from ray.train import FailureConfig, RunConfig, ScalingConfig
          >>> trainer = JaxTrainer(train_fn, scaling_config=ScalingConfig(num_workers=(2, 4)),
          ...                      run_config=RunConfig(failure_config=FailureConfig(max_failures=3)))
          >>> trainer.fit()
        """

        def __init__(self, train_loop_per_worker: Callable[..., Any], *, cpu_devices_per_worker: int | None = None,
                     snapshot_dir: str | None = None, snapshot_seconds: float | None = None,
                     snapshot_steps: int | None = None, **kwargs: Any) -> None:
            env: dict[str, str] = {}
            if cpu_devices_per_worker is not None:  # (applied by mx.MirroredStrategy() before JAX's backend starts)
                env.update(JAX_PLATFORMS="cpu", MIRRORAX_CPU_DEVICES=str(int(cpu_devices_per_worker)))
            for var, value in ((DIR_ENV, snapshot_dir), (SECONDS_ENV, snapshot_seconds), (STEPS_ENV, snapshot_steps)):
                if value is not None:
                    env[var] = str(value)
            super().__init__(_wrapped(train_loop_per_worker, env), **kwargs)

    return JaxTrainer


def __getattr__(name: str) -> Any:
    if name == "JaxTrainer":  # made on first use: defining it imports Ray
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
