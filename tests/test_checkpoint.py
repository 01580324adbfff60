"""Checkpoints: round trip, elastic restore, keep=K, async saves, damage, mismatch, NaN refusal."""

from __future__ import annotations

import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mirrorax.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    all_finite,
)
from mirrorax.train_state import TrainState


def replicated(n: int) -> NamedSharding:
    mesh = jax.make_mesh(
        (n,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )
    return NamedSharding(mesh, P())


def make_state(n_devices: int = 8, seed: int = 0, width: int = 64) -> dict:
    """A small training state shaped like the trainer's: groups of path-keyed variables + step."""
    rng = np.random.default_rng(seed)
    sharding = replicated(n_devices)

    def put(x):
        return jax.device_put(jnp.asarray(x), sharding)

    return {
        "trainable": {
            "sequential/dense/kernel": put(rng.normal(size=(64, width)).astype(np.float32)),
            "sequential/dense/bias": put(rng.normal(size=(width,)).astype(np.float32)),
        },
        "non_trainable": {
            "sequential/batch_normalization/moving_mean": put(np.zeros(width, np.float32)),
            "seed_generator/state": put(np.array([seed, 0], np.uint32)),
        },
        "optimizer": {
            "adam/iterations": put(np.array(seed, np.int64).astype(np.int32)),
            "adam/m/sequential/dense/kernel": put(rng.normal(size=(64, width)).astype(np.float32)),
        },
        "metrics": {"loss/total": put(np.float32(1.5)), "loss/count": put(np.float32(3.0))},
        "empty": {},
        "rng": jax.device_put(jax.random.key(seed), sharding),
        "step": put(np.int32(seed)),
    }


def abstract(state: dict, n_devices: int) -> dict:
    sharding = replicated(n_devices)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def assert_same_values(a: dict, b: dict) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def step_files(directory: pathlib.Path, step: int) -> list[pathlib.Path]:
    return sorted(p for p in (directory / str(step)).rglob("*") if p.is_file())


def biggest_data_file(directory: pathlib.Path, step: int) -> pathlib.Path:
    """The file holding the array bytes (the largest data file of the state item's OCDBT store)."""
    files = [p for p in step_files(directory, step) if "state" in p.parts and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


META = {"epoch": 2, "batch_in_epoch": 5, "seed": 7, "examples_seen": 704,
        "history": {"loss": [1.0, np.float32(0.5)]}, "config": {"global_batch_size": 64}}


def test_round_trip(tmp_path):
    state = make_state(8, seed=1)
    with Checkpointer(tmp_path / "ck", keep=2) as ckpt:
        assert ckpt.restore_latest(abstract(state, 8)) is None
        assert ckpt.save(10, state, META) is True
        ckpt.wait()
        assert ckpt.all_steps() == [10] and ckpt.latest_step() == 10
        step, restored, meta = ckpt.restore_latest(abstract(state, 8))
    assert step == 10
    assert_same_values(restored, state)
    assert restored["empty"] == {}
    assert meta == {**META, "history": {"loss": [1.0, 0.5]}}
    assert jax.tree.map(lambda x: x.dtype, restored) == jax.tree.map(lambda x: x.dtype, state)


@pytest.mark.multi_device
@pytest.mark.parametrize("n_new", [1, 4])
def test_restore_on_fewer_devices(tmp_path, n_new):
    state = make_state(8, seed=2)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(3, state, {"epoch": 0})
    with Checkpointer(tmp_path) as ckpt:
        step, restored, _ = ckpt.restore_latest(abstract(state, n_new))
    assert step == 3
    assert_same_values(restored, state)
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding == replicated(n_new)
        assert len(leaf.sharding.device_set) == n_new


def test_keep_newest_k(tmp_path):
    state = make_state(2)
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state, {"step": step})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["3", "4"]


def test_async_saves_back_to_back_then_close(tmp_path):
    state = make_state(8)
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(1, state, {"n": 1})
    second = make_state(8, seed=5)
    ckpt.save(2, second, {"n": 2})  # while step 1 may still be writing
    # The arrays were copied off the devices before save returned: the next step may donate them.
    for leaf in jax.tree.leaves(second):
        leaf.delete()
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(3, state, {})
    with Checkpointer(tmp_path) as again:
        assert again.all_steps() == [1, 2]
        step, restored, meta = again.restore_latest(abstract(state, 8))
    assert (step, meta) == (2, {"n": 2})
    assert_same_values(restored, make_state(8, seed=5))


def test_same_step_is_noop_and_older_step_is_refused(tmp_path):
    state = make_state(2)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(5, state, {})
        assert ckpt.save(5, state, {}) is False
        with pytest.raises(CheckpointError, match="newer checkpoint 5"):
            ckpt.save(4, state, {})


def test_restore_a_given_step(tmp_path):
    _save_steps(tmp_path, steps=(1, 2))
    _garble(biggest_data_file(tmp_path, 2))
    with Checkpointer(tmp_path) as ckpt:
        state, meta = ckpt.restore(1, abstract(make_state(2), 2))
        assert meta == {"step": 1}
        assert_same_values(state, make_state(2, seed=1))
        with pytest.raises(CheckpointError, match=r"No checkpoint for step 7 .* Available steps: \[1, 2\]"):
            ckpt.restore(7, abstract(make_state(2), 2))
        with pytest.raises(CheckpointError, match="step 2 .* is damaged: .*checksum"):
            ckpt.restore(2, abstract(make_state(2), 2))
        assert ckpt.all_steps() == [1, 2]  # restore(step) reports, it does not move anything


def _save_steps(directory, steps=(1, 2)):
    with Checkpointer(directory, async_save=False) as ckpt:
        for s in steps:
            ckpt.save(s, make_state(2, seed=s), {"step": s})


def _garble(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("garble_data", "checksum"),  # silent bit rot: only the checksum notices
        ("truncate_data", "reading it failed"),
        ("delete_data", "reading it failed"),
        ("truncate_meta", "reading it failed"),
        ("delete_tree_metadata", "metadata"),
    ],
)
def test_damaged_newest_falls_back_with_warning(tmp_path, damage, reason):
    _save_steps(tmp_path)
    if damage == "garble_data":
        _garble(biggest_data_file(tmp_path, 2))
    elif damage == "truncate_data":
        f = biggest_data_file(tmp_path, 2)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "delete_data":
        biggest_data_file(tmp_path, 2).unlink()
    elif damage == "truncate_meta":
        f = tmp_path / "2" / "meta" / "metadata"
        f.write_text(f.read_text()[:5])
    elif damage == "delete_tree_metadata":
        (tmp_path / "2" / "state" / "_METADATA").unlink()
    state = make_state(2, seed=1)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.warns(CheckpointWarning, match=rf"step 2 .*damaged: .*{reason}") as record:
            step, restored, meta = ckpt.restore_latest(abstract(state, 2))
        assert len(record) == 1 and record[0].filename == __file__
        assert (step, meta) == (1, {"step": 1})
        assert_same_values(restored, state)
        # The damaged step no longer counts, so the resumed run can write step 2 again.
        assert ckpt.all_steps() == [1]
        assert ckpt.save(2, make_state(2, seed=9), {"step": 2})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert [p.name.split("_")[1] for p in (tmp_path / "damaged").iterdir()] == ["2"]


def test_every_checkpoint_damaged_is_an_error(tmp_path):
    _save_steps(tmp_path, steps=(1,))
    _garble(biggest_data_file(tmp_path, 1))
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match="Every checkpoint .* step 1: .*checksum"):
            ckpt.restore_latest(abstract(make_state(2), 2))
        assert ckpt.all_steps() == [1]  # nothing moved


def test_leftover_temporary_directory_is_ignored(tmp_path):
    _save_steps(tmp_path, steps=(1,))
    # What a crash in the middle of writing step 2 leaves behind.
    tmp = tmp_path / "2.orbax-checkpoint-tmp-1764000000000000"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "partial").write_bytes(b"\0" * 10)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        step, _, _ = ckpt.restore_latest(abstract(make_state(2), 2))
        assert step == 1
        ckpt.save(2, make_state(2), {})
    assert (tmp_path / "2").is_dir() and not tmp.exists()


_CRASHING_WRITER = r'''
import os, sys
import jax
import numpy as np
from mirrorax.checkpoint.checkpointer import Checkpointer

directory = sys.argv[1]
small = {"w": jax.numpy.ones((64, 64)), "step": jax.numpy.int32(1)}
big = {"w": jax.numpy.asarray(np.random.default_rng(0).normal(size=(64, 64)), jax.numpy.float32),
       "step": jax.numpy.int32(2), "pad": jax.numpy.zeros((4096, 1024))}
ckpt = Checkpointer(directory)
ckpt.save(1, small, {"step": 1})
ckpt.wait()
ckpt.save(2, big, {"step": 2})  # returns while the background thread writes ~16 MB
print("crashing", flush=True)
os._exit(3)  # no cleanup, no flush of the pending write: what a kill -9 leaves
'''


@pytest.mark.multi_process
@pytest.mark.slow  # starts processes
def test_crash_during_async_save_leaves_previous_checkpoint_usable(tmp_path):
    import subprocess

    (tmp_path / "writer.py").write_text(_CRASHING_WRITER)
    from jobs.procs import clean_env, python

    proc = subprocess.run(python(str(tmp_path / "writer.py"), str(tmp_path / "ck")), env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "crashing" in proc.stdout, proc.stdout + proc.stderr
    wanted = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=replicated(1)),
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(1))}
    with Checkpointer(tmp_path / "ck") as ckpt:
        # Step 2 is either absent (the usual case) or complete; never half-written.
        if ckpt.all_steps() == [1, 2]:
            wanted["pad"] = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=replicated(1))
        step, state, meta = ckpt.restore_latest(wanted)  # no CheckpointWarning: nothing damaged
        assert step in (1, 2) and meta == {"step": step} and int(state["step"]) == step
        assert ckpt.save(3, dict(state, step=jnp.int32(3)), {"step": 3})
    assert not [p for p in (tmp_path / "ck").iterdir() if "tmp" in p.name]


@pytest.mark.parametrize(
    "change, message",
    [
        ("shape", r"'trainable/sequential/dense/kernel' is shape=\(64, 64\) dtype=float32 in the "
                  r"checkpoint but shape=\(64, 32\) dtype=float32 in the model"),
        ("dtype", r"'step' is shape=\(\) dtype=int32 in the checkpoint but shape=\(\) dtype=float32"),
        ("missing", r"'trainable/sequential/dense_1/kernel' .* is missing from the checkpoint"),
        ("extra", r"checkpoint holds variable 'metrics/loss/count' that the model does not have"),
    ],
)
def test_different_model_is_refused_naming_the_variable(tmp_path, change, message):
    _save_steps(tmp_path, steps=(1,))
    wanted = abstract(make_state(2), 2)
    if change == "shape":
        wanted["trainable"]["sequential/dense/kernel"] = jax.ShapeDtypeStruct(
            (64, 32), jnp.float32, sharding=replicated(2))
    elif change == "dtype":
        wanted["step"] = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(2))
    elif change == "missing":
        wanted["trainable"]["sequential/dense_1/kernel"] = wanted["trainable"]["sequential/dense/kernel"]
    elif change == "extra":
        del wanted["metrics"]["loss/count"]
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointMismatchError, match=message):
            ckpt.restore_latest(wanted)
        assert ckpt.all_steps() == [1]  # a mismatch is not damage: nothing moved


def test_foreign_step_directory_is_refused_not_moved(tmp_path):
    (tmp_path / "5" / "default").mkdir(parents=True)  # e.g. a plain Orbax checkpoint
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match="not written by mirrorax"):
            ckpt.restore_latest(abstract(make_state(2), 2))
    assert (tmp_path / "5" / "default").is_dir()


def test_empty_existing_directory_starts_fresh(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [] and ckpt.latest_step() is None
        assert ckpt.restore_latest(abstract(make_state(2), 2)) is None
    assert not any(p.name.startswith(".mirrorax-write-test") for p in tmp_path.iterdir())


def test_unusable_directory_fails_at_construction(tmp_path):
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    # Root ignores permission bits, so use paths that cannot be directories for anyone.
    with pytest.raises(CheckpointError, match="Cannot create the checkpoint directory .*not_a_dir/ck"):
        Checkpointer(a_file / "ck")
    with pytest.raises(CheckpointError, match="existing file"):
        Checkpointer(a_file)
    if os.path.isdir("/proc/self"):  # a directory nobody can create entries in
        with pytest.raises(CheckpointError, match="not writable|Cannot create"):
            Checkpointer("/proc/self/mirrorax-checkpoints")


def test_invalid_arguments_say_what_was_received(tmp_path):
    with pytest.raises(ValueError, match=r"keep must be an integer >= 1 \(the number of newest checkpoints to keep; "
                                         r"None keeps all\); received 0"):
        Checkpointer(tmp_path, keep=0)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"step must be an integer >= 0; received -1"):
            ckpt.save(-1, make_state(2), {})
        with pytest.raises(TypeError, match=r"Received .*object.* at 'config/callback'"):
            ckpt.save(1, make_state(2), {"config": {"callback": object()}})


def test_non_finite_state_is_not_saved(tmp_path):
    state = make_state(2)
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, state, {})
        bad = dict(state, trainable=dict(state["trainable"]))
        bad["trainable"]["sequential/dense/bias"] = state["trainable"]["sequential/dense/bias"].at[3].set(jnp.nan)
        # One process checks the values in the background: the save is abandoned there, and the next
        # call that waits for it says so.
        ckpt.save(2, bad, {})
        with pytest.warns(CheckpointWarning, match=r"step 2 was not saved: variable "
                                                   r"'trainable/sequential/dense/bias' holds NaN or Inf\. The "
                                                   r"newest checkpoint in .* stays 1\.") as rec:
            ckpt.wait()
        assert rec[0].filename == __file__
        assert ckpt.all_steps() == [1]  # keep=1 did not delete step 1 to make room for step 2
        ckpt.wait()  # said once
        assert ckpt.save(3, state, {}) is True
        ckpt.wait()
        assert ckpt.all_steps() == [3]  # and the abandoned save did not upset `keep`
    with Checkpointer(tmp_path) as again:
        assert again.all_steps() == [3]


@pytest.mark.multi_device
def test_all_finite_on_sharded_arrays():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("batch")))
    assert all_finite({"x": sharded, "n": jnp.arange(3), "f": 1.0, "none": None})
    assert not all_finite({"x": sharded.at[13].set(jnp.inf)})
    assert not all_finite([np.array([0.0, np.nan], np.float32)])
    assert all_finite({}) and all_finite({"h": jnp.ones(2, jnp.bfloat16)})


def test_meta_round_trips_nan_history_and_file_is_json(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, make_state(2), {"history": {"val_loss": [float("nan"), 1.0]}})
        _, _, meta = ckpt.restore_latest(abstract(make_state(2), 2))
    assert np.isnan(meta["history"]["val_loss"][0])
    integrity = json.loads((tmp_path / "1" / "integrity" / "metadata").read_text())
    assert integrity["step"] == 1 and "trainable/sequential/dense/kernel" in integrity["checksums"]


def dict_form_state(n_devices: int = 8) -> dict:
    """A trainer's state as it was before TrainState: a dict of its groups and counters."""
    rng = np.random.default_rng(3)
    sharding = replicated(n_devices)

    def put(x):
        return jax.device_put(jnp.asarray(x), sharding)

    return {
        "params": {"sequential/dense/kernel": put(rng.normal(size=(8, 4)).astype(np.float32)),
                   "sequential/dense/bias": put(rng.normal(size=(4,)).astype(np.float32))},
        "model_state": {"seed_generator/state": put(np.array([3, 0], np.uint32))},
        "optimizer": {"adam/iterations": put(np.int32(7)),
                      "adam/m/sequential/dense/kernel": put(rng.normal(size=(8, 4)).astype(np.float32))},
        "metrics": {"loss/total": put(np.float32(2.5)), "loss/count": put(np.float32(4.0))},
        "step": put(np.int32(7)), "skipped": put(np.int32(0)), "nonfinite_step": put(np.int32(0)),
        "bad_label": put(np.zeros(4, np.int32)),
    }


def test_train_state_is_stored_with_its_counters_packed_and_the_older_dict_form_restores_into_it(tmp_path):
    old = dict_form_state()
    with Checkpointer(tmp_path / "dict", async_save=False) as ckpt:  # what the trainer wrote before packing
        assert ckpt.save(7, old, {"epoch": 1})
    with Checkpointer(tmp_path / "typed", async_save=False) as ckpt:
        assert ckpt.save(7, TrainState.from_dict(old), {"epoch": 1})  # the counters in one int32[7]
    checksums = json.loads((tmp_path / "typed" / "7" / "integrity" / "metadata").read_text())["checksums"]
    assert sorted(checksums) == sorted([
        "params/sequential/dense/kernel", "params/sequential/dense/bias", "model_state/seed_generator/state",
        "optimizer/adam/iterations", "optimizer/adam/m/sequential/dense/kernel", "metrics/loss/total",
        "metrics/loss/count", "counters"])

    # Either checkpoint restores into a TrainState (here on 4 devices), with the same values.
    typed_abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated(4)),
                                  TrainState.from_dict(dict_form_state()))
    for form in ("dict", "typed"):
        with Checkpointer(tmp_path / form, keep=None) as ckpt:
            step, state, meta = ckpt.restore_latest(typed_abstract)
        assert step == 7 and meta["epoch"] == 1 and type(state) is TrainState, form
        assert jax.tree.structure(state) == jax.tree.structure(typed_abstract), form
        assert all(a.sharding.num_devices == 4 for a in jax.tree.leaves(state)), form
        assert int(state.step) == 7 and state.counters.tolist() == [7, 0, 0, 0, 0, 0, 0], form
        assert_same_values(state.metrics, old["metrics"])
        assert_same_values({k: getattr(state, k) for k in ("params", "model_state", "optimizer")},
                           {k: old[k] for k in ("params", "model_state", "optimizer")})


def test_older_dict_form_of_another_metric_layout_is_refused_naming_the_variable(tmp_path):
    old = dict_form_state()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(7, old, {})
        other = dict(old, metrics={**old["metrics"], "accuracy/total": old["metrics"]["loss/total"]})
        with pytest.raises(CheckpointMismatchError, match="'metrics/accuracy/total'.* is missing"):
            ckpt.restore_latest(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                             TrainState.from_dict(other)))


def test_train_state_of_another_model_is_refused_with_the_old_paths(tmp_path):
    old = dict_form_state()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(7, old, {})
        other = dict(old, params=dict(old["params"], **{"sequential/dense/bias": jnp.zeros(5, jnp.float32)}))
        with pytest.raises(CheckpointMismatchError, match="'params/sequential/dense/bias' is shape=\\(4,\\)"):
            ckpt.restore_latest(TrainState.from_dict(abstract(other, 8)))


_WORKER = r'''
import os, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
pid, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60, heartbeat_timeout_seconds=20)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from mirrorax.checkpoint.checkpointer import Checkpointer

mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
rep = NamedSharding(mesh, P())
abstract = {"trainable": {"dense/kernel": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=rep)},
            "step": jax.ShapeDtypeStruct((), np.int32, sharding=rep)}
with Checkpointer(directory, keep=2) as ckpt:
    step, state, meta = ckpt.restore_latest(abstract)
    kernel = state["trainable"]["dense/kernel"]
    assert step == 3 and meta == {"writer_processes": 1}, (step, meta)
    assert kernel.sharding == rep and kernel.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(kernel.addressable_data(0)),
                                  np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    state["trainable"]["dense/kernel"] = kernel + 1
    state["step"] = state["step"] + 4
    assert ckpt.save(7, state, {"writer_processes": jax.process_count()})
print("worker", pid, "ok", flush=True)
'''


@pytest.mark.multi_process
@pytest.mark.slow  # starts processes
def test_checkpoint_moves_between_process_counts(tmp_path):
    """1 process x 8 devices -> 2 processes x 4 devices -> 1 process x 1 and 4 devices."""
    import socket
    import subprocess

    sharding = replicated(8)
    start = {"trainable": {"dense/kernel": jax.device_put(
                 jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64), sharding)},
             "step": jax.device_put(jnp.int32(3), sharding)}
    with Checkpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(3, start, {"writer_processes": 1})

    (tmp_path / "worker.py").write_text(_WORKER)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    from jobs.procs import clean_env, python

    env = clean_env()
    workers = [
        subprocess.Popen(python(str(tmp_path / "worker.py"), str(i), str(port), str(tmp_path / "ck")), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    for i, (w, out) in enumerate(zip(workers, outputs)):
        assert w.returncode == 0 and f"worker {i} ok" in out, out[-3000:]

    for n in (1, 4):
        with Checkpointer(tmp_path / "ck") as ckpt:
            step, state, meta = ckpt.restore_latest(abstract(start, n))
        assert (step, meta) == (7, {"writer_processes": 2})
        assert state["trainable"]["dense/kernel"].sharding == replicated(n)
        np.testing.assert_array_equal(np.asarray(state["trainable"]["dense/kernel"]),
                                      np.asarray(start["trainable"]["dense/kernel"]) + 1)
        assert int(state["step"]) == 7


def _sharded_state(n: int, shard: bool, rows: int = 2048) -> dict:
    """A few MiB of float32 and int32 state on ``n`` devices, split by rows when ``shard``."""
    mesh = jax.make_mesh((n,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    spec = P("batch") if shard else P()
    rng = np.random.default_rng(3)
    return {
        "w": jax.device_put(rng.normal(size=(rows, 512)).astype(np.float32), NamedSharding(mesh, spec)),
        "m": jax.device_put(rng.normal(size=(rows, 512)).astype(np.float32), NamedSharding(mesh, spec)),
        "b": jax.device_put(rng.normal(size=(512,)).astype(np.float32), NamedSharding(mesh, P())),
        "step": jax.device_put(np.int32(0), NamedSharding(mesh, P())),
    }


@pytest.mark.multi_device
@pytest.mark.parametrize("n,shard", [(1, False), pytest.param(8, False, marks=pytest.mark.slow), (8, True)])
def test_async_save_holds_the_step_values_while_later_steps_donate_the_buffers(tmp_path, n, shard):
    """Steps that donate (and overwrite in place) the saved buffers right after ``save`` returns must
    not reach the checkpoint: it restores bit for bit the values of the step it names."""
    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state):
        return {"w": state["w"] * 1.5 + 1.0, "m": state["m"] - 2.0, "b": state["b"] + 1.0,
                "step": state["step"] + 1}

    state = _sharded_state(n, shard)
    saved = {}
    with Checkpointer(tmp_path, keep=None) as ckpt:
        for step in range(1, 13):
            before, state = state, train_step(state)
            # Donated: the step wrote its result into those buffers. (On CPU, JAX declines to donate a buffer
            # that a checkpoint's host copy still aliases, which is also consistent; a GPU copies.)
            assert before["w"].is_deleted() or step % 4 == 1, step
            if step % 4 == 0:
                saved[step] = jax.tree.map(lambda x: np.array(x, copy=True), state)
                assert ckpt.save(step, state, {"step": step})
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                      state)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 8, 12]
        for step, expected in saved.items():
            restored, meta = ckpt.restore(step, abstract_state)
            assert meta == {"step": step}
            for path, value in expected.items():
                np.testing.assert_array_equal(np.asarray(restored[path]), value, err_msg=f"step {step} {path}")


@pytest.mark.multi_device
def test_host_digest_of_shards_equals_the_device_digest():
    """A save sums this process's shards on the host; restore verifies with the devices' sums."""
    import ml_dtypes

    from mirrorax.integrity import HostDigest, digest

    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    tree = {
        "rows": put(rng.normal(size=(64, 40)).astype(np.float32), "batch"),
        "cols": put(rng.normal(size=(16, 24)).astype(np.float32), None, "batch"),
        "replicated": put(rng.normal(size=(5, 3, 7)).astype(np.float32)),
        "bf16": put(rng.normal(size=(16, 8)).astype(ml_dtypes.bfloat16), "batch"),
        "f16": put(rng.normal(size=(9,)).astype(np.float16)),
        "i32_last_axis": put(rng.integers(-99, 99, size=(2, 3, 16)).astype(np.int32), None, None, "batch"),
        "u8": put(rng.integers(0, 255, size=(24,)).astype(np.uint8), "batch"),
        "bool": put(rng.random(16) > 0.5, "batch"),
        "c64": put((rng.normal(size=(8, 4)) + 1j * rng.normal(size=(8, 4))).astype(np.complex64), "batch"),
        "scalar": put(np.float32(3.5)),
        "key": put(jax.random.key(3)),
        "keys": put(jax.random.split(jax.random.key(3), 8), "batch"),
        "numpy": np.arange(6, dtype=np.int32).reshape(2, 3),
        "python": 2.0,
        "nan": put(np.array([1.0, np.nan, 2, 3, 4, 5, 6, 7], np.float32), "batch"),
        "single_device": jnp.arange(10.0),
    }
    checksums, non_finite = digest(tree)
    assert HostDigest(tree).result() == (checksums, non_finite)
    assert non_finite == ["nan"] and len(checksums) == len(tree)


def test_a_value_orbax_cannot_write_is_refused_before_the_save_naming_it(tmp_path):
    # Refused by Orbax from inside its save, such a value left background threads waiting for good.
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match=r"Received 'text' \(of type str\) at 'a/b'"):
            ckpt.save(1, {"a": {"b": "text"}}, {})
        with pytest.raises(TypeError, match=r"dtype <U1 at 'w'"):
            ckpt.save(1, {"w": np.array(["x"])}, {})
        with pytest.raises(ValueError, match=r"Received shape \(0, 3\) at 'w'"):
            ckpt.save(1, {"w": jnp.zeros((0, 3))}, {})
        assert ckpt.save(1, {"w": jnp.ones(3), "n": 2.0}, {})
    assert Checkpointer(tmp_path, read_only=True).all_steps() == [1]


def test_only_a_storage_fault_gets_storage_advice():
    import errno

    from mirrorax.checkpoint.storage import storage_fault as _storage_fault

    assert _storage_fault(OSError(errno.ENOSPC, "No space left on device")) == "ENOSPC: No space left on device"
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Failed to write 409429 bytes: No space left on device '
                             "[os_error_code='28']")
    assert _storage_fault(RuntimeError("commit failed").with_traceback(None)) is None
    wrapped = RuntimeError("commit failed")
    wrapped.__cause__ = tensorstore
    assert _storage_fault(wrapped) == "ENOSPC: No space left on device"
    assert _storage_fault(ValueError("Cannot serialize host local jax.Array (ParamInfo=[name=epoch.0])")) is None
