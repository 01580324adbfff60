"""The Keras front-end's record (:class:`mirrorax.front_end.FrontEnd`): what the engine asks of a Keras model.

Its adapter (:class:`mirrorax.keras.adapter.KerasAdapter`), its callbacks' driver (Keras's ``CallbackList``:
:class:`mirrorax.keras.callbacks.KerasCallbacks`), its metrics' padding mask (:mod:`mirrorax.keras.masking`),
the epoch ``keras.callbacks.BackupAndRestore`` restores a model to, and Keras's default no-op hooks. The
package registers it lazily (``front_end.register_lazy("keras", ...)``); the engine imports none of this.
"""

from __future__ import annotations

from typing import Any

from mirrorax.front_end import FrontEnd
from mirrorax.keras import _internals as internals
from mirrorax.keras.callbacks import KerasCallbacks
from mirrorax.keras.masking import metric_masking

__all__ = ["KERAS_FRONT_END"]


def _claims(model: Any) -> bool:
    return any(c.__module__.startswith("keras") for c in type(model).__mro__)


def _adapter(model: Any, *, loss: Any = None, optimizer: Any = None, metrics: Any = None,
             mixed_precision: str | None = None) -> Any:
    from mirrorax.keras.adapter import KerasAdapter

    return KerasAdapter(model, loss=loss, optimizer=optimizer, metrics=metrics, mixed_precision=mixed_precision)


#: A Keras 3 model, as the engine trains it. (``mx.Trainer`` reads its data as mirrorax does; the model's own
#: ``fit`` under a scope passes Keras's reading, ``mirrorax.keras.order.KERAS_FIT``.)
KERAS_FRONT_END = FrontEnd(name="keras", claims=_claims, adapter=_adapter, callbacks=KerasCallbacks,
                           metric_masking=metric_masking, initial_epoch=internals.initial_epoch,
                           default_hook=internals.is_default)
