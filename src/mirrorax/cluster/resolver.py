"""``strategy.cluster_resolver``: this process's task in the job, as TF's ``TFConfigClusterResolver`` reports it.

TF programs read their role from the strategy's resolver (``task_type``, ``task_id``, ``cluster_spec()``):
TF's multi-worker tutorials decide with them which worker is the chief and where each one writes. The
answers here are TF's for the same job:

* under ``TF_CONFIG``: its ``task`` and ``cluster`` as written (a ``chief`` task is process 0, the workers
  follow, as :mod:`mirrorax.cluster.join` joins them);
* in a job started any other way (``mirrorax launch``, SLURM, Open MPI, ``MIRRORAX_*``): one ``worker``
  task per process, ``task_id`` the process index, so worker 0 is the chief as under a ``TF_CONFIG`` of
  workers only. Such a job names no address per process: the spec lists the coordinator's address for
  worker 0 and ``"process-<i>"`` for the others;
* on one process without ``TF_CONFIG``: TF's single-worker answers: ``task_type`` ``None``, ``task_id``
  0, an empty spec.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from mirrorax.cluster import join as cluster

__all__ = ["ClusterResolver", "ClusterSpec"]


class ClusterSpec:
    """The job's tasks by type (TF's ``tf.train.ClusterSpec``, read-only).

    Example:
      >>> spec = ClusterSpec({"worker": ["h0:2222", "h1:2222"]})
      >>> spec.as_dict(), spec.num_tasks("worker"), spec.task_address("worker", 1)
      ({'worker': ['h0:2222', 'h1:2222']}, 2, 'h1:2222')
    """

    def __init__(self, tasks: Mapping[str, Sequence[str]]) -> None:
        self._tasks = {kind: list(addresses) for kind, addresses in tasks.items()}

    def as_dict(self) -> dict[str, list[str]]:
        """``{task type: [address of task 0, of task 1, ...]}``."""
        return {kind: list(addresses) for kind, addresses in self._tasks.items()}

    @property
    def jobs(self) -> list[str]:
        """The task types (TF calls them jobs)."""
        return list(self._tasks)

    def num_tasks(self, job_name: str) -> int:
        """How many tasks of type ``job_name`` the job has.

        Raises:
          ValueError: the job has no task of that type.
        """
        return len(self._addresses(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The indices of the tasks of type ``job_name``."""
        return list(range(self.num_tasks(job_name)))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of type ``job_name``.

        Raises:
          ValueError: no such task.
        """
        addresses = self._addresses(job_name)
        if not 0 <= task_index < len(addresses):
            raise ValueError(f"No task {task_index} of type {job_name!r}: it has tasks 0..{len(addresses) - 1}. "
                             "Pass an index from task_indices(job_name).")
        return addresses[task_index]

    def _addresses(self, job_name: str) -> list[str]:
        if job_name not in self._tasks:
            raise ValueError(f"No task of type {job_name!r} in this cluster: it has {sorted(self._tasks)}. "
                             "Pass one of those.")
        return self._tasks[job_name]

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and other.as_dict() == self.as_dict()

    def __repr__(self) -> str:
        return f"ClusterSpec({self._tasks!r})"


class ClusterResolver:
    """This process's task and the job's tasks, as TF's resolver gives them (see the module).

    Attributes:
      task_type: ``"chief"`` or ``"worker"`` (``None`` on one process without ``TF_CONFIG``).
      task_id: this task's index among the tasks of its type.
      environment: ``""`` (TF's value outside Kubernetes and Cloud TPU).
      rpc_layer: ``"grpc"`` under ``TF_CONFIG`` (TF's default), else ``None``.

    Example:
      >>> resolver = MirroredStrategy().cluster_resolver   # one process, no TF_CONFIG
      >>> resolver.task_type, resolver.task_id, resolver.cluster_spec().as_dict()
      (None, 0, {})
    """

    environment = ""

    def __init__(self, task_type: str | None, task_id: int, spec: ClusterSpec, rpc_layer: str | None = None) -> None:
        self.task_type = task_type
        self.task_id = task_id
        self._spec = spec
        self.rpc_layer = rpc_layer

    @classmethod
    def for_this_process(cls) -> ClusterResolver:
        """The resolver of the job this process belongs to (reads ``TF_CONFIG`` and the joined job)."""
        raw = os.environ.get("TF_CONFIG", "").strip()
        info = cluster.cluster_info()
        if raw and (info is None or info.source == "TF_CONFIG"):
            config = json.loads(raw)  # a malformed TF_CONFIG was refused when the job was joined
            task = config.get("task", {})
            return cls(task.get("type", "worker"), int(task.get("index", 0)), ClusterSpec(config["cluster"]), "grpc")
        count, index = cluster.process_count(), cluster.process_index()
        if count == 1:
            return cls(None, 0, ClusterSpec({}))
        first = info.coordinator_address if info is not None else "process-0"
        return cls("worker", index, ClusterSpec({"worker": [first] + [f"process-{i}" for i in range(1, count)]}))

    def cluster_spec(self) -> ClusterSpec:
        """The job's tasks by type (a :class:`ClusterSpec`)."""
        return self._spec

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of task ``task_id`` of ``task_type`` (default: this task), ``rpc_layer://`` first if
        given; ``""`` on one process without ``TF_CONFIG`` (TF's local session)."""
        kind = self.task_type if task_type is None else task_type
        index = self.task_id if task_id is None else task_id
        if kind is None or not self._spec:
            return ""
        address = self._spec.task_address(kind, index)
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def __repr__(self) -> str:
        return f"ClusterResolver(task_type={self.task_type!r}, task_id={self.task_id}, cluster_spec={self._spec!r})"
