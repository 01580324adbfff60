"""keras.io's programs, as written, give plain Keras's numbers under a 4-device scope (slow tier).

One test per program in ``tests/keras_io/``: ``run.run_program`` runs it in plain Keras and under
``MirroredStrategy(devices=jax.devices()[:4]).scope()``, each in a fresh process with the same seed,
and compares its History, weights, evaluate and predict at rtol 1e-4. Programs listed in
``run.EXPECTED_FAILURES`` are strict xfails: one that starts to match fails until it is unlisted.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multi_device, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("keras_io_run", Path(__file__).parent / "keras_io" / "run.py")
assert _spec is not None and _spec.loader is not None
run = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run  # dataclasses look their module up there
_spec.loader.exec_module(run)


def _param(name: str) -> object:
    reason = run.EXPECTED_FAILURES.get(name)
    return pytest.param(name, marks=pytest.mark.xfail(reason=reason, strict=True)) if reason else name


@pytest.mark.timeout(2 * run.TIMEOUT_S + 60)
@pytest.mark.parametrize("name", [_param(n) for n in run.programs()])
def test_keras_io_program_matches_plain_keras(name: str, tmp_path: Path) -> None:
    outcome = run.run_program(name, tmp_path)
    # An expected failure reaches here as "xfail": fail the test, so that pytest records the xfail.
    assert outcome.status == "match", f"{name}: {outcome.status}\n{outcome.detail}"
