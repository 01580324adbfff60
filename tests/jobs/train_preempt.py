"""The multi-process preemption job: train_dense's model and data, checkpointed, SIGTERM to one process.

Run by tests/test_preemption.py as 2 processes started by hand (as a scheduler would start them).
Environment: ``MP_OUT`` (``rank<R>.npz`` with the final weights and history goes there), ``MP_CKPT``
(the checkpoint directory), ``MP_TERM=R:S`` (process R sends itself SIGTERM after its step S, on the
first run only: when the checkpoint directory is still empty), ``MP_SLEEP`` (seconds per step of the first
run, so that the stop falls mid-run: the notice reaches the other process some steps later; the rerun goes
at full speed), ``MP_EPOCHS``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from jobs import train_dense  # noqa: E402


class Steps:
    """Prints each step; process R sends itself SIGTERM after step S (a scheduler signalling one host)."""

    def __init__(self, process: int, term: str | None, sleep: float) -> None:
        self.process, self.sleep, self.count = process, sleep, 0
        self.rank, self.at = (int(v) for v in term.split(":")) if term else (-1, -1)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.count += 1
        print(f"process {self.process} STEP {batch}", flush=True)
        if self.process == self.rank and self.count == self.at:
            print(f"SIGTERM_AT {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.sleep)


if __name__ == "__main__":
    import mirrorax as mx

    strategy = mx.MultiWorkerMirroredStrategy()
    ckpt = os.environ["MP_CKPT"]
    first_run = not os.path.isdir(ckpt) or not any(name.isdigit() for name in os.listdir(ckpt))
    term = os.environ.get("MP_TERM") if first_run else None
    x, y = train_dense.data()
    model = train_dense._model(strategy)
    trainer = mx.Trainer(model, strategy=strategy)
    steps = Steps(strategy.process_index, term, float(os.environ.get("MP_SLEEP", "0")) if first_run else 0.0)
    history = trainer.fit(x, y, batch_size=train_dense.BATCH, epochs=int(os.environ.get("MP_EPOCHS", "3")),
                          shuffle=True, seed=3, verbose=2, callbacks=[steps], checkpoint_dir=ckpt)
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    out.update({f"h_{k}": np.asarray(v, np.float64) for k, v in history.history.items()})
    np.savez(os.path.join(os.environ["MP_OUT"], f"rank{strategy.process_index}.npz"), **out)
    if os.environ.get("MP_MEASURE"):
        # The per-step cost of the preemption check (JAX's sync point), as fit calls it.
        from mirrorax.cluster import preemption

        with preemption.Watch(strategy.process_count) as watch:
            assert watch.mode == "jax", watch.mode
            start = time.perf_counter()
            for _ in range(20000):
                watch.reached()
            print(f"SYNC_POINT_US {(time.perf_counter() - start) / 20000 * 1e6:.2f}", flush=True)
    print(f"process {strategy.process_index} done", flush=True)
