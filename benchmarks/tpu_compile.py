"""Each system's train step compiled for a TPU v5e on a host without one: what XLA:TPU makes of it.

libtpu's compile-only client compiles for a TPU topology with no chip attached. Each system (the systems of
``benchmarks.accelerator``) is built on one CPU device as the table builds it, and the first program its
first step compiles whose name matches the system's step is compiled again for the TPU instead of running
(the run stops there: no CPU compile, no step). Printed per system: the compile's seconds on this host,
XLA's static cost estimate (bytes accessed, FLOPs), and the compiled program's conditionals, copies,
asynchronous copies (memory-space prefetches and evictions) and fusions.

A static estimate from another build of the compiler than the chip's (libtpu 0.0.42, the version
jax 0.10.2 pins): it showed the LM's two mirrorax programs alike (561 asynchronous copies each) where
the chip's compiler made 544 and 706 in their entry computations. Use it to find where programs differ
before spending chip time, never as a measurement. Needs ``pip install "libtpu==0.0.42.*"`` (~700 MB);
``--libtpu DIR`` where it was installed with ``--target DIR``.

    python -m benchmarks.tpu_compile --workload transformer
    python -m benchmarks.tpu_compile --workload lm --systems mirrorax,keras_scope
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The program each system's first step compiles for its training step (jax.jit's module names).
STEP_PROGRAM = {"jax": r"train_step", "keras_fit": r"train_step", "mirrorax": r"guarded",
                "keras_scope": r"guarded", "guide_api": r"with_token"}


class _Compiled(Exception):
    """Raised from inside the first step once its program is compiled for the TPU: the step stops there."""


def tpu_device(topology: str) -> Any:
    """A device of a TPU ``topology`` (e.g. ``"v5e:1x1"``) from libtpu's compile-only client."""
    from jax.experimental import topologies

    bounds = {"chips_per_host_bounds": (1, 1, 1)} if topology.endswith(":1x1") else {}
    return topologies.get_topology_desc(topology_name=topology, platform="tpu", **bounds).devices[0]


def child(workload: str, system: str, topology: str) -> None:
    """Builds ``system`` on one CPU device and compiles its step's program for the TPU; prints one row."""
    import jax
    import keras
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client as xc

    from benchmarks import accelerator as acc
    from benchmarks import workloads

    wl = workloads.get(workload)
    if acc.PLANS[wl.name].bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x, y = workloads.make_data(wl, wl.batch * 2)
    tpu = tpu_device(topology)
    original = compiler.backend_compile_and_load
    got: dict[str, Any] = {}

    def compile_for_tpu(backend: Any, module: Any, devices: Any, options: Any, callbacks: Any) -> Any:
        name = str(module.operation.attributes["sym_name"]).strip('"')
        if not re.search(STEP_PROGRAM[system], name):
            return original(backend, module, devices, options, callbacks)
        opts = compiler.get_compile_options(1, 1, device_assignment=np.array([[tpu]]), backend=tpu.client)
        t0 = time.perf_counter()
        got["program"] = tpu.client.compile(module, executable_devices=xc.DeviceList((tpu,)), compile_options=opts)
        got["seconds"], got["name"] = time.perf_counter() - t0, name
        raise _Compiled

    compiler.backend_compile_and_load = compile_for_tpu
    try:
        acc.build(system, wl, x, y, jax.devices("cpu")[:1]).call(1)
    except _Compiled:
        pass
    finally:
        compiler.backend_compile_and_load = original
    if "program" not in got:
        raise SystemExit(f"{system}: no program named like {STEP_PROGRAM[system]!r} was compiled")
    program = got["program"]
    cost = program.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = program.hlo_modules()[0].to_string()  # (a compile-only Executable has no as_text)
    counts = [len(re.findall(r" conditional[(]", text)), len(re.findall(r" copy[(]", text)),
              text.count("copy-start("), len(re.findall(r" fusion[(]", text))]
    print(f"| {workload} | {system} | {got['name']} | {got['seconds']:.1f} | "
          f"{cost.get('bytes accessed', 0) / 1e6:,.1f} | {cost.get('flops', 0) / 1e9:,.2f} | "
          + " | ".join(map(str, counts)) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tpu_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="transformer")
    p.add_argument("--systems", default="jax,mirrorax,keras_scope,guide_api,keras_fit")
    p.add_argument("--topology", default="v5e:1x1")
    p.add_argument("--libtpu", default=None, help="a folder holding the libtpu package (pip install --target)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.workload, args.child, args.topology)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in STEP_PROGRAM]
    if unknown:
        p.error(f"unknown system(s) {unknown}; expected among {list(STEP_PROGRAM)}")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [args.libtpu] if args.libtpu else []
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(path + [repo, os.path.join(repo, "src"), os.environ.get("PYTHONPATH", "")]))
    print("| workload | system | program | compile s (this host) | MB accessed (estimate) | GFLOP | conditionals "
          "| copies | async copies | fusions |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    failed = 0
    for s in systems:  # a process each: a fresh compiler, and a system's failure is its own
        cmd = [sys.executable, "-m", "benchmarks.tpu_compile", "--workload", args.workload, "--topology",
               args.topology, "--child", s]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
        print("\n".join(rows) if rows else f"| {args.workload} | {s} | failed: {proc.stderr.strip()[-300:]} |",
              flush=True)
        failed += proc.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
