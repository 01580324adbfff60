"""The strategy's one dispatch window (``strategy.in_flight``) and ``strategy.jit``'s public options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mirrorax as mx
from mirrorax.steps import dispatch
from mirrorax.steps.dispatch import InFlight

pytestmark = pytest.mark.multi_device


def _recording_pending(monkeypatch, s: mx.MirroredStrategy) -> list[int]:
    """Instruments ``s``'s window: the number of entries pending right after each push."""
    window = s.in_flight
    pending: list[int] = []
    push = window.push

    def recorded(*args, **kwargs):
        push(*args, **kwargs)
        pending.append(window.pending)

    monkeypatch.setattr(window, "push", recorded)
    return pending


@pytest.mark.parametrize("k", [1, 3])
def test_max_in_flight_bounds_jit_and_run(monkeypatch, k):
    # Element-wise functions only: no collective, so k=3 steps queued cannot strain XLA's CPU rendezvous.
    s = mx.MirroredStrategy(devices=jax.devices()[:2], max_in_flight=k)
    assert s.max_in_flight == k and s.in_flight.depth == k
    pending = _recording_pending(monkeypatch, s)
    double = s.jit(lambda a: a * 2)
    a = s.replicate(np.ones(4, np.float32))
    x = jax.device_put(np.arange(8, dtype=np.float32), s.batch_sharding)

    def halve(v):
        return v / 2

    for i in range(6):
        if i % 2:
            x = s.run(halve, args=(x,))
        else:
            a = double(a)
        # after each push at most k-1 are pending; fewer only while the window fills up
        assert pending == [min(j + 1, k - 1) for j in range(i + 1)]
    s.in_flight.drain()
    assert s.in_flight.pending == 0
    np.testing.assert_array_equal(np.asarray(a), np.full(4, 8.0, np.float32))
    np.testing.assert_array_equal(np.asarray(x), np.arange(8, dtype=np.float32) / 8)


def test_program_pushed_by_its_loop_keeps_the_bound_and_on_done_order(monkeypatch):
    s = mx.MirroredStrategy(devices=jax.devices()[:2], max_in_flight=2)
    pending = _recording_pending(monkeypatch, s)
    step = s.jit(lambda a, b: (a + b, jnp.sum(b)), donate_argnums=0)
    a = s.replicate(np.zeros(3, np.float32))
    b = s.replicate(np.ones(3, np.float32))
    program = step.program(a, b)
    done: list[float] = []
    for i in range(4):
        (a, total), token = program(a, b)
        # the entry retires only after the next push: its on_done has not run yet
        s.in_flight.push(i, token, on_done=lambda i, total=total: done.append((i, float(total))))
        assert done == [(j, 3.0) for j in range(i)]
        assert s.in_flight.last_done == (i - 1 if i else None)
    s.in_flight.drain()
    assert done == [(j, 3.0) for j in range(4)]  # in push order, once each
    assert pending == [1, 1, 1, 1]
    assert step.compile_count == 1
    np.testing.assert_array_equal(np.asarray(a), np.full(3, 4.0, np.float32))


def test_on_done_runs_once_per_entry_in_order(monkeypatch):
    waited: list[object] = []
    monkeypatch.setattr(dispatch, "wait", lambda x: waited.append(x))
    window = InFlight(3)
    calls: list[tuple[str, int]] = []
    for i in range(5):
        window.push(i, ready=("ready", i), on_done=lambda aux: calls.append(("a", aux)))
        window.push(10 + i)  # no on_done: retires silently
    assert calls == [("a", i) for i in range(4)]  # entry 4 and 14 are still pending
    window.drain()
    window.drain()  # nothing left: no second call
    assert calls == [("a", i) for i in range(5)]
    assert waited[0] == ("ready", 0) and waited[1] == 10  # ``ready`` is waited on, else ``aux`` itself
    assert window.last_done == 14


def test_after_dispatch_runs_once_after_the_next_push(monkeypatch):
    monkeypatch.setattr(dispatch, "wait", lambda x: None)
    window = InFlight(2)
    seen: list[int] = []
    window.after_dispatch(lambda: seen.append(window.pending))
    assert seen == []
    window.push("a")
    assert seen == [1]  # ran after the push appended, before the window waited
    window.push("b")
    assert seen == [1]


def test_distributed_batches_are_placed_after_the_next_dispatch(monkeypatch):
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    asked, placed = [], []
    after = s.in_flight.after_dispatch

    def recorded(fn):
        asked.append(fn)
        after(lambda: (placed.append(fn), fn())[1])

    monkeypatch.setattr(s.in_flight, "after_dispatch", recorded)
    f = s.jit(lambda batch: jnp.sum(batch.data[0] * batch.mask[:, None]))
    totals = []
    for i, batch in enumerate(s.experimental_distribute_dataset((x,), batch_size=4)):
        assert len(asked) == i + 1 and len(placed) == i  # the next batch waits for this one's dispatch
        totals.append(f(batch))
        assert len(placed) == i + 1
    s.in_flight.drain()
    np.testing.assert_allclose([float(t) for t in totals], [x[i:i + 4].sum() for i in (0, 4, 8)])
    # batches read without any dispatch in between: one request waits in the window, not one per batch
    asked.clear()
    assert len(list(s.experimental_distribute_dataset((x,), batch_size=4))) == 3
    assert len(asked) == 1


def test_jit_out_shardings_tree_and_callable():
    s = mx.MirroredStrategy(devices=jax.devices()[:4])
    split_cols = NamedSharding(s.mesh, P(None, "batch"))
    a = s.replicate(np.arange(32, dtype=np.float32).reshape(4, 8))

    def fn(a):
        return a * 2, {"sum": jnp.sum(a), "rows": a[:, :4] + 1}

    # without out_shardings: the output shaped like ``a`` keeps its (replicated) layout
    assert jax.tree.leaves(s.jit(fn)(a))[0].sharding == s.replicated

    tree = (split_cols, {"sum": s.replicated, "rows": s.batch_sharding})
    out = s.jit(fn, out_shardings=tree)(a)
    assert out[0].sharding.spec == P(None, "batch")
    assert out[1]["sum"].sharding.spec == P()
    assert out[1]["rows"].sharding.spec == P("batch")
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(a) * 2)

    seen = []

    def layouts(arg):
        seen.append(arg.shape)
        return s.batch_sharding, {"sum": s.replicated, "rows": split_cols}

    g = s.jit(fn, out_shardings=layouts)
    for _ in range(2):
        out = g(a)
    assert seen == [(4, 8)]  # called once per signature, with the positional arguments
    assert out[0].sharding.spec == P("batch")
    assert out[1]["sum"].sharding.spec == P()
    assert out[1]["rows"].sharding.spec == P(None, "batch")
    np.testing.assert_array_equal(np.asarray(out[1]["rows"]), np.asarray(a)[:, :4] + 1)
    # a single sharding is a prefix of every output
    assert s.jit(lambda a: (a, a + 1), out_shardings=split_cols)(a)[1].sharding == split_cols

    # a callable returning None keeps the default rules
    h = s.jit(fn, out_shardings=lambda a: None)
    assert h(a)[1]["rows"].sharding == s.replicated
    s.in_flight.drain()


def test_jit_out_shardings_refused_with_the_fix():
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    with pytest.raises(TypeError, match=r"out_shardings must be None.*holding P\(\).*strategy.replicated"):
        s.jit(lambda a: a, out_shardings=(P(),))
    with pytest.raises(TypeError, match="out_shardings must be None"):
        s.jit(out_shardings={"a": "replicated"})
    bad = s.jit(lambda a: a, out_shardings=lambda a: [P()])
    with pytest.raises(TypeError, match=r"out_shardings\(\*args\) must be None"):
        bad(s.replicate(np.ones(2, np.float32)))


@pytest.mark.parametrize("stateful", [True, False])
def test_jit_traces_a_step_once_per_signature(stateful):
    """strategy.jit traced a step three times per signature (its Keras variables, the outputs' shapes for
    their layouts, the compile): for a model's step, seconds each (a 219M-parameter LM's trace took ~5 s).
    One trace now serves all three; the compiled program replays it, with the same numbers."""
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    traces = []

    def update(w, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        return w - 0.1 * g, {"loss": loss, "rows": x[:, 0]}

    def step(w, batch):
        traces.append(1)
        return update(w, batch)

    fn = s.jit(step, donate_argnums=0, stateful=stateful)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 1)).astype(np.float32)
    w = s.replicate(w0)
    for rows in (8, 8, 4, 8):  # two signatures
        x, y = rng.normal(size=(rows, 3)).astype(np.float32), rng.normal(size=(rows, 1)).astype(np.float32)
        batch = jax.device_put((x, y), s.batch_sharding)
        expected_w, expected = jax.jit(update)(np.asarray(w), (x, y))
        w, out = fn(w, batch)
        np.testing.assert_allclose(np.asarray(w), np.asarray(expected_w), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out["loss"]), np.asarray(expected["loss"]), rtol=1e-6)
        # the layout rules still apply: batch-shaped outputs stay split, the rest replicated
        assert out["rows"].sharding.spec == P(s.batch_axis) and out["loss"].sharding.is_fully_replicated
    assert len(traces) == 2, traces


def _flat_step(s: mx.MirroredStrategy, **kwargs):
    from mirrorax.steps.dispatch import StrategyFunction

    def step(state, x):
        new = {"b": state["b"] + x.sum(), "a": [w * 2 for w in state["a"]]}
        return new, jnp.stack([new["b"], x.mean()])

    return StrategyFunction(s.batch_mesh, s.in_flight, step, donate_argnums=0,
                            out_shardings=lambda state, x: (jax.tree.map(lambda a: a.sharding, state), s.replicated),
                            ready=lambda out: out[1], flat_state=True, **kwargs)


def test_flat_state_program_takes_the_leaves_and_is_the_pytree_calls_program():
    """``flat_state=True``: the compiled program takes and gives the state as its leaves (a loop keeps it
    so between steps; JAX then sorts no dict keys and builds no dicts per call); called with the state
    itself, lowered, or as ``flat_program``, it is one compiled program."""
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    step = _flat_step(s)
    state = {"b": s.replicate(np.float32(1)), "a": [s.replicate(np.arange(3, dtype=np.float32))]}
    x = jax.device_put(np.arange(4, dtype=np.float32), s.batch_sharding)
    lowered = step.lower(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state),
                         x).compile()
    (new, aux), ready = step.program(state, x)(state, x)
    assert isinstance(new, dict) and float(new["b"]) == 7 and new["a"][0].tolist() == [0, 2, 4]
    assert ready is aux and aux.tolist() == [7, 1.5]
    program, treedef = step.flat_program(new, x)
    leaves = treedef.flatten_up_to(new)
    assert [a.shape for a in leaves] == [(3,), ()]  # the dict's keys in JAX's order: "a", then "b"
    (out, aux), _ = program(leaves, x)
    assert isinstance(out, list) and treedef.unflatten(out)["a"][0].tolist() == [0, 4, 8] and float(out[1]) == 13
    assert out[1].sharding == s.replicated
    assert step.compile_count == 1 and "guarded" in lowered.as_text()[:2000]


def test_flat_state_refuses_a_state_of_another_structure_with_the_fix():
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    from mirrorax.steps.dispatch import StrategyFunction

    bad = StrategyFunction(s.batch_mesh, s.in_flight, lambda state, x: ({"c": state["b"]}, x.sum()),
                           out_shardings=lambda state, x: (s.replicated, s.replicated), ready=lambda out: out[1],
                           flat_state=True)
    x = jax.device_put(np.arange(4, dtype=np.float32), s.batch_sharding)
    with pytest.raises(TypeError, match="Return the state with the structure it came in"):
        bad({"b": s.replicate(np.float32(1))}, x)
    with pytest.raises(ValueError, match="flat_state=True needs out_shardings"):
        StrategyFunction(s.batch_mesh, s.in_flight, lambda state: state, flat_state=True)
    step = _flat_step(s)
    state = {"b": s.replicate(np.float32(1)), "a": [s.replicate(np.arange(3, dtype=np.float32))]}
    step(state, x)
    with pytest.raises(TypeError, match="Expected a state of structure"):  # the program of another structure
        step.program(state, x)({"b": state["b"]}, x)


def test_the_train_loop_keeps_the_state_as_its_leaves(monkeypatch):
    """Trainer.fit calls its train program with the state's leaves at every step (no TrainState built and
    flattened per step); the trainer ends with the TrainState. (Its numbers: tests/test_equivalence.py.)"""
    from helpers import dense, flat_digits

    from mirrorax.steps.dispatch import StrategyFunction

    x, y, _, _ = flat_digits(56)
    firsts = []
    real = StrategyFunction.flat_program

    def flat_program(self, *args):
        program, treedef = real(self, *args)
        return (lambda leaves, tree: firsts.append(type(leaves)) or program(leaves, tree)), treedef

    monkeypatch.setattr(StrategyFunction, "flat_program", flat_program)
    trainer = mx.Trainer(dense(seed=5), mx.MirroredStrategy(devices=jax.devices()[:2]))
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert firsts == [list] * 4  # 16 + 16 + 16 + 8 rows
    assert isinstance(trainer.state, mx.TrainState) and int(trainer.state.step) == 4
