"""Keras metrics given a step's padding mask: the Keras front-end's ``metric_masking``.

While a step that sees padding rows traces (``strategy.run``'s replicas:
:func:`mirrorax.steps.padding.masked_metric_updates`), every Keras metric class that defines ``update_state`` (Keras's
and the user's) has it wrapped: a call with one value per row of the step's batch is given the mask as its
``sample_weight`` (times the user's own), so its state counts the real rows only
(:func:`mirrorax.steps.padding.masked_update`). The wrappers are installed while any step traces under the context, on
any thread, act only on the thread whose step set a mask, and leave a metric called by another metric as it is;
the classes get their own methods back when the last such trace ends.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from mirrorax.steps.padding import current_mask, masked_update

__all__ = ["metric_masking"]

_state = threading.local()  # .inside: depth of wrapped calls on this thread
_lock = threading.Lock()
_installed: dict[Any, Callable[..., Any]] = {}  # class -> its own update_state, while wrapped
_users = 0


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask = current_mask()
        inside = getattr(_state, "inside", 0)
        if mask is None or inside:  # not in a step, or a metric called by a metric
            return original(self, *args, **kwargs)
        args, kwargs = masked_update(original, self, args, kwargs, mask)
        _state.inside = inside + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.inside = inside

    update_state.__mirrorax_original__ = original  # type: ignore[attr-defined]
    return update_state


def _metric_classes(base: Any) -> Iterator[Any]:
    seen: set[Any] = set()
    todo = [base]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        yield cls
        todo.extend(cls.__subclasses__())


def _install() -> None:
    global _users
    keras = sys.modules.get("keras")
    with _lock:
        _users += 1
        if keras is None:
            return
        # Every class that defines update_state itself (Keras's and the user's metrics), walked on each
        # install: a metric class defined since the last one is included.
        for cls in _metric_classes(keras.metrics.Metric):
            own = cls.__dict__.get("update_state")
            if callable(own) and cls not in _installed and not hasattr(own, "__mirrorax_original__"):
                _installed[cls] = own
                cls.update_state = _wrapped(own)


def _uninstall() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for cls, own in _installed.items():
                cls.update_state = own
            _installed.clear()


@contextlib.contextmanager
def metric_masking() -> Iterator[None]:
    """Keras metrics' ``update_state`` wrapped while the block runs (see the module's docstring)."""
    _install()
    try:
        yield
    finally:
        _uninstall()
