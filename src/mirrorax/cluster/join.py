"""Joining a multi-process job on JAX's own distributed runtime (``jax.distributed``).

Every process of a job runs the same script. Before JAX starts its backend, each one connects to the
coordination service that process 0 hosts; XLA then sees the devices of every process as one set and
its collectives (NCCL on GPU, ICI on TPU, gloo on CPU) carry the gradient all-reduce. Nothing here
moves training data: this module only finds out which job we are in and joins it.

Where the job description comes from, first match wins (:func:`job_from_env`):

0. Inside a Ray Train worker: Ray's worker group (:func:`mirrorax.cluster.ray_train.job_from_ray`, which writes
   the three variables below for the calls after it).
1. ``MIRRORAX_COORDINATOR`` (``host:port``), ``MIRRORAX_NUM_PROCESSES``, ``MIRRORAX_PROCESS_ID``
   (``mirrorax launch`` sets these), optionally ``MIRRORAX_LOCAL_DEVICE_IDS`` (``"0,1"``).
2. ``TF_CONFIG``: ``cluster.chief`` + ``cluster.worker`` in that order are processes ``0..n-1``; the
   first address is the coordinator; ``task`` says which one this process is.
3. What ``jax.distributed`` detects itself: SLURM (``srun``), Open MPI (``mpirun``), Cloud TPU and
   Kubernetes indexed jobs, through JAX's own ``ClusterEnv`` classes, read without connecting.

Timeouts (seconds; environment variables override the defaults of :func:`maybe_initialize_from_env`):
``MIRRORAX_INIT_TIMEOUT`` (60) bounds the wait for every process to join; ``MIRRORAX_HEARTBEAT_TIMEOUT``
(30) is how long a silent process may go before the others abort, which bounds how long they outlive a
dead peer; ``MIRRORAX_SHUTDOWN_TIMEOUT`` (300) is how long a finished process waits for the others.
A process that dies of an uncaught exception tells the others at once (:mod:`mirrorax.cluster.failure`).

Process 0's coordination service listens on the loopback address when the coordinator's host is one
(every process is then on this host: ``mirrorax launch``), else on every interface, as JAX does;
``MIRRORAX_COORDINATOR_BIND=host:port`` chooses (:func:`resolve_bind_address`).
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax

import mirrorax.cluster.discovery as _discovery
import mirrorax.cluster.failure as _failure
import mirrorax.cluster.output as _output
import mirrorax.cluster.restarts as _restarts
import mirrorax.cluster.watchdog as _watchdog
from mirrorax._checks import check_int
from mirrorax.cluster import ray_train
from mirrorax.cluster.cache_writes import cache_every_process
from mirrorax.cluster.discovery import ClusterError, ClusterInfo, accelerators_present, job_from_env, private_jax
from mirrorax.cluster.discovery import coordination_client as coordination_client
from mirrorax.cluster.preemption import PREEMPTED_EXIT_CODE  # (kept here too: mx.cluster.PREEMPTED_EXIT_CODE)

__all__ = ["ClusterInfo", "ClusterError", "initialize", "maybe_initialize_from_env", "is_initialized",
           "job_from_env", "process_index", "process_count", "cluster_info", "resolve_bind_address",
           "PREEMPTED_EXIT_CODE", "coordination_client"]

DEFAULT_INIT_TIMEOUT = 60
DEFAULT_HEARTBEAT_TIMEOUT = 30
DEFAULT_SHUTDOWN_TIMEOUT = 300

_info: ClusterInfo | None = None
_lock = threading.Lock()


_warned: set[str] = set()


def backend_started() -> bool:
    """True once anything (``jax.devices()``, a computation, ...) has started JAX's backend.

    JAX offers no public query; ``jax.distributed`` uses the private one we use. On a JAX without it,
    this warns once and answers False: ``jax.distributed.initialize`` then refuses a started backend
    itself, in its own words.
    """
    query = getattr(private_jax("xla_bridge"), "backends_are_initialized", None)
    if query is None:
        _warn_once("backend", f"mirrorax cannot tell whether JAX's backend started: jax {jax.__version__} has no "
                   "jax._src.xla_bridge.backends_are_initialized (a private function that mirrorax relies on, "
                   "tested with jax 0.10). It assumes the backend did not start. If joining a job then fails "
                   "because JAX computations already ran, create mx.MirroredStrategy() (or call "
                   "mx.initialize()) before any other JAX call.")
        return False
    return bool(query())


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def is_initialized() -> bool:
    """True once this process has joined a multi-process job (through mirrorax or ``jax.distributed``)."""
    return _info is not None or jax.distributed.is_initialized()


def cluster_info() -> ClusterInfo | None:
    """The job this process joined through mirrorax, or ``None``."""
    return _info


def process_index() -> int:
    """This process's index in the job, without starting JAX's backend before a job is joined.

    Example:
      >>> process_index()
      0
    """
    if _info is not None:
        return _info.process_id
    return jax.process_index() if (is_initialized() or backend_started()) else 0


def process_count() -> int:
    """How many processes the job has (1 until one is joined); starts no backend before a join.

    Example:
      >>> process_count()
      1
    """
    if _info is not None:
        return _info.num_processes
    return jax.process_count() if (is_initialized() or backend_started()) else 1


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               initialization_timeout: int = DEFAULT_INIT_TIMEOUT,
               heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_TIMEOUT,
               shutdown_timeout_seconds: int = DEFAULT_SHUTDOWN_TIMEOUT,
               cluster_detection_method: str | None = None,
               coordinator_bind_address: str | None = None) -> ClusterInfo:
    """Joins a multi-process job explicitly; call it first, before anything else touches JAX.

    With no address, count and id, the job is read from the environment (:func:`job_from_env`, or the
    ``jax.distributed`` method named by ``cluster_detection_method``, e.g. ``"mpi4py"``).

    Args:
      coordinator_address: ``"host:port"`` of process 0, where the coordination service listens.
      num_processes: how many processes the job has (every process must pass the same number).
      process_id: this process's index, ``0 <= process_id < num_processes``.
      local_device_ids: restricts this process to these local accelerators; ``None``: all of them.
      initialization_timeout: seconds to wait for the coordinator and every process to join.
      heartbeat_timeout_seconds: a process silent this long is declared dead and the others abort.
      shutdown_timeout_seconds: how long a finished process waits at exit for the others to finish.
      cluster_detection_method: a ``jax.distributed`` detection method used for unset values.
      coordinator_bind_address: ``"host:port"`` where process 0's coordination service listens;
        ``None``: see :func:`resolve_bind_address` (the loopback address for a loopback coordinator,
        else every interface).

    Returns:
      The :class:`ClusterInfo` of the job joined.

    Raises:
      ClusterError: already joined; JAX's backend already started; the processes disagree on the
        process count; the coordinator's port is taken (process 0); the coordinator did not answer
        within ``initialization_timeout`` (names the address).
      ValueError: an argument is out of range, or the environment describes no job.

    If the coordinator answers but not every process joins within ``initialization_timeout``, the
    process exits (status 1) with a message saying so: JAX would abort it from C++ otherwise, and the
    wait cannot be interrupted by an exception.

    Example:
      >>> import mirrorax as mx  # at the top of the script, on each of the 2 processes
      >>> mx.initialize("10.0.0.1:1234", num_processes=2, process_id=int(os.environ["RANK"]))  # doctest: +SKIP
    """
    global _info
    with _lock:
        if is_initialized():
            where = (f" as process {_info.process_id} of {_info.num_processes} at {_info.coordinator_address}"
                     if _info else " (by jax.distributed.initialize)")
            raise ClusterError(f"This process already joined a job{where}. Call mx.initialize() once per "
                               "process, and not after jax.distributed.initialize().")
        if backend_started():
            raise ClusterError(
                "mx.initialize() must run before JAX starts its backend, but the backend already started "
                "(something called jax.devices(), created an array or ran a computation). Fix: call "
                "mx.initialize() (or create mx.MirroredStrategy()) at the top of the script, before any "
                "other JAX call.")
        for name, value in (("initialization_timeout", initialization_timeout),
                            ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
                            ("shutdown_timeout_seconds", shutdown_timeout_seconds)):
            check_int(name, value, 1, meaning="seconds")
        info = _resolve(coordinator_address, num_processes, process_id, local_device_ids,
                        cluster_detection_method, initialization_timeout)
        info = dataclasses.replace(info, heartbeat_timeout_seconds=heartbeat_timeout_seconds)
        _apply_cpu_devices()
        # jax.config's options are attributes made at run time; its stub lists none of them.
        if jax.config.jax_cpu_collectives_implementation is None:  # type: ignore[attr-defined]
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        bind = resolve_bind_address(info.coordinator_address, coordinator_bind_address)
        _watchdog.start(info.process_id)  # mirrorax launch's watchdog: this process is joining
        _connect(info, initialization_timeout, shutdown_timeout_seconds, bind)
        _watchdog.joined()
        _info = info
        _quiet_collectives(info)
        client = coordination_client()
        if client is None:
            _warn_once("client", f"jax {jax.__version__} has no jax._src.distributed.global_state.client (a "
                       "private object that mirrorax relies on, tested with jax 0.10): the processes do not "
                       "check that they agree on the job's size, and one that raises does not stop the others "
                       "at once (they stop after MIRRORAX_HEARTBEAT_TIMEOUT, or when mirrorax launch stops them).")
            return info
        # Armed before the count check, so that a process that fails it takes the others down quickly.
        _failure.install(client, info.process_id, info.num_processes)
        _check_process_counts(info, initialization_timeout, client)
        _restarts.note_group(client, info.process_id, info.num_processes, _local_devices(info), initialization_timeout)
        if os.environ.get(_restarts.DIR_ENV):  # an elastic job: a restarted group loads what each process compiled
            cache_every_process()
        return info


def maybe_initialize_from_env() -> bool:
    """Joins the job the environment describes, if any; does nothing otherwise.

    ``MirroredStrategy()`` calls this first, so an unchanged script joins the job under
    ``mirrorax launch``, ``srun``, ``mpirun`` or ``TF_CONFIG``. It also applies
    ``MIRRORAX_CPU_DEVICES`` (simulated CPU devices per process) while that is still possible. When the
    environment describes no job, JAX's backend is not started.

    Returns:
      True if this call joined a job; False if there is no job, the job has one process, or this
      process had already joined.

    Raises:
      ClusterError: the environment describes a job but JAX's backend already started, or joining
        failed (see :func:`initialize`).
      ValueError: a ``MIRRORAX_*`` variable or ``TF_CONFIG`` is malformed.

    Example:
      >>> maybe_initialize_from_env()  # no job in this environment
      False
    """
    if is_initialized():
        return False
    info = ray_train.job_from_ray() or job_from_env()  # a Ray Train worker: the job of Ray's worker group
    if info is None or info.num_processes == 1:
        if not backend_started():
            _apply_cpu_devices()
        return False
    if backend_started():
        raise ClusterError(
            f"The environment describes a job of {info.num_processes} processes (from {info.source}), "
            "but JAX's backend already started in this process, so it can only run alone. Fix: create "
            "mx.MirroredStrategy() (or call mx.initialize()) before any other JAX call.")
    initialize(info.coordinator_address, info.num_processes, info.process_id,
               local_device_ids=info.local_device_ids,
               initialization_timeout=_env_seconds("MIRRORAX_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT),
               heartbeat_timeout_seconds=_env_seconds("MIRRORAX_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT),
               shutdown_timeout_seconds=_env_seconds("MIRRORAX_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT))
    return True


def _resolve(address: str | None, num_processes: int | None, process_id: int | None,
             local_device_ids: Sequence[int] | None, method: str | None, timeout: int) -> ClusterInfo:
    """Fills unset values from the environment and validates the lot."""
    source = "arguments"
    if None in (address, num_processes, process_id):
        if method is not None:
            detect = getattr(getattr(private_jax("clusters"), "ClusterEnv", None),
                             "auto_detect_unset_distributed_params", None)
            if detect is None:
                raise ClusterError(
                    f"cluster_detection_method={method!r} asks JAX's own cluster detection, which mirrorax "
                    f"reaches through the private jax._src.clusters, absent from jax {jax.__version__} "
                    "(mirrorax is tested with jax 0.10). Pass coordinator_address, num_processes and "
                    "process_id, or set MIRRORAX_COORDINATOR / MIRRORAX_NUM_PROCESSES / MIRRORAX_PROCESS_ID.")
            address, num_processes, process_id, ids = detect(
                address, num_processes, process_id, local_device_ids, method, timeout)
            local_device_ids, source = ids, method
        elif (found := ray_train.job_from_ray() or job_from_env()) is not None:
            address = address if address is not None else found.coordinator_address
            num_processes = num_processes if num_processes is not None else found.num_processes
            process_id = process_id if process_id is not None else found.process_id
            if local_device_ids is None:
                local_device_ids = found.local_device_ids
            source = found.source
    missing = [n for n, v in (("coordinator_address", address), ("num_processes", num_processes),
                              ("process_id", process_id)) if v is None]
    if missing:
        raise ValueError(
            f"mx.initialize() needs {', '.join(missing)}, and the environment describes no job to take "
            "them from. Pass coordinator_address='host:port', num_processes=N, process_id=i, or set "
            "MIRRORAX_COORDINATOR / MIRRORAX_NUM_PROCESSES / MIRRORAX_PROCESS_ID (or run under srun, "
            "mpirun or TF_CONFIG).")
    return _discovery.make_info(address, num_processes, process_id, local_device_ids, source)


def resolve_bind_address(coordinator_address: str, explicit: str | None = None) -> str | None:
    """Where process 0's coordination service listens; ``None`` leaves JAX's choice (every interface).

    First match wins: ``explicit``; ``MIRRORAX_COORDINATOR_BIND``; ``JAX_COORDINATOR_BIND_ADDRESS``
    (``None``: JAX reads it itself); the coordinator's own address when its host is a loopback address
    (``127.x.y.z``, ``localhost``, ``::1``), because then every process is on this host and nothing
    elsewhere should reach the service; else ``None`` (JAX binds ``[::]:port``, which other hosts need).

    Args:
      coordinator_address: the job's ``"host:port"``.
      explicit: a ``"host:port"`` given by the caller, or ``None``.

    Returns:
      A ``"host:port"`` to bind, or ``None`` for JAX's default.

    Raises:
      ValueError: the explicit address or ``MIRRORAX_COORDINATOR_BIND`` is not ``"host:port"``.

    Example:
      >>> resolve_bind_address("127.0.0.1:1234")
      '127.0.0.1:1234'
      >>> resolve_bind_address("10.0.0.1:1234") is None  # every interface: the other hosts connect
      True
    """
    for value, name in ((explicit, "coordinator_bind_address"),
                        (os.environ.get("MIRRORAX_COORDINATOR_BIND"), "MIRRORAX_COORDINATOR_BIND")):
        if value:
            try:
                _discovery.split_address(value)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            return value
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None
    host, port = _discovery.split_address(coordinator_address)
    if not _is_loopback(host):
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _connect(info: ClusterInfo, timeout: int, shutdown_timeout: int, bind: str | None) -> None:
    """``jax.distributed.initialize`` with the failure modes that would crash in C++ turned into errors."""
    deadline = time.monotonic() + timeout
    host, port = _discovery.split_address(info.coordinator_address)
    if info.process_id == 0:
        _check_port_free(bind or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{port}",
                         info.coordinator_address)
    else:
        _wait_for_listener(host, port, info, deadline, timeout)
    # Past this point JAX aborts the process from C++ if not every process joins in time; a timer that
    # fires first says why in words (a thread cannot raise into the blocked main thread).
    joined = threading.Event()

    def _give_up() -> None:
        if not joined.is_set():
            _failure.die(
                f"mirrorax: process {info.process_id} reached the coordinator at {info.coordinator_address} "
                f"but not all {info.num_processes} processes joined within {timeout} s. Check that all "
                f"{info.num_processes} processes were started, that each was given the same process count "
                f"({info.num_processes}) and a distinct process id, and set MIRRORAX_INIT_TIMEOUT to wait "
                "longer if some start late.")

    timer = threading.Timer(max(1.0, deadline - time.monotonic()), _give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            info.coordinator_address, info.num_processes, info.process_id,
            local_device_ids=list(info.local_device_ids) if info.local_device_ids is not None else None,
            cluster_detection_method="deactivate", initialization_timeout=timeout + 30,
            heartbeat_timeout_seconds=(info.heartbeat_timeout_seconds if info.heartbeat_timeout_seconds is not None
                                       else DEFAULT_HEARTBEAT_TIMEOUT),
            shutdown_timeout_seconds=shutdown_timeout, coordinator_bind_address=bind)
    finally:
        joined.set()
        timer.cancel()


def _local_devices(info: ClusterInfo) -> int | None:
    """This process's device count where it is known without starting JAX's backend (simulated CPU devices, or
    the accelerators named by ``local_device_ids``), else ``None``."""
    if info.local_device_ids is not None:
        return len(info.local_device_ids)
    # jax.config's options are attributes made at run time; its stub lists none of them.
    count = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined]
    if (jax.config.jax_platforms or "").strip() == "cpu" and count and count > 0:  # type: ignore[attr-defined]
        return int(count)
    return None


def _check_port_free(bind: str, address: str) -> None:
    """Raises unless the coordination service can listen at ``bind`` (``"host:port"``): JAX would abort
    from C++ otherwise."""
    host, port = _discovery.split_address(bind)
    try:
        candidates = {(i[0], i[4][:2]) for i in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                    flags=socket.AI_PASSIVE)}
    except socket.gaierror as e:
        raise ClusterError(f"Process 0 should host the coordinator listening at {bind}, but {host!r} does not "
                           f"resolve on this host ({e.strerror}). Fix MIRRORAX_COORDINATOR_BIND (or "
                           "coordinator_bind_address) to an address of this host.") from None
    if host in ("::", "0.0.0.0"):  # every interface: gRPC falls back to IPv4 where IPv6 is off
        candidates |= {(socket.AF_INET, ("0.0.0.0", port)), (socket.AF_INET6, ("::", port))}
    errors: list[OSError] = []
    for family, sockaddr in sorted(candidates):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is no conflict
                s.bind(sockaddr)
        except OSError as e:
            errors.append(e)
    in_use = [e for e in errors if e.errno == errno.EADDRINUSE]
    if in_use:
        raise ClusterError(
            f"Process 0 hosts the coordinator at {address}, but port {port} is in use on this host "
            f"({in_use[0].strerror}). Pick a free port (mirrorax launch picks one when --port is not given), "
            f"or stop the process that holds it (e.g. a previous run: `ss -ltnp | grep :{port}`).")
    if errors and len(errors) == len(candidates):
        raise ClusterError(
            f"Process 0 hosts the coordinator at {address} and should listen at {bind}, but cannot "
            f"({errors[0].strerror}). Set MIRRORAX_COORDINATOR_BIND (or coordinator_bind_address) to an "
            f"address of this host, e.g. '0.0.0.0:{port}'.")


def _wait_for_listener(host: str, port: int, info: ClusterInfo, deadline: float, timeout: int) -> None:
    """Waits until something listens at the coordinator's address, or raises naming that address."""
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise ClusterError(
        f"Process {info.process_id} of {info.num_processes} could not reach the coordinator at "
        f"{info.coordinator_address} within {timeout} s (last error: {last}). Process 0 must be running "
        "and reachable from this host at that address; check the host name, the port and firewalls, "
        "or raise MIRRORAX_INIT_TIMEOUT if process 0 starts late.")


def _check_process_counts(info: ClusterInfo, timeout: int, client: Any) -> None:
    """Every process must agree on the process count; JAX trusts process 0's number silently."""
    client.key_value_set(f"mirrorax/num_processes/{info.process_id}", str(info.num_processes))
    others = range(1, info.num_processes) if info.process_id == 0 else [0]
    for other in others:
        try:
            theirs = int(client.blocking_key_value_get(f"mirrorax/num_processes/{other}", timeout * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            raise ClusterError(f"Process {info.process_id} could not read the process count of process "
                               f"{other} within {timeout} s: {e}") from None
        if theirs != info.num_processes:
            raise ClusterError(
                f"The processes disagree on the job's size: process {info.process_id} was told "
                f"num_processes={info.num_processes}, process {other} was told {theirs}. Start every "
                "process with the same MIRRORAX_NUM_PROCESSES (or num_processes=...).")


def _quiet_collectives(info: ClusterInfo) -> None:
    """Drops gloo's connection lines from this process's stdout (:mod:`mirrorax.cluster.output`), unless the
    launcher does it (``MIRRORAX_LAUNCHED``), the user wants them, or this is not a CPU job (only the
    CPU collectives are gloo's, and accelerator jobs should keep a plain stdout)."""
    if (info.num_processes > 1 and not os.environ.get("MIRRORAX_LAUNCHED") and not _output.verbose()
            # jax.config's options are attributes made at run time; its stub lists none of them.
            and ((jax.config.jax_platforms or "").strip() == "cpu"  # type: ignore[attr-defined]
                 or not accelerators_present())):
        _output.install()


def _apply_cpu_devices() -> None:
    """``MIRRORAX_CPU_DEVICES=K``: K simulated CPU devices in this process (set by ``mirrorax launch``)."""
    raw = os.environ.get("MIRRORAX_CPU_DEVICES")
    if raw is None or backend_started():
        return
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"MIRRORAX_CPU_DEVICES must be a positive integer; received {raw!r}.")
    jax.config.update("jax_num_cpu_devices", count)


def _env_seconds(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive number of seconds; received {raw!r}.")
    return value


def _reset_for_tests() -> None:
    """Forgets the joined job (tests only; the JAX runtime itself cannot be re-joined in a process)."""
    global _info
    _info = None
    _failure.uninstall()


if __name__ == "__main__":  # pragma: no cover - `python -m mirrorax.cluster.join`: what would be joined
    print(job_from_env(), file=sys.stdout)
