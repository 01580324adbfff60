"""Epoch streams: which global batches an epoch trains on, from which position.

Array inputs form one endless stream of passes (pass ``k`` shuffled by ``(seed, k)``); an epoch is one
pass, or ``steps_per_epoch`` batches that continue where the last epoch stopped. Iterable inputs give
one iteration per epoch (a one-shot iterator continues across epochs, as in Keras). A stream also
counts the real examples of the batches it handed out, for samples/s. Each source makes its own
(``Source.stream``), a subclass of :class:`Stream` that lives beside it (``ArrayStream``, ``IterStream``).

Keras's ``fit`` (``ends_with_data=True``) reads ``steps_per_epoch`` as an upper bound instead: an epoch
continues where the last one stopped but ends where the data does (the end of a pass over arrays, the
end of an iteration), and the next epoch starts a new pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from mirrorax.inputs.batch import Batch

__all__ = ["Stream", "len_or_none", "within_pass", "ran_out_of_data"]


class Stream:
    """Base: ``batches(position, count, start)`` plus the real-example count of handed-out batches."""

    per_process = False
    batches_per_pass: int | None = None

    def __init__(self, ends_with_data: bool = False) -> None:
        self._reals: list[int] = []
        self.ends_with_data = ends_with_data

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        raise NotImplementedError

    def epoch_span(self, epoch: int, steps_per_epoch: int | None) -> tuple[int, int | None]:
        """Where epoch ``epoch`` starts in the stream, and how many batches it takes (``None``: a pass).

        A function of the epoch alone, so that a resumed run takes the same batches."""
        n = self.batches_per_pass
        if not steps_per_epoch:
            return (epoch * n if n else 0), None
        if not self.ends_with_data or not n:
            return epoch * steps_per_epoch, steps_per_epoch
        per_pass = -(-n // steps_per_epoch)  # epochs a pass lasts; the last one takes what is left
        pass_index, j = divmod(epoch, per_pass)
        return pass_index * n + j * steps_per_epoch, min(steps_per_epoch, n - j * steps_per_epoch)

    def order_state(self, position: int) -> dict[str, Any] | None:
        """What a restarted fit must set back to read stream ``position`` in the same order (the global
        generators Keras's order is drawn from); ``None``: the order needs nothing (see ``ArrayStream``)."""
        return None

    def last_real(self, k: int) -> int:
        """Real examples in the next ``max(k, 1)`` batches handed out (those a step just consumed)."""
        take = max(k, 1)
        total = sum(self._reals[:take])
        del self._reals[:take]
        return total


def len_or_none(x: Any) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None


def within_pass(stream: Stream, steps: int | None, warn: bool) -> int | None:
    """evaluate's and predict's ``steps``: a limit within one pass over the data (never a second pass,
    which would count examples twice), as Keras reads it; ``warn``: with Keras's warning when it cuts."""
    n = stream.batches_per_pass
    if not steps or not n:
        return steps
    if warn and steps > n:
        ran_out_of_data()
    return min(steps, n)


def ran_out_of_data() -> None:
    """Keras's warning when an epoch ends before its ``steps_per_epoch`` (the same words)."""
    warnings.warn("Your input ran out of data; interrupting training. Make sure that your dataset or generator "
                  "can generate at least `steps_per_epoch * epochs` batches. You may need to use the "
                  "`.repeat()` function when building your dataset.", stacklevel=3)
