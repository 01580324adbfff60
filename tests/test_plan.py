"""``mx.plan``: the step's per-device cost, known before step 1 from compile-only programs."""

import io
import json
import os
import subprocess

import jax
import keras
import numpy as np
import pytest
from helpers import Compiles, held_bytes
from jobs.procs import clean_env, python

import mirrorax as mx
from mirrorax.fit import planner

pytestmark = pytest.mark.multi_device


def _model(width=256):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="tanh"),
                          keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(10, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return m


def _data(n=64):
    x = np.random.default_rng(0).normal(size=(n, 64)).astype(np.float32)
    return x, np.arange(n) % 10


@pytest.mark.slow  # a fit per layout; test_a_model_made_under_a_scope_is_planned_on_its_strategy is fast
@pytest.mark.parametrize("shard", [None, "optimizer", "all"])
def test_planned_state_bytes_equal_what_fit_holds(shard):
    x, y = _data()
    s = mx.MirroredStrategy(devices=jax.devices()[:4], shard=shard)
    p = mx.plan(_model(), x, y, batch_size=32, strategy=s)
    trainer = mx.Trainer(_model(), s)
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert (p.param_bytes, p.optimizer_bytes, p.model_state_bytes) == tuple(
        held_bytes(trainer, g) for g in ("params", "optimizer", "model_state"))
    assert p.flops > 0 and p.peak_bytes >= p.argument_bytes - p.output_bytes
    params = sum(np.asarray(w).nbytes for w in _model().get_weights())
    # The gradient all-reduce moves (at least) every gradient once.
    assert p.collective_bytes >= (params if shard is None else params // 4)
    assert "per device" in str(p) and p.summary().startswith("plan: 4 devices")


@pytest.mark.slow  # a plan search: a compile per probe
def test_largest_batch_search_and_fit_refuses_a_step_that_does_not_fit(monkeypatch):
    x, y = _data()
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    # Narrow layers: the state stays under SHARD_MIN_SIZE, so the three modes compile one program per batch
    # (the searches of the other two modes load it from the session's cache), and the activations are a
    # large part of the step's peak from small batches on. Width 512 searched through 28 compiles.
    model = _model(64)
    at_64 = mx.plan(model, x, y, batch_size=64, strategy=s, search=False)
    memory = at_64.peak_bytes + 2**20  # a device with 1 MiB more than the step at batch 64 needs
    p = mx.plan(model, x, y, batch_size=64, strategy=s, device_memory=memory)
    largest = p.largest_batch[None]
    assert largest is not None and largest >= 64 and largest % 2 == 0
    assert mx.plan(model, x, y, batch_size=largest, strategy=s, device_memory=memory, search=False).fits
    over = largest + max(2, largest // 16)
    assert not mx.plan(model, x, y, batch_size=over, strategy=s, device_memory=memory, search=False).fits
    monkeypatch.setenv("MIRRORAX_DEVICE_MEMORY", str(memory))
    trainer = mx.Trainer(model, s)
    with pytest.raises(MemoryError, match=r"per device .* at global batch 100000 .*a global batch of at most"):
        trainer.fit(np.zeros((100000, 64), np.float32), np.zeros(100000, np.int32), batch_size=100000, verbose=0)
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)  # nothing half-done: the same trainer still trains


def test_parse_bytes():
    assert planner.parse_bytes("24GB") == 24 * 10**9
    assert planner.parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="24GB"):
        planner.parse_bytes("lots")


@pytest.mark.slow  # a plan and a fit per verbosity
@pytest.mark.parametrize("shard,devices", [(None, 4), ("all", 4), (None, 1)])
def test_fit_prints_the_plans_line_with_verbose_and_compiles_the_step_once(shard, devices):
    x, y = _data(128)
    s = mx.MirroredStrategy(devices=jax.devices()[:devices], shard=shard)
    expected = mx.plan(_model(), x, y, batch_size=32, strategy=s, search=False).summary()
    mx.Trainer(_model(), s).fit(x, y, batch_size=32, epochs=1, verbose=0)  # JAX's own one-time programs
    outputs, compiles = {}, {}
    for verbose in (0, 1, 2):
        trainer = mx.Trainer(_model(), s)
        trainer.stream = io.StringIO()
        with Compiles() as counted:
            trainer.fit(x, y, batch_size=32, epochs=2, verbose=verbose)
        outputs[verbose], compiles[verbose] = trainer.stream.getvalue(), counted.count
        assert trainer.compile_counts()["train"] == 1
    assert "plan:" not in outputs[0]
    for verbose in (1, 2):
        assert outputs[verbose].splitlines()[0] == expected  # the numbers are mx.plan's
        assert outputs[verbose].count("plan:") == 1
    # The plan's compile is the program step 1 runs: no compilation more than without the line.
    assert compiles[1] == compiles[2] == compiles[0], compiles


@pytest.mark.parametrize("devices", [1, 2])  # (on one device fit gives the step host arrays: planned so too)
@pytest.mark.parametrize("entry", ["trainer", "scope"])
def test_a_plan_after_a_fit_of_the_same_shapes_compiles_nothing(entry, devices, monkeypatch):
    """mx.plan after a fit compiled the whole step again (35 s for a 219M-parameter LM on a TPU): its batch
    lacked the real-row count fit's batches carry, and a model under a scope was planned on fresh steps."""
    from mirrorax.steps.dispatch import StrategyFunction

    x, y = _data(64)
    s = mx.MirroredStrategy(devices=jax.devices()[:devices])
    with s.scope():
        model = _model()
    if entry == "trainer":
        trainer = mx.Trainer(model, s)
        trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
        target = trainer
    else:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        trainer = target = model
    lowered = []
    lower = StrategyFunction.lower
    monkeypatch.setattr(StrategyFunction, "lower", lambda self, *a: lowered.append(1) or lower(self, *a))
    with Compiles() as counted:
        first = mx.plan(target, x[:1], y[:1], batch_size=32, search=False)
        again = mx.plan(target, x[:1], y[:1], batch_size=32, search=False)
    assert counted.count == 0
    # Read once: the second plan (and every later fit's, where the device memory is known) is the first's.
    assert len(lowered) == 1 and again == first
    assert mx.plan(target, x[:1], y[:1], batch_size=16, search=False).batch_size == 16  # another program
    assert len(lowered) == 2


@pytest.mark.parametrize("devices", [1, 2])
def test_fit_reads_its_plan_once_per_program(devices, monkeypatch):
    """Where a device's memory is known (accelerators; here MIRRORAX_DEVICE_MEMORY), fit plans its step at
    every start: the plan of a program already read is not read again (it cost ~0.5 s a fit on a TPU)."""
    from mirrorax.steps.dispatch import StrategyFunction

    monkeypatch.setenv("MIRRORAX_DEVICE_MEMORY", "16GB")
    x, y = _data(64)
    s = mx.MirroredStrategy(devices=jax.devices()[:devices])
    trainer = mx.Trainer(_model(), s)
    lowered = []
    lower = StrategyFunction.lower
    monkeypatch.setattr(StrategyFunction, "lower", lambda self, *a: lowered.append(1) or lower(self, *a))
    texts = []
    as_text = jax.stages.Compiled.as_text
    monkeypatch.setattr(jax.stages.Compiled, "as_text", lambda self, *a: texts.append(1) or as_text(self, *a))
    for _ in range(3):
        trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert len(lowered) == 1 and trainer.compile_counts()["train"] == 1
    # A quiet fit's memory check reads the memory analysis only; the plan shown later reads the cost and
    # the text of the same compiled program (no lowering, no compile), once.
    assert texts == []
    with Compiles() as counted:
        shown = mx.plan(trainer, x[:1], y[:1], batch_size=32, search=False)
        again = mx.plan(trainer, x[:1], y[:1], batch_size=32, search=False)
    assert counted.count == 0 and len(lowered) == 1 and len(texts) == 1
    assert shown.flops > 0 and again.flops == shown.flops
    assert (shown.collective_bytes > 0) == (devices > 1)


def test_a_model_made_under_a_scope_is_planned_on_its_strategy():
    x, y = _data(16)
    s = mx.MirroredStrategy(devices=jax.devices()[:2], shard="all")
    with s.scope():
        model = _model()
    p = mx.plan(model, x, y, batch_size=16, search=False)  # outside the scope
    assert (p.shard, p.num_devices) == ("all", 2)


@pytest.mark.slow  # a fit per verbosity
def test_model_fit_under_a_scope_prints_no_plan_line(capsys):
    # Keras's fit prints no plan, so the Keras program under the scope prints none at any verbose.
    x, y = _data(64)
    s = mx.MirroredStrategy(devices=jax.devices()[:2], shard="optimizer")
    for verbose in (0, 1, 2):
        with s.scope():
            model = _model()
        capsys.readouterr()
        model.fit(x, y, batch_size=16, epochs=1, verbose=verbose)
        out = capsys.readouterr().out
        assert "plan:" not in out, out


_MEMORY_SCRIPT = os.path.join(os.path.dirname(__file__), "jobs", "plan_memory.py")


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["none", "optimizer", "all"])
def test_planned_peak_is_within_20_percent_of_the_process_growth(shard):
    """On CPU the 4 simulated devices share one process: fit grows it by 4 x the plan's per-device peak,
    less the model's own copy of the weights that fit takes over (tests/jobs/plan_memory.py)."""
    # The job sets glibc's mmap threshold to 64 KiB, so freed buffers go back to the OS at once and the RSS
    # counts live memory: the dynamic threshold otherwise rises to the largest block freed (up to 32 MiB)
    # and keeps later blocks of that size in the heap after they are freed. Without it, shard="all"
    # measured 1.12-1.28x the plan in 5 runs, with it 1.07-1.09x (optimizer 1.02x, replicated 1.015x).
    proc = subprocess.run(python(_MEMORY_SCRIPT, shard, "4"), capture_output=True, text=True, timeout=280,
                          env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["planned"] == r["held"]  # state bytes on device 0: predicted == measured
    assert r["compiles"] == 1
    predicted = r["devices"] * r["peak_bytes"] - r["model_copy"]
    assert predicted > 200 * 2**20  # the state dominates the process's own noise
    assert abs(r["growth"] - predicted) <= 0.2 * predicted, (r["growth"] / 2**20, predicted / 2**20, r)


# -- traffic within and across hosts (mirrorax.traffic) ---------------------------------------------------

def _ring_factor(kind, n):
    """What each member of a ring of n sends, per byte of its result (the model of mirrorax.traffic)."""
    return {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n}[kind]


def test_replicated_gradient_all_reduce_crosses_hosts_at_the_rings_two_edges():
    x, y = _data(32)
    model = _model()
    params = sum(np.asarray(w).nbytes for w in model.get_weights())
    ids = [d.id for d in jax.devices()]
    p = mx.plan(model, x, y, batch_size=32, strategy=mx.MirroredStrategy(), search=False, hosts=2)
    t = p.traffic
    assert t.hosts == {i: k // 4 for k, i in enumerate(ids)} and t.num_hosts == 2
    assert {(c.kind, c.groups) for c in t.collectives} == {("all-reduce", (tuple(ids),))}
    reduced = sum(c.result_bytes for c in t.collectives)
    assert params <= reduced <= params + 64  # the gradients, plus the loss and metric sums packed in one operand
    # A ring over 0..7 on hosts {0..3}, {4..7} crosses at 3->4 and 7->0: 2 of its 8 members send across,
    # each 2 (8-1)/8 of the bytes reduced; the other 6 send within their host.
    assert t.across_bytes == round(2 * _ring_factor("all-reduce", 8) * reduced)
    assert t.within_bytes == round(6 * _ring_factor("all-reduce", 8) * reduced)
    assert t.across_bytes >= 3.5 * params
    assert {i for i, (_, a) in t.per_device.items() if a} == {ids[3], ids[7]}
    assert p.across_hosts_bytes == t.across_bytes and "across hosts" in str(p) and "across 2 hosts" in p.summary()


def test_fully_sharded_parameters_are_gathered_across_hosts():
    x, y = _data(32)
    p = mx.plan(_model(), x, y, batch_size=32, strategy=mx.MirroredStrategy(shard="all"), search=False,
                hosts={d.id: k // 4 for k, d in enumerate(jax.devices())})
    gathers = [c for c in p.traffic.collectives if c.kind == "all-gather"]
    # Whatever XLA gathers (the split kernels, or activations computed from them), it gathers over all 8
    # devices in their order: a ring whose 2 edges 3->4 and 7->0 cross hosts, (8-1)/8 of each result.
    assert gathers and all(c.groups == (tuple(d.id for d in jax.devices()),) for c in gathers)
    gathered = sum(c.result_bytes for c in gathers)
    assert sum(c.across_bytes for c in gathers) == pytest.approx(2 * _ring_factor("all-gather", 8) * gathered)
    assert sum(c.within_bytes for c in gathers) == pytest.approx(6 * _ring_factor("all-gather", 8) * gathered)


def _mesh_2x4(devices=None):
    devices = jax.devices() if devices is None else devices
    return jax.sharding.Mesh(np.asarray(devices).reshape(2, 4), ("hosts", "chips"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _psum_over(mesh, axis):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.ShapeDtypeStruct((8, 256), np.float32, sharding=NamedSharding(mesh, P(("hosts", "chips"))))
    f = jax.shard_map(lambda a: jax.lax.psum(a, axis), mesh=mesh, in_specs=P(("hosts", "chips")),
                      out_specs=P(("hosts", "chips")))
    return jax.jit(f).lower(x).compile()


def test_a_reduction_within_the_inner_axis_crosses_no_host():
    compiled = _psum_over(_mesh_2x4(), "chips")
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in compiled.as_text()  # the list form
    t = mx.traffic(compiled, hosts=2)
    ids = [d.id for d in jax.devices()]
    [c] = t.collectives
    assert (c.kind, c.result_bytes, c.groups) == ("all-reduce", 1024, (tuple(ids[:4]), tuple(ids[4:])))
    assert t.across_bytes == 0 and t.within_bytes == 8 * _ring_factor("all-reduce", 4) * 1024
    # By default a device's host is its process: one process, one host.
    assert mx.traffic(compiled).num_hosts == 1
    # The same program over the outer axis: every byte crosses (pairs {0,4}, {1,5}, ... of one member per host).
    outer = mx.traffic(_psum_over(_mesh_2x4(), "hosts"), hosts=2)
    assert outer.collectives[0].groups == tuple((ids[k], ids[k + 4]) for k in range(4))
    assert outer.within_bytes == 0 and outer.across_bytes == 8 * _ring_factor("all-reduce", 2) * 1024


def test_group_ids_are_positions_in_the_programs_device_assignment():
    # A mesh of devices in the order 0,4,1,5 | 2,6,3,7: the inner axis's groups are XLA's {0,1,2,3} and
    # {4,5,6,7}, which are devices {0,4,1,5} and {2,6,3,7}; on hosts by device id (0-3, 4-7) its ring
    # 0->4->1->5->0 crosses at every edge.
    d = jax.devices()
    order = [d[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    t = mx.traffic(_psum_over(_mesh_2x4(order), "chips"),
                   hosts=lambda dev: d.index(dev) // 4)
    assert t.collectives[0].groups == tuple(tuple(x.id for x in order[k:k + 4]) for k in (0, 4))
    assert t.within_bytes == 0 and t.across_bytes == 8 * _ring_factor("all-reduce", 4) * 1024


def test_the_iota_and_mesh_forms_of_replica_groups():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh_2x4()
    ids = [d.id for d in jax.devices()]
    x = jax.ShapeDtypeStruct((8, 256), np.float32, sharding=NamedSharding(mesh, P(("hosts", "chips"))))
    # Rows split 8 ways, re-split over the inner axis only: XLA gathers over the outer axis, printing its
    # groups {0,4},{1,5},{2,6},{3,7} in the iota form.
    gather = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P("chips"))).lower(x).compile()
    assert "replica_groups=[4,2]<=[2,4]T(1,0)" in gather.as_text()
    [g] = [c for c in mx.traffic(gather, hosts=2).collectives if c.kind == "all-gather"]
    assert g.groups == tuple((ids[k], ids[k + 4]) for k in range(4)) and g.result_bytes == 2 * 256 * 4
    assert g.across_bytes == 8 * _ring_factor("all-gather", 2) * g.result_bytes and g.within_bytes == 0
    # A sum over the inner axis, left to XLA's partitioner: the mesh form, mesh[...] {axis}.
    total = jax.jit(lambda a: a.reshape(2, 4, 256).sum(1),
                    out_shardings=NamedSharding(mesh, P("hosts"))).lower(x).compile()
    assert "replica_groups=mesh[" in total.as_text()
    [r] = mx.traffic(total, hosts=2).collectives
    assert r.groups == (tuple(ids[:4]), tuple(ids[4:])) and r.across_bytes == 0
    # On a 4x2 mesh with the rows split "b"-major, the sum over "a" prints the mesh's ids in the iota form
    # (device_ids=([4,2]T(1,0))): its groups are the devices of each column, {0,2,4,6} and {1,3,5,7}.
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((8, 256), np.float32, sharding=NamedSharding(mesh, P(("b", "a"))))
    columns = jax.jit(lambda a: a.reshape(2, 4, 256).sum(1), out_shardings=NamedSharding(mesh, P("b"))).lower(x)
    text = columns.compile().as_text()
    assert "replica_groups=mesh[" in text and "device_ids=([4,2]T(1,0))" in text
    [c] = mx.traffic(columns.compile(), hosts=2).collectives
    assert c.groups == (tuple(ids[0::2]), tuple(ids[1::2]))
    assert (c.within_bytes, c.across_bytes) == (2 * 2 * _ring_factor("all-reduce", 4) * 1024,) * 2


def test_replica_modes_and_a_permute_from_hlo_text():
    """The group modes jit never prints today (replica ids: no channel_id; replicas spanning every
    partition), on a 2-replica x 2-partition program, read by XLA's rules."""
    from mirrorax.traffic import traffic_of

    d = jax.devices()[:4]  # devices[r * 2 + p]: replica r, partition p
    hlo = ("HloModule m, replica_count=2, num_partitions=2\n"
           "%a = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add\n"
           "%b = f32[4]{0} all-reduce(%x), channel_id=2, replica_groups={{0},{1}}, use_global_device_ids=false\n"
           "%c = f32[4]{0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1}}\n")
    a, b, c = traffic_of(hlo, d, hosts=2).collectives
    assert a.groups == ((d[0].id, d[2].id), (d[1].id, d[3].id))  # each partition's two replicas: across
    assert b.groups == ((d[0].id, d[1].id), (d[2].id, d[3].id))  # each replica's two partitions: within
    assert c.groups == ((d[0].id, d[1].id), (d[2].id, d[3].id)) and c.within_bytes == 2 * 16
    assert (a.within_bytes, a.across_bytes, b.within_bytes, b.across_bytes) == (0, 4 * 16, 4 * 16, 0)
    with pytest.raises(ValueError, match="divide the program's 4 devices"):
        traffic_of(hlo, d, hosts=3)


@pytest.mark.parametrize("entry", ["trainer", "scope"])
def test_fit_traces_its_step_once_with_the_plan_at_its_start(entry, monkeypatch):
    """Where the device memory is known, fit plans (lowers and compiles) its step before step 1: that trace
    and compile are the ones step 1 runs, for the Trainer and for model.fit under a scope alike."""
    monkeypatch.setenv("MIRRORAX_DEVICE_MEMORY", "16GB")
    x, y = _data(96)
    s = mx.MirroredStrategy(devices=jax.devices()[:2])
    with s.scope():
        model = _model()
    trainer = mx.Trainer(model, s) if entry == "trainer" else None

    def fit(batch_size):
        if trainer is not None:
            trainer.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
        else:
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)

    fit(32)  # builds the model (Keras's own symbolic build traces it too)
    calls = []
    call = type(model).call
    monkeypatch.setattr(type(model), "call", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    with Compiles() as counted:
        fit(48)  # a new global batch: one new program
    assert len(calls) == 1 and counted.count == 1, (calls, counted.count)
