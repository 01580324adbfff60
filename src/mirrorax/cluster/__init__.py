"""The job's processes: joining a multi-process job, launching one, and keeping it alive.

* :mod:`~mirrorax.cluster.join`: joining a job on ``jax.distributed`` (``mx.initialize``; its public names
  are this package's too: ``mirrorax.cluster.initialize``); :mod:`~mirrorax.cluster.discovery`: the job
  read from the environment (SLURM, Open MPI, Kubernetes, ``TF_CONFIG``, Ray);
  :mod:`~mirrorax.cluster.resolver`: the task TF's resolver reports (``strategy.cluster_resolver``);
* :mod:`~mirrorax.cluster.failure`: a process that dies tells the others; :mod:`~mirrorax.cluster.output`:
  the collectives' chatter kept out of a process's output;
* :mod:`~mirrorax.cluster.launch`: ``mirrorax launch`` (``python -m mirrorax.cluster.launch``), with
  :mod:`~mirrorax.cluster.watchdog` (each rank's progress), :mod:`~mirrorax.cluster.verdict` (which ranks
  failed first) and :mod:`~mirrorax.cluster.restarts`;
* :mod:`~mirrorax.cluster.preemption`: SIGTERM, the exit code, every process stopping at one step;
* elastic jobs: :mod:`~mirrorax.fit.elastic` (a fit's snapshots) and :mod:`~mirrorax.cluster.ray_train`
  (a Ray Train worker's group).

The launcher, the watchdog, the restarts and ``preemption`` import no JAX at import time, so this package
imports nothing itself: the joining module's public names load on first use.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded on first use (below); imported here for type checkers
    from mirrorax.cluster.join import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
    from mirrorax.cluster.join import ClusterError as ClusterError
    from mirrorax.cluster.join import ClusterInfo as ClusterInfo
    from mirrorax.cluster.join import cluster_info as cluster_info
    from mirrorax.cluster.join import coordination_client as coordination_client
    from mirrorax.cluster.join import initialize as initialize
    from mirrorax.cluster.join import is_initialized as is_initialized
    from mirrorax.cluster.join import job_from_env as job_from_env
    from mirrorax.cluster.join import maybe_initialize_from_env as maybe_initialize_from_env
    from mirrorax.cluster.join import process_count as process_count
    from mirrorax.cluster.join import process_index as process_index
    from mirrorax.cluster.join import resolve_bind_address as resolve_bind_address

__all__ = ["ClusterInfo", "ClusterError", "initialize", "maybe_initialize_from_env", "is_initialized",
           "job_from_env", "process_index", "process_count", "cluster_info", "resolve_bind_address",
           "PREEMPTED_EXIT_CODE", "coordination_client"]


def __getattr__(name: str):  # PEP 562
    if name in __all__:
        from mirrorax.cluster import join

        return getattr(join, name)
    raise AttributeError(f"module 'mirrorax.cluster' has no attribute {name!r}")
