"""TF's custom-training tutorial as ported (``examples/tf_custom_training.py``) at its real sizes, N devices
against 1 device at the same global batch: the check that ``tests/test_custom_loops.py`` makes at a size CI
can afford.

    PYTHONPATH=$PWD/src python tests/tools/tutorial_sizes.py            # 60,000 / 10,000 rows, 2 epochs
    PYTHONPATH=$PWD/src python tests/tools/tutorial_sizes.py --train 4000 --test 1000 --pairs 1@192,3@192

Each pair ``N@B`` runs the tutorial on ``N`` simulated CPU devices at a global batch of ``B`` (64 per replica
by default: 1@128 against 2@128, 1@192 against 3@192). It prints every printed metric of each run, how
many rows each metric counted, and each run's largest relative difference from the 1-device run at its
global batch (metrics, and weights at the end).

``--perturb EPS`` (default 1e-7) adds the floor to judge those differences by: the 1-device run again at
each global batch, its first initial weights (the first convolution's kernel, Keras's first
``GlorotUniform`` draw) times ``1 + EPS``. The tutorial's ReLU network amplifies a float32 rounding
difference over hundreds of steps; a device count that moves the numbers no further than that rounding
does is the 1-device program. ``--perturb 0`` skips it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import tempfile
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("KERAS_BACKEND", "jax")

METRICS = ("train_loss", "train_accuracy", "test_loss", "test_accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=60000)
    parser.add_argument("--test", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--pairs", default="1@128,2@128,1@192,3@192")
    parser.add_argument("--perturb", type=float, default=1e-7)
    args = parser.parse_args()

    import jax
    import keras

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tf_custom_training.py"
    spec = importlib.util.spec_from_file_location("tf_custom_training", path)
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)

    glorot = keras.initializers.GlorotUniform.__call__
    draws: dict = {"eps": 0.0, "shape": None}

    def perturbed(self, shape, *a, **k):  # the first kernel's draws (Keras draws again per trace) times 1 + eps
        value = glorot(self, shape, *a, **k)
        if draws["eps"] and draws["shape"] in (None, tuple(shape)):
            draws["shape"] = tuple(shape)
            value = value * (1 + draws["eps"])
        return value

    keras.initializers.GlorotUniform.__call__ = perturbed
    pairs = [tuple(int(v) for v in pair.split("@")) + (0.0,) for pair in args.pairs.split(",")]
    if args.perturb:
        pairs += [(1, batch, args.perturb) for batch in sorted({b for n, b, _ in pairs})]
    runs = {}
    for n, batch, eps in pairs:
        draws.update(eps=eps, shape=None)
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as checkpoints:
            run = tutorial.main(devices=jax.devices()[:n], global_batch_size=batch, epochs=args.epochs,
                                checkpoint_dir=checkpoints, num_train=args.train, num_test=args.test)
        runs[(n, batch, eps)] = run
        print(f"{n} device(s) at a global batch of {batch}{f', weights x (1 + {eps:g})' if eps else ''}: "
              f"{time.monotonic() - start:.0f} s; rows counted: train {run['train_rows']}, test {run['test_rows']}",
              flush=True)

    print("\n| run | " + " | ".join(METRICS) + " | largest relative difference from 1 device: metrics | weights |")
    print("|---|" + "---|" * (len(METRICS) + 2))
    for (n, batch, eps), run in runs.items():
        one = runs.get((1, batch, 0.0))
        same = one is None or run is one
        metrics = "-" if same else f"{max(abs(a - b) / abs(b) for k in METRICS for a, b in zip(run[k], one[k])):.2g}"
        weights = "-" if same else f"{max(_relative(a, b) for a, b in zip(run['weights'], one['weights'])):.2g}"
        cells = [" / ".join(f"{v:.7g}" for v in run[key]) for key in METRICS]
        label = f"{n} @ {batch}" + (f", weights x (1 + {eps:g})" if eps else "")
        print(f"| {label} | " + " | ".join(cells) + f" | {metrics} | {weights} |")


def _relative(a, b) -> float:
    """The largest difference between two weights, relative to the largest magnitude of the reference."""
    import numpy as np

    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


if __name__ == "__main__":
    main()
