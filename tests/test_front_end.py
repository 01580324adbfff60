"""A front-end (``mirrorax.front_end.FrontEnd``) as a third party writes one, trained through ``mx.Trainer``.

Keras 3 and Flax NNX are the engine's two front-ends; here a toy third one, ``Line`` (``y = x @ w + b``, a plain
object: neither Keras, nor Flax, nor a ``FunctionalModel``), registered from the test without touching the
engine: its own adapter (which writes the trained values back into the ``Line``), its own callbacks driver
(its callbacks have ``step`` / ``epoch`` methods, not Keras's ``on_*``), its own pass order (each pass over
the rows backwards), its own ``initial_epoch`` (a callback moves the start at ``on_train_begin``) and its own
reading of ``steps_per_epoch`` (an upper bound). Its numbers are a plain JAX loop's over the same batches.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import strategy

import mirrorax as mx
from mirrorax import front_end
from mirrorax.fit.hooks import BATCH_HOOKS
from mirrorax.steps import padding

pytestmark = pytest.mark.multi_device

LR, ROWS, BATCH, FEATURES = 0.05, 8, 4, 3


class Line:
    """The toy's model: ``y = x @ w + b`` trained by SGD on the squared error."""

    def __init__(self, w, b) -> None:
        self.w, self.b = np.asarray(w, np.float32), np.float32(b)
        self.resume_at: int | None = None  # set by a callback at on_train_begin (the toy's BackupAndRestore)


class LineModel(mx.FunctionalModel):
    """The toy's adapter's model: its parameters are the ``Line``'s own ``w`` and ``b`` (written back there)."""

    def __init__(self, line: Line) -> None:
        self.line = line
        super().__init__(lambda p, x: x @ p["w"] + p["b"], {"w": line.w, "b": line.b}, loss="mse",
                         optimizer=optax.sgd(LR))

    @property
    def params(self):
        return {"w": self.line.w, "b": self.line.b}

    @params.setter
    def params(self, values) -> None:
        self.line.w, self.line.b = np.asarray(values["w"]), np.asarray(values["b"])


class LineCallbacks:
    """The toy's callbacks driver: its callbacks have ``step(index)`` and ``epoch(index, loss)``."""

    calls: list[str] = []  # every hook the engine called through a driver of this kind

    def __init__(self, callbacks, model, *, add_history=False, add_progbar=False, **params) -> None:
        self.callback_list, self.model = list(callbacks or []), model
        self.listens = {kind: kind == "train_end" for kind in BATCH_HOOKS}  # its callbacks act per step

    def restore_history(self, history) -> None:
        pass

    def call(self, method, *args) -> None:
        LineCallbacks.calls.append(method)
        for cb in self.callback_list:
            if method == "on_train_begin" and hasattr(cb, "begin"):
                cb.begin(self.model)
            elif method == "on_train_batch_end":
                cb.step(args[0])
            elif method == "on_epoch_end":
                cb.epoch(args[0], args[1]["loss"])


class Backwards:
    """The toy's pass order: each pass over the rows backwards, drawn when the pass starts."""

    def __init__(self) -> None:
        self.draws = 0

    def draw(self, shuffle, num_examples, batch_size):
        self.draws += 1
        return np.arange(num_examples)[::-1].copy()

    def state(self):
        return {"draws": self.draws}

    def restore(self, state) -> None:
        self.draws = state["draws"]


class Masked:
    """The toy's metric masking: records, per trace that opens it, the mask its metrics would be given."""

    def __init__(self) -> None:
        self.open = False
        self.seen: list[tuple[bool, int | None]] = []  # (open, the mask's rows) per update

    @contextlib.contextmanager
    def __call__(self):
        self.open = True
        try:
            yield
        finally:
            self.open = False

    def update(self) -> None:  # what a metric of the toy's does in a step
        mask = padding.current_mask()
        self.seen.append((self.open, None if mask is None else int(mask.shape[0])))


@pytest.fixture
def line_front_end(monkeypatch):
    monkeypatch.setattr(front_end, "_FRONT_ENDS", list(front_end.front_ends()))  # (restored after the test)
    monkeypatch.setattr(LineCallbacks, "calls", [])
    order = Backwards()
    masked = Masked()
    record = front_end.FrontEnd(
        name="line", claims=lambda m: isinstance(m, Line),
        adapter=lambda m, *, loss, optimizer, metrics, mixed_precision: LineModel(m).adapter(),
        callbacks=LineCallbacks, metric_masking=masked, initial_epoch=lambda m: m.resume_at,
        reading=mx.FitReading(ends_with_data=True, order=order))
    front_end.register(record)
    return record, order, masked


class Recorder:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.epochs: list[tuple[int, float]] = []

    def begin(self, line: Line) -> None:
        line.resume_at = 1  # as BackupAndRestore: the fit starts at epoch 1

    def step(self, index: int) -> None:
        self.steps.append(index)

    def epoch(self, index: int, loss: float) -> None:
        self.epochs.append((index, loss))


def _plain(w, b, x, y, epochs: int, order):
    """SGD on the squared error over the batches of ``order`` (one pass per epoch), in plain JAX: the weights
    and each epoch's mean loss (over its examples, each at the weights its step saw)."""
    params = {"w": jnp.asarray(w), "b": jnp.asarray(b)}

    def loss(p, xb, yb):
        return (xb @ p["w"] + p["b"] - yb) ** 2

    grad = jax.grad(lambda p, xb, yb: loss(p, xb, yb).mean())

    means = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, ROWS, BATCH):
            rows = order[start:start + BATCH]
            per_row, grads = loss(params, x[rows], y[rows]), grad(params, x[rows], y[rows])
            total += float(per_row.sum())
            params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        means.append(total / ROWS)
    return np.asarray(params["w"]), float(params["b"]), means


def test_a_third_front_end_trains_through_the_trainer_with_its_own_parts(line_front_end):
    record, order, _ = line_front_end
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 2.0], np.float32) + 0.25).astype(np.float32)
    w0, b0 = rng.normal(size=FEATURES).astype(np.float32) * 0.1, 0.0
    line, recorder = Line(w0, b0), Recorder()

    trainer = mx.Trainer(line, strategy(2))
    assert trainer.reading is record.reading  # the front-end's own reading of fit's data
    with pytest.warns(UserWarning, match="Your input ran out of data"):  # steps_per_epoch an upper bound
        history = trainer.fit(x, y, batch_size=BATCH, epochs=3, steps_per_epoch=3, shuffle=True, verbose=0,
                              callbacks=[recorder])

    # The start moved by the toy's initial_epoch: epochs 1 and 2 ran, each a backward pass of 2 batches
    # (the reading ends an epoch where the data does, before steps_per_epoch=3).
    assert history.epoch == [1, 2] and [e for e, _ in recorder.epochs] == [1, 2]
    assert order.draws == 2 and recorder.steps == [0, 1, 0, 1]
    assert LineCallbacks.calls[0] == "on_train_begin" and LineCallbacks.calls[-1] == "on_train_end"
    w, b, means = _plain(w0, b0, x, y, epochs=2, order=np.arange(ROWS)[::-1])
    np.testing.assert_allclose(line.w, w, rtol=1e-5, atol=1e-6)  # written back into the Line by its adapter
    np.testing.assert_allclose(line.b, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], means, rtol=1e-5)
    np.testing.assert_allclose([loss for _, loss in recorder.epochs], means, rtol=1e-5)
    assert means[1] < means[0]

    # mirrorax's own reading, given to the Trainer, wins over the front-end's: (seed, pass)'s order, no draw.
    line2 = Line(w0, b0)
    mx.Trainer(line2, strategy(2), reading=mx.FitReading()).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                                                verbose=0)
    assert order.draws == 2
    w1, b1, _ = _plain(w0, b0, x, y, epochs=1, order=np.arange(ROWS))
    np.testing.assert_allclose(line2.w, w1, rtol=1e-5, atol=1e-6)


def test_a_front_ends_metric_masking_is_open_while_a_padded_step_traces(line_front_end):
    _, _, masked = line_front_end
    s = strategy(4)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)

    def step(batch):
        (xb,) = batch
        masked.update()
        return mx.compute_average_loss(xb.sum(1), batch)

    batches = list(s.experimental_distribute_dataset((x,), batch_size=6))  # 6 rows on 4 replicas: 8, 2 padding
    assert len(batches) == 1 and batches[0].padded
    total = float(s.reduce("sum", s.run(step, args=(batches[0],)), axis=None))
    assert total == pytest.approx(x.sum() / 6)
    # Per replica the step saw the padding: the toy's context was open, its metrics given each replica's mask.
    # (traced more than once: the discovery trace, the program's)
    assert masked.seen and set(masked.seen) == {(True, 2)} and not masked.open
    masked.seen.clear()
    s.jit(step)(batches[0])  # the global view: cut to the real rows, no padding, nothing to mask
    assert masked.seen and all(rows is None for _, rows in masked.seen)
