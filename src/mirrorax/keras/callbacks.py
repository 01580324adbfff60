"""Keras's side of a ``fit``'s callbacks: which ones are Keras's, what they need, and what they implement.

:mod:`mirrorax.hooks` drives the callbacks of any model; for a Keras model it hands them to a
``keras.callbacks.CallbackList`` as Keras's own ``fit`` does, and asks this module what only Keras
knows: whether a model is Keras's (:func:`is_keras_model`), whether a callback implements a hook or
inherits Keras's no-op (:func:`implements`), whether Keras runs a list's batch-end hooks on its worker
thread (:func:`runs_async`), a plain object with ``on_*`` methods as a Keras callback
(:func:`as_keras_callback`), and what a ``TensorBoard`` callback needs installed (:func:`check_available`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

from mirrorax.keras import _internals as internals

__all__ = ["as_keras_callback", "check_available", "implements", "is_keras_model", "runs_async"]


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
