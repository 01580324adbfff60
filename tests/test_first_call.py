"""A program's first call runs with the collector paused and the frame stack's room reserved
(``mirrorax.steps.first_call``).

CPython maps its frames' stack in 16 KiB chunks and unmaps a chunk as soon as the call that needed it
returns: a trace going up and down across a chunk's end maps, faults in and unmaps a chunk at every
crossing. The first call's frame reserves room, so the trace's frames stay in one chunk. Observed here
by the thread's minor page faults (Linux), while a function goes 400 frames deep (about 50 KiB of frames,
more than a chunk: it crosses at least one chunk's end from any starting depth) and back, 300 times.
"""

from __future__ import annotations

import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrorax as mx
from mirrorax.steps import first_call as _first_call

resource = pytest.importorskip("resource")
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(resource, "RUSAGE_THREAD"),
                       reason="the thread's page faults are counted on Linux only"),
    pytest.mark.skipif(sys.version_info < (3, 11), reason="CPython keeps frames in mapped chunks from 3.11 on"),
]

ROUNDS = 300


def _down(d: int) -> int:
    return 0 if d == 0 else _down(d - 1)


def _faults_going_deep() -> int:
    """The thread's minor page faults while ``_down`` goes 400 frames deep and back, ``ROUNDS`` times."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(ROUNDS):
        _down(400)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_going_deep_maps_a_chunk_each_time_without_the_room():
    """The case the room is for (which the other tests would miss if it did not happen): outside a first
    call, every round trip maps a fresh chunk."""
    assert _faults_going_deep() >= ROUNDS


def test_a_first_call_keeps_its_frames_in_one_chunk_and_leaves_the_collector_as_found():
    enabled = gc.isenabled()
    seen = []
    assert _first_call.run(lambda a, b=0: seen.append((_faults_going_deep(), gc.isenabled())) or a + b, 2, b=3) == 5
    (faults, collecting), = seen
    assert faults < ROUNDS // 10 and not collecting
    assert gc.isenabled() is enabled
    # Nested: the outer call's room serves (no second reservation), and the collector stays paused.
    inner = _first_call.run(lambda: _first_call.run(lambda: (_faults_going_deep(), gc.isenabled())))
    assert inner[0] < ROUNDS // 10 and inner[1] is False and gc.isenabled() is enabled


def test_an_error_inside_leaves_the_collector_on():
    with pytest.raises(ZeroDivisionError):
        _first_call.run(lambda: 1 / 0)
    assert gc.isenabled()
    assert _faults_going_deep() >= ROUNDS  # and the room is gone with the call


@pytest.mark.multi_device
@pytest.mark.parametrize("collector_on", [True, False])
def test_every_program_traces_in_a_first_call(collector_on):
    """fit's, evaluate's and predict's programs, strategy.jit's first call of a signature and its
    discovery trace (stateful) or layout trace (given layouts) all trace inside a first call: the collector
    paused (full collections of a large heap took half of a fresh process's step trace) and the frame
    stack's room reserved; afterwards the collector is as the user left it. The traced functions run
    Python only while a program is traced (after the model's first look at the shapes)."""
    import optax

    seen = []  # (collector on, faults going deep) at each trace

    def look():
        seen.append((gc.isenabled(), _faults_going_deep()))

    def apply(p, x):
        look()
        return jnp.tanh(x @ p["w"])

    model = mx.FunctionalModel(apply, {"w": np.full((3, 2), 0.1, np.float32)},
                               loss="sparse_categorical_crossentropy_from_logits", optimizer=optax.sgd(0.1))
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    trainer = mx.Trainer(model, s)
    x, y = np.ones((10, 3), np.float32), np.arange(10) % 2
    if not collector_on:
        gc.disable()
    try:
        trainer.fit(x, y, batch_size=4, epochs=2, verbose=0)  # a full batch, then the short last one
        trainer.evaluate(x, y, batch_size=4, verbose=0)
        trainer.predict(x, batch_size=4)
        double = s.jit(lambda a: (look(), a * 2)[1])
        double(s.replicate(np.ones(2, np.float32)))
        double(s.replicate(np.ones(2, np.float32)))
        for stateful in (True, False):  # given layouts: the trace is the first call's own
            triple = s.jit(lambda a: (look(), a * 3)[1], out_shardings=s.replicated, stateful=stateful)
            triple(s.replicate(np.ones(2, np.float32)))
            triple(s.replicate(np.ones(2, np.float32)))
        assert gc.isenabled() is collector_on
    finally:
        gc.enable()
    # The first look is the model's build (the outputs' shape, before any program); then the programs.
    assert seen[0][0] is collector_on and not any(on for on, _ in seen[1:]), seen
    assert all(faults < ROUNDS // 10 for _, faults in seen[1:]), seen
    assert len(seen) >= 8  # two train programs, evaluate's, predict's, the jits' traces


def _deep(k: int, f):
    return f() if k == 0 else _deep(k - 1, f)


@pytest.mark.multi_device
def test_a_warm_fit_keeps_its_frames_in_one_chunk_from_any_depth():
    """Trainer.fit (evaluate, predict) runs with the room too: called from deeper and deeper stacks (a
    notebook's, a framework's), a warm fit's own Python straddles a chunk's end at some depth, and there
    it mapped a chunk again and again (the bare method: >= 30 faults a call; with the room a few)."""
    import optax

    model = mx.FunctionalModel(lambda p, x: jnp.tanh(x @ p["w"]), {"w": np.full((3, 2), 0.1, np.float32)},
                               loss="sparse_categorical_crossentropy_from_logits", optimizer=optax.sgd(0.1))
    trainer = mx.Trainer(model, mx.MirroredStrategy(devices=jax.devices()[:2]))
    x, y = np.ones((16, 3), np.float32), np.arange(16) % 2

    def faults(fit) -> int:
        fit()  # warm: the programs compiled
        worst = 0
        for depth in range(0, 240, 3):  # ~24 KiB of frames: more than a chunk, so some depth straddles one
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            _deep(depth, fit)
            worst = max(worst, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        return worst

    def roomy():
        trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)

    def bare():
        type(trainer).fit.__wrapped__(trainer, x, y, batch_size=8, epochs=1, verbose=0)

    assert faults(bare) >= 30  # the case the room is for happens here
    assert faults(roomy) < 15
    assert int(trainer.state.step) == 2 * (1 + 80) * 2  # every fit ran: 2 steps each, 81 fits per form, 2 forms
