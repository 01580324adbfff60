"""Starting the test jobs: environments, free ports, N processes at once with a hard time bound."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

if __package__:  # jobs.procs, from the tests
    from . import zygote
else:  # procs, from a job script beside it
    import zygote

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
# Variables of the test runner's own environment that would describe a job to the children.
_JOB_VARS = ("MIRRORAX_", "TF_CONFIG", "SLURM_", "OMPI_", "JAX_COORDINATOR", "JAX_NUM_CPU_DEVICES",
             "JAX_PLATFORMS", "JAX_LOCAL_DEVICE_IDS", "KUBERNETES_SERVICE_HOST")


# Compiling dominates the suite's time (each test compiles its own small steps). The suite compiles fast:
# - LLVM's expensive passes skipped and its optimisation of the generated code off (-O0): a third less
#   CPU for the in-process tests (test_keras_fit.py + test_equivalence.py: 300 -> 198 s; the keras.io
#   battery: 249 -> 194 s);
# - XLA's older emitters for fused loops in place of the MLIR fusion emitters (XLA's own flag), which
#   spend half of what is left of a CPU compile: test_keras_fit.py 88 -> 61 s of CPU, its 250 backend
#   compiles 45 -> 19 s.
# The HLO programs stay as they are and the numbers move within float rounding (tests/jobs/float64_fit.py:
# Keras's float64 fit against the Trainer's, 1.7e-16 with the flags, 1.1e-16 without); both sides of a
# comparison compile alike. MIRRORAX_TEST_USER_CODEGEN=1 compiles as a user's program does (the last two
# flags off), to run the suite as users compile.
FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true"
FAST_CODEGEN = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
USER_CODEGEN_VAR = "MIRRORAX_TEST_USER_CODEGEN"  # =1: XLA's and LLVM's code generation as a user's programs


def suite_xla_flags(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the suite's compile options added: ``FAST_COMPILE`` always,
    ``FAST_CODEGEN`` unless ``MIRRORAX_TEST_USER_CODEGEN=1`` (which also removes them if already there)."""
    words = [f for f in flags.split() if f not in FAST_CODEGEN]
    if FAST_COMPILE not in words:
        words.append(FAST_COMPILE)
    if os.environ.get(USER_CODEGEN_VAR) != "1":
        words.extend(FAST_CODEGEN)
    return " ".join(words)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The runner's environment without job variables, with the package importable and CPU JAX."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_VARS)}
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p),
               TF_CPP_MIN_LOG_LEVEL="3")
    env.update(extra)
    return env


def python(*args: str) -> list[str]:
    """``python ARGS`` for a job: a Python forked from one that imported JAX, Keras and mirrorax already
    (``zygote.py``: ~8 s of CPU less per process, the same behaviour), for environments from ``clean_env``."""
    return [zygote.python_path(clean_env()), *args]


def run_all(commands: list[list[str]], envs: list[dict[str, str]], timeout: float
            ) -> tuple[list[int], list[str], list[float]]:
    """Starts every command at once; returns exit codes, outputs and exit times (s after start).

    A process still running at ``timeout`` is killed and reported with exit code -999.
    """
    start = time.monotonic()
    procs = [subprocess.Popen(c, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for c, e in zip(commands, envs)]
    codes, outs, times = [0] * len(procs), [""] * len(procs), [0.0] * len(procs)

    def wait(i: int) -> None:
        try:
            outs[i], _ = procs[i].communicate(timeout=timeout)
            codes[i] = procs[i].returncode
        except subprocess.TimeoutExpired:
            os.killpg(procs[i].pid, 9)
            outs[i], _ = procs[i].communicate()
            codes[i] = -999
        times[i] = time.monotonic() - start

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes, outs, times


def launcher(*args: str) -> list[str]:
    """``python -m mirrorax.cluster.launch ARGS``."""
    return python("-m", "mirrorax.cluster.launch", *args)


def listeners(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on ``port`` on this host (from /proc/net/tcp*,
    so no tool is needed), e.g. ``["127.0.0.1", "::ffff:127.0.0.1"]``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            hex_address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            # Each 32-bit word of the address is printed in host (little-endian) byte order.
            raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
            address = ipaddress.ip_address(raw)
            mapped = getattr(address, "ipv4_mapped", None)
            found.append(f"::ffff:{mapped}" if mapped else str(address))
    return found
