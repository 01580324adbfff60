"""Small models and data shared by the tests (built fresh each call, seeded)."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import keras
import numpy as np

import mirrorax as mx
from mirrorax import zoo


def strategy(n: int) -> mx.MirroredStrategy:
    return mx.MirroredStrategy(devices=jax.devices()[:n])


def built(build, n: int | None):
    """``build()``'s model in plain Keras (``n`` None) or under the scope of ``n`` devices."""
    if n is None:
        return build()
    with strategy(n).scope():
        return build()


def assert_same_run(got, want, rtol: float = 1e-4) -> None:
    """Two runs' ``(History.history, evaluate's dict, arrays)`` agree: the same log keys, every logged
    value and every array (predictions, weights) to ``rtol`` (arrays also to 1e-6 absolute)."""
    for logs, want_logs in zip(got[:2], want[:2]):
        assert set(logs) == set(want_logs), (logs, want_logs)
        for key in want_logs:
            np.testing.assert_allclose(logs[key], want_logs[key], rtol=rtol, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6), got[2], want[2])


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
    from mirrorax.steps import dispatch

    captured = {}
    original = dispatch.StrategyFunction.flat_program  # (the loop keeps the state as its leaves)

    def flat_program(self, *args):
        captured["args"] = args
        return original(self, *args)

    dispatch.StrategyFunction.flat_program = flat_program
    try:
        trainer.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=1, verbose=0)
    finally:
        dispatch.StrategyFunction.flat_program = original
    return captured["args"]


EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def example(name: str):
    """The program ``examples/<name>.py``, imported as a module of its own (its ``main`` then runs it)."""
    spec = importlib.util.spec_from_file_location(f"mirrorax_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


# -- the same small model from either front-end (tests of the engine, not of Keras) ------------------------
FRONT_ENDS = ("keras", "nnx")


def learnable(rows: int = 50, classes: int = 5, seed: int = 0, flat: bool = False):
    """``rows`` 8x8x1 images (or their 64 features, ``flat``) and labels a linear map of them decides: a task
    the models learn, so that N devices and 1 device stay on one well-conditioned path."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8, 8, 1)).astype(np.float32)
    y = np.argmax(x.reshape(rows, -1) @ rng.normal(size=(64, classes)), axis=1)
    return (x.reshape(rows, -1) if flat else x), y


def front_end_model(front_end: str, kind: str = "cnn", *, seed: int = 0, optimizer: str = "adam",
                    learning_rate: float = 1e-2, classes: int = 5):
    """One small smooth model built with Keras or with Flax NNX, and the ``mx.Trainer`` keyword arguments that
    complete it: ``(model, trainer_kwargs)``.

    kinds: ``"cnn"`` (8x8x1 images: a conv without bias, BatchNorm, GELU, average pooling, Dropout 0.2, a dense
    head), ``"mlp"`` (64 features: Dense 16 tanh, a dense head), ``"wide"`` (16 features: Dense 1024 without bias,
    BatchNorm, tanh, a dense head; its 16x1024 kernel is large enough for ``shard=``).
    """
    if front_end == "keras":
        keras.utils.set_random_seed(seed)
        layers = keras.layers
        body = {"cnn": [keras.Input((8, 8, 1)), layers.Conv2D(8, 3, padding="same", use_bias=False),
                        layers.BatchNormalization(), layers.Activation("gelu"), layers.AveragePooling2D(2),
                        layers.Flatten(), layers.Dropout(0.2)],
                "mlp": [keras.Input((64,)), layers.Dense(16, activation="tanh")],
                "wide": [keras.Input((16,)), layers.Dense(1024, use_bias=False), layers.BatchNormalization(),
                         layers.Activation("tanh")]}[kind]
        model = keras.Sequential([*body, layers.Dense(classes)])
        opt = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}[optimizer](learning_rate)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model, {}
    import optax
    from flax import nnx

    rngs = nnx.Rngs(seed)
    if kind == "cnn":
        class Net(nnx.Module):
            def __init__(self):
                self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
                self.bn = nnx.BatchNorm(8, rngs=rngs)
                self.drop = nnx.Dropout(0.2, rngs=rngs)
                self.head = nnx.Linear(8 * 4 * 4, classes, rngs=rngs)

            def __call__(self, x):
                x = nnx.avg_pool(nnx.gelu(self.bn(self.conv(x))), window_shape=(2, 2), strides=(2, 2))
                return self.head(self.drop(x.reshape(x.shape[0], -1)))
    elif kind == "mlp":
        class Net(nnx.Module):  # type: ignore[no-redef]
            def __init__(self):
                self.hidden = nnx.Linear(64, 16, rngs=rngs)
                self.head = nnx.Linear(16, classes, rngs=rngs)

            def __call__(self, x):
                return self.head(nnx.tanh(self.hidden(x)))
    else:
        class Net(nnx.Module):  # type: ignore[no-redef]
            def __init__(self):
                self.hidden = nnx.Linear(16, 1024, use_bias=False, rngs=rngs)
                self.bn = nnx.BatchNorm(1024, rngs=rngs)
                self.head = nnx.Linear(1024, classes, rngs=rngs)

            def __call__(self, x):
                return self.head(nnx.tanh(self.bn(self.hidden(x))))
    opt = {"adam": optax.adam, "sgd": optax.sgd}[optimizer](learning_rate)
    return Net(), {"loss": "sparse_categorical_crossentropy_from_logits", "optimizer": opt, "metrics": ["accuracy"]}


def front_end_trainer(front_end: str, n_or_strategy, kind: str = "cnn", **kwargs):
    """``(model, trainer)``: :func:`front_end_model`'s model in an ``mx.Trainer`` on ``n`` devices (or a
    strategy); ``kwargs``: the model's (``seed``, ``optimizer``, ...) and the Trainer's (the rest)."""
    model_keys = {"seed", "optimizer", "learning_rate", "classes"}
    model, trainer_kwargs = front_end_model(front_end, kind, **{k: v for k, v in kwargs.items() if k in model_keys})
    s = strategy(n_or_strategy) if isinstance(n_or_strategy, int) else n_or_strategy
    trainer_kwargs.update({k: v for k, v in kwargs.items() if k not in model_keys})
    return model, mx.Trainer(model, s, **trainer_kwargs)


def trained_state(trainer: mx.Trainer) -> list[np.ndarray]:
    """The trainer's parameters, model state (BatchNorm statistics, Dropout's stream) and optimizer state,
    host copies in a fixed order: what a front-end-independent comparison reads."""
    state = trainer.host_state()
    return [np.asarray(a) for group in ("params", "model_state", "optimizer") for a in jax.tree.leaves(state[group])]


def held_bytes(trainer: mx.Trainer, group: str, device=None) -> int:
    """Bytes of ``trainer.state[group]`` that ``device`` (the first device) holds: what ``mx.plan`` plans for
    that group per device."""
    device = device or jax.devices()[0]
    return sum(sh.data.nbytes for a in jax.tree.leaves(trainer.state[group]) for sh in a.addressable_shards
               if sh.device == device)


class Compiles:
    """Counts the programs XLA builds while active: JAX's backend compiles, and the loads from its
    persistent compilation cache that stand in for one (tests/conftest.py turns the cache on; JAX reports
    a load as a backend compile too). ``names``: the compiled functions' names, in order."""

    def __init__(self):
        self.names = []

    @property
    def count(self):
        return len(self.names)

    def _listen_duration(self, event, duration, **kwargs):
        if event.endswith("backend_compile_duration"):
            self.names.append(kwargs.get("fun_name"))

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen_duration)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen_duration)


def flip_bit_after(path, text: bytes, at: int = 0) -> None:
    """Flips the lowest bit of the byte ``at`` after the first ``text`` in the file ``path``: one bit of one field
    of a record (``b'"batch_in_epoch":'`` -> its first digit)."""
    raw = bytearray(open(path, "rb").read())
    where = raw.index(text) + len(text) + at
    raw[where] ^= 0x01
    open(path, "wb").write(bytes(raw))


def rewrite_snapshot_index(directory, change) -> None:
    """A crafted snapshot index in ``directory`` (a snapshot's ``<step>/``): ``change(index)`` applied and its digest
    written anew, so that only the index's own checks can refuse it."""
    import hashlib
    import json
    import os

    path = os.path.join(directory, "index.json")
    with open(path) as f:
        index = json.load(f)
    change(index)
    text = json.dumps(index).encode()
    with open(path, "wb") as f:
        f.write(text)
    with open(os.path.join(directory, "digest.json")) as f:
        digests = json.load(f)
    digests["index.json"] = hashlib.sha256(text).hexdigest()
    with open(os.path.join(directory, "digest.json"), "w") as f:
        f.write(json.dumps(digests))
