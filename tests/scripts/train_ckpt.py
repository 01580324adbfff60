"""A training run that checkpoints; killed and restarted by tests/test_resume.py.

Usage: python train_ckpt.py CHECKPOINT_DIR OUT.npz [--devices N] [--every K]
Prints "STEP n" after each step (flushed) so the test can kill it at a known point.
"""

import argparse
import os
import sys
import time

T0 = time.time()
parser = argparse.ArgumentParser()
parser.add_argument("checkpoint_dir")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.0)
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


class Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.first = True

    def on_train_batch_end(self, batch, logs=None):
        if self.first:
            print(f"FIRST_STEP_AT {time.time() - T0:.2f}", flush=True)
            self.first = False
        print(f"STEP {batch}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)


x, y, _, _ = flat_digits(200)
model = dense()
trainer = mx.Trainer(model, mx.MirroredStrategy())
hist = trainer.fit(x, y, batch_size=32, epochs=4, shuffle=True, seed=5, verbose=2, callbacks=[Steps()],
                   checkpoint_dir=None if args.checkpoint_dir == "-" else args.checkpoint_dir,
                   checkpoint_every=args.every)
np.savez(args.out, *model.get_weights(), loss=np.array(hist.history["loss"]),
         accuracy=np.array(hist.history["accuracy"]))
print("DONE", flush=True)
