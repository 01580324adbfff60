"""Elastic jobs (issue 48): snapshots, a fit restarted on another process count, ``mirrorax launch
--min-nprocs`` and Ray Train.

In this process: snapshots (:mod:`mirrorax.checkpoint.snapshot`) on any layout, what a node keeps, damage, the schedule,
flat memory and threads over a long run; a fit stopped mid-epoch and resumed from its snapshot on another
device count; the restart's line; the launcher's restart policy. In processes (slow): ``tests/jobs/
elastic_job.py``'s three trainings (``model.fit``, ``mx.Trainer(shard="all")``, a custom loop), under
``mirrorax launch --nprocs 4 --min-nprocs 2`` with one process killed twice, and on Ray Train
(``tests/test_ray.py``), each against one uninterrupted run of 4 processes x 2 devices.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import flat_digits, flip_bit_after, rewrite_snapshot_index, strategy
from jax.sharding import NamedSharding, PartitionSpec
from jobs.procs import ROOT, SCRIPTS, clean_env, launcher, python

import mirrorax as mx
from mirrorax.checkpoint import policy, snapshot
from mirrorax.checkpoint import snapshot_io as _snapshot_io
from mirrorax.cluster import restarts as _restarts
from mirrorax.fit import elastic

pytestmark = pytest.mark.multi_device

#: The multi-device floor: each array of a run within this of the reference's largest magnitude, each logged
#: value within it relative (tests/README.md: N devices against 1 after a few Adam epochs).
FLOOR = 1e-5


def _state(s: mx.MirroredStrategy):
    """A replicated leaf, one split over the devices, an integer and a typed PRNG key."""
    rng = np.random.default_rng(0)
    split = NamedSharding(s.mesh, PartitionSpec(s.batch_axis))
    return {"w": s.replicate(rng.normal(size=(5, 3)).astype(np.float32)),
            "shards": jax.device_put(rng.normal(size=(24, 2)).astype(np.float32), split),
            "count": s.replicate(np.int32(7)),
            "key": s.replicate(jax.random.key(3))}


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_snapshot_restores_bit_for_bit_on_other_devices_and_layouts(tmp_path):
    saved = _state(strategy(8))
    with mx.Snapshots(tmp_path, every_steps=1) as snaps:
        snaps.save(11, saved, {"epoch": 1})
        snaps.save(12, saved, {"epoch": 1})
    # The split leaf's gather compiled once, not at every snapshot (it was 127 ms a snapshot at 8 devices).
    assert _snapshot_io._gather(saved["shards"].sharding.mesh)._cache_size() == 1
    other = _state(strategy(3))  # another device count; its "shards" split over 3 devices
    step, restored, meta = mx.Snapshots(tmp_path).restore_latest(_abstract(other))
    assert step == 12 and meta["epoch"] == 1 and meta["group"]["devices"] == jax.device_count()
    _same(restored, saved)
    assert restored["shards"].sharding == other["shards"].sharding  # the new run's layout
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)


def test_the_replica_check_sums_on_the_host_what_the_devices_would():
    """Issue 57: check_replicas, run at every multi-process fit's start, compiled a digest program per process
    (2.8 s of a restarted process's start on a loaded host); it sums whole copies on the host now, with the
    checksums the devices give (a replicated leaf, one split over the devices, an integer, a typed key, bfloat16)."""
    from mirrorax import integrity
    from mirrorax.cluster import consistency

    state = dict(_state(strategy(4)), half=strategy(4).replicate(np.linspace(-3, 3, 7).astype(jnp.bfloat16)))
    assert consistency._checksums(state) == integrity.digest(state)[0]
    assert list(consistency._checksums(state)) == list(integrity.digest(state)[0])  # (in the state's order)


def test_a_node_keeps_its_newest_snapshot_and_none_of_a_killed_writer(tmp_path):
    s = strategy(4)
    snaps = mx.Snapshots(tmp_path, every_steps=2)
    state = {"w": s.replicate(np.zeros(3, np.float32))}
    for step in range(1, 8):
        state = {"w": state["w"] + 1}
        snaps.maybe_save(step, state)
    snaps.wait()
    assert sorted(os.listdir(snaps.directory)) == ["4", "6"]  # steps 2, 4, 6 taken; the newest two kept
    os.makedirs(os.path.join(snaps.directory, "8.tmp-999"))  # a writer killed mid-write
    state = {"w": state["w"] + 1}
    snaps.maybe_save(8, state)
    snaps.wait()
    assert sorted(os.listdir(snaps.directory)) == ["6", "8"]
    step, restored, _ = mx.Snapshots(tmp_path).restore_latest(_abstract(state))
    assert step == 8 and float(restored["w"][0]) == 8.0


def test_a_damaged_snapshot_is_skipped_with_a_warning_and_the_one_before_taken(tmp_path):
    state = {"w": strategy(2).replicate(np.arange(6, dtype=np.float32))}
    with mx.Snapshots(tmp_path) as snaps:
        snaps.save(3, state)
        snaps.save(4, {"w": state["w"] + 1})
    for step in (4, 3):
        data = os.path.join(snaps.directory, str(step), "state.bin")
        raw = bytearray(open(data, "rb").read())
        raw[-1] ^= 0x40  # a flipped bit in the last float
        open(data, "wb").write(bytes(raw))
        with pytest.warns(mx.SnapshotWarning, match=f"/{step}: the bytes of 'w' do not match their checksum: skipped, "
                                                    f"moved to .*/{step}.damaged"):
            restored = mx.Snapshots(tmp_path).restore_latest(_abstract(state))
        assert restored is None if step == 3 else restored[0] == 3
    assert sorted(os.listdir(snaps.directory)) == ["3.damaged", "4.damaged"]


def test_another_models_snapshot_is_refused(tmp_path):
    s = strategy(2)
    with mx.Snapshots(tmp_path) as snaps:
        snaps.save(1, {"w": s.replicate(np.zeros((3, 4), np.float32))})
    with pytest.raises(mx.SnapshotError, match=r"variable 'w' is shape=\(3, 4\) dtype=float32 there but "
                                              r"shape=\(3, 5\) dtype=float32 here"):
        mx.Snapshots(tmp_path).restore_latest({"w": jax.ShapeDtypeStruct((3, 5), np.float32, sharding=s.replicated)})


def test_snapshots_off_without_a_directory(monkeypatch):
    monkeypatch.delenv(snapshot.DIR_ENV, raising=False)
    snaps = mx.Snapshots()
    assert not snaps.enabled and not snaps.maybe_save(5, {"w": jnp.zeros(1)})
    assert snaps.restore_latest({}) is None and snaps.latest_step() is None


def test_the_schedule_every_steps_and_by_the_clock(tmp_path, monkeypatch):
    every = mx.Snapshots(tmp_path, every_steps=3)
    assert [s for s in range(1, 10) if every.due(s)] == [3, 6, 9]
    jumps = mx.Snapshots(tmp_path, every_steps=3)  # 4 steps per dispatch: a multiple passed is due (the first
    assert [s for s in (4, 8, 12, 16) if jumps.due(s)] == [8, 12, 16]  # call knows no step before it)
    resumed = mx.Snapshots(tmp_path, every_steps=3)  # resumed at step 10: the next multiple, not at once
    assert [s for s in (11, 12, 13) if resumed.due(s)] == [12]
    clock = [100.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    timed = mx.Snapshots(tmp_path, every_seconds=30)
    state = {"w": strategy(1).replicate(np.zeros(2, np.float32))}
    assert not timed.due(1)
    clock[0] += 5.0  # 10 steps in 5 s: 2 steps a second, 60 steps to 30 s
    assert timed.due(snapshot.FIRST_STEPS + 1)  # the first: a few steps in; the next planned from it
    timed.save(snapshot.FIRST_STEPS + 1, state)
    assert timed.next_step == snapshot.FIRST_STEPS + 1 + 60
    timed.wait()


def test_the_writer_says_a_failed_write_once_and_training_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    snaps = mx.Snapshots(blocker)  # its node directory cannot be made under a file
    state = {"w": strategy(1).replicate(np.zeros(2, np.float32))}
    snaps.save(1, state)
    with pytest.warns(mx.SnapshotWarning, match="could not be written"):
        snaps.wait()
    snaps.save(2, state)
    snaps.wait()  # said once


def test_memory_and_threads_stay_flat_over_a_long_run_with_frequent_snapshots(tmp_path, monkeypatch):
    """Issue 48: a snapshot at every step of 600 steps, after a warm-up: the process's threads, its Python
    memory (tracemalloc), its resident memory and the snapshots on disk do not grow."""
    import tracemalloc

    monkeypatch.setenv(snapshot.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(snapshot.STEPS_ENV, "1")
    monkeypatch.setattr(elastic, "_fits", itertools.count(1))
    s = strategy(4)
    x, y, _, _ = flat_digits(64)
    with s.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    trainer = mx.Trainer(model, s)
    seen: dict[int, tuple[int, int, float]] = {}

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    class Look(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch in (19, 59):
                import gc

                gc.collect()
                seen[epoch] = (threading.active_count(), tracemalloc.get_traced_memory()[0], rss_mb())

    tracemalloc.start()
    try:
        trainer.fit(x, y, batch_size=8, epochs=60, verbose=0, callbacks=[Look()])  # 480 steps, 480 snapshots
    finally:
        tracemalloc.stop()
    (threads0, py0, rss0), (threads1, py1, rss1) = seen[19], seen[59]
    assert threads1 == threads0, (threads0, threads1)
    assert py1 - py0 < 256 * 1024, f"Python memory grew {(py1 - py0) / 1024:.0f} KiB over 320 snapshots"
    assert rss1 - rss0 < 8, f"resident memory grew {rss1 - rss0:.1f} MiB over 320 snapshots"
    node_dir = os.path.join(tmp_path, _snapshot_io.node_name())
    (fit1,) = [d for d in os.listdir(node_dir) if d.startswith("fit1-") and os.path.isdir(os.path.join(node_dir, d))]
    assert sorted(os.listdir(os.path.join(node_dir, fit1))) == ["479", "480"]  # the job's folder: the newest two


def _fit(n: int, tmp_path, monkeypatch, stop_at: int | None = None, keras_fit: bool = False,
         learning_rate: float | None = None):
    """A Keras model (BatchNormalization, Dropout) fit for 3 epochs on 300 rows at batch 48 on ``n`` devices,
    snapshots every 3 steps in ``tmp_path``; ``stop_at``: a callback raises after that step (a lost process:
    the snapshots stay); ``keras_fit``: the model's own fit (Keras's order), else mx.Trainer's;
    ``learning_rate``: another than the model's (3e-3)."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    import elastic_job

    monkeypatch.setenv(snapshot.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(snapshot.STEPS_ENV, "3")
    monkeypatch.setattr(elastic, "_fits", itertools.count(1))  # a new process: its first fit
    x, y, xt, yt = elastic_job.data()
    np.random.seed(5)
    s = strategy(n)
    with s.scope():
        model = elastic_job.keras_model()
        if learning_rate is not None:
            model.optimizer.learning_rate = learning_rate

    class Lost(Exception):
        pass

    def die(batch, logs=None):
        nonlocal steps
        steps += 1
        if steps == stop_at:
            raise Lost

    steps = 0
    stop = keras.callbacks.LambdaCallback(on_train_batch_end=die)
    try:
        if keras_fit:  # (Keras's progress bar, a line per epoch)
            hist = model.fit(x, y, batch_size=48, epochs=3, verbose=2, callbacks=[stop]).history
        else:
            hist = mx.Trainer(model, s).fit(x, y, batch_size=48, epochs=3, seed=7, verbose=2, callbacks=[stop]).history
    except Lost:
        return None
    return hist, model.evaluate(xt, yt, batch_size=48, verbose=0, return_dict=True), model.get_weights()


def _assert_floor(got, want) -> None:
    """History and evaluate within FLOOR relative; each array within FLOOR of the reference's magnitude."""
    for logs, want_logs in zip(got[:2], want[:2]):
        assert set(logs) == set(want_logs), (logs, want_logs)
        for key in want_logs:
            np.testing.assert_allclose(logs[key], want_logs[key], rtol=FLOOR, err_msg=key)
    for a, b in zip(got[2], want[2]):
        assert np.max(np.abs(a - b)) <= FLOOR * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))


@pytest.mark.parametrize("keras_fit", [False, True], ids=["trainer", "model_fit"])
def test_a_fit_lost_mid_epoch_resumes_from_its_snapshot_on_another_device_count(tmp_path, monkeypatch, capfd,
                                                                               keras_fit):
    reference = _fit(8, tmp_path / "reference", monkeypatch, keras_fit=keras_fit)
    assert _fit(8, tmp_path / "run", monkeypatch, stop_at=11, keras_fit=keras_fit) is None
    capfd.readouterr()
    resumed = _fit(6, tmp_path / "run", monkeypatch, keras_fit=keras_fit)
    said = capfd.readouterr()
    line = [x for x in said.err.splitlines() if "elastic restart" in x]
    # The progress goes on from the epoch it was in (mirrorax's line per epoch, or Keras's bar), not from epoch 1.
    epochs = re.findall(r"Epoch (\d)/3", said.out)
    assert epochs == ["2", "3"], said.out
    assert len(line) == 1 and line[0].startswith(
        "mirrorax: elastic restart: fit 1 continues on 1 process (6 devices) from snapshot step 9 (epoch 2, batch 2); "
        "the job had 1 process (8 devices); 2 steps lost (it had reached step 11)."), line  # exact: noted each step
    _assert_floor(resumed, reference)  # Keras's History too: the epochs before the loss are in it
    assert len(resumed[0]["loss"]) == 3


@pytest.fixture(scope="module")
def lost_at_11(tmp_path_factory):
    """``mx.Trainer``'s uninterrupted fit on 8 devices, and the snapshots of one lost after step 11 (taken at steps
    3, 6 and 9; the newest two kept)."""
    root = tmp_path_factory.mktemp("lost_at_11")
    with pytest.MonkeyPatch.context() as mp:
        reference = _fit(8, root / "reference", mp)
        assert _fit(8, root / "run", mp, stop_at=11) is None
    return reference, root / "run"


#: One bit of each field of snapshot 9's records (its position, its index: a shape, an offset, a checksum), and an
#: index entry of dtype ``object`` written with a valid digest: each makes it damage.
SNAPSHOT_EDITS = {
    "position: batch_in_epoch": lambda d: flip_bit_after(d / "meta.json", b'"batch_in_epoch":'),
    "position: epoch": lambda d: flip_bit_after(d / "meta.json", b'"epoch":'),
    "index: shape": lambda d: flip_bit_after(d / "index.json", b'"shape":['),
    "index: offset": lambda d: flip_bit_after(d / "index.json", b'"offset":'),
    "index: crc32": lambda d: flip_bit_after(d / "index.json", b'"crc32":'),
    "index: dtype object": lambda d: rewrite_snapshot_index(d, lambda i: i["leaves"][0].update(dtype="object")),
}


@pytest.mark.slow
@pytest.mark.parametrize("edit", SNAPSHOT_EDITS, ids=list(SNAPSHOT_EDITS))
def test_a_damaged_snapshot_is_passed_over_for_the_one_before_with_the_uninterrupted_numbers(
        tmp_path, monkeypatch, capfd, lost_at_11, edit):
    """Issue 56: a fit restarted on a snapshot whose records were edited (one bit) or crafted takes the snapshot
    before it, with one warning naming the damaged one, and ends with the uninterrupted run's numbers (a flipped
    ``batch_in_epoch`` resumed at the wrong place: 95 steps instead of 96, weights 3.0e-2 away)."""
    reference, lost = lost_at_11
    run = tmp_path / "run"
    shutil.copytree(lost, run)
    node = run / _snapshot_io.node_name()
    (fit1,) = [d for d in node.iterdir() if d.name.startswith("fit1-") and d.is_dir()]
    assert sorted(p.name for p in fit1.iterdir()) == ["6", "9"]
    SNAPSHOT_EDITS[edit](fit1 / "9")
    capfd.readouterr()
    with pytest.warns(mx.SnapshotWarning) as warned:
        resumed = _fit(6, run, monkeypatch)
    said = [str(w.message) for w in warned if issubclass(w.category, mx.SnapshotWarning)]
    assert len(said) == 1 and f"{fit1}/9: " in said[0], said
    assert said[0].endswith(f"skipped, moved to {fit1}/9.damaged; the snapshot before it is tried."), said
    line = [x for x in capfd.readouterr().err.splitlines() if "elastic restart" in x]
    # From the snapshot before, and the steps lost counted exactly: 11 were reached.
    assert len(line) == 1 and "from snapshot step 6 (epoch 1, batch 6)" in line[0], line
    assert line[0].endswith("5 steps lost (it had reached step 11)."), line
    _assert_floor(resumed, reference)


@pytest.mark.slow
def test_two_jobs_sharing_a_snapshot_folder_never_mix(tmp_path, monkeypatch):
    """Issue 56: two jobs with one MIRRORAX_SNAPSHOT_DIR, the same model, another learning rate. The second took the
    first's final snapshot, trained 0 batches and returned the first's weights; now it trains as if alone, saying
    which setting differs, and the first job's snapshots stay whole (run again, it passes through its own)."""
    alone = _fit(8, tmp_path / "alone", monkeypatch, learning_rate=1e-2)
    first = _fit(8, tmp_path / "shared", monkeypatch)
    with pytest.warns(mx.SnapshotWarning, match=r"are not this job's and are ignored \(learning_rate: 0.003 in that "
                                                r"job, 0.01 in this one\): fit1 starts afresh"):
        second = _fit(8, tmp_path / "shared", monkeypatch, learning_rate=1e-2)
    _assert_floor(second, alone)
    assert np.max(np.abs(second[2][0] - first[2][0])) > 1e-2  # (not the first job's weights)
    again = _fit(8, tmp_path / "shared", monkeypatch)
    _assert_floor(again, first)
    assert len([d for d in os.listdir(tmp_path / "shared" / _snapshot_io.node_name()) if d.endswith(".reached")]) == 2


def test_the_restart_line_names_the_lost_and_the_steps_lost(monkeypatch):
    here = ["ray-a", "ray-c", "ray-d"]  # a job of 3 processes, one node each
    monkeypatch.delenv(_restarts.LOST_ENV, raising=False)
    facts = {"reached": 44, "group": {"processes": 4, "devices": 8, "nodes": ["ray-a", "ray-b", "ray-c", "ray-d"]}}
    assert _restarts.restart_line("fit 2", "snapshot step 40 (epoch 2, batch 4)", 40, facts, 6, 3, here) == (
        "mirrorax: elastic restart: fit 2 continues on 3 processes (6 devices) from snapshot step 40 (epoch 2, batch "
        "4); the job had 4 processes (8 devices); lost: process 1 (its node ray-b left); 4 steps lost (it had reached "
        "step 44).")
    monkeypatch.setenv(_restarts.LOST_ENV, "process 1 (slot 1: killed by signal SIGKILL)")  # mirrorax launch's words
    told = _restarts.restart_line("'loop'", "snapshot step 40", 40, facts, 6, 3, here)
    assert "lost: process 1 (slot 1: killed by signal SIGKILL); 4 steps lost" in told
    monkeypatch.delenv(_restarts.LOST_ENV)
    grown = {"reached": 12, "group": {"processes": 2, "devices": 4, "nodes": ["ray-a", "ray-c"]}}
    assert _restarts.restart_line("fit 1", "snapshot step 12", 12, grown, 6, 3, here) == (
        "mirrorax: elastic restart: fit 1 continues on 3 processes (6 devices) from snapshot step 12; the job had 2 "
        "processes (4 devices); 0 steps lost (it had reached step 12).")


class _Store:
    """A coordination service's key-value store, shared by threads playing the processes of a job."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.changed:
            assert self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000), key
            return self.values[key]


def test_a_grown_group_says_the_group_before_it_not_the_one_that_took_the_snapshot(tmp_path, monkeypatch):
    """Issue 57: after a grow-back (3 processes -> 4) from a snapshot the 4 processes before the loss took, the
    restart line says the job had 3 processes and lost nothing (it said "the job had 4 processes ...; lost:
    process 1 (its node ray-b left)"). Each job notes its group on every node at its join, and reads the one
    noted before it: the newest of the nodes' notes."""
    monkeypatch.setenv(_restarts.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(_restarts.LOST_ENV, raising=False)
    monkeypatch.setattr(_restarts, "_before", [])
    names = iter(["ray-a", "ray-e"])  # two processes, two nodes: ray-a ran the group of 3, ray-e is new
    monkeypatch.setattr(_restarts, "node_name", lambda: local.name)
    local = threading.local()
    stale = {"processes": 4, "devices": 8, "nodes": ["ray-a", "ray-b", "ray-c", "ray-d"], "at": 1.0}
    last = {"processes": 3, "devices": 6, "nodes": ["ray-a", "ray-c", "ray-d"], "at": 2.0}
    with open(_restarts.group_file(str(tmp_path), "ray-e"), "w") as f:
        json.dump(stale, f)  # a node that was away since the group of 4
    with open(_restarts.group_file(str(tmp_path), "ray-a"), "w") as f:
        json.dump(last, f)
    store, seen = _Store(), {}

    def process(pid: int) -> None:
        local.name = next(names) if pid == 0 else "ray-e"
        _restarts.note_group(store, pid, 2, 2, timeout_s=20)
        seen[pid] = _restarts.group_before()

    threads = [threading.Thread(target=process, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == {0: last, 1: last}, seen
    for node in ("ray-a", "ray-e"):  # this job's group, noted on each of its nodes for the next one
        with open(_restarts.group_file(str(tmp_path), node)) as f:
            now = json.load(f)
        assert (now["processes"], now["devices"], now["nodes"]) == (2, 4, ["ray-a", "ray-e"]), now
    here = ["ray-a", "ray-c", "ray-d", "ray-e"]
    assert _restarts.restart_line("fit 1", "snapshot step 9 (epoch 2, batch 2)", 9, {"reached": 12, "group": stale}, 8,
                                  4, here) == (
        "mirrorax: elastic restart: fit 1 continues on 4 processes (8 devices) from snapshot step 9 (epoch 2, batch "
        "2); the job had 3 processes (6 devices); 3 steps lost (it had reached step 12).")


def test_the_launcher_leaves_out_a_slot_that_keeps_failing(tmp_path):
    env: dict[str, str] = {}
    r = _restarts.Restarts(4, 2, _restarts.default_max_restarts(4, 2), env)
    sigkill = "killed by signal SIGKILL"
    try:
        assert r.max_restarts == 5 and os.path.isdir(env[snapshot.DIR_ENV])
        assert r.after_failure([(1, sigkill, -9)]) == "restarting the group of 4"
        assert r.env(1) == {"MIRRORAX_SLOT": "1", _snapshot_io.LOST_ENV: "process 1 (slot 1: killed by signal SIGKILL)"}
        assert r.after_failure([(1, sigkill, -9)]) == (
            "slot 1 failed 2 times: restarting on the 3 process(es) left (--min-nprocs 2)")
        assert r.slots == [0, 2, 3] and r.env(1)["MIRRORAX_SLOT"] == "2" and "left out" in r.lost
        r.after_failure([(0, "exit code 1", 1)])
        assert r.after_failure([(0, "exit code 1", 1)]).startswith("slot 0 failed 2 times: restarting on the 2")
        assert r.after_failure([(1, "exit code 143: preempted", 143)]) == "restarting the group of 2"  # not counted
        assert r.after_failure([(1, "exit code 143: preempted", 143)]) == "restarting the group of 2"
        assert r.after_failure([(0, "exit code 1", 1)]) == "restarting the group of 2" and r.slots == [2, 3]
        # At --min-nprocs, a slot that keeps failing cannot be left out: the job stops, saying why.
        assert r.after_failure([(0, "exit code 1", 1)]) is None and r.slots == [2, 3]
        assert r.stopped == ("fewer than --min-nprocs 2 healthy processes remain: 1 (slot 3); slot 2 failed 2 times (a "
                             "slot that fails 2 times is left out). Lower --min-nprocs to go on with fewer processes")
        assert r.attempts == 9 and r.used_up().startswith("restarts used up: the group failed 9 times, and "
                                                          "--max-restarts 5 allows no more.")
    finally:
        made = env[snapshot.DIR_ENV]
        r.close()
    assert not os.path.exists(made)
    assert _restarts.default_max_restarts(4, 4) == 0
    assert _restarts.Restarts(4, 4, 0, env := {}).made is None and env == {}


def test_several_slots_failing_together_are_each_counted_and_never_a_survivor():
    """Issue 57: slots 1, 2 and 3 fail together in every attempt under --min-nprocs 2: each is counted (slot 0,
    which never failed, is not), and at their second failure 1 healthy slot is left: the job stops, saying so."""
    r = _restarts.Restarts(4, 2, 5, {})
    sigkill = "killed by signal SIGKILL"
    together = [(1, sigkill, -9), (2, sigkill, -9), (3, sigkill, -9)]
    assert r.after_failure(together) == "restarting the group of 4"
    assert r.lost == ("process 1 (slot 1: killed by signal SIGKILL) and process 2 (slot 2: killed by signal SIGKILL) "
                      "and process 3 (slot 3: killed by signal SIGKILL)")
    assert r.after_failure(together) is None and r.slots == [0, 1, 2, 3]
    assert r.stopped.startswith("fewer than --min-nprocs 2 healthy processes remain: 1 (slot 0); slots 1, 2, 3 "
                                "failed 2 times each"), r.stopped
    kept = _restarts.Restarts(4, 2, 5, {})
    assert kept.after_failure(together[:2]) == "restarting the group of 4"
    assert kept.after_failure(together[:2]) == (
        "slots 1, 2 failed 2 times each: restarting on the 2 process(es) left (--min-nprocs 2)")
    assert kept.slots == [0, 3]


def test_a_ray_train_worker_reads_its_job_from_rays_context(monkeypatch, tmp_path):
    """mirrorax.cluster.ray_train with Ray's train context and collective stubbed: the rank and size are Ray's, the
    coordinator rank 0's (broadcast once), the job kept in MIRRORAX_* for the calls after, and the run's
    snapshot directory set."""
    import types

    from mirrorax.cluster import ray_train

    sent = []
    context = types.SimpleNamespace(get_world_size=lambda: 4, get_world_rank=lambda: 0,
                                    get_experiment_name=lambda: "my run/1")
    train = types.ModuleType("ray.train")
    train.get_context = lambda: context
    collective = types.ModuleType("ray.train.collective")
    collective.broadcast_from_rank_zero = lambda value: sent.append(value) or value
    ray = types.ModuleType("ray")
    ray.util = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")
    ray.train = train
    for name, module in (("ray", ray), ("ray.train", train), ("ray.train.collective", collective)):
        monkeypatch.setitem(sys.modules, name, module)
    for var in ("MIRRORAX_COORDINATOR", "MIRRORAX_NUM_PROCESSES", "MIRRORAX_PROCESS_ID", snapshot.DIR_ENV):
        monkeypatch.setenv(var, "")  # (recorded, so that what job_from_ray writes is undone after the test)
        monkeypatch.delenv(var)
    monkeypatch.setattr(ray_train, "SNAPSHOT_ROOT", str(tmp_path))
    info = ray_train.job_from_ray()
    assert (info.num_processes, info.process_id, info.source) == (4, 0, "ray") and len(sent) == 1
    assert sent[0].startswith("127.0.0.1:") and os.environ["MIRRORAX_COORDINATOR"] == sent[0]
    assert os.environ[snapshot.DIR_ENV] == os.path.join(str(tmp_path), "my_run_1")
    assert ray_train.job_from_ray() is None and len(sent) == 1  # agreed once: the variables say it from here
    assert mx.cluster.job_from_env().process_id == 0
    context.get_world_rank = lambda: 2  # a worker that is not rank 0 sends nothing and takes rank 0's address
    monkeypatch.delenv("MIRRORAX_COORDINATOR")
    collective.broadcast_from_rank_zero = lambda value: sent.append(value) or "10.0.0.7:1234"
    assert ray_train.job_from_ray().coordinator_address == "10.0.0.7:1234" and sent[-1] is None
    monkeypatch.setattr(train, "get_context", lambda: (_ for _ in ()).throw(RuntimeError("not in a worker")))
    assert ray_train.job_from_ray() is None and not ray_train.in_ray_worker()


def test_below_the_minimum_a_run_that_trained_says_what_it_waits_for_and_ends_at_its_deadline():
    """Issue 57: mirrorax.cluster.ray_wait on the controller's states (as its callback sees them). Before the first
    group the wait is said, not bounded; after a loss below min_workers it is said once, with the minimum and the
    room there is, and ends at the deadline (not before), with a message that says nothing is lost and how to
    resume; room again (or a running group) resets it."""
    from mirrorax.cluster import ray_wait

    alive = [{"Alive": True, "Resources": {"CPU": 1.0, "mx_worker": 1.0}} for _ in range(4)]
    nodes = list(alive)
    wait = ray_wait.WaitForWorkers(3, 4, {"CPU": 1.0, "mx_worker": 1.0}, deadline_s=60)
    assert wait.observe("InitializingState", lambda: nodes[:2], 0.0).endswith(
        "the cluster's live nodes have room for 2. The run starts when there is room (its first group has not "
        "started).")
    assert wait.observe("InitializingState", lambda: nodes[:2], 1000.0) is None  # not bounded before it trained
    assert wait.observe("RunningState", lambda: nodes, 1001.0) is None
    nodes[1] = nodes[2] = {"Alive": False, "Resources": alive[1]["Resources"]}  # two nodes removed
    said = wait.observe("RestartingState", lambda: nodes, 1010.0)
    assert said == ("mirrorax: Ray Train waits for room for 3 workers (the minimum of ScalingConfig(num_workers=(3, "
                    "4)), each {CPU: 1, mx_worker: 1}); the cluster's live nodes have room for 2. The run ends in 60 s "
                    "unless room appears (JaxTrainer(wait_for_workers_s=...)); its snapshots and checkpoints are "
                    "kept."), said
    for t in (1011.0, 1040.0, 1069.0):  # said once; not ended before the deadline
        assert wait.observe("RestartingState", lambda: nodes, t) is None
    with pytest.raises(ray_wait.BelowMinimumWorkers, match=r"waited 60 s \(wait_for_workers_s=60\) for room for 3 "
                       r"workers, the minimum of ScalingConfig\(num_workers=\(3, 4\)\); the cluster's live nodes had "
                       r"room for 2\. The run ends here, and nothing is lost: .* run the same script again"):
        wait.observe("ReschedulingState", lambda: nodes, 1070.5)
    back = ray_wait.WaitForWorkers(3, 4, {"CPU": 1.0}, deadline_s=60)
    back.observe("RunningState", lambda: nodes, 0.0)
    assert back.observe("RestartingState", lambda: nodes, 1.0) is not None
    assert back.observe("RestartingState", lambda: alive, 50.0) is None and back.since is None  # a node came back
    assert back.observe("RestartingState", lambda: nodes, 100.0) is not None  # a new wait, said again
    back.observe("RestartingState", lambda: nodes, 159.0)  # 59 s of the new one: not yet
    with pytest.raises(ValueError, match="wait_for_workers_s must be a positive number of seconds; received 0"):
        ray_wait.WaitForWorkers(3, 4, {"CPU": 1.0}, deadline_s=0)


def test_ray_counts_the_workers_the_live_nodes_hold(monkeypatch, tmp_path, capsys):
    """Issue 57: Ray's elastic policy counted the workers from a view that still counted a node just lost: it
    started a group of the old size and waited its start timeout (10 s in the tests, 60 by default), and ended a
    running group of the right size to "grow" onto the lost node. The trainer's policy counts the live nodes'."""
    pytest.importorskip("ray.train", reason='Ray Train is not installed (pip install "mirrorax[ray]")')
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    from mirrorax.cluster import ray_train

    scaling = ScalingConfig(num_workers=(2, 4), resources_per_worker={"w": 1})
    trainer = ray_train.JaxTrainer(lambda config: None, run_config=RunConfig(name="t", storage_path=str(tmp_path)),
                                   scaling_config=scaling)
    given = {}
    monkeypatch.setattr(type(trainer).__mro__[1], "_initialize_and_run_controller",
                        lambda self, **kwargs: given.update(kwargs))
    trainer._initialize_and_run_controller(scaling_policy=ElasticScalingPolicy(scaling), other=1)
    policy = given["scaling_policy"]
    assert isinstance(policy, ElasticScalingPolicy) and type(policy) is not ElasticScalingPolicy and given["other"] == 1
    reserved = {f"node{i}": {"w": 1.0} for i in range(4)}  # Ray's view: 4 nodes
    live = [{"Alive": True, "Resources": {"w": 1.0}}] * 3 + [{"Alive": False, "Resources": {"w": 1.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: live)
    assert policy._count_possible_workers(reserved) == 3
    assert "counts 4 workers; its live nodes hold 3" in capsys.readouterr().out
    monkeypatch.setattr(ray, "nodes", lambda: live[:3] + [{"Alive": True, "Resources": {"w": 1.0}}])  # it came back
    assert policy._count_possible_workers(reserved) == 4


def test_a_ray_run_without_datasets_starts_no_dataset_actor(tmp_path):
    """Issue 57: Ray Train's dataset callback started an actor process at every group start, datasets or not (it
    imports Ray Data: seconds of CPU), and each worker's context waited for it: 7.7 s of a restart's 14 s of group
    start on the loaded 2-core host. Without datasets the trainer leaves it out; with them it is Ray's."""
    pytest.importorskip("ray.train", reason='Ray Train is not installed (pip install "mirrorax[ray]")')
    from ray.train import RunConfig, ScalingConfig

    from mirrorax.cluster import ray_train

    def callbacks(**kwargs) -> list[str]:
        trainer = ray_train.JaxTrainer(lambda config: None, scaling_config=ScalingConfig(num_workers=2),
                                       run_config=RunConfig(name="t", storage_path=str(tmp_path)), **kwargs)
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    without = callbacks()
    assert "DatasetsCallback" not in without and {"BackendSetupCallback", "WaitCallback"} <= set(without), without
    assert "DatasetsCallback" in callbacks(datasets={"train": lambda: None})


def test_each_node_is_cleaned_by_its_first_worker_whatever_its_address(monkeypatch):
    """Issue 57: the lowest world rank on each node (by Ray's node id) removes its snapshots; nodes that share an
    address (here all on one host, as Ray's local ranks would number them) are each cleaned once."""
    import types

    from mirrorax.cluster import ray_train

    store: dict[str, str] = {}
    client = types.SimpleNamespace(key_value_set=store.__setitem__,
                                   blocking_key_value_get=lambda key, timeout_ms: store[key])
    monkeypatch.setattr(ray_train, "coordination_client", lambda: client)
    monkeypatch.setattr(ray_train, "_context", lambda: types.SimpleNamespace(get_world_size=lambda: 5))
    nodes = ["ray-a", "ray-b", "ray-a", "ray-c", "ray-b"]
    assert [ray_train._cleaner(rank, node) for rank, node in enumerate(nodes)] == [True, True, False, True, False]
    monkeypatch.setattr(ray_train, "coordination_client", lambda: None)  # no job joined: each cleans its own
    assert ray_train._cleaner(3, "ray-c")


def test_ray_train_without_ray_says_how_to_install_it(monkeypatch):
    from mirrorax.cluster import ray_train

    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # as where it is not installed: `import ray` fails
    ray_train._trainer_class.cache_clear()
    try:
        assert not ray_train.in_ray_worker() and ray_train.job_from_ray() is None  # the rest works without Ray
        with pytest.raises(ModuleNotFoundError, match=r'not installed here \(importing ray.train.v2.jax failed: .*\)\. '
                                                      r'Install it with: pip install "mirrorax\[ray\]"'):
            ray_train.JaxTrainer  # noqa: B018
    finally:
        ray_train._trainer_class.cache_clear()


def test_a_process_that_imported_ray_names_its_node_without_starting_ray(monkeypatch):
    """A snapshot names its node; a process that imported ray without starting it (a notebook using Ray Data, a
    test that imported ray.train) is not a Ray worker: its node is the host, and Ray is not asked. Ray's
    get_runtime_context() would start a local Ray instance (CI caught one, forking the test's process)."""
    import socket
    import types

    asked = []
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: False
    ray.get_runtime_context = lambda: asked.append(1) or types.SimpleNamespace(get_node_id=lambda: "f" * 56)
    monkeypatch.setitem(sys.modules, "ray", ray)
    assert _restarts.node_name() == (socket.gethostname() or "localhost") and asked == []
    ray.is_initialized = lambda: True  # in a Ray worker: the Ray node's id, so simulated nodes of one host differ
    assert _restarts.node_name() == "ray-" + "f" * 16 and asked == [1]


def test_launch_refuses_a_minimum_above_the_processes():
    from mirrorax.cluster import launch

    with pytest.raises(ValueError, match="min_nprocs must be at most nprocs \\(2\\); received min_nprocs=3"):
        launch.launch(["true"], 2, min_nprocs=3)


# -- in processes -------------------------------------------------------------------------------------------------
PHASES = ("fit", "trainer", "loop")


def _job_env(out, **extra: str) -> dict[str, str]:
    return clean_env(EJ_OUT=str(out), **extra)


def _results(out) -> dict[str, dict[str, np.ndarray]]:
    return {p: dict(np.load(os.path.join(out, f"{p}.npz"))) for p in PHASES}


def assert_same_numbers(got: dict, want: dict) -> None:
    """Each phase's weights within FLOOR of the reference's magnitude; its history and evaluation within FLOOR."""
    for phase in PHASES:
        g, w = got[phase], want[phase]
        assert set(g) == set(w), (phase, sorted(g), sorted(w))
        for key in w:
            if key.startswith(("history/", "evaluate/")):
                np.testing.assert_allclose(g[key], w[key], rtol=FLOOR, err_msg=f"{phase} {key}")
            else:
                np.testing.assert_array_equal(g["epochs"], w["epochs"]) if key == "epochs" else None
                err = np.max(np.abs(g[key] - w[key])) if w[key].size else 0.0
                assert err <= FLOOR * max(1.0, float(np.max(np.abs(w[key])))), (phase, key, err)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The three trainings on 4 processes x 2 devices, nothing lost: what every elastic run must equal."""
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.run(launcher("--nprocs", "4", "--cpu-devices-per-proc", "2", "--",
                                   *python(str(SCRIPTS / "elastic_job.py"))),
                          env=_job_env(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return _results(out)


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.timeout(700)
def test_launch_min_nprocs_finishes_on_the_processes_left_with_the_same_numbers(tmp_path, uninterrupted):
    """One process (slot 1) SIGKILLed at step 10 of model.fit, then again at step 12 of the restarted group:
    it keeps failing, the group goes on with 3; each training equals the uninterrupted 4-process run."""
    events = "kill:fit:10:slot1:4,kill:fit:12:slot1:4"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(launcher("--nprocs", "4", "--min-nprocs", "2", "--cpu-devices-per-proc", "2", "--",
                                   *python(str(SCRIPTS / "elastic_job.py"))),
                          env=_job_env(tmp_path, EJ_EVENTS=events, MIRRORAX_SNAPSHOT_STEPS="3", TMPDIR=str(tmp)),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    said = [x for x in out.splitlines() if x.startswith("mirrorax launch:")]
    assert said[0].startswith("mirrorax launch: rank 1 failed (killed by signal SIGKILL)"), said
    assert said[1] == "mirrorax launch: restarting the group of 4 (restart 1 of 5)", said
    assert said[3] == ("mirrorax launch: slot 1 failed 2 times: restarting on the 3 process(es) left (--min-nprocs 2) "
                       "(restart 2 of 5)"), said
    restarts = [x.removeprefix("[rank 0] ") for x in out.splitlines() if "elastic restart" in x]
    assert restarts[0].startswith("mirrorax: elastic restart: fit 1 continues on 4 processes (8 devices) from "
                                  "snapshot step 9 (epoch 2, batch 2); the job had 4 processes (8 devices); lost: "
                                  "process 1 (slot 1: killed by signal SIGKILL); "), restarts
    assert restarts[1].startswith("mirrorax: elastic restart: fit 1 continues on 3 processes (6 devices) from "
                                  "snapshot step 9 (epoch 2, batch 2); the job had 4 processes (8 devices); lost: "
                                  "process 1 (slot 1: killed by signal SIGKILL), its failure 2: left out; "), restarts
    assert restarts[1].endswith("3 steps lost (it had reached step 12)."), restarts  # at most 3: a snapshot every 3
    assert all(f"DONE {p} on 3 processes" in out for p in PHASES), out[-3000:]
    assert os.listdir(tmp) == [], os.listdir(tmp)  # the launch's snapshot directory is gone
    assert_same_numbers(_results(tmp_path), uninterrupted)


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.timeout(300)
def test_launch_with_three_of_four_slots_dying_in_every_attempt_stops_and_says_why():
    """Issue 57 on real JAX processes (tests/jobs/psum.py, gloo on loopback): slots 1, 2 and 3 SIGKILL themselves
    at their 5th all-reduce in every attempt under --min-nprocs 2; slot 0, blocked in the collective, is never
    named nor left out, and the last line says that the job stopped because 1 healthy process is left."""
    proc = subprocess.run(launcher("--nprocs", "4", "--min-nprocs", "2", "--cpu-devices-per-proc", "2", "--",
                                   *python(str(SCRIPTS / "psum.py"))),
                          env=clean_env(MP_FAIL="kill:", MP_FAIL_SLOTS="1,2,3"), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=280)
    said = [x for x in proc.stdout.splitlines() if x.startswith("mirrorax launch:")]
    assert proc.returncode == 137, proc.stdout[-4000:]
    assert not [x for x in said if "rank 0 " in x or "slot 0 " in x], said
    assert said[-1].startswith("mirrorax launch: stopped: fewer than --min-nprocs 2 healthy processes remain: 1 (slot "
                               "0); slots 1, 2, 3 failed 2 times each"), said
    assert proc.stdout.splitlines()[-1] == said[-1]


def restart_lines(out: str) -> list[str]:
    """The restart lines of a job's output, without a prefix (``[rank 0] ``, Ray's ``(RayTrainWorker ...)``), each
    once."""
    return list(dict.fromkeys(re.sub(r"^.*?mirrorax: elastic", "mirrorax: elastic", x) for x in out.splitlines()
                              if "elastic restart" in x))


def listeners_on_loopback(line: str) -> list[tuple[str, str]]:
    """The listeners of a ``LISTENERS [...]`` line that are not on a loopback address."""
    return [(a, who) for a, who in json.loads(line.split("LISTENERS", 1)[1])
            if a not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.timeout(1200)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,  # (before the reference run: found without importing)
                    reason='Ray Train is not installed (pip install "mirrorax[ray]")')
def test_ray_train_loses_a_worker_and_grows_back_with_the_same_numbers(tmp_path, uninterrupted):
    """Issue 48 on Ray Train, a local cluster of simulated nodes (tests/jobs/ray_elastic.py): in each of the three
    trainings a worker is SIGKILLed at step 10 and its node removed (rank 2, then rank 0: the coordinator's, then
    rank 3): the group goes on with 3; at step 13 a node comes back and Ray's next resize grows the group to 4.
    Each training equals the uninterrupted 4-process run; the steps lost are at most the 3 since a snapshot."""
    pytest.importorskip("ray.train", reason='Ray Train is not installed (pip install "mirrorax[ray]")')
    events = ("hold:fit:10:rank2:4,wait:fit:13:all:3,hold:trainer:10:rank0:4,wait:trainer:13:all:3,"
              "hold:loop:10:rank3:4,wait:loop:13:all:3")
    env = _job_env(tmp_path, EJ_EVENTS=events, MIRRORAX_SNAPSHOT_STEPS="3",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ray_elastic.py"), str(tmp_path)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1100)
    out = proc.stdout
    print("\n".join(x for x in out.splitlines() if x.startswith(("EVENT", "RESULT", "TOKEN"))))
    assert proc.returncode == 0 and "RESULT ok" in out, out[-6000:]
    listening = next(x for x in out.splitlines() if x.startswith("LISTENERS"))
    assert len(json.loads(listening.split(" ", 1)[1])) > 10 and not listeners_on_loopback(listening), listening
    assert "TOKEN REFUSED" in out, out[-3000:]  # Ray's token authentication is on: a wrong token is refused
    said = restart_lines(out)
    raw = [re.sub(r"^.*?mirrorax: elastic", "mirrorax: elastic", x) for x in out.splitlines() if " continues on " in x]
    assert len(raw) == len(set(raw)), raw  # each restart line once in the driver's console (issue 57: it was twice)
    for what, lost in (("fit 1", 2), ("fit 2", 0)):
        shrunk = next(x for x in said if x.startswith(f"mirrorax: elastic restart: {what} continues on 3 processes"))
        assert f"the job had 4 processes (8 devices); lost: process {lost} (its node ray-" in shrunk, shrunk
        grown = next(x for x in said if x.startswith(f"mirrorax: elastic restart: {what} continues on 4 processes"))
        assert "from snapshot step 12 (epoch 2, batch 5); the job had 3 processes (6 devices); " in grown, grown
    loop = [x for x in said if x.startswith("mirrorax: elastic restart: 'loop'")]
    assert len(loop) == 2 and "lost: process 3 (its node ray-" in loop[0], loop
    for line in said:  # at most the 3 steps since the last snapshot
        lost = re.search(r"; (\d+) steps? lost \(it had reached step (\d+)\)", line)
        assert "had ended before it" in line or (lost and int(lost.group(1)) <= 3), line
    assert_same_numbers(_results(tmp_path), uninterrupted)


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason='Ray Train is not installed (pip install "mirrorax[ray]")')
def test_ray_train_cleans_every_node_and_ends_below_its_minimum_within_its_deadline(tmp_path):
    """Issue 57 on a local Ray cluster of 4 simulated nodes sharing one address (tests/jobs/ray_elastic.py
    ``minimum``): a run that succeeds leaves no snapshot on any node; then a run of num_workers=(3, 4) loses 2
    workers with their nodes at step 10 of the custom loop: it says what Ray waits for, ends within its 20 s
    deadline with a message that names the minimum and how to resume, and the nodes left keep their snapshot of
    step 9 (every 3 steps): nothing lost."""
    pytest.importorskip("ray.train", reason='Ray Train is not installed (pip install "mirrorax[ray]")')
    env = _job_env(tmp_path, EJ_PHASES="loop", MIRRORAX_SNAPSHOT_STEPS="3", RE_WAIT_S="20",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ray_elastic.py"), str(tmp_path), "minimum"], env=env,
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=560)
    out = proc.stdout
    lines = {x.split(" ", 1)[0]: x.split(" ", 1)[1] for x in out.splitlines()
             if x.startswith(("RESULT ", "SNAPSHOTS ", "RESULT2 ", "ENDED ", "KEPT "))}
    print("\n".join(x for x in out.splitlines() if x.startswith(("EVENT", "RESULT", "ENDED", "SNAPSHOTS"))))
    assert proc.returncode == 0 and lines.get("RESULT") == "ok", out[-6000:]
    assert lines["SNAPSHOTS"] == "LEFT []", lines["SNAPSHOTS"]  # every node cleaned, whatever its address
    assert lines["RESULT2"].startswith(
        "BelowMinimumWorkers: Ray Train waited 20 s (wait_for_workers_s=20) for room for 3 workers, the minimum of "
        "ScalingConfig(num_workers=(3, 4)); the cluster's live nodes had room for 2. The run ends here, and nothing is "
        "lost"), lines["RESULT2"]
    assert "run the same script again" in lines["RESULT2"]
    said = [x for x in out.splitlines() if "mirrorax: Ray Train waits for room for 3 workers" in x]
    assert len(said) == 1 and "The run ends in 20 s unless room appears" in said[0], said
    assert float(lines["ENDED"]) < 20 + 25, lines["ENDED"]  # Ray notices the loss (seconds), then the deadline
    kept = json.loads(lines["KEPT"])
    assert len(kept) == 2 and all(f"loop/9/{f}" in files for files in kept.values()
                                  for f in ("state.bin", "index.json", "meta.json")), kept
