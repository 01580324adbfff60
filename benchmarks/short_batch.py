"""What computing a short batch on its real rows costs: the tail program's compile, and steps/s.

Run from the repository root::

    python -m benchmarks.short_batch                  # 1 and 8 devices
    python -m benchmarks.short_batch --devices 8 --steps 40 --rounds 3

The model is ``mirrorax.zoo.mlp()`` (784-512-10, Adam, sparse cross-entropy) fitted by an
``mx.Trainer`` at a global batch of 256 on MNIST-shaped random data, three ways:

* ``even``: ``steps`` full batches an epoch (no tail: one program);
* ``tail``: the same and 16 rows more, so each epoch ends with a batch of 16 rows (placed as 256, computed
  on 16): its first epoch compiles the tail program, ``compile_s`` is that epoch's time less a later
  one's;
* ``uneven``: a global batch of 252 (``steps`` of them), which does not divide by 8 devices: every batch
  is placed as 256 rows and computed on 252 (on 1 device it divides: the ``even`` case).

Each epoch is one ``fit(epochs=1)`` call timed from the call to its return; ``steps/s`` is the median over
``rounds`` later epochs. Each case is a new model and trainer (its own programs), after a warm-up one.
A device count is fixed when JAX starts, so each runs in its own process (``--child``); the parent
prints one markdown table.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(devices: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    import jax
    import keras
    import numpy as np

    import mirrorax as mx
    from mirrorax import zoo

    rng = np.random.default_rng(0)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:devices])
    # (warm-up: a first trainer in the process pays one-time costs that the first epoch would count)
    rows_of = {"warm-up": (256, steps * 256), "even": (256, steps * 256), "tail": (256, steps * 256 + 16),
               "uneven": (252, steps * 252)}
    out = []
    for case, (batch, rows) in rows_of.items():
        keras.utils.set_random_seed(0)
        model = zoo.mlp()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        trainer = mx.Trainer(model, strategy)
        x = rng.random((rows, 784), np.float32)
        y = rng.integers(0, 10, rows)
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            trainer.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            times.append(time.perf_counter() - start)
        steady = statistics.median(times[1:])
        epoch_steps = -(-rows // batch)
        if case == "warm-up":
            continue
        out.append({"devices": devices, "case": case, "batch": batch, "steps": epoch_steps,
                    "first_epoch_s": times[0], "epoch_s": steady, "steps_per_s": epoch_steps / steady,
                    "programs": trainer.compile_counts()["train"]})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.rounds)))
        return
    rows = []
    for n in args.devices:
        env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n), KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-m", "benchmarks.short_batch", "--child", str(n), "--steps",
                               str(args.steps), "--rounds", str(args.rounds)],
                              cwd=REPO, env=env, capture_output=True, text=True, check=True)
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    print("| devices | case | batch | steps/epoch | train programs | first epoch s | epoch s | steps/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['devices']} | {r['case']} | {r['batch']} | {r['steps']} | {r['programs']} | "
              f"{r['first_epoch_s']:.2f} | {r['epoch_s']:.3f} | {r['steps_per_s']:.1f} |")
    by = {(r["devices"], r["case"]): r for r in rows}
    for n in args.devices:
        even, tail = by[(n, "even")], by[(n, "tail")]
        compile_s = tail["first_epoch_s"] - even["first_epoch_s"]
        print(f"{n} device(s): the tail's first epoch took {compile_s:+.2f} s more than the even one's "
              "(the tail program's compile, and one step)")


if __name__ == "__main__":
    main()
