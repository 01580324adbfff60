"""How ``fit`` reads its data: where an epoch ends, and the order of each pass over arrays.

mirrorax's own reading (``FitReading()``): an epoch of ``steps_per_epoch`` batches takes exactly that many,
array inputs continuing into a new pass, and pass ``k`` over arrays is shuffled by ``(seed, k)``: the same on
any device count, replayed on resume. A front-end may read as its own ``fit`` does: Keras's ``model.fit``
under a scope reads ``steps_per_epoch`` as an upper bound (an epoch also ends where the data does, with
Keras's "ran out of data" warning) and draws each pass's order from the program's global random state when
the pass starts (:class:`PassOrder`; Keras's is ``mirrorax.keras.order.KERAS_ORDER``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

__all__ = ["FitReading", "PassOrder"]


class PassOrder(Protocol):
    """The order of a pass over array inputs, drawn when the pass starts (a front-end's own ``fit``'s order).

    A fit with such an order counts its passes from its own first epoch (as an iterator made per fit
    does), and a restarted fit sets the state the interrupted pass was drawn from back (:meth:`restore`)
    to draw it again.
    """

    def draw(self, shuffle: Any, num_examples: int, batch_size: int) -> np.ndarray | None:
        """The example order of a pass that starts now (``shuffle`` as the fit was given it), the same on every
        process; ``None``: the rows in order."""
        ...

    def state(self) -> dict[str, Any]:
        """What the next :meth:`draw` is drawn from, as JSON (kept in a snapshot's meta)."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Sets a :meth:`state` back."""
        ...


@dataclasses.dataclass(frozen=True)
class FitReading:
    """How ``fit`` reads its data (``mx.Trainer(model, reading=...)``; default: mirrorax's reading).

    Attributes:
      ends_with_data: ``steps_per_epoch`` is an upper bound: an epoch continues where the last one stopped
        but ends where the data does (the end of a pass over arrays, of an iteration), warning when it ran
        out before ``steps_per_epoch`` (Keras's ``fit``); evaluate and predict warn of a short input too.
        ``False``: an epoch takes exactly ``steps_per_epoch`` batches, array inputs continuing into a new pass.
      order: the order of each pass over arrays, drawn when the pass starts (a :class:`PassOrder`);
        ``None``: shuffled by ``(seed, pass)``, independent of the device count and of when it is drawn.
    """

    ends_with_data: bool = False
    order: PassOrder | None = None
