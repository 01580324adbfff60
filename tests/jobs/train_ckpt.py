"""The checkpointed training job that the resume and preemption tests stop and run again.

Usage: python train_ckpt.py CHECKPOINT_DIR|- OUT.npz [--devices N] [--epochs E] [--every K]
                            [--input arrays|grain] [--front-end keras|nnx] [--hold-at S] [--go FILE]
                            [--kill-rank R --kill-at-step S] [--sleep SECONDS]

A Dense model on 200 digits at batch 32 (7 batches per epoch, the last one short), shuffled with seed 5,
checkpointed every K steps (default: every epoch) when CHECKPOINT_DIR is not ``-``. Prints ``STEP n``
after each step (flushed). Process 0 writes the final weights and history to OUT.npz, and, with
``--input grain``, the number of records the data source read. ``--front-end nnx``: the model is Flax NNX's
(``helpers.front_end_model``'s tanh MLP), and OUT.npz holds the trainer's whole state
(``helpers.trained_state``) instead of the Keras model's weights.

The handshake that lets a test stop the job at a known step, with no sleep to race: with ``--hold-at S``
the job prints ``HOLD S`` after its S-th step and waits there, until the test has sent its signal and
created ``--go FILE`` (after a SIGKILL it simply never goes on). Under ``mirrorax launch``,
``--kill-rank R`` makes process R SIGKILL itself after its ``--kill-at-step`` step, on the first attempt.
"""

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint_dir")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--every", type=int, default=None, help="checkpoint_every (default: every epoch)")
parser.add_argument("--input", choices=("arrays", "grain"), default="arrays")
parser.add_argument("--front-end", choices=("keras", "nnx"), default="keras")
parser.add_argument("--hold-at", type=int, default=None, help="wait after this step (counted over the fit)")
parser.add_argument("--go", default=None, help="the file whose creation ends the hold")
parser.add_argument("--kill-rank", type=int, default=None, help="this process SIGKILLs itself (first attempt only)")
parser.add_argument("--kill-at-step", type=int, default=10)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds after each step")
args = parser.parse_args()

os.environ["KERAS_BACKEND"] = "jax"
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
if "MIRRORAX_COORDINATOR" not in os.environ:  # under `mirrorax launch` the launcher sets the devices
    jax.config.update("jax_num_cpu_devices", args.devices)

import numpy as np  # noqa: E402

import mirrorax as mx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import dense, flat_digits, front_end_trainer, trained_state  # noqa: E402

ROWS, BATCH = 200, 32  # 7 batches per epoch, the last one short (8 rows)
HOLD_LIMIT_S = 120  # a test that never answers the hold: end the job rather than hang


class Steps:  # a plain object with Keras's hook: the Trainer drives it for any front-end
    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        print(f"STEP {batch}", flush=True)
        if args.kill_rank is not None and os.environ.get("MIRRORAX_RESTART", "0") == "0" and \
                jax.process_index() == args.kill_rank and self.steps == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.steps == args.hold_at:
            print(f"HOLD {self.steps}", flush=True)
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not (args.go and os.path.exists(args.go)):
                assert time.monotonic() < deadline, f"held at step {self.steps} for {HOLD_LIMIT_S} s: no go"
                time.sleep(0.01)  # a signal meanwhile runs its handler; the sleep goes on after it
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


strategy = mx.MirroredStrategy()  # first: joins the job (under `mirrorax launch`) before JAX starts
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

if args.front_end == "nnx":
    model, trainer = front_end_trainer("nnx", strategy, "mlp", classes=10, seed=1)
else:
    with strategy.scope():
        model = dense()
    trainer = mx.Trainer(model)
hist = trainer.fit(*fit_args, batch_size=BATCH, epochs=args.epochs, verbose=2, callbacks=[Steps()],
                   checkpoint_dir=None if args.checkpoint_dir == "-" else args.checkpoint_dir,
                   checkpoint_every=args.every or "epoch", **fit_kwargs)
if jax.process_index() == 0:
    weights = trained_state(trainer) if args.front_end == "nnx" else model.get_weights()
    np.savez(args.out, *weights, loss=np.array(hist.history["loss"]),
             accuracy=np.array(hist.history["accuracy"]),
             reads=np.array(-1 if records is None else records.reads))
print("DONE", flush=True)
