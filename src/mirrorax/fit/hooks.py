"""The callbacks of a ``fit`` / ``evaluate`` / ``predict`` call, driven at no per-step cost when none listens.

Each kind of model's callbacks have a driver: its front-end's (:class:`mirrorax.front_end.FrontEnd`'s
``callbacks``: a Keras model's go through Keras's ``CallbackList``, as Keras's own ``fit`` drives them, in
:mod:`mirrorax.keras.callbacks`), or for any other model :class:`PlainCallbacks`, a list of plain objects
whose ``on_*`` methods are called when present. Batch hooks are called only when some callback implements
one, so a run whose callbacks only act per epoch pays nothing per step. A train step's batch logs reach
them packed in one small device array (:class:`PackedLogs`), read to the host when a value is first read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mirrorax import front_end
from mirrorax._host import host_value
from mirrorax.cluster.watchdog import leaving

__all__ = ["BATCH_HOOKS", "Callbacks", "PackedLogs", "PlainCallbacks", "implements"]

#: The kinds of batch hooks (``listens``' keys) and the callback methods of each.
BATCH_HOOKS = {
    "train_begin": ("on_train_batch_begin", "on_batch_begin"),
    "train_end": ("on_train_batch_end", "on_batch_end"),
    "test_begin": ("on_test_batch_begin",),
    "test_end": ("on_test_batch_end",),
    "predict_begin": ("on_predict_batch_begin",),
    "predict_end": ("on_predict_batch_end",),
}


def implements(cb: Any, names: Sequence[str]) -> bool:
    """Whether ``cb`` implements one of the hooks ``names``: a method that is not a front-end's default no-op
    (a Keras callback's hooks it does not override, given to any model)."""
    defaults = [kind.default_hook for kind in front_end.front_ends() if kind.default_hook is not None]
    for n in names:
        method = getattr(cb, n, None)
        if callable(method) and not any(is_default(method) for is_default in defaults):
            return True
    return False


class PlainCallbacks:
    """The callbacks of a model no front-end drives (a :class:`mirrorax.FunctionalModel`): plain objects
    whose ``set_model`` and ``on_*`` methods are called when present.

    Args:
      callbacks: a list of callbacks or ``None``. model: the model (``set_model``'s).
      add_history, add_progbar, params: what a ``CallbackList`` takes; a plain list takes none of them.
    """

    def __init__(self, callbacks: Any, model: Any, *, add_history: bool = False, add_progbar: bool = False,
                 **params: Any) -> None:
        members = list(callbacks or [])
        for cb in members:
            if hasattr(cb, "set_model"):
                cb.set_model(model)
        self.callback_list: Any = members
        self.listens = {kind: any(implements(cb, names) for cb in members) for kind, names in BATCH_HOOKS.items()}

    def restore_history(self, history: Any) -> None:
        """Nothing to restore: a plain list holds no history."""

    def show_figures(self, figures: Sequence[tuple[str, str]]) -> None:
        """Nothing to show them with: a plain list has no progress bar (the Trainer's own line shows them)."""

    def call(self, method: str, *args: Any) -> None:
        for cb in self.callback_list:
            fn = getattr(cb, method, None)
            if fn is not None:
                fn(*args)


class Callbacks:
    """The callbacks of one ``fit`` / ``evaluate`` / ``predict`` call, through their model's driver.

    Args:
      callbacks: a list of callbacks, the front-end's own list (a ``keras.callbacks.CallbackList``), or
        ``None``.
      model: the model (its front-end's driver, else :class:`PlainCallbacks`).
      params: ``set_params`` values (``epochs``, ``steps``, ``verbose``) for a new list.
      add_history, add_progbar: as ``CallbackList``'s (what Keras's ``fit`` passes).

    Attributes:
      listens: per kind of batch hook (:data:`BATCH_HOOKS`), whether some callback implements it.
    """

    def __init__(self, callbacks: Any, model: Any, *, add_history: bool = False, add_progbar: bool = False,
                 **params: Any) -> None:
        kind = front_end.of(model)
        make = kind.callbacks if kind is not None and kind.callbacks is not None else PlainCallbacks
        self.driver = make(callbacks, model, add_history=add_history, add_progbar=add_progbar, **params)
        self.listens: dict[str, bool] = dict(self.driver.listens)

    @property
    def callback_list(self) -> Any:
        """The driver's list (Keras models: the ``CallbackList``)."""
        return self.driver.callback_list

    def restore_history(self, history: Any) -> None:
        """A resumed fit: the callbacks that keep a history (Keras's ``History``) hold the epochs that ran
        before the restart, as ``history`` (a :class:`mirrorax.History`) does."""
        self.driver.restore_history(history)

    def show_figures(self, figures: Sequence[tuple[str, str]]) -> None:
        """The epoch's figures (``(name, text)`` pairs: MFU, busy and input shares), for the driver's progress bar
        to end the epoch's line with at ``on_epoch_end`` (Keras's ``ProgbarLogger``); not in the logs."""
        show = getattr(self.driver, "show_figures", None)
        if show is not None:
            show(figures)

    def call(self, method: str, *args: Any) -> None:
        """Calls ``method`` (e.g. ``"on_epoch_end"``) on every callback that has it.

        A callback's ``sys.exit(N)`` (N not 0) is recorded before it propagates: a process of a job that
        leaves so while the others train then leaves at once with status N (``mirrorax.cluster.failure``), not
        after waiting at JAX's exit barrier until ``mirrorax launch`` ends it without its status.
        """
        try:
            self.driver.call(method, *args)
        except SystemExit as e:
            if e.code not in (None, 0) and method != "on_train_end":
                leaving(e.code)
            raise


class PackedLogs(Mapping[str, float]):
    """A batch's logs packed in one small device array (a train step's one output beside the state), read
    to the host once, when a value is first read; the names need no read.

    Args:
      names: the logs' names, in the array's order. packed: the array. offset: where the logs start in it.
    """

    def __init__(self, names: Sequence[str], packed: Any, offset: int = 0) -> None:
        self.names, self.packed, self.offset = tuple(names), packed, offset
        self._host: dict[str, float] | None = None

    def on_host(self) -> dict[str, float]:
        """The logs as Python floats (waits for the step that made them, the first time)."""
        if self._host is None:
            values = host_value(self.packed)
            self._host = {n: float(values[self.offset + i]) for i, n in enumerate(self.names)}
        return self._host

    def __getitem__(self, key: str) -> float:
        return self.on_host()[key]

    def __iter__(self) -> Any:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, key: object) -> bool:
        return key in self.names
