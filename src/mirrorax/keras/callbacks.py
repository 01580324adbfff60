"""Keras's driver of a ``fit``'s callbacks (:class:`KerasCallbacks`, the Keras front-end's ``callbacks``).

:mod:`mirrorax.fit.hooks` drives the callbacks of any model through its front-end's driver; a Keras model's go
through a ``keras.callbacks.CallbackList`` as Keras's own ``fit`` drives them (``set_params``,
``set_model``, every ``on_*`` hook, Keras's asynchronous dispatch of batch hooks). Batch logs are the
step's metric results as device scalars: Keras's ``CallbackList`` turns them into floats on a worker thread
when every batch hook is async-safe (its own ``History`` / ``ProgbarLogger``), on the loop's thread
otherwise, and they reach other callbacks as :class:`LazyLogs`. Beside it, what only Keras knows: whether a
model is Keras's (:func:`is_keras_model`), whether a callback implements a hook or inherits Keras's no-op
(:func:`implements`), whether Keras runs a list's batch-end hooks on its worker thread (:func:`runs_async`),
a plain object with ``on_*`` methods as a Keras callback (:func:`as_keras_callback`), and what a
``TensorBoard`` callback needs installed (:func:`check_available`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mirrorax.fit.hooks import BATCH_HOOKS, PackedLogs
from mirrorax.keras import _internals as internals

__all__ = ["KerasCallbacks", "LazyLogs", "as_keras_callback", "check_available", "implements", "is_keras_model",
           "runs_async"]


class KerasCallbacks:
    """A Keras model's callbacks of one call, in a ``keras.callbacks.CallbackList`` (the driver
    :class:`mirrorax.fit.hooks.Callbacks` calls).

    Args:
      callbacks: a list of callbacks (Keras's, or plain objects with ``on_*`` methods, wrapped), a
        ``keras.callbacks.CallbackList`` (Keras's fit under a scope passes its own), or ``None``.
      model: the Keras model.
      add_history, add_progbar: as ``CallbackList``'s. params: ``set_params`` values for a new list; for a
        given list they fill only what its own params lack.
    """

    def __init__(self, callbacks: Any, model: Any, *, add_history: bool = False, add_progbar: bool = False,
                 **params: Any) -> None:
        import keras

        check_available(callbacks)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            self.callback_list: Any = callbacks
            if params:  # the caller's (Keras's fit) params win: ours only fill what is missing
                callbacks.set_params({**params, **(callbacks.params or {})})
        else:
            callbacks = [as_keras_callback(cb, keras) for cb in callbacks or []]
            self.callback_list = keras.callbacks.CallbackList(callbacks, add_history=add_history,
                                                              add_progbar=add_progbar, model=model, **params)
        members = list(self.callback_list.callbacks)
        self.listens = {kind: any(implements(cb, names) for cb in members) for kind, names in BATCH_HOOKS.items()}
        self._figures: Sequence[tuple[str, str]] = ()
        for cb in members:
            if isinstance(cb, keras.callbacks.ProgbarLogger):
                _end_line_with_figures(cb, self)

    def show_figures(self, figures: Sequence[tuple[str, str]]) -> None:
        """The epoch's figures, for Keras's progress bar to end the epoch's line with at the next
        ``on_epoch_end`` (given to the ``ProgbarLogger`` alone: the logs that ``History`` and the other
        callbacks get are Keras's)."""
        self._figures = tuple(figures)

    def take_figures(self) -> Sequence[tuple[str, str]]:
        """The figures to show now (once)."""
        figures, self._figures = self._figures, ()
        return figures

    def restore_history(self, history: Any) -> None:
        """A resumed fit: Keras's ``History`` callbacks (emptied by ``on_train_begin``) hold the epochs that ran
        before the restart, as ``history`` (a :class:`mirrorax.History`) does, and the model holds them."""
        import keras

        for cb in self.callback_list.callbacks:
            if isinstance(cb, keras.callbacks.History):
                cb.epoch = list(history.epoch)
                cb.history = {k: list(v) for k, v in history.history.items()}
                if cb.model is not None:
                    cb.model.history = cb

    def call(self, method: str, *args: Any) -> None:
        """Calls ``method`` through the ``CallbackList``.

        A train or test batch's logs (device scalars) reach the callbacks as :class:`LazyLogs`: a callback
        that ignores them costs no wait for the step. (Keras's ``CallbackList`` turns them into floats first
        whenever a callback is not ``async_safe``, which waits for every step.)"""
        if method in _LAZY_BATCH_ENDS and len(args) == 2 and isinstance(args[1], Mapping) and \
                not runs_async(self.callback_list, _LAZY_BATCH_ENDS[method]) and \
                (isinstance(args[1], PackedLogs) or not any(isinstance(v, Mapping) for v in args[1].values())):
            logs = LazyLogs(args[1])
            for cb in self.callback_list.callbacks:
                getattr(cb, method)(args[0], logs=logs)
            return
        getattr(self.callback_list, method)(*args)


class _Shown(float):
    """A figure's text in a ``keras.utils.Progbar`` line: Keras formats a value as a number (``f"{avg:.4f}"``
    after dividing it by its count, 1 at an epoch's end); this one keeps its text through both."""

    text = ""

    def __new__(cls, text: str) -> _Shown:
        shown = super().__new__(cls, 1.0)
        shown.text = text
        return shown

    def __truediv__(self, other: Any) -> _Shown:
        return self

    def __format__(self, spec: str) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text


def _end_line_with_figures(progbar: Any, driver: KerasCallbacks) -> None:
    """Makes ``progbar`` (a ``keras.callbacks.ProgbarLogger``) end each epoch's line with the figures the driver
    holds then: its ``on_epoch_end`` gets the logs with the figures appended, as values shown as text."""
    if getattr(progbar, "mirrorax_figures", None) is not None:
        progbar.mirrorax_figures = driver  # a list given to another fit: this fit's figures
        return
    progbar.mirrorax_figures = driver
    own = progbar.on_epoch_end

    def on_epoch_end(epoch: int, logs: Any = None) -> Any:
        figures = progbar.mirrorax_figures.take_figures()
        if figures:
            logs = {**(logs or {}), **{name: _Shown(text) for name, text in figures}}
        return own(epoch, logs)

    progbar.on_epoch_end = on_epoch_end


# Batch-end hooks whose logs are flat device scalars, and the kind of batch hooks that Keras runs on a thread
# when every callback is async-safe: then Keras's own path waits for nothing either.
_LAZY_BATCH_ENDS = {"on_train_batch_end": "train", "on_batch_end": "train", "on_test_batch_end": "test"}


def implements(cb: Any, names: Sequence[str]) -> bool:
    """Whether ``cb`` implements one of the hooks ``names`` (not Keras's default no-op)."""
    return any(callable(getattr(cb, n, None)) and not internals.is_default(getattr(cb, n)) for n in names)


def check_available(callbacks: Any) -> None:
    """Raises at once, with what to install, when a callback needs a package that is missing.

    ``keras.callbacks.TensorBoard`` writes its event files with TensorFlow's ``tf.summary``, whose
    ``scalar`` / ``histogram`` / ``image`` come from the ``tensorboard`` package: without TensorFlow it
    fails with ``No module named 'tensorflow'`` at ``set_model``; without ``tensorboard`` (which
    ``tensorflow`` / ``tensorflow-cpu`` no longer install, from 2.21) with ``TBNotInstalledError`` at the
    end of the first epoch, after that epoch's work.

    Raises:
      ImportError: a ``TensorBoard`` callback and no TensorFlow or no ``tensorboard`` installed.
    """
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras is a dependency
        return
    members = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else callbacks
    if not isinstance(members, (list, tuple)):
        return
    for cb in members:
        if not isinstance(cb, keras.callbacks.TensorBoard):
            continue
        missing = [name for name, module in (("tensorflow-cpu", "tensorflow"), ("tensorboard", "tensorboard"))
                   if importlib.util.find_spec(module) is None]
        if missing:
            raise ImportError(
                f"keras.callbacks.TensorBoard(log_dir={getattr(cb, 'log_dir', None)!r}) writes its logs with "
                "TensorFlow's tf.summary, which needs both the `tensorflow` and the `tensorboard` packages; "
                f"missing here: {', '.join(missing)}. Install them with `pip install tensorflow-cpu tensorboard` "
                "(the CPU build of TensorFlow is enough: it only writes the logs, training stays on JAX; since "
                "TensorFlow 2.21 it no longer brings `tensorboard` along), or remove the TensorBoard callback.")


_HOOK_NAMES = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_test_begin", "on_test_end",
               "on_predict_begin", "on_predict_end", "on_batch_begin", "on_batch_end", "on_train_batch_begin",
               "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end", "on_predict_batch_begin",
               "on_predict_batch_end")


def as_keras_callback(cb: Any, keras: Any) -> Any:
    """``cb`` as a ``keras.callbacks.Callback``: a plain object with some ``on_*`` methods (what
    ``Trainer.fit`` accepts for any model) is wrapped, since Keras's ``CallbackList`` calls every hook of
    every member. Only the hooks ``cb`` has are overridden, so the others stay Keras's no-ops (and batch
    hooks that no member has are never called)."""
    if isinstance(cb, keras.callbacks.Callback):
        return cb

    def forward(name: str) -> Callable[..., Any]:
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.wrapped, name)(*args, **kwargs)

        hook.__name__ = name
        return hook

    methods: dict[str, Any] = {n: forward(n) for n in _HOOK_NAMES if callable(getattr(cb, n, None))}

    def set_model(self: Any, model: Any) -> None:
        keras.callbacks.Callback.set_model(self, model)
        if callable(getattr(self.wrapped, "set_model", None)):
            self.wrapped.set_model(model)

    def set_params(self: Any, params: Any) -> None:
        keras.callbacks.Callback.set_params(self, params)
        if callable(getattr(self.wrapped, "set_params", None)):
            self.wrapped.set_params(params)

    wrapper = type(type(cb).__name__, (keras.callbacks.Callback,),
                   dict(methods, set_model=set_model, set_params=set_params))()
    wrapper.wrapped = cb
    return wrapper


def is_keras_model(model: Any) -> bool:
    try:
        return internals.is_keras_trainer(model)  # keras.Model, or a layer mixed with a Trainer
    except ImportError:  # pragma: no cover
        return False


def runs_async(callback_list: Any, kind: str) -> bool:
    """Whether a ``CallbackList`` runs its ``kind`` (``"train"`` / ``"test"``) batch-end hooks on its thread."""
    return internals.runs_batch_ends_async(callback_list, kind)


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
