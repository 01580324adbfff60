"""Small models and data shared by the tests (built fresh each call, seeded)."""

from __future__ import annotations

import jax
import keras
import numpy as np

import mirrorax as mx
from mirrorax import zoo


def strategy(n: int) -> mx.MirroredStrategy:
    return mx.MirroredStrategy(devices=jax.devices()[:n])


def digits(n: int = 200):
    (x, y), (xt, yt) = zoo.load_digits()
    return x[:n], y[:n], xt, yt


def cnn(seed: int = 1, *, compile_kwargs=None, dropout: float = 0.1) -> keras.Model:
    """The main job's CNN (BatchNorm + Dropout), narrow for speed."""
    keras.utils.set_random_seed(seed)
    m = zoo.digits_cnn(width=8, dropout=dropout)
    m.compile(**(compile_kwargs or dict(optimizer="adam", loss="sparse_categorical_crossentropy",
                                        metrics=["accuracy"])))
    return m


def dense(seed: int = 1, inputs: int = 64, classes: int = 10, **compile_kwargs) -> keras.Model:
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(classes, activation="softmax")])
    kw = dict(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    kw.update(compile_kwargs)
    m.compile(**kw)
    return m


def flat_digits(n: int = 200):
    x, y, xt, yt = digits(n)
    return x.reshape(len(x), -1), y, xt.reshape(len(xt), -1), yt


def assert_weights_close(a: keras.Model, b: keras.Model, rtol: float, atol: float) -> None:
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for i, (u, v) in enumerate(zip(wa, wb)):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=f"weight {i}")


def train_step_args(trainer: mx.Trainer, x, y, batch_size: int = 24) -> tuple:
    """The arguments ``trainer``'s compiled train step is called with in a one-step ``fit`` on ``(x, y)``
    (for ``trainer.steps.train.lower(*args)`` or a ``jax.make_jaxpr`` of the step). Read
    ``trainer.steps.train`` after this call: ``fit`` selects which compiled variant it names."""
    from mirrorax import dispatch

    captured = {}
    original = dispatch.StrategyFunction.program

    def program(self, *args):
        captured["args"] = args
        return original(self, *args)

    dispatch.StrategyFunction.program = program
    try:
        trainer.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=1, verbose=0)
    finally:
        dispatch.StrategyFunction.program = original
    return captured["args"]


def changed_lines(original: str, port: str) -> list[str]:
    """The lines a port of a tutorial changes (replaced, removed or added) after its ``# fmt: off`` line, beyond
    imports and the strategy line (``examples/``: TF's tutorial, Flax's MNIST tutorial)."""
    import difflib

    def body(text: str) -> list[str]:
        return text.split("# fmt: off\n", 1)[1].splitlines()

    def counted(line: str) -> bool:
        s = line.strip()
        return bool(s) and not (s.startswith(("import ", "from ", "os.environ.setdefault("))
                                or "MirroredStrategy(" in s)

    a, b = body(original), body(port)
    changed = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            old, new = [x for x in a[i1:i2] if counted(x)], [x for x in b[j1:j2] if counted(x)]
            changed += (old + new)[:max(len(old), len(new))]
    return changed
