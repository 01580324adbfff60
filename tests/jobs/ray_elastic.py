"""A Ray Train job of ``elastic_job.py`` on a local cluster of simulated nodes, workers lost and brought back.

Usage: python ray_elastic.py OUT [elastic|minimum]  (environment: ``EJ_EVENTS``, ``EJ_PHASES``,
``MIRRORAX_SNAPSHOT_STEPS``, ``RE_WAIT_S``)

The cluster: a head node (no CPU: the driver and Ray Train's controller live there) and 4 worker nodes of one
``mx_worker`` slot each, every Ray process on 127.0.0.1 (the nodes share one address) with Ray's token
authentication on. The training: ``mirrorax.cluster.ray_train.JaxTrainer`` with 2 CPU devices per worker,
``FailureConfig(max_failures=...)``. This driver acts on the job's markers (``elastic_job.py``):
``held-<phase>-<step>-<rank>`` (a worker waits): SIGKILL that worker and remove its node, a lost host;
``done-*-wait-*`` (a smaller group waits): add a node, so that Ray's next resize grows the group back.
It prints ``EVENT ...`` lines (each ends with the wall clock's time) and ``RESULT ok`` or the error.

* ``elastic`` (the default): ``ScalingConfig(num_workers=(2, 4))``, the events of ``EJ_EVENTS``; it also prints
  ``LISTENERS`` (every TCP socket a process of the cluster listens on, from psutil: what ``ss -ltnp`` shows)
  and ``TOKEN`` (what a client with a wrong token got).
* ``minimum``: first a run of 4 workers that succeeds (``EJ_PHASES``), then ``SNAPSHOTS LEFT`` (the files left
  in every node's snapshot directory: none, whatever the nodes' shared address); then a run of
  ``num_workers=(3, 4)`` with ``wait_for_workers_s=RE_WAIT_S`` in which the workers of ranks 2 and 3 are held at
  step 10 of the ``loop`` phase, killed and their nodes removed: ``RESULT2 <error>`` (how it ended),
  ``ENDED <s>`` (from the second node's removal to its end) and ``KEPT {node: files}`` (the snapshots of the
  nodes left).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

OUT = os.path.abspath(sys.argv[1])
HERE = os.path.dirname(os.path.abspath(__file__))
# Ray's own setup, before Ray is imported: token authentication, and a driver that connects on loopback (Ray
# otherwise swaps 127.0.0.1 in an address for this host's outward address, where nothing listens).
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                  RAY_USAGE_STATS_ENABLED="0", RAY_TRAIN_V2_ENABLED="1",
                  # a group started while Ray still counts a removed node waits this long for it (default 60 s)
                  RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10")

import psutil  # noqa: E402  (Ray's dependency)
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))
import mirrorax.cluster.ray_train as mx_ray  # noqa: E402
from jobs import elastic_job  # noqa: E402

# Ray's sessions (logs, sockets) in a directory of this run, removed at its end: short, for Unix socket paths.
TEMP = tempfile.mkdtemp(prefix="mxray-")
# ray.cluster_utils.Cluster writes the head's address to <default temp dir>/ray/ray_current_cluster whatever its
# temp_dir says, and fails where that directory does not exist (a fresh machine: nothing made /tmp/ray before).
# The default temp dir is RAY_TMPDIR: this run's own, so that it writes nowhere outside it.
os.environ["RAY_TMPDIR"] = TEMP
os.makedirs(os.path.join(TEMP, "ray"), exist_ok=True)
NODE = dict(node_ip_address="127.0.0.1", num_cpus=1, resources={"mx_worker": 1}, include_dashboard=False,
            temp_dir=TEMP)
START = time.monotonic()


def say(*words: object) -> None:
    print(f"EVENT {time.monotonic() - START:7.1f}s", *words, f"at {time.time():.3f}", flush=True)


def listeners() -> list[tuple[str, str]]:
    """(address, process name) of every listening TCP socket of this process's descendants."""
    ours = {p.pid: p.name() for p in psutil.Process().children(recursive=True)}
    found = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in ours:
            found.append((c.laddr.ip, ours[c.pid]))
    return found


# A client with the wrong token: Ray must refuse it (it retries for ~20 s first: run beside the training).
PROBE = ("import ray, sys\ntry:\n    ray.init(address=sys.argv[1])\n    print('CONNECTED')\n"
         "except Exception as e:\n    print('REFUSED', type(e).__name__)\n")


def start() -> tuple[Cluster, list]:
    cluster = Cluster(initialize_head=True, head_node_args=dict(node_ip_address="127.0.0.1", num_cpus=0,
                                                                include_dashboard=False, temp_dir=TEMP))
    nodes = [cluster.add_node(**NODE) for _ in range(4)]
    ray.init(address=cluster.address)
    assert ray.get_runtime_context().get_node_id() == cluster.head_node.node_id, "the driver is not on the head"
    say("cluster up")
    return cluster, nodes


def job_env(events: str, phases: str) -> dict[str, str]:
    import numpy as np

    x, y, xt, yt = elastic_job.data()
    np.savez(os.path.join(OUT, "data.npz"), x=x, y=y, xt=xt, yt=yt)
    env = {"EJ_OUT": OUT, "EJ_EVENTS": events, "EJ_PHASES": phases,
           "MIRRORAX_SNAPSHOT_STEPS": os.environ.get("MIRRORAX_SNAPSHOT_STEPS", "3"),
           "EJ_DATA": os.path.join(OUT, "data.npz")}
    return {k: v for k, v in env.items() if v}


def trainer(env: dict[str, str], name: str, workers: int | tuple[int, int], **kwargs):
    return mx_ray.JaxTrainer(
        elastic_job.ray_main, train_loop_config={"env": env}, cpu_devices_per_worker=2,
        snapshot_dir=os.path.join(OUT, f"snapshots-{name}"),
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"mx_worker": 1},
                                     elastic_resize_monitor_interval_s=2.0),
        run_config=RunConfig(name=name, storage_path=os.path.join(OUT, "ray"),
                             failure_config=FailureConfig(max_failures=8),
                             worker_runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}),
        **kwargs)


def run(cluster: Cluster, nodes: list, job, on_first_hold=None, removed: list[float] | None = None) -> list[object]:
    """Fits ``job`` in a thread while acting on its markers; returns ``[None]`` or ``[the error]``. ``removed``: each
    node's removal time (``time.monotonic()``) is appended there."""
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(_fit(job)), daemon=True)
    thread.start()
    seen: set[str] = set()
    while thread.is_alive():
        for name in sorted(os.listdir(OUT)):
            if name in seen or not (name.startswith("held-") or "-wait-" in name) or name.endswith(".tmp"):
                continue
            seen.add(name)
            if name.startswith("held-"):
                with open(os.path.join(OUT, name)) as f:
                    held = json.load(f)
                if on_first_hold is not None:  # every process of the cluster is up: the training's too
                    on_first_hold()
                    on_first_hold = None
                node = next(n for n in nodes if n.node_id == held["node"])
                os.kill(held["pid"], signal.SIGKILL)  # the worker dies at once; then its host leaves the cluster
                say("killed", name, "pid", held["pid"])
                cluster.remove_node(node, allow_graceful=True)
                nodes.remove(node)
                if removed is not None:
                    removed.append(time.monotonic())
                say("removed its node")
            else:
                nodes.append(cluster.add_node(**NODE))
                say("added a node after", name)
        time.sleep(0.1)
    thread.join()
    say("fit returned", outcome)
    return outcome


def files_under(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def elastic(cluster: Cluster, nodes: list) -> None:
    probe = subprocess.Popen([sys.executable, "-c", PROBE, cluster.address], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, RAY_AUTH_TOKEN="0" * 32))
    job = trainer(job_env(os.environ.get("EJ_EVENTS", ""), os.environ.get("EJ_PHASES", "")), "elastic", (2, 4))
    outcome = run(cluster, nodes, job, lambda: print("LISTENERS", json.dumps(listeners()), flush=True))
    print("TOKEN", probe.communicate(timeout=120)[0].strip(), flush=True)
    print("RESULT", "ok" if outcome and outcome[0] is None else outcome, flush=True)


def minimum(cluster: Cluster, nodes: list) -> None:
    outcome = run(cluster, nodes, trainer(job_env("", os.environ.get("EJ_PHASES", "loop")), "clean", 4))
    print("RESULT", "ok" if outcome and outcome[0] is None else outcome, flush=True)
    print("SNAPSHOTS LEFT", json.dumps(files_under(os.path.join(OUT, "snapshots-clean"))), flush=True)
    wait = float(os.environ.get("RE_WAIT_S", "20"))
    job = trainer(job_env("hold:loop:10:rank2:4,hold:loop:10:rank3:4", "loop"), "minimum", (3, 4),
                  wait_for_workers_s=wait)
    removed: list[float] = []
    outcome = run(cluster, nodes, job, removed=removed)
    ended = time.monotonic()
    print("RESULT2", outcome[0] if outcome else "nothing", flush=True)
    print("ENDED", f"{ended - removed[-1]:.1f}" if removed else "never removed", flush=True)
    left = [f"ray-{n.node_id[:16]}" for n in nodes]  # (the names mirrorax.cluster.restarts.node_name gives them)
    print("KEPT", json.dumps({node: files_under(os.path.join(OUT, "snapshots-minimum", node)) for node in left}),
          flush=True)


def main() -> None:
    cluster, nodes = start()
    try:
        {"elastic": elastic, "minimum": minimum}[sys.argv[2] if len(sys.argv) > 2 else "elastic"](cluster, nodes)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if os.environ.get("RE_KEEP_LOGS"):  # (Ray's logs, to see where a restart's time went)
            print("LOGS", TEMP, flush=True)
        else:
            shutil.rmtree(TEMP, ignore_errors=True)


def _fit(trainer) -> object:
    try:
        trainer.fit()
        return None
    except Exception as e:  # noqa: BLE001 - reported on the RESULT line
        return f"{type(e).__name__}: {e}"[:2000]


if __name__ == "__main__":
    main()
