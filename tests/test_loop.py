"""The loop's machinery: bounded steps in flight, progress output, several steps per dispatch, gradient
accumulation, non-finite losses, plain-JAX models."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_weights_close, cnn, dense, digits, flat_digits, strategy

import mirrorax as mx
from mirrorax.steps import dispatch
from mirrorax.steps.dispatch import InFlight

pytestmark = pytest.mark.multi_device


def test_in_flight_window_waits_for_the_previous_step(monkeypatch):
    waited = []
    monkeypatch.setattr(dispatch, "wait", lambda x: waited.append(x))
    window = InFlight(depth=2)
    for i in range(5):
        window.push(i)
        # after dispatching step i the host has waited for step i-1, never for step i
        assert waited == list(range(i))
    window.drain()
    assert waited == list(range(5))


def test_progress_modes():
    x, y, _, _ = flat_digits(96)
    t = mx.Trainer(dense(), strategy(4))
    for verbose, check in [
        (0, lambda out: out == ""),
        (2, lambda out: out.count("\n") == 2 and out.startswith("Epoch 1/2 - 3 steps") and "samples/s" in out
         and "accuracy:" in out and "\r" not in out),
        (1, lambda out: "Epoch 1/2\n" in out and "3/3 [" in out and "samples/s" in out and "loss:" in out),
    ]:
        t.stream = io.StringIO()
        t.fit(x, y, batch_size=32, epochs=2, verbose=verbose)
        out = t.stream.getvalue()
        if verbose:  # the plan's line comes first (tests/test_plan.py checks it)
            plan_line, _, out = out.partition("\n")
            assert plan_line.startswith("plan: 4 devices"), plan_line
        assert check(out), repr(out)


@pytest.mark.slow  # several fits, one per steps_per_execution
def test_steps_per_execution_gives_the_same_weights():
    x, y, xt, yt = digits(200)
    a = cnn()
    ta = mx.Trainer(a, strategy(4))
    ha = ta.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    b = cnn()
    tb = mx.Trainer(b, strategy(4), steps_per_execution=3)  # 7 batches an epoch: 3 + 3 + 1
    hb = tb.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(a, b, 1e-5, 1e-5)
    np.testing.assert_allclose(ha.history["loss"], hb.history["loss"], rtol=1e-5)
    assert hb.history["accuracy"] == pytest.approx(ha.history["accuracy"], abs=1e-7)
    assert tb.compile_counts()["train_many"] == 1 and tb.compile_counts()["train"] == 1


# Gradient accumulation and on_nonfinite: tests/test_front_ends.py, under both front-ends.


@pytest.mark.slow
def test_functional_model_matches_plain_jax():
    x, y, _, _ = flat_digits(120)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(0, 0.1, (64, 10)).astype(np.float32), "b": np.zeros(10, np.float32)}

    def apply(p, xb):
        return xb @ p["w"] + p["b"]

    def per_example(yt, logits):
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), yt[:, None], 1)[:, 0]

    opt = optax.adam(1e-2)
    model = mx.FunctionalModel(apply, params, loss=per_example, optimizer=opt, metrics=["accuracy"])
    t = mx.Trainer(model, strategy(8))
    hist = t.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0)

    p, s = params, opt.init(params)  # the same loop by hand, on one device
    for _ in range(2):
        for i in range(0, 120, 50):
            g = jax.grad(lambda q, i=i: per_example(y[i:i + 50], apply(q, x[i:i + 50])).mean())(p)
            u, s = opt.update(g, s, p)
            p = optax.apply_updates(p, u)
    for k in p:
        np.testing.assert_allclose(model.params[k], p[k], rtol=1e-5, atol=1e-6)
    probs = t.predict(x, batch_size=50)
    assert t.evaluate(x, y, batch_size=50)["accuracy"] == pytest.approx(np.mean(probs.argmax(-1) == y), abs=1e-7)
    assert len(hist.history["loss"]) == 2


@pytest.mark.slow  # three fits
def test_background_prefetch_gives_the_same_result_and_survives_errors():
    x, y, xt, yt = flat_digits(150)
    a = dense()
    mx.Trainer(a, strategy(4), prefetch=0).fit(x, y, batch_size=32, epochs=2, shuffle=True, verbose=0)
    b = dense()
    tb = mx.Trainer(b, strategy(4), prefetch=2)  # the background thread (the default on accelerators)
    tb.fit(x, y, batch_size=32, epochs=2, shuffle=True, verbose=0)
    assert_weights_close(a, b, 0, 0)  # the same program on the same batches: bitwise equal
    assert tb.evaluate(xt, yt, batch_size=64) == mx.Trainer(a, strategy(4), prefetch=0).evaluate(xt, yt, batch_size=64)

    def broken():
        yield x[:32], y[:32]
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):  # raised on the training thread, not lost
        tb.fit(broken(), batch_size=32, verbose=0)


@pytest.mark.slow  # test_progress_modes covers each mode's output
def test_auto_progress_is_a_bar_in_jupyter_and_a_line_per_epoch_elsewhere(monkeypatch):
    import sys
    import types

    from mirrorax.fit.progress import resolve_verbose

    x, y, _, _ = flat_digits(64)
    t = mx.Trainer(dense(), strategy(2))
    t.stream = io.StringIO()  # no tty, as a log file and as a notebook's stdout
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert resolve_verbose("auto", t.stream) == 2
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))  # running in a notebook
    assert resolve_verbose("auto", t.stream) == 1
    t.fit(x, y, batch_size=32, epochs=1, verbose="auto")
    out = t.stream.getvalue()
    if out.startswith("plan: "):  # (fit's plan line comes first with verbose)
        out = out.split("\n", 1)[1]
    assert out.startswith("Epoch 1/1\n") and "\r2/2 [" in out, repr(out)  # the bar, redrawn in place


@pytest.mark.parametrize("weighted", [False, True])
def test_a_batch_of_known_rows_passes_the_step_only_what_it_reads(weighted, monkeypatch):
    """A batch whose real rows the host knows is cut to them in the step, where its mask and count are
    constants: they are not passed (each argument of a compiled step costs host time at every call), nor
    are sample weights the user did not give. The losses stay Keras's own, the short last batch's too."""
    from mirrorax.inputs.batch import Batch

    x, y, _, _ = flat_digits(48)
    w = np.linspace(0.5, 1.5, len(x)).astype(np.float32) if weighted else None
    seen = []
    step_tree = Batch.step_tree
    monkeypatch.setattr(Batch, "step_tree", lambda self: seen.append(step_tree(self)) or seen[-1])
    trainer = mx.Trainer(dense(seed=4), strategy(2))
    ours = trainer.fit(x, y, sample_weight=w, batch_size=20, epochs=2, verbose=0, shuffle=False)
    assert {frozenset(t) for t in seen} == {frozenset({"x", "y", "rows", "sample_weight"} if weighted
                                                      else {"x", "y", "rows", "unweighted"})}
    assert sorted({t["rows"].count for t in seen}) == [8, 20]  # the short last batch too
    keras_model = dense(seed=4)
    theirs = keras_model.fit(x, y, sample_weight=w, batch_size=20, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(ours.history["loss"], theirs.history["loss"], rtol=2e-5)


@pytest.mark.parametrize("devices, prefetch, guard, host", [
    (1, 0, None, True), (2, 0, None, False), (1, 2, None, False), (1, 0, "log", False)],
    ids=["one-device", "two-devices", "prefetch", "transfer-guard"])
def test_one_device_steps_take_the_host_rows_and_jax_transfers_them(devices, prefetch, guard, host, monkeypatch):
    """On one device of one process fit's step is given each batch's rows as the host's numpy arrays, for JAX's
    dispatch to transfer them (as jax.jit does a numpy argument in Flax's loop): a Python transfer per leaf spared,
    a quarter of Trainer.fit's host time a step on the CPU proxy. Rows are placed where they are split, where a
    thread places them ahead (prefetch) or where a transfer guard would log (or refuse) the implicit transfer; the
    weights are the same bit for bit, the short last batch (200 rows in batches of 64) and evaluate's included."""
    import contextlib

    from mirrorax.inputs import prefetch as prefetch_lib

    x, y, _, _ = flat_digits(200)
    x = x.astype(np.float64)  # (float64 rows: given to the step as JAX's float32, as the program was made for)
    seen = []
    to_global = prefetch_lib.to_global

    def spy(batch, mesh, **kw):
        out = to_global(batch, mesh, **kw)
        seen.append(isinstance(out.x, np.ndarray))
        return out

    def fit(n, prefetch, guard):
        model = dense()
        trainer = mx.Trainer(model, strategy(n), prefetch=prefetch)
        scope = jax.transfer_guard_host_to_device(guard) if guard else contextlib.nullcontext()
        with scope:
            trainer.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
            logs = trainer.evaluate(x, y, batch_size=64, verbose=0)
        return model.get_weights(), logs

    reference = fit(1, 2, None)  # placed ahead on a thread: the rows on the device before each step
    monkeypatch.setattr(prefetch_lib, "to_global", spy)
    weights, logs = fit(devices, prefetch, guard)
    assert seen and set(seen) == {host}, seen
    assert len(seen) == 2 * 4 + 4  # two epochs and evaluate's pass, 4 batches each (the last of 8 rows)
    if devices == 1:
        for a, b in zip(weights, reference[0]):
            np.testing.assert_array_equal(a, b)
        assert logs == reference[1]
    else:  # (N devices == 1 device is test_equivalence's; here: the same fit, placed)
        for a, b in zip(weights, reference[0]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
