"""Prefetch: batches placed on the devices on a background thread while the current step runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mirrorax.inputs.batch import Batch
from mirrorax.inputs.placement import to_global

if TYPE_CHECKING:
    from mirrorax.strategy import MirroredStrategy

__all__ = ["Prefetcher"]


class Prefetcher:
    """Places the next batches on the devices on a background thread while the current step runs.

    Args:
      batches: ``(k, batch)`` pairs: ``k == 0`` for one step's batch, ``k > 0`` for ``k`` stacked steps.
      strategy: where they go. depth: batches placed ahead.
    """

    _END = object()

    def __init__(self, batches: Iterator[tuple[Any, Batch]], strategy: MirroredStrategy, depth: int = 2) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, strategy), daemon=True,
                                        name="mirrorax-prefetch")
        self._thread.start()

    def _run(self, batches: Iterator[tuple[Any, Batch]], strategy: MirroredStrategy) -> None:
        try:
            for tag, b in batches:
                if not self._put((tag, to_global(b, strategy, stacked=tag > 0))):
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
