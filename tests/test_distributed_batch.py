"""A distributed batch however the user holds it (``mirrorax.steps.distributed_batch``): whole, unpacked in the loop
(``for x, y in dist``), a dict's entries, a named tuple's fields, a dataset of one array; and what a step
gets of each: the real rows, exactly as of the whole batch.

The data: 50 rows in global batches of 16 (16, 16, 16 and 2), so the last batch is short on every device
count, and on 3 devices every batch is padded (16 rows on 18 places); each number is checked against
numpy's on the real rows.
"""

from __future__ import annotations

import collections
import functools
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import strategy

import mirrorax as mx

pytestmark = pytest.mark.multi_device

ROWS, BATCH = 50, 16
X = np.arange(1, ROWS + 1, dtype=np.float32)  # row i holds i + 1: a padding row (a copy of a real one) shows
Y = (np.arange(ROWS) % 3).astype(np.int32)
Pair = collections.namedtuple("Pair", ["x", "y"])


def real_batches():
    return [(X[i:i + BATCH], Y[i:i + BATCH]) for i in range(0, ROWS, BATCH)]


def stats(x, y):
    """What a step computes of its batch: reductions over the rows, and the rows it was given."""
    return {"mean": jnp.mean(x), "sum_y": jnp.sum(y), "rows": jnp.asarray(x.shape[0]),
            "max": jnp.max(x), "norm": jnp.mean(jnp.tanh(x / 10) * y)}


def want(x, y):
    return {"mean": x.mean(), "sum_y": y.sum(), "rows": len(x), "max": x.max(), "norm": (np.tanh(x / 10) * y).mean()}


def check(got: list[dict], what: str) -> None:
    for step, (g, (x, y)) in enumerate(zip(got, real_batches(), strict=True)):
        for k, v in want(x, y).items():
            np.testing.assert_allclose(np.asarray(g[k]), v, rtol=1e-6, err_msg=f"{what}: step {step} {k}")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_unpacked_in_the_loop_gives_the_step_the_real_rows(n):
    s = strategy(n)
    step = s.jit(stats)
    check([step(x, y) for x, y in s.experimental_distribute_dataset((X, Y), batch_size=BATCH)], "for x, y in dist")
    # one program per row count, as for the whole batch (the full ones, the short last one)
    assert step.compile_count == 2
    whole = s.jit(lambda b: stats(*b))
    check([whole(b) for b in s.experimental_distribute_dataset((X, Y), batch_size=BATCH)], "whole batch")


def test_the_issue_s_example_on_three_devices():
    # 32 rows on 3 devices: 33 places, one padding row (a copy of row 1).
    s = strategy(3)
    x, y = np.arange(1, 33, dtype=np.float32), np.arange(32, dtype=np.float32)
    mean = keras.metrics.Mean()
    for xb, yb in s.experimental_distribute_dataset((x, y), batch_size=32):
        assert float(s.jit(lambda a, b: jnp.mean(a))(xb, yb)) == 16.5
        s.run(lambda a, b: mean.update_state(a), args=(xb, yb))
    assert float(mean.result()) == 16.5 and float(mean.count.value) == 32


@pytest.mark.parametrize("form", ["dict entries", "named tuple fields", "nested", "a slice of the tree"])
def test_every_way_of_holding_a_piece(form):
    s = strategy(3)
    step = s.jit(stats)
    got = []
    if form == "dict entries":
        for batch in s.experimental_distribute_dataset({"image": X, "label": Y}, batch_size=BATCH):
            got.append(step(batch["image"], batch["label"]))
    elif form == "named tuple fields":
        for batch in s.experimental_distribute_dataset(Pair(X, Y), batch_size=BATCH):
            assert isinstance(batch.data, Pair)
            got.append(step(batch.x, batch.data.y))  # the batch's attribute, its data's attribute
    elif form == "nested":
        for (x, _), y in s.experimental_distribute_dataset(((X, X * 2), Y), batch_size=BATCH):
            got.append(step(x, y))
    else:
        for batch in s.experimental_distribute_dataset({"inputs": (X,), "label": Y}, batch_size=BATCH):
            got.append(s.jit(lambda inputs, y: stats(inputs[0], y))(batch["inputs"], batch["label"]))
    check(got, form)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_per_replica_a_keras_metric_and_compute_average_loss_count_the_real_rows(n):
    s = strategy(n)
    mean, count = keras.metrics.Mean(), keras.metrics.Sum()

    def replica(x, y):
        mean.update_state(x)
        count.update_state(jnp.ones_like(x))
        # TF's forms: the step's batch found from its pieces, and a piece given as the batch
        return mx.compute_average_loss(x), mx.masked_mean(y, x), x * 2

    means, y_means, doubled = [], [], []
    for x, y in s.experimental_distribute_dataset((X, Y), batch_size=BATCH):
        share, y_share, twice = s.run(replica, args=(x, y))
        means.append(s.reduce("sum", share))
        y_means.append(s.reduce("sum", y_share))
        doubled.append(s.gather(twice))
    assert float(mean.result()) == pytest.approx(X.mean(), rel=1e-6) and float(count.result()) == ROWS
    for (x, y), m, ym, d in zip(real_batches(), means, y_means, doubled, strict=True):
        assert float(m) == pytest.approx(x.mean(), rel=1e-6) and float(ym) == pytest.approx(y.mean(), rel=1e-6)
        np.testing.assert_array_equal(d, x * 2)  # per-example outputs: the real rows only, once


def test_a_dataset_of_one_array_gives_arrays():
    s = strategy(3)
    got = []
    for xb in s.experimental_distribute_dataset(X.reshape(ROWS, 1), batch_size=BATCH):
        assert isinstance(xb, jax.Array) and xb.shape == (18, 1)  # outside a step: the placed rows
        got.append(s.jit(lambda a: stats(a.reshape(-1), jnp.zeros(a.shape[0], jnp.int32)))(xb))
    for g, (x, _) in zip(got, real_batches(), strict=True):
        assert float(g["mean"]) == pytest.approx(x.mean()) and int(g["rows"]) == len(x)


def test_an_array_computed_outside_the_step_joins_its_batch_or_is_named():
    s = strategy(3)
    step = s.jit(stats)
    # beside a piece of its batch: the same rows and layout, so the same real rows
    check([step(x / 1, y) for x, y in s.experimental_distribute_dataset((X, Y), batch_size=BATCH)], "x / 1")
    # alone, with its batch alive: the one padded batch of those rows is its batch, so the step gets the real
    # rows (computed from the batch in the loop: x + 0, the transposed stack of jnp.array(batch).T)
    mean = s.jit(lambda a: jnp.mean(a))
    (x, y), = list(s.experimental_distribute_dataset((X[:16], Y[:16]), batch_size=BATCH))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(mean(x + 0)) == pytest.approx(X[:16].mean())
    # with two padded batches of those rows alive, whose it is cannot be told: the step would see the padding,
    # and says so
    (x2, y2), = list(s.experimental_distribute_dataset((X[16:32], Y[16:32]), batch_size=BATCH))
    with pytest.warns(mx.PaddingIgnoredWarning, match=r"received argument\[0\] with the rows of a padded batch.*"
                                                      r"no piece of that batch beside it"):
        mean(x + 0)


@pytest.mark.parametrize("run", [False, True])
def test_a_batch_given_whole_from_the_host_is_warned(run):
    s = strategy(2)
    x, y = X[:16].reshape(16, 1), Y[:16]
    fn = s.jit(lambda x, y: jnp.mean(x))
    call = (lambda: s.run(lambda x, y: jnp.sum(x), args=(x, y))) if run else (lambda: fn(x, y))
    effect = "times too large" if run else "no speed-up"
    with pytest.warns(mx.ReplicatedBatchWarning, match=r"arrays that look like a global batch \(argument 0 "
                                                       rf"of shape \(16, 1\), argument 1 of shape \(16,\)\).*{effect}"):
        call()
    # a dict of host arrays too; a state and one constant array are no batch
    with pytest.warns(mx.ReplicatedBatchWarning, match=r"argument 0\['image'\]"):
        s.jit(lambda b: jnp.mean(b["image"]))({"image": x, "label": y})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.jit(lambda state, c: state["w"] * c)({"w": np.ones((4, 1), np.float32), "b": np.ones(1, np.float32),
                                                "scale": np.ones(4, np.float32)}, np.ones(4, np.float32))
        # a square kernel and its bias in a pair are a state, not a batch
        s.jit(lambda p: p[0] @ p[1])((jnp.ones((4, 4)), jnp.ones(4)))


@pytest.mark.parametrize("form", ["jnp", "pair"])
def test_a_jnp_batch_or_a_float_pair_given_whole_is_warned(form):
    """A global batch made with ``jnp`` (the form Flax's guides write: replicated on the devices, not split) and
    a float ``(X, Y)`` pair given as one argument are warned as numpy batches are (they trained with no warning,
    each device on every row)."""
    s = strategy(2)
    x, y = X[:16].reshape(16, 1), Y[:16].astype(np.float32)
    if form == "jnp":
        call = functools.partial(s.jit(lambda x, y: jnp.mean(x * y)), jnp.asarray(x), jnp.asarray(y))
        where = r"argument 0 of shape \(16, 1\), argument 1 of shape \(16,\)"
    else:
        call = functools.partial(s.jit(lambda b: jnp.mean(b[0] * b[1])), (x, y))
        where = r"argument 0\[0\] of shape \(16, 1\), argument 0\[1\] of shape \(16,\)"
    with pytest.warns(mx.ReplicatedBatchWarning, match=rf"look like a global batch \({where}\).*"
                                                       r"experimental_distribute_dataset"):
        call()


def test_nnx_step_given_pieces():
    from flax import nnx

    s = strategy(3)
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))

    @s.jit
    def step(model, x, y):
        return stats(model(x[:, None])[:, 0] * 0 + x, y)

    check([step(model, x, y) for x, y in s.experimental_distribute_dataset((X, Y), batch_size=BATCH)], "nnx")


def test_program_refuses_pieces():
    s = strategy(3)
    (x, y), = list(s.experimental_distribute_dataset((X[:16], Y[:16]), batch_size=BATCH))
    with pytest.raises(TypeError, match=r"pieces of a padded batch.*Call the function itself"):
        s.jit(stats).program(x, y)


def test_a_full_batch_s_pieces_cost_nothing_per_call():
    # A loop over full batches pays nothing per call for pieces: a call looks for them only while a piece of a
    # padded batch lives.
    from mirrorax.steps import distributed_batch

    s = strategy(4)
    x, y = next(iter(s.experimental_distribute_dataset((X[:16], Y[:16]), batch_size=BATCH)))
    assert distributed_batch.piece_of(x).full and not distributed_batch.padded_pieces_alive()
    (x, y), (short, _) = list(s.experimental_distribute_dataset((X[:20], Y[:20]), batch_size=BATCH))
    assert not distributed_batch.piece_of(short).full and distributed_batch.padded_pieces_alive()
    del short, _
    assert not distributed_batch.padded_pieces_alive()


def test_a_full_batch_beside_the_next_padded_one_is_no_stray():
    # The next batch is placed while a step runs: a full batch's array (or one computed from it) beside a
    # living padded batch of the same rows is not taken for a stray piece of it. (Two devices: on one, a batch
    # is the host's arrays and a short one its real rows, never padded.)
    from mirrorax.steps import distributed_batch

    s = strategy(2)
    step = s.jit(lambda x: jnp.mean(x))
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, _) in enumerate(s.experimental_distribute_dataset((X, Y), batch_size=BATCH)):
            step(x)  # (dispatched: the next batch is placed now)
            got.append(float(step(x * 1)))
            if i == 2:
                assert distributed_batch.padded_pieces_alive()  # the last batch, 2 real rows of 16
                break
    assert got == [x.mean() for x, _ in real_batches()][:3]


def _keras_loop(n: int, unpacked: bool, per_replica: bool) -> dict:
    """TF's custom-training step with Keras objects (a tape, ``apply_gradients``, a Keras metric), its batch
    given whole (``images, labels = inputs`` in the step) or unpacked in the loop (``for x, y in dist``)."""
    keras.utils.set_random_seed(3)
    s = strategy(n)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
    optimizer = keras.optimizers.Adam(1e-2)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(x, y):
        def tape():
            predictions = model(x[:, None] / 50, training=True)
            return mx.compute_average_loss(loss_object(y, predictions)), predictions

        (loss, predictions), gradients = mx.value_and_grad(tape, model, has_aux=True)()
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        accuracy.update_state(y, predictions)
        return loss

    def whole(inputs):
        images, labels = inputs
        return step(images, labels)

    if per_replica:
        call = (lambda x, y: s.run(step, args=(x, y))) if unpacked else (lambda b: s.run(whole, args=(b,)))
    else:
        call = s.jit(step) if unpacked else s.jit(whole)
    losses = []
    for _ in range(2):
        for batch in s.experimental_distribute_dataset((X, Y), batch_size=BATCH):
            loss = call(*batch) if unpacked else call(batch)
            losses.append(float(s.reduce("sum", loss) if per_replica else loss))
    return {"losses": losses, "accuracy": float(accuracy.result()), "count": float(accuracy.count.value),
            "weights": model.get_weights()}


@pytest.mark.parametrize("per_replica", [False, True])
def test_a_keras_step_given_pieces_equals_the_whole_batch_and_one_device(per_replica):
    one = _keras_loop(1, unpacked=False, per_replica=False)
    whole, pieces = (_keras_loop(3, unpacked=u, per_replica=per_replica) for u in (False, True))
    assert pieces["count"] == whole["count"] == one["count"] == 2 * ROWS
    for got in (whole, pieces):
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5)
        assert got["accuracy"] == pytest.approx(one["accuracy"], rel=1e-6)
        for a, b in zip(got["weights"], one["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("source", ["arrays", "arrays shuffled", "iterable", "one array"])
def test_on_one_device_a_batch_is_the_hosts_arrays_which_the_step_transfers(source):
    """On one device of one process a batch is not placed: its arrays are the host's (an iterable's items
    themselves; an array dataset's rows cut from read-only views, so that an in-place edit cannot reach the user's
    arrays), the short last batch its real rows (one device holds every row: nothing to pad), and the step's
    dispatch transfers them as jax.jit does Flax's loop's numpy batch. The rows and their order are those of the
    placed batches of two devices; where a transfer guard logs implicit transfers, the batches are placed."""
    items = real_batches()
    data, kw = {"arrays": ((X, Y), {"batch_size": BATCH}),
                "arrays shuffled": ((X, Y), {"batch_size": BATCH, "shuffle": True, "seed": 4}),
                "iterable": (items, {}), "one array": (X, {"batch_size": BATCH})}[source]

    def leaves(b):
        return b.data if isinstance(b, mx.DistributedBatch) else (b,)

    s = strategy(1)
    for _ in range(2):  # (a second pass: the batches known by their signature from the first)
        batches = [leaves(b) for b in s.experimental_distribute_dataset(data, **kw)]
        assert [type(b[0]) for b in batches] == [np.ndarray] * 4
        assert [len(b[0]) for b in batches] == [16, 16, 16, 2]  # (not padded: 2 rows, not 16)
    placed = [[np.asarray(a)[:len(b[0])] for a in leaves(p)] for b, p in
              zip(batches, strategy(2).experimental_distribute_dataset(data, **kw), strict=True)]
    for b, p in zip(batches, placed):
        assert isinstance(p[0], np.ndarray) and len(b) == len(p)
        for u, v in zip(b, p):
            np.testing.assert_array_equal(u, v)
    if source == "iterable":  # the loader's own arrays
        assert all(b[0] is x and b[1] is y for b, (x, y) in zip(batches, items))
    else:
        for b in batches:
            x = b[0]
            try:
                x += 1  # a view of the user's rows refuses; a copy (shuffled rows, the short batch) takes it
            except ValueError as e:
                assert "read-only" in str(e)
        np.testing.assert_array_equal(X, np.arange(1, ROWS + 1))
    if source in ("arrays", "iterable"):
        step = s.jit(stats)
        check([step(x, y) for x, y in s.experimental_distribute_dataset(data, **kw)], source)
    with jax.transfer_guard_host_to_device("log"):
        first = next(iter(s.experimental_distribute_dataset(data, **kw)))
    assert isinstance(leaves(first)[0], jax.Array)
