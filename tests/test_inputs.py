"""Inputs: arrays, tuples/dicts of arrays, multi-output models, and any iterable of batches."""

import keras
import numpy as np
import pytest
from helpers import assert_weights_close, dense, flat_digits, strategy

import mirrorax as mx

pytestmark = pytest.mark.multi_device


def _batches(x, y, bs, w=None):
    for i in range(0, len(x), bs):
        yield (x[i:i + bs], y[i:i + bs]) if w is None else (x[i:i + bs], y[i:i + bs], w[i:i + bs])


class _Reiterable:
    """A dataset object that can be iterated once per epoch (like tf.data or a DataLoader)."""

    def __init__(self, x, y, bs, w=None):
        self.x, self.y, self.bs, self.w = x, y, bs, w

    def __iter__(self):
        return _batches(self.x, self.y, self.bs, self.w)

    def __len__(self):
        return -(-len(self.x) // self.bs)


@pytest.mark.slow
def test_iterable_of_batches_equals_arrays():
    x, y, xt, yt = flat_digits(130)
    w = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    a = dense()
    ha = mx.Trainer(a, strategy(4)).fit(x, y, sample_weight=w, batch_size=32, epochs=2, shuffle=False, verbose=0)
    b = dense()
    tb = mx.Trainer(b, strategy(4))
    hb = tb.fit(_Reiterable(x, y, 32, w), epochs=2, verbose=0)  # batch size from the first batch
    assert_weights_close(a, b, 1e-6, 1e-6)
    np.testing.assert_allclose(ha.history["loss"], hb.history["loss"], rtol=1e-6)
    # evaluate and predict from a generator (a one-shot iterator) too
    ev_arrays = tb.evaluate(xt, yt, batch_size=50)
    ev_gen = tb.evaluate(_batches(xt, yt, 50), batch_size=50)
    assert ev_gen["accuracy"] == pytest.approx(ev_arrays["accuracy"], abs=1e-7)
    pred = tb.predict((xb for xb, _ in _batches(xt, yt, 50)), batch_size=50)
    np.testing.assert_allclose(pred, tb.predict(xt, batch_size=50), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # several fits (and the frameworks' imports)
def test_generator_with_steps_per_epoch_continues_across_epochs():
    x, y, _, _ = flat_digits(128)

    def endless():
        while True:
            yield from _batches(x, y, 32)

    model = dense()
    hist = mx.Trainer(model, strategy(2)).fit(endless(), batch_size=32, epochs=3, steps_per_epoch=2, verbose=0)
    assert len(hist.history["loss"]) == 3
    ref = dense()
    mx.Trainer(ref, strategy(2)).fit(x, y, batch_size=32, epochs=3, steps_per_epoch=2, shuffle=False, verbose=0)
    assert_weights_close(model, ref, 1e-6, 1e-6)  # arrays continue through passes in the same order


def test_larger_batch_than_batch_size_is_an_error():
    x, y, _, _ = flat_digits(64)
    with pytest.raises(ValueError, match="more than batch_size=16"):
        mx.Trainer(dense(), strategy(2)).fit(_Reiterable(x, y, 32), batch_size=16, verbose=0)


@pytest.mark.slow  # several fits (and the frameworks' imports)
def test_multi_input_dict_and_multi_output():
    rng = np.random.default_rng(0)
    n = 90
    xa, xb = rng.normal(size=(n, 5)).astype(np.float32), rng.normal(size=(n, 3)).astype(np.float32)
    y_cls = rng.integers(0, 3, n).astype(np.int32)
    y_reg = rng.normal(size=(n, 1)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(3)
        ia, ib = keras.Input((5,), name="a"), keras.Input((3,), name="b")
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([ia, ib]))
        out_c = keras.layers.Dense(3, activation="softmax", name="cls")(h)
        out_r = keras.layers.Dense(1, name="reg")(h)
        m = keras.Model({"a": ia, "b": ib}, {"cls": out_c, "reg": out_r})
        m.compile(optimizer="sgd", loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                  metrics={"cls": ["accuracy"]})
        return m

    ref = build()
    ref.fit({"a": xa, "b": xb}, {"cls": y_cls, "reg": y_reg}, batch_size=20, epochs=2, shuffle=False, verbose=0)
    model = build()
    trainer = mx.Trainer(model, strategy(8))
    trainer.fit({"a": xa, "b": xb}, {"cls": y_cls, "reg": y_reg}, batch_size=20, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, ref, 1e-5, 1e-6)
    pred = trainer.predict({"a": xa, "b": xb}, batch_size=32)
    assert set(pred) == {"cls", "reg"} and pred["cls"].shape == (n, 3) and pred["reg"].shape == (n, 1)
    ref_pred = ref.predict({"a": xa, "b": xb}, verbose=0)
    np.testing.assert_allclose(pred["reg"], ref_pred["reg"], rtol=1e-5, atol=1e-6)


def test_tuple_inputs():
    rng = np.random.default_rng(1)
    xa, xb = rng.normal(size=(40, 4)).astype(np.float32), rng.normal(size=(40, 2)).astype(np.float32)
    y = rng.integers(0, 2, 40).astype(np.int32)
    keras.utils.set_random_seed(0)
    ia, ib = keras.Input((4,)), keras.Input((2,))
    out = keras.layers.Dense(2, activation="softmax")(keras.layers.Concatenate()([ia, ib]))
    model = keras.Model([ia, ib], out)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    trainer = mx.Trainer(model, strategy(4))
    trainer.fit((xa, xb), y, batch_size=16, epochs=1, verbose=0)
    assert trainer.predict((xa, xb), batch_size=16).shape == (40, 2)


class _Tensor:
    """Quacks like a tf.Tensor or a torch.Tensor: converts with .numpy()."""

    def __init__(self, a):
        self._a = a

    def numpy(self):
        return self._a


@pytest.mark.slow  # several fits (and the frameworks' imports)
def test_framework_tensors_in_batches_convert_through_numpy():
    x, y, _, _ = flat_digits(64)
    a = dense()
    mx.Trainer(a, strategy(2)).fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    b = dense()
    batches = [(_Tensor(x[i:i + 32]), _Tensor(y[i:i + 32].astype(np.int64))) for i in (0, 32)]
    mx.Trainer(b, strategy(2)).fit(batches, epochs=1, verbose=0)
    assert_weights_close(a, b, 1e-6, 1e-7)


# -- the NaN/inf scan: on a thread for large arrays, once for arrays nothing can write -----------------------
def _large(nan_at=None):
    """4.4 MB of float32 (over BACKGROUND_MIN_BYTES): scanned on a thread when asked."""
    from mirrorax.inputs.checks import BACKGROUND_MIN_BYTES

    x = np.random.default_rng(0).normal(size=(1100, 1000)).astype(np.float32)
    assert x.nbytes >= BACKGROUND_MIN_BYTES
    if nan_at is not None:
        x[nan_at] = np.nan
    return x, np.zeros(len(x), np.int32)


def test_background_scan_raises_the_same_error_before_any_batch():
    from mirrorax.inputs.arrays import ArraySource

    x, y = _large(nan_at=(700, 3))
    with pytest.raises(ValueError) as up_front:
        ArraySource(x, y)
    assert "x holds nan at x[700, 3] (example 700)" in str(up_front.value)
    source = ArraySource(x, y, scan_in_background=True)  # no error yet: the scan runs on a thread
    with pytest.raises(ValueError) as joined:
        source.wait_checked()
    assert str(joined.value) == str(up_front.value)
    with pytest.raises(ValueError, match=r"x holds nan at x\[700, 3\]"):  # raised again, by every reader
        next(ArraySource(x, y, scan_in_background=True).batches(8, strategy(2).batch_mesh, shuffle=False,
                                                                seed=0, pass_index=0))


def test_background_scans_share_threads_started_once():
    """Every fit call scans a writeable array again; the threads doing it are started once per process
    (one per usable core: starting them at every call cost ~30 ms a fit on a 13-core TPU host)."""
    import os
    import threading

    from mirrorax.inputs.checks import FiniteScan

    def scanners():
        return {t for t in threading.enumerate() if t.name == "mirrorax-finite-scan"}

    x, _ = _large()
    FiniteScan([("x", x)], background=True).wait()
    first = scanners()
    assert 1 <= len(first) <= len(os.sched_getaffinity(0))
    for nan_at in (None, (1099, 999), None, (0, 0)):
        y = x.copy()
        if nan_at is not None:
            y[nan_at] = np.inf
        scans = [FiniteScan([("a", y)], background=True), FiniteScan([("b", x.copy())], background=True)]
        if nan_at is None:
            scans[0].wait()
        else:
            with pytest.raises(ValueError, match=rf"a holds inf at a\[{nan_at[0]}, {nan_at[1]}\]"):
                scans[0].wait()
        scans[1].wait()
        assert scans[0].done and scans[1].done
    assert scanners() == first


def _counting_scan(monkeypatch):
    """The values scanned for NaN/inf, counted (in one piece or in chunks on threads)."""
    from mirrorax.inputs import checks as input_checks

    scanned = []
    real = input_checks.all_finite
    monkeypatch.setattr(input_checks, "all_finite", lambda a: (scanned.append(a.size), real(a))[1])
    return scanned


def test_arrays_nothing_can_write_are_scanned_once(monkeypatch):
    import jax

    from mirrorax.inputs.checks import immutable_place

    scanned = _counting_scan(monkeypatch)
    xh, y = _large()
    t = mx.Trainer(dense(inputs=1000), strategy(2))
    x = jax.device_put(xh, jax.devices()[0])  # immutable; np.asarray views its buffer
    t.fit(x, y, batch_size=550, verbose=0)  # scanned on threads, in chunks
    t.fit(x, y, batch_size=550, verbose=0)
    t.evaluate(x, y, batch_size=550)
    frozen = np.frombuffer(xh.tobytes(), np.float32).reshape(xh.shape)  # read-only, owned by bytes
    t.evaluate(frozen, y, batch_size=550)
    t.evaluate(frozen, y, batch_size=550)
    assert sum(scanned) == 2 * xh.size  # once each
    owned = xh.copy()
    owned.flags.writeable = False  # its owner can give the writes back: no promise
    assert immutable_place(owned) is None
    assert immutable_place(np.frombuffer(memoryview(bytearray(16)).toreadonly(), np.float32)) is None


def test_the_cache_never_hides_a_nan_written_between_calls(monkeypatch):
    scanned = _counting_scan(monkeypatch)
    x, y = _large()
    t = mx.Trainer(dense(inputs=1000), strategy(2))
    t.evaluate(x, y, batch_size=550)
    x[5, 7] = np.nan  # a writeable array: scanned by every call
    with pytest.raises(ValueError, match=r"x holds nan at x\[5, 7\]"):
        t.evaluate(x, y, batch_size=550)
    x[5, 7] = 0.0
    x.flags.writeable = False
    t.evaluate(x, y, batch_size=550)
    x.flags.writeable = True  # read-only again after a write: still scanned
    x[9, 1] = np.inf
    x.flags.writeable = False
    with pytest.raises(ValueError, match=r"x holds inf at x\[9, 1\]"):
        t.evaluate(x, y, batch_size=550)
    assert sum(scanned) >= 4 * x.size  # every call (the ones that raise also search)


def test_a_full_batch_carries_its_row_count_as_a_short_one_does():
    # The step then folds the mask and the real-row count away (constants), as for a cut batch: a
    # smaller program to trace and compile before the first step (issue 22).
    from mirrorax.inputs.batch import Batch, RealRows

    mask = np.ones(8, np.float32)
    batch = Batch(np.zeros((8, 2)), np.zeros(8), mask, mask, num_real=8.0, rows=8)
    assert batch.real_rows() == RealRows(8) and batch.tree()["rows"] == RealRows(8)
    assert Batch(np.zeros((8, 2)), np.zeros(8), mask, mask, rows=5).real_rows() == RealRows(5)
    stacked = Batch(np.zeros((2, 8, 2)), np.zeros((2, 8)), np.ones((2, 8)), np.ones((2, 8)), rows=(8, 3))
    assert stacked.real_rows() == RealRows((8, 3))
    assert Batch(np.zeros((8, 2)), np.zeros(8), mask, mask, rows=None).real_rows() is None


class _Counted(_Reiterable):
    """A re-iterable dataset that counts its passes and the batches read from them."""

    def __init__(self, x, y, bs):
        super().__init__(x, y, bs)
        self.passes, self.reads = 0, 0

    def __iter__(self):
        self.passes += 1
        for item in _batches(self.x, self.y, self.bs):
            self.reads += 1
            yield item


def test_the_look_at_the_first_batch_is_the_first_pass_own():
    """The trainer sizes and builds from the first batch of the pass it then runs: one pass per call, each
    batch read once (a tf.data .cache() is filled by a whole pass; nothing is read and dropped)."""
    x, y, _, _ = flat_digits(100)
    trainer = mx.Trainer(dense(), strategy(2))
    data = _Counted(x, y, 32)  # 4 batches, the last of 4 rows
    logs = trainer.evaluate(data)
    assert (data.passes, data.reads) == (1, 4)
    assert logs["loss"] == pytest.approx(trainer.evaluate(x, y, batch_size=32)["loss"], rel=1e-6)
    pred = trainer.predict(_Counted(x, y, 32))
    assert pred.shape[0] == len(x)
    data = _Counted(x, y, 32)
    trainer.fit(data, epochs=2, verbose=0)
    assert (data.passes, data.reads) == (2, 8)


def test_tensors_frames_and_jax_arrays_are_arrays_as_keras_reads_them():
    """What Keras's data adapters slice as arrays (array_slicing.can_slice_array) is arrays here too:
    tf.Tensor, jax.Array, pandas, dicts of them; a tf.data.Dataset is an iterable of batches."""
    tf = pytest.importorskip("tensorflow")
    pd = pytest.importorskip("pandas")
    import jax.numpy as jnp

    from mirrorax.inputs.arrays import ArraySource
    from mirrorax.inputs.make import is_array_tree, make_source

    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    for arrays in (tf.constant(x), jnp.asarray(x), {"a": tf.constant(x), "b": tf.convert_to_tensor([1, 2, 3, 4, 5, 6])},
                   pd.DataFrame(x), tf.RaggedTensor.from_tensor(tf.constant(x)), tf.sparse.from_dense(x)):
        assert is_array_tree(arrays), type(arrays)
    assert not is_array_tree(tf.data.Dataset.from_tensor_slices(x).batch(2))
    assert not is_array_tree(iter([x]))
    # keras.io's one-row inference: a dict of one-row tensors from Python lists
    one = make_source({"age": tf.convert_to_tensor([60]), "thal": tf.convert_to_tensor([[0, 1, 0]])})
    assert isinstance(one, ArraySource) and one.num_examples == 1
    assert one.x["age"].dtype == np.int32 and one.x["thal"].shape == (1, 3)
    src = make_source(tf.constant(x), tf.constant(np.arange(6.0)))
    np.testing.assert_array_equal(src.x, x)
    # pandas as Keras slices it: a Series is one column
    frame = pd.DataFrame({"u": np.arange(6.0), "v": np.arange(6, 12)})
    assert make_source(dict(frame)).x["u"].shape == (6, 1)
    np.testing.assert_array_equal(make_source(frame).x, frame.to_numpy().astype(np.float32))
    # a ragged tensor whose rows are of one length is its dense tensor; others are refused with the fix
    np.testing.assert_array_equal(make_source(tf.RaggedTensor.from_tensor(tf.constant(x))).x, x)
    with pytest.raises(ValueError, match=r"x is a tf.RaggedTensor whose rows have different lengths.*to_tensor\(\)"):
        make_source(tf.ragged.constant([[1.0, 2.0], [3.0]]))
    with pytest.raises(TypeError, match=r"x\['s'\] is a tf.SparseTensor .*tf.sparse.to_dense"):
        make_source({"s": tf.sparse.from_dense(x)})


@pytest.mark.multi_device
def test_rows_placer_places_as_device_put_does_on_every_kind_of_layout():
    """``RowsPlacer`` (the batches' transfer, worked out once per signature) gives ``jax.device_put``'s arrays on
    a 2 x 4 mesh: split over both axes, over one (each slice held by two devices: a host buffer sent twice, which
    this jaxlib's copy-until-done transfer refused with 'bad_function_call'), and replicated."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mirrorax.inputs.placement import RowsPlacer

    mesh = jax.make_mesh((2, 4), ("host", "batch"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    labels = np.arange(8, dtype=np.int32)
    for spec in (P(("host", "batch")), P("batch"), P("host"), P()):
        sharding = NamedSharding(mesh, spec)
        got = RowsPlacer([(x.shape, x.dtype), (labels.shape, labels.dtype)], sharding)([x, labels])
        for a, want in zip(got, (x, labels)):
            assert a.sharding == sharding and a.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(a), want)
            for shard in a.addressable_shards:  # each device holds its own rows
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
