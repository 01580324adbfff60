"""Epoch streams: which global batches an epoch trains on, from which position.

Array inputs form one endless stream of passes (pass ``k`` shuffled by ``(seed, k)``); an epoch is one
pass, or ``steps_per_epoch`` batches that continue where the last epoch stopped. Iterable inputs give
one iteration per epoch (a one-shot iterator continues across epochs, as in Keras). A stream also
counts the real examples of the batches it handed out, for samples/s. Each source makes its own
(``Source.stream``).

Keras's ``fit`` (``ends_with_data=True``) reads ``steps_per_epoch`` as an upper bound instead: an epoch
continues where the last one stopped but ends where the data does (the end of a pass over arrays, the
end of an iteration), and the next epoch starts a new pass.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from mirrorax.inputs.batch import Batch
from mirrorax.inputs.keras_order import pass_order

if TYPE_CHECKING:
    from mirrorax.inputs.arrays import ArraySource
    from mirrorax.inputs.iterables import IterableSource
    from mirrorax.strategy import MirroredStrategy

__all__ = ["Stream", "ArrayStream", "IterStream", "within_pass", "ran_out_of_data"]


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

    def last_real(self, k: int) -> int:
        """Real examples in the next ``max(k, 1)`` batches handed out (those a step just consumed)."""
        take = max(k, 1)
        total = sum(self._reals[:take])
        del self._reals[:take]
        return total


class ArrayStream(Stream):
    """Global batches from an :class:`ArraySource` as one endless stream of passes."""

    batches_per_pass: int

    def __init__(self, source: ArraySource, batch_size: int, strategy: MirroredStrategy,
                 shuffle: Any, seed: int, with_targets: bool = True, ends_with_data: bool = False,
                 keras_order: bool = False) -> None:
        self.source, self.batch_size, self.strategy = source, batch_size, strategy
        self.shuffle, self.seed, self.with_targets = shuffle, seed, with_targets
        super().__init__(ends_with_data)
        self.batches_per_pass = source.batches_per_pass(batch_size)
        self.keras_order = keras_order
        self._drawn: dict[int, np.ndarray | None] = {}  # Keras's order of the pass being read

    def _order(self, pass_index: int) -> np.ndarray | None:
        """The order of pass ``pass_index``: ``None`` for ``(seed, pass)``'s; Keras's, drawn the first time
        the pass is read (when Keras draws it) and kept while it is read."""
        if not self.keras_order:
            return None
        if pass_index not in self._drawn:
            self._drawn = {pass_index: pass_order(self.shuffle, self.source.num_examples, self.batch_size)}
        return self._drawn[pass_index]

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        """Batches ``start..count`` (default: to the end of the pass) of the epoch at stream ``position``."""
        n = self.source.num_examples
        end = position + count if count else (position // self.batches_per_pass + 1) * self.batches_per_pass
        position += start
        while position < end:
            pass_index, start = divmod(position, self.batches_per_pass)
            for b in self.source.batches(self.batch_size, self.strategy, shuffle=self.shuffle, seed=self.seed,
                                         pass_index=pass_index, start=start, with_targets=self.with_targets,
                                         order=self._order(pass_index)):
                self._reals.append(min(self.batch_size, n - (position % self.batches_per_pass) * self.batch_size))
                yield b
                position += 1
                if position >= end:
                    return


class IterStream(Stream):
    """Global batches from an :class:`IterableSource`; an epoch is one iteration (or ``count`` batches)."""

    def __init__(self, source: IterableSource, batch_size: int, strategy: MirroredStrategy,
                 with_targets: bool = True, ends_with_data: bool = False) -> None:
        self.source, self.batch_size, self.strategy = source, batch_size, strategy
        self.with_targets = with_targets
        self.per_process = source.per_process
        super().__init__(ends_with_data)
        self.batches_per_pass = len_or_none(source.iterable)
        self._continuing: Iterator[Batch] | None = None
        self._seen = 0  # batches taken from _continuing (a sized iterable under Keras's steps_per_epoch)

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        """The epoch's batches from batch ``start`` on (a resumed epoch skips what it already trained)."""
        it: Iterator[Batch]
        one_shot = isinstance(self.source.iterable, Iterator)
        # A one-shot iterator (a generator) continues across epochs, as in Keras; so does any iterable
        # under Keras's steps_per_epoch, until an iteration ends.
        continuing = one_shot or bool(self.ends_with_data and count)
        if continuing:
            if self._continuing is None:
                self._continuing = self.source.batches(self.batch_size, self.strategy,
                                                       with_targets=self.with_targets)
            it = self._continuing
        else:
            it = self.source.batches(self.batch_size, self.strategy, with_targets=self.with_targets)
        if start:
            it = itertools.islice(it, start, None)
        taken = 0
        for i, b in enumerate(it, start=start):
            self._reals.append(int(b.mask.sum()) * max(self.strategy.process_count, 1))
            yield b
            taken += 1
            if count and i + 1 >= count:
                break
        else:
            if not one_shot:
                self._continuing, self._seen = None, 0  # the iteration ended: the next epoch starts anew
            return
        if continuing and not one_shot and self.batches_per_pass:
            self._seen += taken
            if self._seen >= self.batches_per_pass:  # a sized iterable's pass is done (Keras's rule)
                self._continuing, self._seen = None, 0


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
