"""Work-arounds for orbax-checkpoint 0.12's behaviour after a failed restore or save (see each docstring)."""

from __future__ import annotations

import ast
import atexit
import contextlib
import gc
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from mirrorax.cluster.failure import die

__all__ = [
    "QuietSaveErrors",
    "before_executors_shut_down",
    "close_at_exit",
    "forget_at_exit",
    "close_abandoned_writes",
    "dropping_orbax_read_errors_of_abandoned_reads",
    "drain_abandoned_reads",
    "stop_tensorstore_metric_leak",
    "stop_tensorstore_spec_leak",
]

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


class QuietSaveErrors:
    """Keeps a failed background save (disk full) from printing hundreds of lines around its error.

    When a file write of an asynchronous save fails, Orbax 0.12 logs the error with its traceback from
    each of its background threads (``ERROR:absl:... _SignalingThread.run() raised an exception``, three
    or more tracebacks), and TensorStore's callbacks then hit the closed event loop (``RuntimeError:
    Event loop is closed``, one traceback per pending write, through ``sys.unraisablehook``): 400 to 700
    lines for one full disk. The same error reaches the caller once, through ``wait_until_finished``,
    and the checkpointer says it in one line. Between :meth:`start` (a save begins) and :meth:`stop`
    (it was waited for), Orbax's error records are held back and the closed-loop echoes dropped;
    :meth:`stop` gives the held records to the log again when the save did not fail (nothing is lost).
    After a failed save, its echoes are dropped until Orbax's threads are closed (:meth:`end`): one of
    them may log the error once more after the wait (seen 1 time in 5 on a full disk).
    """

    def __init__(self) -> None:
        self._held: list[logging.LogRecord] = []
        self._previous_hook: Any = None
        self._active = False  # installed: holding (a save in flight) or dropping (a failed save's echoes)
        self._dropping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
            if not self._dropping:
                self._held.append(record)
            return False
        return True

    def _hook(self, unraisable: Any) -> None:
        exc = unraisable.exc_value
        if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
            self._previous_hook(unraisable)

    def start(self) -> None:
        """A save begins: Orbax's error records are held from now on."""
        self._dropping = False
        if self._active:
            return
        self._active = True
        logging.getLogger("absl").addFilter(self)
        self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._hook

    def stop(self, failed: bool) -> None:
        """The save was waited for. ``failed``: its error was reported, so the held records are dropped, and so
        are its later echoes (Orbax's threads may still log it after the wait) until :meth:`start` or
        :meth:`end`; else the held records go to the log again and nothing is held any more."""
        if not self._active:
            return
        held, self._held = self._held, []
        if failed:
            self._dropping = True
            return
        self._uninstall()
        for record in held:
            logging.getLogger(record.name).handle(record)

    def end(self) -> None:
        """Orbax's threads are closed: nothing more is held or dropped."""
        self._held = []
        self._dropping = False
        self._uninstall()

    def _uninstall(self) -> None:
        if not self._active:
            return
        self._active = False
        logging.getLogger("absl").removeFilter(self)
        if sys.unraisablehook == self._hook:
            sys.unraisablehook = self._previous_hook


_ABANDONED_WRITE = "write_fragment"  # orbax/_src/serialization/serialization.py, async_serialize_from_host


def close_abandoned_writes() -> None:
    """Closes the array writes a failed save left suspended (call once that save was waited for).

    After a write fails, Orbax 0.12.8 leaves the other writes' coroutines suspended, referenced, never
    resumed: they are finalised only when the interpreter exits, where their cleanup (which imports
    a module) fails with one "Exception ignored ... Python is likely shutting down" traceback each.
    Closed now, their cleanup runs while the interpreter can still run it, and the memory they hold
    is released.
    """
    for obj in gc.get_objects():
        if inspect.iscoroutine(obj) and obj.cr_code.co_name == _ABANDONED_WRITE and obj.cr_frame is not None \
                and not obj.cr_running:
            try:
                obj.close()
            except Exception:  # noqa: BLE001, S110 - the save already failed and was reported
                pass


def stop_tensorstore_metric_leak() -> None:
    """Stops Orbax from polling TensorStore's metrics, whose Python binding leaks at every call.

    ``tensorstore.experimental_collect_matching_metrics`` keeps about 7 KB of Python objects per call
    (measured: 14 MB over 2,000 calls, with the objects it returns long gone), and Orbax 0.12.8 calls
    it twice per save and twice per restore, only to log the raw bytes written or read (an INFO line
    and a ``jax.monitoring`` scalar). That is most of the creep seen over long runs (about 0.13 MB per
    save). With the poll answering 0, Orbax skips that telemetry (its code returns early when no raw
    bytes were counted); nothing it writes or reads changes. Done once, process-wide, by the first
    :class:`~mirrorax.checkpoint.checkpointer.Checkpointer`.
    """
    from orbax.checkpoint._src.serialization import tensorstore_utils

    if getattr(tensorstore_utils.get_tensorstore_raw_bytes, "__name__", "") != "_no_raw_bytes":
        def _no_raw_bytes(*args: Any, **kwargs: Any) -> int:
            return 0

        tensorstore_utils.get_tensorstore_raw_bytes = _no_raw_bytes


def stop_tensorstore_spec_leak() -> None:
    """Makes ``tensorstore.Spec.to_json()`` and ``tensorstore.KvStore.Spec.to_json()`` leak-free.

    TensorStore 0.1.86's conversion of a spec's JSON to Python objects keeps a reference to every
    nested dict and list it creates: about 2.8 KB per ``Spec.to_json()`` of an array (its zarr
    metadata) and 0.2 KB per ``KvStore.Spec.to_json()``, never freed. Orbax 0.12.8 calls the first once
    per array whenever it reads a checkpoint's metadata (``array_metadata_from_tensorstore``, for the
    best-effort zarr metadata of ``item_metadata``) and the second once per array per save, restore
    and metadata read (``_build_ocdbt_kvstore_tspec``): about 110 KB per ``fit`` that resumes and saves
    a small model, nearly all of the per-``fit`` creep. A spec's ``repr`` is the same JSON printed in
    C++ as a Python literal, without that conversion; read back with :func:`ast.literal_eval` it gives
    the very value ``to_json()`` returns (a repr that does not read back, and any call with arguments,
    goes to TensorStore's own method). Done once, process-wide, by the first
    :class:`~mirrorax.checkpoint.checkpointer.Checkpointer`.
    """
    import tensorstore

    for cls in (tensorstore.Spec, tensorstore.KvStore.Spec):
        if getattr(cls.to_json, "__name__", "") != "_to_json_without_leak":
            setattr(cls, "to_json", _without_leak(cls.to_json))  # noqa: B010 - a method of a C++ class


def _without_leak(original: Any) -> Any:
    def _to_json_without_leak(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:
            text = repr(self)
            start = text.find("(")
            if start > 0 and text.endswith(")"):
                try:
                    return ast.literal_eval(text[start + 1:-1])
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    pass  # e.g. a NaN printed as nan: TensorStore's own conversion
        return original(self, *args, **kwargs)

    _to_json_without_leak.__doc__ = original.__doc__
    return _to_json_without_leak


def before_executors_shut_down(hook: Any) -> None:
    """Runs ``hook()`` when the program ends, before Python stops its thread-pool executors.

    Orbax 0.12 finishes a save (writes, renames, re-lists the steps) on ``concurrent.futures`` executors.
    When the main thread ends, Python first runs the exit hooks of the threading module, among them
    ``concurrent.futures``', after which every executor refuses new work ("cannot schedule new futures
    after interpreter shutdown"), and only then ``atexit``'s: a save still being written there is lost
    (its ``<step>.orbax-checkpoint-tmp`` directory stays, the exit status 0). CPython's
    ``threading._register_atexit`` runs hooks at that first stage, newest first, so one registered after
    ``concurrent.futures`` was imported runs while the executors still work. ``atexit`` gets ``hook`` too
    (it must be idempotent): on an interpreter without that function, and for a process that exits by
    running ``atexit``'s hooks alone.
    """
    register = getattr(threading, "_register_atexit", None)
    if callable(register):
        import concurrent.futures.thread  # noqa: F401 - imported first, so that its hook runs after ours

        register(hook)
    atexit.register(hook)


#: The objects to close when the program ends (writing checkpointers not closed yet), by id.
_OPEN: dict[int, Any] = {}
_exit_hook_registered = False


def close_at_exit(closable: Any) -> None:
    """Closes ``closable`` (a writing checkpointer) when the program ends, if it is still open then, before
    Python stops the executors Orbax writes with (:func:`before_executors_shut_down`): a save started as a
    program's last act is finished, never left a temporary directory. A close that fails then (a full
    disk) is said in one line and the process exits with status 1."""
    global _exit_hook_registered
    _OPEN[id(closable)] = closable
    if not _exit_hook_registered:
        _exit_hook_registered = True
        before_executors_shut_down(_close_at_exit)


def forget_at_exit(closable: Any) -> None:
    """``closable`` was closed: nothing to do for it when the program ends."""
    _OPEN.pop(id(closable), None)


def _close_at_exit() -> None:
    failure: Exception | None = None
    while _OPEN:
        _, closable = _OPEN.popitem()
        try:
            closable.close()
        except Exception as exc:  # noqa: BLE001 - said below, once every one was closed
            failure = failure or exc
    if failure is not None:
        die(f"mirrorax: {type(failure).__name__}: {failure}", 1)
