"""Bytes crossing hosts per train step of the benchmark's transformer, per state layout, from the compiled
programs (compile only, nothing runs): ``mx.plan(..., hosts=H)`` for replication, ``shard="optimizer"``
and ``shard="all"`` over every device, and hybrid sharding (HSDP: the state split within a host,
replicated across hosts).

The devices are read as ``--hosts`` hosts of consecutive devices (8 simulated CPU devices as 2 hosts of
4: the mesh 2 processes x 4 devices make under ``mirrorax launch``, one host per row). HSDP's program is
the strategy's where the API offers a hybrid mesh (``MirroredStrategy(mesh=mx.hybrid_mesh(k),
shard="all")``), else it is written here with ``jax.jit`` and ``NamedSharding``s on a
``(hosts, devices)`` mesh (with ``--check``, both): the same Keras model and Adam through ``stateless_call`` /
``stateless_apply``, the batch split over both axes, each variable split over the inner axis by
mirrorax's own rule (``state_sharding`` of a ``shard="all"`` strategy on one host's devices) and
replicated over the outer. ``shard="all"`` is written the same way too (``--check``), as a check that the
hand-written program moves what the strategy's does.

Run from the repository root::

    python -m benchmarks.traffic                       # 8 devices as 2 hosts x 4, the transformer
    python -m benchmarks.traffic --workload mlp --check
    python -m benchmarks.traffic --speed               # samples/s of each layout, 2 processes x 4 devices
    python -m benchmarks.traffic --collectives         # and each layout's collectives, by kind and group
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _hand_written(wl: Any, workloads: Any, hosts: int, inner_sharded: bool) -> Any:
    """The train step written with ``jax.jit`` on a ``(hosts, devices)`` mesh: the batch over both axes;
    the state split over the inner axis (HSDP, ``inner_sharded``) or over both (FSDP), compiled."""
    import jax
    import keras
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mirrorax as mx

    devices = jax.devices()
    per_host = len(devices) // hosts
    mesh = jax.make_mesh((hosts, per_host), ("hosts", "devices"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices)
    # mirrorax's rule for which axis of a variable is split (and which stay whole), on the split's devices.
    rule = mx.MirroredStrategy(devices=devices[:per_host] if inner_sharded else devices, shard="all")
    split = "devices" if inner_sharded else ("hosts", "devices")

    def layout(shape: tuple[int, ...]) -> NamedSharding:
        spec = rule.state_sharding(shape, "params").spec
        return NamedSharding(mesh, P(*[split if s is not None else None for s in spec] if spec else ()))

    keras.utils.set_random_seed(0)
    model = workloads.build_keras_model(wl)
    model.compile(**workloads.compile_args(wl))
    model.optimizer.build(model.trainable_variables)
    loss_fn = model.loss

    def step(tv: Any, ntv: Any, ov: Any, x: Any, y: Any) -> Any:
        def loss(tv: Any) -> Any:
            logits, new_ntv = model.stateless_call(tv, ntv, x, training=True)
            return loss_fn(y, logits), new_ntv

        (value, new_ntv), grads = jax.value_and_grad(loss, has_aux=True)(tv)
        new_tv, new_ov = model.optimizer.stateless_apply(ov, grads, tv)
        return new_tv, new_ntv, new_ov, value

    def spec(vs: Any) -> Any:
        return [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=layout(tuple(v.shape))) for v in vs]

    x, y = workloads.make_data(wl, wl.batch)
    batch = NamedSharding(mesh, P(("hosts", "devices")))
    args = (spec(model.trainable_variables), spec(model.non_trainable_variables), spec(model.optimizer.variables),
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch),
            jax.ShapeDtypeStruct(np.shape(y), np.asarray(y).dtype, sharding=batch))
    out = (*([a.sharding for a in group] for group in args[:3]), NamedSharding(mesh, P()))
    return jax.jit(step, out_shardings=out, donate_argnums=(0, 1, 2)).lower(*args).compile()


def _strategy_hsdp(hosts: int) -> Any:
    """HSDP through the strategy's public API where it has one (``MirroredStrategy(mesh=mx.hybrid_mesh(k),
    shard="all")``), else ``None``."""
    import jax

    import mirrorax as mx

    hybrid_mesh = getattr(mx, "hybrid_mesh", None)
    if hybrid_mesh is None:
        return None
    return mx.MirroredStrategy(mesh=hybrid_mesh(len(jax.devices()) // hosts), shard="all")


def _collectives_table(name: str, t: Any, params: int) -> None:
    """``t``'s collectives summed by kind and group shape: how many, the result bytes per device, how many of
    each ring's edges cross hosts, and the bytes sent across hosts (all devices, and the busiest one)."""
    rows: dict[tuple[str, int, int, int], list[float]] = {}
    for c in t.collectives:
        group = c.groups[0] if c.groups else ()
        spans = len({t.hosts[d] for d in group})
        crossing = sum(t.hosts[a] != t.hosts[b] for g in c.groups
                       for a, b in zip(g, (*g[1:], g[0]) if c.kind != "collective-permute" else g[1:]))
        row = rows.setdefault((c.kind, len(c.groups), len(group), spans), [0, 0.0, 0, 0.0])
        row[0] += 1
        row[1] += c.result_bytes
        row[2] = crossing  # (per collective: the same for each of a row's collectives)
        row[3] += c.across_bytes
    print(f"\n{name}: collectives by kind and group (params {params / 2**20:.2f} MiB)\n")
    print("| collective | groups x devices | hosts per group | count | result MiB per device "
          "| ring edges crossing hosts, per collective | across hosts MiB | across / parameters |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (kind, groups, size, spans), (count, result, crossing, across) in sorted(rows.items()):
        edges = "-" if kind == "all-to-all" else f"{crossing:.0f}"  # all-to-all: every pair, not a ring
        print(f"| {kind} | {groups} x {size} | {spans} | {count:.0f} | {result / 2**20:,.2f} | {edges} "
              f"| {across / 2**20:,.2f} | {across / params:.3f} |")


LAYOUTS = ("replicated", "optimizer", "all", "hsdp")


def _layout_strategy(layout: str) -> Any:
    import mirrorax as mx

    if layout == "hsdp":
        return mx.MirroredStrategy(mesh=mx.hybrid_mesh(), shard="all")  # one row per process
    return mx.MirroredStrategy(shard={"replicated": None, "optimizer": "optimizer", "all": "all"}[layout])


def _worker(args: argparse.Namespace) -> None:
    """One process of a ``mirrorax launch`` job: ``Trainer.fit`` of the workload in one layout, timed."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax

    import mirrorax as mx
    from benchmarks import workloads

    strategy = _layout_strategy(args.worker)  # joins the job from the launcher's environment
    wl = workloads.get(args.workload)
    x, y = workloads.make_data(wl, wl.batch * max(args.steps, args.warmup))
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl))
    trainer = mx.Trainer(model, strategy)

    def run(n: int) -> float:
        start = time.perf_counter()
        trainer.fit(x, y, batch_size=wl.batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
        jax.block_until_ready(trainer.state)
        return time.perf_counter() - start

    run(args.warmup)
    rates = [wl.batch * args.steps / run(args.steps) for _ in range(args.repeats)]
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump({"layout": args.worker, "samples_per_s": rates, "processes": jax.process_count(),
                       "devices": jax.device_count()}, f)


def _speed(args: argparse.Namespace, layouts: list[str]) -> dict[str, list[float]]:
    """Samples/s of each layout on ``--hosts`` processes (``mirrorax launch``, gloo on loopback)."""
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    speeds = {}
    for layout in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "speed.json")
            cmd = ["mirrorax", "launch", "--nprocs", str(args.hosts), "--cpu-devices-per-proc",
                   str(args.devices // args.hosts), "--", sys.executable, "-m", "benchmarks.traffic", "--worker",
                   layout, "--workload", args.workload, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--repeats", str(args.repeats), "--out", out]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0 or not os.path.exists(out):
                print(f"{layout}: mirrorax launch exited with {proc.returncode}:\n"
                      f"{(proc.stdout + proc.stderr)[-1500:]}", flush=True)
                continue
            with open(out) as f:
                speeds[layout] = json.load(f)["samples_per_s"]
        print(json.dumps({"layout": layout, "samples_per_s": speeds[layout]}), flush=True)
    return speeds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="transformer")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--check", action="store_true",
                   help="also compile HSDP and shard='all' written with jax.jit (against the strategy's)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--collectives", action="store_true",
                   help="also print each layout's collectives by kind and group: what crosses hosts")
    p.add_argument("--speed", action="store_true",
                   help="instead: time Trainer.fit of each layout on --hosts processes under mirrorax launch")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="the layouts to compile (or, with --speed, to time); 'all' is always compiled: the reference")
    p.add_argument("--steps", type=int, default=5, help="timed steps per timed run (--speed)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch (--speed)")
    p.add_argument("--worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.speed:
        import mirrorax as mx

        layouts = [la for la in args.layouts.split(",") if la != "hsdp" or hasattr(mx, "hybrid_mesh")]
        speeds = _speed(args, layouts)
        print("\n| layout | samples/s (timed runs) |\n|---|---|")
        for layout, rates in speeds.items():
            print(f"| {layout} | {' / '.join(f'{r:.2f}' for r in rates)} |")
        return 0
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)

    import mirrorax as mx
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    x, y = workloads.make_data(wl, wl.batch)
    rows: list[dict[str, Any]] = []
    traffics: list[tuple[str, Any]] = []

    def record(name: str, how: str, t: Any, seconds: float) -> None:
        traffics.append((f"{name} ({how})", t))
        rows.append({"layout": name, "program": how, "within_bytes": t.within_bytes, "across_bytes": t.across_bytes,
                     "max_across_bytes_per_device": t.max_across_bytes, "collectives": len(t.collectives),
                     "compile_s": round(seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)

    params = 0
    chosen = set(args.layouts.split(","))
    for shard in [s for s in (None, "optimizer", "all") if s == "all" or (s or "replicated") in chosen]:
        start = time.process_time()
        with mx.MirroredStrategy(shard=shard).scope():
            model = workloads.build_keras_model(wl)
            model.compile(**workloads.compile_args(wl))
        params = sum(int(v.numpy().nbytes) for v in model.trainable_variables)
        plan = mx.plan(model, x[:1], y[:1], batch_size=wl.batch, search=False, hosts=args.hosts)
        assert plan.traffic is not None
        record({None: "replicated", "optimizer": "optimizer (ZeRO-1)", "all": "all (FSDP)"}[shard],
               "mx.plan", plan.traffic, time.process_time() - start)
    start = time.process_time()
    strategy = _strategy_hsdp(args.hosts) if "hsdp" in chosen else None
    if strategy is not None:
        with strategy.scope():
            model = workloads.build_keras_model(wl)
            model.compile(**workloads.compile_args(wl))
        plan = mx.plan(model, x[:1], y[:1], batch_size=wl.batch, search=False, hosts=args.hosts)
        assert plan.traffic is not None
        record("HSDP", "mx.plan", plan.traffic, time.process_time() - start)
    if ("hsdp" in chosen and strategy is None) or args.check:
        start = time.process_time()
        compiled = _hand_written(wl, workloads, args.hosts, inner_sharded=True)
        record("HSDP", "jax.jit", mx.traffic(compiled, hosts=args.hosts), time.process_time() - start)
    if args.check:
        start = time.process_time()
        compiled = _hand_written(wl, workloads, args.hosts, inner_sharded=False)
        record("all (FSDP)", "jax.jit", mx.traffic(compiled, hosts=args.hosts), time.process_time() - start)

    fsdp = next(r for r in rows if r["layout"] == "all (FSDP)")["across_bytes"]
    print(f"\n{wl.title}: {args.devices} devices as {args.hosts} hosts, parameters {params / 2**20:.2f} MiB; "
          "bytes sent per step by all devices (ring model, mirrorax.traffic)\n")
    busiest = next(r for r in rows if r["layout"] == "all (FSDP)")["max_across_bytes_per_device"]
    print("| layout | program | within hosts MiB | across hosts MiB | across / parameters | across / FSDP's "
          "| busiest device across MiB | / FSDP's |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        most = r["max_across_bytes_per_device"]
        print(f"| {r['layout']} | {r['program']} | {r['within_bytes'] / 2**20:,.1f} | {r['across_bytes'] / 2**20:,.1f} "
              f"| {r['across_bytes'] / params:.2f} | {r['across_bytes'] / fsdp:.2f} | {most / 2**20:,.1f} "
              f"| {most / busiest:.2f} |")
    if args.collectives:
        for name, t in traffics:
            _collectives_table(name, t, params)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"workload": wl.name, "devices": args.devices, "hosts": args.hosts, "param_bytes": params,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
