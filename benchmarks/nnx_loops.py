"""Flax NNX training loops on one device: Flax's own loops against mirrorax's two doors, alternated in one process.

The workloads are Flax's: the MNIST tutorial's CNN (BatchNorm, Dropout with its ``nnx.Rngs``, AdamW,
``nnx.MultiMetric``) and a small transformer classifier (two pre-norm blocks of ``nnx.MultiHeadAttention``
and an MLP, Dropout, Adam), each at a global batch of 32 and 256, and the performance guide's own small
model (``guide``: 2 -> 64 -> 3 with BatchNorm and Dropout, a mean squared error), fed host numpy batches as
the tutorial does. The systems:

* ``flax_split_merge``: Flax's fastest loop, as Flax's own benchmark writes it
  (``benchmarks/nnx_simple_training.py``, its ``jax`` mode): ``nnx.split`` once before the loop,
  ``@partial(jax.jit, donate_argnums=0)`` over ``train_step_jax(state, batch)`` with the ``graphdef`` closed
  over (``nnx.merge`` inside, ``nnx.state`` out): the state donated, the batch given as the loader gives it;
* ``nnx_jit``: the tutorial's ``@nnx.jit`` step on the objects;
* ``strategy_jit``: the same step under ``@strategy.jit`` (``donate_argnums`` on the objects), over
  ``strategy.experimental_distribute_dataset`` of the same arrays;
* ``strategy_jit_loader``: the same, over ``strategy.experimental_distribute_dataset`` of the loader's host
  numpy batches (the ones Flax's loop is given): the guide ported with its loop's dataset changed;
* ``trainer``: ``mx.Trainer(module, loss=..., optimizer=...).fit`` of the same module and optimizer;
* ``flax_functional``: Flax's performance guide's functional loop as written (``@jax.jit`` over
  ``jax_train_step(graphdef, state, x, y)`` returning ``loss, state``, nothing donated), and
  ``strategy_jit_functional``, the same with ``@strategy.jit`` for ``@jax.jit`` over
  ``experimental_distribute_dataset`` of the loader's batches (measured against ``flax_functional``);
* ``guide_as_written``: that loop line for line as the guide writes it, its batch made in the loop (``x, y =
  jnp.ones((32, 2)), jnp.zeros((32, 3))`` for the guide's model; other workloads: their batch's shapes), and
  ``strategy_jit_guide_as_written``, the guide ported by its decorator alone (``@strategy.jit`` for ``@jax.jit``;
  on one device a ``jnp`` batch is already where a split one would be, and nothing is warned).

Each chunk is ``steps`` steps, ended when the state is ready (a Trainer chunk is one ``fit`` call, its set-up
included). Each system runs in a process of its own (a system sharing a process with others slows Flax's
loop: measured on the bf16 transformer, the hand loop ran 8,349-8,877 samples/s beside mirrorax's systems and
9,475-9,717 alone), ``--process-rounds`` times, the processes alternating in ABBA order; each ratio to
``flax_split_merge`` is the median over the process rounds of the two rates of that round (drift on a shared
host hits both alike). ``--process-rounds 0`` times every system in one process, alternating chunks.

Run: ``python -m benchmarks.nnx_loops --workloads guide`` (the CPU, 1 device: the guide's model, whose step is
small enough that the loops' host work shows), or
``python -m benchmarks.nnx_loops --workloads cnn,transformer --batches 32,256`` on an accelerator;
``python -m benchmarks.accelerator --workloads nnx`` runs it there with the other tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

SYSTEMS = ("flax_split_merge", "nnx_jit", "strategy_jit", "strategy_jit_loader", "trainer", "flax_functional",
           "strategy_jit_functional", "guide_as_written", "strategy_jit_guide_as_written")
#: Each system's ratio is to this loop's steps/s (the functional loops' to Flax's functional loops).
BASELINE = {"strategy_jit_functional": "flax_functional", "strategy_jit_guide_as_written": "guide_as_written"}
LABELS = {"flax_split_merge": "Flax's split/merge jax.jit loop", "nnx_jit": "@nnx.jit",
          "strategy_jit": "@strategy.jit, over arrays",
          "strategy_jit_loader": "@strategy.jit, over the loader's batches",
          "trainer": "mx.Trainer", "flax_functional": "Flax's functional jax.jit loop (the guide's)",
          "strategy_jit_functional": "the functional loop on @strategy.jit",
          "guide_as_written": "Flax's guide's functional loop, line for line",
          "strategy_jit_guide_as_written": "the same with @strategy.jit for @jax.jit"}


def _models() -> dict[str, Any]:
    import jax.numpy as jnp
    from flax import nnx

    class CNN(nnx.Module):
        """Flax's MNIST tutorial CNN."""

        def __init__(self, *, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
            self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
            self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
            self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
            self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
            self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
            self.linear2 = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
            x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
            x = x.reshape(x.shape[0], -1)
            x = nnx.relu(self.dropout2(self.linear1(x)))
            return self.linear2(x)

    class Block(nnx.Module):
        def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
            self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(heads, dim, dropout_rate=0.1, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
            self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
            self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))))

    class Transformer(nnx.Module):
        """A small transformer classifier: token and position embeddings, two blocks, mean pooling."""

        def __init__(self, *, rngs: nnx.Rngs, vocab: int = 1000, length: int = 64, dim: int = 128, heads: int = 4):
            self.tokens = nnx.Embed(vocab, dim, rngs=rngs)
            self.positions = nnx.Embed(length, dim, rngs=rngs)
            self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(2)])
            self.norm = nnx.LayerNorm(dim, rngs=rngs)
            self.head = nnx.Linear(dim, 10, rngs=rngs)

        def __call__(self, x):
            h = self.tokens(x) + self.positions(jnp.arange(x.shape[1]))[None]
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h).mean(axis=1))

    class Guide(nnx.Module):
        """The model of Flax's guide "Performance considerations" (2 -> 64 -> 3, BatchNorm, Dropout)."""

        def __init__(self, *, rngs: nnx.Rngs):
            self.linear = nnx.Linear(2, 64, rngs=rngs)
            self.bn = nnx.BatchNorm(64, rngs=rngs)
            self.dropout = nnx.Dropout(0.2, rngs=rngs)
            self.linear_out = nnx.Linear(64, 3, rngs=rngs)

        def __call__(self, x):
            return self.linear_out(nnx.relu(self.dropout(self.bn(self.linear(x)))))

    return {"cnn": CNN, "transformer": Transformer, "guide": Guide}


def make_data(workload: str, rows: int, seed: int = 0) -> tuple[Any, Any]:
    """Host arrays in the tutorial's form: float32 images in [0, 1] (the CNN) or int32 tokens, int labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if workload == "guide":  # the guide's regression: 2 inputs, 3 targets
        x = rng.normal(size=(rows, 2)).astype(np.float32)
        return x, np.stack([np.sin(x[:, 0]), np.cos(x[:, 1]), x[:, 0] * x[:, 1]], axis=1).astype(np.float32)
    y = rng.integers(0, 10, rows).astype(np.int32)
    if workload == "cnn":
        return rng.uniform(0, 1, (rows, 28, 28, 1)).astype(np.float32), y
    return rng.integers(0, 1000, (rows, 64)).astype(np.int32), y


def objects(workload: str) -> tuple[Any, Any, Any]:
    """The model, its ``nnx.Optimizer`` and the tutorial's ``nnx.MultiMetric``, seeded."""
    import optax
    from flax import nnx

    model = _models()[workload](rngs=nnx.Rngs(0))
    model.train()  # (Dropout on, BatchNorm's batch statistics: as the Trainer trains it)
    tx = optax.adamw(0.005, 0.9) if workload == "cnn" else optax.adam(1e-3)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if workload == "guide":
        return model, optimizer, nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def train_step(model: Any, optimizer: Any, metrics: Any, x: Any, y: Any) -> Any:
    """The tutorial's step: loss and gradients, the metrics and the optimizer updated in place (the guide's
    regression: a mean squared error, its average the one metric)."""
    import optax
    from flax import nnx

    if y.ndim > 1:  # (the guide's model)
        def mse(model: Any) -> Any:
            return ((model(x) - y) ** 2).mean()

        loss, grads = nnx.value_and_grad(mse)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)
        return loss

    def loss_fn(model: Any) -> Any:
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=y).mean(), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    metrics.update(loss=loss, logits=logits, labels=y)
    optimizer.update(model, grads)
    return loss


def squared_error(y: Any, y_pred: Any) -> Any:
    """Per example, for the Trainer: the guide's loss."""
    return ((y_pred - y) ** 2).mean(axis=-1)


def flax_loop_step(graphdef: Any, train_step: Any) -> Any:
    """Flax's fastest loop's step, as Flax's own benchmark writes it (``benchmarks/nnx_simple_training.py``,
    google/flax, its ``jax`` mode): the ``graphdef`` closed over, the state donated, ``train_step(model,
    optimizer, metrics, x, y)`` the step's body."""
    import jax
    from flax import nnx

    @partial(jax.jit, donate_argnums=0)
    def train_step_jax(state: Any, batch: Any) -> Any:
        model, optimizer, metrics = nnx.merge(graphdef, state)
        x, y = batch
        train_step(model, optimizer, metrics, x, y)
        return nnx.state((model, optimizer, metrics))

    return train_step_jax


def _endless(iterable: Any) -> Any:
    """``iterable``'s items, read again from its start each time it ends (a dataset is iterated anew: each pass
    places its batches, as a training loop's epochs do)."""
    while True:
        yield from iterable


def functional_step(jit: Any, train_step: Any) -> Any:
    """Flax's guide "Performance considerations"'s functional loop's step, as the guide writes it: ``jit`` (``jax.jit``,
    or ``strategy.jit`` in its port) over ``jax_train_step(graphdef, state, x, y)`` returning ``loss, state``, nothing
    donated; ``train_step(model, optimizer, metrics, x, y)`` the step's body."""
    from flax import nnx

    @jit
    def jax_train_step(graphdef: Any, state: Any, x: Any, y: Any) -> Any:
        model, optimizer, metrics = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, metrics, x, y)
        state = nnx.state((model, optimizer, metrics))
        return loss, state

    return jax_train_step


class System:
    """One loop on one workload: ``call(n)`` trains ``n`` steps and returns when the state is ready."""

    def __init__(self, name: str, workload: str, x: Any, y: Any, batch: int, devices: list[Any],
                 max_in_flight: int = 2) -> None:
        import jax
        from flax import nnx

        import mirrorax as mx

        self.name = name
        model, optimizer, metrics = objects(workload)
        steps_per_pass = len(x) // batch
        batches = [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps_per_pass)]
        self._i = 0
        if name == "flax_split_merge":  # Flax's benchmarks/nnx_simple_training.py, its jax mode
            graphdef, state = nnx.split((model, optimizer, metrics))
            train_step_jax = flax_loop_step(graphdef, train_step)
            box = [state]
            self.step, self.donated = train_step_jax, (0,)
            self.example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, batches[0]))

            def call(n: int) -> None:
                for _ in range(n):
                    batch = batches[self._i % steps_per_pass]
                    self._i += 1
                    box[0] = train_step_jax(box[0], batch)
                jax.block_until_ready(box[0])
        elif name in ("flax_functional", "strategy_jit_functional", "guide_as_written",
                      "strategy_jit_guide_as_written"):  # the guide's functional loop
            strategy = mx.MirroredStrategy(devices=devices, max_in_flight=max_in_flight)
            jit = jax.jit if name in ("flax_functional", "guide_as_written") else strategy.jit
            graphdef, state = nnx.split((model, optimizer, metrics))
            jax_train_step = functional_step(jit, train_step)
            box = [state]
            if name.endswith("guide_as_written"):  # line for line: the guide makes its batch in the loop
                import jax.numpy as jnp

                (xs, xd), (ys, yd) = ((a.shape, a.dtype) for a in batches[0])

                def call(n: int) -> None:
                    state = box[0]
                    for _ in range(n):
                        x, y = jnp.ones(xs, xd), jnp.zeros(ys, yd)
                        loss, state = jax_train_step(graphdef, state, x, y)
                    box[0] = jax.block_until_ready(state)
            else:  # over the loader's batches (the port: through experimental_distribute_dataset)
                feed = batches if name == "flax_functional" else strategy.experimental_distribute_dataset(batches)
                stream = _endless(feed)

                def call(n: int) -> None:
                    state = box[0]
                    for _ in range(n):
                        xb, yb = next(stream)
                        loss, state = jax_train_step(graphdef, state, xb, yb)
                    box[0] = jax.block_until_ready(state)
        elif name == "nnx_jit":
            step = nnx.jit(train_step, donate_argnums=(0, 1, 2))

            def call(n: int) -> None:
                for _ in range(n):
                    xb, yb = batches[self._i % steps_per_pass]
                    self._i += 1
                    step(model, optimizer, metrics, xb, yb)
                jax.block_until_ready(nnx.state((model, optimizer)))
        elif name in ("strategy_jit", "strategy_jit_loader"):
            strategy = mx.MirroredStrategy(devices=devices, max_in_flight=max_in_flight)
            step = strategy.jit(train_step, donate_argnums=(0, 1, 2))
            dist = (strategy.experimental_distribute_dataset((x, y), batch_size=batch) if name == "strategy_jit"
                    else strategy.experimental_distribute_dataset(batches))
            stream = _endless(dist)

            def call(n: int) -> None:
                for _ in range(n):
                    xb, yb = next(stream)
                    step(model, optimizer, metrics, xb, yb)
                strategy.in_flight.drain()
                jax.block_until_ready(nnx.state(model, nnx.Param))
        elif name == "trainer":
            guide = workload == "guide"
            trainer = mx.Trainer(model, mx.MirroredStrategy(devices=devices, max_in_flight=max_in_flight),
                                 loss=squared_error if guide else "sparse_categorical_crossentropy_from_logits",
                                 optimizer=optimizer.tx, metrics=[] if guide else ["accuracy"])

            def call(n: int) -> None:
                trainer.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
                jax.block_until_ready(trainer.state)
        else:
            raise ValueError(f"unknown system {name!r}; expected one of {SYSTEMS}")
        self.call = call


def measure(workload: str, batch: int, systems: list[str], steps: int, rounds: int, devices: list[Any],
            max_in_flight: int = 2) -> dict:
    """Every system built, warmed up (its compile) and timed in ``rounds`` chunks of ``steps`` steps, ABBA."""
    x, y = make_data(workload, batch * max(steps, 8))
    built = {s: System(s, workload, x, y, batch, devices, max_in_flight) for s in systems}
    first = {}
    for s in systems:
        t0 = time.perf_counter()
        built[s].call(3)
        first[s] = time.perf_counter() - t0
    chunks: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(rounds):
        for s in systems if r % 2 == 0 else systems[::-1]:
            t0 = time.perf_counter()
            built[s].call(steps)
            chunks[s].append(time.perf_counter() - t0)
    rows = {}
    for s in systems:
        base = chunks.get(BASELINE.get(s, "flax_split_merge"))
        rate = statistics.median(steps / t for t in chunks[s])
        ratio = statistics.median(b / t for b, t in zip(base, chunks[s])) if base else None
        rows[s] = {"steps_per_s": rate, "ratio": ratio, "chunk_s": chunks[s], "warmup_s": first[s]}
    return {"workload": workload, "batch": batch, "steps": steps, "rounds": rounds, "max_in_flight": max_in_flight,
            "device_kind": devices[0].device_kind, "systems": rows}


def markdown(results: list[dict]) -> str:
    lines = ["| workload | batch | system | steps/s | / its baseline (Flax's split/merge loop; the functional loop: "
             "Flax's) |", "|---|---:|---|---:|---:|"]
    for r in results:
        for s, v in r["systems"].items():
            ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
            lines.append(f"| {r['workload']} | {r['batch']} | {LABELS[s]} | {v['steps_per_s']:,.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def separate(combos: list[tuple[str, int]], systems: list[str], steps: int, rounds: int, process_rounds: int,
             max_in_flight: int = 2) -> list[dict]:
    """Each system in a process of its own, ``process_rounds`` times, the processes alternating (ABBA): each
    process builds its one system on every (workload, batch) of ``combos`` in turn, warms it up and times
    ``rounds`` chunks of ``steps`` steps. A system's steps/s is the median of all its chunks; its ratio to Flax's
    loop the median over the process rounds of its rate over Flax's loop's in the same round (drift on a shared
    host hits both alike). One result per combo."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems}
    for r in range(process_rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:
            cmd = [sys.executable, "-m", "benchmarks.nnx_loops", "--child", system,
                   "--workloads", ",".join(w for w, _ in combos), "--batches", ",".join(str(b) for _, b in combos),
                   "--pairs", "--steps", str(steps), "--rounds", str(rounds), "--max-in-flight", str(max_in_flight)]
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"{system} failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
            runs[system].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  {system} (process round {r + 1}): " + ", ".join(
                f"{m['workload']}/{m['batch']} {m['systems'][system]['steps_per_s']:,.0f}" for m in runs[system][-1]),
                file=sys.stderr, flush=True)
    results = []
    for c, (workload, batch) in enumerate(combos):
        rows = {}
        for s in systems:
            name = BASELINE.get(s, "flax_split_merge")
            base = [run[c] for run in runs.get(name, [])]
            mine_runs = [run[c] for run in runs[s]]
            chunks = [t for run in mine_runs for t in run["systems"][s]["chunk_s"]]
            rate = statistics.median(steps / t for t in chunks)
            ratio = None if not base else statistics.median(
                statistics.median(steps / t for t in mine["systems"][s]["chunk_s"])
                / statistics.median(steps / t for t in theirs["systems"][name]["chunk_s"])
                for mine, theirs in zip(mine_runs, base))
            rows[s] = {"steps_per_s": rate, "ratio": ratio, "chunk_s": chunks,
                       "warmup_s": [run["systems"][s]["warmup_s"] for run in mine_runs]}
        results.append({"workload": workload, "batch": batch, "steps": steps, "rounds": rounds,
                        "process_rounds": process_rounds, "max_in_flight": max_in_flight,
                        "device_kind": runs[systems[0]][0][c]["device_kind"], "systems": rows})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.nnx_loops", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="guide", help="guide, cnn, transformer (comma-separated; default guide)")
    p.add_argument("--batches", default="32", help="global batches (comma-separated; default 32)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=200, help="steps per chunk (default 200)")
    p.add_argument("--rounds", type=int, default=6, help="timed chunks per process (default 6)")
    p.add_argument("--process-rounds", type=int, default=3,
                   help="processes per system, alternating (default 3); 0: every system in this one process")
    p.add_argument("--max-in-flight", type=int, default=2, help="the strategy's dispatch window (default 2)")
    p.add_argument("--pairs", action="store_true", help="the i-th workload at the i-th batch, not every batch")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # (a worker: this one system)
    p.add_argument("--out", default=None, help="a JSON file for the results")
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    batches = [int(b) for b in args.batches.split(",") if b]
    # Every workload at every batch; --pairs: the i-th workload at the i-th batch.
    combos = list(zip(workloads, batches)) if args.pairs else [(w, b) for w in workloads for b in batches]
    if args.child:  # this one system, on every combo, in this process
        import jax

        print(json.dumps([measure(w, b, [args.child], args.steps, args.rounds, jax.devices()[:1], args.max_in_flight)
                          for w, b in combos]))
        return 0
    if args.process_rounds:
        results = separate(combos, systems, args.steps, args.rounds, args.process_rounds, args.max_in_flight)
    else:
        import jax

        results = []
        for w, b in combos:
            results.append(measure(w, b, systems, args.steps, args.rounds, jax.devices()[:1], args.max_in_flight))
            print(markdown(results[-1:]), flush=True)  # (a run cut short keeps what it measured)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"Device: {results[0]['device_kind'] if results else '?'}\n\n" + markdown(results))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
