"""Preemption: SIGTERM stops fit at a step boundary, saves, exits 143; the same command resumes exactly.

* One process (a real SIGTERM from outside, mid-epoch): exit status 143 with one line saying where
  the checkpoint is; the rerun ends with the weights and history of an uninterrupted run.
* Without checkpoint_dir: exit status 143, promptly, with a message saying the work is lost and how
  to keep it.
* grain input, stopped by SIGTERM or by SIGKILL (then resumed from a periodic checkpoint): the
  resumed epoch continues the loader from its saved state (``set_state``): the data source reads
  exactly the records not yet trained on (a replay would read the epoch's first batches again).
* torchdata-style loaders (``state_dict`` / ``load_state_dict``): the same, in-process, with a
  stand-in loader (torchdata is not a dependency).
* 2 processes x 2 devices, SIGTERM to process 1 only: both stop at the same step and exit 143; the
  rerun ends with the weights of one uninterrupted process on 4 devices.
* The SIGTERM handler exists only during fit, only in the main thread.
* The engine's, not Keras's: the in-process tests and the SIGTERM mid-epoch run again for a Flax NNX model
  (``helpers.front_end_model``), under the same Trainer.

Tolerance: rtol=1e-5, atol=1e-6 against the uninterrupted run (the same batches from the same state;
only float reassociation across device and process counts differs); accuracies exact.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from jobs.procs import clean_env, free_port, python, run_all

import mirrorax as mx
from mirrorax.cluster import preemption

SCRIPT = os.path.join(os.path.dirname(__file__), "jobs", "train_ckpt.py")
MP_SCRIPT = "tests/jobs/train_preempt.py"
RTOL, ATOL = 1e-5, 1e-6
ROWS, BATCH, EPOCHS = 200, 32, 3  # the job's data and defaults: 7 batches per epoch

pytestmark = pytest.mark.multi_device


def _run(args, timeout=240):
    out = subprocess.run(python(SCRIPT, *args), capture_output=True, text=True, timeout=timeout, env=clean_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _run_and_signal(tmp_path, args, after_steps, sig=signal.SIGTERM, timeout=240, ready=lambda: True):
    """Runs the job until it holds after step ``after_steps`` (its handshake), sends ``sig`` once
    ``ready()``, then lets it go on; returns (status, output, seconds from the signal to the exit)."""
    go = tmp_path / "go"
    proc = subprocess.Popen(python(SCRIPT, *args, "--hold-at", str(after_steps), "--go", str(go)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    seen, sent = [], None
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("HOLD"):
                deadline = time.monotonic() + 60
                while not ready():
                    assert time.monotonic() < deadline, "".join(seen)
                    time.sleep(0.01)
                proc.send_signal(sig)
                sent = time.monotonic()
                go.touch()
        proc.wait(timeout=60)
    finally:
        timer.cancel()
    assert sent is not None, "".join(seen)
    return proc.returncode, "".join(seen), time.monotonic() - sent


@pytest.fixture(scope="module")
def uninterrupted():
    """The job run through once, in this process (2 devices, as the job), per kind of input and front-end."""
    from helpers import dense, flat_digits, front_end_trainer, strategy, trained_state

    runs: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def run(inputs: str, front_end: str = "keras") -> dict[str, np.ndarray]:
        if front_end == "nnx" and (inputs, front_end) not in runs:
            x, y, _, _ = flat_digits(ROWS)
            _, trainer = front_end_trainer("nnx", 2, "mlp", classes=10, seed=1)
            hist = trainer.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=True, seed=5)
            runs[inputs, front_end] = dict({f"arr_{i}": w for i, w in enumerate(trained_state(trainer))},
                                           loss=np.array(hist.history["loss"]),
                                           accuracy=np.array(hist.history["accuracy"]))
        if (inputs, front_end) not in runs:
            x, y, _, _ = flat_digits(ROWS)
            with strategy(2).scope():
                model = dense()
            if inputs == "grain":
                data = (_grain_loader(x, y)[0],)
                kwargs = {}
            else:
                data, kwargs = (x, y), {"shuffle": True, "seed": 5}
            hist = mx.Trainer(model).fit(*data, batch_size=BATCH, epochs=EPOCHS, verbose=0, **kwargs)
            out = {f"arr_{i}": w for i, w in enumerate(model.get_weights())}
            runs[inputs, front_end] = dict(out, loss=np.array(hist.history["loss"]),
                                           accuracy=np.array(hist.history["accuracy"]))
        return runs[inputs, front_end]

    return run


def _grain_loader(x, y):
    import grain

    class Records:
        def __init__(self):
            self.reads = 0

        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            self.reads += 1
            return x[i], y[i]

        def __repr__(self):
            return f"Records({len(x)})"

    records = Records()
    loader = grain.DataLoader(
        data_source=records,
        sampler=grain.samplers.IndexSampler(len(x), shard_options=grain.sharding.NoSharding(), shuffle=True,
                                            seed=7, num_epochs=1),
        operations=[grain.transforms.Batch(BATCH)], worker_count=0,
        read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return loader, records


def _assert_same(got: dict, want: dict) -> None:
    for k in want:
        if k == "accuracy":
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL, err_msg=k)


def _resumed_at(out: str) -> tuple[int, int]:
    m = re.search(r"Resumed from checkpoint step \d+ in .* \(epoch (\d+), batch (\d+)\)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("inputs, sig, front_end", [("arrays", "SIGTERM", "keras"), ("grain", "SIGTERM", "keras"),
                                                    ("grain", "SIGKILL", "keras"), ("arrays", "SIGTERM", "nnx")])
def test_stopped_mid_epoch_the_rerun_resumes_exactly(tmp_path, inputs, sig, front_end, uninterrupted):
    """SIGTERM: fit saves where it stops and exits 143. SIGKILL: the resume starts from the newest
    periodic checkpoint (every 3 steps), which also holds grain's state. A Flax NNX model the same way (the
    whole state: parameters, optimizer)."""
    ckpt, got = tmp_path / "ckpt", tmp_path / "got.npz"
    every = ["--every", "3"] if sig == "SIGKILL" else []
    # The signal after 10 of 21 steps (epoch 2, batch 3), where the job holds until it is sent.
    # SIGKILL waits for the periodic checkpoint of step 9 (epoch 2, batch 2) to be on disk.
    ready = (lambda: (ckpt / "9").is_dir()) if sig == "SIGKILL" else (lambda: True)
    job = ["--input", inputs, "--front-end", front_end, *every]
    code, out, seconds = _run_and_signal(tmp_path, [str(ckpt), str(tmp_path / "never.npz"), *job], 10,
                                         getattr(signal, sig), ready=ready)
    assert not (tmp_path / "never.npz").exists()
    if sig == "SIGTERM":
        print(f"SIGTERM to exit: {seconds:.2f} s")
        assert code == mx.PREEMPTED_EXIT_CODE == 143, out
        assert re.search(r"mirrorax: preempted \(SIGTERM\): saved checkpoint step \d+ \(epoch 2, batch \d+\) "
                         r"in .*; exiting with status 143", out), out
        assert "Traceback" not in out, out
        assert seconds < 30, seconds  # a typical grace period; measured ~1 s (one step + the save)
    else:
        assert code == -signal.SIGKILL, out

    out = _run([str(ckpt), str(got), *job])  # the same command again
    epoch, batch = _resumed_at(out)
    assert epoch == 2 and 0 < batch < 7, out  # mid-epoch
    result = dict(np.load(got))
    _assert_same(result, uninterrupted(inputs, front_end))
    if inputs == "grain":
        # First batch once (fit sizes the model with it), the rest of the resumed epoch, then whole
        # epochs: the records trained on before the stop are not read again.
        assert int(result["reads"]) == BATCH + (ROWS - batch * BATCH) + ROWS * (EPOCHS - epoch), \
            (int(result["reads"]), batch)


@pytest.mark.slow  # starts a process
@pytest.mark.timeout(120)
def test_sigterm_without_checkpoint_dir_ends_promptly_and_says_how_to_keep_the_work(tmp_path):
    code, out, seconds = _run_and_signal(tmp_path, ["-", str(tmp_path / "never.npz")], 3)
    assert code == 143, out
    assert "mirrorax: preempted (SIGTERM) at step" in out and "the work since fit started is lost" in out, out
    assert "checkpoint_dir" in out, out
    assert seconds < 10, seconds
    assert not (tmp_path / "never.npz").exists()


# -- in-process ---------------------------------------------------------------------------------


class _TermAt:
    """Sends this process SIGTERM after the given step of the fit (counted over the whole fit)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.count = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(front_end: str):
    """The job's model (Keras's Dense, or the NNX tanh MLP) in a Trainer on 2 devices."""
    from helpers import dense, front_end_trainer, strategy

    if front_end == "nnx":
        return front_end_trainer("nnx", 2, "mlp", classes=10, seed=1)[1]
    with strategy(2).scope():
        return mx.Trainer(dense())


def _state(trainer):
    from helpers import trained_state

    return trained_state(trainer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("front_end", ["keras", "nnx"])
def test_preempted_is_a_system_exit_and_the_handler_exists_only_during_fit(tmp_path, front_end):
    from helpers import flat_digits

    assert issubclass(mx.Preempted, SystemExit)
    x, y, _, _ = flat_digits(ROWS)
    trainer = _trainer(front_end)
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    class Look:
        def on_train_batch_end(self, batch, logs=None):
            seen.append(signal.getsignal(signal.SIGTERM))

    with pytest.raises(mx.Preempted) as info:
        trainer.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[Look(), _TermAt(4)],
                    checkpoint_dir=tmp_path / "ck")
    assert info.value.code == 143 and info.value.step == 4, (info.value.code, info.value.step)
    assert info.value.checkpoint_dir == str(tmp_path / "ck")
    assert seen[0] is not before and getattr(seen[0], "__self__", None).__class__ is preemption.Watch
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    with mx.Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.latest_step() == 4
        meta = ckpt.read_meta()
    assert (meta["epoch"], meta["batch_in_epoch"]) == (0, 4)


def test_the_watch_is_a_no_op_outside_the_main_thread():
    before = signal.getsignal(signal.SIGTERM)
    modes = []

    def run():
        with preemption.Watch() as watch:
            modes.append((watch.mode, watch.reached()))

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert modes == [("off", False)]
    assert signal.getsignal(signal.SIGTERM) is before


class _StatefulLoader:
    """Stands in for torchdata's StatefulDataLoader: the loader holds the position (``state_dict``),
    and ``load_state_dict`` makes the next iteration continue from it."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.next_batch, self.reads, self.loaded = 0, 0, []
        self._resume_at = None

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __iter__(self):
        self.next_batch, self._resume_at = self._resume_at or 0, None
        while self.next_batch < len(self):
            i = self.next_batch
            self.reads += len(self.x[i * BATCH:(i + 1) * BATCH])
            self.next_batch += 1
            yield self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]

    def state_dict(self):
        return {"batches_yielded": self.next_batch, 3: (1, 2)}  # not JSON-exact: stored pickled

    def load_state_dict(self, state):
        assert state[3] == (1, 2)
        self.loaded.append(state["batches_yielded"])
        self._resume_at = state["batches_yielded"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("front_end", ["keras", "nnx"])
def test_a_state_dict_loader_resumes_from_its_own_state(tmp_path, front_end):
    from helpers import flat_digits

    x, y, _, _ = flat_digits(ROWS)

    def fit(loader, callbacks=(), ckpt=None):
        trainer = _trainer(front_end)
        hist = trainer.fit(loader, batch_size=BATCH, epochs=2, verbose=0, callbacks=list(callbacks),
                           checkpoint_dir=ckpt)
        return _state(trainer), hist.history["loss"]

    want = fit(_StatefulLoader(x, y))
    with pytest.raises(mx.Preempted):
        fit(_StatefulLoader(x, y), [_TermAt(10)], tmp_path / "ck")  # epoch 2, after batch 3
    loader = _StatefulLoader(x, y)
    got = fit(loader, ckpt=tmp_path / "ck")
    assert loader.loaded == [3]
    # The first batch (fit sizes the model with it), the 4 batches left of epoch 2; nothing replayed.
    assert loader.reads == BATCH + (ROWS - 3 * BATCH), loader.reads
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)


# -- two processes -------------------------------------------------------------------------------


def _two_processes(tmp_path, timeout: float, **env: str):
    port = free_port()
    envs = [clean_env(MIRRORAX_COORDINATOR=f"127.0.0.1:{port}", MIRRORAX_NUM_PROCESSES="2",
                      MIRRORAX_PROCESS_ID=str(i), MIRRORAX_CPU_DEVICES="2", MP_OUT=str(tmp_path),
                      MP_CKPT=str(tmp_path / "ckpt"), **env) for i in range(2)]
    return run_all([python(MP_SCRIPT)] * 2, envs, timeout=timeout)


@pytest.mark.multi_process
@pytest.mark.slow  # starts processes
@pytest.mark.timeout(300)
def test_two_processes_sigterm_to_one_stops_both_at_one_step_and_the_rerun_resumes_exactly(tmp_path):
    from helpers import strategy
    from jobs import train_dense

    # Process 1 alone gets SIGTERM after its step 10 of 28 (epoch 2, batch 3), on the first run only;
    # its steps are spaced (MP_SLEEP, first run only) so that the stop falls mid-run.
    job = {"MP_TERM": "1:10", "MP_SLEEP": "0.25", "MP_EPOCHS": "4", "MP_MEASURE": "1"}
    codes, outs, _ = _two_processes(tmp_path, 120, **job)
    ended = time.time()
    assert codes == [143, 143], (codes, outs[0][-3000:], outs[1][-3000:])
    sent = float(re.search(r"SIGTERM_AT ([\d.]+)", outs[1]).group(1))
    print(f"SIGTERM to both exited: {ended - sent:.2f} s")
    assert ended - sent < 30, ended - sent
    m = re.search(r"mirrorax: preempted \(SIGTERM\): saved checkpoint step (\d+) \(epoch (\d+), batch (\d+)\)",
                  outs[0])
    assert m and "exiting with status 143" in outs[0], outs[0][-3000:]
    assert "mirrorax: preempted" not in outs[1], outs[1][-3000:]  # process 0 speaks
    assert "Traceback" not in outs[0] + outs[1], (outs[0][-3000:], outs[1][-3000:])
    step = int(m.group(1))
    # Both stopped at that step: the step each printed last is the same.
    last = [re.findall(r"process \d STEP (\d+)", o)[-1] for o in outs]
    assert last[0] == last[1], last
    assert 10 <= step < 28, step

    codes, outs, _ = _two_processes(tmp_path, 150, **job)  # the same command again
    assert codes == [0, 0], (codes, outs[0][-3000:], outs[1][-3000:])
    assert f"Resumed from checkpoint step {step}" in outs[0], outs[0][-3000:]
    print(outs[0][outs[0].index("SYNC_POINT_US"):].splitlines()[0])

    model = train_dense._model(strategy(4))
    hist = mx.Trainer(model, strategy(4)).fit(*train_dense.data(), batch_size=train_dense.BATCH, epochs=4,
                                              shuffle=True, seed=3, verbose=0)
    for r in range(2):
        got = np.load(tmp_path / f"rank{r}.npz")
        for i, w in enumerate(model.get_weights()):
            np.testing.assert_allclose(got[f"w{i}"], w, rtol=RTOL, atol=ATOL, err_msg=f"rank {r} w{i}")
        np.testing.assert_allclose(got["h_loss"], hist.history["loss"], rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(got["h_accuracy"], hist.history["accuracy"])
