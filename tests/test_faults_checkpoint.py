"""Faults on the checkpoint side (issue 20): a checkpoint is trusted only when verified.

Each test stages one fault an operator meets (an edited or bit-flipped ``meta``, a pickled input state,
a newer format, an incomplete step, a full disk, a second run, a read-only directory, a changed learning
rate, a wrong argument) and checks what the user is told and that nothing resumes at the wrong place.
All in-process.
"""

from __future__ import annotations

import base64
import builtins
import errno
import io
import json
import os
import pathlib
import pickle
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mirrorax as mx
from mirrorax.checkpoint import resume as resume_lib
from mirrorax.checkpoint.checkpointer import Checkpointer, CheckpointError, CheckpointWarning
from mirrorax.inputs import position
from mirrorax.results import History
from mirrorax.train_state import TrainState

RUN = {"batch_size": 8, "shuffle": True, "seed": 0, "steps_per_epoch": None}


def _state(step: int, lr: float = 0.01) -> TrainState:
    sharding = NamedSharding(jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2]), P())

    def put(x):
        return jax.device_put(jnp.asarray(x), sharding)

    state = TrainState.create(
        params={"000/dense/kernel": np.full((4, 3), step, np.float32)},
        model_state={},
        optimizer={"000/adam/iteration": np.int32(step), "001/adam/learning_rate": np.float32(lr)},
        metrics={},
    ).replace(step=np.int32(step))
    return jax.tree.map(put, state)


def _abstract(state: TrainState) -> TrainState:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _meta(step: int, epoch: int, batch: int, **extra) -> dict:
    return {"step": step, "epoch": epoch, "batch_in_epoch": batch, "run": dict(RUN),
            "history": {"loss": [0.5] * epoch}, **extra}


def _write(directory, steps=(3, 6), **extra) -> None:
    with Checkpointer(directory, keep=None) as ckpt:
        for s in steps:
            ckpt.save(s, _state(s), _meta(s, s // 4, s % 4, **extra))


def _edit_json(path: pathlib.Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def _restore_latest(directory):
    with Checkpointer(directory) as ckpt:
        return ckpt.restore_latest(_abstract(_state(0)))


# -- 3: a checkpoint never runs code ---------------------------------------------------------------


class _Boom:
    """Unpickling it creates a file: the proof that loading ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_input_state_is_stored_as_json_and_rebuilt_without_unpickling():
    raw = {"batches_yielded": 3, 3: (1, 2), "rng": np.arange(4, dtype=np.uint32), "b": b"\x00\xff"}
    saved = position._encode("torchdata", raw)
    assert saved["encoding"] == "typed-json"
    text = json.dumps(saved)  # plain JSON: what meta stores
    back = position._decode(json.loads(text))
    assert back["batches_yielded"] == 3 and back[3] == (1, 2) and back["b"] == b"\x00\xff"
    np.testing.assert_array_equal(back["rng"], raw["rng"])
    assert back["rng"].dtype == np.uint32
    # A state holding an arbitrary object is not saved at all (the resumed epoch replays the input).
    assert position._encode("torchdata", {"sampler": object()}) is None


def test_a_pickled_input_state_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps(_Boom(str(marker)))).decode("ascii")
    evil = {"kind": "torchdata", "encoding": "pickle", "value": payload}
    _write(tmp_path / "ck", steps=(6,), input_state=evil)
    monkeypatch.delenv(position.ALLOW_PICKLE_ENV, raising=False)
    with Checkpointer(tmp_path / "ck") as ckpt, pytest.raises(CheckpointError) as err:
        resume_lib.resume(ckpt, _abstract(_state(0)), dict(RUN), History())
    assert "pickled" in str(err.value) and position.ALLOW_PICKLE_ENV in str(err.value)
    with pytest.raises(position.UnsafeInputState):
        position._decode(evil)
    assert not marker.exists()


# -- 4: every byte a resume reads is verified --------------------------------------------------------


@pytest.mark.parametrize("edit", [
    lambda m: m.update(batch_in_epoch=m["batch_in_epoch"] ^ 1),  # one flipped bit
    lambda m: m.update(epoch=m["epoch"] + 1),
    lambda m: m["history"]["loss"].__setitem__(0, 0.25),  # an edited history value
])
def test_an_edited_meta_record_is_damage_never_a_place_to_resume(tmp_path, edit):
    _write(tmp_path)
    _edit_json(tmp_path / "6" / "meta" / "metadata", edit)
    with pytest.warns(CheckpointWarning, match=r"step 6 .*meta record .*does not match its digest"):
        step, state, meta = _restore_latest(tmp_path)
    assert (step, meta["epoch"], meta["batch_in_epoch"]) == (3, 0, 3)
    assert int(state.step) == 3
    assert [p.name.split("_")[1] for p in (tmp_path / "damaged").iterdir()] == ["6"]


def test_a_step_directory_renamed_to_another_step_is_damage(tmp_path):
    _write(tmp_path)
    shutil.copytree(tmp_path / "6", tmp_path / "9")  # a step of another number: the record says 6
    with pytest.warns(CheckpointWarning, match=r"step 9 .*integrity record is of step 6"):
        step, _, _ = _restore_latest(tmp_path)
    assert step == 6


def test_resume_cross_checks_the_position_against_the_step(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(6, _state(6), _meta(5, 1, 2))  # written so (a bug, or another writer): digest is fine
        with pytest.raises(CheckpointError, match=r"does not say consistently where it stopped"):
            resume_lib.resume(ckpt, _abstract(_state(0)), dict(RUN), History())


# -- 10, 11: format versions and incomplete steps --------------------------------------------------


def test_a_newer_format_is_refused_with_upgrade_advice_and_left_alone(tmp_path):
    _write(tmp_path)
    _edit_json(tmp_path / "6" / "integrity" / "metadata", lambda r: r.update(format=99))
    with pytest.raises(CheckpointError, match=r"newer mirrorax \(checkpoint format 99; .*reads formats up to 2\)"
                                              r".*Upgrade mirrorax"):
        _restore_latest(tmp_path)
    assert (tmp_path / "6").is_dir() and not (tmp_path / "damaged").exists()


def test_an_older_meta_without_run_settings_says_older_mirrorax(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(6, _state(6), {"epoch": 1, "batch_in_epoch": 2})
        with pytest.raises(CheckpointError, match=r"written by an older mirrorax"):
            resume_lib.resume(ckpt, _abstract(_state(0)), dict(RUN), History())


def test_a_newer_step_holding_only_meta_falls_back_to_the_newest_complete_one(tmp_path):
    _write(tmp_path)
    (tmp_path / "9").mkdir()
    shutil.copytree(tmp_path / "6" / "meta", tmp_path / "9" / "meta")
    with pytest.warns(CheckpointWarning, match=r"step 9 .*incomplete .*Resuming from step 6"):
        step, _, _ = _restore_latest(tmp_path)
    assert step == 6
    with Checkpointer(tmp_path) as ckpt:  # and step 9 can be written again
        assert ckpt.save(9, _state(9), _meta(9, 2, 1))


# -- issue 19: a wrong argument is a TypeError, not damage -----------------------------------------


def test_restore_latest_given_keras_variables_is_a_type_error_not_damage(tmp_path):
    import keras

    _write(tmp_path)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with Checkpointer(tmp_path) as ckpt, pytest.raises(TypeError, match=r"keras.*Variable.*ShapeDtypeStruct"):
        ckpt.restore_latest({"params": model.trainable_variables})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "6"]


# -- 14: readable warnings -------------------------------------------------------------------------


def test_a_truncated_file_is_named_without_a_pybind_repr(tmp_path):
    rng = np.random.default_rng(0)
    with Checkpointer(tmp_path) as ckpt:
        for step in (3, 6):  # random values: compression leaves the data file as large as the array
            ckpt.save(step, {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)}, {})
    big = max((p for p in (tmp_path / "6").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    with pytest.warns(CheckpointWarning) as record, Checkpointer(tmp_path) as ckpt:
        step, _, _ = ckpt.restore_latest({"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)})
    assert step == 3
    text = str(record[0].message)
    assert "pybind" not in text and "TensorStore({" not in text and "\n" not in text, text


# -- 8: disk full ----------------------------------------------------------------------------------


def test_a_full_disk_is_one_line_naming_the_step_and_the_newest_good_checkpoint(tmp_path, capfd):
    big = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(128, 128)), jnp.float32)}  # 64 KiB
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    ckpt = Checkpointer(tmp_path)
    try:
        ckpt.save(1, big, {})
        ckpt.wait()
        capfd.readouterr()
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))  # files over 4 KiB: no space
        ckpt.save(2, jax.tree.map(lambda a: a + 1, big), {})
        with pytest.raises(CheckpointError) as err:
            ckpt.wait()
        left = sorted(os.listdir(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
        ckpt.close()
    message = str(err.value)
    assert message.startswith("Checkpoint step 2 could not be written to ") and "\n" not in message
    assert "the newest good checkpoint is step 1" in message and "File too large" in message
    assert isinstance(err.value.cause, Exception) and err.value.__cause__ is None  # kept, not printed
    assert left == [".mirrorax-lock", "1"], left  # the failed step's temporary directory is gone at once
    printed = capfd.readouterr()
    assert len((printed.out + printed.err).splitlines()) <= 2, printed.err[-3000:]
    with Checkpointer(tmp_path) as again:
        assert again.restore_latest(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), big))[0] == 1


def test_a_small_file_written_on_a_full_disk_stays_whole_and_leaves_nothing(tmp_path):
    """Issue 56: an index, a lock, TF's state file are written atomically: a write that fails part-way (here
    past RLIMIT_FSIZE, as on a full disk) leaves the old file as it was and no temporary file."""
    from mirrorax.checkpoint.storage import write_atomic

    target = tmp_path / "index.json"
    target.write_text('{"old": true}')
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        with pytest.raises(OSError):
            write_atomic(str(target), b"x" * 65536)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert target.read_text() == '{"old": true}' and os.listdir(tmp_path) == ["index.json"]
    write_atomic(str(target), b'{"new": true}')
    assert target.read_text() == '{"new": true}' and os.listdir(tmp_path) == ["index.json"]


def test_tfs_state_file_that_cannot_be_written_is_one_line_and_is_left_whole(tmp_path, monkeypatch):
    keras = pytest.importorskip("keras")
    from mirrorax.keras import checkpoint as keras_checkpoint

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    manager = mx.CheckpointManager(mx.Checkpoint(model=model), tmp_path, max_to_keep=2)
    manager.save()
    state_file = tmp_path / "checkpoint"
    named = state_file.read_text()

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(keras_checkpoint, "write_atomic", full)
    assert manager.save().endswith("/ckpt/2") and state_file.read_text() == named  # unchanged: not rewritten
    other = mx.CheckpointManager(mx.Checkpoint(model=model), tmp_path, max_to_keep=2, checkpoint_name="other")
    with pytest.raises(CheckpointError, match=r"^TF's checkpoint state file .*checkpoint could not be written: "
                                              r"OSError: \[Errno 28\] No space left on device; it is as it was"):
        other.save()
    assert state_file.read_text() == named
    mx.Checkpoint(model=model).wait()


# -- 9: one run per directory ----------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_on_one_directory_is_refused_naming_the_owner(tmp_path):
    lock = tmp_path / ".mirrorax-lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "since": "then"}))  # pid 1 lives
    with pytest.raises(CheckpointError, match=rf"in use by another run \(process 1 on host {socket.gethostname()}"):
        Checkpointer(tmp_path)
    lock.write_text(json.dumps({"host": "other-host", "pid": 4242, "since": "then"}))
    with pytest.raises(CheckpointError, match=r"process 4242 on host other-host.*delete"):
        Checkpointer(tmp_path)
    with Checkpointer(tmp_path, read_only=True) as reader:  # reading needs no lock
        assert reader.all_steps() == []


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_released_on_close(tmp_path, capfd):
    dead = _dead_pid()
    lock = tmp_path / ".mirrorax-lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "since": "then"}))
    with Checkpointer(tmp_path) as ckpt:
        assert f"its owner, process {dead} on this host" in capfd.readouterr().err
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        ckpt.save(1, {"w": jnp.ones(3)}, {})
    assert not lock.exists()


# -- 7: reading needs no write access --------------------------------------------------------------


@pytest.fixture
def read_only_dir(monkeypatch):
    """Python-level writes under a directory fail as on a read-only mount (EROFS), even for root."""
    roots: list[str] = []

    def inside(path) -> bool:
        try:
            p = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return False
        return any(p == r or p.startswith(r + os.sep) for r in roots)

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and inside(file):
            refuse(file)
        return real_open(file, mode, *a, **k)

    def guarded_os_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
            refuse(path)
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
    for name in ("mkdir", "remove", "unlink", "rmdir", "rename", "replace"):
        real = getattr(os, name)

        def guarded(path, *a, _real=real, **k):
            if inside(path):
                refuse(path)
            return _real(path, *a, **k)

        monkeypatch.setattr(os, name, guarded)
    return roots


def test_a_read_only_checkpointer_reads_a_read_only_directory_and_moves_nothing(tmp_path, read_only_dir):
    _write(tmp_path)
    _edit_json(tmp_path / "6" / "meta" / "metadata", lambda m: m.update(epoch=7))  # damaged: left in place
    read_only_dir.append(str(tmp_path))
    with pytest.warns(CheckpointWarning, match=r"step 6 .*left in place \(read-only\)"), \
            Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.restore_latest(_abstract(_state(0)))[0] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "6"]
    with pytest.raises(CheckpointError, match="Read-only file system"):  # the fixture does refuse writes
        Checkpointer(tmp_path)


@pytest.mark.slow  # trains a Keras model (a fast test above covers the read-only Checkpointer)
def test_trainer_load_reads_a_read_only_directory(tmp_path, read_only_dir):
    from helpers import dense, flat_digits, strategy

    x, y, _, _ = flat_digits(64)
    with strategy(2).scope():
        model = dense()
    mx.Trainer(model).fit(x, y, batch_size=32, epochs=1, verbose=0, checkpoint_dir=tmp_path / "ck")
    before = sorted(str(p) for p in (tmp_path / "ck").rglob("*"))
    read_only_dir.append(str(tmp_path / "ck"))
    with strategy(2).scope():
        again = dense(seed=7)
    loaded = mx.Trainer.load(tmp_path / "ck", again)
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert loaded.state is not None
    assert sorted(str(p) for p in (tmp_path / "ck").rglob("*")) == before
    with Checkpointer(tmp_path / "ck", read_only=True) as reader, pytest.raises(CheckpointError, match="read-only"):
        reader.save(99, {"w": jnp.ones(2)}, {})


# -- 13: a learning rate changed between runs ------------------------------------------------------


def test_a_learning_rate_configured_anew_replaces_the_checkpoints(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        saved_run = dict(RUN, hyperparameters={"001/adam/learning_rate": 0.01})
        ckpt.save(6, _state(6, lr=0.005), _meta(6, 1, 2) | {"run": saved_run})
        this_run = dict(RUN, hyperparameters={"001/adam/learning_rate": 0.001})
        with pytest.warns(CheckpointWarning, match=r"learning_rate is 0.001 in this run and was 0.01 .*uses 0.001 "
                                                   r"\(the checkpoint held 0.005\)"):
            resumed = resume_lib.resume(ckpt, _abstract(_state(0)), this_run, History())
    lr = resumed.state.optimizer["001/adam/learning_rate"]
    assert float(lr) == pytest.approx(0.001) and lr.sharding == _state(0).step.sharding


@pytest.mark.slow  # three Keras fits (the fast tests around it cover resume's choice)
def test_a_learning_rate_changed_on_purpose_is_used_and_said(tmp_path):
    from helpers import dense, flat_digits, strategy

    x, y, _, _ = flat_digits(64)

    def fit(lr, epochs):
        with strategy(2).scope():
            model = dense(optimizer=mx_adam(lr))
        trainer = mx.Trainer(model)
        trainer.fit(x, y, batch_size=32, epochs=epochs, verbose=0, checkpoint_dir=tmp_path / "ck")
        return float(trainer.state.optimizer["001/adam/learning_rate"])

    assert fit(0.01, 1) == pytest.approx(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same value: nothing to say
        assert fit(0.01, 2) == pytest.approx(0.01)
    with pytest.warns(CheckpointWarning, match=r"learning_rate is 0.001 in this run and was 0.01 .*uses 0.001"):
        assert fit(0.001, 3) == pytest.approx(0.001)


def mx_adam(lr):
    import keras

    return keras.optimizers.Adam(lr)


def test_a_learning_rate_a_callback_changed_is_kept_from_the_checkpoint(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        run = dict(RUN, hyperparameters={"001/adam/learning_rate": 0.01})
        ckpt.save(6, _state(6, lr=0.002), _meta(6, 1, 2) | {"run": run})  # a schedule lowered it to 0.002
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            resumed = resume_lib.resume(ckpt, _abstract(_state(0)), run, History())
    assert float(resumed.state.optimizer["001/adam/learning_rate"]) == pytest.approx(0.002)


# -- 14: nothing piles up over repeated saves and fits ---------------------------------------------


def test_threads_do_not_pile_up_over_saves_and_checkpointers(tmp_path):
    state = {"w": jnp.ones((8, 8))}
    with Checkpointer(tmp_path / "a", keep=2) as ckpt:
        ckpt.save(1, state, {})
        ckpt.wait()
        before = threading.active_count()
        for step in range(2, 30):
            ckpt.save(step, state, {})
        ckpt.wait()
        assert threading.active_count() <= before + 1
    start = threading.active_count()
    for i in range(10):
        with Checkpointer(tmp_path / "b", keep=1) as ckpt:
            ckpt.save(i + 1, state, {})
    assert threading.active_count() <= start + 1


def test_saves_and_restores_do_not_poll_tensorstores_leaking_metrics(tmp_path, monkeypatch):
    """``tensorstore.experimental_collect_matching_metrics`` keeps ~7 KB per call (14 MB over 2,000 calls);
    Orbax polled it twice per save and per restore for a log line: the creep of long runs."""
    import tensorstore

    calls = []
    real = tensorstore.experimental_collect_matching_metrics
    monkeypatch.setattr(tensorstore, "experimental_collect_matching_metrics",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    state = {"w": jnp.ones((8, 8))}
    with Checkpointer(tmp_path) as ckpt:
        for step in range(1, 4):
            ckpt.save(step, state, {})
        assert ckpt.restore_latest(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state))[0] == 3
    assert calls == []


def test_tensorstore_spec_to_json_is_unchanged_and_leak_free(tmp_path):
    """TensorStore 0.1.86's ``Spec.to_json()`` keeps every nested dict and list it returns (2.8 KB per
    array spec); Orbax calls it per array on every save, restore and metadata read."""
    import gc
    import tracemalloc

    import tensorstore

    with Checkpointer(tmp_path):  # the first Checkpointer makes it leak-free, process-wide
        pass
    array = tensorstore.open({"driver": "zarr", "kvstore": {"driver": "memory"},
                              "metadata": {"shape": [4, 3], "dtype": "<f4", "chunks": [4, 3]}}, create=True).result()
    spec, kv = array.spec(), tensorstore.KvStore.Spec({"driver": "file", "path": str(tmp_path) + "/"})
    for s in (spec, kv):  # with an argument: TensorStore's own conversion, the reference
        assert s.to_json() == s.to_json(include_defaults=False)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            spec.to_json()
            kv.to_json()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 200 * 100, f"{grown / 200:.0f} bytes kept per call"  # was ~3,000


def test_restores_keep_no_memory(tmp_path):
    """A resuming ``fit`` restores once: 12 variables kept ~88 KB per restore (TensorStore specs)."""
    import gc
    import tracemalloc

    state = _state(3)
    abstract = _abstract(state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state, _meta(3, 0, 3))
        for _ in range(3):  # warm-up: caches of JAX and Orbax fill once
            ckpt.restore_latest(abstract)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(5):
                ckpt.restore_latest(abstract)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert grown < 5 * 30_000, f"{grown / 5 / 1024:.1f} KB kept per restore"  # was 88 KB; now 8-15
