"""Flax NNX programs on the strategy (``mirrorax.nnx``, ``mirrorax.steps.split_merge``): ``@strategy.jit`` in place of
``@nnx.jit``.

N devices == 1 device: an NNX CNN with BatchNorm and Dropout (its own ``nnx.Rngs`` stream), GELU, Adam, on
50 rows in global batches of 16 (the last holds 2), against the engine's own 1-device run. Measured: weights
<= 1.8e-7 (at 2 and 4 devices), metrics <= 1.5e-7 relative, accuracy counts exactly the 50 real rows at
1/2/3/4/8 devices; the engine on 1 device equals ``nnx.jit`` bitwise. Flax's MNIST tutorial, ported by
replacing its three ``@nnx.jit`` and reading its batches through ``experimental_distribute_dataset``
(``examples/flax_nnx_mnist.py``, 5 lines): on 1 device bitwise the original; on 3 devices its training
metrics within 2e-7, its test accuracy and predictions equal (see :func:`test_mnist_port_equals_one_device`
for the one parameter Adam moves on rounding alone).
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import changed_lines, example, strategy
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mirrorax as mx

pytestmark = pytest.mark.multi_device

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "mirrorax"


class CNN(nnx.Module):
    """BatchNorm (its conv has no bias: BatchNorm would cancel it, and Adam moves a weight whose gradient is
    rounding alone by its full step) and Dropout with its own stream; GELU keeps the case well-conditioned."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(8 * 4 * 4, 5, rngs=rngs)

    def __call__(self, x):
        x = nnx.gelu(self.bn(self.conv(x)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        return self.head(self.drop(x.reshape(x.shape[0], -1)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits


def train_step(model, optimizer, metrics, batch):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])


def eval_step(model, metrics, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])


ROWS = 50  # in global batches of 16: 16, 16, 16 and 2


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8, 8, 1)).astype(np.float32)
    return {"x": x, "y": np.argmax(x.reshape(ROWS, -1) @ rng.normal(size=(64, 5)), axis=1)}


def objects():
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def host(tree) -> list[np.ndarray]:
    return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
            for a in jax.tree.leaves(tree)]


def train_step_xy(model, optimizer, metrics, x, y):
    train_step(model, optimizer, metrics, {"x": x, "y": y})


def eval_step_xy(model, metrics, x, y):
    eval_step(model, metrics, {"x": x, "y": y})


def train(n: int | None, epochs: int = 2, unpacked: bool = False) -> dict:
    """``epochs`` of training and evaluation; ``n`` devices under ``strategy.jit``, or ``None``: ``nnx.jit``.
    ``unpacked``: the steps take ``x, y``, unpacked from each batch in the loop (``for x, y in dist``)."""
    model, optimizer, metrics = objects()
    if n is None:
        jit, batches = nnx.jit, lambda: [{k: v[i:i + 16] for k, v in data().items()} for i in range(0, ROWS, 16)]
    else:
        s = strategy(n)
        items = (data()["x"], data()["y"]) if unpacked else data()
        jit, dist = s.jit, s.experimental_distribute_dataset(items, batch_size=16)
        batches = lambda: dist  # noqa: E731
    if unpacked:
        train_fn, eval_fn = jit(train_step_xy), jit(eval_step_xy)
    else:
        train_fn, eval_fn = jit(train_step), jit(eval_step)
    out: dict = {"train": [], "test": [], "counts": []}
    for _ in range(epochs):
        model.train()
        for batch in batches():
            train_fn(model, optimizer, metrics, *(batch if unpacked else (batch,)))
        out["train"].append({k: float(v) for k, v in metrics.compute().items()})
        out["counts"].append(int(metrics.accuracy.count[...]))
        metrics.reset()
        model.eval()
        for batch in batches():
            eval_fn(model, metrics, *(batch if unpacked else (batch,)))
        out["test"].append({k: float(v) for k, v in metrics.compute().items()})
        out["counts"].append(int(metrics.accuracy.count[...]))
        metrics.reset()
    out["state"] = host(nnx.state((model, optimizer)))
    return out


_ONE: dict = {}


def one_device() -> dict:
    if "run" not in _ONE:
        _ONE["run"] = train(1)
    return _ONE["run"]


def assert_same_run(one: dict, many: dict, atol: float) -> None:
    assert many["counts"] == [ROWS] * 4  # the accuracy counted the real rows only, every pass
    for key in ("train", "test"):
        for a, b in zip(one[key], many[key]):
            for name in a:
                np.testing.assert_allclose(b[name], a[name], rtol=1e-5, err_msg=f"{key} {name}")
    assert len(one["state"]) == len(many["state"])
    for i, (a, b) in enumerate(zip(one["state"], many["state"])):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol, err_msg=f"state leaf {i}")


# -- N devices == 1 device ------------------------------------------------------------------------------
def test_three_devices_equal_one():
    # 3 devices do not divide 16: every batch carries padding, and the last (2 real rows) leaves one replica
    # none; BatchNorm's statistics, Dropout's masks and the metrics see the real rows only.
    assert_same_run(one_device(), train(3), atol=1e-5)


@pytest.mark.slow  # a sweep over device counts
@pytest.mark.parametrize("n", [2, 4, 8])
def test_devices_equal_one(n):
    assert_same_run(one_device(), train(n), atol=1e-5)


def test_batch_unpacked_in_the_loop_on_three_devices_equals_one():
    # for x, y in dist: step(..., x, y): each array still knows its batch's real rows (BatchNorm, Dropout, the
    # metrics, Adam on 3 devices, where every batch carries padding).
    assert_same_run(one_device(), train(3, unpacked=True), atol=1e-5)


@pytest.mark.slow  # a sweep over device counts
@pytest.mark.parametrize("n", [4, 8])
def test_batch_unpacked_in_the_loop_equals_one_device(n):
    assert_same_run(one_device(), train(n, unpacked=True), atol=1e-5)


@pytest.mark.slow  # a third training of the same model
def test_one_device_is_nnx_jit():
    # The engine on one device is Flax's own program: the same numbers as nnx.jit, bitwise.
    assert_same_run(train(None), one_device(), atol=0)


def test_state_lives_on_the_devices_and_rngs_advance():
    s = strategy(2)
    model, optimizer, metrics = objects()
    step = s.jit(train_step)
    for batch in s.experimental_distribute_dataset(data(), batch_size=16):
        step(model, optimizer, metrics, batch)
    assert model.conv.kernel[...].sharding == s.replicated  # placed once, written back, kept there
    assert model.bn.mean[...].sharding == s.replicated
    assert int(optimizer.step[...]) == 4 and int(model.drop.rngs.count[...]) == 4  # one Dropout key per step
    assert int(metrics.accuracy.count[...]) == ROWS
    assert step.compile_count == 2  # the full batches and the short one


def test_a_step_that_calls_another_runs_it_inline():
    # As a jax.jit inside a jax.jit: the inner @strategy.jit step runs in the outer step's trace, on its objects.
    s = strategy(3)
    inner = s.jit(train_step)

    @s.jit
    def outer(model, optimizer, metrics, x, y):
        inner(model, optimizer, metrics, {"x": x, "y": y})

    runs = []
    for nested in (False, True):
        model, optimizer, metrics = objects()
        step = outer if nested else s.jit(train_step_xy)
        for x, y in s.experimental_distribute_dataset((data()["x"], data()["y"]), batch_size=16):
            step(model, optimizer, metrics, x, y)
        assert int(metrics.accuracy.count[...]) == ROWS
        runs.append(host(nnx.state((model, optimizer, metrics))))
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)


# -- donation, returned objects, errors ------------------------------------------------------------------
def test_donation_is_explicit():
    s = strategy(2)
    batch = next(iter(s.experimental_distribute_dataset(data(), batch_size=16)))
    for donate in ((), (0, 1, 2)):
        model, optimizer, metrics = objects()
        step = s.jit(train_step, donate_argnums=donate)
        step(model, optimizer, metrics, batch)  # (the first call places the state: new arrays)
        before = model.conv.kernel[...]
        step(model, optimizer, metrics, batch)
        assert before.is_deleted() == bool(donate)
        assert not model.conv.kernel[...].is_deleted() and int(optimizer.step[...]) == 2


def test_a_returned_object_is_the_callers():
    # Flax's "Scale up on multiple devices" guide returns the model from its step: the caller's comes back.
    s = strategy(2)
    model, optimizer, metrics = objects()
    batch = next(iter(s.experimental_distribute_dataset(data(), batch_size=16)))

    @s.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch)[0])(model)
        optimizer.update(model, grads)
        return model, loss

    returned, loss = step(model, optimizer, batch)
    assert returned is model and np.ndim(loss) == 0 and int(optimizer.step[...]) == 1

    @s.jit
    def makes(model, batch):
        return nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    with pytest.raises(TypeError, match=r"returned Linear object that is none of its arguments"):
        makes(model, batch)


def test_errors_name_the_fix():
    s = strategy(2)
    model, optimizer, metrics = objects()
    batch = next(iter(s.experimental_distribute_dataset(data(), batch_size=16)))

    @s.jit
    def grows(model, batch):  # a variable created in the step: the caller's model gets it, as under nnx.jit
        model.extra = nnx.Param(jax.numpy.ones(3))

    grows(model, batch)
    np.testing.assert_array_equal(model.extra[...], np.ones(3))

    @s.jit
    def switches(model, batch):
        model.drop.rate = 0.9

    with pytest.raises(ValueError, match=r"changed the structure of the NNX objects it was given \(the same \d+ "
                                         r"variables, but a static attribute or a submodule changed\).*outside the "
                                         r"step"):
        switches(model, batch)
    with pytest.raises(TypeError, match=r"strategy.run received stateful objects \(.*CNN.*\).*@strategy.jit"):
        s.run(train_step, args=(model, optimizer, metrics, batch))
    with pytest.raises(TypeError, match=r"call it as a function"):
        s.jit(train_step).program(model, optimizer, metrics, batch)


# -- objects held between calls (mirrorax.steps.held): walked once, every change between calls seen -------------------
class Loss(nnx.Variable):
    pass


class Encoder(nnx.Module):
    """A module that creates a variable in ``__call__`` (as Flax's VAE example does), and sows an intermediate
    when asked (Flax's intermediates guide)."""

    def __init__(self, rngs: nnx.Rngs, sow: bool = False):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs)])
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.sows = sow

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.tanh(layer(x))
        x = self.drop(self.bn(x))
        self.kl_loss = Loss(jnp.mean(x ** 2))
        if self.sows:
            self.sow(nnx.Intermediate, "features", x)
        return x


def _changes_between_calls(jit) -> list[np.ndarray]:
    """A loop that changes its objects between calls in every way a loop does, under ``jit``: what each call
    returned and the objects' state after it. Each change is followed by a call of a step that the same
    objects went through before it (a held call, if nothing saw the change)."""
    model = Encoder(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @jit
    def step(model, optimizer, x):
        def loss_fn(model):
            return jnp.mean((model(x) - 1) ** 2) + model.kl_loss[...]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    @jit
    def forward(model, x):
        return model(x)

    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4)
    seen = []

    def record(*values):
        seen.extend(np.asarray(v) for v in values)
        seen.extend(host(nnx.state(model)))

    for _ in range(3):
        record(step(model, optimizer, x), forward(model, x))
    model.layers[0].bias[...] = np.full(4, 0.5, np.float32)  # a value assigned (from the host)
    record(step(model, optimizer, x))
    model.eval()  # static attributes: BatchNorm's running statistics, no Dropout
    record(forward(model, x))
    model.train()
    record(forward(model, x), step(model, optimizer, x))
    model.layers.append(nnx.Linear(4, 4, rngs=nnx.Rngs(1)))  # a submodule added to a list
    record(forward(model, x))
    model.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(2))  # a submodule replaced
    record(forward(model, x))
    model.drop.rate = 0.7  # a static attribute set
    record(forward(model, x))
    model.sows = True  # the module sows: a variable added by each call, popped between calls
    record(forward(model, x))
    record(*jax.tree.leaves(nnx.pop(model, nnx.Intermediate)), forward(model, x))
    record(*jax.tree.leaves(nnx.pop(model, nnx.Intermediate)), forward(model, x))
    model.sows = False
    del model.kl_loss  # an attribute removed
    record(forward(model, x))
    view = nnx.view(model, deterministic=True)  # another object sharing the variables
    record(forward(view, x), forward(model, x))
    return seen


def test_changes_between_calls_are_seen_as_nnx_jit_sees_them():
    # Each call after the first reads the held objects; every change between calls must reach the step as it
    # reaches nnx.jit's (one device: bitwise).
    want = _changes_between_calls(nnx.jit)
    got = _changes_between_calls(strategy(1).jit)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(b, a, err_msg=f"value {i}")


def test_a_loop_walks_its_objects_once(monkeypatch):
    from mirrorax.nnx import split_merge

    walks = []
    split = split_merge.NnxSplitMerge.split
    monkeypatch.setattr(split_merge.NnxSplitMerge, "split", lambda self, o: walks.append(1) or split(self, o))
    s = strategy(2)
    model, optimizer, metrics = objects()
    step = s.jit(train_step)
    for _ in range(3):
        for batch in s.experimental_distribute_dataset(data(), batch_size=16):
            step(model, optimizer, metrics, batch)
    assert len(walks) == 1 and int(optimizer.step[...]) == 12 and step.compile_count == 2
    model.eval()  # a new structure: walked once more, then held again
    for batch in s.experimental_distribute_dataset(data(), batch_size=16):
        step(model, optimizer, metrics, batch)
    assert len(walks) == 2


def test_held_objects_go_with_the_caller():
    import gc
    import weakref

    s = strategy(2)
    model, optimizer, metrics = objects()
    step = s.jit(train_step)
    batch = next(iter(s.experimental_distribute_dataset(data(), batch_size=16)))
    step(model, optimizer, metrics, batch)
    kernel = weakref.ref(model.conv.kernel[...])
    gone = weakref.ref(model)
    del model, optimizer, metrics
    gc.collect()
    assert gone() is None and kernel() is None  # the step holds neither the objects nor their arrays


def test_cached_partial_as_under_nnx_jit():
    # Flax's performance guide: nnx.cached_partial(step, model, optimizer, metrics) over the decorated step.
    def run(jit, batches):
        model, optimizer, metrics = objects()
        cached = nnx.cached_partial(jit(train_step), model, optimizer, metrics)
        for batch in batches:
            cached(batch)
        return host(nnx.state((model, optimizer, metrics)))

    want = run(nnx.jit, [{k: v[i:i + 16] for k, v in data().items()} for i in range(0, ROWS, 16)])
    s = strategy(1)
    got = run(s.jit, s.experimental_distribute_dataset(data(), batch_size=16))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(b, a)


# -- Flax's sharding annotations on a 2-D mesh -------------------------------------------------------------
class Annotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.dense = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.dense(x)))


def test_sharding_annotations_are_honoured_on_a_2x4_mesh():
    """A kernel annotated ``(None, "model")`` on a ``("data", "model")`` mesh trains split as annotated (its
    Adam moments too), with the numbers of one device."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(36, 8)).astype(np.float32)
    y = rng.integers(0, 4, 36)

    def step(model, optimizer, batch):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(batch["x"]), batch["y"]).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    def run(s, mesh):
        with jax.set_mesh(mesh):  # Flax creates annotated variables on the mesh in scope (eager sharding)
            model = Annotated(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        jitted = s.jit(step)
        losses = [float(jitted(model, optimizer, b))
                  for _ in range(2) for b in s.experimental_distribute_dataset({"x": x, "y": y}, batch_size=16)]
        return model, optimizer, losses

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    model, optimizer, losses = run(mx.MirroredStrategy(mesh=mesh), mesh)
    one = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
    model1, _, losses1 = run(mx.MirroredStrategy(mesh=one), one)
    kernel = model.dense.kernel[...]
    assert kernel.sharding.spec == P(None, "model") and kernel.addressable_shards[0].data.shape == (8, 4)
    mu = optimizer.opt_state[0].mu["dense"]["kernel"][...]
    assert mu.sharding.spec == P(None, "model")
    assert model.out.kernel[...].sharding.is_fully_replicated
    np.testing.assert_allclose(losses, losses1, rtol=1e-5)
    for a, b in zip(host(nnx.state(model)), host(nnx.state(model1))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_an_annotation_the_mesh_cannot_take_is_named():
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)):
        model = Annotated(nnx.Rngs(0))
    s = strategy(2)  # one axis, "batch"
    with pytest.raises(ValueError, match=r"sharding annotation gives the variable '0/dense/kernel'.*naming axis "
                                         r"'model'; the mesh has axes \('batch',\)"):
        s.jit(lambda m, x: m(x))(model, np.ones((4, 8), np.float32))


# -- Flax's MNIST tutorial, ported (examples/flax_nnx_mnist.py) ---------------------------------------------

def test_mnist_port_changes_at_most_5_lines():
    original, port = (EXAMPLES / "flax_nnx_mnist_original.py").read_text(), (EXAMPLES / "flax_nnx_mnist.py").read_text()
    changed = changed_lines(original, port)
    assert 0 < len(changed) <= 5, changed
    assert sum(line.strip() == "@nnx.jit" for line in changed) == 3 and port.count("  @strategy.jit\n") == 3
    # the count sees a change: one more edited line is counted
    edited = port.replace("learning_rate = 0.005", "learning_rate = 0.005 + 0")
    assert len(changed_lines(original, edited)) == len(changed) + 1


MNIST_SIZES = dict(train_steps=7, eval_every=3, num_train=200, num_test=100, verbose=False)  # 6 x 32 + 8; 3 x 32 + 4


@pytest.mark.slow  # the tutorial's CNN, three times
def test_mnist_port_equals_one_device():
    """The port on 1 device is the original bitwise; on 3 devices it trains the same model, except the one
    parameter Adam moves on rounding alone: conv2's bias, which BatchNorm cancels (its gradient is 0 up to
    rounding, and Adam steps by ``lr`` whatever the gradient's size: 0.03 apart after 7 steps), and the running
    mean BatchNorm keeps of it, which evaluation reads (test loss 6.006 against 6.036)."""
    original = example("flax_nnx_mnist_original").main(**MNIST_SIZES)
    port = example("flax_nnx_mnist")
    one = port.main(devices=jax.devices()[:1], **MNIST_SIZES)
    many = port.main(devices=jax.devices()[:3], **MNIST_SIZES)
    for a, b in zip(original["weights"], one["weights"]):
        np.testing.assert_array_equal(a, b)
    assert one["rng_count"] == many["rng_count"] == original["rng_count"] == 14  # 7 steps x 2 Dropout layers
    for key in ("train_loss", "train_accuracy", "test_accuracy"):
        np.testing.assert_allclose(many[key], one[key], rtol=1e-5, err_msg=key)
        assert one[key] == original[key]
    assert [len(p) for p in many["test_predictions"]] == [4, 4]  # the last test batch: its 4 real rows
    for a, b in zip(one["test_predictions"], many["test_predictions"]):
        np.testing.assert_array_equal(a, b)
    # state leaves in nnx.state's order: batch_norm1 (bias, mean, scale, var), batch_norm2 (...), conv1 (bias,
    # kernel), conv2 (bias, kernel), linear1, linear2
    moved_by_rounding = {5: "batch_norm2.mean", 10: "conv2.bias"}
    for i, (a, b) in enumerate(zip(one["weights"], many["weights"])):
        if i not in moved_by_rounding:
            np.testing.assert_allclose(b, a, rtol=0, atol=5e-4, err_msg=f"leaf {i}")


# -- Flax's guide "Scale up on multiple devices", ported (examples/flax_scale_up.py) ---------------------------
def test_scale_up_port_changes_one_line():
    original, port = (EXAMPLES / "flax_scale_up_original.py").read_text(), (EXAMPLES / "flax_scale_up.py").read_text()
    assert [line.strip() for line in changed_lines(original, port)] == ["@jax.jit"]
    assert "strategy = mx.MirroredStrategy(mesh=auto_mesh)\n" in port and port.count("  @strategy.jit\n") == 1
    edited = port.replace("optax.adam(1e-3)", "optax.adam(2e-3)")  # the count sees a change
    assert len(changed_lines(original, edited)) == 2


def _scale_up_under_nnx_jit():
    """Flax's own program for the guide's step: the original with ``@nnx.jit`` for its ``@jax.jit`` (which
    writes the ``nnx.Optimizer`` back, as ``@strategy.jit`` does and ``jax.jit`` does not)."""
    source = (EXAMPLES / "flax_scale_up_original.py").read_text()
    assert source.count("  @jax.jit\n  def train_step") == 1
    module = types.ModuleType("mirrorax_example_flax_scale_up_nnx_jit")
    exec(compile(source.replace("  @jax.jit\n  def train_step", "  @nnx.jit\n  def train_step"),
                 str(EXAMPLES / "flax_scale_up_original.py"), "exec"), module.__dict__)
    return module


def _named(run: dict) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.state((run["model"], run["optimizer"])))[0]
    return {jax.tree_util.keystr(p): np.asarray(a) for p, a in flat}


@pytest.mark.slow  # the guide's model (2 x 1024 x 1024 twice) compiled five times
@pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork' is deprecated:DeprecationWarning")  # the guide's
def test_scale_up_port_splits_as_annotated_with_one_devices_numbers():
    """The guide's program on its 2x4 mesh under ``@strategy.jit``: its annotated kernels (and their Adam
    moments) split as annotated, its losses and weights those of the same program on 1 device. The weights
    within the 1-device floor of this program: ReLU layers fitting random labels, where Adam's first steps move
    each weight by about ``lr`` whatever its gradient's size, so a 1e-7 change of the input moves the weights
    by 4.3e-5 on 1 device (2x4 against 1x1: 5.1e-5, and the same for Flax's own ``nnx.jit``, which the port
    equals bitwise on either mesh); the losses agree within 6e-8 and the Adam moments within 1e-8."""
    port = example("flax_scale_up")
    many = port.main()
    one = port.main(mesh_shape=(1, 1), devices=jax.devices()[:1])
    layers, opt = many["model"].layers, many["optimizer"]
    moments = opt.opt_state[0]
    # as annotated: dot1's kernel (None, "model") and w2 ("model", None), each under the layer axis nnx.vmap
    # adds (replicated: nnx.PARTITION_NAME None); Adam's moments as their parameters
    for name, spec, shard in (("dot1/kernel", P(None, None, "model"), (2, 1024, 256)),
                              ("w2", P(None, "model", None), (2, 256, 1024))):
        path = name.split("/")
        arrays = [layers.dot1.kernel[...] if name == "dot1/kernel" else layers.w2[...],
                  *(slot["layers"][path[0]][path[1]][...] if len(path) == 2 else slot["layers"][name][...]
                    for slot in (moments.mu, moments.nu))]
        for array in arrays:
            assert array.sharding.mesh.axis_names == ("data", "model"), name
            assert array.sharding.is_equivalent_to(NamedSharding(array.sharding.mesh, spec), 3), (name, array.sharding)
            assert array.addressable_shards[0].data.shape == shard, name
    assert int(opt.step[...]) == 5  # written back, step after step
    np.testing.assert_allclose(many["losses"], one["losses"], rtol=1e-6)
    assert many["losses"][-1] < 0.3 * many["losses"][0]  # (over-)fitting, as the guide says
    a, b = _named(one), _named(many)
    assert sorted(a) == sorted(b)
    for key in a:
        atol = 1e-4 if "opt_state" not in key else 1e-7
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=atol, err_msg=key)
    # on the 2x4 mesh and on 1 device the port is Flax's own program (nnx.jit), bitwise
    flax_own = _scale_up_under_nnx_jit()
    for port_run, kw in ((many, {}), (one, dict(mesh_shape=(1, 1), devices=jax.devices()[:1]))):
        own = flax_own.main(**kw)
        assert own["losses"] == port_run["losses"]
        for key, value in _named(own).items():
            np.testing.assert_array_equal(_named(port_run)[key], value, err_msg=key)
    # the guide's own @jax.jit keeps the model it returns but not the optimizer: Adam restarts every step
    guide = example("flax_scale_up_original").main(mesh_shape=(1, 1), devices=jax.devices()[:1])
    assert int(guide["optimizer"].step[...]) == 0 and guide["losses"][:2] == one["losses"][:2]
    assert guide["losses"][2] > one["losses"][2] + 1e-3


# -- Flax's "Performance considerations" guide and its VAE example, ported ------------------------------------
def test_performance_guide_port_changes_5_lines():
    original = (EXAMPLES / "flax_performance_original.py").read_text()
    port = (EXAMPLES / "flax_performance.py").read_text()
    changed = [line.strip() for line in changed_lines(original, port)]
    loops = [f"for x, y in make_batches(num_rows, batch_size, seed={seed}):" for seed in (0, 1, 2)]
    assert changed == ["@nnx.jit  # <== currently slow", *loops[:2], "@jax.jit  # regular JAX", loops[2]], changed


PERF_LOOPS = ("nnx_jit", "cached_partial", "functional")


def _perf_guide(n: int | None) -> dict:
    if n is None:
        return example("flax_performance_original").main()
    return example("flax_performance").main(devices=jax.devices()[:n])


@pytest.mark.parametrize("n", [1, 3, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_performance_guide_port_equals_the_original(n):
    """The guide's three loops (its ``@nnx.jit`` step, the same step through ``nnx.cached_partial``, its
    functional loop over ``graphdef`` and ``state``), each over batches unpacked in the loop with a short last
    batch, on ``n`` devices against the original on one: on 1 device bitwise; on several, the losses to 1e-5
    (measured <= 3.6e-7) and the state to 1e-5 (<= 2.4e-7), except the two values Adam moves on rounding alone:
    the bias of the Linear that BatchNorm follows (BatchNorm cancels it: its gradient is 0 up to rounding, and
    Adam steps by ``lr`` whatever the gradient's size: 4.8e-3 apart after 21 steps, within Adam's bound of lr x
    steps = 2.1e-2) and BatchNorm's running mean, which holds it (7e-4)."""
    want, got = _perf_guide(None), _perf_guide(n)
    moved_by_rounding = {1: "bn.mean", 6: "linear.bias"}  # in nnx.state((model, optimizer))'s order
    for loop in PERF_LOOPS:
        assert len(got[loop]) == 7  # 200 rows in batches of 32: 6 and a short 8
        if n == 1:
            assert got[loop] == want[loop], loop
        np.testing.assert_allclose(got[loop], want[loop], rtol=1e-5, err_msg=loop)
    np.testing.assert_allclose(got["metrics"]["loss"], want["metrics"]["loss"], rtol=1e-5)
    for i, (a, b) in enumerate(zip(want["state"], got["state"], strict=True)):
        if n == 1:
            np.testing.assert_array_equal(b, a, err_msg=f"leaf {i}")
        elif i in moved_by_rounding:
            np.testing.assert_allclose(b, a, rtol=0, atol=21 * 1e-3, err_msg=moved_by_rounding[i])
        else:
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5, err_msg=f"leaf {i}")


def test_vae_port_changes_6_lines():
    original, port = (EXAMPLES / "flax_vae_original.py").read_text(), (EXAMPLES / "flax_vae.py").read_text()
    changed = [line.strip() for line in changed_lines(original, port)]
    assert changed.count("@nnx.jit") == 3 and len(changed) == 6, changed


VAE_SIZES = dict(epochs=2, steps_per_epoch=5, num_train=500, num_test=50, verbose=False)


@pytest.mark.parametrize("n", [1, 3, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_vae_port_equals_the_original(n):
    """Flax's VAE example (a ``Loss`` variable created in ``__call__`` and popped in the loss, noise from an
    ``nnx.Rngs`` stream the encoder holds, batches of 64 rows: padded on 3 devices) on ``n`` devices against
    the original on one: on 1 device bitwise; on several, the losses to 1e-5 (measured 1.7e-7), the weights to
    1e-5 (<= 3.6e-6, Adam), the reconstructions and samples to 1e-5 (<= 1.1e-6)."""
    want = example("flax_vae_original").main(**VAE_SIZES)
    got = example("flax_vae").main(devices=jax.devices()[:n], **VAE_SIZES)
    if n == 1:
        assert got["losses"] == want["losses"]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    for key in ("reconstructions", "samples"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5 if n > 1 else 0, err_msg=key)
    for i, (a, b) in enumerate(zip(want["weights"], got["weights"], strict=True)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 if n > 1 else 0, err_msg=f"weight {i}")


# -- flax is optional ------------------------------------------------------------------------------------
def test_the_engine_never_imports_flax():
    # Only the wing imports Flax; the package loads it when a step meets flax.nnx (split_merge.protocols).
    import ast

    for path in SRC.rglob("*.py"):
        if "nnx" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "flax" for n in names), f"{path.name} imports flax"


def test_the_wing_without_flax_names_the_install(monkeypatch):
    for name in [m for m in sys.modules if m == "mirrorax.nnx" or m.startswith("mirrorax.nnx.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flax", None)
    monkeypatch.setitem(sys.modules, "flax.nnx", None)
    with pytest.raises(ImportError, match=r'pip install "mirrorax\[flax\]"'):
        importlib.import_module("mirrorax.nnx")


@pytest.mark.slow  # a fresh interpreter
def test_mirrorax_works_without_flax():
    code = ("import sys; sys.modules['flax'] = None\n"
            "import mirrorax as mx, numpy as np\n"
            "s = mx.MirroredStrategy()\n"
            "print(float(s.jit(lambda x: x.sum())(np.ones(3, np.float32))), 'flax' in sys.modules and "
            "sys.modules['flax'] is not None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3.0", "False"]


# -- mx.Trainer with an NNX model -------------------------------------------------------------------------
def nnx_trainer(n: int, seed: int = 0, optimizer=None):
    model = CNN(nnx.Rngs(seed))
    optimizer = optimizer(model) if optimizer is not None else optax.adam(1e-2)
    return model, mx.Trainer(model, strategy(n), loss="sparse_categorical_crossentropy_from_logits",
                             optimizer=optimizer, metrics=["accuracy"])


def test_trainer_fits_an_nnx_model_as_the_custom_loop_does():
    """``mx.Trainer(module, optimizer=nnx.Optimizer(...))`` on 3 devices trains the model the custom loop of
    ``@strategy.jit`` steps trains on 1 (the same batches, Dropout keys and BatchNorm statistics), and writes
    it back into the module."""
    model, trainer = nnx_trainer(3, optimizer=lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))
    history = trainer.fit(data()["x"], data()["y"], batch_size=16, epochs=2, shuffle=False, verbose=0)
    loop = one_device()
    trained = host(nnx.state(model))
    for i, (a, b) in enumerate(zip(loop["state"][:len(trained)], trained)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5, err_msg=f"model leaf {i}")
    assert int(model.drop.rngs.count[...]) == 8  # 4 steps x 2 epochs, one Dropout key each
    # the Trainer's accuracy is the loop's: the same rows counted (its loss is the mean over rows, the loop's
    # Average the mean over batches)
    np.testing.assert_allclose(history.history["accuracy"], [e["accuracy"] for e in loop["train"]], rtol=1e-6)
    with pytest.raises(ValueError, match=r"must be one of \('bfloat16', 'float16'\) or None; received 'float8'. "
                                         r"Use mixed_precision='bfloat16'"):
        mx.Trainer(CNN(nnx.Rngs(0)), strategy(1), loss="mse", optimizer=optax.sgd(0.1), mixed_precision="float8")


@pytest.mark.slow  # three fits and a checkpoint each
def test_trainer_resumes_an_nnx_model_exactly(tmp_path):
    """An epoch on 2 devices with a checkpoint, then the same fit again from a fresh model (other initial
    weights) on 3 devices: the uninterrupted run's history and model; ``Trainer.load`` writes the checkpoint
    into a fresh module."""
    x, y = data()["x"], data()["y"]
    kw = dict(batch_size=16, shuffle=True, seed=3, verbose=0)
    whole, t = nnx_trainer(2)
    want = t.fit(x, y, epochs=2, **kw).history
    _, first = nnx_trainer(2)
    first.fit(x, y, epochs=1, checkpoint_dir=tmp_path / "ck", **kw)
    resumed, again = nnx_trainer(3, seed=7)
    got = again.fit(x, y, epochs=2, checkpoint_dir=tmp_path / "ck", **kw).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    for a, b in zip(host(nnx.state(whole)), host(nnx.state(resumed))):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    fresh = CNN(nnx.Rngs(11))
    loaded = mx.Trainer.load(tmp_path / "ck", fresh, strategy(1), loss="sparse_categorical_crossentropy_from_logits",
                             optimizer=optax.adam(1e-2), metrics=["accuracy"])
    for a, b in zip(host(nnx.state(resumed)), host(nnx.state(fresh))):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-7)
    assert loaded.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(
        again.evaluate(x, y, batch_size=16, verbose=0), rel=1e-6)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # 16,384 weights: as many as shard= splits (SHARD_MIN_SIZE); no bias before BatchNorm (see CNN)
        self.hidden = nnx.Linear(16, 1024, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(1024, rngs=rngs)
        self.out = nnx.Linear(1024, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.bn(self.hidden(x))))


@pytest.mark.slow  # three fits
@pytest.mark.parametrize("shard", ["optimizer", "all"])
def test_trainer_shards_an_nnx_models_state(shard):
    """``shard=`` splits the NNX model's large kernel (and its Adam moments) over 4 devices, with one device's
    numbers."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40, 16)).astype(np.float32)
    y = rng.integers(0, 3, 40)

    def fit(s):
        model = MLP(nnx.Rngs(0))
        t = mx.Trainer(model, s, loss="sparse_categorical_crossentropy_from_logits", optimizer=optax.adam(1e-3))
        t.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model, t

    one, _ = fit(strategy(1))
    many, t = fit(mx.MirroredStrategy(jax.devices()[:4], shard=shard))
    kernel = t.state["params"]["hidden/kernel"]
    assert kernel.sharding.spec == (P(None, "batch") if shard == "all" else P())
    assert any(getattr(v.sharding, "spec", P()) == P(None, "batch")
               for v in jax.tree.leaves(t.state["optimizer"]) if v.shape == (16, 1024))
    for a, b in zip(host(nnx.state(one)), host(nnx.state(many))):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_trainer_honours_sharding_annotations_on_a_2x4_mesh():
    """``mx.Trainer`` lays an annotated NNX model out as annotated (its Adam moments too), as a Keras layout
    map: the kernel split over ``"model"``, the same numbers as on one device."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(36, 8)).astype(np.float32)
    y = rng.integers(0, 4, 36)

    def fit(mesh):
        with jax.set_mesh(mesh):
            model = Annotated(nnx.Rngs(0))
        t = mx.Trainer(model, mx.MirroredStrategy(mesh=mesh), loss="sparse_categorical_crossentropy_from_logits",
                       optimizer=optax.adam(1e-2))
        return model, t, t.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]

    model, t, losses = fit(jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2))
    one, _, losses1 = fit(jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                                        devices=jax.devices()[:1]))
    assert t.state["params"]["dense/kernel"].sharding.spec == P(None, "model")
    assert t.state["params"]["out/kernel"].sharding.is_fully_replicated
    slots = [v for v in jax.tree.leaves(t.state["optimizer"]) if v.shape == (8, 16)]
    assert len(slots) == 2 and all(v.sharding.spec == P(None, "model") for v in slots)  # Adam's mu and nu
    np.testing.assert_allclose(losses, losses1, rtol=1e-5)
    for a, b in zip(host(nnx.state(model)), host(nnx.state(one))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.slow  # three fits
def test_trainer_mixed_bfloat16_is_flax_dtype_with_float32_master_weights():
    """``mx.Trainer(module, mixed_precision="bfloat16")`` is Flax's own mixed precision: every layer's ``dtype``
    bfloat16, its ``param_dtype`` float32; the same run, bitwise, as the layers written ``dtype=jnp.bfloat16``.
    The parameters, their Adam moments and BatchNorm's statistics stay float32; the logits reach the loss in
    float32; the outcome stays near the float32 run's (bfloat16 keeps 8 bits of mantissa: outcomes, not bits)."""
    import jax.numpy as jnp

    from mirrorax.nnx.model import set_compute_dtype

    x, y = data()["x"], data()["y"]

    def fit(mixed_precision=None, by_hand=False):
        model = CNN(nnx.Rngs(0))
        if by_hand:
            assert sorted(set_compute_dtype(model, jnp.bfloat16)) == ["bn", "conv", "head"]  # not Dropout
        t = mx.Trainer(model, strategy(2), loss="sparse_categorical_crossentropy_from_logits",
                       optimizer=optax.adam(1e-2), metrics=["accuracy"], mixed_precision=mixed_precision)
        history = t.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history
        return model, t, history

    full, t32, h32 = fit()
    half, t16, h16 = fit("bfloat16")
    hand, _, hhand = fit(by_hand=True)
    assert (half.conv.dtype, half.bn.dtype, half.head.dtype) == (jnp.bfloat16,) * 3  # set on the module
    assert {a.dtype for a in jax.tree.leaves(t16.state["params"])} == {np.dtype(np.float32)}
    assert {a.dtype for a in jax.tree.leaves(t16.state["optimizer"]) if a.ndim} == {np.dtype(np.float32)}
    assert half.bn.mean[...].dtype == np.float32
    assert h16 == hhand
    for a, b in zip(host(nnx.state(half)), host(nnx.state(hand))):
        np.testing.assert_array_equal(a, b)
    assert h16 != h32 and h16["loss"][-1] < h16["loss"][0]  # computed in bfloat16, and it learns
    np.testing.assert_allclose(h16["loss"], h32["loss"], rtol=2e-3)
    p32, p16 = t32.predict(x, batch_size=16), t16.predict(x, batch_size=16)
    assert p16.dtype == np.float32 and np.abs(p32 - p16).max() < 0.1
    assert np.mean(p32.argmax(-1) == p16.argmax(-1)) > 0.95


def test_dynamic_loss_scale_follows_keras_rule():
    """The float16 loss scaling (``mirrorax.models.loss_scale``) is Keras's ``LossScaleOptimizer`` rule: with a
    power-of-two scale the unscaled gradients are exact, so Adam on them is Adam, bitwise; a step with a
    non-finite gradient changes nothing but halves the scale; ``growth_steps`` finite steps double it."""
    import jax.numpy as jnp

    from mirrorax.models.loss_scale import dynamic_loss_scale, is_loss_scaled, loss_scale_of

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.zeros(2, jnp.float32)}
    grads = [jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), params) for _ in range(5)]
    adam, scaled = optax.adam(1e-2), dynamic_loss_scale(optax.adam(1e-2), initial_scale=2.0 ** 10, growth_steps=3)
    assert is_loss_scaled(scaled) and not is_loss_scaled(adam)
    p1, s1, p2, s2 = params, adam.init(params), params, scaled.init(params)
    scales = []
    for g in grads:
        u1, s1 = adam.update(g, s1, p1)
        p1 = optax.apply_updates(p1, u1)
        scale = loss_scale_of(s2)
        u2, s2 = scaled.update(jax.tree.map(lambda a, scale=scale: a * scale, g), s2, p2)
        p2 = optax.apply_updates(p2, u2)
        scales.append(float(s2.scale))
    for k in params:
        np.testing.assert_array_equal(np.asarray(p1[k]), np.asarray(p2[k]))
    assert scales == [2.0 ** 10, 2.0 ** 10, 2.0 ** 11, 2.0 ** 11, 2.0 ** 11]  # doubled after 3 finite steps
    before = s2
    bad = jax.tree.map(lambda a: a.at[0].set(jnp.inf), grads[0])
    u, s2 = scaled.update(bad, s2, p2)
    assert all(not np.asarray(a).any() for a in jax.tree.leaves(u))  # no update
    for a, b in zip(jax.tree.leaves(s2.inner), jax.tree.leaves(before.inner)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # Adam's moments and count as they were
    assert (float(s2.scale), int(s2.good_steps)) == (2.0 ** 10, 0)
    assert loss_scale_of(s1) == 1.0


@pytest.mark.slow  # four fits
def test_trainer_mixed_float16_scales_the_loss(tmp_path):
    """``mx.Trainer(module, mixed_precision="float16")``: the layers compute in float16, the parameters stay
    float32, the loss is scaled dynamically (the scale in the optimizer's state, 2**15 at first as Keras's).
    3 and 4 devices = 1 device within float16's own floor, measured here: the 1-device run with its inputs moved
    by half a float16 ulp (measured: weights 4.2e-4, losses 9.7e-5 away; 3 and 4 devices: 2.0e-4, <= 1.2e-4;
    the floor is one draw of float16's rounding, so a gap up to twice it passes; a wrong scale or a lost
    replica is orders above it).
    (SGD with momentum: Adam moves a weight whose gradient is rounding alone by a full step, and float16 rounds
    such gradients differently on different device counts: with Adam, ``head/kernel[101, 2]``, whose float32
    gradient is -5.3e-6 against a median of 0.026, gets +3.9e-6 on 1 device and 0 on 4, where XLA sums the
    replicas' float16 partial gradients in float16, and moves by 1e-2 either way.) A scale so large that every
    step's gradients overflow drops every update (the parameters bitwise as they were) and halves the scale
    each step. The scale is in the checkpoints: a fit resumed after its first epoch is the uninterrupted one."""
    import jax.numpy as jnp

    from mirrorax.models.loss_scale import dynamic_loss_scale

    x, y = data()["x"], data()["y"]

    def fit(n, optimizer=None, epochs=3, x_in=x, **kw):
        model = CNN(nnx.Rngs(0))
        t = mx.Trainer(model, strategy(n), loss="sparse_categorical_crossentropy_from_logits",
                       optimizer=optimizer or optax.sgd(0.1, momentum=0.9), metrics=["accuracy"],
                       mixed_precision="float16")
        history = t.fit(x_in, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, **kw).history
        return model, t, history

    one, t1, h1 = fit(1)
    assert (one.conv.dtype, one.bn.dtype, one.head.dtype) == (jnp.float16,) * 3
    assert {a.dtype for a in jax.tree.leaves(t1.state["params"])} == {np.dtype(np.float32)}
    scale = t1.state["optimizer"]
    assert (float(scale.scale), int(scale.good_steps)) == (2.0 ** 15, 12)  # 4 steps x 3 epochs, none overflowed
    assert h1["loss"][-1] < 0.8 * h1["loss"][0]

    def gaps(model, history):
        weights = max(np.abs(a - b).max() for a, b in zip(host(nnx.state(one)), host(nnx.state(model))))
        return weights, np.abs(np.asarray(history["loss"]) - h1["loss"]).max()

    x_moved = x * np.float32(1 + 2.0 ** -11)  # half a float16 ulp
    floor = gaps(*fit(1, x_in=x_moved)[::2])
    for n in (3, 4):
        many = gaps(*fit(n)[::2])
        assert many[0] <= 2 * floor[0] and many[1] <= 2 * floor[1], (n, many, floor)

    fit(1, epochs=1, checkpoint_dir=tmp_path / "ck")
    resumed, t, history = fit(1, checkpoint_dir=tmp_path / "ck")
    assert int(t.state["optimizer"].good_steps) == 12 and history["loss"] == h1["loss"]
    for a, b in zip(host(nnx.state(one)), host(nnx.state(resumed))):
        np.testing.assert_array_equal(a, b)

    start = host(nnx.state(CNN(nnx.Rngs(0)), nnx.Param))
    huge, t, _ = fit(1, dynamic_loss_scale(optax.adam(1e-2), initial_scale=2.0 ** 40), epochs=1)  # not wrapped again
    for a, b in zip(start, host(nnx.state(huge, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    state = t.state["optimizer"]
    assert (float(state.scale), int(state.good_steps), int(state.inner[0].count)) == (2.0 ** 36, 0, 0)
