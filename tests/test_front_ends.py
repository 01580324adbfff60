"""The engine under both front-ends: the same small smooth model built with Keras and with Flax NNX
(``helpers.front_end_model``), trained by ``mx.Trainer``, each against its own 1-device run.

What is the engine's and not Keras's (Keras's own numbers are ``test_equivalence.py``'s and
``test_keras_fit.py``'s): N devices == 1 device on uneven data (a CNN with BatchNorm and Dropout, 50 rows in
global batches of 16: the last holds 2, and 3 devices divide none of them), ``shard="optimizer" | "all"``,
a checkpointed fit resumed on another device count, gradient accumulation, ``on_nonfinite`` and ``mx.plan``.
Preemption is ``test_preemption.py``'s, parametrised there over the same front-ends.

Compared: the trainer's parameters, model state (BatchNorm's statistics, Dropout's stream) and optimizer
state (``helpers.trained_state``) at atol 1e-5; history and evaluate at rtol 1e-5. Measured (2026-12-05):
state <= 1.2e-7 (Keras 7.5e-8 .. 1.2e-7, NNX 6e-8 .. 1.2e-7 at 2/3/4/8 devices; shard modes 1.4e-7 / 1.2e-7),
history and evaluate <= 1.7e-7 relative (Keras; NNX equal); accumulation 6e-8 / 3e-8, the resume
7.5e-8 / 6e-8 (Keras / NNX).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    FRONT_ENDS,
    front_end_model,
    front_end_trainer,
    held_bytes,
    learnable,
    strategy,
    trained_state,
)
from jax.sharding import PartitionSpec as P

import mirrorax as mx

pytestmark = pytest.mark.multi_device

ATOL, RTOL = 1e-5, 1e-5
FIT = dict(batch_size=16, epochs=2, shuffle=True, seed=3, verbose=0)


def _fit(front_end: str, n, kind: str = "cnn", **kwargs):
    x, y = learnable(flat=kind == "mlp")
    model, trainer = front_end_trainer(front_end, n, kind, **kwargs)
    history = trainer.fit(x, y, **FIT).history
    return {"state": trained_state(trainer), "history": history,
            "evaluate": trainer.evaluate(x, y, batch_size=16), "trainer": trainer}


def assert_same(got: dict, want: dict, atol: float = ATOL) -> None:
    assert len(got["state"]) == len(want["state"])
    for i, (a, b) in enumerate(zip(want["state"], got["state"])):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol, err_msg=f"state leaf {i}")
    for key in want["history"]:
        np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=RTOL, err_msg=key)
    for key in want["evaluate"]:
        np.testing.assert_allclose(got["evaluate"][key], want["evaluate"][key], rtol=RTOL, err_msg=key)


@pytest.fixture(scope="module")
def one_device():
    runs: dict[str, dict] = {}

    def run(front_end: str) -> dict:
        if front_end not in runs:
            runs[front_end] = _fit(front_end, 1)
        return runs[front_end]

    return run


# -- N devices == 1 device ------------------------------------------------------------------------------
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("n", [3, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow)])
def test_n_devices_equal_one(one_device, front_end, n):
    """BatchNorm's statistics over the real rows of the global batch, Dropout's masks one device's, the short
    last batch (2 rows: some replicas hold none) counted on its real rows."""
    assert_same(_fit(front_end, n), one_device(front_end))


@pytest.mark.slow  # two fits per front-end and mode
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("shard", ["optimizer", "all"])
def test_shard_modes_equal_one_device(front_end, shard):
    """``shard=`` splits the 16x1024 kernel's Adam moments (and, with ``"all"``, the kernel) over 4 devices;
    the numbers are one device's."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 16)).astype(np.float32), rng.integers(0, 5, 40)

    def fit(s):
        _, trainer = front_end_trainer(front_end, s, "wide", learning_rate=1e-3)
        history = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        return {"state": trained_state(trainer), "history": history, "evaluate": {}, "trainer": trainer}

    one = fit(strategy(1))
    many = fit(mx.MirroredStrategy(jax.devices()[:4], shard=shard))
    big = [a for a in jax.tree.leaves(many["trainer"].state) if a.shape == (16, 1024)]
    specs = [a.sharding.spec for a in big]
    assert len(big) == 3 and specs.count(P(None, "batch")) == (3 if shard == "all" else 2), specs
    assert_same(many, one)


# -- checkpoints and resume -----------------------------------------------------------------------------
@pytest.mark.slow  # three fits and a checkpoint
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_fit_resumed_on_another_device_count_is_the_uninterrupted_one(tmp_path, one_device, front_end):
    """One epoch on 2 devices with a checkpoint, then the same 2-epoch fit on 3 devices from a model with other
    initial weights: it resumes and ends with the uninterrupted run's state, history and evaluation."""
    x, y = learnable()
    _, first = front_end_trainer(front_end, 2)
    first.fit(x, y, **dict(FIT, epochs=1), checkpoint_dir=tmp_path / "ck")
    _, again = front_end_trainer(front_end, 3, seed=7)
    history = again.fit(x, y, **FIT, checkpoint_dir=tmp_path / "ck").history
    got = {"state": trained_state(again), "history": history, "evaluate": again.evaluate(x, y, batch_size=16)}
    assert_same(got, one_device(front_end))


# -- accumulation, non-finite steps, the plan --------------------------------------------------------------
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_gradient_accumulation_equals_the_whole_batch(front_end):
    """``accumulation_steps=4`` on 4 devices: the whole batch's update (SGD on the tanh MLP; the short last
    batch's 2 real rows fall into the first micro-batch)."""
    x, y = learnable(flat=True)

    def fit(k):
        _, trainer = front_end_trainer(front_end, 4, "mlp", optimizer="sgd", learning_rate=0.1,
                                       accumulation_steps=k)
        history = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        return {"state": trained_state(trainer), "history": history, "evaluate": {}}

    whole, accumulated = fit(1), fit(4)
    assert_same(accumulated, whole, atol=1e-6)
    assert whole["history"]["loss"][1] < whole["history"]["loss"][0]  # it learns


def _poisoned():
    x, y = learnable(96, flat=True)
    x[40] = np.nan  # in batch 2 (rows 32-63)
    return x, y


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_nonfinite_step_raises_and_keeps_the_last_good_state(front_end):
    x, y = _poisoned()
    _, t = front_end_trainer(front_end, 2, "mlp")
    _, ref = front_end_trainer(front_end, 2, "mlp")
    for trainer in (t, ref):
        trainer.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    with pytest.raises(mx.NonFiniteLossError, match=r"non-finite at step 3 \(epoch 1, batch 2"):
        # batches from an iterable (NaN in arrays is refused on the host before training)
        t.fit(((x[i:i + 32], y[i:i + 32]) for i in range(0, 96, 32)), batch_size=32, epochs=1, verbose=0)
    ref.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)  # what t applied: its first batch
    for a, b in zip(trained_state(ref), trained_state(t)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    assert all(np.isfinite(a).all() for a in trained_state(t))
    # The same trainer trains on from there (the frozen record does not outlive the error), and its step
    # counter counts applied steps only.
    assert int(np.asarray(t.host_state()["step"])) == 2
    for trainer in (t, ref):
        trainer.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    for a, b in zip(trained_state(ref), trained_state(t)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    assert int(np.asarray(t.host_state()["step"])) == 3


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_nonfinite_steps_skipped_are_counted(front_end):
    x, y = _poisoned()
    _, t = front_end_trainer(front_end, 2, "mlp", on_nonfinite="skip")
    history = t.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    assert history["skipped_steps"] == [1.0, 2.0]
    assert np.isfinite(history["loss"]).all() and all(np.isfinite(a).all() for a in trained_state(t))


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_plan_state_bytes_equal_what_fit_holds(front_end):
    """``mx.plan`` on the trainer (an NNX module carries no loss: its Trainer does), sharded over 4 devices:
    the bytes per device it plans are those fit places. For the NNX module also the search over modes, which
    builds each mode's step from the Trainer's loss and optimizer (Keras's search: ``test_plan.py``)."""
    x, y = learnable(flat=True)
    _, trainer = front_end_trainer(front_end, mx.MirroredStrategy(jax.devices()[:4], shard="all"), "mlp")
    search = front_end == "nnx"
    p = mx.plan(trainer, x, y, batch_size=16, device_memory="64MB" if search else None)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert (p.param_bytes, p.optimizer_bytes, p.model_state_bytes) == tuple(
        held_bytes(trainer, g) for g in ("params", "optimizer", "model_state"))
    assert p.flops > 0
    if search:
        assert set(p.largest_batch) == {None, "optimizer", "all"}
        assert all(b is not None and b >= 16 for b in p.largest_batch.values()), p.largest_batch
    with pytest.raises(ValueError, match=r"An NNX module carries no loss and no optimizer.*mx.plan\(trainer"):
        mx.plan(front_end_model("nnx", "mlp")[0], x, y, batch_size=16, strategy=strategy(1))
