"""What a step sees of a short batch's padding, and the warning for what stays ambiguous.

The keras.io JAX guide's loss is a plain mean. In the global view (``strategy.jit``) a batch whose real
rows the host knows reaches the step cut to them, so a plain mean is the mean of ``tf.data``'s short last
batch. Per replica (``strategy.run``) every replica holds as many rows, padding included: a result reduced
over them without the mask lets the padding in, and the step warns once
(:class:`mirrorax.PaddingIgnoredWarning`), naming it. ``drop_remainder=True`` drops the short batch.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx

pytestmark = pytest.mark.multi_device

RNG = np.random.default_rng(0)
X = RNG.normal(size=(50, 4)).astype(np.float32)
Y = RNG.normal(size=(50, 2)).astype(np.float32)
W0 = (0.3 * RNG.normal(size=(4, 2))).astype(np.float32)


def _per_example(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2, axis=1)


def plain_step(w, batch):  # the guide's form: a plain mean, the mask never read
    x, y = batch
    loss, g = jax.value_and_grad(lambda w: jnp.mean(_per_example(w, x, y)))(w)
    return w - 0.5 * g, loss


def masked_step(w, batch):
    x, y = batch
    loss, g = jax.value_and_grad(lambda w: mx.compute_average_loss(_per_example(w, x, y), batch))(w)
    return w - 0.5 * g, loss


def _loop(s, step, dist, epochs=2):
    w = s.replicate(jnp.asarray(W0))
    for _ in range(epochs):
        for batch in dist:
            w, _ = step(w, batch)
    return np.asarray(w)


def _forms(s, fn):
    return {"jit": s.jit(fn), "run": lambda w, b: s.run(fn, args=(w, b))}


def _tf_data(step, epochs=2, batch_size=16):
    """``step`` over tf.data's ``ds.batch(batch_size)`` on one device: 16, 16, 16 and 2 rows."""
    w = jnp.asarray(W0)
    for _ in range(epochs):
        for i in range(0, len(X), batch_size):
            w, _ = step(w, (X[i:i + batch_size], Y[i:i + batch_size]))
    return np.asarray(w)


def test_plain_mean_step_in_the_global_view_gives_tf_data_batches():
    """The guide's loss on uneven data: the short batch's mean is over its 2 real rows, on any device count."""
    want = _tf_data(plain_step)
    for n in (1, 3, 4):  # 16 rows on 3 devices: every batch padded to 18
        s = strategy(n)
        with warnings.catch_warnings():
            warnings.simplefilter("error", mx.PaddingIgnoredWarning)
            got = _loop(s, s.jit(plain_step), s.experimental_distribute_dataset((X, Y), batch_size=16))
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"{n} devices")


def test_plain_mean_step_per_replica_warns_once_naming_the_result():
    s = strategy(4)
    step = _forms(s, plain_step)["run"]
    with pytest.warns(mx.PaddingIgnoredWarning, match="drop_remainder=True") as record:
        _loop(s, step, s.experimental_distribute_dataset((X, Y), batch_size=16))  # 50 rows: 16, 16, 16, 2
    assert len([r for r in record if r.category is mx.PaddingIgnoredWarning]) == 1
    message = str(record[0].message)
    assert "2 real rows of 16" in message and "each replica runs plain_step on 4 rows" in message, message
    assert "it enters output[0], output[1] (reduced over the rows without the mask)" in message, message
    assert "compute_average_loss" in message


@pytest.mark.parametrize("form", ["jit", "run"])
def test_mask_reading_step_and_even_data_do_not_warn(form):
    s = strategy(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mx.PaddingIgnoredWarning)
        _loop(s, _forms(s, masked_step)[form], s.experimental_distribute_dataset((X, Y), batch_size=16))
        _loop(s, _forms(s, plain_step)[form], s.experimental_distribute_dataset((X[:48], Y[:48]), batch_size=16))


def test_per_row_outputs_and_stateful_mask_reading_steps_do_not_warn():
    s = strategy(4)
    dist = s.experimental_distribute_dataset((X, Y), batch_size=16)

    def predict(w, batch):  # one output per row: the caller masks them (gather + mask)
        return jnp.tanh(batch[0] @ w)

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="tanh")])
    optimizer = keras.optimizers.SGD(0.1)

    def keras_step(inputs):
        x, y = inputs
        loss, grads = mx.value_and_grad(
            lambda: mx.compute_average_loss(jnp.mean((model(x) - y) ** 2, axis=1)), model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    w = s.replicate(jnp.asarray(W0))
    jitted = s.jit(predict)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mx.PaddingIgnoredWarning)
        for batch in dist:
            s.run(predict, args=(w, batch))
            jitted(w, batch)
            s.run(keras_step, args=(batch,))


def test_stateful_plain_mean_step_per_replica_warns_and_global_view_is_exact():
    def objects():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="tanh")])
        return model, keras.optimizers.SGD(0.1)

    def train(s, form):
        model, optimizer = objects()

        def keras_step(inputs):
            x, y = inputs
            loss, grads = mx.value_and_grad(lambda: jnp.mean((model(x) - y) ** 2), model.trainable_variables)()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        step = s.jit(keras_step) if form == "jit" else (lambda b: s.run(keras_step, args=(b,)))
        for batch in s.experimental_distribute_dataset((X, Y), batch_size=16):
            step(batch)
        return model

    with pytest.warns(mx.PaddingIgnoredWarning, match=r"variable 'sequential/dense/kernel'"):
        train(strategy(2), "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", mx.PaddingIgnoredWarning)
        one, three = train(strategy(1), "jit"), train(strategy(3), "jit")
    model, optimizer = objects()
    for i in range(0, len(X), 16):  # tf.data's batches on one device, in eager Keras
        x, y = X[i:i + 16], Y[i:i + 16]
        loss, grads = mx.value_and_grad(lambda x=x, y=y: jnp.mean((model(x) - y) ** 2), model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    for a, b, c in zip(model.get_weights(), one.get_weights(), three.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)
        np.testing.assert_allclose(c, a, atol=1e-6)


def test_batch_normalization_per_replica_is_named():
    """Per replica, BatchNormalization's statistics take each replica's rows, padding included: named."""
    s = strategy(3)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])

    def step(inputs):
        x, y = inputs
        return mx.compute_average_loss(jnp.mean((model(x, training=True) - y) ** 2, axis=1))

    with pytest.warns(mx.PaddingIgnoredWarning, match=r"variable '.*moving_mean'.*variable '.*moving_variance'"):
        for batch in s.experimental_distribute_dataset((X, Y), batch_size=16):
            s.run(step, args=(batch,))


@pytest.mark.parametrize("form", ["jit", "run"])
def test_drop_remainder_gives_tf_data_batches_and_weights(form):
    s = strategy(4)
    dist = s.experimental_distribute_dataset((X, Y), batch_size=16, drop_remainder=True)
    assert len(dist) == 3 and len(list(dist)) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", mx.PaddingIgnoredWarning)
        # per replica a plain mean is a replica's share, not the global mean: run takes compute_average_loss
        got = _loop(s, _forms(s, plain_step if form == "jit" else masked_step)[form], dist)
    w = jnp.asarray(W0)  # tf.data's ds.batch(16, drop_remainder=True) on one device
    for _ in range(2):
        for i in range(3):
            w, _ = plain_step(w, (X[16 * i:16 * (i + 1)], Y[16 * i:16 * (i + 1)]))
    np.testing.assert_allclose(got, np.asarray(w), atol=1e-6)


def test_drop_remainder_skips_short_items_of_an_iterable():
    s = strategy(4)
    items = [(X[i:i + 16], Y[i:i + 16]) for i in range(0, 50, 16)]  # 16, 16, 16, 2 rows
    dist = s.experimental_distribute_dataset(items, drop_remainder=True)
    assert [int(b.num_real) for b in dist] == [16, 16, 16]
    assert [bool(b.padded) for b in s.experimental_distribute_dataset(items)] == [False, False, False, True]
