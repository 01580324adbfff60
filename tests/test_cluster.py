"""Joining a job: where the description comes from (ours, TF_CONFIG, SLURM, Open MPI) and clear errors.

Environment parsing is tested in-process with fake variables; everything that connects runs in fresh
subprocesses (a process joins at most one job, before its JAX backend starts).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap

import pytest
from jobs.procs import clean_env, free_port, launcher, python, run_all

from mirrorax.cluster import discovery as _discovery
from mirrorax.cluster import join as cluster

JOB_PREFIXES = ("MIRRORAX_", "TF_CONFIG", "SLURM_", "OMPI_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS",
                "KUBERNETES_SERVICE_HOST")


@pytest.fixture
def env(monkeypatch):
    """os.environ without any job description; returns a setter."""
    for name in list(os.environ):
        if name.startswith(JOB_PREFIXES):
            monkeypatch.delenv(name)

    def set_(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))

    return set_


# -- where the job description comes from (no connection) ----------------------------------------
def test_no_job_in_a_plain_environment(env):
    assert cluster.job_from_env() is None


def test_our_variables(env):
    env(MIRRORAX_COORDINATOR="h0:1234", MIRRORAX_NUM_PROCESSES=4, MIRRORAX_PROCESS_ID=3,
        MIRRORAX_LOCAL_DEVICE_IDS="0,1")
    info = cluster.job_from_env()
    assert (info.coordinator_address, info.num_processes, info.process_id) == ("h0:1234", 4, 3)
    assert info.local_device_ids == (0, 1) and info.source == "MIRRORAX_*" and not info.is_primary


@pytest.mark.parametrize("values, match", [
    (dict(MIRRORAX_COORDINATOR="h0:1234"), "MIRRORAX_NUM_PROCESSES, MIRRORAX_PROCESS_ID missing"),
    (dict(MIRRORAX_COORDINATOR="h0:1234", MIRRORAX_NUM_PROCESSES="two", MIRRORAX_PROCESS_ID=0),
     "MIRRORAX_NUM_PROCESSES must be an integer; received 'two'"),
    (dict(MIRRORAX_COORDINATOR="h0", MIRRORAX_NUM_PROCESSES=2, MIRRORAX_PROCESS_ID=0), "'host:port'"),
    (dict(MIRRORAX_COORDINATOR="h0:1", MIRRORAX_NUM_PROCESSES=2, MIRRORAX_PROCESS_ID=2),
     "process_id < num_processes"),
])
def test_our_variables_malformed(env, values, match):
    env(**values)
    with pytest.raises(ValueError, match=match):
        cluster.job_from_env()


def test_tf_config_workers(env):
    workers = ["w0.example:2222", "w1.example:2222", "w2.example:2222"]
    env(TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": 2}}))
    info = cluster.job_from_env()
    assert (info.coordinator_address, info.num_processes, info.process_id, info.source) == (
        "w0.example:2222", 3, 2, "TF_CONFIG")


def test_tf_config_chief_is_process_zero(env):
    cfg = {"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "task": {"type": "worker", "index": 0}}
    env(TF_CONFIG=json.dumps(cfg))
    info = cluster.job_from_env()
    assert (info.coordinator_address, info.num_processes, info.process_id) == ("c:1", 3, 1)
    cfg["task"] = {"type": "chief", "index": 0}
    env(TF_CONFIG=json.dumps(cfg))
    assert cluster.job_from_env().process_id == 0


@pytest.mark.parametrize("cfg, match", [
    ({"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}}, "parameter servers"),
    ({"cluster": {"worker": ["a:1"], "evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}},
     "task type 'evaluator'"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 5}}, "not in cluster"),
    ("{not json", "TF_CONFIG must be JSON"),
])
def test_tf_config_malformed(env, cfg, match):
    env(TF_CONFIG=cfg if isinstance(cfg, str) else json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        cluster.job_from_env()


def test_our_variables_win_over_tf_config(env):
    env(TF_CONFIG=json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"index": 1}}),
        MIRRORAX_COORDINATOR="h0:9", MIRRORAX_NUM_PROCESSES=2, MIRRORAX_PROCESS_ID=0)
    assert cluster.job_from_env().source == "MIRRORAX_*"


SLURM = dict(SLURM_JOB_ID="12345", SLURM_STEP_NODELIST="node[007-010],gpu1", SLURM_NTASKS="8",
             SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_STEP_NUM_NODES="4")


def test_slurm_is_read_through_jax_own_detector(env):
    env(**SLURM)
    info = cluster.job_from_env()
    # JAX's rule: the first node of the step, port = 61440 + job id % 4096.
    assert info.coordinator_address == f"node007:{61440 + 12345 % 4096}"
    assert (info.num_processes, info.process_id, info.source) == (8, 5, "slurm")
    assert info.local_device_ids == (1,)  # 2 tasks per node: one device each, as JAX does


def test_slurm_one_task_per_node_uses_every_local_device(env):
    env(**{**SLURM, "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
           "JAX_COORDINATOR_PORT": "4321"})
    info = cluster.job_from_env()
    assert info.coordinator_address == "node007:4321" and info.local_device_ids is None


def test_slurm_single_task_is_no_job(env):
    env(**{**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert cluster.job_from_env() is None


def test_open_mpi(env):
    env(OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://10.96.0.1,10.148.0.1:34911", OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="1")
    info = cluster.job_from_env()
    assert info.coordinator_address.startswith("10.96.0.1:")
    assert (info.num_processes, info.process_id, info.source, info.local_device_ids) == (2, 1, "ompi", None)


def test_kubernetes_pod_without_indexed_job_is_not_probed(env):
    env(KUBERNETES_SERVICE_HOST="10.0.0.1")  # JAX's detector would warn (an error in our tests)
    assert cluster.job_from_env() is None


class _CloudTpuWithoutMetadata:
    """JAX's Cloud-TPU detector on a TPU host without the GCE metadata server: its environment variables
    are there, but reading the job queries the server and raises (requests.ConnectionError there)."""

    opt_in_only_method = False
    name = "gketpu"
    __name__ = "GkeTpuCluster"

    @classmethod
    def is_env_present(cls):
        return True

    asked = 0

    @classmethod
    def get_process_count(cls):
        cls.asked += 1
        # requests' words on a host without the server (a 500-character repr of the pool and its cause)
        raise ConnectionError(
            "HTTPConnectionPool(host='metadata.google.internal', port=80): Max retries exceeded with url: "
            "/computeMetadata/v1/instance/attributes/agent-worker-number (Caused by NameResolutionError(\"<urllib3."
            "connection.HTTPConnection object at 0x7f3a2c1d5e10>: Failed to resolve 'metadata.google.internal' "
            "([Errno -2] Name or service not known)\"))")


class _ProbeRaises:
    """A detector whose very probe fails (no network, a missing optional package)."""

    opt_in_only_method = False
    name = "gcetpu"
    __name__ = "GceTpuCluster"

    @classmethod
    def is_env_present(cls):
        raise OSError("[Errno 101] Network is unreachable")


def test_a_detector_that_raises_is_no_job_and_says_so_once(env, monkeypatch, capsys):
    from jax._src import clusters

    monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [_ProbeRaises, _CloudTpuWithoutMetadata])
    monkeypatch.setattr(_discovery, "_FAILED", {})
    assert cluster.job_from_env() is None
    err = capsys.readouterr().err
    # The probe that failed says nothing (no job looked present); the one that found its environment says
    # what failed, that the run goes on alone, and how to join a job instead: one line.
    assert err.count("\n") == 1 and "GceTpuCluster" not in err and "gcetpu" not in err
    # One short line: the error's kind, not requests' repr of its connection pool (issue 48: 600 characters).
    assert len(err) <= 140 and "HTTPConnectionPool" not in err and "0x7f" not in err, err
    assert err == ("mirrorax: running as one process (JAX's 'gketpu' job detector failed: ConnectionError; set "
                   "MIRRORAX_COORDINATOR=host:port to join a job)\n"), err
    # The explicit settings come first and never reach the detectors.
    env(MIRRORAX_COORDINATOR="h0:1", MIRRORAX_NUM_PROCESSES=2, MIRRORAX_PROCESS_ID=1)
    assert cluster.job_from_env().process_id == 1
    assert capsys.readouterr().err == ""


def test_a_strategy_starts_where_the_detector_raises(env, monkeypatch, capsys):
    from jax._src import clusters

    import mirrorax as mx

    monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [_ProbeRaises, _CloudTpuWithoutMetadata])
    monkeypatch.setattr(_discovery, "_FAILED", {})
    monkeypatch.setattr(_CloudTpuWithoutMetadata, "asked", 0)
    strategy = mx.MirroredStrategy()
    assert strategy.num_replicas_in_sync == len(jax_devices()) and not cluster.is_initialized()
    assert "running as one process" in capsys.readouterr().err
    # A process builds many strategies: the server is asked, and the notice printed, once per environment.
    mx.MirroredStrategy()
    assert _CloudTpuWithoutMetadata.asked == 1 and capsys.readouterr().err == ""
    env(SLURM_JOB_NAME="another")  # another environment: asked again
    mx.MirroredStrategy()
    assert _CloudTpuWithoutMetadata.asked == 2 and "running as one process" in capsys.readouterr().err


def jax_devices():
    import jax

    return jax.devices()


def test_process_helpers_before_any_job():
    assert _discovery.split_address("[::1]:80") == ("::1", 80)
    if not cluster.is_initialized():
        assert cluster.process_count() >= 1 and cluster.process_index() >= 0


# -- a JAX without the private modules mirrorax reads ----------------------------------------------
@pytest.fixture
def without(monkeypatch):
    """``without("clusters")``: importing ``jax._src.clusters`` fails, as on a JAX that moved it."""
    monkeypatch.setattr(cluster, "_warned", set())

    def hide(name: str) -> None:
        monkeypatch.setitem(sys.modules, f"jax._src.{name}", None)

    return hide


def test_without_backend_query_warns_and_assumes_not_started(without):
    without("xla_bridge")
    with pytest.warns(RuntimeWarning, match="cannot tell whether JAX's backend started.*assumes"):
        assert cluster.backend_started() is False
    assert cluster.backend_started() is False  # warned once


def test_without_jax_detectors_a_multi_task_job_is_a_clear_error(env, without):
    without("clusters")
    assert cluster.job_from_env() is None  # no scheduler: nothing to detect
    env(**{**SLURM, "SLURM_NTASKS": "1"})
    assert cluster.job_from_env() is None  # one task: it runs alone anyway
    env(**SLURM)
    with pytest.raises(cluster.ClusterError, match="SLURM_NTASKS=8: .*one task of a 8-task job.*jax._src.clusters"
                                                   ".*Set MIRRORAX_COORDINATOR"):
        cluster.job_from_env()
    env(MIRRORAX_COORDINATOR="h0:1", MIRRORAX_NUM_PROCESSES=8, MIRRORAX_PROCESS_ID=5)
    assert cluster.job_from_env().process_id == 5  # the fix the message names works


def test_jax_detectors_with_another_interface_are_a_clear_error_too(env, monkeypatch):
    from jax._src import clusters

    class Moved:  # a detector whose methods JAX renamed
        opt_in_only_method = False
        __name__ = "Moved"

    monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [Moved])
    env(**SLURM)
    with pytest.raises(cluster.ClusterError, match="SLURM_NTASKS=8: .*jax._src.clusters\\) changed "
                                                   "\\(AttributeError"):
        cluster.job_from_env()


def test_without_jax_detectors_a_detection_method_is_a_clear_error(env, without):
    without("clusters")
    with pytest.raises(cluster.ClusterError, match="cluster_detection_method='mpi4py' .*jax._src.clusters.*"
                                                   "Pass coordinator_address"):
        cluster._resolve(None, None, None, None, "mpi4py", 5)


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(60)
def test_without_the_distributed_client_a_job_still_joins_with_a_warning():
    port = free_port()
    codes, outs, _ = run_all([_snippet(f"""
        import sys, warnings
        import mirrorax.cluster.join as c
        sys.modules["jax._src.distributed"] = None  # a JAX that moved its client
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = c.initialize("127.0.0.1:{port}", 1, 0)
        print("JOINED", info.num_processes, [str(w.message)[:60] for w in caught])""")], [clean_env()], timeout=50)
    assert "JOINED 1" in outs[0] and "has no jax._src.distributed.global_state.client" in outs[0], outs[0]


# -- where process 0's coordination service listens -------------------------------------------------
@pytest.mark.parametrize("address, want", [
    ("127.0.0.1:1234", "127.0.0.1:1234"), ("127.3.2.1:1234", "127.3.2.1:1234"),
    ("localhost:1234", "localhost:1234"), ("[::1]:1234", "[::1]:1234"),
    ("10.0.0.1:1234", None), ("host0:1234", None), ("[fe80::1]:1234", None),
])
def test_a_loopback_coordinator_listens_on_loopback_only(env, address, want):
    assert cluster.resolve_bind_address(address) == want


def test_bind_address_overrides(env):
    assert cluster.resolve_bind_address("127.0.0.1:1", "0.0.0.0:1") == "0.0.0.0:1"
    env(JAX_COORDINATOR_BIND_ADDRESS="10.1.1.1:1")
    assert cluster.resolve_bind_address("127.0.0.1:1") is None  # JAX reads its own variable
    env(MIRRORAX_COORDINATOR_BIND="10.2.2.2:1")
    assert cluster.resolve_bind_address("10.0.0.1:1") == "10.2.2.2:1"
    env(MIRRORAX_COORDINATOR_BIND="10.2.2.2")
    with pytest.raises(ValueError, match="MIRRORAX_COORDINATOR_BIND: .*'host:port'"):
        cluster.resolve_bind_address("10.0.0.1:1")


def test_the_port_check_probes_the_address_to_be_bound():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for bind in (f"127.0.0.1:{port}", f"[::]:{port}", f"0.0.0.0:{port}"):
            with pytest.raises(cluster.ClusterError, match=f"port {port} is in use"):
                cluster._check_port_free(bind, f"127.0.0.1:{port}")
        cluster._check_port_free(f"127.0.0.2:{port}", f"127.0.0.2:{port}")  # another address: free
    with pytest.raises(cluster.ClusterError, match="should listen at 192.0.2.1:1234, but cannot .*"
                                                   "MIRRORAX_COORDINATOR_BIND"):
        cluster._check_port_free("192.0.2.1:1234", "h0:1234")  # not an address of this host


@pytest.mark.slow  # starts processes
@pytest.mark.multi_process
@pytest.mark.timeout(90)
def test_under_the_launcher_the_coordinator_listens_on_loopback_only_and_gloo_is_quiet():
    port = free_port()
    codes, outs, _ = run_all([launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--port", str(port),
                                       "--", *python("tests/jobs/psum.py"))],
                             [clean_env(MP_LISTENERS="1")], timeout=80)
    assert codes == [0], outs
    line = next(x for x in outs[0].splitlines() if "LISTENERS" in x)
    addresses = line.split("LISTENERS")[1].split()
    # gRPC listens on an IPv6 socket; "::ffff:127.0.0.1" is its IPv4 loopback address.
    assert addresses and set(addresses) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, line
    assert "[Gloo]" not in outs[0], outs[0]  # gloo's connection chatter is dropped by the launcher


# -- joining, in subprocesses ---------------------------------------------------------------------
def _snippet(code: str) -> list[str]:
    return python("-c", textwrap.dedent(code))


def _ours(port: int, n: int, i: int, **extra: str) -> dict[str, str]:
    return clean_env(MIRRORAX_COORDINATOR=f"127.0.0.1:{port}", MIRRORAX_NUM_PROCESSES=str(n),
                     MIRRORAX_PROCESS_ID=str(i), MIRRORAX_CPU_DEVICES="2", **extra)


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(60)
def test_no_job_does_not_start_the_backend():
    code, out, _ = run_all([_snippet("""
        from mirrorax.cluster import join as cluster
        import mirrorax.keras.adapter, mirrorax.fit.functions, mirrorax.trainer  # importing starts no backend either
        assert not cluster.backend_started()
        assert cluster.maybe_initialize_from_env() is False
        assert not cluster.backend_started()
        import jax; assert len(jax.devices()) == 3, jax.devices()
        print("OK")""")], [clean_env(MIRRORAX_CPU_DEVICES="3")], timeout=50)
    assert code == [0] and "OK" in out[0], out[0]


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(60)
def test_initialize_after_backend_started_is_a_clear_error():
    codes, outs, _ = run_all([_snippet("""
        import jax; jax.devices()
        import mirrorax.cluster.join as c
        try:
            c.initialize("127.0.0.1:1", 2, 0)
        except c.ClusterError as e:
            print("ERR", e)""")], [clean_env()], timeout=50)
    assert "ERR" in outs[0] and "before JAX starts its backend" in outs[0], outs[0]


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(60)
def test_env_job_after_backend_started_is_a_clear_error():
    codes, outs, _ = run_all([_snippet("""
        import jax; jax.devices()
        import mirrorax.cluster.join as c
        c.maybe_initialize_from_env()""")], [_ours(free_port(), 2, 1)], timeout=50)
    assert codes[0] != 0 and "describes a job of 2 processes" in outs[0], outs[0]


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(60)
def test_initialize_twice_is_a_clear_error():
    port = free_port()
    codes, outs, _ = run_all([_snippet(f"""
        import mirrorax.cluster.join as c
        info = c.initialize("127.0.0.1:{port}", 1, 0)
        assert c.is_initialized() and c.process_count() == 1
        try:
            c.initialize("127.0.0.1:{port}", 1, 0)
        except c.ClusterError as e:
            print("ERR", e)""")], [clean_env()], timeout=50)
    assert "ERR This process already joined a job as process 0 of 1" in outs[0], outs[0]


@pytest.mark.slow  # starts processes
@pytest.mark.multi_process
@pytest.mark.timeout(60)
def test_coordinator_that_never_answers_names_the_address():
    port = free_port()
    codes, outs, times = run_all([python("tests/jobs/psum.py")],
                                 [_ours(port, 2, 1, MIRRORAX_INIT_TIMEOUT="3")], timeout=50)
    assert codes[0] == 1 and times[0] < 20, (codes, times, outs)
    assert f"could not reach the coordinator at 127.0.0.1:{port} within 3 s" in outs[0], outs[0]


@pytest.mark.slow  # starts processes
@pytest.mark.multi_process
@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        codes, outs, _ = run_all([python("tests/jobs/psum.py")], [_ours(port, 2, 0)], timeout=50)
    assert codes[0] == 1 and f"port {port} is in use" in outs[0], outs[0]


@pytest.mark.slow  # starts processes
@pytest.mark.multi_process
@pytest.mark.timeout(60)
def test_processes_that_disagree_on_the_count_fail_clearly():
    port = free_port()
    codes, outs, _ = run_all([python("tests/jobs/psum.py")] * 2,
                             [_ours(port, 2, 0), _ours(port, 3, 1)], timeout=50)
    assert codes == [1, 1], (codes, outs)
    assert "disagree on the job's size" in outs[0] + outs[1], outs


@pytest.mark.slow  # starts processes
@pytest.mark.multi_process
@pytest.mark.timeout(60)
def test_a_process_that_never_comes_ends_the_wait():
    port = free_port()
    codes, outs, times = run_all([python("tests/jobs/psum.py")] * 2,
                                 [_ours(port, 3, 0, MIRRORAX_INIT_TIMEOUT="4"),
                                  _ours(port, 3, 1, MIRRORAX_INIT_TIMEOUT="4")], timeout=50)
    assert all(c not in (0, -999) for c in codes) and max(times) < 30, (codes, times, outs)
    assert "not all 3 processes joined within 4 s" in outs[0], outs[0]


def _psum_ok(codes, outs, n=2):
    assert codes == [0] * n, (codes, outs)
    for i, out in enumerate(outs):
        assert f"RESULT {i} {n} {2 * n} {float(sum(range(2 * n)))} joined=True" in out, out


@pytest.mark.slow  # starts processes
@pytest.mark.multi_process
@pytest.mark.timeout(90)
def test_two_real_processes_from_fake_slurm_variables():
    """What `srun -N1 -n2 python psum.py` would give each task, JAX's SLURM detector deriving the rest."""
    port = free_port()
    envs = [clean_env(SLURM_JOB_ID="77", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                      SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_STEP_NUM_NODES="1",
                      JAX_COORDINATOR_PORT=str(port), MIRRORAX_CPU_DEVICES="2") for i in range(2)]
    codes, outs, _ = run_all([python("tests/jobs/psum.py")] * 2, envs, timeout=80)
    _psum_ok(codes, outs)


@pytest.mark.slow  # starts processes
@pytest.mark.multi_process
@pytest.mark.timeout(90)
def test_two_real_processes_from_tf_config():
    workers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    envs = [clean_env(TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}),
                      MIRRORAX_CPU_DEVICES="2") for i in range(2)]
    codes, outs, _ = run_all([python("tests/jobs/psum.py")] * 2, envs, timeout=80)
    _psum_ok(codes, outs)
