"""Beyond replication: ``MirroredStrategy(shard="optimizer" | "all")`` splits the optimizer state (and the
parameters) over the same devices; the maths, and so the result, stays the single-device one."""

import jax
import keras
import numpy as np
import pytest
from helpers import assert_weights_close, cnn, digits, flat_digits

import mirrorax as mx

pytestmark = pytest.mark.multi_device


def _strategy(n, shard):
    return mx.MirroredStrategy(devices=jax.devices()[:n], shard=shard)


@pytest.fixture(scope="module")
def replicated_run():
    x, y, _, _ = digits(200)  # 200 rows, batch 48: the last batch (8 rows) is padded at 3 devices
    model = cnn()  # BatchNorm + Dropout
    hist = mx.Trainer(model, _strategy(3, None)).fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), hist.history


@pytest.mark.slow  # an equivalence sweep: the CNN, 2 epochs, per mode
@pytest.mark.parametrize("shard", ["optimizer", "all"])
def test_sharded_modes_give_the_replicated_result(replicated_run, shard):
    want, want_hist = replicated_run
    x, y, xt, yt = digits(200)
    model = cnn()
    trainer = mx.Trainer(model, _strategy(3, shard))
    hist = trainer.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(model.get_weights(), want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"weight {i}")
    np.testing.assert_allclose(hist.history["loss"], want_hist["loss"], rtol=1e-5)
    # The 256x64 dense kernel is large enough to split (3 does not divide 256 or 64: it stays whole on
    # 3 devices) -- so check the layout on 4 devices, where it splits.
    s4 = _strategy(4, shard)
    t4 = mx.Trainer(cnn(), s4)
    t4.fit(x[:96], y[:96], batch_size=48, epochs=1, shuffle=False, verbose=0)
    kernel = next(k for k in t4.state["params"]
                  if k.endswith("dense/kernel") and t4.state["params"][k].shape == (256, 64))
    moments = [v for k, v in t4.state["optimizer"].items() if "dense_kernel" in k and v.shape == (256, 64)]
    assert len(moments) == 2 and all(m.sharding.spec == jax.sharding.PartitionSpec("batch", None) for m in moments)
    want_param = jax.sharding.PartitionSpec("batch", None) if shard == "all" else jax.sharding.PartitionSpec()
    assert t4.state["params"][kernel].sharding.spec == want_param
    assert all(v.sharding.is_fully_replicated for v in t4.state["model_state"].values())  # BatchNorm statistics
    # The model gets its weights whole after fit, and evaluate/predict work on the sharded state.
    assert t4.model.trainable_variables[0].value.sharding.is_fully_replicated
    assert t4.evaluate(xt, yt, batch_size=64)["accuracy"] > 0


def test_small_or_indivisible_variables_stay_replicated():
    s = _strategy(8, "all")
    assert s.state_sharding((64, 10), "params").is_fully_replicated  # 640 < SHARD_MIN_SIZE
    assert s.state_sharding((1001, 33), "params").is_fully_replicated  # no axis divides by 8
    assert s.state_sharding((1000, 64), "params").spec == jax.sharding.PartitionSpec("batch", None)
    assert s.state_sharding((12, 4096), "params").spec == jax.sharding.PartitionSpec(None, "batch")
    assert _strategy(8, "optimizer").state_sharding((1000, 64), "params").is_fully_replicated
    assert (_strategy(8, "optimizer").state_sharding((1000, 64), "optimizer").spec
            == jax.sharding.PartitionSpec("batch", None))
    with pytest.raises(ValueError, match="shard must be one of"):
        mx.MirroredStrategy(shard="zero3")


def test_place_takes_one_sharding_for_every_leaf_as_device_put_does():
    s = _strategy(4, None)
    tree = {"w": np.arange(8, dtype=np.float32).reshape(4, 2), "b": np.float32(3), "on_device": jax.numpy.ones(4)}
    one = s.place(tree, s.replicated)
    each = s.place(tree, jax.tree.map(lambda _: s.replicated, tree))
    for k in tree:
        assert one[k].sharding == each[k].sharding == s.replicated, k
        np.testing.assert_array_equal(np.asarray(one[k]), np.asarray(tree[k]))
    split = s.place({"x": np.arange(8.0)}, s.batch_sharding)["x"]
    assert split.sharding == s.batch_sharding and len({sh.device for sh in split.addressable_shards}) == 4
    replicated = s.replicate(tree)
    assert all(a.sharding == s.replicated for a in jax.tree.leaves(replicated))


def _state_bytes_on(device, tree) -> int:
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


@pytest.mark.slow  # three fits of a 1024-wide MLP on 8 devices
def test_state_bytes_per_device_shrink_by_the_device_count():
    x = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
    y = np.arange(64) % 10

    def build():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="tanh"),
                              keras.layers.Dense(1024, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return m

    measured = {}
    for shard in (None, "optimizer", "all"):
        t = mx.Trainer(build(), _strategy(8, shard))
        t.fit(x, y, batch_size=32, epochs=1, verbose=0)
        d0 = jax.devices()[0]
        measured[shard] = {g: _state_bytes_on(d0, t.state[g]) for g in ("params", "optimizer")}
    rep = measured[None]
    # Within 10 % of an even split: the small variables (biases, the 1024x10 head) stay replicated.
    assert measured["all"]["params"] <= rep["params"] / 8 * 1.1
    assert measured["all"]["optimizer"] <= rep["optimizer"] / 8 * 1.1
    assert measured["optimizer"]["params"] == rep["params"]
    assert measured["optimizer"]["optimizer"] <= rep["optimizer"] / 8 * 1.1


@pytest.mark.slow  # four fits with checkpoints
def test_checkpoint_written_sharded_on_8_resumes_replicated_on_2_and_back(tmp_path):
    x, y, _, _ = flat_digits(160)

    def build():
        keras.utils.set_random_seed(4)
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    kw = dict(batch_size=32, shuffle=True, seed=1, verbose=0)
    ref = build()
    mx.Trainer(ref, _strategy(1, None)).fit(x, y, epochs=3, **kw)
    ckpt = str(tmp_path / "ckpt")
    steps = [(8, "all", 1), (2, None, 2), (8, "all", 3)]  # epochs 1, 2, 3 on alternating layouts
    for n, shard, epochs in steps:
        model = build()
        mx.Trainer(model, _strategy(n, shard)).fit(x, y, epochs=epochs, checkpoint_dir=ckpt, **kw)
    assert_weights_close(model, ref, 1e-5, 1e-6)
