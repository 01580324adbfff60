"""Reading the job a process belongs to from its environment, without connecting or starting JAX.

Pure functions of ``os.environ`` (tests set fake SLURM / Open MPI / ``TF_CONFIG`` variables and check the
result). For SLURM, Open MPI, Cloud TPU and Kubernetes we ask JAX's own ``ClusterEnv`` classes, so the
coordinator address is the one ``jax.distributed.initialize()`` would derive.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from mirrorax._checks import check_int

__all__ = ["ClusterError", "ClusterInfo", "job_from_env", "make_info", "split_address", "private_jax",
           "accelerators_present", "coordination_client"]

# Device files of accelerators, checked without starting JAX (tests point this elsewhere).
ACCELERATOR_PATTERNS = ["/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/kfd", "/dev/vfio/[0-9]*"]


def accelerators_present() -> list[str]:
    """Device files of GPUs/TPUs on this machine (cheap: no JAX, no driver calls)."""
    return sorted(path for pattern in ACCELERATOR_PATTERNS for path in glob.glob(pattern))

_OURS = ("MIRRORAX_COORDINATOR", "MIRRORAX_NUM_PROCESSES", "MIRRORAX_PROCESS_ID")
# Variables that say "this process is one task of several" to the schedulers JAX detects.
_SCHEDULER_COUNTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


class ClusterError(RuntimeError):
    """A job that cannot be joined: the set-up is inconsistent or a peer is unreachable."""


def private_jax(name: str) -> Any | None:
    """``jax._src.<name>``, or ``None`` on a JAX where that private module is gone.

    mirrorax reads a few things JAX does not export (its cluster detectors, whether the backend started,
    the distributed client); every use goes through here and has a fallback for a JAX that moved them.
    """
    try:
        return importlib.import_module(f"jax._src.{name}")
    except ImportError:
        return None


def coordination_client() -> Any | None:
    """The connected ``DistributedRuntimeClient`` of JAX's coordination service (its key-value store:
    ``key_value_set``, ``blocking_key_value_get``, ``key_value_delete``); ``None`` before a job is joined, or
    on a JAX where it moved (``jax.distributed`` does not export it)."""
    return getattr(getattr(private_jax("distributed"), "global_state", None), "client", None)


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """Where this process sits in a multi-process job.

    Attributes:
      coordinator_address: ``"host:port"`` where process 0 hosts the coordination service.
      num_processes: how many processes the job has.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      source: where the description came from: ``"arguments"``, ``"MIRRORAX_*"``, ``"TF_CONFIG"``,
        or a ``jax.distributed`` detection method (``"slurm"``, ``"ompi"``, ...).
      local_device_ids: the local accelerators this process uses; ``None``: all it sees.
      heartbeat_timeout_seconds: how long a silent process may go before the others abort.

    Example:
      >>> ClusterInfo("10.0.0.1:1234", 2, 1).is_primary
      False
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    source: str = "arguments"
    local_device_ids: tuple[int, ...] | None = None
    heartbeat_timeout_seconds: int | None = None

    @property
    def is_primary(self) -> bool:
        """True on process 0, the one that prints and writes files."""
        return self.process_id == 0


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``, with a clear error when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"A coordinator address must look like 'host:port' (e.g. '10.0.0.1:1234'); "
                         f"received {address!r}.")
    return host.strip("[]"), int(port)


def make_info(address: object, num_processes: object, process_id: object,
              local_device_ids: Sequence[int] | None, source: str) -> ClusterInfo:
    """Validates the three values every process needs and returns them as a :class:`ClusterInfo`."""
    if not isinstance(address, str):
        raise TypeError(f"coordinator_address must be a 'host:port' string; received {address!r} "
                        f"(of type {type(address).__name__}).")
    split_address(address)
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        check_int(name, value, None, error=TypeError)
    assert isinstance(num_processes, int) and isinstance(process_id, int)
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"Expected num_processes >= 1 and 0 <= process_id < num_processes (from {source}). "
                         f"Received num_processes={num_processes}, process_id={process_id}.")
    ids = tuple(int(i) for i in local_device_ids) if local_device_ids is not None else None
    return ClusterInfo(address, num_processes, process_id, source, ids)


def job_from_env(environ: dict[str, str] | None = None) -> ClusterInfo | None:
    """The job the environment describes, or ``None`` (first match: ``MIRRORAX_*``, ``TF_CONFIG``, JAX's).

    Args:
      environ: the variables to read; ``None`` reads ``os.environ``. JAX's detectors always read
        ``os.environ``.

    Returns:
      A :class:`ClusterInfo` (possibly of one process), or ``None`` when nothing describes a job.

    Raises:
      ValueError: ``MIRRORAX_*`` variables are partly set or malformed, or ``TF_CONFIG`` is malformed
        or gives this process a role mirrorax has no use for (``ps``, ``evaluator``).
      ClusterError: a scheduler describes several tasks (``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``) but
        this JAX lacks the detectors that read them.

    Example:
      >>> job_from_env({"MIRRORAX_COORDINATOR": "h0:1234", "MIRRORAX_NUM_PROCESSES": "2",
      ...               "MIRRORAX_PROCESS_ID": "1"}).process_id
      1
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in _OURS):
        return _from_ours(env)
    if env.get("TF_CONFIG", "").strip():
        return _from_tf_config(env["TF_CONFIG"])
    return _from_jax_detectors() if environ is None else None


def _from_ours(env: dict[str, str] | os._Environ[str]) -> ClusterInfo:
    missing = [n for n in _OURS if not env.get(n)]
    if missing:
        raise ValueError(f"{', '.join(n for n in _OURS if n not in missing)} set but {', '.join(missing)} "
                         f"missing: a job needs all three of {', '.join(_OURS)} (or none of them).")
    values = {}
    for name in _OURS[1:]:
        try:
            values[name] = int(env[name])
        except ValueError:
            raise ValueError(f"{name} must be an integer; received {env[name]!r}.") from None
    ids = env.get("MIRRORAX_LOCAL_DEVICE_IDS")
    local = None
    if ids:
        try:
            local = [int(i) for i in ids.split(",")]
        except ValueError:
            raise ValueError(f"MIRRORAX_LOCAL_DEVICE_IDS must be comma-separated integers like '0,1'; "
                             f"received {ids!r}.") from None
    return make_info(env["MIRRORAX_COORDINATOR"], values["MIRRORAX_NUM_PROCESSES"],
                     values["MIRRORAX_PROCESS_ID"], local, "MIRRORAX_*")


def _from_tf_config(raw: str) -> ClusterInfo:
    try:
        config = json.loads(raw)
        cluster, task = config["cluster"], config.get("task", {})
        kind, index = task.get("type", "worker"), int(task.get("index", 0))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"TF_CONFIG must be JSON like {{'cluster': {{'worker': ['h0:2222', 'h1:2222']}}, "
                         f"'task': {{'type': 'worker', 'index': 0}}}}; could not read {raw!r} ({e}).") from None
    unused = sorted(set(cluster) - {"chief", "worker", "evaluator"})
    if unused:
        raise ValueError(f"TF_CONFIG lists {unused} tasks; mirrorax trains synchronously on 'chief' and "
                         "'worker' tasks only (no parameter servers). Remove the other task types.")
    if kind not in ("chief", "worker"):
        raise ValueError(f"TF_CONFIG gives this process task type {kind!r}; mirrorax runs 'chief' and "
                         "'worker' tasks only. Run evaluators as separate, single-process jobs.")
    # tf.distribute's order: the chief is task 0 of the job, then the workers.
    chiefs, workers = list(cluster.get("chief", [])), list(cluster.get("worker", []))
    addresses = chiefs + workers
    offset = 0 if kind == "chief" else len(chiefs)
    if not addresses or not 0 <= index < len(cluster.get(kind, [])):
        raise ValueError(f"TF_CONFIG task {kind}:{index} is not in cluster {cluster}. Expected an index "
                         f"below len(cluster[{kind!r}]).")
    return make_info(addresses[0], len(addresses), offset + index, None, "TF_CONFIG")


def _from_jax_detectors() -> ClusterInfo | None:
    """Asks JAX's cluster detectors, in JAX's order, but only whether their environment is present."""
    kinds = getattr(getattr(private_jax("clusters"), "ClusterEnv", None), "_cluster_types", None)
    if kinds is None:
        _without_jax_detectors("JAX's cluster detectors (the private jax._src.clusters) are absent")
        return None
    try:
        return _detect(kinds)
    except (AttributeError, TypeError) as e:  # the private interface changed under us
        _without_jax_detectors(f"JAX's cluster detectors (the private jax._src.clusters) changed "
                               f"({type(e).__name__}: {e})")
        return None


# The detectors that found their environment but could not read the job, by name, with the environment
# they failed in: a process builds many strategies (every `MirroredStrategy()` looks for a cluster), and
# each would ask the metadata server again and print its notice again (once per strategy on a TPU host
# without the server). The same environment fails the same way: once per process and environment.
_FAILED: dict[str, frozenset[tuple[str, str]]] = {}


def _detect(kinds: Sequence[Any]) -> ClusterInfo | None:
    environ = frozenset(os.environ.items())  # what a detector that failed read: skip it while it stays so
    for env in kinds:
        if env.opt_in_only_method:
            continue
        name = env.name or env.__name__
        if _FAILED.get(name) == environ:
            continue
        # JAX's Kubernetes detector warns in every pod without the `kubernetes` package and queries
        # the API server otherwise: consult it only for indexed jobs, the kind it can bootstrap.
        if env.__name__ == "K8sCluster" and ("JOB_COMPLETION_INDEX" not in os.environ
                                  or importlib.util.find_spec("kubernetes") is None):
            continue
        # A detector that raises (a Cloud TPU host without the GCE metadata server, no network, a missing
        # optional package) means "not this environment": a one-host run must start wherever JAX does.
        try:
            present = env.is_env_present()
        except (AttributeError, TypeError):
            raise  # the private interface changed under us: _from_jax_detectors says so
        except Exception:  # noqa: BLE001 - a probe that fails is "absent": it found no job to join
            continue
        if not present:
            continue
        try:
            count = env.get_process_count()
            if count <= 1:
                return None
            port = os.environ.get("JAX_COORDINATOR_PORT")
            address = os.environ.get("JAX_COORDINATOR_ADDRESS") or env.get_coordinator_address(
                timeout_secs=60, override_coordinator_port=port)
            process_id = env.get_process_id()
        except (AttributeError, TypeError):
            raise  # the private interface changed under us: _from_jax_detectors says so
        except Exception as e:  # noqa: BLE001 - the environment looked like a cluster but could not be read
            _FAILED[name] = environ
            # One short line: the error's type, never its text (a requests ConnectionError's is a 500-character
            # repr of the connection pool); a one-chip host without the metadata server is the common case.
            _say(f"mirrorax: running as one process (JAX's {name!r} job detector failed: {type(e).__name__}; "
                 "set MIRRORAX_COORDINATOR=host:port to join a job)")
            continue
        return make_info(address, count, process_id, _local_ids(env), name)
    return None


def _say(message: str) -> None:
    """One line on stderr (never a warning: a warning filter set to "error" would stop the run again)."""
    print(message, file=sys.stderr, flush=True)


def _without_jax_detectors(why: str) -> None:
    """No detection on a JAX whose detectors moved: refuse to run a task of a multi-task job alone."""
    for name in _SCHEDULER_COUNTS:
        raw = os.environ.get(name, "")
        if raw.isdigit() and int(raw) > 1:
            import jax

            raise ClusterError(
                f"{name}={raw}: this process looks like one task of a {raw}-task job, but mirrorax cannot "
                f"read the job: {why} in jax {jax.__version__} (mirrorax is tested with jax 0.10). Running "
                "alone, every task would train its own copy. Set MIRRORAX_COORDINATOR=host:port, "
                "MIRRORAX_NUM_PROCESSES and MIRRORAX_PROCESS_ID for each task (e.g. from SLURM_PROCID), or "
                "call mx.initialize(...).")
    return None


def _local_ids(env: Any) -> list[int] | None:
    """JAX gives each process one accelerator (its local rank) under SLURM and Open MPI; with one task
    per node that would leave all but one GPU idle, so then every local device is used."""
    if ids := os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return [int(i) for i in ids.split(",")]
    name = getattr(env, "name", "")
    if name == "slurm":
        nodes = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES")
        if nodes and int(nodes) == int(os.environ["SLURM_NTASKS"]):
            return None
    elif name == "ompi" and os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1":
        return None
    local = env.get_local_process_id()
    return None if local is None else [local]
