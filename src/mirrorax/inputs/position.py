"""Where an iterable input stands within an epoch, so that a resumed epoch continues it there.

For an input that can save its own position, a checkpoint's ``meta["input_state"]`` holds that position,
so a resumed epoch continues the input where it stopped instead of reading and dropping the batches
already trained on: grain's iterators (``get_state()`` / ``set_state()``), and torchdata's
``StatefulDataLoader`` (``state_dict()`` / ``load_state_dict()``). Any other deterministic iterable is
replayed. Array inputs need none of this: their position is an index (``ArraySource``).
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["ALLOW_PICKLE_ENV", "InputState", "UnsafeInputState", "check_loadable"]


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

    def __init__(self, iterable: Any, opened: tuple[Iterator[Any], Any] | None = None) -> None:
        self.iterable = iterable
        self.restored = False  # whether the last positioned iteration took the input's own state
        self._pending: tuple[int, dict[str, Any] | None] | None = None
        self._states: dict[int, dict[str, Any] | None] = {}
        # An iteration begun before tracking (the source's look at the first batch): its iterator and the
        # item it read. The first epoch from batch 0 continues it; a positioned one (a resume) drops it.
        self._opened = opened

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
        opened, self._opened = self._opened, None
        if opened is not None and start == 0 and saved is None:
            return self._read(opened[0], 0, first=opened[1])
        if saved is not None and saved.get("kind") == "torchdata" and _loader_state(self.iterable):
            self.iterable.load_state_dict(_decode(saved))
            self.restored = True
        it = iter(self.iterable)
        if saved is not None and saved.get("kind") == "grain" and _iterator_state(it):
            it.set_state(_decode(saved))
            self.restored = True
        return self._read(it, start)

    def _read(self, it: Iterator[Any], start: int, first: Any = None) -> Iterator[Any]:
        """``it``'s items from batch ``start``; ``first``: an item already read from ``it`` (the state before
        it is not known: a checkpoint there replays)."""
        kind = "grain" if _iterator_state(it) else "torchdata" if _loader_state(self.iterable) else None
        self._states.clear()
        if not self.restored:
            for _ in range(start):  # replay: read and drop what the checkpoint already trained on
                if next(it, _END) is _END:
                    return
        index = start
        held = _END if first is None else first
        while True:
            if held is not _END:
                item, held = held, _END
            else:
                if kind:
                    self._states[index] = self._capture(it, kind)
                    self._states.pop(index - self.KEEP, None)
                item = next(it, _END)
            if item is _END:
                return
            yield item
            index += 1

    def _capture(self, it: Any, kind: str) -> dict[str, Any] | None:  # a grain iterator has get_state()
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


# The opt-in that lets a checkpoint written by mirrorax <= 0.x (which pickled some input states) resume
# with that state. Unpickling runs code chosen by whoever wrote the file, so it is never the default.
ALLOW_PICKLE_ENV = "MIRRORAX_UNPICKLE_INPUT_STATE"
_TAG = "__mirrorax__"  # marks a typed value in the "typed-json" encoding
_ARRAY_KINDS = "biufc"  # numpy dtype kinds an array may have: bool, ints, floats, complex


class UnsafeInputState(ValueError):
    """A saved input state that could only be read by unpickling it (written by an older mirrorax)."""


def _encode(kind: str, raw: Any) -> dict[str, Any] | None:
    """A JSON form of an input's state, or ``None`` when it holds a value JSON cannot carry.

    grain's bytes are JSON text. A ``state_dict`` that plain JSON cannot carry exactly (int keys,
    tuples, bytes, numpy arrays, torch tensors) is stored as "typed-json": the same JSON with those
    values tagged, rebuilt by :func:`_decode` without running any code from the checkpoint. Any other
    value (an arbitrary object) is not saved: the resumed epoch replays the input instead.
    """
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
    try:
        value = _to_typed(raw)
    except TypeError:
        return None
    return {"kind": kind, "encoding": "typed-json", "value": value}


def _to_typed(x: Any) -> Any:
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and _TAG not in x:
            return {k: _to_typed(v) for k, v in x.items()}
        return {_TAG: "dict", "items": [[_to_typed(k), _to_typed(v)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        items = [_to_typed(v) for v in x]
        return items if type(x) is list else {_TAG: "tuple", "items": items}
    if isinstance(x, bytes):
        return {_TAG: "bytes", "value": base64.b64encode(x).decode("ascii")}
    torch = sys.modules.get("torch")
    is_tensor = torch is not None and isinstance(x, torch.Tensor)
    if is_tensor or isinstance(x, (np.ndarray, np.generic)):
        a = np.asarray(x.detach().cpu().numpy() if is_tensor else x)
        if a.dtype.kind not in _ARRAY_KINDS:
            raise TypeError(f"an array of dtype {a.dtype}")
        a = a if a.flags.c_contiguous else a.copy()  # (ascontiguousarray makes a scalar 1-d)
        return {_TAG: "torch" if is_tensor else "scalar" if isinstance(x, np.generic) else "ndarray",
                "dtype": a.dtype.str, "shape": list(a.shape), "value": base64.b64encode(a.tobytes()).decode("ascii")}
    raise TypeError(f"a value of type {type(x).__name__}")


def _from_typed(x: Any) -> Any:
    if isinstance(x, list):
        return [_from_typed(v) for v in x]
    if not isinstance(x, dict):
        return x
    tag = x.get(_TAG)
    if tag is None:
        return {k: _from_typed(v) for k, v in x.items()}
    if tag == "dict":
        return {_from_typed(k): _from_typed(v) for k, v in x["items"]}
    if tag == "tuple":
        return tuple(_from_typed(v) for v in x["items"])
    if tag == "bytes":
        return base64.b64decode(x["value"])
    if tag in ("ndarray", "scalar", "torch"):
        dtype = np.dtype(x["dtype"])
        if dtype.kind not in _ARRAY_KINDS:
            raise ValueError(f"a saved input state holds an array of dtype {dtype}, which mirrorax never writes")
        a = np.frombuffer(base64.b64decode(x["value"]), dtype).reshape(x["shape"]).copy()
        if tag == "scalar":
            return a[()]
        if tag == "torch":
            torch = importlib.import_module("torch")  # the input asking for this state is a torch loader
            return torch.from_numpy(a)
        return a
    raise ValueError(f"a saved input state holds a value tagged {tag!r}, which this mirrorax does not know")


def check_loadable(saved: dict[str, Any]) -> None:
    """Raises :class:`UnsafeInputState` for a state that only unpickling could read, unless the user
    opted in (``MIRRORAX_UNPICKLE_INPUT_STATE=1``)."""
    if saved.get("encoding") == "pickle" and os.environ.get(ALLOW_PICKLE_ENV, "") != "1":
        raise UnsafeInputState(
            "its input state is pickled (written by an older mirrorax), and unpickling a file runs code "
            "chosen by whoever wrote it, so mirrorax does not load it. If you wrote this checkpoint "
            f"yourself and trust the directory, set {ALLOW_PICKLE_ENV}=1 to load it once (the next "
            "checkpoints are stored as JSON); otherwise resume from a checkpoint saved at an epoch's end, "
            "or start fresh in a new checkpoint_dir"
        )


def _decode(saved: dict[str, Any]) -> Any:
    encoding, value = saved["encoding"], saved["value"]
    if encoding == "utf-8":
        return value.encode("utf-8")
    if encoding == "base64":
        return base64.b64decode(value)
    if encoding == "typed-json":
        return _from_typed(value)
    if encoding == "pickle":
        check_loadable(saved)
        return pickle.loads(base64.b64decode(value))  # noqa: S301 - the user opted in, by name
    if encoding == "json":
        return value
    raise ValueError(f"a saved input state has encoding {encoding!r}; this mirrorax reads "
                     "'json', 'typed-json', 'utf-8' and 'base64'")
