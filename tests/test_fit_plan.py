"""``fit``'s preparation and its epoch runner (``mirrorax.fit.fit_plan``, ``Loop.fit`` / ``Loop.epoch``): fit's
arguments read once into one frozen record, a refused argument leaving no SIGTERM handler behind, and the
runner starting where the record says. A linear ``FunctionalModel`` on 2 devices: cheap to compile."""

import dataclasses
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import strategy

import mirrorax as mx
from mirrorax.fit import fit_plan
from mirrorax.keras import order as keras_order

ROWS, FEATURES, CLASSES = 40, 4, 3


def _trainer() -> mx.Trainer:
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(0, 0.1, (FEATURES, CLASSES)).astype(np.float32), "b": np.zeros(CLASSES, np.float32)}

    def per_example(yt, logits):
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), yt[:, None], 1)[:, 0]

    model = mx.FunctionalModel(lambda p, xb: xb @ p["w"] + p["b"], params, loss=per_example,
                               optimizer=optax.sgd(0.1))
    return mx.Trainer(model, strategy(2))


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)


def _prepare(trainer: mx.Trainer, x, y, **given) -> fit_plan.FitPlan:
    args = fit_plan.FitArgs(x, y, **{"shuffle": False, "verbose": 0, **given})
    return fit_plan.prepare(trainer.device_state, trainer.steps, trainer.model, args, out=trainer.stream,
                            steps_per_execution=1, refuse_nonfinite=True, reading=mx.FitReading())


def test_prepare_reads_fit_once_into_a_frozen_record():
    trainer, (x, y) = _trainer(), _data()
    plan = _prepare(trainer, x, y, epochs=3, initial_epoch=1, validation_data=(x[:8], y[:8]), validation_freq=[2])
    try:
        assert plan.batch_size == 32 and plan.validation_batch_size == 32  # arrays' default; validation's: fit's
        assert plan.stream.batches_per_pass == 2  # 40 rows in batches of 32: a full one and a short one
        assert plan.start == fit_plan.Start(1) and not plan.resumed and plan.first_epoch == 0
        assert [plan.validate(e) for e in range(3)] == [False, True, False]  # after the (1-based) 2nd epoch
        assert plan.saving.tiers == [] and plan.saving.checkpoint_dir is None and plan.inputs is None
        assert fit_plan.resume(plan, trainer.device_state) is plan  # no checkpoint_dir: nothing to resume
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.epochs = 5  # type: ignore[misc]
        moved = plan.starting_at(2)
        assert moved.start == fit_plan.Start(2) and plan.start == fit_plan.Start(1) and moved.hooks is plan.hooks
        # An order drawn per pass (Keras's) counts a fit's passes from its first epoch: the stream's epoch 0 is
        # the start's.
        drawn = mx.FitReading(order=keras_order.KERAS_ORDER)
        assert dataclasses.replace(moved, reading=drawn).first_epoch == 2
    finally:
        plan.watch.close()


@pytest.mark.parametrize("given, match", [
    (dict(epochs=-1), r"epochs must be an integer >= 0; received -1"),
    (dict(validation_freq=0), r"validation_freq must be an integer >= 1; received 0"),
], ids=["epochs", "validation_freq"])
def test_a_refused_argument_leaves_no_sigterm_handler_behind(given, match):
    trainer, (x, y) = _trainer(), _data()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match=match):
        _prepare(trainer, x, y, **given)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_epoch_runner_starts_where_the_plan_says():
    x, y = _data()
    trainer = _trainer()
    plan = _prepare(trainer, x, y, batch_size=8, epochs=3, steps_per_epoch=2).starting_at(2)
    try:
        logs = trainer.loop.fit(plan)
    finally:
        plan.watch.close()
    assert plan.history.epoch == [2] and set(logs) == {"loss"}
    assert int(trainer.host_state().step) == 2  # one epoch of two steps, not three epochs
    # The same epoch as fit(initial_epoch=2) runs: the stream's batches 4 and 5 (a pass's last, the next's first).
    other = _trainer()
    history = other.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=2, initial_epoch=2, shuffle=False, verbose=0)
    assert history.history["loss"] == plan.history.history["loss"]
    for a, b in zip(jax.tree.leaves(trainer.host_state().params), jax.tree.leaves(other.host_state().params)):
        np.testing.assert_array_equal(a, b)


def test_evaluate_and_predict_read_their_arguments_into_one_pass():
    trainer, (x, y) = _trainer(), _data()
    adapter, model = trainer.adapter, trainer.model
    one = fit_plan.prepare_pass(adapter, model, 1, "evaluate", x, y, batch_size=None, steps=None, callbacks=None,
                                refuse_nonfinite=True)
    assert one.batch_size == 32 and one.steps is None and one.hooks is None  # arrays' default batch
    assert one.source.sample(8, trainer.strategy.batch_mesh).y is not None
    # predict takes the inputs of an (x, y) tuple, and NaN inputs (they spoil only their own rows).
    bad = x.copy()
    bad[0, 0] = np.nan
    one = fit_plan.prepare_pass(adapter, model, 1, "predict", (bad, y), batch_size=16, steps=2, callbacks=[],
                                refuse_nonfinite=True)
    assert one.batch_size == 16 and one.steps == 2 and one.hooks is not None
    first = jax.tree.leaves(one.source.sample(8, trainer.strategy.batch_mesh, with_targets=False).x)[0]
    assert np.isnan(np.asarray(first)[0, 0])
    with pytest.raises(ValueError, match="NaN"):  # evaluate refuses them (on_nonfinite="raise")
        fit_plan.prepare_pass(adapter, model, 1, "evaluate", bad, y, batch_size=None, steps=None, callbacks=None,
                              refuse_nonfinite=True)
    with pytest.raises(ValueError, match=r"steps must be an integer >= 1; received 0"):
        fit_plan.prepare_pass(adapter, model, 1, "predict", x, batch_size=None, steps=0, callbacks=None,
                              refuse_nonfinite=True)


def test_one_batch_is_prepared_whole_and_a_source_is_taken_as_it_is():
    trainer, (x, y) = _trainer(), _data()
    adapter, model = trainer.adapter, trainer.model
    one = fit_plan.prepare_pass(adapter, model, 1, "train", x[:13], y[:13], batch_size="all", refuse_nonfinite=True)
    assert one.batch_size == 13 and one.steps is None and one.hooks is None  # the whole input, one batch
    again = fit_plan.prepare_pass(adapter, model, 1, "train", one.source, batch_size="all", refuse_nonfinite=True)
    assert again.source is one.source  # made by a caller that read x itself: not read again
    with pytest.raises(ValueError, match=r"train_on_batch needs targets.*train_on_batch\(x, y\)"):
        fit_plan.prepare_pass(adapter, model, 1, "train", x[:13], batch_size="all", refuse_nonfinite=True)
    with pytest.raises(TypeError, match="One batch must be arrays.*received x of type list_iterator"):
        fit_plan.prepare_pass(adapter, model, 1, "evaluate", iter([(x, y)]), batch_size="all", refuse_nonfinite=True)


def test_train_on_batch_runs_on_fits_runner_and_raises_a_non_finite_loss_as_fit_does():
    """train_on_batch's step is fit's, dispatched and finished as fit's: a label this loss cannot take (its
    per-example loss is NaN) raises with the update not applied, the values stay as they were, and the same
    trainer trains on; a good batch's update is one SGD step on its mean loss."""
    trainer, (x, y) = _trainer(), _data()
    trainer.train_on_batch(x[:13], y[:13])
    before = trainer.host_state()
    bad = y[:13].copy()
    bad[5] = CLASSES + 4  # take_along_axis out of range: a NaN loss (this loss names no classes to check)
    with pytest.raises(mx.NonFiniteLossError, match=r"step 2 \(the batch of this train_on_batch call\).*not applied"):
        trainer.train_on_batch(x[:13], bad)
    after = trainer.host_state()
    assert int(after.step) == int(before.step)
    jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
    logs = trainer.train_on_batch(x[13:26], y[13:26])  # trains on
    assert int(trainer.host_state().step) == int(before.step) + 1
    w, b = before.params["w"], before.params["b"]

    def loss(p):
        logits = x[13:26] @ p["w"] + p["b"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[13:26, None], 1))

    grads = jax.grad(loss)({"w": w, "b": b})
    np.testing.assert_allclose(trainer.host_state().params["w"], w - 0.1 * grads["w"], rtol=1e-5, atol=1e-7)
    assert logs["loss"] == pytest.approx(float(loss({"w": w, "b": b})), rel=1e-5)


def test_a_fits_saving_is_one_object_with_one_hook_for_both_tiers(tmp_path, monkeypatch):
    """Issue 56: what a fit saves is one field of its record (it was three: the checkpointer, a saver, the
    snapshots), and the loop has one saving hook for both tiers (it had four), which saves each tier on its
    policy: here a checkpoint every 3 steps and at each epoch's end, a snapshot every 2 steps and at the end."""
    from mirrorax.checkpoint import snapshot
    from mirrorax.fit import elastic, epoch, saving
    from mirrorax.fit.loop import Loop

    fields = {f.name for f in dataclasses.fields(fit_plan.FitPlan)}
    assert "saving" in fields and not fields & {"ckpt", "saver", "snapshots", "run"}
    monkeypatch.setenv(snapshot.DIR_ENV, str(tmp_path / "snapshots"))
    monkeypatch.setenv(snapshot.STEPS_ENV, "2")
    monkeypatch.setattr(elastic, "_fits", __import__("itertools").count(1))
    seen, saved = [], []
    run = Loop.run

    def spy(self, run_, batches, dispatch, hooks, **kwargs):
        seen.append([type(h).__name__ for h in hooks])
        return run(self, run_, batches, dispatch, hooks, **kwargs)

    tier_save = saving.Tier.save

    def record(self, point, state, meta, window):
        saved.append((self.kind, point.step, meta["epoch"], meta["batch_in_epoch"]))
        tier_save(self, point, state, meta, window)

    monkeypatch.setattr(Loop, "run", spy)
    monkeypatch.setattr(saving.Tier, "save", record)
    trainer, (x, y) = _trainer(), _data()
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, checkpoint_dir=tmp_path / "ckpt",
                checkpoint_every=3)  # 5 steps an epoch
    assert seen == [["EpochMeter", "SavingHook", "BatchCallbacks", "HaltWatch", "ProgressHook"]] * 2  # (the meter: 58)
    assert not [n for n in dir(epoch) if n in ("PreemptionStop", "PeriodicSave")]
    assert saved == [("snapshot", 2, 0, 2), ("checkpoint", 3, 0, 3), ("snapshot", 4, 0, 4),
                     ("checkpoint", 5, 1, 0),  # the epoch end (no multiple of 2 passed: no snapshot)
                     ("checkpoint", 6, 1, 1), ("snapshot", 6, 1, 1), ("snapshot", 8, 1, 3), ("checkpoint", 9, 1, 4),
                     ("checkpoint", 10, 2, 0), ("snapshot", 10, 2, 0)]  # the end (the fit end adds none: saved)
