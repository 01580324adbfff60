"""Custom training loops on the strategy's own API, and the three examples in ``examples/``.

Examples: each is run on 1 device and on device counts that do not divide its global batch (every
batch then carries padding rows) on uneven data (the last batch is short too), and must give the same
weights: the keras.io guide's loop and the GAN on 2, 3 and 4 devices and on 2 processes x 2 devices, TF's
tutorial (its Keras metrics printed) on 2 and 3. Measured (each example's ``main``): keras_io_guide
<= 2.7e-6 (its BatchNormalization + Adam: Adam's step divides by the gradient's scale, so rounding in a
near-zero gradient component moves a weight by ~1e-6; with SGD the same run differs by 6e-8), gan
<= 1.5e-7, tf_custom_loop (``strategy.run`` on 3 devices vs the global view on 1) 6e-8. The tolerance
(atol 1e-5 on weights) leaves room for float32 reassociation, not for a wrong gradient scale:
tf_custom_loop's per-replica step uses SGD, whose step scales with the gradient (Adam's would hide a
gradient summed twice: 4e-5 after 2 epochs).
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import changed_lines, example, strategy

import mirrorax as mx
from mirrorax.steps import dispatch

pytestmark = pytest.mark.multi_device

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"



def _assert_trees_close(a, b, atol: float) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for i, (u, v) in enumerate(zip(la, lb)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=0, atol=atol, err_msg=f"leaf {i}")


def _batches(dist):
    """Every batch of one pass as host values: (data, mask, num_real)."""
    return [(jax.tree.map(np.asarray, b.data), np.asarray(b.mask), float(b.num_real)) for b in dist]


# -- the examples ------------------------------------------------------------------------------------
_ONE_DEVICE: dict[str, dict] = {}


def _one_device(name: str) -> dict:
    """An example's ``main`` on one device, made once per module (each other device count compares with it)."""
    if name not in _ONE_DEVICE:
        _ONE_DEVICE[name] = example(name).main(num_devices=1, verbose=False)
    return _ONE_DEVICE[name]


@pytest.mark.slow  # an example's training, on two device counts
@pytest.mark.parametrize("n", [2, 3, 4])
def test_keras_io_guide_equals_one_device(n):
    # 200 digits in batches of 64: 3 full, the last 8 rows; on 3 devices 64 rows are padded to 66. The
    # model keeps the guide's BatchNormalization and Dropout: the step sees the real rows only, so their
    # statistics and masks are one device's.
    one = _one_device("keras_io_guide")
    many = example("keras_io_guide").main(num_devices=n, verbose=False)
    _assert_trees_close(one["weights"], many["weights"], atol=1e-5)
    np.testing.assert_allclose(one["losses"], many["losses"], rtol=1e-5)
    assert one["losses"][1] < one["losses"][0]


@pytest.mark.slow  # an example's training, on two device counts
def test_tf_custom_loop_per_replica_equals_global_view():
    tf_loop = example("tf_custom_loop")
    global_view = tf_loop.main(num_devices=1, mode="jit", verbose=False)
    per_replica = tf_loop.main(num_devices=3, mode="run", verbose=False)
    _assert_trees_close(global_view["weights"], per_replica["weights"], atol=1e-5)
    for key in ("train_loss", "test_loss"):
        np.testing.assert_allclose(global_view[key], per_replica[key], rtol=1e-5)
    for key in ("train_accuracy", "test_accuracy"):
        assert global_view[key] == per_replica[key]
    assert per_replica["train_loss"][1] < per_replica["train_loss"][0]


@pytest.mark.slow  # an example's training, on two device counts
@pytest.mark.parametrize("n", [2, 3, 4])
def test_gan_trains_and_equals_one_device(n):
    gan = example("gan")
    one = _one_device("gan")
    many = gan.main(num_devices=n, verbose=False)  # 1,030 points in batches of 100: the last 30 (padded on 3, 4)
    _assert_trees_close(one["generator"], many["generator"], atol=1e-5)
    _assert_trees_close(one["discriminator"], many["discriminator"], atol=1e-5)
    np.testing.assert_allclose(one["d_losses"], many["d_losses"], rtol=1e-5)
    np.testing.assert_allclose(one["g_losses"], many["g_losses"], rtol=1e-5)
    # The generated points walk toward the real ones, epoch after epoch.
    distance = np.linalg.norm(np.asarray(many["fake_means"]) - gan.REAL_MEAN, axis=1)
    assert np.all(np.diff(distance) < 0), distance
    assert distance[-1] < 0.25 * distance[0], distance
    # The discriminator wins at first (loss well below log 4, its loss when it cannot tell real from
    # fake); as the generator catches up, the discriminator's loss rises and the generator's falls.
    assert many["d_losses"][0] < math.log(4) - 0.2, many["d_losses"]
    assert many["d_losses"][-1] > many["d_losses"][0] + 0.1, many["d_losses"]
    assert many["g_losses"][-1] < many["g_losses"][0], many["g_losses"]


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.timeout(300)
def test_examples_on_two_processes_equal_one_device(tmp_path):
    """The keras.io guide's loop, the GAN, a per-replica evaluation loop (a Keras metric, predictions
    gathered across steps) and batches unpacked in the loop on 2 processes x 2 devices, uneven data: every
    process gets one device's numbers."""
    from jobs import custom_loops
    from jobs.procs import clean_env, launcher, python, run_all

    cmd = launcher("--nprocs", "2", "--cpu-devices-per-proc", "2", "--failure-timeout", "20", "--",
                   *python("tests/jobs/custom_loops.py"))
    codes, outs, _ = run_all([cmd], [clean_env(MP_OUT=str(tmp_path))], timeout=280)
    assert codes[0] == 0, outs[0][-5000:]
    assert "process 1 of 2: 4 replicas in sync" in outs[0], outs[0][-5000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    want = custom_loops.results(1)
    assert sorted(ranks[0]) == sorted(want)
    for key in want:
        np.testing.assert_allclose(ranks[0][key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert ranks[0]["rows['count']"] == custom_loops.ROWS and len(ranks[0]["rows['predictions']"]) == custom_loops.ROWS
    # batches unpacked in the loop: each step's real rows (16, 16, 16, 2), the metric's 50
    assert ranks[0]["pieces['count']"] == custom_loops.ROWS
    assert ranks[0]["pieces['steps']"][:, 2].tolist() == [16, 16, 16, 2]
    assert ranks[0]["pieces['steps']"][:, 0].tolist() == [8.5, 24.5, 40.5, 49.5]
    # and read on the host (gather, reduce over the examples): the real rows, not the short batch's padding
    assert ranks[0]["pieces['gathered']"].tolist() == [i % 3 for i in range(custom_loops.ROWS)]
    assert ranks[0]["pieces['sums']"].tolist() == [136, 392, 648, 99]


# -- DistributedBatch ---------------------------------------------------------------------------------
def test_arrays_are_cut_padded_and_masked():
    s = strategy(3)
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10, dtype=np.int32)
    dist = s.experimental_distribute_dataset({"x": x, "y": y}, batch_size=4)
    assert len(dist) == 3
    batches = list(dist)
    assert [float(b.num_real) for b in batches] == [4, 4, 2]
    for b in batches:
        assert set(b.data) == {"x", "y"}
        assert b.data["x"].shape == (6, 2) and b.data["y"].shape == (6,) and b.mask.shape == (6,)
        assert b.data["x"].dtype == np.float32 and b.data["y"].dtype == np.int32 and b.mask.dtype == np.float32
        assert b.data["x"].sharding.spec == jax.sharding.PartitionSpec("batch")
        assert b.mask.sharding.spec == jax.sharding.PartitionSpec("batch")
        assert b.num_real.sharding.is_fully_replicated
    host = _batches(s.experimental_distribute_dataset({"x": x, "y": y}, batch_size=4))
    np.testing.assert_array_equal(host[0][1], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(host[2][1], [1, 1, 0, 0, 0, 0])
    real = np.concatenate([d["y"][m > 0] for d, m, _ in host])
    np.testing.assert_array_equal(real, y)  # every example once, in order
    for d, m, _ in host:  # padding rows are copies of real rows: harmless inputs
        assert set(d["y"][m == 0]) <= set(d["y"][m > 0])


def test_iterable_of_ragged_batches():
    s = strategy(3)
    rng = np.random.default_rng(0)
    items = [(rng.normal(size=(n, 3)).astype(np.float32), np.arange(n)) for n in (5, 5, 2)]
    host = _batches(s.experimental_distribute_dataset(items))
    assert [n for _, _, n in host] == [5, 5, 2]
    for (xb, yb), mask, n in host:
        assert xb.shape == (6, 3) and yb.shape == (6,)  # 5 rows rounded up to the device count
        assert mask.sum() == n
    np.testing.assert_array_equal(host[2][0][0][host[2][1] > 0], items[2][0])
    # dict-structured items keep their structure
    dicts = [{"image": np.ones((n, 2, 2), np.float32), "label": np.zeros((n,), np.int32)} for n in (4, 1)]
    batches = list(s.experimental_distribute_dataset(dicts))
    assert set(batches[1].data) == {"image", "label"}
    assert batches[1].data["image"].shape == (6, 2, 2) and float(batches[1].num_real) == 1
    # a later item larger than the first (the batch size) is refused, with the fix in the message
    with pytest.raises(ValueError, match="batch_size"):
        list(s.experimental_distribute_dataset([(np.ones((3, 1)),), (np.ones((4, 1)),)]))


def test_shuffle_is_reproducible_and_independent_of_the_device_count():
    x = np.arange(23, dtype=np.int32)

    def orders(n: int, seed: int) -> list[np.ndarray]:
        dist = strategy(n).experimental_distribute_dataset((x,), batch_size=8, shuffle=True, seed=seed)
        return [np.concatenate([d[0][m > 0] for d, m, _ in _batches(dist)]) for _ in range(2)]

    one, three, eight = orders(1, 5), orders(3, 5), orders(8, 5)
    for a, b, c in zip(one, three, eight):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(np.sort(a), x)  # a permutation: every example once
    assert not np.array_equal(one[0], one[1])  # each pass has its own order
    np.testing.assert_array_equal(orders(3, 5)[0], three[0])  # same seed, same orders
    assert not np.array_equal(orders(1, 6)[0], one[0])


# -- replicate ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_replicate_reuses_the_callers_buffers_as_device_put_does(n):
    """replicate copied every array (a second live state: the keras.io guide's LM held 5,218 MiB on a TPU
    against the hand loop's 2,708): it now keeps the buffers already on the devices, as jax.device_put."""
    s = strategy(n)
    placed = s.replicate({"w": np.arange(4, dtype=np.float32)})
    on_one_device = jax.device_put(jnp.arange(4, dtype=np.float32), jax.devices()[0])
    state = s.replicate({"w": placed["w"], "v": on_one_device, "u": on_one_device})
    assert all(a.sharding.is_equivalent_to(s.replicated, 1) for a in state.values())
    assert state["w"] is placed["w"]  # laid out as asked: used as it is
    d0 = jax.devices()[0]

    def on_d0(a):
        return next(sh.data.unsafe_buffer_pointer() for sh in a.addressable_shards if sh.device == d0)

    # No copy where the array already lies; given twice, one of the two is copied, to be donated safely.
    assert sorted(on_d0(state[k]) == on_d0(on_one_device) for k in ("u", "v")) == [False, True]

    @s.jit(donate_argnums=0)
    def step(state):
        return jax.tree.map(lambda a: a + 1, state)

    new = step(state)
    np.testing.assert_array_equal(np.asarray(new["u"]), np.arange(1, 5))
    assert placed["w"].is_deleted()  # donated, as after jax.device_put


def test_replicate_copy_never_aliases_the_callers_buffers():
    s = strategy(3)
    original = s.replicate({"w": np.arange(4, dtype=np.float32)})
    on_one_device = jnp.arange(4, dtype=np.float32)
    copy = s.replicate({"w": original["w"], "v": on_one_device}, copy=True)
    assert copy["w"].sharding == s.replicated and copy["v"].sharding == s.replicated

    @s.jit(donate_argnums=0)
    def step(state):
        return jax.tree.map(lambda a: a + 1, state)

    new = step(copy)
    assert copy["w"].is_deleted()  # the donated copy is gone ...
    assert not original["w"].is_deleted() and not on_one_device.is_deleted()  # ... the originals live
    np.testing.assert_array_equal(np.asarray(original["w"]), np.arange(4))
    np.testing.assert_array_equal(np.asarray(on_one_device), np.arange(4))
    np.testing.assert_array_equal(np.asarray(new["v"]), np.arange(1, 5))


# -- jit ------------------------------------------------------------------------------------------------
def _linear_step(s):
    @s.jit(donate_argnums=0)
    def step(params, batch):
        x, y = batch.data

        def loss_fn(p):
            return mx.compute_average_loss((x @ p["w"] + p["b"] - y) ** 2, batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        per_example = (x @ params["w"] + params["b"] - y) ** 2
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss, per_example

    return step


def _linear_data(n: int = 22):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def test_jit_compiles_once_per_row_count_and_lays_out_outputs():
    s = strategy(3)
    step = _linear_step(s)
    params = s.replicate({"w": np.zeros(3, np.float32), "b": np.float32(0)})
    dist = s.experimental_distribute_dataset(_linear_data(), batch_size=8)  # 8, 8, 6: padded to 9 rows
    per_examples = []
    for _ in range(2):
        for batch in dist:
            params, loss, per_example = step(params, batch)
            per_examples.append(per_example)
    assert step.compile_count == 2  # the batches of 8 real rows, and the short one of 6 (TF retraces too)
    assert all(p.sharding == s.replicated for p in jax.tree.leaves(params))  # the state stays replicated
    assert loss.shape == () and loss.sharding == s.replicated
    # one value per example: the real rows only (the step never saw the padding), whole on every device
    assert [p.shape for p in per_examples[:3]] == [(8,), (8,), (6,)]
    assert per_example.sharding == s.replicated
    np.testing.assert_array_equal(s.gather(per_example), np.asarray(per_example))  # once, not once per replica
    assert [r.shape for r in s.experimental_local_results(per_examples[0])] == [(3,), (3,), (2,)]  # rows 0-2, 3-5, 6-7
    # a batch with no padding (9 rows on 3 devices) keeps its per-example values split
    even = next(iter(s.experimental_distribute_dataset(_linear_data(9), batch_size=9)))
    _, _, per_example = step(params, even)
    assert per_example.shape == (9,) and per_example.sharding == s.batch_sharding
    assert step.compile_count == 3


def test_a_loop_of_one_signature_looks_its_arguments_up_once(monkeypatch):
    """Steps of one signature run the last call's program without a per-leaf look at the arguments (about a
    microsecond a leaf on the host, every step); a call of another signature (the short last batch, a new
    dtype) still finds its own program, and its padding is still left out."""
    from mirrorax.steps.dispatch import StrategyFunction

    looked = []
    signature = StrategyFunction.signature
    monkeypatch.setattr(StrategyFunction, "signature", lambda self, *a: (looked.append(1), signature(self, *a))[1])
    s = strategy(3)
    step = _linear_step(s)
    x, y = _linear_data(40)  # 8 x 5 rows, then a batch of 8 real rows split over 3 devices: 9 with padding
    params = s.replicate({"w": np.zeros(3, np.float32), "b": np.float32(0)})
    full = list(s.experimental_distribute_dataset((x[:24], y[:24]), batch_size=6))  # 4 batches, no padding
    for batch in full[:2]:
        params, _, _ = step(params, batch)
    before = len(looked)
    for batch in full[2:] * 3:
        params, loss, _ = step(params, batch)
    assert len(looked) == before  # 6 more steps, no signature looked up
    w, b = np.asarray(params["w"]), float(params["b"])  # (the step donates params)
    short = next(iter(s.experimental_distribute_dataset((x[:8], y[:8]), batch_size=8)))
    _, loss, per_example = step(params, short)  # another signature after fast calls: its own program
    want = (x[:8] @ w + b - y[:8]) ** 2
    np.testing.assert_allclose(np.asarray(per_example), want, rtol=1e-5)  # the 8 real rows, no padding row
    np.testing.assert_allclose(float(loss), want.mean(), rtol=1e-5)
    assert len(looked) > before
    f = s.jit(lambda a: a * 2)
    for a in (np.ones(3, np.float32), np.ones(3, np.float32), np.ones(3, np.int32), np.ones(4, np.float32)):
        out = f(s.replicate(a))
        assert out.dtype == a.dtype and out.shape == a.shape  # a new dtype or shape: traced, not the last program
        np.testing.assert_array_equal(np.asarray(out), a * 2)
    assert step.compile_count == 2


def test_jit_matches_one_device_with_sgd():
    x, y = _linear_data()

    def train(n: int):
        s = strategy(n)
        step = _linear_step(s)
        params = s.replicate({"w": np.zeros(3, np.float32), "b": np.float32(0)})
        losses = []
        for batch in s.experimental_distribute_dataset((x, y), batch_size=8):
            params, loss, _ = step(params, batch)
            losses.append(float(loss))
        return jax.tree.map(np.asarray, params), losses

    (p1, l1), (p3, l3) = train(1), train(3)
    _assert_trees_close(p1, p3, atol=1e-6)
    np.testing.assert_allclose(l1, l3, rtol=1e-6)
    # first step's loss is the mean over the 8 real rows, not over the 9 padded ones
    np.testing.assert_allclose(l1[0], np.mean(y[:8] ** 2), rtol=1e-6)


def test_dispatch_waits_for_the_previous_call_never_the_current(monkeypatch):
    s = strategy(2)
    pushed, waited = [], []
    real_wait = dispatch.wait
    # Record what the host waits on, and still wait (steps with collectives must not pile up).
    monkeypatch.setattr(dispatch, "wait", lambda x: (waited.append(x), real_wait(x))[1])
    push = s.in_flight.push
    monkeypatch.setattr(s.in_flight, "push", lambda token: (pushed.append(token), push(token))[1])
    step = _linear_step(s)
    params = s.replicate({"w": np.zeros(3, np.float32), "b": np.float32(0)})
    batch = next(iter(s.experimental_distribute_dataset(_linear_data(), batch_size=8)))

    def count(params, batch):
        return jnp.sum(batch.mask)

    for i in range(4):
        if i % 2:  # strategy.run shares the window with strategy.jit
            s.run(count, args=(params, batch))
        else:
            params, _, _ = step(params, batch)
        assert len(pushed) == i + 1
        # after dispatching call i the host has waited for calls 0 .. i-1, never for call i
        assert [id(t) for t in waited] == [id(t) for t in pushed[:i]]


def test_max_in_flight_one_waits_for_each_call(monkeypatch):
    s = mx.MirroredStrategy(devices=jax.devices()[:2], max_in_flight=1)
    waited = []
    real_wait = dispatch.wait
    monkeypatch.setattr(dispatch, "wait", lambda x: (waited.append(x), real_wait(x))[1])
    f = s.jit(lambda a: a * 2)
    a = s.replicate(np.ones(2, np.float32))
    for i in range(3):
        a = f(a)
        assert len(waited) == i + 1
    with pytest.raises(ValueError, match="max_in_flight"):
        mx.MirroredStrategy(max_in_flight=0)


# -- run ------------------------------------------------------------------------------------------------
def test_run_replica_context_and_output_kinds():
    s = strategy(3)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    batch = next(iter(s.experimental_distribute_dataset((x,), batch_size=6)))
    assert mx.get_replica_context() is None  # outside strategy.run

    def fn(batch):
        ctx = mx.get_replica_context()
        (rows,) = batch.data
        local = jnp.sum(rows)
        return {"id": ctx.replica_id_in_sync_group, "n": ctx.num_replicas_in_sync, "local": local,
                "sum": ctx.all_reduce("sum", local), "mean": ctx.all_reduce(mx.ReduceOp.MEAN, local),
                "max": ctx.all_reduce("MAX", local), "rows": rows * 2}

    out = s.run(fn, args=(batch,))
    np.testing.assert_array_equal(np.asarray(out["id"]), [0, 1, 2])
    assert out["id"].sharding == s.batch_sharding  # varies over the replicas: one value each
    locals_ = x.reshape(3, 2, 2).sum(axis=(1, 2))
    np.testing.assert_array_equal(np.asarray(out["local"]), locals_)
    for key, want in (("sum", locals_.sum()), ("mean", locals_.mean()), ("max", locals_.max())):
        assert out[key].shape == () and out[key].sharding == s.replicated, key  # equal everywhere
        np.testing.assert_allclose(float(out[key]), want, rtol=1e-6)
    assert int(out["n"]) == 3
    np.testing.assert_array_equal(s.gather(out["rows"]), x * 2)  # per-replica rows, in replica order


def test_run_gradient_of_the_state_is_already_summed():
    """The all_reduce bug: summing the replicas' gradients again multiplied them by the replica count."""
    s = strategy(3)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    batch = next(iter(s.experimental_distribute_dataset((x,), batch_size=6)))
    w = s.replicate(np.ones(2, np.float32))

    def grad(w, batch):
        (rows,) = batch.data
        return jax.grad(lambda w: mx.compute_average_loss(rows @ w, batch))(w)

    np.testing.assert_allclose(np.asarray(s.run(grad, args=(w, batch))), x.mean(axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="already the same on every replica"):
        s.run(lambda w, b: mx.get_replica_context().all_reduce("sum", grad(w, b)), args=(w, batch))


def test_run_keeps_the_state_replicated_and_compiles_once():
    s = strategy(3)
    x, y = _linear_data()

    def replica_step(params, batch):
        xb, yb = batch.data
        loss, grads = jax.value_and_grad(
            lambda p: mx.compute_average_loss((xb @ p["w"] + p["b"] - yb) ** 2, batch))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    params = s.replicate({"w": np.zeros(3, np.float32), "b": np.float32(0)})
    losses = []
    for batch in s.experimental_distribute_dataset((x, y), batch_size=8):
        params, per_replica = s.run(replica_step, args=(params, batch))
        losses.append(s.reduce("sum", per_replica))
    assert all(p.sharding == s.replicated for p in jax.tree.leaves(params))
    assert per_replica.shape == (3,) and per_replica.sharding == s.batch_sharding
    assert s._run_functions[replica_step].compile_count == 1
    # the same numbers as the global view on one device
    ref = strategy(1)
    step = _linear_step(ref)
    ref_params = ref.replicate({"w": np.zeros(3, np.float32), "b": np.float32(0)})
    ref_losses = []
    for batch in ref.experimental_distribute_dataset((x, y), batch_size=8):
        ref_params, loss, _ = step(ref_params, batch)
        ref_losses.append(float(loss))
    _assert_trees_close(ref_params, params, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


# -- reduce and gather ----------------------------------------------------------------------------------
def test_reduce_and_gather():
    s = strategy(3)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    split = jax.device_put(x, s.batch_sharding)  # replica r holds rows 2r, 2r+1
    per_replica = x.reshape(3, 2, 2)
    np.testing.assert_allclose(s.reduce("sum", split), per_replica.sum(axis=0))
    np.testing.assert_allclose(s.reduce(mx.ReduceOp.MEAN, split), per_replica.mean(axis=0))
    np.testing.assert_allclose(s.reduce("max", split), per_replica.max(axis=0))
    np.testing.assert_allclose(s.reduce("sum", split, axis=0), x.sum(axis=0))  # over examples too
    np.testing.assert_allclose(s.reduce("mean", split, axis=1), per_replica.mean(axis=0).mean(axis=1))
    np.testing.assert_array_equal(s.gather(split), x)
    np.testing.assert_array_equal(s.gather(split, axis=1), np.concatenate(list(per_replica), axis=1))
    # a replicated value counts once per replica (TF's rule for mirrored values)
    replicated = s.replicate(np.float32(2))
    assert float(s.reduce("sum", replicated)) == 6 and float(s.reduce("mean", replicated)) == 2
    np.testing.assert_array_equal(s.gather(replicated), [2, 2, 2])
    # pytrees, and scalars per replica from strategy.run
    tree = s.reduce("sum", {"a": split, "b": [split]})
    np.testing.assert_allclose(tree["b"][0], per_replica.sum(axis=0))
    ids = s.run(lambda: mx.get_replica_context().replica_id_in_sync_group.astype(jnp.float32))
    assert float(s.reduce("sum", ids)) == 3 and isinstance(s.gather(ids), np.ndarray)


def test_the_hosts_reads_of_a_batch_give_its_real_rows_only():
    """A batch or its pieces read on the host, as TF's input guide does (``experimental_local_results(x)``) or to
    count labels (``reduce("sum", y, axis=0)``): each replica's real rows, never the padding of a short batch.
    Before, 10 rows in batches of 4 on 3 devices (padded to 6) summed their labels to 6, 30, 49 (22 and 17 are
    right), the last batch gathering ``[8, 9, 8, 8, 8, 8]``."""
    s = strategy(3)
    x, y = np.arange(10, dtype=np.float32)[:, None], np.arange(10)
    local, gathered, sums, means, whole = [], [], [], [], []
    for batch in s.experimental_distribute_dataset((x, y), batch_size=4):
        xb, yb = batch
        local.append([r.tolist() for r in s.experimental_local_results(yb)])
        gathered.append(s.gather(yb).tolist())
        sums.append(int(s.reduce("sum", yb, axis=0)))
        means.append(float(s.reduce("mean", xb, axis=0)[0]))
        whole.append([[c.ravel().tolist() for c in r] for r in s.experimental_local_results(batch)])
        with pytest.raises(ValueError, match=r"axis=0"):
            s.reduce("sum", yb)  # element-wise over replicas holding different numbers of real rows: refused
    assert local == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8, 9], [], []]]
    assert gathered == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and sums == [6, 22, 17] and means == [1.5, 5.5, 8.5]
    assert whole == [[[[float(v) for v in r], r] for r in batch] for batch in local]  # a batch is its data
    # a dataset of one array: its batches are pieces too
    assert [s.gather(b).tolist() for b in s.experimental_distribute_dataset(y, batch_size=4)] == gathered
    # full batches (6 rows on 3 devices) hold no padding: every row is read, element-wise sums as before
    full = list(s.experimental_distribute_dataset((x[:6], y[:6]), batch_size=6))[0]
    assert [r.tolist() for r in s.experimental_local_results(full[1])] == [[0, 1], [2, 3], [4, 5]]
    assert s.reduce("sum", full[1]).tolist() == [6, 9]


def test_per_example_outputs_give_the_real_rows_only():
    """Predictions collected over an uneven dataset: every example once, in order, no padding row, per
    replica (run: the replicas keep the padding, gather drops it) and in the global view (jit: the step
    saw the real rows only), on any device count."""
    x, y = _linear_data(22)  # batches of 8, 8, 6: on 3 devices padded to 9 rows; on 4 to 8, 8, 8
    w = np.array([0.5, -1.0, 2.0], np.float32)

    def predict(w, batch):
        return batch.data[0] @ w

    want = x @ w
    for n in (1, 3, 4):
        s = strategy(n)
        dist = s.experimental_distribute_dataset((x, y), batch_size=8)
        params = s.replicate(w)
        jitted = s.jit(predict)
        # asked to stay split: so they do where the real rows divide by the devices, else come back whole
        split = s.jit(predict, out_shardings=s.batch_sharding)
        plain = s.jit(predict, out_shardings=s.batch_sharding, stateful=False)  # the same rule without the trace
        run, glob, local, sums, kept = [], [], [], [], []
        for batch in dist:
            out = s.run(predict, args=(params, batch))
            run.append(s.gather(out))
            local.append(np.concatenate(s.experimental_local_results(out)))
            sums.append(s.reduce("sum", out, axis=0))
            glob.append(np.asarray(jitted(params, batch)))  # the user's own read: real rows only
            rows = split(params, batch)
            kept.append(s.gather(rows))
            assert rows.sharding == (s.batch_sharding if len(rows) % n == 0 else s.replicated)
            np.testing.assert_array_equal(np.asarray(plain(params, batch)), np.asarray(rows))
        for got in (run, local, glob, kept):
            np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-6, err_msg=f"{n} devices")
        np.testing.assert_allclose(sums, [want[:8].sum(), want[8:16].sum(), want[16:].sum()], rtol=1e-5)
        if n == 3:  # the short batch, 6 real rows of 9: the replicas hold 3, 3 and 0 of them
            assert [len(r) for r in s.experimental_local_results(out)] == [3, 3, 0]
            with pytest.raises(ValueError, match=r"axis=0"):
                s.reduce("sum", out)  # element-wise over replicas holding 3, 3 and 0 real rows: refused
            with pytest.raises(ValueError, match=r"axis=0"):
                s.gather(out, axis=1)


def test_errors_say_what_was_received():
    s = strategy(2)
    with pytest.raises(ValueError, match=r"'avg'"):
        s.reduce("avg", np.ones(2))
    batch = next(iter(s.experimental_distribute_dataset((np.ones((4, 2), np.float32),), batch_size=4)))
    with pytest.raises(ValueError, match=r"one value per row.*\(3,\)"):
        mx.compute_average_loss(jnp.ones(3), batch)
    with pytest.raises(TypeError, match="DistributedBatch"):
        mx.compute_average_loss(jnp.ones(4), (np.ones(4),))
    with pytest.raises(ValueError, match="batch_size is required"):
        s.experimental_distribute_dataset((np.ones((4, 2)),))
    step = s.jit(lambda a, scale=1.0: a * scale)  # keywords as jax.jit takes them; a wrong one named by Python
    np.testing.assert_array_equal(step(np.ones(2, np.float32), scale=2.0), [2.0, 2.0])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'scael'"):
        step(np.ones(2, np.float32), scael=2.0)


# -- TF's tutorial, ported with its Keras objects (examples/tf_custom_training.py) ----------------------
def test_tf_custom_training_port_changes_at_most_10_lines():
    changed = changed_lines((EXAMPLES / "tf_custom_training_tf.py").read_text(),
                             (EXAMPLES / "tf_custom_training.py").read_text())
    assert 0 < len(changed) <= 10, changed
    # the count sees a change: one more edited line is counted
    port = (EXAMPLES / "tf_custom_training.py").read_text().replace("EPOCHS = epochs", "EPOCHS = epochs + 0")
    assert len(changed_lines((EXAMPLES / "tf_custom_training_tf.py").read_text(), port)) == len(changed) + 1


def test_tf_multi_worker_ctl_port_changes_at_most_12_lines():
    # TF's multi-worker custom loop (examples/tf_multi_worker_ctl.py; run on 2 processes by
    # tests/test_tf_multi_worker.py): the tape, compute_average_loss, the checkpoint and its manager, the
    # counters as Keras variables, Keras 3's reset_state; the input pipeline and its per-worker paths stay.
    changed = changed_lines((EXAMPLES / "tf_multi_worker_ctl_tf.py").read_text(),
                             (EXAMPLES / "tf_multi_worker_ctl.py").read_text())
    assert 0 < len(changed) <= 12, changed
    assert not any("dataset" in line or "filepath" in line or "cluster_resolver" in line for line in changed), changed


TUTORIAL_ROWS = {"num_train": 300, "num_test": 100}  # at a global batch of 192: 192 + 108, and 100 alone


def _tutorial(n: int, tmp_path) -> dict:
    return example("tf_custom_training").main(devices=jax.devices()[:n], global_batch_size=192,
                                               checkpoint_dir=str(tmp_path / f"ckpt{n}"), **TUTORIAL_ROWS)


@pytest.mark.slow  # the tutorial's convnet trained for 2 epochs
@pytest.mark.parametrize("n", [2, 3])
def test_tf_custom_training_equals_one_device(n, tmp_path):
    """TF's tutorial as ported, on data that does not fill its last global batch: every printed metric of n
    devices is one device's, and each counts the real rows only (Keras metrics in strategy.run given no
    mask). On 3 devices the short train batch leaves replica 2 nothing but padding; 100 test rows too."""
    if "tutorial" not in _ONE_DEVICE:
        _ONE_DEVICE["tutorial"] = _tutorial(1, tmp_path)
    one, many = _ONE_DEVICE["tutorial"], _tutorial(n, tmp_path)
    for run in (one, many):
        assert run["train_rows"] == [300.0, 300.0] and run["test_rows"] == [100.0, 100.0]
        for rows, key in ((300, "train_accuracy"), (100, "test_accuracy")):  # counts of real rows: k / rows
            assert all(abs(a * rows - round(a * rows)) < 1e-4 for a in run[key]), (key, run[key])
    _assert_trees_close(one["weights"], many["weights"], atol=1e-5)
    for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
        np.testing.assert_allclose(one[key], many[key], rtol=1e-5, err_msg=key)
    assert one["train_loss"][1] < one["train_loss"][0]
    for run in (one, many):  # restored from the last epoch's checkpoint into a new model: the same model
        _assert_trees_close(run["weights"], run["restored_weights"], atol=0)
        assert run["eval_accuracy"] == pytest.approx(run["test_accuracy"][-1], abs=1e-7)
