"""A plain-JAX job for the launcher and cluster tests: join from the environment, then all-reduce.

Prints one line per process: ``RESULT <process> <count> <global devices> <sum>``. ``MP_FAIL=raise:R`` /
``MP_FAIL=kill:R`` / ``MP_FAIL=stop:R`` makes process R raise / SIGKILL / SIGSTOP itself after ``MP_FAIL_STEP``
steps (default 5) while the others keep all-reducing (they block in the collective, the case that must not hang).
``MP_FAIL_SLOTS=1,2`` names ``mirrorax launch`` slots (``MIRRORAX_SLOT``) in place of R: each of them fails so, in every
attempt. ``MP_LISTENERS=1`` makes process 0 print ``LISTENERS <addresses>``: where the coordinator's port listens.
"""

import os
import signal
import sys
import time

import numpy as np

from mirrorax.cluster import join as cluster

joined = cluster.maybe_initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

me, count = jax.process_index(), jax.process_count()
mesh = jax.make_mesh((jax.device_count(),), ("batch",), devices=jax.devices())
sharding = NamedSharding(mesh, P("batch"))
total = jax.jit(jnp.sum)
mode, _, rank = os.environ.get("MP_FAIL", "").partition(":")
slots = os.environ.get("MP_FAIL_SLOTS", "")
failing = os.environ.get("MIRRORAX_SLOT", "") in slots.split(",") if slots else rank == str(me)
fail_step = int(os.environ.get("MP_FAIL_STEP", "5"))
steps = int(os.environ.get("MP_STEPS", "3"))
step = 0
while step < steps or mode:
    rows = np.arange(jax.local_device_count(), dtype=np.float32) + me * jax.local_device_count()
    value = float(total(jax.make_array_from_process_local_data(sharding, rows)))
    step += 1
    if mode and step == fail_step and failing:
        print(f"process {me} fails now ({mode}) at {time.time():.3f}", flush=True)
        if mode == "raise":
            raise RuntimeError(f"boom in process {me}")
        os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
    if mode and step > 100000:
        break
if os.environ.get("MP_LISTENERS") and me == 0:
    from procs import listeners  # this script's folder is on sys.path

    print("LISTENERS", *listeners(int(os.environ["MIRRORAX_COORDINATOR"].rpartition(":")[2])), flush=True)
print(f"RESULT {me} {count} {jax.device_count()} {value} joined={joined}", flush=True)
sys.exit(0)
