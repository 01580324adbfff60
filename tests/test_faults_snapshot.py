"""Faults on the snapshot side (issue 56): a snapshot is used only when verified, belongs to one job, and a
restart counts the steps it lost exactly.

Each test stages one fault (a bit flipped in a snapshot's records, an index crafted with a valid digest, a
snapshot of another job in the same folder, a write in flight when the process dies) and checks what the
user is told and what is resumed. In-process but for the killed note of the steps reached; a fit resumed
past a damaged snapshot with the uninterrupted run's numbers: ``tests/test_elastic.py``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import jax
import numpy as np
import pytest
from helpers import flip_bit_after, rewrite_snapshot_index, strategy

import mirrorax as mx
from mirrorax.checkpoint import record, snapshot_io
from mirrorax.checkpoint.policy import AnyOf, EpochEnd, EveryNSeconds, EveryNSteps, OnPreemption, SavePoint

pytestmark = pytest.mark.multi_device


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _two_snapshots(tmp_path, **kwargs) -> tuple[mx.Snapshots, dict]:
    """Snapshots 3 and 6 of a (5, 3) float32 ``w`` and an int32 counter, each with a fit's position."""
    s = strategy(2)
    state = {"w": s.replicate(np.arange(15, dtype=np.float32).reshape(5, 3)), "n": s.replicate(np.int32(0))}
    with mx.Snapshots(tmp_path, **kwargs) as snaps:
        for step in (3, 6):
            state = {"w": state["w"] + 1, "n": state["n"] + 1}
            snaps.save(step, state, {"step": step, "epoch": 1, "batch_in_epoch": 8, "run": {"batch_size": 4}})
    return snaps, state


#: One bit of each field of a snapshot's records: its position (``"batch_in_epoch":8`` -> 9, ``"epoch":1`` -> 0),
#: the step it names, the index's shape, offset, size and checksum of an array, and the digest itself.
EDITS = {
    "position: batch_in_epoch": ("meta.json", b'"batch_in_epoch":'),
    "position: epoch": ("meta.json", b'"epoch":'),
    "position: step": ("meta.json", b'"step":'),
    "index: shape": ("index.json", b'"shape":['),
    "index: offset": ("index.json", b'"offset":'),
    "index: nbytes": ("index.json", b'"nbytes":'),
    "index: crc32": ("index.json", b'"crc32":'),
    "index: dtype": ("index.json", b'"dtype":"'),
    "digest": ("digest.json", b'"index.json":"'),
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_a_bit_flipped_in_any_field_of_a_record_is_skipped_and_the_snapshot_before_taken(tmp_path, edit):
    snaps, _ = _two_snapshots(tmp_path)
    name, text = EDITS[edit]
    flip_bit_after(os.path.join(snaps.directory, "6", name), text)
    with pytest.warns(mx.SnapshotWarning) as said:
        step, restored, meta = mx.Snapshots(tmp_path).restore_latest(_abstract({"w": restored_like(), "n": count()}))
    assert step == 3 and meta["batch_in_epoch"] == 8 and int(restored["n"]) == 1  # the one before, whole
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(15, dtype=np.float32).reshape(5, 3) + 1)
    assert len(said) == 1, [str(w.message) for w in said]
    message = str(said[0].message)
    assert f"{snaps.directory}/6: its {name} does not match its digest" in message or (
        name == "digest.json" and "does not match its digest" in message), message
    assert message.endswith(f"skipped, moved to {snaps.directory}/6.damaged; the snapshot before it is tried.")
    assert sorted(os.listdir(snaps.directory)) == ["3", "6.damaged"]


def restored_like():
    return strategy(2).replicate(np.zeros((5, 3), np.float32))


def count():
    return strategy(2).replicate(np.int32(0))


CRAFTED = {
    "dtype object": (lambda i: i["leaves"][0].update(dtype="object"),
                     "variable 'n' has dtype 'object': only number and bool arrays are read"),
    "dtype of strings": (lambda i: i["leaves"][1].update(dtype="<U3"),
                         "variable 'w' has dtype '<U3': only number and bool arrays are read"),
    "shape of another size": (lambda i: i["leaves"][1].update(shape=[74, 512]),
                              "variable 'w' is 60 bytes, not the [74, 512] x 4 its shape says"),
    "past the file's end": (lambda i: i["leaves"][1].update(offset=10**6),
                            "variable 'w' ends at byte 1000060 of a"),
    "another step": (lambda i: i.update(step=7), "its index is of step 7, its directory step 6"),
    "another format": (lambda i: i.update(format=1), "its index is of snapshot format 1; this mirrorax reads format 2"),
}


@pytest.mark.parametrize("craft", CRAFTED, ids=list(CRAFTED))
def test_an_index_crafted_with_a_valid_digest_is_refused_never_read(tmp_path, craft):
    """Only number dtypes are read, and only sizes that match their shapes and lie in the file: an index with a
    recomputed digest (a bug, or a crafted file) is damage, never a crash (it was ``TypeError: Cannot change
    data-type for array of references`` / ``ValueError: cannot reshape array``, every rerun)."""
    snaps, _ = _two_snapshots(tmp_path)
    change, why = CRAFTED[craft]
    rewrite_snapshot_index(os.path.join(snaps.directory, "6"), change)
    with pytest.warns(mx.SnapshotWarning, match=re.escape(f"{snaps.directory}/6: {why}")):
        step, _, _ = mx.Snapshots(tmp_path).restore_latest(_abstract({"w": restored_like(), "n": count()}))
    assert step == 3


def test_a_record_the_resume_refuses_is_damage_too(tmp_path):
    """The caller's check (a fit's: the position against the step) runs on a record whose digest holds."""
    snaps, _ = _two_snapshots(tmp_path)

    def verify(meta, step):
        return "its position is wrong" if step == 6 else None

    with pytest.warns(mx.SnapshotWarning, match="/6: its position is wrong: skipped"):
        step, _, _ = mx.Snapshots(tmp_path).restore_latest(_abstract({"w": restored_like(), "n": count()}),
                                                           verify=verify)
    assert step == 3
    assert record.position_wrong({"run": {}, "step": 6, "epoch": 1, "batch_in_epoch": 8}, 6) is None
    assert "epoch -1" in record.position_wrong({"run": {}, "step": 6, "epoch": -1, "batch_in_epoch": 8}, 6)
    assert "step 5 at step 6" in record.position_wrong({"run": {}, "step": 5, "epoch": 1, "batch_in_epoch": 8}, 6)


def test_snapshots_of_two_jobs_never_mix_and_the_setting_that_differs_is_named(tmp_path):
    first, second = {"learning_rate": 0.001, "batch_size": 48}, {"learning_rate": 0.002, "batch_size": 48}
    a, state = _two_snapshots(tmp_path, job=first)
    assert os.path.basename(a.directory).startswith("loop-") and a.directory != mx.Snapshots(
        tmp_path, job=second).directory
    like = _abstract({"w": restored_like(), "n": count()})
    with pytest.warns(mx.SnapshotWarning, match=r"Snapshots of another job in .*/loop-[0-9a-f]{12} are not this "
                                                r"job's and are ignored \(learning_rate: 0.001 in that job, 0.002 in "
                                                r"this one\): loop starts afresh"):
        assert mx.Snapshots(tmp_path, job=second).restore_latest(like) is None
    assert mx.Snapshots(tmp_path, job=first).restore_latest(like)[0] == 6  # the first job's are whole
    # A record of another job copied into this job's folder is damage, not a place to resume from.
    b = mx.Snapshots(tmp_path, job=second)
    os.makedirs(b.directory)
    os.rename(os.path.join(a.directory, "6"), os.path.join(b.directory, "6"))
    with pytest.warns(mx.SnapshotWarning) as said:
        assert mx.Snapshots(tmp_path, job=second).restore_latest(like) is None
    assert re.search("/6: it names another job .*learning_rate: 0.001 in that job", str(said[0].message)), said[0]


def test_the_steps_reached_are_exact_while_a_snapshot_is_being_written(tmp_path, monkeypatch):
    """The restart's "steps lost" counts from the newest step reached, noted at every step: a write that holds the
    writer thread (a slow disk) does not hold the note back (it said 17 when 20 were reached)."""
    gate, real = threading.Event(), snapshot_io.write

    def slow(*args, **kwargs):
        gate.wait(60)
        real(*args, **kwargs)

    monkeypatch.setattr(snapshot_io, "write", slow)
    state = {"w": strategy(2).replicate(np.zeros(3, np.float32))}
    snaps = mx.Snapshots(tmp_path, every_steps=10)
    try:
        for step in range(1, 21):  # the snapshot of step 10 is being written from step 10 on
            snaps.maybe_save(step, state)
        assert mx.Snapshots(tmp_path).held()["reached"] == 20  # what a restart reads now
    finally:
        gate.set()
        snaps.wait()
    assert mx.Snapshots(tmp_path).held() == {"step": 20, "reached": 20, "holders": [0]}


def test_the_note_of_the_step_reached_outlives_a_killed_process(tmp_path):
    from jobs.procs import clean_env, python

    path = str(tmp_path / "fit1.reached")
    code = (f"import os, signal\nfrom mirrorax.checkpoint.snapshot_io import Reached\nr = Reached({path!r})\n"
            "for step in range(1, 1001):\n    r.note(step)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run(python("-c", code), env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert snapshot_io.Reached.read(path) == 1000 and snapshot_io.Reached.read(str(tmp_path / "none")) == -1


def test_a_failed_write_leaves_no_temporary_directory(tmp_path, monkeypatch):
    snaps = mx.Snapshots(tmp_path)
    state = {"w": strategy(1).replicate(np.zeros(4, np.float32))}
    snaps.save(1, state)
    snaps.wait()
    def full(*args, **kwargs):  # the write fails in the middle: its files written, not yet renamed
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_io, "sync_directory", full)
    snaps.save(2, state)
    with pytest.warns(mx.SnapshotWarning, match="could not be written .*No space left on device"):
        snaps.wait()
    assert sorted(os.listdir(snaps.directory)) == ["1"]  # no 2.tmp-<pid> left


def test_save_policies_compose_as_orbax_composes_them(monkeypatch):
    every = EveryNSteps(4)
    assert [s for s in (2, 4, 7, 9, 12) if every.should_save(SavePoint(s))] == [4, 9, 12]  # a multiple passed
    durable = AnyOf(EpochEnd(), OnPreemption(), EveryNSteps(5))
    points = [SavePoint(3), SavePoint(5), SavePoint(7, epoch_end=True), SavePoint(8, preempted=True), SavePoint(9)]
    assert [p.step for p in points if durable.should_save(p)] == [5, 7, 8]
    clock = [0.0]
    from mirrorax.checkpoint import policy

    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    agreed = []
    timed = EveryNSeconds(2.0, agree=lambda step: agreed.append(step) or step)
    assert not timed.should_save(SavePoint(1)) and timed.should_save(SavePoint(11))
    clock[0] = 5.0  # 10 steps in 5 s: 2 steps a second, 4 steps to 2 s
    timed.saved(SavePoint(11))
    assert timed.next_step == 15 and agreed == [15]
    with pytest.raises(ValueError, match="EveryNSteps takes a number of steps >= 1; received 0"):
        EveryNSteps(0)


@pytest.mark.slow
def test_a_killed_launchers_snapshot_folder_is_removed_by_the_next_launch(tmp_path):
    """``mirrorax launch`` removes the snapshot folder it made when it ends; one killed with SIGKILL (its children
    die with it) left ``<tmp>/mirrorax-snapshots-*`` behind, one per such launch. The next launch removes it."""
    import sys

    from jobs.procs import clean_env

    env = clean_env(TMPDIR=str(tmp_path))
    child = ("import os, sys, time\nfrom mirrorax.checkpoint.snapshot import Snapshots\nSnapshots()\n"
             "print('READY', os.environ['MIRRORAX_SNAPSHOT_DIR'], os.environ['MIRRORAX_LAUNCHER_PID'], flush=True)\n"
             "time.sleep(float(sys.argv[1]))\n")
    cmd = [sys.executable, "-m", "mirrorax.cluster.launch", "--nprocs", "1", "--max-restarts", "1", "--",
           sys.executable, "-c", child]
    first = subprocess.Popen([*cmd, "300"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    timer = threading.Timer(240, first.kill)
    timer.start()
    try:
        ready = next((line for line in first.stdout if "READY" in line), "")  # type: ignore[union-attr]
        made, launcher = ready.split("READY", 1)[1].split()[:2]
        os.kill(int(launcher), signal.SIGKILL)  # the launcher itself: its cleanup never runs
        first.wait(60)
    finally:
        timer.cancel()
        first.kill()
    assert os.path.dirname(made) == str(tmp_path) and os.path.exists(os.path.join(made, "launcher.json")), made
    second = subprocess.run([*cmd, "0"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "READY" in second.stdout, second.stdout[-2000:] + second.stderr[-2000:]
    assert not os.path.exists(made)  # removed by the next launch's process
    assert not [n for n in os.listdir(tmp_path) if n.startswith("mirrorax-snapshots-")]  # (its own: at its end)


def test_a_fits_snapshot_tier_saves_by_the_clock_once_per_decision(tmp_path, monkeypatch):
    """The fit's local tier asks the snapshots' own policy: 2 steps a second and a snapshot every 30 s is one every
    60 steps after the first (10 steps in), each decision planned once."""
    from mirrorax.checkpoint import policy
    from mirrorax.checkpoint.resume import Record
    from mirrorax.fit.saving import Saving
    from mirrorax.results import History

    clock = [0.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
    snaps = mx.Snapshots(tmp_path, every_seconds=30)
    taken = []
    real = snaps.save

    def save(step, state, meta, window=None):
        taken.append((step, meta["epoch"]))
        real(step, state, meta, window=window)

    monkeypatch.setattr(snaps, "save", save)
    saving = Saving(Record({"batch_size": 8}, History(), {}), snapshots=snaps)
    state = {"w": strategy(1).replicate(np.zeros(2, np.float32))}
    for step in range(1, 201):
        clock[0] += 0.5
        saving.save_due(SavePoint(step), state, 0, step, lambda: None)
    assert [s for s, _ in taken] == [11, 71, 131, 191]
    saving.save_due(SavePoint(200, fit_end=True), state, 5, 0, lambda: None)  # the fit's end: always
    assert taken[-1] == (200, 5) and [t.kind for t in saving.tiers] == ["snapshot"]
    snaps.wait()
    assert sorted(os.listdir(snaps.directory)) == ["191", "200"]
