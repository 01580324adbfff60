"""Where a fit's time goes (``fit.utilisation``, ``fit.meter``) and ``steps_per_execution="auto"``
(``fit.auto_steps``): each epoch's figures, in the progress line and in ``mx.utilisation``; the input-bound
warning; the steps per dispatch "auto" picks, and that its numbers are those of one step per dispatch.

No assertion here rests on a timing: "auto"'s choice is a pure function of measured costs, tested on costs
given; the integration tests force its choice and check the numbers and the batch hooks; the input-bound
tests take a source 5 ms a batch slow against a step of ~0.1-2 ms, and arrays whose batch is read in
microseconds.
"""

import io
import re
import time
import types
import warnings

import jax
import keras
import numpy as np
import pytest
from helpers import assert_weights_close, strategy

import mirrorax as mx

# (The modules under test are imported in each test: on the code before them each test fails on its own.)

pytestmark = pytest.mark.multi_device


def _data(rows: int = 8 * 61 + 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32)


def _tiny(seed: int = 3, **compile_kwargs) -> keras.Model:
    """A step of almost no device work (Dropout: its random stream must run on as one step per dispatch's)."""
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dropout(0.2),
                          keras.layers.Dense(2, activation="softmax")])
    m.compile(**{"optimizer": "adam", "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"],
                 **compile_kwargs})
    return m


def _bare_fit_meter(auto: bool):
    """A fit's meter on one CPU device with no model behind it: its measurements fed by hand."""
    from mirrorax.fit.meter import FitMeter

    device = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    strategy_ = types.SimpleNamespace(devices=[device], is_primary=True, process_count=1)
    return FitMeter(type("Model", (), {})(), strategy_, None, steps_per_execution=1, auto=auto, prefetch=0,
                    source=None, epochs=1)


# -- "auto": the choice, a pure function of measured costs --------------------------------------------------

def test_auto_fuses_where_the_host_is_the_limit_and_not_where_the_devices_are():
    from mirrorax.fit.auto_steps import MAX_STEPS, Costs, choose_steps, keeps_paying

    # Costs of the order measured on this CPU with 4 simulated devices: a trivial step costs the host ~400 us a
    # dispatch and the devices ~35 us; a large one (a wide MLP at a large batch) the devices ~80 ms.
    trivial = Costs(call=400e-6, read=10e-6, device=35e-6)
    assert choose_steps(trivial) == 16  # 25 + 10 us of host a step: within 10% of the device's 35 (k=8: 60 us)
    assert trivial.step_time(16) <= 1.1 * trivial.step_time(MAX_STEPS) < trivial.step_time(8)
    assert choose_steps(Costs(call=400e-6, read=10e-6, device=80e-3)) == 1  # the devices are the limit
    assert choose_steps(Costs(call=400e-6, read=5e-3, device=35e-6)) == 1  # the input is: fusing gains 7%
    assert choose_steps(Costs(call=400e-6, read=10e-6, device=380e-6)) == 1  # 410 vs 380 us: under 10% to gain
    assert choose_steps(trivial, limit=4) == 4  # half an epoch, or the stacked batches' memory
    # A new program's compile must pay for itself within the fit.
    assert choose_steps(trivial, remaining_steps=1000, compile_seconds=1.0) == 1
    assert choose_steps(trivial, remaining_steps=100_000, compile_seconds=1.0) == 16
    assert keeps_paying(400e-6, 60e-6) and not keeps_paying(400e-6, 390e-6)


def test_measured_again_at_k_the_devices_per_dispatch_time_is_told_apart_and_a_larger_k_taken():
    from mirrorax.fit.auto_steps import Costs, choose_steps, refine

    # At k=1 a step took the devices 40 us; at k=8, 10 us a step: 34 of the 40 were the dispatch's (a launch, its
    # completion), which fusing pays once per k too. The first choice (k=8 within 10% of the best the one-point
    # costs said) was short of what the parted costs reach.
    one = Costs(call=300e-6, read=5e-6, device=40e-6)
    assert choose_steps(one) == 8
    parted = refine(one, 8, call=330e-6, device=10e-6)
    assert parted.device == pytest.approx(40e-6 / 7) and parted.device_call == pytest.approx(40e-6 - 40e-6 / 7)
    assert parted.step_time(8) == pytest.approx(max(330e-6 / 8 + 5e-6, 10e-6))  # the line goes through both
    assert choose_steps(parted, current=8) == 128
    assert choose_steps(parted, current=128) == 128  # nothing beats the current k: it stays
    assert choose_steps(Costs(call=300e-6, read=5e-6, device=50e-3), current=8) == 8


def test_auto_changes_k_only_past_every_batch_the_grouping_may_have_read():
    from mirrorax.fit.auto_steps import AutoSteps

    a = AutoSteps(lead_groups=2)  # a prefetch thread 0 ahead: the loop's next group, and one more
    assert [a.group(i) for i in (0, 17, 1000)] == [1, 1, 1]
    a.switch(8, dispatched=20)  # 20 batches dispatched at k=1: the grouping has read at most 2 groups more
    assert (a.group(22), a.group(23), a.group(500)) == (1, 8, 8)
    a.new_epoch()  # the next epoch groups by the newest decision from its first batch
    assert (a.group(0), a.switch_at) == (8, None)
    a.switch(1, dispatched=16)
    assert (a.group(39), a.group(40)) == (8, 1)  # 16 + 3 groups of 8


def test_a_group_size_by_batch_index_groups_the_same_batches_in_order():
    from mirrorax.inputs.batch import Batch
    from mirrorax.inputs.prefetch import device_batches

    mesh = strategy(2)

    def batch(i):
        return Batch(x=np.full((2, 1), i, np.float32), y=np.zeros(2, np.int32), sample_weight=np.ones(2, np.float32),
                     mask=np.ones(2, np.float32), rows=2)

    sizes = lambda index: 1 if index < 3 else 4  # noqa: E731
    got = list(device_batches(iter([batch(i) for i in range(13)]), sizes, mesh, prefetch=0, per_process=False))
    assert [k for k, _ in got] == [0, 0, 0, 4, 4, 0, 0]  # 0-2 one by one, 3-6 and 7-10 stacked, 11-12 short of 4
    seen = np.concatenate([np.asarray(b.x).reshape(-1, 2)[:, 0] for _, b in got])
    assert seen.tolist() == list(range(13))


class _Executions(keras.callbacks.Callback):
    """Each epoch's (begin, end) batch indices: the executions the batch hooks saw."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([])

    def on_train_batch_begin(self, batch, logs=None):
        self.epochs[-1].append([batch, None])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1][-1][1] = batch


def _force_auto(monkeypatch, k: int = 4):
    """"auto" decides ``k`` and keeps it, whatever this machine's timings are."""
    from mirrorax.fit import meter

    monkeypatch.setattr(meter, "choose_steps", lambda costs, **kwargs: k)
    monkeypatch.setattr(meter, "keeps_paying", lambda one, fused: True)


@pytest.mark.slow  # two fits of 62 batches, 2 epochs
def test_auto_trains_as_one_step_per_dispatch_and_calls_batch_hooks_per_execution(monkeypatch):
    _force_auto(monkeypatch)
    x, y = _data()  # 62 batches of 8 an epoch, the last one of 3 rows
    a, b = _tiny(), _tiny()
    ha = mx.Trainer(a, strategy(4)).fit(x, y, batch_size=8, epochs=2, verbose=0)
    executions = _Executions()
    tb = mx.Trainer(b, strategy(4), steps_per_execution="auto")
    hb = tb.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[executions])
    assert_weights_close(a, b, 1e-6, 0)  # the same batches, in the same order, the same updates
    for key in ha.history:
        np.testing.assert_allclose(hb.history[key], ha.history[key], rtol=1e-6, err_msg=key)
    assert [u.steps_per_execution for u in tb.utilisation] == [4, 4] and tb.compile_counts()["train_many"] == 1
    # As Keras's steps_per_execution=k gives them: an execution's begin at its first batch, its end at its last.
    for epoch in executions.epochs:
        assert [e[0] for e in epoch] == [0] + [e[1] + 1 for e in epoch[:-1]] and epoch[-1][1] == 61
        sizes = [end - begin + 1 for begin, end in epoch]
        assert set(sizes) == {1, 4} and sum(sizes) == 62
    assert executions.epochs[1][:15] == [[i, i + 3] for i in range(0, 60, 4)]  # epoch 2: fused from its start


@pytest.mark.slow  # four fits
def test_autos_choice_waits_for_fits_long_enough_and_holds_for_the_next_of_the_same_batch(monkeypatch):
    from mirrorax.fit import meter

    # Fusing pays for its compile only over 50 steps here: the trainer's first fit of 40 batches is too short
    # (the choice is put off), its second counts the first's steps too and fuses, its third fuses from its start.
    monkeypatch.setattr(meter, "choose_steps", lambda costs, remaining_steps=None, **kw:
                        4 if remaining_steps is None or remaining_steps >= 50 else 1)
    monkeypatch.setattr(meter, "keeps_paying", lambda one, fused: True)
    x, y = _data(8 * 40)
    t = mx.Trainer(_tiny(), strategy(2), steps_per_execution="auto")
    runs = []
    for batch in (8, 8, 8, 4):
        executions = _Executions()
        t.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[executions])
        runs.append([end - begin + 1 for begin, end in executions.epochs[0]])
    assert runs[0] == [1] * 40  # put off
    assert runs[1][:18] == [1] * 18 and 4 in runs[1]  # measured at one step a dispatch again, then fused
    assert runs[2] == [4] * 10  # the same costs: fused from the first batch
    assert runs[3][:18] == [1] * 18  # another global batch: measured afresh


def test_a_larger_k_put_off_for_its_compile_is_looked_at_again_in_the_next_fit(monkeypatch):
    from mirrorax.fit import meter

    # The first choice is k=4 whatever the steps to come; a larger k=8 pays for its compile only over 100 steps
    # to come. A trainer fits 80 batches at a time (a loop of short fits, as a notebook or a benchmark runs):
    # in the second fit k=4 is checked with 96 steps to come (put off, k=4 holds); the third fit checks it again
    # with 176 to come (the earlier fits' steps count) and takes 8, which the fourth runs from its start.
    def choose(costs, limit=128, remaining_steps=None, compile_seconds=0.0, current=1):
        if current == 1:
            return 4
        return 8 if remaining_steps is None or remaining_steps >= 100 else current

    monkeypatch.setattr(meter, "choose_steps", choose)
    monkeypatch.setattr(meter, "keeps_paying", lambda one, fused: True)
    x, y = _data(8 * 80)
    t = mx.Trainer(_tiny(), strategy(2), steps_per_execution="auto")
    runs, phases = [], []
    for _ in range(4):
        executions = _Executions()
        t.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[executions])
        runs.append([end - begin + 1 for begin, end in executions.epochs[0]])
        phases.append(t.loop.meter.phase)
    assert runs[0][:18] == [1] * 18 and 4 in runs[0] and phases[0] == "verify"  # not 64 steps at 4 yet
    assert runs[1] == [4] * 20 and phases[1] == "deferred"
    assert runs[2][:19] == [4] * 19 and phases[2] == "verify"  # switched to 8 near its end
    assert runs[3] == [8] * 10 and phases[3] == "settled"
    assert sum(runs[3]) == 80


def test_where_the_two_points_see_no_gain_but_the_host_is_the_limit_a_larger_k_is_tried(monkeypatch):
    from mirrorax.fit import meter
    from mirrorax.fit.auto_steps import Costs, choose_steps

    # The first choice is k=4. Measured again at 4, the line through the two points reads all of the host's time
    # at 4 as work per step (what a host slower in the second window than in the first makes of it), so no k
    # gains on it; but at 4 the host's work a dispatch (tens to hundreds of us on this CPU) is far above the
    # devices' (1 us a step here): a larger k is tried on k's own costs, and taken where it pays (forced here).
    monkeypatch.setattr(meter, "refine", lambda one, k, call, device: Costs(call=0.0, read=call / k, device=device))
    monkeypatch.setattr(meter, "choose_steps", lambda costs, limit=128, remaining_steps=None, compile_seconds=0.0,
                        current=1: 4 if current == 1 else choose_steps(costs, limit=limit, current=current))
    monkeypatch.setattr(meter, "keeps_paying", lambda one, fused: True)
    monkeypatch.setattr(meter.FitMeter, "note_probe",
                        lambda self, k, seconds: self.probes.setdefault(k, []).append(1e-6))
    x, y = _data(8 * 80)
    t = mx.Trainer(_tiny(), strategy(2), steps_per_execution="auto")
    runs = []
    for _ in range(3):
        executions = _Executions()
        t.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[executions])
        runs.append([end - begin + 1 for begin, end in executions.epochs[0]])
    assert runs[1][:16] == [4] * 16  # verified at 4 after 64 steps, then the switch
    k = t.loop.meter.auto.next_k
    assert 4 < k <= 40 and runs[2][:80 // k] == [k] * (80 // k), (k, runs[2])  # (at most half an epoch)


def test_auto_keeps_no_probe_of_a_dispatch_that_compiled_nor_a_device_time_past_the_step_time(monkeypatch):
    from mirrorax.fit import meter
    from mirrorax.fit.epoch import EpochRun
    from mirrorax.steps.dispatch import InFlight

    fit = _bare_fit_meter(auto=True)
    fit.auto.switch(4, dispatched=0)
    fit.phase, fit.probe_wanted = "verify", True
    monkeypatch.setattr(fit, "feed", lambda *a, **kw: None)
    run = EpochRun(None, InFlight(2))
    epoch = meter.EpochMeter(fit, run, 0)

    def dispatch(probe: float, compiles: bool) -> None:
        if compiles:
            meter._compile[0] += 0.5  # what JAX's compile events add
        epoch.probe = probe
        run.before, run.steps = run.steps, run.steps + 4
        epoch.after_step(run)

    meter.compile_seconds()
    dispatch(600e-6, compiles=True)  # the new k's first run: not the devices' time
    assert fit.probes == {} and fit.probe_wanted
    dispatch(20e-6, compiles=False)
    assert fit.probes == {4: [5e-6]} and not fit.probe_wanted
    # A probe longer than the steps the window timed (a hiccup of the host's) counts as no more than them.
    window = meter._Window()
    window.add(4, wall=40e-6, read=0.0, waited=0.0, clean=True)
    fit.probes[4] = [30e-6]
    assert fit._device(4, window) == pytest.approx(10e-6)
    fit.probes[4] = [5e-6]
    assert fit._device(4, window) == pytest.approx(5e-6)


def test_auto_tries_fusing_where_the_probe_says_device_bound_but_the_host_does_most_of_the_step():
    from mirrorax.fit.epoch import EpochRun
    from mirrorax.steps.dispatch import InFlight

    def decided(call: float, probe: float, step: float) -> tuple[int, str]:
        """"auto"'s first choice after 13 clean dispatches at one step each (read 5 us, the rest window wait)."""
        fit = _bare_fit_meter(auto=True)
        fit.probes[1] = [probe] * 3
        for _ in range(13):
            fit.window.add(1, wall=step, read=5e-6, waited=step - call - 5e-6, clean=True)
        fit._decide(EpochRun(None, InFlight(2), total=100_000), 0)
        return fit.auto.next_k, fit.phase

    # A trivial step on a CPU: the host's 70 us of an 80 us step; the probe 75 us (the hand-off to the runtime's
    # threads, a dispatch's cost). As probed the devices are the limit (no k gains on them), but the host does
    # most of the step: a k is tried (64: within 10% of the best, as if the probed time were all the dispatch's).
    assert decided(call=70e-6, probe=75e-6, step=80e-6) == (64, "verify")
    # The LM: the devices 300 ms a step, the host 1 ms: one step a dispatch, settled (no program compiled).
    assert decided(call=1e-3, probe=0.3, step=0.301) == (1, "settled")
    # A step the devices and the host share, the host under half of it: measured as the devices' limit, kept.
    assert decided(call=30e-6, probe=75e-6, step=80e-6) == (1, "settled")


@pytest.mark.slow  # two fits of a Keras model under a scope
def test_keras_compile_takes_auto_under_a_scope_and_fits_as_steps_per_execution_one(monkeypatch, capsys):
    _force_auto(monkeypatch)
    x, y = _data()
    with strategy(4).scope():
        a = _tiny()
        b = _tiny(steps_per_execution="auto")  # Keras 3 takes an int only; tf.keras 2.x took "auto"
    assert b.steps_per_execution == 1  # what Keras's own functions read
    ha = a.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    hb = b.fit(x, y, batch_size=8, epochs=2, verbose=2, shuffle=False)
    assert_weights_close(a, b, 1e-6, 0)
    assert set(hb.history) == set(ha.history) == {"loss", "accuracy"}  # Keras's History: no figures in it
    for key in ha.history:
        np.testing.assert_allclose(hb.history[key], ha.history[key], rtol=1e-6, err_msg=key)
    lines = re.findall(r"^62/62 - .*$", capsys.readouterr().out, re.M)
    figures = r" - loss: [0-9.]+ - device busy: \d+% - input wait: \d+% - steps/execution: 4 \(auto\)"
    assert len(lines) == 2 and all(re.search(figures + "$", s) for s in lines), lines
    assert [u.epoch for u in mx.utilisation(b)] == [0, 1]


# -- the figures -------------------------------------------------------------------------------------------

def test_the_printed_mfu_is_the_steps_flops_times_steps_per_second_over_the_peak(monkeypatch):
    x, y = _data(8 * 40)
    monkeypatch.setenv("MIRRORAX_PEAK_TFLOPS", "1e-5")  # 10 MFLOP/s: the tiny step's figure shows
    t = mx.Trainer(_tiny(), strategy(4))
    t.stream = io.StringIO()
    h = t.fit(x, y, batch_size=8, epochs=1, verbose=2)
    out = t.stream.getvalue()
    u, = t.utilisation
    planned = mx.plan(t, x[:1], y[:1], batch_size=8)
    assert u.flops_per_step == planned.flops > 0 and u.peak_flops == planned.peak_flops == 1e7
    assert u.mfu == pytest.approx(u.flops_per_step * u.steps_per_second / 1e7, rel=1e-12)
    assert u.steps == 40 and u.steps_per_second * 8 >= 0.99 * h.samples_per_second[0]  # (compile left out)
    printed = re.search(r"^Epoch 1/1 - 40 steps - .* - MFU: ([0-9.]+)% - device busy: \d+% - input wait: \d+%$", out,
                        re.M)
    assert printed is not None and printed.group(1) == f"{100 * u.mfu:.1f}", out
    assert "peak 1e-05 TFLOP/s" in planned.summary() and "peak FLOP/s" in str(planned)
    monkeypatch.delenv("MIRRORAX_PEAK_TFLOPS")
    assert "no peak known for cpu: MFU not shown" in mx.plan(t, x[:1], y[:1], batch_size=8).summary()


def test_without_a_peak_the_line_has_no_mfu_and_the_history_no_figures():
    x, y = _data(8 * 12)
    t = mx.Trainer(_tiny(), strategy(2))
    t.stream = io.StringIO()
    assert t.utilisation == []
    with pytest.raises(ValueError, match="No fit has run for Trainer"):
        mx.utilisation(t)
    h = t.fit(x, y, batch_size=8, epochs=2, verbose=2)
    lines = [s for s in t.stream.getvalue().splitlines() if s.startswith("Epoch")]
    assert len(lines) == 2 and all("MFU" not in s and re.search(r" - device busy: \d+% - input wait: \d+%$", s)
                                   for s in lines), lines
    assert set(h.history) == {"loss", "accuracy"}
    records = mx.utilisation(t.model)
    assert [u.epoch for u in records] == [0, 1] and all(u.mfu is None and u.flops_per_step is None for u in records)
    assert all(0 <= u.input_wait <= 1 and u.device_busy is not None and 0 < u.device_busy <= 1 for u in records)


@pytest.mark.parametrize("kind, want", [("TPU v5 lite", 197e12), ("TPU v4", 275e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H100 PCIe", 756e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
                                        ("NVIDIA A100-SXM4-40GB", 312e12), ("a chip of next year", None)])
def test_the_peak_of_a_device_kind(kind, want):
    from mirrorax.fit import utilisation

    device = types.SimpleNamespace(platform="tpu" if kind.startswith("TPU") else "gpu", device_kind=kind)
    assert utilisation.peak_flops(device) == want
    assert utilisation.peak_flops(jax.devices()[0]) is None  # the CPU: no MFU


def test_a_bad_peak_setting_and_a_bad_steps_per_execution_say_what_they_received(monkeypatch):
    from mirrorax.fit import utilisation

    monkeypatch.setenv("MIRRORAX_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="MIRRORAX_PEAK_TFLOPS must be a positive number .* received 'fast'"):
        utilisation.peak_flops(jax.devices()[0])
    with pytest.raises(ValueError, match="steps_per_execution must be an integer >= 1 or 'auto'; received 'fast'"):
        mx.Trainer(_tiny(), strategy(1), steps_per_execution="fast")


# -- input-bound epochs --------------------------------------------------------------------------------------

def _slow_batches(x, y, seconds=0.005):
    for i in range(0, len(x), 8):
        time.sleep(seconds)
        yield x[i:i + 8], y[i:i + 8]


def _input_bound_warnings(fit):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in seen if issubclass(w.category, mx.InputBoundWarning)]


def test_an_input_that_sleeps_5_ms_a_batch_is_named_with_its_fix_and_arrays_are_not():
    x, y = _data(8 * 30)
    t = mx.Trainer(_tiny(), strategy(2))
    said = _input_bound_warnings(lambda: t.fit(_slow_batches(x, y), batch_size=8, epochs=1, verbose=0))
    assert len(said) == 1 and "waited" in said[0] and "for the next batch" in said[0], said
    assert "load the data as arrays in memory" in said[0] and "prefetch=2" in said[0]
    assert t.utilisation[0].input_wait > 0.5  # 5 ms a batch against a step of at most ~2 ms here
    assert _input_bound_warnings(lambda: t.fit(x, y, batch_size=8, epochs=2, verbose=0)) == []
    assert all(u.input_wait < 0.2 for u in t.utilisation)


@pytest.mark.parametrize("way", ["one_by_one", "wrapped"])
def test_the_clock_tells_the_inputs_reads_from_the_placing_and_the_window(way):
    """The meter's two ways around the batches (one generator when one step a dispatch is placed on the loop's
    thread; the input's reads and the placed batches wrapped apart otherwise) count a read as input wait, and
    neither the placing nor the host's work after it: reads of >= 2 ms, a placing of >= 4 ms, a window of none.
    (Intervals that do not overlap: the read total is at most the loop's time less the placings', whatever the
    host's load stretches.)"""
    from mirrorax.fit.epoch import EpochRun
    from mirrorax.fit.meter import EpochMeter
    from mirrorax.steps.dispatch import InFlight

    fit = _bare_fit_meter(auto=False)
    run = EpochRun(None, InFlight(2))
    meter = EpochMeter(fit, run, 0)
    meter.probe_at = ()
    fit.note_batch = lambda *a: None
    n, placings = 12, []

    def host():
        for i in range(n):
            time.sleep(0.002)
            yield i

    def place(b):
        start = time.perf_counter()
        time.sleep(0.004)
        placings.append(time.perf_counter() - start)
        return b

    start = time.perf_counter()
    if way == "one_by_one":
        placed = meter.one_by_one(host(), place)
    else:
        placed = meter.placing((0, place(b)) for b in meter.reading(host()))
    got, upcoming = [], next(placed, None)
    while upcoming is not None:  # the loop's order: a step's batch, the next one read, then its after_step
        got.append(upcoming[1])
        upcoming = next(placed, None)
        run.before, run.steps = run.steps, run.steps + 1
        meter.after_step(run)
    total = time.perf_counter() - start
    assert got == list(range(n)) and meter.dispatches == n
    assert n * 0.002 <= meter.input_wait <= total - sum(placings)
    assert 0 <= meter.waited < n * 0.001  # from the next batch's arrival to a step's after_step: no sleep there


class _SlowRows(keras.utils.PyDataset):
    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // 8

    def __getitem__(self, i):
        time.sleep(0.005)
        return self.x[8 * i:8 * i + 8], self.y[8 * i:8 * i + 8]


def test_a_slow_py_dataset_is_told_of_its_workers_once_a_fit():
    x, y = _data(8 * 20)
    with strategy(2).scope():
        model = _tiny()
    said = _input_bound_warnings(lambda: model.fit(_SlowRows(x, y), epochs=2, verbose=0))
    assert len(said) == 1 and "PyDataset" in said[0] and "workers=N" in said[0], said


class _CountedRows(keras.utils.PyDataset):
    """Batches by index; each read noted in ``log`` (a file: processes read too) with its process and thread."""

    def __init__(self, x, y, log, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.log = x, y, log

    def __len__(self):
        return len(self.x) // 8

    def __getitem__(self, i):
        import os
        import threading

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {threading.get_ident()}\n")
        return self.x[8 * i:8 * i + 8], self.y[8 * i:8 * i + 8]


@pytest.mark.parametrize("processes", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_py_dataset_with_workers_is_read_ahead_by_them_in_keras_order(processes, tmp_path):
    """The fix the warning names works: a PyDataset's workers (threads, or processes with use_multiprocessing)
    read its batches ahead, in the order Keras draws (shuffle=True), and the fit is the one of one reader."""
    import os

    x, y = _data(8 * 24)
    outcomes = []
    for n, kwargs in enumerate(({}, {"workers": 3, "use_multiprocessing": processes})):
        with strategy(2).scope():
            model = _tiny()
        log = tmp_path / f"reads{n}"
        keras.utils.set_random_seed(5)  # Keras's order: drawn from Python's random state at each pass
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)  # JAX's word on a fork: as under Keras
            model.fit(_CountedRows(x, y, log, **kwargs), epochs=2, verbose=0, shuffle=True)
        outcomes.append((model.get_weights(), [tuple(line.split()) for line in log.read_text().splitlines()]))
    (plain, one), (read_ahead, many) = outcomes
    for a, b in zip(plain, read_ahead):
        np.testing.assert_array_equal(a, b)
    assert len(set(one)) == 1 and len(one) == len(many) == 2 * 24 + 1  # (+ the batch read to build the model)
    readers = {pid for pid, _ in many} if processes else {thread for _, thread in many}
    assert len(readers) > 2 and (not processes or str(os.getpid()) in readers)


@pytest.mark.multi_process
@pytest.mark.slow  # two processes
@pytest.mark.timeout(240)
def test_on_two_processes_process_0s_choice_is_every_processs(tmp_path):
    """Each process of a 2 x 2 job is made to choose another k (4 and 8): they dispatch process 0's, the job
    finishes, and its numbers are one process's at one step per dispatch."""
    from jobs import auto_steps
    from jobs.procs import clean_env, launcher, python, run_all

    cmd = launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--failure-timeout", "20", "--",
                   *python("tests/jobs/auto_steps.py"))
    codes, outs, _ = run_all([cmd], [clean_env(MP_OUT=str(tmp_path))], timeout=180)
    assert codes[0] == 0, outs[0]
    ranks = [dict(np.load(tmp_path / f"auto{r}.npz")) for r in range(2)]
    assert ranks[0]["k"].tolist() == ranks[1]["k"].tolist() == [4, 4]
    want = auto_steps.train(strategy(4))
    for key in want:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
        if key != "k":
            np.testing.assert_allclose(ranks[0][key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
