"""Across processes: ``Trainer.fit`` against a hand-written multi-process JAX loop, both under ``mirrorax launch``.

Both systems run as ``--nprocs`` processes of ``--devices-per-proc`` simulated CPU devices each (one JAX job,
gloo collectives on loopback), on the MLP workload (784-512-10, Adam, global batch 256):

* ``mirrorax``: ``mx.MirroredStrategy()`` over every device of the job, ``Trainer(model).fit(x, y, ...)``
  on the same host arrays in every process (the engine places each process's rows);
* ``keras_scope``: Keras's own ``model.fit`` of a model compiled under ``strategy.scope()`` (the same
  engine, with Keras's ``on_nonfinite="ignore"``: no guard around the update);
* ``jax``: the loop a JAX expert writes for several processes: a mesh over ``jax.devices()``, the state
  replicated and donated, each process's rows of the next batch placed with
  ``jax.make_array_from_process_local_data`` while the current step runs, at most 2 steps in flight.

Systems alternate within each round (machine drift hits both alike). Samples/s is process 0's global
batch x steps / wall time of a timed run, which ends when the state is ready. Prints a markdown table.

Run: ``python -m benchmarks.multiprocess`` (about 4 minutes on 2 cores), or
``python -m benchmarks.multiprocess --rounds 1 --repeats 2 --steps 30`` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEMS = ("mirrorax", "keras_scope", "jax")


def _worker(system: str, steps: int, warmup: int, repeats: int, batch: int, out: str) -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mirrorax as mx
    from benchmarks import workloads

    strategy = mx.MirroredStrategy()  # initialises jax.distributed from the launcher's environment
    wl = workloads.get("mlp")
    x, y = workloads.make_data(wl, batch * max(steps, warmup), seed=0)

    if system == "mirrorax":
        with strategy.scope():
            model = workloads.build_keras_model(wl)
            model.compile(**workloads.compile_args(wl))
        trainer = mx.Trainer(model, strategy)

        def run(n: int) -> None:
            trainer.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
            jax.block_until_ready(trainer.state)
    elif system == "keras_scope":  # Keras's own model.fit of a model compiled under the scope
        with strategy.scope():
            model = workloads.build_keras_model(wl)
            model.compile(**workloads.compile_args(wl))

        def run(n: int) -> None:
            model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
            jax.block_until_ready([v.value for v in model.trainable_variables])
    else:
        from functools import partial

        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
        model = workloads.build_keras_model(wl)
        spec = workloads.compile_args(wl)
        optimizer, loss_obj = spec["optimizer"], spec["loss"]
        optimizer.build(model.trainable_variables)
        host_state = ([np.asarray(v.value) for v in model.trainable_variables],
                      [np.asarray(v.value) for v in model.non_trainable_variables],
                      [np.asarray(v.value) for v in optimizer.variables])
        # One state: process 0's values on every process.
        from jax.experimental import multihost_utils

        host_state = multihost_utils.broadcast_one_to_all(host_state)
        state = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, replicated, lambda i, a=a: a[i]),
                             host_state)
        shardings = jax.tree.map(lambda _: replicated, state)

        def loss_fn(trainable: Any, non_trainable: Any, xb: Any, yb: Any) -> Any:
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, xb, training=True)
            return loss_obj(yb, y_pred), non_trainable

        @partial(jax.jit, donate_argnums=(0,), in_shardings=(shardings, rows, rows),
                 out_shardings=(shardings, replicated))
        def step(state: Any, xb: Any, yb: Any) -> Any:
            trainable, non_trainable, opt_vars = state
            (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable,
                                                                                      xb, yb)
            trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
            return (trainable, non_trainable, opt_vars), jnp.asarray(loss)

        local = batch // jax.process_count()
        lo = jax.process_index() * local

        def put(i: int) -> tuple[Any, Any]:
            first = (i * batch) % len(x) + lo
            return (jax.make_array_from_process_local_data(rows, x[first:first + local]),
                    jax.make_array_from_process_local_data(rows, y[first:first + local]))

        def run(n: int) -> None:
            nonlocal state
            pending, nxt = None, put(0)
            for i in range(n):
                xb, yb = nxt
                state, loss = step(state, xb, yb)
                if i + 1 < n:
                    nxt = put(i + 1)
                if pending is not None:
                    pending.block_until_ready()
                pending = loss
            jax.block_until_ready(state)

    run(warmup)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(steps)
        rates.append(batch * steps / (time.perf_counter() - t0))
    if jax.process_index() == 0:
        Path(out).write_text(json.dumps({"system": system, "samples_per_s": rates,
                                         "processes": jax.process_count(), "devices": jax.device_count()}))


def _launch(system: str, args: argparse.Namespace, out: Path) -> list[float]:
    cmd = ["mirrorax", "launch"]
    cmd += ["--nprocs", str(args.nprocs), "--cpu-devices-per-proc", str(args.devices_per_proc), "--",
            sys.executable, "-m", "benchmarks.multiprocess", "--worker", system, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--batch", str(args.batch),
            "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"{system} under mirrorax launch exited with {proc.returncode}:\n{tail}")
    return json.loads(out.read_text())["samples_per_s"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--devices-per-proc", type=int, default=4)
    p.add_argument("--steps", type=int, default=100, help="timed steps per timed run")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per launch")
    p.add_argument("--rounds", type=int, default=2, help="launches per system, alternating")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--systems", default="mirrorax,keras_scope,jax",
                   help="comma-separated, among mirrorax (Trainer.fit), keras_scope (model.fit under a scope), jax")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.repeats, args.batch, args.out)
        return
    systems = tuple(x.strip() for x in args.systems.split(",") if x.strip())
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or "jax" not in systems:
        p.error(f"--systems takes names among {SYSTEMS}, jax included (the reference); received {args.systems!r}")
    rates: dict[str, list[float]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            for system in order:
                got = _launch(system, args, Path(tmp) / f"{system}_{r}.json")
                rates[system] += got
                print(f"round {r + 1}: {system}: {', '.join(f'{v:,.0f}' for v in got)} samples/s", flush=True)
    med = {s: statistics.median(v) for s, v in rates.items()}
    print(f"\n{args.nprocs} processes x {args.devices_per_proc} CPU devices, MLP, global batch {args.batch}, "
          f"{args.steps} steps x {args.repeats} runs x {args.rounds} rounds\n")
    print("| system | median samples/s | min-max | vs hand-written |\n|---|---:|---:|---:|")
    for s in systems:
        print(f"| {s} | {med[s]:,.0f} | {min(rates[s]):,.0f}-{max(rates[s]):,.0f} | {med[s] / med['jax']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
