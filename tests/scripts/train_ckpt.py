"""A training run that checkpoints; killed and restarted by tests/test_resume.py.

Usage: python train_ckpt.py CHECKPOINT_DIR OUT.npz [--devices N] [--every K]
Prints "STEP n" after each step (flushed) so the test can kill it at a known point.
"""

import argparse
import os
import signal
import sys
import time

T0 = time.time()
parser = argparse.ArgumentParser()
parser.add_argument("checkpoint_dir")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--kill-rank", type=int, default=None, help="this process SIGKILLs itself (first attempt only)")
parser.add_argument("--kill-at-step", type=int, default=10)
args = parser.parse_args()

os.environ["KERAS_BACKEND"] = "jax"
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
if "MIRRORAX_COORDINATOR" not in os.environ:  # under `mirrorax launch` the launcher sets the devices
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
        self.steps = getattr(self, "steps", 0) + 1
        print(f"STEP {batch}", flush=True)
        if args.kill_rank is not None and os.environ.get("MIRRORAX_RESTART", "0") == "0" and \
                jax.process_index() == args.kill_rank and self.steps == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.sleep:
            time.sleep(args.sleep)


strategy = mx.MirroredStrategy()  # first: joins the job (under `mirrorax launch`) before JAX starts
x, y, _, _ = flat_digits(200)
with strategy.scope():
    model = dense()
trainer = mx.Trainer(model)
hist = trainer.fit(x, y, batch_size=32, epochs=4, shuffle=True, seed=5, verbose=2, callbacks=[Steps()],
                   checkpoint_dir=None if args.checkpoint_dir == "-" else args.checkpoint_dir,
                   checkpoint_every=args.every)
if jax.process_index() == 0:
    np.savez(args.out, *model.get_weights(), loss=np.array(hist.history["loss"]),
             accuracy=np.array(hist.history["accuracy"]))
print("DONE", flush=True)
