"""Sequence models whose outputs carry a Keras mask give Keras's numbers under the scope.

keras.io's "Understanding masking & padding": ``Embedding(mask_zero=True)`` makes a ``(batch, time)`` mask
that Keras propagates to the outputs of an ``LSTM(return_sequences=True)`` tagger, and its loss and metrics
then count only the unmasked timesteps (the loss divides by their number in the batch). The targets under
the mask here are random, so any step that ignores the mask reports other numbers. 300 rows in batches of
64: the last batch has 44 rows, which split unevenly over 3 and over 8 devices.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from helpers import assert_same_run, built

import mirrorax as mx

pytestmark = pytest.mark.multi_device

ROWS, BATCH, STEPS, VOCAB, TAGS = 300, 64, 10, 40, 4


def _data():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, STEPS + 1, ROWS)
    x = np.zeros((ROWS, STEPS), "int32")
    y = rng.integers(0, TAGS, (ROWS, STEPS)).astype("int32")  # noise under the mask
    for i, n in enumerate(lengths):
        x[i, :n] = rng.integers(1, VOCAB, n)
        y[i, :n] = x[i, :n] % TAGS  # learnable where unmasked
    return x, y


def _tagger(reduction: str = "sum_over_batch_size"):
    inputs = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    h = keras.layers.LSTM(8, return_sequences=True)(h)
    model = keras.Model(inputs, keras.layers.Dense(TAGS)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def _tagger_and_classifier():
    """Two outputs: the masked tags, and a class of the whole sequence (the mask consumed by the pooling)."""
    inputs = keras.Input((STEPS,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    h = keras.layers.LSTM(8, return_sequences=True)(h)
    tags = keras.layers.Dense(TAGS, name="tags")(h)
    kind = keras.layers.Dense(2, name="kind")(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, {"tags": tags, "kind": kind})
    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss={"tags": sparse, "kind": sparse},
                  loss_weights={"tags": 1.0, "kind": 0.5}, metrics={"tags": ["accuracy"], "kind": ["accuracy"]})
    return model


def _run(n: int | None, build=_tagger, two_outputs: bool = False):
    """Plain Keras (``n`` None) or the scope of ``n`` devices: fit's History with validation, evaluate's
    dict, and the weights."""
    x, y = _data()
    if two_outputs:
        y = {"tags": y, "kind": (x.sum(axis=1) % 2).astype("int32")}
    keras.utils.set_random_seed(1)
    model = built(build, n)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_split=64 / ROWS).history
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return history, evaluated, model.get_weights()


@pytest.fixture(scope="module")
def keras_run():
    return _run(None)


def _assert_same(got, want) -> None:
    # The history: the masked loss is the mean over the batch's unmasked timesteps; summed per replica
    # without the mask (the targets under it are noise), 8 devices reported 1.3687 for Keras's 1.3633 in
    # the second epoch (0.46 more after 2 epochs of 1,000 rows). Evaluate's outputs keep their mask: its
    # metrics count unmasked timesteps only (here the tagger has learned them), a short last batch's too.
    assert_same_run(got, want, rtol=1e-4)


@pytest.mark.parametrize("n", [3, 8])
def test_a_masked_sequence_tagger_gives_keras_losses_metrics_and_weights(keras_run, n):
    _assert_same(_run(n), keras_run)


def test_a_masked_output_beside_an_unmasked_one_gives_keras_numbers():
    # Keras multiplies each output's losses and mask by the weight without broadcasting: the padding
    # mask's (batch,) weight, given to both outputs, made the tags' loss raise on 8 devices.
    _assert_same(_run(8, _tagger_and_classifier, two_outputs=True),
                 _run(None, _tagger_and_classifier, two_outputs=True))


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
def test_a_per_process_pipeline_padding_a_masked_batch_gives_keras_numbers(reduction):
    # A per-process pipeline's short batch stays padded and masked (only the devices know the global
    # count). Keras divides a masked loss by all the batch's unmasked timesteps: with the padding's
    # weight zero and the real rows scaled by rows / real rows, the loss and its gradient were the
    # wrong mean (1.6411 for Keras's 1.5979 in the first epoch of a longer run; the weights 7e-3 apart).
    # A summed loss takes the real rows' unmasked entries' sum, unscaled.
    x, y = _data()
    keras.utils.set_random_seed(1)
    model = _tagger(reduction)
    want = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    want_evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)

    s = mx.MirroredStrategy(devices=jax.devices()[:4])

    def pipeline(ctx):
        return [(x[lo:lo + BATCH], y[lo:lo + BATCH]) for lo in range(0, ROWS, BATCH)]

    keras.utils.set_random_seed(1)
    with s.scope():
        scoped = _tagger(reduction)
    trainer = mx.Trainer(scoped, s)
    history = trainer.fit(s.distribute_datasets_from_function(pipeline), batch_size=BATCH, epochs=2,
                          verbose=0).history
    evaluated = trainer.evaluate(s.distribute_datasets_from_function(pipeline), batch_size=BATCH, verbose=0)
    _assert_same((history, evaluated, scoped.get_weights()), (want, want_evaluated, model.get_weights()))
