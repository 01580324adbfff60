"""Where an iterable input stands within an epoch, so that a resumed epoch continues it there.

For an input that can save its own position, a checkpoint's ``meta["input_state"]`` holds that position,
so a resumed epoch continues the input where it stopped instead of reading and dropping the batches
already trained on: grain's iterators (``get_state()`` / ``set_state()``), and torchdata's
``StatefulDataLoader`` (``state_dict()`` / ``load_state_dict()``). Any other deterministic iterable is
replayed. Array inputs need none of this: their position is an index (``ArraySource``).
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Iterator
from typing import Any

__all__ = ["InputState"]


class InputState:
    """Stands in for a re-iterable input and records the input's own position before each batch.

    Each ``iter()`` starts an epoch's iteration. Before each batch it records the input's state (grain:
    the iterator's ``get_state()``; torchdata: the loader's ``state_dict()``), so that a checkpoint
    taken after ``b`` batches of the epoch stores the position "after ``b`` batches" even though the
    loop has already read ahead. :meth:`position` makes the next iteration start at a batch: from a
    saved state when the input can take it (no record is read twice), else by reading and dropping
    the batches before it (the replay that works for any deterministic iterable).

    Args:
      iterable: the user's input (a grain ``DataLoader``, a ``StatefulDataLoader``, ...).
    """

    KEEP = 256  # states kept behind the newest read: more than any read-ahead (prefetch, steps per dispatch)

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable
        self.restored = False  # whether the last positioned iteration took the input's own state
        self._pending: tuple[int, dict[str, Any] | None] | None = None
        self._states: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.iterable)

    def position(self, batch: int, saved: dict[str, Any] | None) -> None:
        """The next iteration starts at batch ``batch`` of the epoch, from ``saved`` (a
        ``meta["input_state"]``) if given and usable."""
        self._pending = (batch, saved)

    def __iter__(self) -> Iterator[Any]:
        start, saved = self._pending or (0, None)
        self._pending = None
        self.restored = False
        if saved is not None and saved.get("kind") == "torchdata" and _loader_state(self.iterable):
            self.iterable.load_state_dict(_decode(saved))
            self.restored = True
        it = iter(self.iterable)
        if saved is not None and saved.get("kind") == "grain" and _iterator_state(it):
            it.set_state(_decode(saved))
            self.restored = True
        return self._read(it, start)

    def _read(self, it: Iterator[Any], start: int) -> Iterator[Any]:
        kind = "grain" if _iterator_state(it) else "torchdata" if _loader_state(self.iterable) else None
        self._states.clear()
        if not self.restored:
            for _ in range(start):  # replay: read and drop what the checkpoint already trained on
                if next(it, _END) is _END:
                    return
        index = start
        while True:
            if kind:
                self._states[index] = self._capture(it, kind)
                self._states.pop(index - self.KEEP, None)
            item = next(it, _END)
            if item is _END:
                return
            yield item
            index += 1

    def _capture(self, it: Any, kind: str) -> dict[str, Any]:  # a grain iterator has get_state()
        raw = it.get_state() if kind == "grain" else self.iterable.state_dict()
        return _encode(kind, raw)

    def state_at(self, batch: int) -> dict[str, Any] | None:
        """The input's state after ``batch`` batches of the current epoch (``None``: not recorded)."""
        return self._states.get(batch)


_END = object()


def _iterator_state(it: Any) -> bool:
    return callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))


def _loader_state(loader: Any) -> bool:
    # torchdata's StatefulDataLoader keeps the position on the loader, not on its iterators.
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _encode(kind: str, raw: Any) -> dict[str, Any]:
    """A JSON form of an input's state: grain's bytes are JSON text; a ``state_dict`` that JSON
    cannot carry exactly (tensors, int keys) is pickled."""
    if isinstance(raw, bytes):
        try:
            return {"kind": kind, "encoding": "utf-8", "value": raw.decode("utf-8")}
        except UnicodeDecodeError:
            return {"kind": kind, "encoding": "base64", "value": base64.b64encode(raw).decode("ascii")}
    try:
        if json.loads(json.dumps(raw)) == raw:
            return {"kind": kind, "encoding": "json", "value": raw}
    except (TypeError, ValueError):
        pass
    return {"kind": kind, "encoding": "pickle", "value": base64.b64encode(pickle.dumps(raw)).decode("ascii")}


def _decode(saved: dict[str, Any]) -> Any:
    encoding, value = saved["encoding"], saved["value"]
    if encoding == "utf-8":
        return value.encode("utf-8")
    if encoding == "base64":
        return base64.b64decode(value)
    if encoding == "pickle":
        return pickle.loads(base64.b64decode(value))  # noqa: S301 - written by this run's own checkpoint
    return value
