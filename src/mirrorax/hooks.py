"""Callbacks driven as Keras's own ``fit`` drives them, at no per-step cost when none listens.

A Keras model's callbacks go through ``keras.callbacks.CallbackList`` (``set_params``, ``set_model``,
every ``on_*`` hook, Keras's asynchronous dispatch of batch hooks); anything else (callbacks of a
:class:`mirrorax.FunctionalModel`) is a list of plain objects whose ``on_*`` methods are called when
present. Batch hooks are called only when some callback implements one, so a run whose callbacks
only act per epoch pays nothing per step. Batch logs are the step's metric results as device scalars:
Keras's ``CallbackList`` turns them into floats on a worker thread when every batch hook is async-safe
(its own ``History`` / ``ProgbarLogger``), on the loop's thread otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mirrorax._host import host_value
from mirrorax.cluster.watchdog import leaving
from mirrorax.keras import _internals as internals
from mirrorax.keras import callbacks as keras_callbacks

__all__ = ["Callbacks", "PackedLogs"]

_BATCH_HOOKS = {
    "train_begin": ("on_train_batch_begin", "on_batch_begin"),
    "train_end": ("on_train_batch_end", "on_batch_end"),
    "test_begin": ("on_test_batch_begin",),
    "test_end": ("on_test_batch_end",),
    "predict_begin": ("on_predict_batch_begin",),
    "predict_end": ("on_predict_batch_end",),
}


class Callbacks:
    """The callbacks of one ``fit`` / ``evaluate`` / ``predict`` call.

    Args:
      callbacks: a list of callbacks, a ``keras.callbacks.CallbackList``, or ``None``.
      model: the model (Keras models get a ``CallbackList``; anything else plain calls).
      params: ``set_params`` values (``epochs``, ``steps``, ``verbose``) for a new ``CallbackList``.
      add_history, add_progbar: as ``CallbackList``'s (what Keras's ``fit`` passes).
    """

    def __init__(self, callbacks: Any, model: Any, *, add_history: bool = False, add_progbar: bool = False,
                 **params: Any) -> None:
        self.keras = keras_callbacks.is_keras_model(model)
        keras_callbacks.check_available(callbacks)
        if self.keras:
            import keras

            if isinstance(callbacks, keras.callbacks.CallbackList):
                self._list: Any = callbacks
                if params:  # the caller's (Keras's fit) params win: ours only fill what is missing
                    callbacks.set_params({**params, **(callbacks.params or {})})
            else:
                callbacks = [keras_callbacks.as_keras_callback(cb, keras) for cb in callbacks or []]
                self._list = keras.callbacks.CallbackList(callbacks, add_history=add_history,
                                                          add_progbar=add_progbar, model=model, **params)
            members = list(self._list.callbacks)
        else:
            members = list(callbacks or [])
            for cb in members:
                if hasattr(cb, "set_model"):
                    cb.set_model(model)
            self._list = members
        self.listens = {kind: any(keras_callbacks.implements(cb, names) for cb in members)
                        for kind, names in _BATCH_HOOKS.items()}

    @property
    def callback_list(self) -> Any:
        """The ``CallbackList`` (Keras models) or the list of callbacks."""
        return self._list

    def restore_history(self, history: Any) -> None:
        """A resumed fit: Keras's ``History`` callbacks (emptied by ``on_train_begin``) hold the epochs that ran
        before the restart, as ``history`` (a :class:`mirrorax.History`) does, and the model holds them."""
        if not self.keras:
            return
        import keras

        for cb in self._list.callbacks:
            if isinstance(cb, keras.callbacks.History):
                cb.epoch = list(history.epoch)
                cb.history = {k: list(v) for k, v in history.history.items()}
                if cb.model is not None:
                    cb.model.history = cb

    def call(self, method: str, *args: Any) -> None:
        """Calls ``method`` (e.g. ``"on_epoch_end"``) on every callback that has it.

        A train or test batch's logs (device scalars) reach Keras callbacks as :class:`LazyLogs`: a
        callback that ignores them costs no wait for the step. (Keras's ``CallbackList`` turns them into
        floats first whenever a callback is not ``async_safe``, which waits for every step.)

        A callback's ``sys.exit(N)`` (N not 0) is recorded before it propagates: a process of a job that
        leaves so while the others train then leaves at once with status N (``mirrorax.cluster.failure``), not
        after waiting at JAX's exit barrier until ``mirrorax launch`` ends it without its status.
        """
        try:
            self._call(method, *args)
        except SystemExit as e:
            if e.code not in (None, 0) and method != "on_train_end":
                leaving(e.code)
            raise

    def _call(self, method: str, *args: Any) -> None:
        if self.keras:
            if method in _LAZY_BATCH_ENDS and len(args) == 2 and isinstance(args[1], Mapping) and \
                    not keras_callbacks.runs_async(self._list, _LAZY_BATCH_ENDS[method]) and \
                    (isinstance(args[1], PackedLogs) or not any(isinstance(v, Mapping) for v in args[1].values())):
                logs = LazyLogs(args[1])
                for cb in self._list.callbacks:
                    getattr(cb, method)(args[0], logs=logs)
                return
            getattr(self._list, method)(*args)
            return
        for cb in self._list:
            fn = getattr(cb, method, None)
            if fn is not None:
                fn(*args)


# Batch-end hooks whose logs are flat device scalars, and the kind of batch hooks that Keras runs on a thread
# when every callback is async-safe: then Keras's own path waits for nothing either.
_LAZY_BATCH_ENDS = {"on_train_batch_end": "train", "on_batch_end": "train", "on_test_batch_end": "test"}


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


class LazyLogs(dict):
    """A batch's logs that come to the host when a callback first reads a value.

    Holds the step's device scalars; the first read of any value (``logs["loss"]``, ``items()``,
    ``dict(logs)``, ...) converts all of them at once, as Keras's ``pythonify_logs`` does (sorted keys,
    Python floats), and from then on it is a plain dict. The keys, ``len`` and ``in`` need no values.
    """

    def __init__(self, logs: Mapping[str, Any] | None = None) -> None:
        logs = logs or {}
        self._packed = logs if isinstance(logs, PackedLogs) else None
        super().__init__((k, None if self._packed is not None else logs[k]) for k in sorted(logs))
        self._pending = bool(logs)

    def _fill(self) -> None:
        if self._pending:
            self._pending = False
            if self._packed is not None:  # floats already, read in one transfer
                super().update(self._packed.on_host())
                return
            super().update(internals.pythonify_logs(dict(super().items())))

    def __getitem__(self, key: Any) -> Any:
        self._fill()
        return super().__getitem__(key)

    def __iter__(self) -> Any:  # (defined, so that dict(logs) and {**logs} read values through __getitem__)
        return super().__iter__()

    def __repr__(self) -> str:
        self._fill()
        return super().__repr__()

    def __eq__(self, other: object) -> bool:
        self._fill()
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        self._fill()
        return super().__ne__(other)

    __hash__ = None  # type: ignore[assignment]  # as dict's

    def __reduce__(self) -> Any:
        self._fill()
        return (dict, (dict(super().items()),))

    def get(self, key: Any, default: Any = None) -> Any:
        self._fill()
        return super().get(key, default)

    def items(self) -> Any:
        self._fill()
        return super().items()

    def values(self) -> Any:
        self._fill()
        return super().values()

    def copy(self) -> dict[str, Any]:
        self._fill()
        return dict(super().items())

    def pop(self, key: Any, *default: Any) -> Any:
        self._fill()
        return super().pop(key, *default)

    def popitem(self) -> Any:
        self._fill()
        return super().popitem()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._fill()
        return super().setdefault(key, default)

    def __or__(self, other: Any) -> Any:
        self._fill()
        return dict(super().items()) | other
