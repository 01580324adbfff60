"""``mx.plan``: the step's per-device cost, known before step 1 from compile-only programs."""

import importlib

import jax
import keras
import numpy as np
import pytest

import mirrorax as mx

pytestmark = pytest.mark.multi_device
plan_module = importlib.import_module("mirrorax.plan")


def _model(width=256):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="tanh"),
                          keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(10, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return m


def _data(n=64):
    x = np.random.default_rng(0).normal(size=(n, 64)).astype(np.float32)
    return x, np.arange(n) % 10


@pytest.mark.parametrize("shard", [None, "all"])
def test_planned_state_bytes_equal_what_fit_holds(shard):
    x, y = _data()
    s = mx.MirroredStrategy(devices=jax.devices()[:4], shard=shard)
    p = mx.plan(_model(), x, y, batch_size=32, strategy=s)
    trainer = mx.Trainer(_model(), s)
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    d0 = jax.devices()[0]

    def held(group):
        return sum(sh.data.nbytes for a in jax.tree.leaves(trainer.state[group]) for sh in a.addressable_shards
                   if sh.device == d0)

    assert (p.param_bytes, p.optimizer_bytes, p.model_state_bytes) == (held("params"), held("optimizer"),
                                                                        held("model_state"))
    assert p.flops > 0 and p.peak_bytes >= p.argument_bytes - p.output_bytes
    params = sum(np.asarray(w).nbytes for w in _model().get_weights())
    # The gradient all-reduce moves (at least) every gradient once.
    assert p.collective_bytes >= (params if shard is None else params // 4)
    assert "per device" in str(p) and p.summary().startswith("plan: 4 devices")


def test_largest_batch_search_and_fit_refuses_a_step_that_does_not_fit(monkeypatch):
    x, y = _data()
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    model = _model(512)
    at_64 = mx.plan(model, x, y, batch_size=64, strategy=s, search=False)
    memory = at_64.peak_bytes + 2**20  # a device with 1 MiB more than the step at batch 64 needs
    p = mx.plan(model, x, y, batch_size=64, strategy=s, device_memory=memory)
    largest = p.largest_batch[None]
    assert largest is not None and largest >= 64 and largest % 2 == 0
    assert mx.plan(model, x, y, batch_size=largest, strategy=s, device_memory=memory, search=False).fits
    over = largest + max(2, largest // 16)
    assert not mx.plan(model, x, y, batch_size=over, strategy=s, device_memory=memory, search=False).fits
    monkeypatch.setenv("MIRRORAX_DEVICE_MEMORY", str(memory))
    trainer = mx.Trainer(model, s)
    with pytest.raises(MemoryError, match=r"per device .* at global batch 100000 .*a global batch of at most"):
        trainer.fit(np.zeros((100000, 64), np.float32), np.zeros(100000, np.int32), batch_size=100000, verbose=0)
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)  # nothing half-done: the same trainer still trains


def test_parse_bytes():
    assert plan_module.parse_bytes("24GB") == 24 * 10**9
    assert plan_module.parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="24GB"):
        plan_module.parse_bytes("lots")
