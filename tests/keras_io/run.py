"""Runs keras.io programs in plain Keras (1 device) and under a 4-device scope, and compares them.

Usage (from the repository root)::

    PYTHONPATH=$PWD/src python tests/keras_io/run.py                 # every program, then the table
    PYTHONPATH=$PWD/src python tests/keras_io/run.py vae_subclassing  # some of them
    PYTHONPATH=$PWD/src python tests/keras_io/run.py --list
    PYTHONPATH=$PWD/src python tests/keras_io/run.py --no-shuffle NAME  # diagnosis: shuffle=False in both
    PYTHONPATH=$PWD/src python tests/keras_io/run.py --record         # re-record plain Keras's outcomes
    PYTHONPATH=$PWD/src python tests/keras_io/run.py --fresh NAME     # run plain Keras even if recorded
    PYTHONPATH=$PWD/src python tests/keras_io/run.py --one-device NAME  # diagnosis: a DATA_PARALLEL program
                                                                       # against plain Keras on 1 device

Each program is a module here (``tests/keras_io/<name>.py``) copied from keras-team/keras-io with its
model-building and compile code verbatim; only its data (small, learnable, seeded synthetic arrays), its
sizes and TF-only calls differ. It exposes ``program(strategy_scope) -> dict`` which builds and compiles
its model inside ``with strategy_scope():`` and fits it as written (default ``shuffle=True``).

Every program runs twice, side by side, each in a fresh process with 4 simulated CPU devices and
``keras.utils.set_random_seed(SEED)``: plain Keras (``strategy_scope`` is a no-op) and under
``mx.MirroredStrategy(devices=jax.devices()[:4]).scope()`` (each process forked from one that has
imported JAX, Keras and numpy and nothing more: ``tests/jobs/forks.py``). Every number the program
returns (History, weights, evaluate, predict) must agree: ``|scoped - plain| <= RTOL * |plain| + ATOL``
elementwise, with the same keys and shapes.

A program in ``DATA_PARALLEL`` (mixed precision) is compared with Keras's own
``keras.distribution.DataParallel`` on the same 4 devices instead: its plain side runs under that
distribution, the rounding baseline of a step whose gradients are bfloat16 sums over the batch, taken
per device and then across, where one device's differ by more than RTOL. ``--one-device`` compares it
with plain Keras on one device, as a diagnosis.

Plain Keras is the reference, and for a given program, seed and versions it is deterministic: its
outcome is recorded in ``expected/<name>.npz`` (the arrays) and ``expected/<name>.json`` (the keras,
jax, jaxlib and numpy versions, the program's source digest, the seed and the device count it was made
with). A run then starts only the scoped process and compares it with the record, when the record's key
equals the current one; otherwise (another Keras, an edited program) it runs plain Keras too, as
before, and never compares with a stale record. ``--record`` makes the records: it runs each program's
plain side twice, in two fresh processes, and writes the record only if the two agree bit for bit.
A ``DATA_PARALLEL`` program's key holds the host's vector instruction set too (its bfloat16 sums round
as XLA orders them for it): it keeps one record per instruction set, ``expected/<name>.isa-<hash>.*``
beside the first, so that AVX2 and AVX-512 hosts each find theirs.

The table lists ``name | status | max abs | max rel | seconds``; max rel is
over the elements whose plain value exceeds ATOL in magnitude. Exit status 1 when a program that is not
in ``EXPECTED_FAILURES`` fails or differs.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/, for its fork server
from jobs.forks import TENSORFLOW_IF_INSTALLED, ForkServer  # noqa: E402
from jobs.procs import suite_xla_flags  # noqa: E402

SEED = 1337
NUM_DEVICES = 4
RTOL = 1e-4
# Weights that end near zero (a bias after two epochs) compare on their absolute difference: 1e-6 is
# about eight float32 ulps of a weight of order 1, far below any training difference.
ATOL = 1e-6
TIMEOUT_S = 600
_NO_SHUFFLE = "KERAS_IO_DIAGNOSE_NO_SHUFFLE"
_ONE_DEVICE = "KERAS_IO_DIAGNOSE_ONE_DEVICE"
EXPECTED = HERE / "expected"
RECORD_COMMAND = "PYTHONPATH=$PWD/src python tests/keras_io/run.py --record"

# Programs that cannot match yet, with the issue-17 item that breaks them. The lead empties this after
# merging the fixes; a listed program that matches is reported as XPASS (and fails its pytest test).
EXPECTED_FAILURES: dict[str, str] = {}

# Programs whose plain side runs under Keras's own `keras.distribution.DataParallel` on the same
# NUM_DEVICES devices, with why one device is not their baseline. Under mixed precision a gradient is a
# bfloat16 sum over the batch: summed in another order (per device, then across), it now and then rounds to
# the neighbouring bfloat16 value, 2**-8 apart where float32's are 2**-24, and Adam carries that into every
# weight. DataParallel cannot place a batch that the devices do not divide: such a program's short batches
# are multiples of NUM_DEVICES.
DATA_PARALLEL: dict[str, str] = {
    "float8_training_and_inference_with_transformer":
        "mixed_bfloat16, then float8: Keras DataParallel and the scope both differ from one device by the "
        "same amounts after 3 epochs (weights 2.8e-3 and 9.2e-3, losses 4.4e-4 and 6.5e-3)",
}


def programs() -> list[str]:
    """The names of the battery's programs: every module here but the runner."""
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in ("run", "__init__"))


# --------------------------------------------------------------------------------------------------
# Records of plain Keras's outcomes.


def record_key(name: str) -> dict[str, Any]:
    """What plain Keras's outcome of ``name`` depends on: a record made under another key is stale."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    source = (HERE / f"{name}.py").read_bytes()
    # TensorFlow is not in the key: no program here uses it (tf.data, tf ops), and with it installed or not
    # plain Keras gives the same bits (checked on training_guide_endpoint and writing_callbacks with
    # `import tensorflow` made to fail). A program that imports it keys on its version.
    uses_tf = b"tensorflow" in source
    extra = {"tensorflow": installed("tensorflow") or installed("tensorflow-cpu")} if uses_tf else {}
    if b"keras_hub" in source:
        extra["keras-hub"] = installed("keras-hub")
    # Only where it is not one device, so that the other records' keys stay as they were made.
    if name in DATA_PARALLEL:
        extra["baseline"] = f"keras DataParallel on {NUM_DEVICES} devices"
        # Its bfloat16 and float8 sums round as XLA's CPU code orders them, which follows the vector
        # instructions the host has: a record made on an AVX-512 host differs from this program run on an
        # AVX2 one (2026-12-05: history 6e-4 apart, where a fresh plain run on the same host matched to 9e-8).
        extra["cpu_isa"] = _cpu_isa()
    return {**{p: installed(p) for p in ("keras", "jax", "jaxlib", "numpy")}, **extra,
            "source_sha256": hashlib.sha256(source).hexdigest(), "seed": SEED, "num_devices": NUM_DEVICES,
            "xla_flags": _xla_flags()}


def _cpu_isa() -> str:
    """The host's vector-instruction extensions that XLA's CPU code generator uses (Linux's CPU flags)."""
    wanted = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
              "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "asimd", "sve", "sve2"}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.machine()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.partition(":")[2].split())
            break
    return " ".join(sorted(flags & wanted)) or "none"


def _stems(name: str) -> list[str]:
    """The record files ``name`` may have: ``expected/<name>.*``, and for a program whose baseline rounds
    as the host's vector instructions order its sums (``DATA_PARALLEL``: ``cpu_isa`` in its key) one more
    per instruction set, ``expected/<name>.isa-<hash of cpu_isa>.*``, so that AVX2 and AVX-512 hosts (CI
    runs on both) each find a current record instead of running plain Keras beside the scope (87 s)."""
    if name not in DATA_PARALLEL:
        return [name]
    return [name, f"{name}.isa-{hashlib.sha256(_cpu_isa().encode()).hexdigest()[:8]}"]


def _differences(stem: str, current: dict[str, Any]) -> list[str]:
    meta_file = EXPECTED / f"{stem}.json"
    if not meta_file.exists() or not (EXPECTED / f"{stem}.npz").exists():
        return ["no record"]
    recorded = json.loads(meta_file.read_text()).get("key", {})
    return [f"{k}: recorded {recorded.get(k)!r}, now {v!r}" for k, v in current.items() if recorded.get(k) != v]


def _current_stem(name: str, current: dict[str, Any] | None = None) -> str | None:
    current = record_key(name) if current is None else current
    return next((stem for stem in _stems(name) if not _differences(stem, current)), None)


def stale_fields(name: str) -> list[str]:
    """The key fields in which ``name``'s record differs from now (["no record"] when there is none);
    ``[]`` when one of its records (``_stems``) is current."""
    current = record_key(name)
    if _current_stem(name, current) is not None:
        return []
    return _differences(name, current)


def load_record(name: str) -> dict[str, np.ndarray]:
    """``name``'s current record (else its first one)."""
    with np.load(EXPECTED / f"{_current_stem(name) or name}.npz") as data:
        return {k.replace("|", "/"): data[k] for k in data.files}


def _save_arrays(path: str, arrays: dict[str, np.ndarray], *, compressed: bool = False) -> None:
    save = np.savez_compressed if compressed else np.savez
    save(path, **{k.replace("/", "|"): v for k, v in arrays.items()})


def identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """The keys whose arrays are not bit-for-bit equal (NaN equal to NaN), or present in only one."""
    differ = sorted(a.keys() ^ b.keys())
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y, equal_nan=True):
            differ.append(key)
    return differ


# --------------------------------------------------------------------------------------------------
# Worker side: one program, one mode, in this process.


def _flatten(value: Any, prefix: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}/{k}" if prefix else str(k), out)
    elif isinstance(value, list | tuple) and not (value and all(np.isscalar(v) for v in value)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}/{i:03d}", out)
    elif value is not None:
        out[prefix] = np.asarray(value, dtype=np.float64)


def _force_no_shuffle(keras: Any) -> None:
    """A diagnosis, not the battery: every fit in both modes gets ``shuffle=False``.

    A program that matches this way but not with its default ``shuffle=True`` differs only by its
    shuffle order. mirrorax routes a scoped model's ``fit`` through its ``_METHODS`` table, so both
    that entry and Keras's own ``Model.fit`` are wrapped.
    """
    import functools

    from mirrorax.keras import fit as keras_fit

    def no_shuffle(fit: Any) -> Any:
        @functools.wraps(fit)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["shuffle"] = False
            return fit(self, *args, **kwargs)

        return wrapped

    keras.Model.fit = no_shuffle(keras.Model.fit)
    keras_fit._METHODS["fit"] = no_shuffle(keras_fit._METHODS["fit"])


def _worker(name: str, mode: str, out_file: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_NUM_CPU_DEVICES"] = str(NUM_DEVICES)
    import jax

    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
    import keras

    started = time.perf_counter()
    record: dict[str, Any] = {"name": name, "mode": mode}
    try:
        spec = importlib.util.spec_from_file_location(f"keras_io_{name}", HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if mode == "scoped":
            import mirrorax as mx

            strategy = mx.MirroredStrategy(devices=jax.devices()[:NUM_DEVICES])
            scope = strategy.scope
        else:
            scope = contextlib.nullcontext
            if name in DATA_PARALLEL and os.environ.get(_ONE_DEVICE) != "1":
                # Current for the whole program, as Keras's fit must run under it.
                keras.distribution.set_distribution(
                    keras.distribution.DataParallel(devices=jax.devices()[:NUM_DEVICES]))
        if os.environ.get(_NO_SHUFFLE) == "1":
            _force_no_shuffle(keras)
        keras.utils.set_random_seed(SEED)
        result = module.program(scope)
        arrays: dict[str, np.ndarray] = {}
        _flatten(result, "", arrays)
        _save_arrays(out_file + ".npz", arrays)
        record["ok"] = True
    except BaseException as exc:  # noqa: B036 - the parent reports any failure, even SystemExit
        record["ok"] = False
        record["error"] = "".join(traceback.format_exception(exc))[-3000:]
    record["seconds"] = time.perf_counter() - started
    Path(out_file + ".json").write_text(json.dumps(record))


# --------------------------------------------------------------------------------------------------
# Parent side: fresh processes, comparison, table.


@dataclasses.dataclass
class Outcome:
    """One program's comparison. ``status`` is match, DIFFER, FAIL-scoped, FAIL-plain, xfail or XPASS."""

    name: str
    status: str
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    seconds: float = 0.0
    detail: str = ""
    # "plain run" or "record", what the scoped outcome was compared with; "(DataParallel)" after it for a
    # program in DATA_PARALLEL.
    reference: str = "plain run"

    @property
    def ok(self) -> bool:
        return self.status in ("match", "xfail")


def _xla_flags() -> str:
    """The workers' ``XLA_FLAGS``: the caller's with the test suite's compile options
    (``jobs.procs.suite_xla_flags``), from pytest or not, as the records were made. The options are part
    of a record's key: a run with other ones (``MIRRORAX_TEST_USER_CODEGEN=1``) runs plain Keras beside."""
    return suite_xla_flags(os.environ.get("XLA_FLAGS", ""))


_SERVER: list[ForkServer] = []


def _server() -> ForkServer:
    """The process every worker is forked from (``tests/jobs/forks.py``), started at the first worker: it
    imports JAX, Keras and numpy once (about 7 s of CPU a worker saved), and TensorFlow where installed (what
    the programs' ``keras.utils.set_random_seed`` imports: 5 s more), not mirrorax, so that plain Keras's
    process holds nothing of it; a worker is still a fresh process in which nothing has run."""
    if not _SERVER or _SERVER[0].proc.poll() is not None:
        env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(NUM_DEVICES),
                   XLA_FLAGS=_xla_flags())
        _SERVER[:] = [ForkServer(["jax", "keras", "numpy", TENSORFLOW_IF_INSTALLED], env)]
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


_WORKER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("keras_io_run", {run!r})
run = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = run  # dataclasses look their module up there
spec.loader.exec_module(run)
run._worker({name!r}, {mode!r}, {out!r})
"""


def _start(name: str, mode: str, tmp: Path, tag: str = "") -> tuple[int, str]:
    """Starts ``name``'s ``mode`` worker in a fresh process; returns its pid and its output files' stem."""
    out = str(tmp / f"{name}.{mode}{tag}")
    code = _WORKER.format(run=str(Path(__file__).resolve()), name=name, mode=mode, out=out)
    return _server().start([(f"keras_io {name} {mode}", code)], tmp, out + ".log"), out


def _finish(pid: int, out: str, deadline: float) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    status = _server().wait(pid, max(1.0, deadline - time.monotonic()))
    if status is None:
        return {"ok": False, "error": f"timed out after {TIMEOUT_S} s", "seconds": float(TIMEOUT_S)}, {}
    record_file = Path(out + ".json")
    if not record_file.exists():  # the process died (an XLA abort, say) before writing its record
        log = Path(out + ".log").read_text()
        return {"ok": False, "error": f"worker exited {status}:\n{log[-3000:]}", "seconds": 0.0}, {}
    record = json.loads(record_file.read_text())
    if not record["ok"]:
        return record, {}
    with np.load(out + ".npz") as data:
        arrays = {k.replace("|", "/"): data[k] for k in data.files}
    return record, arrays


def compare(plain: dict[str, np.ndarray], scoped: dict[str, np.ndarray]) -> tuple[float, float, list[str]]:
    """Largest absolute and relative differences, and a line per key outside the tolerance."""
    problems = [f"missing under the scope: {k}" for k in plain if k not in scoped]
    problems += [f"only under the scope: {k}" for k in scoped if k not in plain]
    max_abs = max_rel = 0.0
    for key in sorted(plain.keys() & scoped.keys()):
        a, b = scoped[key], plain[key]
        if a.shape != b.shape:
            problems.append(f"{key}: shape {a.shape} under the scope, {b.shape} in plain Keras")
            continue
        if a.size == 0:
            continue
        diff = np.abs(a - b)
        if not np.all(np.isfinite(diff)):
            if not np.array_equal(np.isnan(a), np.isnan(b)) or not np.array_equal(a[~np.isnan(a)], b[~np.isnan(b)]):
                problems.append(f"{key}: non-finite values differ")
            continue
        big = np.abs(b) > ATOL
        rel = float(np.max(diff[big] / np.abs(b[big]))) if big.any() else 0.0
        max_abs, max_rel = max(max_abs, float(diff.max())), max(max_rel, rel)
        bad = diff > RTOL * np.abs(b) + ATOL
        if bad.any():
            i = np.unravel_index(int(np.argmax(np.where(bad, diff, -1))), diff.shape)
            problems.append(f"{key}: {int(bad.sum())}/{diff.size} elements differ, e.g. at {tuple(map(int, i))} "
                            f"scoped {a[i]:.8g} vs plain {b[i]:.8g}")
    return max_abs, max_rel, problems


def run_program(name: str, tmp: Path | None = None, *, fresh: bool = False) -> Outcome:
    """Runs ``name`` under the scope in a fresh process and compares it with plain Keras's outcome.

    Plain Keras's outcome is its record when that is current (``stale_fields`` is empty) and ``fresh``
    is false; otherwise plain Keras runs too, in a fresh process beside the scoped one.
    """
    use_record = not fresh and not stale_fields(name)
    with contextlib.ExitStack() as stack:
        if tmp is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="keras_io_")))
        # The two processes run side by side: each compiles mostly on one core.
        started = time.monotonic()
        plain_proc = None if use_record else _start(name, "plain", tmp)
        scoped_proc = _start(name, "scoped", tmp)
        if plain_proc is None:
            plain_rec, plain = {"ok": True}, load_record(name)
        else:
            plain_rec, plain = _finish(*plain_proc, started + TIMEOUT_S)
        scoped_rec, scoped = _finish(*scoped_proc, started + TIMEOUT_S)
        seconds = time.monotonic() - started
    reference = "record" if use_record else "plain run"
    if name in DATA_PARALLEL and os.environ.get(_ONE_DEVICE) != "1":
        reference += " (DataParallel)"
    expected = EXPECTED_FAILURES.get(name)
    if not plain_rec["ok"]:
        return Outcome(name, "FAIL-plain", seconds=seconds, detail=plain_rec["error"], reference=reference)
    if not scoped_rec["ok"]:
        status = "xfail" if expected else "FAIL-scoped"
        return Outcome(name, status, seconds=seconds, detail=scoped_rec["error"], reference=reference)
    max_abs, max_rel, problems = compare(plain, scoped)
    if problems:
        status = "xfail" if expected else "DIFFER"
    else:
        status = "XPASS" if expected else "match"
    detail = "\n".join(problems[:12]) if problems else (f"listed in EXPECTED_FAILURES: {expected}" if expected else "")
    return Outcome(name, status, max_abs, max_rel, seconds, detail, reference)


def record_program(name: str, tmp: Path | None = None) -> str:
    """Runs ``name``'s plain side twice, in two fresh processes, and records it if both agree bit for bit.

    Returns a line for the log; raises ``RuntimeError`` when a run fails or the two differ (nothing is
    written then: a program whose plain outcome does not repeat cannot be compared with a record).
    """
    with contextlib.ExitStack() as stack:
        if tmp is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="keras_io_")))
        started = time.monotonic()
        first, second = _start(name, "plain", tmp), _start(name, "plain", tmp, tag="-again")
        (rec_a, a), (rec_b, b) = _finish(*first, started + TIMEOUT_S), _finish(*second, started + TIMEOUT_S)
    for rec in (rec_a, rec_b):
        if not rec["ok"]:
            raise RuntimeError(f"{name}: plain Keras failed, nothing recorded:\n{rec['error']}")
    differ = identical(a, b)
    if differ:
        raise RuntimeError(f"{name}: two plain runs differ in {differ[:8]}: its outcome does not repeat, "
                           "so it cannot be recorded; make the program deterministic (seeds) first")
    EXPECTED.mkdir(exist_ok=True)
    # The first record's file, or where it stands for another instruction set, this one's (``_stems``).
    key = record_key(name)
    main, *per_isa = _stems(name)
    other_isa = not _differences(main, {k: v for k, v in key.items() if k != "cpu_isa"}) and \
        _differences(main, key)
    stem = per_isa[0] if per_isa and other_isa else main
    # Compressed: the float32 values held as float64 halve (an embedding of 20000 x 32: 5 MB -> 2.6 MB).
    _save_arrays(str(EXPECTED / f"{stem}.npz"), a, compressed=True)
    meta = {"key": key, "arrays": len(a), "plain_seconds": round(rec_a["seconds"], 1),
            "regenerate": f"{RECORD_COMMAND} {name}"}
    (EXPECTED / f"{stem}.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return f"{name}: recorded {len(a)} arrays, identical in two fresh processes ({rec_a['seconds']:.1f} s)"


def table(outcomes: list[Outcome]) -> str:
    lines = ["name | status | max abs | max rel | seconds | plain Keras", "--- | --- | --- | --- | --- | ---"]
    lines += [f"{o.name} | {o.status} | {o.max_abs:.2e} | {o.max_rel:.2e} | {o.seconds:.1f} | {o.reference}"
              for o in outcomes]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        _worker(*sys.argv[2:5])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="programs to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the programs and exit")
    p.add_argument("--out", help="keep each run's log, record and arrays in this folder")
    p.add_argument("--no-shuffle", action="store_true",
                   help="diagnosis: every fit with shuffle=False in both modes (not the battery)")
    p.add_argument("--record", action="store_true",
                   help="run plain Keras twice per program and record its outcome in expected/")
    p.add_argument("--fresh", action="store_true", help="run plain Keras even where a current record exists")
    p.add_argument("--one-device", action="store_true",
                   help="diagnosis: plain Keras on one device for the DATA_PARALLEL programs too (not the battery)")
    args = p.parse_args()
    if args.no_shuffle:
        os.environ[_NO_SHUFFLE] = "1"
    if args.one_device:
        os.environ[_ONE_DEVICE] = "1"
    if (args.no_shuffle or args.one_device) and args.record:
        p.error("--record records the battery as written; it cannot be combined with --no-shuffle or --one-device")
    if args.list:
        print("\n".join(programs()))
        return 0
    names = args.names or programs()
    unknown = sorted(set(names) - set(programs()))
    if unknown:
        p.error(f"unknown programs {unknown}; the battery has {programs()}")
    tmp = Path(args.out) if args.out else None
    if tmp:
        tmp.mkdir(parents=True, exist_ok=True)
    if args.record:
        failed = 0
        for name in names:
            try:
                print(record_program(name, tmp), flush=True)
            except RuntimeError as exc:
                failed += 1
                print(exc, flush=True)
        return 1 if failed else 0
    outcomes = []
    for name in names:
        outcome = run_program(name, tmp, fresh=args.fresh or args.no_shuffle or args.one_device)
        outcomes.append(outcome)
        print(f"{name}: {outcome.status} ({outcome.seconds:.1f} s)", flush=True)
        if outcome.detail:
            print("  " + outcome.detail.strip().replace("\n", "\n  "), flush=True)
    print()
    print(table(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
