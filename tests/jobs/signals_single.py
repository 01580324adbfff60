"""One process, signals at awkward moments of ``fit`` (train_dense's model, checkpointed).

``python signals_single.py MODE CKPT``. ``build``: SIGTERM while fit compiles its step (before the first
batch). ``second``: SIGTERM after step 3, and a second one while the checkpoint is being written.
``sigint``: Ctrl-C (SIGINT) after step 3; prints ``INTERRUPTED <message>`` when fit raises
KeyboardInterrupt. Each prints the checkpoint directory's entries (``ENTRIES a,b``) at the end.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs import train_dense  # noqa: E402


class SignalAt:
    def __init__(self, sig: signal.Signals, step: int) -> None:
        self.sig, self.step, self.count = sig, step, 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.count += 1
        if self.count == self.step:
            print(f"sending {self.sig.name}", flush=True)
            os.kill(os.getpid(), self.sig)


def entries(ckpt: str) -> None:
    print("ENTRIES " + ",".join(sorted(os.listdir(ckpt))), flush=True)


if __name__ == "__main__":
    import mirrorax as mx
    import mirrorax.checkpoint.checkpointer as checkpoint
    import mirrorax.fit.planner as planner

    mode, ckpt = sys.argv[1], sys.argv[2]
    print(f"SIGINT at start: {signal.getsignal(signal.SIGINT)}", flush=True)  # Python's own handler, or inherited
    # A terminal's Ctrl-C meets Python's own handler; a SIGINT ignored by the process that runs the tests is
    # inherited ignored (exec keeps SIG_IGN), so the job installs Python's handler itself (not the test, with
    # a preexec_fn: that forks the test's process, and JAX warns, an error there, once its backend is up).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    callbacks = []
    if mode == "build":
        compile_step = planner.at_fit_start

        def term_then_compile(*args, **kwargs):
            print("sending SIGTERM while compiling", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return compile_step(*args, **kwargs)

        planner.at_fit_start = term_then_compile
    elif mode == "second":
        close = checkpoint.Checkpointer.close

        def term_then_close(self):
            print("sending SIGTERM again while the checkpoint is written", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return close(self)

        checkpoint.Checkpointer.close = term_then_close
        callbacks.append(SignalAt(signal.SIGTERM, 3))
    else:
        callbacks.append(SignalAt(signal.SIGINT, 3))
    strategy = mx.MirroredStrategy()
    x, y = train_dense.data()
    model = train_dense._model(strategy)
    try:
        mx.Trainer(model, strategy=strategy).fit(x, y, batch_size=train_dense.BATCH, epochs=3, verbose=0,
                                                 callbacks=callbacks, checkpoint_dir=ckpt)
    except KeyboardInterrupt as e:
        print(f"INTERRUPTED {e}", flush=True)
    except SystemExit:
        entries(ckpt)
        raise
    entries(ckpt)
