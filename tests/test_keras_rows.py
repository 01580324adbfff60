"""Every model sees exactly the rows Keras would show it (issue 17, items 4 and 6).

A short batch (a pass's last, or a global batch that does not divide by the device count) is placed
padded and cut to its real rows inside the step. A model whose forward pass mixes rows (keras.io's
collaborative filtering contracts the batch axis) and Keras's per-output loss trackers (weighted by the
batch's rows) then give plain Keras's numbers on any device count.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from helpers import assert_same_run
from keras import ops

import mirrorax as mx

pytestmark = pytest.mark.multi_device

RTOL = 1e-4
DEVICES = [1, 3, 4]


def two_outputs():
    """Issue 17 item 4: two outputs, ``loss_weights={"a": 1, "b": 2}``."""
    keras.utils.set_random_seed(0)
    x = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(x)
    m = keras.Model(x, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)})
    m.compile(optimizer="adam", loss={"a": "mse", "b": "mse"}, loss_weights={"a": 1, "b": 2})
    return m


class BatchDot(keras.layers.Layer):
    """keras.io's collaborative-filtering score: a contraction over the batch axis, then a sigmoid."""

    def call(self, a, b):
        return ops.sigmoid(ops.expand_dims(ops.tensordot(a, b, 2), 0) + 0 * a[:, :1])


def batch_dot_model():
    """Issue 17 item 6: a forward pass whose every output depends on every row of its batch."""
    keras.utils.set_random_seed(0)
    u, v = keras.Input((1,), dtype="int32"), keras.Input((1,), dtype="int32")
    ue = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(u))
    ve = keras.layers.Flatten()(keras.layers.Embedding(30, 4)(v))
    m = keras.Model([u, v], BatchDot()(ue, ve))
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    return m


_rng = np.random.default_rng(0)
X = _rng.normal(size=(100, 4)).astype("float32")
Y = {"a": (X[:, :1] * 2).astype("float32"), "b": (X.sum(1, keepdims=True) * 3 + 1).astype("float32")}
U = _rng.integers(0, 20, (200, 1)).astype("int32")
V = _rng.integers(0, 30, (200, 1)).astype("int32")
L = _rng.integers(0, 2, (200, 1)).astype("float32")


def scoped(make, n):
    with mx.MirroredStrategy(devices=jax.devices()[:n]).scope():
        return make()


def run_two_outputs(m):
    """100 rows at batch 32: a last batch of 4."""
    hist = m.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return hist.history, m.evaluate(X, Y, batch_size=32, verbose=0, return_dict=True), \
        m.predict(X[:10], verbose=0)


def run_batch_dot(m):
    """200 rows at batch 64 (a last batch of 8), validation at batch 48 (a last batch of 8)."""
    hist = m.fit([U, V], L, batch_size=64, epochs=2, shuffle=False, verbose=0,
                 validation_data=([U[:56], V[:56]], L[:56]), validation_batch_size=48)
    return hist.history, m.evaluate([U, V], L, batch_size=64, verbose=0, return_dict=True), \
        m.predict([U[:10], V[:10]], verbose=0)


@pytest.fixture(scope="module")
def keras_two_outputs():
    return run_two_outputs(two_outputs())


@pytest.fixture(scope="module")
def keras_batch_dot():
    return run_batch_dot(batch_dot_model())


def assert_same(got, want):
    assert_same_run(got, want, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("n", DEVICES)
def test_per_output_losses_with_a_short_last_batch_are_keras(n, keras_two_outputs):
    hist = keras_two_outputs[0]
    # The parts add up to the total, as in Keras (the report: they did not).
    np.testing.assert_allclose(np.add(hist["a_loss"], 2 * np.asarray(hist["b_loss"])), hist["loss"], rtol=1e-5)
    assert_same(run_two_outputs(scoped(two_outputs, n)), keras_two_outputs)


@pytest.mark.slow
@pytest.mark.parametrize("n", DEVICES)
def test_a_model_contracting_the_batch_axis_sees_keras_rows(n, keras_batch_dot):
    m = scoped(batch_dot_model, n)
    assert_same(run_batch_dot(m), keras_batch_dot)
    # A full-batch and a tail program per step kind, as Keras's jit retraces for the short batch.
    assert mx.keras.fit.trainer_of(m).compile_counts()["train"] == 2


@pytest.mark.slow
def test_steps_per_execution_group_holding_the_tail_is_keras(keras_batch_dot):
    # 4 batches a pass in groups of 4: each group ends with the 8-row tail; validation's groups too.
    m = scoped(batch_dot_model, 3)
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", steps_per_execution=4)
    assert_same(run_batch_dot(m), keras_batch_dot)


@pytest.mark.slow
def test_a_batch_that_does_not_divide_by_the_devices_is_computed_whole():
    # batch 64 on 3 devices: every batch is placed as 66 rows and cut back to its 64.
    want = batch_dot_model()
    want_hist = want.fit([U[:128], V[:128]], L[:128], batch_size=64, epochs=2, shuffle=False, verbose=0).history
    got = scoped(batch_dot_model, 3)
    got_hist = got.fit([U[:128], V[:128]], L[:128], batch_size=64, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got_hist["loss"], want_hist["loss"], rtol=RTOL)
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


def test_on_batch_calls_see_the_real_rows():
    # 10 rows on 4 devices: placed as 12.
    want, got = batch_dot_model(), scoped(batch_dot_model, 4)
    for m in (want, got):
        m.train_on_batch([U[:10], V[:10]], L[:10])
    np.testing.assert_allclose(got.test_on_batch([U[:10], V[:10]], L[:10]),
                               want.test_on_batch([U[:10], V[:10]], L[:10]), rtol=RTOL)
    np.testing.assert_allclose(got.predict_on_batch([U[:10], V[:10]]), want.predict_on_batch([U[:10], V[:10]]),
                               rtol=RTOL, atol=1e-6)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # Keras's, at a generator's end
def test_iterable_batches_of_varying_size_are_keras():
    sizes = [(0, 64), (64, 84), (84, 91), (91, 155)]

    def batches():
        for lo, hi in sizes:
            yield (U[lo:hi], V[lo:hi]), L[lo:hi]

    want = batch_dot_model()
    want_hist = want.fit(batches(), epochs=1, shuffle=False, verbose=0).history
    got = scoped(batch_dot_model, 4)
    got_hist = got.fit(batches(), epochs=1, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got_hist["loss"], want_hist["loss"], rtol=RTOL)
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


@pytest.mark.slow
def test_accumulation_splits_the_real_rows():
    # Gradient accumulation equals the whole batch; the whole batch is its real rows (no row mixing
    # here: micro-batches of a mixing model see their own rows, as any micro-batch does).
    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return m

    y = Y["a"]
    want = model()
    want_hist = want.fit(X, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    got = model()
    trainer = mx.Trainer(got, mx.MirroredStrategy(devices=jax.devices()[:3]), accumulation_steps=2)
    got_hist = trainer.fit(X, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got_hist["loss"], want_hist["loss"], rtol=RTOL)
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


def test_functional_model_predict_sees_each_batch_alone():
    # apply_fn centres each batch on its own mean: a padding row would move every output.
    model = mx.FunctionalModel(lambda p, xb: xb - jnp.mean(xb, axis=0) + p["b"], {"b": np.zeros(4, np.float32)},
                               loss="mse", optimizer=optax.sgd(0.1))
    trainer = mx.Trainer(model, mx.MirroredStrategy(devices=jax.devices()[:4]))
    got = trainer.predict(X[:10], batch_size=8)  # a last batch of 2, placed as 4
    want = np.concatenate([X[:8] - X[:8].mean(0), X[8:10] - X[8:10].mean(0)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_per_process_pipeline_keeps_padding_masked_and_per_output_losses_exact(keras_two_outputs):
    # A per-process pipeline's global count only the devices know: its short batch stays padded and
    # masked (no row-mixing model sees Keras's rows there), and the per-output losses still add up.
    strategy = mx.MirroredStrategy(devices=jax.devices()[:4])

    def pipeline(ctx):
        return [(X[lo:lo + 32], {k: v[lo:lo + 32] for k, v in Y.items()}) for lo in range(0, 100, 32)]

    model = two_outputs()
    hist = mx.Trainer(model, strategy).fit(strategy.distribute_datasets_from_function(pipeline), batch_size=32,
                                           epochs=2, verbose=0).history
    for key, want in keras_two_outputs[0].items():
        np.testing.assert_allclose(hist[key], want, rtol=RTOL, err_msg=key)


def test_a_summed_loss_from_a_per_process_pipeline_is_the_real_rows_sum():
    # A padded batch's real rows are weighted rows / real rows, which makes a mean-reduced loss the real
    # rows' mean; a loss reduced by "sum" (a VAE's, say) was then the real rows' sum times that factor
    # (666.65 for Keras's 655.84 in the first epoch, 488.07 for 502.38 in the second).
    def build():
        keras.utils.set_random_seed(1)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
        m.compile(optimizer=keras.optimizers.SGD(1e-3), loss=keras.losses.MeanSquaredError(reduction="sum"),
                  metrics=["mae"])
        return m

    x, y = X, np.concatenate([Y["a"], Y["b"]], axis=1)  # 100 rows at batch 32: a last batch of 4
    plain = build()
    want = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    want_logs = plain.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)

    strategy = mx.MirroredStrategy(devices=jax.devices()[:4])

    def pipeline(ctx):
        return [(x[lo:lo + 32], y[lo:lo + 32]) for lo in range(0, 100, 32)]

    with strategy.scope():
        model = build()
    trainer = mx.Trainer(model, strategy)
    hist = trainer.fit(strategy.distribute_datasets_from_function(pipeline), batch_size=32, epochs=2,
                       verbose=0).history
    logs = trainer.evaluate(strategy.distribute_datasets_from_function(pipeline), batch_size=32, verbose=0)
    assert_same((hist, logs, model.get_weights()), (want, want_logs, plain.get_weights()))
