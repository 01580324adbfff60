"""keras.io's programs, as written, give plain Keras's numbers under a 4-device scope.

One test per program in ``tests/keras_io/`` (slow tier): ``run.run_program`` runs it under
``MirroredStrategy(devices=jax.devices()[:4]).scope()`` in a fresh process and compares its History,
weights, evaluate and predict at rtol 1e-4 with plain Keras's outcome for the same seed: the record in
``tests/keras_io/expected/`` when it was made with the installed keras, jax, jaxlib, numpy and the
program's current source, else a plain-Keras run in a fresh process beside it. Programs listed in
``run.EXPECTED_FAILURES`` are strict xfails: one that starts to match fails until it is unlisted.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("keras_io_run", Path(__file__).parent / "keras_io" / "run.py")
assert _spec is not None and _spec.loader is not None
run = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run  # dataclasses look their module up there
_spec.loader.exec_module(run)


def _param(name: str) -> object:
    reason = run.EXPECTED_FAILURES.get(name)
    return pytest.param(name, marks=pytest.mark.xfail(reason=reason, strict=True)) if reason else name


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.timeout(2 * run.TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [_param(n) for n in run.programs()])
def test_keras_io_program_matches_plain_keras(name: str, tmp_path: Path) -> None:
    outcome = run.run_program(name, tmp_path)
    # An expected failure reaches here as "xfail": fail the test, so that pytest records the xfail.
    assert outcome.status == "match", f"{name}: {outcome.status} (against the {outcome.reference})\n{outcome.detail}"


@pytest.mark.parametrize("name", run.programs())
def test_every_program_has_a_record_of_its_current_source(name: str) -> None:
    """A program edited (or added) without re-recording would silently cost a plain-Keras run per test run."""
    stale = [f for f in run.stale_fields(name) if f == "no record" or f.startswith("source_sha256")]
    assert not stale, (f"{name}: plain Keras's record in tests/keras_io/expected/ does not match the program "
                       f"({stale[0]}); record it: {run.RECORD_COMMAND} {name}")


def _fake_processes(monkeypatch: pytest.MonkeyPatch, outcome: dict[str, np.ndarray]) -> list[str]:
    """Replaces the worker processes with ones that return ``outcome``; returns the modes started."""
    started: list[str] = []

    def start(name: str, mode: str, tmp: Path, tag: str = "") -> tuple[str, str]:
        started.append(mode + tag)
        return mode, str(tmp / f"{name}.{mode}{tag}")

    monkeypatch.setattr(run, "_start", start)
    monkeypatch.setattr(run, "_finish", lambda proc, out, deadline: ({"ok": True, "seconds": 0.0}, dict(outcome)))
    return started


def test_a_current_record_replaces_the_plain_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    name = run.programs()[0]
    record = run.load_record(name)
    monkeypatch.setattr(run, "stale_fields", lambda n: [])
    started = _fake_processes(monkeypatch, record)
    outcome = run.run_program(name, tmp_path)
    assert (started, outcome.status, outcome.reference) == (["scoped"], "match", "record")

    # The scoped side is compared with the record: one element off by more than the tolerance differs.
    key = next(k for k, v in record.items() if v.size and np.all(np.isfinite(v)))
    off = {**record, key: record[key] + 1e-3 * (1 + np.abs(record[key]))}
    _fake_processes(monkeypatch, off)
    assert run.run_program(name, tmp_path).status == "DIFFER"


def test_a_stale_record_is_never_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another Keras (or jax, numpy, an edited program) than the record's: plain Keras runs again."""
    name = run.programs()[0]
    key = run.record_key
    monkeypatch.setattr(run, "record_key", lambda n: {**key(n), "keras": "0.0.0"})
    assert any(f.startswith("keras: recorded ") and f.endswith(", now '0.0.0'") for f in run.stale_fields(name))
    started = _fake_processes(monkeypatch, run.load_record(name))
    outcome = run.run_program(name, tmp_path)
    assert (started, outcome.reference) == (["plain", "scoped"], "plain run")


def test_a_program_keyed_on_the_hosts_instructions_finds_the_record_of_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``DATA_PARALLEL`` program's baseline rounds as the host's vector instructions order its sums: it has
    a record per instruction set (AVX2 and AVX-512 hosts both run CI), and a third kind runs plain Keras."""
    name = next(iter(run.DATA_PARALLEL))
    records = sorted(p.name for p in run.EXPECTED.glob(f"{name}*.json"))
    assert len(records) == 2, records
    isas = {run.json.loads((run.EXPECTED / r).read_text())["key"]["cpu_isa"]: r for r in records}
    for isa, record in isas.items():
        monkeypatch.setattr(run, "_cpu_isa", lambda isa=isa: isa)
        assert run.stale_fields(name) == [] and f"{run._current_stem(name)}.json" == record
    monkeypatch.setattr(run, "_cpu_isa", lambda: "asimd sve")
    assert run._current_stem(name) is None
    assert run.stale_fields(name) == [f"cpu_isa: recorded {min(isas, key=lambda i: len(isas[i]))!r}, now 'asimd sve'"]
