"""TF's custom-training tutorial as ported (``examples/tf_custom_training.py``) at its real sizes, N devices
against 1 device at the same global batch: the check that ``tests/test_custom_loops.py`` makes at a size CI
can afford.

    PYTHONPATH=$PWD/src python tests/tools/tutorial_sizes.py            # 60,000 / 10,000 rows, 2 epochs
    PYTHONPATH=$PWD/src python tests/tools/tutorial_sizes.py --train 4000 --test 1000 --pairs 1@192,3@192

Each pair ``N@B`` runs the tutorial on ``N`` simulated CPU devices at a global batch of ``B`` (64 per replica
by default: 1@128 against 2@128, 1@192 against 3@192). It prints every printed metric of each run, how
many rows each metric counted, and each run's largest relative difference from the 1-device run at its
global batch.
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
    args = parser.parse_args()

    import jax

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tf_custom_training.py"
    spec = importlib.util.spec_from_file_location("tf_custom_training", path)
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)

    runs = {}
    for pair in args.pairs.split(","):
        n, batch = (int(v) for v in pair.split("@"))
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as checkpoints:
            run = tutorial.main(devices=jax.devices()[:n], global_batch_size=batch, epochs=args.epochs,
                                checkpoint_dir=checkpoints, num_train=args.train, num_test=args.test)
        runs[(n, batch)] = run
        print(f"{n} device(s) at a global batch of {batch}: {time.monotonic() - start:.0f} s; rows counted: "
              f"train {run['train_rows']}, test {run['test_rows']}", flush=True)

    print("\n| devices @ batch | " + " | ".join(METRICS) + " | largest relative difference from 1 device |")
    print("|---|" + "---|" * (len(METRICS) + 1))
    for (n, batch), run in runs.items():
        one = runs.get((1, batch))
        worst = None if one is None or n == 1 else max(
            abs(a - b) / abs(b) for key in METRICS for a, b in zip(run[key], one[key]))
        cells = [" / ".join(f"{v:.7g}" for v in run[key]) for key in METRICS]
        print(f"| {n} @ {batch} | " + " | ".join(cells) + f" | {'-' if worst is None else f'{worst:.2g}'} |")


if __name__ == "__main__":
    main()
