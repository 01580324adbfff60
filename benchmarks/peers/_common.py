"""What every system's benchmark process shares: its command line, device set-up, timing and result file.

A system runs as ``python -m benchmarks.peers.<module> --workload W --devices N --steps S --warmup K
--repeats R --batch B --json-out F``: it builds the workload, runs ``K`` warm-up steps (compilation
included), then ``R`` timed runs of ``S`` steps each, and writes one JSON object to ``F``::

    {"system", "workload", "devices", "batch", "steps", "warmup", "repeats", "bf16", "status": "ok",
     "samples_per_s": [one per timed run], "warmup_s", "peak_rss_mb", "device_kind", "note", "versions"}

Device counts are fixed when a backend starts, hence one process per (system, device count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["parse_args", "use_cpu_devices", "peak_rss_mb", "device_memory", "time_runs", "write_result",
           "main_guard", "make_batches"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(system: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parses a system process's command line (the same flags for every system)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.peers.{system}",
                                description=f"Time one workload with {system} on N devices.")
    p.add_argument("--workload", required=True, help="mlp | cnn | transformer | lm (or a | b | c | d)")
    p.add_argument("--devices", type=int, default=1, help="number of devices (simulated CPU devices on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per timed run (workload default)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps before timing (workload default)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs in this process")
    p.add_argument("--batch", type=int, default=None, help="global batch (workload default)")
    p.add_argument("--bf16", action="store_true", help="mixed bfloat16 precision")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--steps-per-execution", type=int, default=1,
                   help="mirrorax / keras fit: steps fused into one dispatch (where supported)")
    p.add_argument("--quick", action="store_true", help="the workload's quick steps (unless --steps)")
    p.add_argument("--json-out", default=None, help="write the result here (else print it)")
    args = p.parse_args(argv)
    args.system = system
    sys.path.insert(0, _REPO)
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    args.workload = wl.name
    args.steps_given = args.steps is not None
    args.steps = args.steps or (wl.quick_steps if args.quick else wl.steps)
    args.warmup = wl.warmup if args.warmup is None else args.warmup
    args.batch = args.batch or wl.batch
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must divide evenly over --devices {args.devices}")
    return args


def use_cpu_devices(n: int) -> None:
    """Asks JAX for ``n`` CPU devices; must run before JAX's backend starts.

    Real accelerators, where present, are used instead (their count is what it is); on CPU the host's
    cores are shared by the ``n`` simulated devices.
    """
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def jax_devices(args: argparse.Namespace) -> list[Any]:
    """The first ``args.devices`` JAX devices (raises if there are fewer). On an accelerator, unless ``--steps``
    was given, ``args.steps`` becomes the workload's ``accel_steps``: the CPU's few steps would time a fit
    call's set-up there, not its steps."""
    import jax

    n = args.devices
    devices = jax.devices()
    if len(devices) < n:
        raise RuntimeError(f"Expected at least {n} {jax.default_backend()} devices. Received: {len(devices)}")
    from benchmarks import workloads

    accel = workloads.get(args.workload).accel_steps
    if devices[0].platform != "cpu" and not getattr(args, "steps_given", True) and not args.quick and accel:
        args.steps = max(args.steps, accel)
    return devices[:n]


def peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``) in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def make_batches(x: Any, y: Any, batch: int) -> list[tuple[Any, Any]]:
    """Splits host arrays into consecutive global batches (views, no copies)."""
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x) - batch + 1, batch)]


def time_runs(run_once: Callable[[], None], repeats: int, samples_per_run: int) -> list[float]:
    """Calls ``run_once`` (which must return only when its work is finished) ``repeats`` times.

    Returns:
      samples per second of each call.
    """
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_once()
        rates.append(samples_per_run / (time.perf_counter() - t0))
    return rates


def device_memory() -> dict[str, Any]:
    """The first device's allocator figures where JAX keeps them (GPUs, TPUs; CPU devices keep none):
    ``device_peak_bytes`` (the process's peak in use) and ``device_bytes_limit``; empty otherwise."""
    if "jax" not in sys.modules:
        return {}
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - platforms without memory stats
        return {}
    out = {"device_peak_bytes": stats.get("peak_bytes_in_use"), "device_bytes_limit": stats.get("bytes_limit")}
    return {k: int(v) for k, v in out.items() if v is not None}


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("jax", "keras", "tensorflow", "torch"):
        if mod in sys.modules:
            out[mod] = getattr(sys.modules[mod], "__version__", "?")
    return out


def write_result(args: argparse.Namespace, **fields: Any) -> dict[str, Any]:
    """Writes the process's result (``status`` ``ok`` unless given) to ``--json-out`` or stdout."""
    result = {
        "system": args.system, "workload": args.workload, "devices": args.devices, "batch": args.batch,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "bf16": bool(args.bf16),
        "status": "ok", "peak_rss_mb": peak_rss_mb(), "versions": _versions(), **device_memory(),
    }
    result.update(fields)
    text = json.dumps(result, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text)
    else:
        print(text)
    return result


def main_guard(args: argparse.Namespace, body: Callable[[], None]) -> None:
    """Runs ``body``; an exception becomes an ``error`` result (with the message) and exit status 1."""
    try:
        body()
    except Exception as e:  # noqa: BLE001 - any failure is a benchmark result, reported as such
        traceback.print_exc()
        write_result(args, status="error", note=f"{type(e).__name__}: {e}"[:500])
        sys.exit(1)
