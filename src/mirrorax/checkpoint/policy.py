"""When to save: small policy objects, composed, as Orbax's save-decision policies are.

A tier (the durable checkpoints, the local snapshots) asks its policy at each :class:`SavePoint` the loop
reaches (after a step, at an epoch's end, at a preemption, at the fit's end) whether to save there:

* :class:`EveryNSteps`: when a multiple of ``n`` was reached (several steps per dispatch may step over the
  multiple itself; Orbax's ``FixedIntervalPolicy`` asks for the multiple);
* :class:`EveryNSeconds`: every ``seconds`` by the clock, as steps: the first a few steps in, then each next
  one from the steps per second measured since the last save, one number that process 0 decides and every
  process agrees on (``agree``), so every process saves at the same step (Orbax's
  ``ContinuousCheckpointingPolicy(minimum_interval_secs=...)`` decides on the primary host too);
* :class:`EpochEnd`, :class:`OnPreemption` (Orbax's ``PreemptionCheckpointingPolicy``), :class:`FitEnd`;
* :class:`AnyOf` (Orbax's ``AnySavePolicy``): any of them.

A policy is told each save it asked for (:meth:`SavePolicy.saved`); every process asks the same questions in
the same order and gets the same answers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["SavePoint", "SavePolicy", "EveryNSteps", "EveryNSeconds", "EpochEnd", "OnPreemption", "FitEnd", "AnyOf",
           "FIRST_STEPS"]

#: By the clock, the first save comes this many steps after the first step asked about (nothing is measured yet).
FIRST_STEPS = 10


@dataclasses.dataclass(frozen=True)
class SavePoint:
    """Where the loop is when it asks: the state's ``step`` after the newest dispatch, and whether this is an
    epoch's end, the step where every process stops for a preemption, or the fit's end."""

    step: int
    epoch_end: bool = False
    preempted: bool = False
    fit_end: bool = False


class SavePolicy(Protocol):
    """When a tier saves."""

    def should_save(self, point: SavePoint) -> bool:
        """Whether to save at ``point`` (asked once per point, in order)."""
        ...

    def saved(self, point: SavePoint) -> None:
        """A save was taken at ``point``."""
        ...


class EveryNSteps:
    """At each step that passes a multiple of ``n`` since the last one asked about (the first point asked about:
    when it is a multiple itself: a fit resumed at step 10 with ``n=3`` saves at 12, not at once)."""

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"EveryNSteps takes a number of steps >= 1; received {n!r}.")
        self.n = n
        self._seen = -1

    def should_save(self, point: SavePoint) -> bool:
        seen, self._seen = self._seen, point.step
        return point.step % self.n == 0 if seen < 0 else point.step // self.n > seen // self.n

    def saved(self, point: SavePoint) -> None:
        self._seen = max(self._seen, point.step)

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryNSeconds:
    """About every ``seconds``, as a number of steps that every process agrees on: ``agree(step)`` gives process
    0's ``step`` on every process (the identity in a job of one process)."""

    def __init__(self, seconds: float, agree: Callable[[int], int] | None = None) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"EveryNSeconds takes a number of seconds > 0; received {seconds!r}.")
        self.seconds = float(seconds)
        self.agree = agree or (lambda step: step)
        self.next_step: int | None = None  # the next save's step (agreed)
        self._clock: tuple[int, float] | None = None  # (step, time) of the last save: the rate

    def should_save(self, point: SavePoint) -> bool:
        if self.next_step is None:
            self.next_step, self._clock = point.step + FIRST_STEPS, (point.step, time.monotonic())
        return point.step >= self.next_step

    def saved(self, point: SavePoint) -> None:
        now = time.monotonic()
        last_step, last_time = self._clock or (point.step, now)
        rate = (point.step - last_step) / max(now - last_time, 1e-6)
        interval = int(min(max(round(rate * self.seconds), 1), 10**9))
        self._clock = (point.step, now)
        self.next_step = int(self.agree(point.step + interval))

    def __repr__(self) -> str:
        return f"EveryNSeconds({self.seconds:g})"


class _AtPoints:
    """At the points the loop marks with :attr:`flag` (a :class:`SavePoint` field)."""

    flag = ""

    def should_save(self, point: SavePoint) -> bool:
        return bool(getattr(point, self.flag))

    def saved(self, point: SavePoint) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EpochEnd(_AtPoints):
    """At the end of every epoch."""

    flag = "epoch_end"


class OnPreemption(_AtPoints):
    """At the step where every process stops for a preemption (SIGTERM)."""

    flag = "preempted"


class FitEnd(_AtPoints):
    """At the end of a fit (its epochs done, or a callback's stop)."""

    flag = "fit_end"


class AnyOf:
    """When any of ``policies`` says so (each is asked, so that each keeps count)."""

    def __init__(self, *policies: SavePolicy) -> None:
        self.policies = policies

    def should_save(self, point: SavePoint) -> bool:
        return any([p.should_save(point) for p in self.policies])

    def saved(self, point: SavePoint) -> None:
        for p in self.policies:
            p.saved(point)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"
