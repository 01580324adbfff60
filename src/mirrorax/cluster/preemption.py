"""Preemption: SIGTERM stops ``fit`` at a step boundary every process agrees on, with a checkpoint.

Schedulers (SLURM preemption, Kubernetes eviction, cloud maintenance) send SIGTERM, then SIGKILL after
a grace period. During ``fit``, a :class:`Watch` turns that SIGTERM into a stop at the next step
boundary; the trainer then saves a checkpoint (with ``checkpoint_dir``) and raises :class:`Preempted`,
a ``SystemExit`` with status :data:`PREEMPTED_EXIT_CODE`, which schedulers and ``mirrorax launch``
treat as "requeue".

How the processes agree on the step:

* One process, no ``jax.distributed``: a Python SIGTERM handler sets a flag, read once per dispatched
  step (a Python attribute read; no device sync). The handler is installed for the duration of
  ``fit`` (main thread only), from its first line (a SIGTERM while the model is built or compiled
  stops at the first step), and the previous one restored after the checkpoint is written (a second
  SIGTERM during the save changes nothing). Ctrl-C (SIGINT, when Python's default handler is in
  place) is handled the same way and said as an interruption: ``fit`` saves (with
  ``checkpoint_dir``) and raises ``KeyboardInterrupt``; a second Ctrl-C interrupts at once.
* ``jax.distributed`` initialised: JAX's preemption notifier took SIGTERM at initialisation (its C++
  handler; a Python handler would replace it, so none is installed). The notice reaches every
  process through the coordination service, which computes a sync point (the largest step counter
  reported, plus one); ``multihost_utils.reached_preemption_sync_point(counter)`` is ``True`` on every
  process at that same counter. The call is a mutex and a comparison in C++ (no RPC per step), so
  it is made once per dispatch. The counter is this module's own, one per dispatch in this process,
  so it is the same on every process (SPMD: every process dispatches the same steps) and it
  increases by exactly one per call, as the protocol needs.
* ``jax.distributed`` initialised with the preemption service disabled
  (``jax_enable_preemption_service=False``): nothing can agree on a step, so nothing is installed and
  SIGTERM keeps its default effect (the process ends at once); a warning says so.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import warnings
from types import FrameType
from typing import Any

#: The exit status of a process that stopped because it was asked to (SIGTERM: preemption, eviction,
#: ``scancel``), after saving what it needs to resume: "preempted, requeue me". 128 + SIGTERM, the status
#: a shell reports for a process that SIGTERM ended. ``mirrorax launch`` returns it when every process
#: did, and restarts the group on it under ``--max-restarts``. (This module is the ground floor that
#: ``launch`` and ``cluster`` both read it from: it imports no JAX at import time.)
PREEMPTED_EXIT_CODE = 143

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "Watch", "announce"]


# One call of reached_preemption_sync_point per dispatch, numbered across every fit of this process.
_dispatch_counter = itertools.count(1)
_last_counter = 0


class Preempted(SystemExit):
    """``fit`` stopped on SIGTERM; raised on every process at the same step.

    A ``SystemExit``: a script that does not catch it exits with status :data:`PREEMPTED_EXIT_CODE`
    (143) without a traceback, and mirrorax's multi-process failure hook does not treat it as a crash.
    Rerun the same command to resume from the checkpoint written at ``step``.

    Attributes:
      code: :data:`PREEMPTED_EXIT_CODE` (the exit status).
      step: the optimizer step at which training stopped.
      checkpoint_dir: where the checkpoint of ``step`` was written (``None`` without one: the work
        since the start of ``fit`` is lost).

    Example:
      >>> try:
      ...     trainer.fit(x, y, epochs=10, checkpoint_dir="runs/a")
      ... except mx.Preempted as stop:
      ...     print(stop.step)  # rerunning resumes from here
      ...     raise
    """

    def __init__(self, message: str, *, step: int, checkpoint_dir: str | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message
        self.step = step
        self.checkpoint_dir = checkpoint_dir

    def __str__(self) -> str:
        return self.message


class Watch:
    """Listens for SIGTERM during one ``fit``; :meth:`reached` says when every process should stop.

    :meth:`start` it (or use it as a context manager) around the fit, :meth:`close` it after; call
    :meth:`reached` once per dispatched step (and at each epoch end), in the same order on every
    process.

    Args:
      process_count: the job's process count (only used to choose the mechanism).
    """

    def __init__(self, process_count: int = 1) -> None:
        self.mode = "off"
        self.received = False
        self.interrupted = False  # the stop was asked by Ctrl-C (SIGINT), not SIGTERM
        self._previous: Any = None
        self._previous_int: Any = None
        self._process_count = process_count

    # -- installation --------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        return self.start()

    def start(self) -> Watch:
        """Chooses the mechanism (see the module docstring) and installs the handler if it is ours."""
        import jax

        if jax.distributed.is_initialized() and _jax_sync_point_available():
            self.mode = "jax"
        elif jax.distributed.is_initialized() and self._process_count > 1:
            if jax.process_index() == 0:
                warnings.warn(
                    "JAX's preemption service is disabled (jax_enable_preemption_service=False), so the "
                    "processes of this job cannot agree on a step at which to stop on SIGTERM: SIGTERM "
                    "ends a process at once, losing the work since the last checkpoint. Leave "
                    "jax_enable_preemption_service at its default (True) to checkpoint on SIGTERM.",
                    RuntimeWarning, stacklevel=4)
        elif threading.current_thread() is threading.main_thread():
            # signal.signal works in the main thread only; elsewhere SIGTERM keeps its effect.
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # the user's own stays
                self._previous_int = signal.signal(signal.SIGINT, self._on_sigint)
            self.mode = "signal"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Restores the SIGTERM handler that was there before (safe to call twice)."""
        if self.mode == "signal":
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            if self._previous_int is not None and signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, self._previous_int)
            self._previous_int = None
            self.mode = "off"

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the loop acts on it at the next step boundary, outside the handler. Kept until
        # close(), after the checkpoint is written: a second SIGTERM during the save changes nothing.
        self.received = True

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        # Ctrl-C: stop at the next step boundary with a checkpoint (as a preemption), said as an
        # interruption; a second Ctrl-C interrupts at once, as Python does.
        self.received = self.interrupted = True
        if self._previous_int is not None:
            signal.signal(signal.SIGINT, self._previous_int)
        try:  # os.write: safe in a handler (print may re-enter a buffered stream)
            os.write(2, b"\nmirrorax: Ctrl-C: stopping after this step (with a checkpoint if fit has a "
                        b"checkpoint_dir); press Ctrl-C again to interrupt at once.\n")
        except OSError:
            pass

    # -- per step ------------------------------------------------------------------------------
    def reached(self) -> bool:
        """``True`` at the step boundary where this process (and every other one) must stop.

        Cost: a Python attribute read (one process), or one C++ call that takes a mutex (JAX's sync
        point; measured 3 to 5 microseconds in a 2-process job); never a device sync or a network round trip.
        """
        if self.mode == "signal":
            return self.received
        if self.mode == "jax":
            global _last_counter
            _last_counter = next(_dispatch_counter)
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(_last_counter):
                self.received = True
            return self.received
        return False


def _jax_sync_point_available() -> bool:
    """Whether JAX's preemption sync manager exists (public API; it raises ``RuntimeError`` if not).

    Calling it again with the last counter passed changes nothing in the protocol's state.
    """
    from jax.experimental import multihost_utils

    try:
        multihost_utils.reached_preemption_sync_point(_last_counter)
    except RuntimeError:
        return False
    return True


def announce(message: str, primary: bool) -> None:
    """Writes ``message`` as one line on stderr, from process 0 only (the others reach the same
    conclusion at the same step). Written to the stream, not ``print``ed: a Ray Train worker's ``print``
    also goes to Ray's logger, and its driver would show the line twice."""
    if primary:
        sys.stdout.flush()
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()
