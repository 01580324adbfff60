"""Work-arounds for orbax-checkpoint 0.12's behaviour after a failed restore (see each docstring)."""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["dropping_orbax_read_errors_of_abandoned_reads", "drain_abandoned_reads"]

_ABANDONED_READ = "_read_array_index_and_device_put"  # orbax/_src/serialization/serialization.py


@contextlib.contextmanager
def dropping_orbax_read_errors_of_abandoned_reads() -> Iterator[None]:
    """Keeps the echoes of one failed array read from leaking out as "Exception ignored in".

    When one array of a restore fails, Orbax (0.12.8) closes its event loop while the reads of the
    other arrays are still pending. Two echoes follow, which Python can only report through
    ``sys.unraisablehook`` (and pytest turns into errors): TensorStore, finishing a read, calls
    ``call_soon_threadsafe`` on the closed loop (``RuntimeError: Event loop is closed``); then the
    orphaned coroutine is garbage-collected, and its ``except BaseException`` turns ``GeneratorExit``
    into ``Exception("Encountered error while reading array index ...")``. The restore call has
    already reported the failure, so inside this scope both echoes are dropped (which also releases
    what they reference, so the orphans can be collected); any other unraisable exception goes to the
    previous hook. The caller drains the orphans (:func:`drain_abandoned_reads`) before the scope
    ends.
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        orphan_closed = isinstance(getattr(exc, "__cause__", None), GeneratorExit) and str(
            exc
        ).startswith("Encountered error while reading array index")
        loop_closed = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        if not (orphan_closed or loop_closed):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def drain_abandoned_reads(timeout_s: float = 5.0) -> None:
    """Collects Orbax's orphaned read coroutines after a failed restore (at most ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        pending = any(
            inspect.iscoroutine(obj) and obj.cr_code.co_name == _ABANDONED_READ
            for obj in gc.get_objects()
        )
        if not pending or time.monotonic() > deadline:
            return
        time.sleep(0.01)
