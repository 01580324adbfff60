"""Epoch streams: which global batches an epoch trains on, from which position.

Array inputs form one endless stream of passes (pass ``k`` shuffled by ``(seed, k)``); an epoch is one
pass, or ``steps_per_epoch`` batches that continue where the last epoch stopped. Iterable inputs give
one iteration per epoch (a one-shot iterator continues across epochs, as in Keras). A stream also
counts the real examples of the batches it handed out, for samples/s.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from mirrorax.data import ArraySource, Batch, IterableSource
from mirrorax.strategy import MirroredStrategy

__all__ = ["Stream", "ArrayStream", "IterStream", "make_stream"]


class Stream:
    """Base: ``batches(position, count, start)`` plus the real-example count of handed-out batches."""

    per_process = False
    batches_per_pass: int | None = None

    def __init__(self) -> None:
        self._reals: list[int] = []

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        raise NotImplementedError

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
                 shuffle: bool, seed: int, with_targets: bool = True) -> None:
        self.source, self.batch_size, self.strategy = source, batch_size, strategy
        self.shuffle, self.seed, self.with_targets = shuffle, seed, with_targets
        super().__init__()
        self.batches_per_pass = source.batches_per_pass(batch_size)

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        """Batches ``start..count`` (default: to the end of the pass) of the epoch at stream ``position``."""
        n = self.source.num_examples
        end = position + count if count else (position // self.batches_per_pass + 1) * self.batches_per_pass
        position += start
        while position < end:
            pass_index, start = divmod(position, self.batches_per_pass)
            for b in self.source.batches(self.batch_size, self.strategy, shuffle=self.shuffle, seed=self.seed,
                                         pass_index=pass_index, start=start, with_targets=self.with_targets):
                self._reals.append(min(self.batch_size, n - (position % self.batches_per_pass) * self.batch_size))
                yield b
                position += 1
                if position >= end:
                    return


class IterStream(Stream):
    """Global batches from an :class:`IterableSource`; an epoch is one iteration (or ``count`` batches)."""

    def __init__(self, source: IterableSource, batch_size: int, strategy: MirroredStrategy,
                 with_targets: bool = True) -> None:
        self.source, self.batch_size, self.strategy = source, batch_size, strategy
        self.with_targets = with_targets
        self.per_process = source.per_process
        super().__init__()
        self.batches_per_pass = len_or_none(source.iterable)
        self._continuing: Iterator[Batch] | None = None

    def batches(self, position: int, count: int | None, start: int = 0) -> Iterator[Batch]:
        """The epoch's batches from batch ``start`` on (a resumed epoch skips what it already trained)."""
        it: Iterator[Batch]
        if isinstance(self.source.iterable, Iterator):
            # A one-shot iterator (a generator) continues across epochs, as in Keras.
            if self._continuing is None:
                self._continuing = self.source.batches(self.batch_size, self.strategy,
                                                       with_targets=self.with_targets)
            it = self._continuing
        else:
            it = self.source.batches(self.batch_size, self.strategy, with_targets=self.with_targets)
        if start:
            it = itertools.islice(it, start, None)
        for i, b in enumerate(it, start=start):
            self._reals.append(int(b.mask.sum()) * max(self.strategy.process_count, 1))
            yield b
            if count and i + 1 >= count:
                return


def make_stream(source: ArraySource | IterableSource, batch_size: int, strategy: MirroredStrategy, *,
                shuffle: bool = False, seed: int = 0, with_targets: bool = True) -> Stream:
    """The stream of ``source``'s global batches of ``batch_size``."""
    if isinstance(source, ArraySource):
        return ArrayStream(source, batch_size, strategy, shuffle, seed, with_targets=with_targets)
    return IterStream(source, batch_size, strategy, with_targets=with_targets)


def len_or_none(x: Any) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None
