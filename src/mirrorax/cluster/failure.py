"""When one process of a job fails, every other one stops soon, and says which process failed.

Two ways a process fails, two mechanisms, both on JAX's coordination service:

* It dies (killed, segfault, out of memory): it stops sending heartbeats, and after
  ``heartbeat_timeout_seconds`` the service aborts every other process with "The following tasks are
  unhealthy (stopped sending heartbeats): <ids>".
* It raises: Python would print the traceback and then wait at JAX's exit barrier for peers that are
  themselves blocked in a collective waiting for it, a deadlock that lasts ``shutdown_timeout``. Instead
  our ``sys.excepthook`` prints the traceback, records ``"<id>|<error>"`` under a key of the service's
  key-value store, and leaves at once (``os._exit(1)``). A watcher thread in every process polls that
  key each second and leaves the same way, naming the failed process.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import types
from typing import Any

import mirrorax.cluster.output as _output
import mirrorax.cluster.watchdog as _watchdog

__all__ = ["install", "uninstall", "die", "FAILURE_KEY", "POLL_SECONDS"]

FAILURE_KEY = "mirrorax/failure"
POLL_SECONDS = 1.0

_state: dict[str, Any] = {}


def die(message: str, code: int = 1) -> None:
    """Prints ``message`` to stderr and ends the process now, without exit handlers (they would wait
    for peers that will never come)."""
    try:
        sys.stdout.flush()
        print(message, file=sys.stderr, flush=True)
        _output.restore()  # what this process printed last is still in the filter's pipe
    finally:
        os._exit(code)


def install(client: Any, process_id: int, num_processes: int) -> None:
    """Arms the excepthook and the watcher for a job of ``num_processes`` (no-op for one process).

    Args:
      client: ``jax.distributed.global_state.client`` (a connected ``DistributedRuntimeClient``).
      process_id: this process's index.
      num_processes: the job's process count.
    """
    if num_processes <= 1 or _state:
        return
    stop = threading.Event()
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        previous(kind, value, tb)
        summary = f"{kind.__name__}: {value}".splitlines()[0][:300] if str(value) else kind.__name__
        leave(summary, 1)

    def leave(summary: str, code: int) -> None:
        stop.set()
        first = _publish(client, f"{process_id}|{summary}")
        cause = ""
        if first is not None and not first.startswith(f"{process_id}|"):
            other, _, why = first.partition("|")
            cause = f" This follows the failure of process {other} ({why})."
        if process_id == 0:
            # Process 0 hosts the service: stay a moment so that the others can read the key.
            threading.Event().wait(POLL_SECONDS * 1.5)
        die(f"mirrorax: process {process_id} of {num_processes} failed with {summary}; leaving now so "
            f"that the other processes stop too.{cause}", code)

    def watch() -> None:
        while not stop.wait(POLL_SECONDS):
            try:
                value = client.key_value_try_get(FAILURE_KEY)
            except Exception:  # noqa: BLE001 - NOT_FOUND until a process fails; service gone at exit
                continue
            other, _, why = value.partition("|")
            if other != str(process_id) and not stop.is_set():
                die(f"mirrorax: process {other} of {num_processes} failed ({why}); process {process_id} "
                    "stops too.")

    watcher = threading.Thread(target=watch, name="mirrorax-failure-watch", daemon=True)
    sys.excepthook = excepthook
    _state.update(stop=stop, previous=previous, hook=excepthook, watcher=watcher, leave=leave)
    watcher.start()
    # Runs before JAX's own exit handler (registered earlier), which shuts the client down.
    atexit.register(_at_exit)


def uninstall() -> None:
    """Disarms both mechanisms (at exit, and in tests)."""
    _stop_watcher()
    if _state and sys.excepthook is _state["hook"]:
        sys.excepthook = _state["previous"]
    _state.clear()


def _at_exit() -> None:
    """At exit: a process leaving by ``sys.exit`` from inside the training loop, while its peers wait
    for it in a step, tells them and leaves at once with its status (JAX's exit barrier would wait for
    them for ``shutdown_timeout``, and they for it until the heartbeat timeout)."""
    code = _watchdog.exit_code_mid_training()
    if code is not None and _state:
        status = code if isinstance(code, int) else 1
        _state["leave"](f"SystemExit({code!r}) inside the training loop (exit status {status})", status)
    _stop_watcher()


def _stop_watcher() -> None:
    if _state:
        _state["stop"].set()
        _state["watcher"].join(timeout=2 * POLL_SECONDS)


def _publish(client: Any, value: str) -> str | None:
    """Records this failure unless one is recorded already; returns the first one recorded (bounded:
    the service may be gone with a dead process 0)."""
    result: list[str | None] = [None]

    def run() -> None:
        try:
            client.key_value_set(FAILURE_KEY, value)
            result[0] = value
        except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process failed first
            try:
                result[0] = client.key_value_try_get(FAILURE_KEY)
            except Exception:  # noqa: BLE001
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=3.0)
    return result[0]
