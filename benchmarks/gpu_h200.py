"""Workload (c) in bfloat16 on one GPU (an H200): samples/s and MFU for mirrorax and the hand-written JAX loop.

Run on a machine with the GPU and a CUDA build of JAX (``pip install -U "jax[cuda12]"``), from the
repository root::

    python benchmarks/gpu_h200.py                 # about 2-4 minutes
    python benchmarks/gpu_h200.py --cpu-smoke     # the same path on CPU, tiny sizes (checks the script)

Each system runs in a process of its own (``benchmarks.peers.<system> --workload transformer --devices 1
--bf16``), one after the other, each doing a warm-up and ``--repeats`` timed runs. MFU is model FLOPs
utilisation: achieved training FLOP/s over the GPU's dense bf16 peak, with the FLOPs per sequence from
:func:`benchmarks.workloads.flops_per_sample` (``6 * params * tokens`` plus the attention products) and
the H200's dense (no sparsity) bf16 peak, 989 TFLOP/s (``--peak-tflops`` for another GPU).
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
SYSTEMS = {"mirrorax": "benchmarks.peers.mirrorax_trainer", "jax": "benchmarks.peers.jax_loop"}


def measure(system: str, args: argparse.Namespace, timeout: float) -> dict:
    """Runs one system's process; returns its JSON result (``status`` other than ``ok`` on failure)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", SYSTEMS[system], "--workload", "transformer", "--devices", "1", "--bf16",
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--repeats", str(args.repeats), "--json-out", out]
        if system == "mirrorax" and args.steps_per_execution > 1:
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
    """Measures both systems and prints samples/s, tokens/s, TFLOP/s and MFU; returns 0 if both ran."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="sequences per step (default 256)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per timed run (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (default 3)")
    p.add_argument("--steps-per-execution", type=int, default=1, help="mirrorax Trainer steps_per_execution")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                   help="the GPU's dense bf16 peak in TFLOP/s (H200 SXM: 989)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per system (default 420)")
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPU with tiny sizes (checks the script)")
    p.add_argument("--json-out", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.batch, args.steps, args.warmup, args.repeats = 2, 2, 1, 1

    wl = workloads.get("transformer")
    rows = []
    for system in SYSTEMS:
        r = measure(system, args, args.timeout)
        if r.get("status") == "ok":
            sps = sorted(r["samples_per_s"])[len(r["samples_per_s"]) // 2]
            flops = workloads.flops_per_sample(wl, r["num_params"]) * sps
            r.update(median_samples_per_s=sps, tokens_per_s=sps * wl.seq_len, tflops=flops / 1e12,
                     mfu=flops / (args.peak_tflops * 1e12))
        rows.append(r)

    kind = next((r.get("device_kind") for r in rows if r.get("device_kind")), "?")
    print(f"{wl.title}, bf16, global batch {args.batch}, on one device: {kind}"
          f"{' (CPU smoke run: MFU against the GPU peak is meaningless here)' if args.cpu_smoke else ''}")
    if not args.cpu_smoke and "H200" not in str(kind):
        print(f"note: the device is not an H200; MFU uses --peak-tflops {args.peak_tflops}")
    print(f"{'system':10s} {'samples/s':>12s} {'tokens/s':>12s} {'TFLOP/s':>9s} {'MFU':>7s}  peak RSS MiB  status")
    for r in rows:
        if r.get("status") == "ok":
            print(f"{r['system']:10s} {r['median_samples_per_s']:12,.1f} {r['tokens_per_s']:12,.0f} "
                  f"{r['tflops']:9.2f} {r['mfu']:7.2%}  {r['peak_rss_mb']:12,.0f}  ok")
        else:
            print(f"{r['system']:10s} {'-':>12s} {'-':>12s} {'-':>9s} {'-':>7s}  {'-':>12s}  "
                  f"{r.get('status')}: {r.get('note', '')}")
    ok = [r for r in rows if r.get("status") == "ok"]
    if len(ok) == 2:
        print(f"mirrorax / hand-written JAX: {ok[0]['median_samples_per_s'] / ok[1]['median_samples_per_s']:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"peak_tflops": args.peak_tflops, "batch": args.batch, "rows": rows}, f, indent=1)
    return 0 if len(ok) == 2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
