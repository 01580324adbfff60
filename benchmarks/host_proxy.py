"""The CPU proxy: each door's host time per step against the loop its users would write by hand.

On an accelerator a small model's step takes microseconds of device time, and every loop is as fast as the
host's work per step lets it be (benchmarks/README.md, "Where a step's time goes"). A trivial step program
shows the same on a CPU host, where that work is all there is: Flax NNX's ``nnx.Linear(2, 10)``, Adam, a
mean squared error and ``nnx.MultiMetric``'s average, batches of 8 from host numpy (a loader's batches, or
arrays); Keras's ``Dense(10)`` on 2 inputs with Adam and a sparse cross-entropy with accuracy. Each system
runs in a process of its own on one CPU device (``--one``), the processes alternating in rounds; each times
``--steps`` steps after a warm-up and reports steps/s and the CPU time of its main thread per step (the
host's own work, which another process's load moves least).

The baselines, each written as its source writes it (the step's body is the guide's for every NNX system):

* ``flax_loop``: Flax's own benchmark (``benchmarks/nnx_simple_training.py``, google/flax, its ``jax``
  mode): ``nnx.split`` once, ``@partial(jax.jit, donate_argnums=0)`` over ``train_step_jax(state, batch)``
  with the ``graphdef`` closed over, ``nnx.merge`` in, ``nnx.state`` out, the loader's numpy batch given as it
  comes. The NNX doors are measured against it.
* ``flax_functional``: Flax's guide "Performance considerations", its functional loop as written:
  ``@jax.jit`` over ``jax_train_step(graphdef, state, x, y)`` returning ``loss, state``.
* ``nnx_jit``: the guide's first loop, ``@nnx.jit`` on the objects.
* ``keras_hand``: the keras.io JAX guide's loop done right (``benchmarks/peers/jax_loop.py``: the state
  replicated and donated, each batch placed one step ahead, 2 steps in flight). The Keras doors are measured
  against it.

The doors: ``strategy_jit`` (the guide's step under ``@strategy.jit``, batches read through
``experimental_distribute_dataset`` of the loader's, not donated), ``strategy_jit_donated``
(``donate_argnums=(0, 1, 2)``), ``strategy_jit_arrays`` (donated, over ``experimental_distribute_dataset((x,
y), batch_size=8)``), ``strategy_jit_functional`` (the functional loop with ``@strategy.jit`` for
``@jax.jit``, against ``flax_functional``), ``trainer`` (``mx.Trainer`` on the module), ``keras_trainer``
(``Trainer.fit`` of the Keras model) and ``keras_scope`` (its ``model.fit`` under ``strategy.scope()``).
Not in the default run, ``trainer_auto``, ``keras_trainer_auto`` and ``keras_scope_auto``: the same with
``steps_per_execution="auto"`` (issue 58: fused steps where the host is the limit, against loops that dispatch
one step a call), each fitted in runs of ``--steps`` until "auto" has settled before it is timed; the table
gives the k each process settled on.

Run: ``python -m benchmarks.host_proxy`` (about 6 min on 2 cores), or
``python -m benchmarks.host_proxy --systems flax_loop,strategy_jit_donated --steps 2000 --rounds 3``, or
``python -m benchmarks.host_proxy --systems keras_trainer_auto,keras_scope_auto,trainer_auto`` (about 4 min).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

BASELINE = {"strategy_jit": "flax_loop", "strategy_jit_donated": "flax_loop", "strategy_jit_arrays": "flax_loop",
            "trainer": "flax_loop", "nnx_jit": "flax_loop", "strategy_jit_functional": "flax_functional",
            "keras_trainer": "keras_hand", "keras_scope": "keras_hand", "trainer_auto": "flax_loop",
            "keras_trainer_auto": "keras_hand", "keras_scope_auto": "keras_hand"}
SYSTEMS = ("flax_loop", "flax_functional", "nnx_jit", "strategy_jit", "strategy_jit_donated", "strategy_jit_arrays",
           "strategy_jit_functional", "trainer", "keras_hand", "keras_trainer", "keras_scope")
#: ``steps_per_execution="auto"`` (issue 58), not in the default run: each fits until "auto" has settled (at most
#: ``SETTLE`` runs of ``--steps`` steps) before it is timed.
AUTO_SYSTEMS = ("trainer_auto", "keras_trainer_auto", "keras_scope_auto")
SETTLE = 8
BATCH = 8


def _data(rows: int) -> tuple[Any, Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 2)).astype(np.float32)
    return x, rng.normal(size=(rows, 10)).astype(np.float32), rng.integers(0, 10, rows).astype(np.int32)


def _nnx(system: str, x: Any, y: Any) -> Any:
    """``loop(n)``: ``n`` steps of ``system``, returning when its state is ready."""
    import jax
    import optax
    from flax import nnx

    import mirrorax as mx

    model = nnx.Linear(2, 10, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    loader = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]  # host numpy batches

    def train_step(model: Any, optimizer: Any, metrics: Any, x: Any, y: Any) -> Any:  # the guide's step
        def loss_fn(model: Any) -> Any:
            y_pred = model(x)
            return ((y_pred - y) ** 2).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)
        return loss

    def batches(n: int) -> Any:
        for i in range(n):
            yield loader[i % len(loader)]

    if system == "flax_loop":  # Flax's benchmarks/nnx_simple_training.py, jax mode
        from benchmarks.nnx_loops import flax_loop_step

        graphdef, state = nnx.split((model, optimizer, metrics))
        train_step_jax = flax_loop_step(graphdef, train_step)
        box = [state]

        def loop(n: int) -> None:
            state = box[0]
            for batch in batches(n):
                state = train_step_jax(state, batch)
            box[0] = jax.block_until_ready(state)
        return _baseline(loop, train_step_jax, (box[0], loader[0]), donated=(0,))
    if system in ("flax_functional", "strategy_jit_functional"):  # the guide's functional loop
        strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
        jit = jax.jit if system == "flax_functional" else strategy.jit
        from benchmarks.nnx_loops import functional_step

        graphdef, state = nnx.split((model, optimizer, metrics))
        jax_train_step = functional_step(jit, train_step)
        box = [state]
        read = (lambda it: it) if system == "flax_functional" else strategy.experimental_distribute_dataset

        def loop(n: int) -> None:
            state = box[0]
            for x, y in read(list(batches(n))):
                loss, state = jax_train_step(graphdef, state, x, y)
            box[0] = jax.block_until_ready(state)
        return _baseline(loop, jax_train_step, (graphdef, box[0], *loader[0]), donated=())  # (the guide donates none)
    if system == "nnx_jit":
        step = nnx.jit(train_step)

        def loop(n: int) -> None:
            for x, y in batches(n):
                step(model, optimizer, metrics, x, y)
            jax.block_until_ready(nnx.state(model))
        return loop
    if system.startswith("strategy_jit"):
        strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
        step = strategy.jit(train_step, donate_argnums=() if system == "strategy_jit" else (0, 1, 2))

        def loop(n: int) -> None:
            if system == "strategy_jit_arrays":
                data = strategy.experimental_distribute_dataset((x[:n * BATCH], y[:n * BATCH]), batch_size=BATCH)
            else:
                data = strategy.experimental_distribute_dataset(list(batches(n)))
            for xb, yb in data:
                step(model, optimizer, metrics, xb, yb)
            strategy.in_flight.drain()
            jax.block_until_ready(nnx.state(model))
        return loop
    if system in ("trainer", "trainer_auto"):
        def mean_squared_error(y: Any, y_pred: Any) -> Any:
            return ((y_pred - y) ** 2).mean(axis=-1)

        trainer = mx.Trainer(model, mx.MirroredStrategy(devices=jax.devices()[:1]), loss=mean_squared_error,
                             optimizer=optimizer.tx, metrics=[],
                             steps_per_execution="auto" if system == "trainer_auto" else 1)

        def loop(n: int) -> None:
            trainer.fit(x[:n * BATCH], y[:n * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            jax.block_until_ready(trainer.state)
        loop.trainer = lambda: trainer
        return loop
    raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS + AUTO_SYSTEMS}")


def _keras(system: str, x: Any, labels: Any) -> Any:
    import jax
    import keras

    import mirrorax as mx

    def build() -> Any:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(10)])
        return model

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if system == "keras_hand":
        from benchmarks.peers.jax_loop import HandLoop

        mesh = jax.make_mesh((1,), ("batch",), devices=jax.devices()[:1],
                             axis_types=(jax.sharding.AxisType.Auto,))
        hand = HandLoop(build(), keras.optimizers.Adam(1e-3), loss, mesh,
                        [(x[i:i + BATCH], labels[i:i + BATCH]) for i in range(0, len(x), BATCH)])
        return _baseline(lambda n: hand.steps(n), hand.train_step, (hand.state, *hand.put(0)), donated=(0,))
    strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
    auto = system.endswith("_auto")
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["accuracy"],
                      **({"steps_per_execution": "auto"} if system == "keras_scope_auto" else {}))
    if system.startswith("keras_scope"):
        def loop(n: int) -> None:
            model.fit(x[:n * BATCH], labels[:n * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        from mirrorax.keras.fit import trainer_of

        loop.trainer = lambda: trainer_of(model)  # model.fit's own Trainer (made by its first fit)
        return loop
    trainer = mx.Trainer(model, strategy, steps_per_execution="auto" if auto else 1)

    def loop(n: int) -> None:
        trainer.fit(x[:n * BATCH], labels[:n * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        jax.block_until_ready(trainer.state)
    loop.trainer = lambda: trainer
    return loop


def _baseline(loop: Any, step: Any, example: tuple[Any, ...], donated: tuple[int, ...]) -> Any:
    """``loop``, carrying what :func:`baselines` checks: its jitted step, arguments of a call, and the arguments
    its source donates."""
    import jax
    import numpy as np

    loop.step, loop.donated = step, donated
    loop.example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), example)  # (outlives a donation)
    return loop


def baselines() -> dict[str, tuple[Any, tuple[Any, ...], tuple[int, ...]]]:
    """Each baseline's jitted step, arguments of one call and the positions its source donates (the state of
    Flax's benchmark and of the keras.io loop; nothing in the guide's functional loop): what a test checks the
    compiled step against."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    x, y, labels = _data(4 * BATCH)
    out = {}
    for system in ("flax_loop", "flax_functional", "keras_hand"):
        loop = _keras(system, x, labels) if system.startswith("keras") else _nnx(system, x, y)
        out[system] = (loop.step, loop.example, loop.donated)
    return out


def _meter(loop: Any) -> Any:
    """The newest fit's meter of a mirrorax system's loop (``fit/meter.py``: where "auto" stands, its k)."""
    return loop.trainer().loop.meter


def one(system: str, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Times ``system`` in this process: its best of ``repeats`` runs of ``steps`` steps after a warm-up (an
    ``"auto"`` system: after runs of ``steps`` until "auto" has settled, at most :data:`SETTLE`)."""
    x, y, labels = _data(BATCH * max(steps, warmup))
    loop = _keras(system, x, labels) if system.startswith("keras") else _nnx(system, x, y)
    loop(warmup)  # (the compile, and a first pass)
    settle = 0
    while system in AUTO_SYSTEMS and settle < SETTLE and _meter(loop).phase != "settled":
        loop(steps)
        settle += 1
    rates, host = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.thread_time()
        loop(steps)
        host.append((time.thread_time() - cpu) / steps * 1e6)
        rates.append(steps / (time.perf_counter() - wall))
    out = {"system": system, "steps_per_s": max(rates), "host_us": min(host), "steps": steps}
    if system in AUTO_SYSTEMS:
        meter = _meter(loop)
        out.update(k=meter.steps_per_execution(), phase=meter.phase, settle_runs=settle)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=1500, help="steps per timed run (default 1500)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per process (its best is kept)")
    p.add_argument("--rounds", type=int, default=3, help="processes per system, alternating (default 3)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a worker: this system, in this process)
    p.add_argument("--out", default=None, help="a JSON file for the results")
    args = p.parse_args(argv)
    if args.one:
        os.environ.setdefault("KERAS_BACKEND", "jax")
        print(json.dumps(one(args.one, args.steps, args.warmup, args.repeats)))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS + AUTO_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; expected some of {', '.join(SYSTEMS + AUTO_SYSTEMS)}")
    systems = list(dict.fromkeys(systems + [b for s in systems if (b := BASELINE.get(s))]))  # its baselines too
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", "KERAS_BACKEND": "jax",
           "PYTHONUNBUFFERED": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:  # ABBA: drift hits every system alike
            cmd = [sys.executable, "-m", "benchmarks.host_proxy", "--one", system, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"{system} failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
            runs[system].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = {}
    for s in systems:
        rate = statistics.median(run["steps_per_s"] for run in runs[s])
        host = statistics.median(run["host_us"] for run in runs[s])
        base = BASELINE.get(s)
        ratio = None if base is None else statistics.median(
            a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs[s], runs[base]))
        extra = None if base is None else host - statistics.median(run["host_us"] for run in runs[base])
        rows[s] = {"steps_per_s": rate, "host_us": host, "baseline": base, "ratio": ratio, "extra_host_us": extra,
                   "runs": runs[s], "k": sorted({run["k"] for run in runs[s] if "k" in run})}
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| system | baseline | steps/s | host us/step | / baseline (steps/s) | host us beyond it |",
             "|---|---|---:|---:|---:|---:|"]
    for s, r in rows.items():
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        extra = "-" if r["extra_host_us"] is None else f"{r['extra_host_us']:+.0f}"
        name = f"{s} (k={'/'.join(map(str, r['k']))})" if r.get("k") else s
        lines.append(f"| {name} | {r['baseline'] or '-'} | {r['steps_per_s']:,.0f} | {r['host_us']:.0f} | {ratio} | "
                     f"{extra} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
