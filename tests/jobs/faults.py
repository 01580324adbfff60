"""The fault job: train_dense's model on a generator input, with one fault injected into one rank.

Run by tests/test_faults_launch.py under ``mirrorax launch`` (2 processes). Environment: ``MP_FAULT``
``KIND:R:S`` makes rank R misbehave at its step S: ``input`` (its generator blocks), ``callback`` (a batch
callback blocks), ``exit`` (``sys.exit(3)`` in a callback), ``exit0`` (``sys.exit(0)``), ``osexit``
(``os._exit(0)`` in a callback), ``nojoin`` (rank R blocks before it joins the job), ``epochexit``
(``sys.exit(3)`` in ``on_epoch_end`` of epoch S). ``MP_OUT``: each rank writes ``pid<R>`` there.
``MP_CKPT``: a checkpoint directory; ``MP_SLEEP``: seconds per step; ``MP_EPOCHS`` (default 30).
``MP_CATCH=N``: a ``CheckpointError`` from fit is caught, printed (``rank R refused: ...``) and ends the
script with ``sys.exit(N)``, as a script that handles it would. ``MP_SLOW_SAVE=S``: each checkpoint save
takes S seconds more (a slow file system), on every rank. ``MP_EVERY=N``: a checkpoint every N steps.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs import train_dense  # noqa: E402

RANK = int(os.environ.get("MIRRORAX_PROCESS_ID", "0"))
KIND, AT_RANK, AT_STEP = (os.environ.get("MP_FAULT", "none:-1:-1").split(":") + ["0"])[:3]
MINE = int(AT_RANK) == RANK


def stuck_forever(where: str) -> None:
    print(f"rank {RANK} blocks now in {where}", flush=True)
    time.sleep(3600)


class Fault:
    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.count += 1
        if MINE and self.count == int(AT_STEP):
            if KIND == "callback":
                stuck_forever("a callback")
            if KIND == "exit":
                print(f"rank {RANK} calls sys.exit(3)", flush=True)
                sys.exit(3)
            if KIND == "exit0":
                print(f"rank {RANK} calls sys.exit(0)", flush=True)
                sys.exit(0)
            if KIND == "osexit":
                print(f"rank {RANK} calls os._exit(0)", flush=True)
                os._exit(0)
        time.sleep(float(os.environ.get("MP_SLEEP", "0")))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if MINE and KIND == "epochexit" and epoch + 1 == int(AT_STEP):
            print(f"rank {RANK} calls sys.exit(3) at the end of epoch {epoch + 1}", flush=True)
            sys.exit(3)


def batches(x, y):
    step = 0
    while True:
        for start in range(0, len(x) - train_dense.BATCH + 1, train_dense.BATCH):
            step += 1
            if MINE and KIND == "input" and step == int(AT_STEP):
                stuck_forever("its input generator")
            yield x[start:start + train_dense.BATCH], y[start:start + train_dense.BATCH]


if __name__ == "__main__":
    if os.environ.get("MP_OUT"):
        with open(os.path.join(os.environ["MP_OUT"], f"pid{RANK}"), "w") as f:
            f.write(str(os.getpid()))
    if MINE and KIND == "nojoin":
        stuck_forever("its script, before joining the job")
    import mirrorax as mx

    strategy = mx.MultiWorkerMirroredStrategy()
    x, y = train_dense.data()
    model = train_dense._model(strategy)
    trainer = mx.Trainer(model, strategy=strategy)
    ckpt = os.environ.get("MP_CKPT") or None
    if os.environ.get("MP_SLOW_SAVE"):
        import orbax.checkpoint as ocp

        slow, real_save = float(os.environ["MP_SLOW_SAVE"]), ocp.CheckpointManager.save

        def slow_save(self, *args, **kwargs):
            time.sleep(slow)
            return real_save(self, *args, **kwargs)

        ocp.CheckpointManager.save = slow_save
    if ckpt:
        try:
            trainer.fit(x, y, batch_size=train_dense.BATCH, epochs=int(os.environ.get("MP_EPOCHS", "30")),
                        verbose=0, callbacks=[Fault()], checkpoint_dir=ckpt,
                        checkpoint_every=int(os.environ.get("MP_EVERY", "0")) or "epoch")
        except mx.CheckpointError as refused:
            if not os.environ.get("MP_CATCH"):
                raise
            print(f"rank {RANK} refused: {refused}", flush=True)
            sys.exit(int(os.environ["MP_CATCH"]))
    else:
        trainer.fit(batches(x, y), steps_per_epoch=6, epochs=int(os.environ.get("MP_EPOCHS", "30")), verbose=0,
                    callbacks=[Fault()])
    print(f"rank {RANK} done", flush=True)
