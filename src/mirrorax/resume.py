"""What ``fit`` keeps in a checkpoint besides the state, and how it resumes from one.

``meta`` holds the data position (epoch, batch within the epoch: global batches, so it means the same
examples on any device count), the run's data settings, the history so far, and the shapes of one
input row (``sample_spec``) so that ``Trainer.load`` can rebuild a model's variables without data.

For an input that can save its own position, ``meta["input_state"]`` also holds that position, so a
resumed epoch continues the input where it stopped instead of reading and dropping the batches
already trained on (:class:`InputState`): grain's iterators (``get_state()`` / ``set_state()``), and
torchdata's ``StatefulDataLoader`` (``state_dict()`` / ``load_state_dict()``).
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from mirrorax.inputs.batch import Batch
from mirrorax.inputs.iterables import IterableSource
from mirrorax.step import host_value
from mirrorax.train_state import TrainState

__all__ = ["Saver", "Resumed", "InputState", "resume", "sample_spec", "sample_from_spec", "check_every"]

PyTree = Any


class Resumed(NamedTuple):
    """Where a resumed fit starts: the state, the data position, and the input's own saved state."""

    state: TrainState
    epoch: int
    batch_in_epoch: int
    step: int
    input_state: dict[str, Any] | None


def resume(ckpt: Any, abstract_state: Any, run: dict[str, Any], history: Any) -> Resumed | None:
    """Restores the newest good checkpoint if there is one, as a :class:`Resumed`.

    Refuses (``CheckpointError``) a checkpoint of a run whose global batch, shuffle, seed or
    steps_per_epoch differ: those decide which examples each step sees.
    """
    from mirrorax.checkpoint import CheckpointError

    restored = ckpt.restore_latest(abstract_state)
    if restored is None:
        return None
    step, state, meta = restored
    saved = meta.get("run", {})
    if saved.get("batch_size") != run["batch_size"]:
        raise CheckpointError(
            f"The checkpoint in {ckpt.directory} was written with global batch_size={saved.get('batch_size')}; "
            f"this run asks for batch_size={run['batch_size']}. Resuming with another global batch would "
            "change the result: pass the same batch_size (any device count works), or a fresh checkpoint_dir.")
    for key in ("shuffle", "seed", "steps_per_epoch"):
        if saved.get(key) != run[key]:
            raise CheckpointError(
                f"The checkpoint in {ckpt.directory} was written with {key}={saved.get(key)!r}; this run "
                f"asks for {key}={run[key]!r}, which would change the data order. Pass the same value, or a "
                "fresh checkpoint_dir.")
    history.restore(meta.get("history", {}))
    return Resumed(state, int(meta["epoch"]), int(meta["batch_in_epoch"]), int(step), meta.get("input_state"))


class Saver:
    """Writes checkpoints of a fit: when due, with the data position and history in ``meta``."""

    def __init__(self, ckpt: Any, every: int | None, run: dict[str, Any], history: Any,
                 spec: dict[str, Any], inputs: InputState | None = None) -> None:
        self.ckpt, self.every, self.run, self.history, self.spec = ckpt, every, run, history, spec
        self.inputs = inputs

    def due(self, before: int, after: int) -> bool:
        """True when a step-count checkpoint falls in steps ``(before, after]``."""
        if not self.every:
            return False
        return after // self.every > before // self.every

    def save(self, state: TrainState, epoch: int, batch_in_epoch: int) -> None:
        step = int(host_value(state.step))
        meta = {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "run": self.run,
                "history": self.history.as_dict(), "sample_spec": self.spec,
                "mirrorax_version": _version()}
        if batch_in_epoch and self.inputs is not None:
            position = self.inputs.state_at(batch_in_epoch)
            if position is not None:
                meta["input_state"] = position
        self.ckpt.save(step, state, meta)


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

    @classmethod
    def attach(cls, source: Any, process_count: int) -> InputState | None:
        """Wraps ``source``'s iterable in place; ``None`` where positions are left to replay: arrays
        (positioned by index already), one-shot iterators, and per-process pipelines of a
        multi-process job (each process's input has its own state; only process 0 writes ``meta``)."""
        if not isinstance(source, IterableSource) or isinstance(source.iterable, (Iterator, InputState)):
            return None
        if source.per_process and process_count > 1:
            return None
        tracker = cls(source.iterable)
        source.iterable = tracker
        return tracker

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


def _version() -> str:
    from mirrorax import __version__

    return __version__


def sample_spec(sample: Batch) -> dict[str, Any]:
    """Shapes and dtypes of one row of x and y: enough to rebuild the model's variables for loading."""
    def spec(t: Any) -> Any:
        return None if t is None else jax.tree.map(lambda a: [list(a.shape[1:]), str(a.dtype)], t)

    return {"x": spec(sample.x), "y": spec(sample.y)}


def sample_from_spec(spec: dict[str, Any]) -> Batch:
    """Zeros shaped as :func:`_sample_spec` recorded (two rows), to rebuild a model's variables."""
    def zeros(t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, list) and len(t) == 2 and isinstance(t[1], str):
            return np.zeros([2, *t[0]], t[1])
        if isinstance(t, dict):
            return {k: zeros(v) for k, v in t.items()}
        return type(t)(zeros(v) for v in t)

    return Batch(zeros(spec["x"]), zeros(spec["y"]), np.ones(2, np.float32), np.ones(2, np.float32))


def check_every(every: Any) -> int | None:
    if every == "epoch":
        return None
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ValueError(f"checkpoint_every must be 'epoch' or a number of steps >= 1; received {every!r}.")
    return int(every)
