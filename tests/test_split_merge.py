"""The split/merge protocol (``mirrorax.steps.split_merge``) as a third party implements it, through ``strategy.jit``.

Keras's variables and Flax NNX's objects are the protocol's two front-ends; here a toy third one, ``Cells``,
whose objects a step reaches by itself (a global, as TF-style Keras steps reach a model): found by the
protocol's discovery trace, bound in the trace, written back, donated by ownership. Its numbers are exact
(small integers in float32).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import strategy

from mirrorax.steps import split_merge

pytestmark = pytest.mark.multi_device

_STACK: list[tuple[str, dict[int, object]]] = []  # the innermost recorder or binding


class Cell:
    """A mutable array a step reads (``get``) and assigns (``set``)."""

    def __init__(self, value) -> None:
        self.value = jnp.asarray(value, jnp.float32)
        self.taken = True  # whether someone may hold self.value (set by value(), cleared by the engine's write)

    def get(self):
        if not _STACK:
            self.taken = True
            return self.value
        kind, seen = _STACK[-1]
        if kind == "record":
            seen.setdefault(("read", id(self)), self)
            return self.value
        return seen[id(self)]

    def set(self, value) -> None:
        if not _STACK:
            self.value, self.taken = jnp.asarray(value, jnp.float32), True
            return
        kind, seen = _STACK[-1]
        if kind == "record":
            seen.setdefault(("set", id(self)), self)
        else:
            seen[id(self)] = value


class Cells:
    """The toy's protocol: cells found by a discovery trace (none among the arguments)."""

    def owns(self, x) -> bool:
        return False

    @contextlib.contextmanager
    def _recording(self):
        seen: dict = {}
        _STACK.append(("record", seen))
        try:
            def found():
                assigned = tuple(c for (kind, _), c in seen.items() if kind == "set")
                read = tuple(c for (kind, i), c in seen.items() if kind == "read" and ("set", i) not in seen)
                return (assigned, read) if assigned or read else None

            yield found
        finally:
            _STACK.pop()

    def discover(self, args, where):
        if any(isinstance(a, Cell) for a in jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, Cell))):
            raise TypeError(f"{where} received a Cell among its arguments: use it in the step instead.")
        return self._recording()

    def split(self, objects):
        assigned, read = objects
        return objects, ([c.value for c in assigned], [c.value for c in read])

    def layouts(self, structure, state, mesh):
        return [mesh.replicated] * len(jax.tree.leaves(state))

    @contextlib.contextmanager
    def bind(self, structure, state):
        (assigned, read), (changed, values) = structure, state
        mapping = {id(c): v for c, v in zip((*assigned, *read), (*changed, *values))}
        _STACK.append(("bound", mapping))
        try:
            yield mapping
        finally:
            _STACK.pop()

    def state(self, structure, before, objects):
        return [jnp.asarray(objects[id(c)], jnp.float32) for c in structure[0]]

    def update(self, objects, state):
        for cells, values in zip(objects, state):
            for c, v in zip(cells, values):
                if c.value is not v:
                    c.value, c.taken = v, False

    def owned(self, objects, changed):
        return [not c.taken for c in objects[0]]

    def names(self, structure):
        return [f"cell {i}" for i in range(len(structure[0]))]


@pytest.fixture
def cells(monkeypatch):
    monkeypatch.setattr(split_merge, "_PROTOCOLS", list(split_merge.protocols()))  # (restored after the test)
    protocol = Cells()
    split_merge.register(protocol)
    return protocol


def test_a_third_party_protocol_found_by_tracing_threads_its_objects(cells):
    s = strategy(4)
    scale, total = Cell(np.full(3, 2.0)), Cell(np.zeros(3))
    x = np.arange(24, dtype=np.float32).reshape(8, 3)

    @s.jit
    def step(x):
        total.set(total.get() + scale.get() * x.sum(0))  # reached by the step itself: nothing passed
        return (scale.get() * x).sum()

    losses = [float(step(s.replicate(x))) for _ in range(3)]
    assert losses == [2.0 * x.sum()] * 3
    np.testing.assert_array_equal(np.asarray(total.value), 3 * 2.0 * x.sum(0))
    np.testing.assert_array_equal(np.asarray(scale.value), [2.0, 2.0, 2.0])  # read only: never written
    assert step.compile_count == 1
    assert total.value.sharding.is_equivalent_to(s.replicated, 1)  # new state on the devices, as laid out

    # A value set from outside is the user's: the next call copies it before donating, and it stays valid.
    mine = jnp.ones(3)
    total.set(mine)
    step(s.replicate(x))
    np.testing.assert_array_equal(np.asarray(mine), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(total.value), 1.0 + 2.0 * x.sum(0))

    # The engine's own write, untaken since, is donated as it is (no copy: its buffer is reused).
    written = total.value
    step(s.replicate(x))
    assert written.is_deleted()

    with pytest.raises(TypeError, match="reads or assigns stateful objects .cell 0"):
        step.program(s.replicate(x))
    with pytest.raises(TypeError, match="received a Cell among its arguments"):
        s.jit(lambda c: c.get())(total)


def test_a_step_that_touches_no_cell_compiles_as_a_plain_function(cells):
    s = strategy(2)
    step = s.jit(lambda x: x * 2)
    np.testing.assert_array_equal(np.asarray(step(s.replicate(np.ones(2)))), [2.0, 2.0])
    step.program(s.replicate(np.ones(2)))  # (a stateful step refuses program())
    assert step.compile_count == 1
