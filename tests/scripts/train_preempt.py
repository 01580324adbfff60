"""A training run that a test stops with SIGTERM (preemption) and then runs again to resume.

Usage: python train_preempt.py CHECKPOINT_DIR|- OUT.npz [--devices N] [--input arrays|grain] [--sleep S]
                               [--every K]
Prints "STEP n" after each step (flushed) so the test can signal it at a known point. Writes the final
weights and history to OUT.npz, and, with --input grain, the number of records the data source read.
"""

import argparse
import os
import sys
import time

T0 = time.time()
parser = argparse.ArgumentParser()
parser.add_argument("checkpoint_dir")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--input", choices=("arrays", "grain"), default="arrays")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--every", type=int, default=None, help="checkpoint_every (default: every epoch)")
args = parser.parse_args()

os.environ["KERAS_BACKEND"] = "jax"
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", args.devices)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import mirrorax as mx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import dense, flat_digits  # noqa: E402

ROWS, BATCH = 200, 32  # 7 batches per epoch, the last one short (8 rows)


class Steps(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(f"STEP {batch}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)


class Records:
    """A grain data source that counts its reads (a resume that replays would read every record again)."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], self.y[i]

    def __repr__(self):  # grain's saved state names the source: a stable repr lets it be restored
        return f"Records({len(self.x)})"


x, y, _, _ = flat_digits(ROWS)
records = None
if args.input == "grain":
    import grain

    records = Records(x, y)
    data = grain.DataLoader(
        data_source=records,
        sampler=grain.samplers.IndexSampler(ROWS, shard_options=grain.sharding.NoSharding(), shuffle=True,
                                            seed=7, num_epochs=1),
        operations=[grain.transforms.Batch(BATCH)], worker_count=0,
        # No read-ahead: the read count is exactly what the run consumed (plus the first batch, which
        # fit reads once to size the model).
        read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    fit_args = (data,)
    fit_kwargs = {}
else:
    fit_args = (x, y)
    fit_kwargs = {"shuffle": True, "seed": 5}

strategy = mx.MirroredStrategy()
with strategy.scope():
    model = dense()
trainer = mx.Trainer(model)
print(f"START {time.time() - T0:.2f}", flush=True)
hist = trainer.fit(*fit_args, batch_size=BATCH, epochs=args.epochs, verbose=2, callbacks=[Steps()],
                   checkpoint_dir=None if args.checkpoint_dir == "-" else args.checkpoint_dir,
                   checkpoint_every=args.every or "epoch", **fit_kwargs)
np.savez(args.out, *model.get_weights(), loss=np.array(hist.history["loss"]),
         accuracy=np.array(hist.history["accuracy"]),
         reads=np.array(-1 if records is None else records.reads))
print("DONE", flush=True)
