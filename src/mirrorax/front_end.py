"""Front-ends as records: what the engine asks of a kind of model, and the registry it asks.

The engine trains any model through a :class:`mirrorax.models.base.ModelAdapter`; what differs between
kinds of model beyond that (Keras 3, Flax NNX, a third party's) is one :class:`FrontEnd` record per kind,
registered here by its wing: which models it claims, their adapter, the driver of their callbacks, a
context that masks their metrics' padding rows while a step traces, where a callback restored a model to
at ``on_train_begin``, and how ``fit`` reads their data by default. The engine imports no wing: it looks
the record up (:func:`of`, :func:`front_ends`) and calls its fields.

A wing registers its record with :func:`register` once it is imported, or with :func:`register_lazy` to be
loaded the first time the engine looks while the wing's library is imported (the package registers Keras's
for ``keras`` and Flax NNX's for ``flax.nnx``, so ``import mirrorax`` imports neither). The load registers
everything the wing gives the engine: its record here and its split/merge protocol
(:mod:`mirrorax.steps.split_merge`, whose lookup loads through :func:`load_imported` too).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["FrontEnd", "register", "register_lazy", "load_imported", "front_ends", "of"]


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """One kind of model, as the engine sees it.

    Attributes:
      name: the kind's name (in messages).
      claims: ``claims(model)``: whether ``model`` is of this kind.
      adapter: ``adapter(model, *, loss, optimizer, metrics, mixed_precision)``: its
        :class:`mirrorax.models.base.ModelAdapter` (the ``Trainer``'s overrides of the compile settings).
      callbacks: ``callbacks(callbacks, model, *, add_history, add_progbar, **params)``: the driver of a call's
        callbacks (an object with ``listens``, ``callback_list``, ``call(method, *args)`` and
        ``restore_history(history)``, as :class:`mirrorax.fit.hooks.PlainCallbacks`); ``None``: plain objects whose
        ``on_*`` methods are called.
      metric_masking: ``metric_masking()``: a context open while a step that sees padding rows traces, in which
        this kind's metrics hand their ``update_state`` arguments to :func:`mirrorax.steps.padding.masked_update`;
        ``None``: its metrics are not masked.
      initial_epoch: ``initial_epoch(model)``: the epoch a callback restored ``model`` to during
        ``on_train_begin`` (Keras's ``BackupAndRestore``), or ``None``; ``None``: never.
      default_hook: ``default_hook(method)``: whether a callback's method is this kind's default no-op (a
        hook its callback class does not override), so that a callback of this kind given to any model is not
        called per batch for nothing; ``None``: every method counts.
      reading: how ``Trainer.fit`` reads this kind's data when the ``Trainer`` is given none
        (a :class:`mirrorax.FitReading`); ``None``: mirrorax's reading.
    """

    name: str
    claims: Callable[[Any], bool]
    adapter: Callable[..., Any]
    callbacks: Callable[..., Any] | None = None
    metric_masking: Callable[[], AbstractContextManager[Any]] | None = None
    initial_epoch: Callable[[Any], int | None] | None = None
    default_hook: Callable[[Any], bool] | None = None
    reading: Any = None


_FRONT_ENDS: list[FrontEnd] = []
_LAZY: dict[str, Callable[[], None]] = {}


def register(front_end: FrontEnd) -> None:
    """Makes the engine train the models ``front_end`` claims (a record of the same name is replaced; the
    first registered record that claims a model is its)."""
    for i, known in enumerate(_FRONT_ENDS):
        if known.name == front_end.name:
            _FRONT_ENDS[i] = front_end
            return
    _FRONT_ENDS.append(front_end)


def register_lazy(module: str, load: Callable[[], None]) -> None:
    """Calls ``load()`` (which :func:`register` s a record, and the wing's split/merge protocol) the first time
    the engine looks up a front-end or a step's protocols while ``module`` is imported: a library's models and
    objects can exist only once it is."""
    _LAZY.setdefault(module, load)


def load_imported() -> None:
    """Loads the wings registered with :func:`register_lazy` whose library is imported now (each once)."""
    if _LAZY:
        for module in [m for m in _LAZY if m in sys.modules]:
            _LAZY.pop(module)()


def front_ends() -> tuple[FrontEnd, ...]:
    """The registered records, after loading those whose library is imported now."""
    load_imported()
    return tuple(_FRONT_ENDS)


def of(model: Any) -> FrontEnd | None:
    """The record that claims ``model``, or ``None`` (a :class:`mirrorax.FunctionalModel`, a plain object)."""
    for front_end in front_ends():
        if front_end.claims(model):
            return front_end
    return None
