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
from helpers import strategy

import mirrorax as mx
from mirrorax.fit import utilisation

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
    device = types.SimpleNamespace(platform="tpu" if kind.startswith("TPU") else "gpu", device_kind=kind)
    assert utilisation.peak_flops(device) == want
    assert utilisation.peak_flops(jax.devices()[0]) is None  # the CPU: no MFU


def test_a_bad_peak_setting_says_what_it_received(monkeypatch):
    monkeypatch.setenv("MIRRORAX_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="MIRRORAX_PEAK_TFLOPS must be a positive number .* received 'fast'"):
        utilisation.peak_flops(jax.devices()[0])


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

