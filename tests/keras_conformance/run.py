"""Runs Keras's own fit and callback tests without and with a strategy scope, and lists the differences.

Usage (from the repository root; slow: ~11 min per pass on 2 cores)::

    PYTHONPATH=$PWD/src python tests/keras_conformance/run.py            # both passes, then the diff
    PYTHONPATH=$PWD/src python tests/keras_conformance/run.py -k fit      # a subset (pytest's -k)
    PYTHONPATH=$PWD/src python tests/keras_conformance/run.py --files trainer_test.py
    PYTHONPATH=$PWD/src python tests/keras_conformance/run.py --scoped-only   # reuse the last baseline

Each pass is one ``pytest`` process over the test files of the installed Keras wheel
(``keras/src/trainers/trainer_test.py`` and ``keras/src/callbacks/*_test.py``, less those that need
TensorFlow or a network), with ``scope_plugin`` giving 8 CPU devices and, in the scoped pass, an
autouse ``MirroredStrategy(devices=jax.devices()[:4]).scope()`` around every test. The outcomes are
read from JUnit XML. The report lists each test that passes without the scope and fails with it;
those named in ``EXPECTED_FAILURES`` (which cannot pass by design) are listed apart, with their
reasons. Exit status 1 when any other test regressed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXCLUDED = ("remote_monitor_test.py", "swap_ema_weights_test.py", "tensorboard_test.py")  # TF or network

# Tests that cannot pass under the scope by design, with the reason. Keyed by "file::Class::test".
_SPARSE = ("sparse inputs (jax BCOO, scipy.sparse, tf.SparseTensor) are refused: mirrorax's input pipeline pads "
           "and shards dense global batches")
_DISTRIBUTION = ("a ModelParallel distribution set under the scope is refused with the way on: its layout map "
                 "belongs in MirroredStrategy(layout_map=...) (issues 17, 21)")
EXPECTED_FAILURES: dict[str, str] = {
    **{f"trainer_test.py::TestTrainer::test_{kind}_sparse_{lib}_graph": _SPARSE
       for kind in ("fit", "evaluate", "predict") for lib in ("jax", "scipy", "tf")},
    "trainer_test.py::JAXTrainerCorrectnessTest::test_jit_fit_with_out_shardings_logic_distributed": (
        "a keras.distribution.DataParallel opened inside the scope: the model is the scope's strategy's, its "
        "variables laid out as that strategy lays them (one replicated NamedSharding on its devices), not "
        "per variable on DataParallel's own mesh as the test asserts (issue 17)"),
    "orbax_checkpoint_test.py::OrbaxCheckpointTest::test_distributed_checkpoint_functionality": _DISTRIBUTION,
    "orbax_checkpoint_test.py::OrbaxCheckpointTest::test_distributed_checkpoint_resharding": _DISTRIBUTION,
}


def keras_test_files(names: list[str] | None) -> list[Path]:
    import importlib.util

    root = Path(importlib.util.find_spec("keras").origin).parent / "src"
    files = [root / "trainers" / "trainer_test.py"] + sorted((root / "callbacks").glob("*_test.py"))
    files = [f for f in files if f.name not in EXCLUDED]
    if names:
        files = [f for f in files if f.name in names]
    return files


def run_pass(scoped: bool, files: list[Path], out: Path, extra: list[str], timeout: int) -> dict[str, str]:
    xml = out / ("scoped.xml" if scoped else "baseline.xml")
    env = dict(os.environ, MIRRORAX_CONFORMANCE_SCOPE="1" if scoped else "0", KERAS_BACKEND="jax",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-c", str(HERE / "pytest.ini"), "--rootdir", str(HERE),
           "-p", "scope_plugin", "-q", "-o", "junit_family=xunit1", f"--timeout={timeout}", f"--junitxml={xml}",
           *extra, *map(str, files)]
    print(("scoped" if scoped else "baseline") + ": " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=False)
    return outcomes(xml)


def outcomes(xml: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        # xunit1 names the file: "trainer_test.py::TestTrainer::test_fit_flow_jit"
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        key = "::".join([Path(case.get("file", "?")).name, cls, case.get("name", "")])
        kinds = {child.tag for child in case}
        result[key] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", help="pytest -k expression (a subset of the tests)")
    p.add_argument("--files", nargs="*", help="only these Keras test files (e.g. trainer_test.py)")
    p.add_argument("--out", default="/tmp/keras_conformance", help="where the JUnit XML files go")
    p.add_argument("--scoped-only", action="store_true", help="reuse the last baseline XML in --out")
    p.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds")
    p.add_argument("-x", action="store_true", help="stop each pass at its first failure")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = keras_test_files(args.files)
    extra = (["-k", args.k] if args.k else []) + (["-x"] if args.x else [])
    base = outcomes(out / "baseline.xml") if args.scoped_only else run_pass(False, files, out, extra, args.timeout)
    scoped = run_pass(True, files, out, extra, args.timeout)

    def count(r: dict[str, str]) -> str:
        return ", ".join(f"{sum(v == k for v in r.values())} {k}" for k in ("passed", "failed", "skipped"))

    regressed = sorted(k for k, v in scoped.items() if v == "failed" and base.get(k) == "passed")
    fixed = sorted(k for k, v in scoped.items() if v == "passed" and base.get(k) == "failed")
    unexpected = [k for k in regressed if k not in EXPECTED_FAILURES]
    print(f"\nwithout the scope: {count({k: base[k] for k in scoped if k in base})}")
    print(f"with the scope:    {count(scoped)}")
    print(f"\npass without the scope, fail with it: {len(regressed)} "
          f"({len(regressed) - len(unexpected)} expected)")
    for k in unexpected:
        print(f"  FAIL {k}")
    for k in regressed:
        if k in EXPECTED_FAILURES:
            print(f"  expected {k}: {EXPECTED_FAILURES[k]}")
    stale = sorted(k for k in EXPECTED_FAILURES if scoped.get(k) == "passed")
    for k in stale:
        print(f"  now passes (drop from EXPECTED_FAILURES): {k}")
    if fixed:
        print(f"fail without the scope, pass with it: {len(fixed)}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
