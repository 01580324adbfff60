"""TrainState: a frozen dataclass pytree with the older dict-like reads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dense, flat_digits, strategy, train_step_args

import mirrorax as mx
from mirrorax._host import host_tree
from mirrorax.train_state import TrainState

FIELDS = ("params", "model_state", "optimizer", "metrics", "counters")
COUNTER_SHAPES = (("step", ()), ("skipped", ()), ("nonfinite_step", ()), ("bad_label", (4,)))


def make() -> TrainState:
    return TrainState.create(params={"dense/kernel": np.ones((2, 3), np.float32), "dense/bias": np.zeros(3)},
                             model_state={}, optimizer={"adam/iterations": np.zeros((), np.int32)},
                             metrics={"loss/total": np.float32(0.0)})


def test_public_and_frozen():
    assert mx.TrainState is TrainState and "TrainState" in mx.__all__
    state = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = 1  # type: ignore[misc]


def test_create_gives_zero_counters():
    state = make()
    assert state.counters.dtype == np.int32 and state.counters.shape == (7,) and not state.counters.any()
    for name, shape in COUNTER_SHAPES:
        value = getattr(state, name)
        assert isinstance(value, np.ndarray), name  # (a 0-d array, not a numpy scalar)
        assert value.dtype == np.int32 and value.shape == shape and not value.any(), name


def test_tree_map_keeps_the_type_and_flatten_order_is_the_field_order():
    state = make()
    doubled = jax.tree.map(lambda a: a * 2, state)
    assert type(doubled) is TrainState
    np.testing.assert_array_equal(doubled.params["dense/kernel"], 2 * np.ones((2, 3)))
    # Fields in declaration order, each group in its own tree's order: the same on every call.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == [".params['dense/bias']", ".params['dense/kernel']", ".optimizer['adam/iterations']",
                     ".metrics['loss/total']", ".counters"]
    leaves, treedef = jax.tree.flatten(state)
    again = jax.tree.unflatten(treedef, leaves)
    assert type(again) is TrainState and all(a is b for a, b in zip(jax.tree.leaves(again), leaves))
    assert jax.tree.structure(make()) == treedef


def test_passes_through_jit():
    @jax.jit
    def bump(s: TrainState) -> TrainState:
        return s.replace(step=s.step + 1, params=jax.tree.map(jnp.negative, s.params))

    out = bump(make())
    assert type(out) is TrainState and int(out.step) == 1
    np.testing.assert_array_equal(out.params["dense/kernel"], -np.ones((2, 3)))


def test_replace_returns_a_new_state():
    state = make()
    new = state.replace(step=np.int32(5))
    assert int(new.step) == 5 and int(state.step) == 0
    assert new.params is state.params
    with pytest.raises(TypeError, match="no field 'opt_state'.*params, model_state"):
        state.replace(opt_state={})


def test_dict_like_reads():
    state = make()
    assert state["params"] is state.params and state["counters"] is state.counters
    np.testing.assert_array_equal(state["bad_label"], state.bad_label)  # a counter reads as its attribute
    assert state.keys() == FIELDS and list(state) == list(FIELDS)
    assert "params" in state and "opt_state" not in state and 0 not in state
    assert dict(state) == state.as_dict()
    assert list(state.as_dict()) == list(FIELDS)
    assert all(state.as_dict()[k] is getattr(state, k) for k in FIELDS)


def test_unknown_key_says_what_there_is():
    with pytest.raises(KeyError, match="no entry 'opt_state'; its entries are params, model_state, optimizer"):
        make()["opt_state"]
    with pytest.raises(KeyError, match="no entry 0"):
        make()[0]  # type: ignore[index]


def test_from_dict_round_trip_and_refusal():
    state = make()
    back = TrainState.from_dict(state.as_dict())
    assert all(getattr(back, k) is getattr(state, k) for k in FIELDS)
    with pytest.raises(KeyError, match=r"missing: \['counters'\].*unknown: \['rng'\]"):
        TrainState.from_dict({**{k: v for k, v in state.as_dict().items() if k != "counters"}, "rng": 1})


def test_repr_is_short():
    text = repr(make())
    assert text.startswith("TrainState(params=<2 leaves>, model_state=<0 leaves>") and "step=" in text


@pytest.mark.multi_device
def test_trainer_state_is_a_train_state_on_the_strategys_layout():
    x, y, _, _ = flat_digits(64)
    t = mx.Trainer(dense(), strategy(4))
    assert t.state is None
    t.fit(x, y, batch_size=32, epochs=1, verbose=0)
    state = t.state
    assert type(state) is TrainState and state["params"] is state.params
    assert int(np.asarray(state.step)) == 2 and int(np.asarray(t.host_state()["step"])) == 2
    assert all(a.sharding.num_devices == 4 for a in jax.tree.leaves(state))
    host = t.host_state()
    assert type(host) is TrainState and all(isinstance(a, np.ndarray) for a in jax.tree.leaves(host))
    assert host.params.keys() == state.params.keys() and host.bad_label.shape == (4,)


# -- the counters, packed in one int32[7] leaf ----------------------------------------------------------
def test_counters_are_one_leaf_read_and_replaced_by_name():
    state = make().replace(step=np.int32(5), bad_label=np.array([3, 1, 7, 9], np.int32))
    np.testing.assert_array_equal(state.counters, [5, 0, 0, 3, 1, 7, 9])
    assert int(state.step) == 5 and state.bad_label.tolist() == [3, 1, 7, 9]
    state = state.replace(skipped=2, nonfinite_step=np.int32(4))  # the others kept
    np.testing.assert_array_equal(state.counters, [5, 2, 4, 3, 1, 7, 9])
    assert {k: np.asarray(v).tolist() for k, v in state.host_counters().items()} == {
        "step": 5, "skipped": 2, "nonfinite_step": 4, "bad_label": [3, 1, 7, 9]}
    with pytest.raises(TypeError, match="counters and step"):
        state.replace(step=1, counters=np.zeros(7, np.int32))


def test_counters_traced_and_on_devices():
    @jax.jit
    def bump(s: TrainState) -> TrainState:
        return s.replace(step=s.step + 1, skipped=s.skipped + (s.bad_label[0] == 0), bad_label=s.bad_label.at[2].set(6))

    out = bump(jax.device_put(make()))
    assert isinstance(out.counters, jax.Array) and out.counters.shape == (7,)
    np.testing.assert_array_equal(out.counters, [1, 1, 0, 0, 0, 6, 0])
    assert isinstance(out.step, jax.Array) and out.step.shape == () and int(out.step) == 1
    assert out.step.sharding.device_set == out.counters.sharding.device_set


def test_abstract_and_layout_states_read_counters_too():
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), make())
    assert abstract.step.shape == () and abstract.bad_label.shape == (4,) and abstract.counters.shape == (7,)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    layout = jax.tree.map(lambda _: sharding, make())
    assert layout.step is sharding and layout.bad_label is sharding


def test_from_dict_takes_the_older_form_with_counters_of_their_own():
    older = {k: v for k, v in make().as_dict().items() if k != "counters"}
    older.update(step=np.int32(7), skipped=np.int32(1), nonfinite_step=np.int32(0),
                 bad_label=np.array([0, 0, 0, 0], np.int32))
    state = TrainState.from_dict(older)
    np.testing.assert_array_equal(state.counters, [7, 1, 0, 0, 0, 0, 0])
    assert state.counters.dtype == np.int32 and state.params is older["params"]
    with pytest.raises(KeyError, match=r"missing: \['nonfinite_step'\]"):
        TrainState.from_dict({k: v for k, v in older.items() if k != "nonfinite_step"})


def test_the_trainers_compiled_step_takes_and_gives_the_counters_packed():
    # Each argument leaf of a compiled step costs host time at every call (~8 us a scalar on a TPU v5e):
    # a Keras MLP with one metric steps 14 model/optimizer leaves, the 4 metric sums (the loss Mean's
    # total and count, the accuracy's; packed they slowed the step at one CPU device, see
    # DeviceState.fresh_metrics) and ONE counters array: 19 leaves, not 22.
    x, y, _, _ = flat_digits(64)
    t = mx.Trainer(dense(), strategy(1))
    state, batch = train_step_args(t, x, y, batch_size=32)
    assert type(state) is TrainState
    assert len(jax.tree.leaves(state.params)) + len(jax.tree.leaves(state.optimizer)) == 14
    assert [np.shape(a) for a in jax.tree.leaves(state.metrics)] == [()] * 4
    assert len(jax.tree.leaves(state)) == 19 and state.counters.shape == (7,)
    lowered = t.steps.train.lower(state, batch)
    assert len(jax.tree.leaves(lowered.args_info[0][0])) == 19  # what the compiled program takes ...
    assert len(jax.tree.leaves(lowered.out_info[0])) == 19  # ... and gives back
    results = t.adapter.metric_results(host_tree(t.state.metrics))
    assert set(results) == {"loss", "accuracy"} and int(t.host_state().step) == 1
