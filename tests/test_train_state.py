"""TrainState: a frozen dataclass pytree with the older dict-like reads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dense, flat_digits, strategy

import mirrorax as mx
from mirrorax.train_state import TrainState

FIELDS = ("params", "model_state", "optimizer", "metrics", "step", "skipped", "nonfinite_step", "bad_label")


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
    for name, shape in (("step", ()), ("skipped", ()), ("nonfinite_step", ()), ("bad_label", (4,))):
        value = getattr(state, name)
        assert value.dtype == np.int32 and value.shape == shape and not value.any(), name


def test_tree_map_keeps_the_type_and_flatten_order_is_the_field_order():
    state = make()
    doubled = jax.tree.map(lambda a: a * 2, state)
    assert type(doubled) is TrainState
    np.testing.assert_array_equal(doubled.params["dense/kernel"], 2 * np.ones((2, 3)))
    # Fields in declaration order, each group in its own tree's order: the same on every call.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == [".params['dense/bias']", ".params['dense/kernel']", ".optimizer['adam/iterations']",
                     ".metrics['loss/total']", ".step", ".skipped", ".nonfinite_step", ".bad_label"]
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
    assert state["params"] is state.params and state["bad_label"] is state.bad_label
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
    with pytest.raises(KeyError, match=r"missing: \['bad_label'\].*unknown: \['rng'\]"):
        TrainState.from_dict({**{k: v for k, v in state.as_dict().items() if k != "bad_label"}, "rng": 1})


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
