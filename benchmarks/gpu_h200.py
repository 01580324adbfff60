"""Workload (c) in bfloat16 on the GPU (an H200): samples/s, MFU and one device's memory for mirrorax's three
sharding modes (``shard=None``, ``"optimizer"``, ``"all"``) and the hand-written JAX loop.

Run on a machine with the GPU and a CUDA build of JAX (``pip install -U "jax[cuda12]"``), from the
repository root::

    python benchmarks/gpu_h200.py                 # about 2-4 minutes
    python benchmarks/gpu_h200.py --cpu-smoke     # the same path on CPU, tiny sizes, 2 simulated devices
                                                  # (checks the script; --dry is the same)
    python benchmarks/gpu_h200.py --systems mirrorax,jax   # some of the systems only

Each system runs in a process of its own (``benchmarks.peers.<system> --workload transformer --devices 1
--bf16``), one after the other, each doing a warm-up and ``--repeats`` timed runs. MFU is model FLOPs
utilisation: achieved training FLOP/s over the GPU's dense bf16 peak, with the FLOPs per sequence from
:func:`benchmarks.workloads.flops_per_sample` (``6 * params * tokens``, the embedding tables left out, plus
the attention products) and the H200's dense (no sparsity) bf16 peak, 989 TFLOP/s (``--peak-tflops`` for
another GPU). Beside it, ``XLA MFU``: the compiled step's own FLOPs per device (``cost_analysis``, as
``mx.plan`` reports them) over the step time and the peak. One device's memory for each mirrorax mode: the
state held (measured), the step's peak as planned (``memory_analysis``) and, on a GPU, the allocator's peak
(``memory_stats``). With one GPU the three modes hold the same (nothing to split over); ``--devices`` uses
more where there are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_BF16_DENSE_TFLOPS = 989.0
SYSTEMS = {"mirrorax": "benchmarks.peers.mirrorax_trainer", "mirrorax_optimizer": "benchmarks.peers.mirrorax_optimizer",
           "mirrorax_all": "benchmarks.peers.mirrorax_all", "jax": "benchmarks.peers.jax_loop"}


def measure(system: str, args: argparse.Namespace, timeout: float) -> dict:
    """Runs one system's process; returns its JSON result (``status`` other than ``ok`` on failure)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["MIRRORAX_BENCH_TINY_LM"] = "1"  # a one-block LM: the path, not the real model's compile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", SYSTEMS[system], "--workload", "transformer", "--devices", str(args.devices),
               "--bf16",
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--repeats", str(args.repeats), "--json-out", out]
        if system.startswith("mirrorax") and args.steps_per_execution > 1:
            cmd += ["--steps-per-execution", str(args.steps_per_execution)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"system": system, "status": "timeout", "note": f"killed after {timeout:.0f} s"}
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        return {"system": system, "status": "error", "note": f"rc {proc.returncode}: " + " | ".join(tail)}


def main(argv: list[str] | None = None) -> int:
    """Measures every system and prints samples/s, tokens/s, TFLOP/s, MFU and one device's memory; returns 0
    if all ran."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="sequences per step (default 256)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per timed run (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (default 3)")
    p.add_argument("--steps-per-execution", type=int, default=1, help="mirrorax Trainer steps_per_execution")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                   help="the GPU's dense bf16 peak in TFLOP/s (H200 SXM: 989)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per system (default 420)")
    p.add_argument("--devices", type=int, default=1, help="devices to train on (default 1; 2 with --cpu-smoke)")
    p.add_argument("--cpu-smoke", "--dry", action="store_true",
                   help="run on CPU with tiny sizes and 2 simulated devices (checks the script)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated systems to run, in this order (default all: {','.join(SYSTEMS)})")
    p.add_argument("--json-out", default=None, help="also write the results here")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        p.error(f"--systems got {args.systems!r}; the systems are {', '.join(SYSTEMS)} (a comma-separated list "
                "of one or more of them)")
    if args.cpu_smoke:
        args.batch, args.steps, args.warmup, args.repeats = 4, 2, 1, 1
        args.devices = max(args.devices, 2)

    wl = workloads.get("transformer")
    rows = []
    for system in systems:
        r = dict(measure(system, args, args.timeout), name=system)
        if r.get("status") == "ok":
            sps = sorted(r["samples_per_s"])[len(r["samples_per_s"]) // 2]
            # Model FLOPs: the whole batch's, over all devices' peak.
            flops = workloads.flops_per_sample(wl, r["num_params"]) * sps
            r.update(median_samples_per_s=sps, tokens_per_s=sps * wl.seq_len, tflops=flops / 1e12,
                     mfu=flops / (args.peak_tflops * 1e12 * args.devices))
            if r.get("flops_per_step"):  # the compiled step's own count, one device's share
                r["xla_mfu"] = r["flops_per_step"] * sps / args.batch / (args.peak_tflops * 1e12)
        rows.append(r)

    kind = next((r.get("device_kind") for r in rows if r.get("device_kind")), "?")
    print(f"{wl.title}, bf16, global batch {args.batch}, on {args.devices} device(s): {kind}"
          f"{' (CPU smoke run: MFU against the GPU peak is meaningless here)' if args.cpu_smoke else ''}")
    if not args.cpu_smoke and "H200" not in str(kind):
        print(f"note: the device is not an H200; MFU uses --peak-tflops {args.peak_tflops}")
    mib = 2.0 ** 20

    def mem(r: dict, key: str) -> str:
        return f"{r[key] / mib:,.1f}" if r.get(key) is not None else "-"

    print(f"{'system':19s} {'samples/s':>10s} {'tokens/s':>11s} {'TFLOP/s':>8s} {'MFU':>7s} {'XLA MFU':>7s}  "
          f"{'state MiB/dev':>13s} {'step peak MiB':>13s} {'alloc peak MiB':>14s}  status")
    for r in rows:
        if r.get("status") == "ok":
            xla = f"{r['xla_mfu']:7.2%}" if r.get("xla_mfu") is not None else f"{'-':>7s}"
            print(f"{r['name']:19s} {r['median_samples_per_s']:10,.1f} {r['tokens_per_s']:11,.0f} "
                  f"{r['tflops']:8.2f} {r['mfu']:7.2%} {xla}  {mem(r, 'state_bytes_per_device'):>13s} "
                  f"{mem(r, 'peak_bytes_per_device'):>13s} {mem(r, 'device_peak_bytes'):>14s}  ok")
        else:
            print(f"{r['name']:19s} {'-':>10s} {'-':>11s} {'-':>8s} {'-':>7s} {'-':>7s}  {'-':>13s} {'-':>13s} "
                  f"{'-':>14s}  {r.get('status')}: {r.get('note', '')}")
    ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
    if "mirrorax" in ok and "jax" in ok:
        ratio = ok["mirrorax"]["median_samples_per_s"] / ok["jax"]["median_samples_per_s"]
        print(f"mirrorax / hand-written JAX: {ratio:.3f}")
    for mode in ("mirrorax_optimizer", "mirrorax_all"):
        if mode in ok and "mirrorax" in ok:
            speed = ok[mode]["median_samples_per_s"] / ok["mirrorax"]["median_samples_per_s"]
            state = ok[mode]["state_bytes_per_device"] / ok["mirrorax"]["state_bytes_per_device"]
            print(f"{mode} / replicated: speed {speed:.3f}, state per device {state:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"peak_tflops": args.peak_tflops, "batch": args.batch, "devices": args.devices, "rows": rows},
                      f, indent=1)
    return 0 if len(ok) == len(systems) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
