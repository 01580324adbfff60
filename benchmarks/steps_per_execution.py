"""Steps per second against the steps fused per dispatch (``steps_per_execution=k``), and what ``"auto"`` picks.

Two models at the two ends: ``small``, Keras's ``Dense(10)`` on 2 inputs at a global batch of 8 (a step is
microseconds of device work: the host's cost per dispatch is all there is), and ``large``, whose step is
milliseconds of device work, so that the host's cost hides behind it: on a CPU a 512-wide MLP of three hidden
layers at a batch of 512, on an accelerator (a TPU or GPU that JAX sees: ``--preset accelerator``, the default
there) a 4096-wide one of four hidden layers on 256 inputs at a batch of 2,048 (6.3e11 FLOPs a step: about
4 ms on a TPU v5e at 80% of its peak). Each runs ``mx.Trainer(model, steps_per_execution=k).fit`` for every
``k`` of ``--ks`` of at most half a fit's steps, and for ``"auto"``, in one process on one device: every
trainer warmed up first (a fit: compiled; ``"auto"``'s over several epochs, long enough for it to decide
and pay for its compile), then ``--rounds`` rounds of one ``fit`` each (``MODELS``' steps), the order
rotating every round. A point is the median of its rounds; ``"auto"``'s point sits at the ``k`` it chose.

Writes ``results.json`` and ``steps_per_execution.png`` (steps/s against k, one panel per model) in ``--out``.

Run: ``python -m benchmarks.steps_per_execution`` (about 5 minutes on 2 CPU cores, about 1 on a TPU v5e), or
``python -m benchmarks.steps_per_execution --models small --ks 1,4,16 --rounds 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One device: the steps' device time is one device's, not eight simulated devices taking turns on the cores.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
os.environ.setdefault("KERAS_BACKEND", "jax")

#: preset -> model -> (inputs, hidden widths, global batch, steps per timed fit, epochs of "auto"'s warm-up fit)
#: The small model's "auto" warm-up is long enough for its fused program to pay for its compile (a shorter
#: fit puts the choice off to the next one: fit/meter.py).
PRESETS = {"cpu": {"small": (2, (), 8, 8192, 3), "large": (512, (512, 512, 512), 512, 64, 1)},
           "accelerator": {"small": (2, (), 8, 2048, 3), "large": (256, (4096,) * 4, 2048, 64, 1)}}
MODELS = PRESETS["cpu"]


def _trainer(name: str, k: Any) -> tuple[Any, Any, Any, int, int]:
    """Model ``name`` of :data:`MODELS` under ``mx.Trainer(steps_per_execution=k)``, its data and sizes."""
    import jax
    import keras
    import numpy as np

    import mirrorax as mx

    inputs, hidden, batch, steps, _ = MODELS[name]
    keras.utils.set_random_seed(0)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
    with strategy.scope():
        layers = [keras.Input((inputs,))] + [keras.layers.Dense(w, activation="relu") for w in hidden]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, inputs)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    return mx.Trainer(model, strategy, steps_per_execution=k), x, y, batch, steps


def _fit(trainer: Any, x: Any, y: Any, batch: int, epochs: int = 1) -> float:
    """One timed fit: its steps per second (set-up included: what a user's epoch costs)."""
    import jax

    start = time.perf_counter()
    trainer.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    jax.block_until_ready(trainer.state)
    return epochs * (len(x) // batch) / (time.perf_counter() - start)


def measure(name: str, ks: list[int], rounds: int) -> dict[str, Any]:
    """Steps/s of model ``name`` at each ``k`` of ``ks`` (those of at most half its fit's steps) and under
    ``"auto"``: medians over ``rounds``."""
    import jax

    systems: dict[str, Any] = {}
    inputs, hidden, batch_size, steps, auto_epochs = MODELS[name]
    ks = [k for k in ks if k <= steps // 2]
    for k in [*ks, "auto"]:
        trainer, x, y, batch, _ = _trainer(name, k)
        _fit(trainer, x, y, batch, auto_epochs if k == "auto" else 1)  # compiles; "auto" measures and decides
        systems[str(k)] = (trainer, x, y, batch, [])
    order = list(systems)
    for r in range(rounds):
        for key in order[r % len(order):] + order[:r % len(order)]:
            trainer, x, y, batch, runs = systems[key]
            runs.append(_fit(trainer, x, y, batch))
    auto = systems["auto"][0]
    shape = "-".join(str(w) for w in (inputs, *hidden, 10))
    return {"model": name, "title": f"{name}: MLP {shape}, batch {batch_size}",
            "device": str(jax.devices()[0].device_kind),
            "steps_per_second": {key: statistics.median(v[4]) for key, v in systems.items()},
            "runs": {key: v[4] for key, v in systems.items()},
            "auto_k": auto.utilisation[-1].steps_per_execution,
            "auto_figures": str(auto.utilisation[-1]),
            "one_step_figures": str(systems[str(ks[0])][0].utilisation[-1])}


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.8), squeeze=False)
    for ax, res in zip(axes[0], results):
        sps = res["steps_per_second"]
        ks = sorted(int(k) for k in sps if k != "auto")
        ax.plot(ks, [sps[str(k)] for k in ks], "o-", label="steps_per_execution=k")
        ax.plot([res["auto_k"]], [sps["auto"]], "r*", markersize=14, label=f'"auto" (chose k={res["auto_k"]})')
        ax.set(xscale="log", xlabel="steps per dispatch k", ylabel="steps/s",
               title=res.get("title", res["model"]))
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    devices = sorted({res.get("device", "cpu") for res in results})
    where = "one CPU device" if devices == ["cpu"] else "one " + ", ".join(devices)
    fig.suptitle(f"Trainer.fit on {where}: steps/s against steps_per_execution", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="small,large")
    p.add_argument("--ks", default="1,2,4,8,16,32,64,128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the models' sizes (default: accelerator where JAX sees one, else cpu)")
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/results/<UTC time>)")
    p.add_argument("--plot", nargs="+", metavar="RESULTS_JSON",
                   help="only draw the plot of earlier runs' results.json (e.g. one per model, each run when the "
                        "host was quiet) into --out")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-steps_per_execution")
    os.makedirs(out, exist_ok=True)
    if args.plot:
        earlier = []
        for path in args.plot:
            with open(path) as f:
                earlier += json.load(f)["results"]
        plot(earlier, os.path.join(out, "steps_per_execution.png"))
        print(f"wrote {out}/steps_per_execution.png")
        return 0
    global MODELS
    if args.preset is None:
        import jax

        args.preset = "cpu" if jax.default_backend() == "cpu" else "accelerator"
    MODELS = PRESETS[args.preset]
    load = os.getloadavg()
    results = []
    for m in args.models.split(","):
        results.append(measure(m, [int(k) for k in args.ks.split(",")], args.rounds))
        with open(os.path.join(out, "results.json"), "w") as f:  # (each model's as it ends: a run cut short)
            json.dump({"results": results, "load_before": load, "load_after": os.getloadavg()}, f, indent=1)
    for res in results:
        sps = res["steps_per_second"]
        print(f'{res["model"]}: ' + ", ".join(f"k={k} {v:,.0f}" for k, v in sps.items()) +
              f' steps/s; "auto" chose k={res["auto_k"]} ({sps["auto"] / sps["1"]:.2f}x k=1)')
        print(f'  k=1: {res["one_step_figures"]}; auto: {res["auto_figures"]}')
    print(f"load average (1, 5, 15 min) before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after: "
          + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    try:
        plot(results, os.path.join(out, "steps_per_execution.png"))
    except ImportError:  # (a machine without matplotlib: the plot is drawn elsewhere with --plot)
        print(f"wrote {out}/results.json; no matplotlib here: draw the plot with --plot {out}/results.json")
        return 0
    print(f"wrote {out}/results.json and steps_per_execution.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
