"""An epoch's batches on the devices: grouped for several steps per dispatch, placed ahead on a
background thread while the current step runs (or synchronously)."""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mirrorax.inputs.batch import Batch, stack
from mirrorax.inputs.placement import to_global

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["Prefetcher", "device_batches", "one_by_one"]


class Prefetcher:
    """Places the next batches on the devices on a background thread while the current step runs.

    Args:
      batches: ``(k, batch)`` pairs: ``k == 0`` for one step's batch, ``k > 0`` for ``k`` stacked steps.
      strategy: where they go. depth: batches placed ahead.
    """

    _END = object()

    def __init__(self, batches: Iterator[tuple[Any, Batch]], mesh: BatchMesh, depth: int = 2) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, mesh), daemon=True,
                                        name="mirrorax-prefetch")
        self._thread.start()

    def _run(self, batches: Iterator[tuple[Any, Batch]], mesh: BatchMesh) -> None:
        try:
            for tag, b in batches:
                if not self._put((tag, to_global(b, mesh, stacked=tag > 0))):
                    return
            self._put(self._END)
        except BaseException as e:  # re-raised on the consuming thread
            self._put(e)

    def _put(self, item: Any) -> bool:
        """Queues ``item`` unless the consumer closed first (then returns False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        return self

    def __next__(self) -> tuple[int, Batch]:
        item = self._queue.get()
        if item is self._END:
            self._queue.put(item)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def device_batches(host: Iterator[Batch], group: int | Callable[[int], int], mesh: BatchMesh, *, prefetch: int,
                   per_process: bool, host_rows: bool = False) -> Iterator[tuple[int, Batch]] | Prefetcher:
    """``host``'s batches on the devices as ``(k, batch)`` pairs: ``k == 0`` for one step's batch,
    ``k == group`` for ``group`` batches stacked for one dispatch (``steps_per_execution``; the tail
    that does not fill a group goes one by one). ``group`` may be a function of the batch index a group
    starts at (``steps_per_execution="auto"``, :mod:`mirrorax.fit.auto_steps`).

    Placed ``prefetch`` ahead on a background thread (:class:`Prefetcher`), or synchronously when
    ``prefetch == 0``, or for per-process pipelines of a multi-process job: they agree on "more data?"
    with a collective each step, which must stay on the thread that dispatches the steps. ``host_rows``
    (synchronous only; :func:`mirrorax.inputs.placement.host_rows` says where): one step's rows stay the host's
    arrays, for the step's dispatch to transfer.
    """
    place = one_by_one(group, mesh, prefetch=prefetch, per_process=per_process, host_rows=host_rows)
    if place is not None:
        return ((0, place(b)) for b in host)

    def grouped() -> Iterator[tuple[int, Batch]]:
        if group == 1:  # (placed ahead on a thread)
            for b in host:
                yield 0, b
            return
        index = 0
        while True:
            size = group(index) if callable(group) else group
            chunk = list(itertools.islice(host, size))
            index += len(chunk)
            if len(chunk) == size > 1:
                yield size, stack(chunk)
            else:
                for b in chunk:
                    yield 0, b
                if len(chunk) < size:
                    return

    if _synchronous(mesh, prefetch, per_process):
        return ((k, to_global(b, mesh, stacked=k > 0, host=host_rows)) for k, b in grouped())
    return Prefetcher(grouped(), mesh, depth=prefetch)


def one_by_one(group: int | Callable[[int], int], mesh: BatchMesh, *, prefetch: int, per_process: bool,
               host_rows: bool = False) -> Callable[[Batch], Batch] | None:
    """How :func:`device_batches` places each batch when it places them one step a dispatch on the loop's own
    thread (``group == 1``, synchronous): ``place(batch)`` gives the batch on the devices (or, with
    ``host_rows``, the host's rows for the dispatch to transfer); ``None`` where batches are stacked or placed
    ahead on a thread. (One generator around ``place`` is the whole pipeline then: what fit's figures time the
    reads and the placing in, :meth:`mirrorax.fit.meter.EpochMeter.one_by_one`.)"""
    if group != 1 or not _synchronous(mesh, prefetch, per_process):
        return None
    return functools.partial(to_global, mesh=mesh, host=host_rows)


def _synchronous(mesh: BatchMesh, prefetch: int, per_process: bool) -> bool:
    """Whether batches are placed on the loop's thread: no prefetch, or per-process pipelines of a multi-process
    job (they agree on "more data?" with a collective each step, which must stay on the dispatching thread)."""
    return prefetch == 0 or (per_process and mesh.process_count > 1)
