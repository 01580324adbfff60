"""``steps_per_execution="auto"``: how many train steps one dispatch should run, from measured costs.

A dispatch costs the host a fixed amount (the call into the compiled program, the loop's hooks, the batch's
placement) whatever the step does; the devices then spend their own time on it. While the host's part is the
larger, the devices wait for the host: fusing ``k`` steps into one dispatch (a ``lax.scan`` over ``k`` stacked
batches) pays the host's part once per ``k`` steps. Reading the next batch from the input is paid per step
however the steps are fused, and so is the devices' time.

So a step at ``k`` takes about ``max(call / k + read, device)`` (host and devices overlap), and the choice is
a pure function of three measured times (:func:`choose_steps`): the smallest power of two that brings the
step within reach of what fusing cannot remove, when that pays at least :data:`MIN_GAIN` over ``k = 1``. After
the switch the steps per second are measured again, and ``k`` is kept only while it pays
(:func:`keeps_paying`). The devices too spend time per dispatch (a launch, its completion), which a step
measured at one step per dispatch counts as the step's: measured again at ``k``, the two points part what is
paid per dispatch from what is paid per step, host's and devices' (:func:`refine`), and a larger ``k`` is
taken where that pays. :class:`AutoSteps` holds the decision for a fit, as a schedule by batch index: the
same decision on every process gives the same dispatches on every process.
"""

from __future__ import annotations

import dataclasses

__all__ = ["AutoSteps", "Costs", "MAX_STEPS", "MIN_GAIN", "choose_steps", "keeps_paying", "refine"]

#: The most steps one dispatch runs.
MAX_STEPS = 128
#: The predicted speed-up over one step per dispatch below which fusing is not worth a compile.
MIN_GAIN = 0.10
#: The measured speed-up below which a fused ``k`` is given up (the prediction said at least MIN_GAIN).
KEEP_GAIN = 0.04
#: How close to the best reachable step time a chosen ``k`` brings the step.
SLACK = 0.10


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one step costs at one step per dispatch, in seconds.

    Attributes:
      call: the host's work per dispatch that fusing pays once per execution (dispatch, hooks, placement).
      read: the host's wait per step for the next batch from the input (paid per step, fused or not).
      device: the devices' time per step; device_call: theirs per dispatch (0: not told apart from ``device``).
    """

    call: float
    read: float
    device: float
    device_call: float = 0.0

    def step_time(self, k: int) -> float:
        """The predicted seconds per step with ``k`` steps per dispatch (host and devices overlapping)."""
        return max(self.call / k + self.read, self.device + self.device_call / k)


def refine(one: Costs, k: int, call: float, device: float) -> Costs:
    """``one`` (measured at one step per dispatch) told apart, with what a dispatch of ``k`` steps cost (``call``:
    the host's work per dispatch; ``device``: the devices' time per step), into what is paid per dispatch and what
    per step, host's and devices' (a line through the two points).

    Example:
      >>> c = refine(Costs(call=300e-6, read=5e-6, device=40e-6), 8, call=330e-6, device=10e-6)
      >>> round(1e6 * c.device, 1), round(1e6 * c.device_call, 1)  # 40 us a step at k=1: 34 of it a dispatch's
      (5.7, 34.3)
    """
    if k <= 1:
        return one
    host_step = max((call - one.call) / (k - 1), 0.0)
    device_step = max((device * k - one.device) / (k - 1), 0.0)
    return Costs(call=max(one.call - host_step, 0.0), read=one.read + host_step, device=device_step,
                 device_call=max(one.device - device_step, 0.0))


def choose_steps(costs: Costs, *, limit: int = MAX_STEPS, remaining_steps: int | None = None,
                 compile_seconds: float = 0.0, current: int = 1) -> int:
    """The steps per dispatch for ``costs``: ``current`` (1: one step per dispatch) where the devices (or the
    input) are the limit, else the smallest power of two ``k <= limit`` whose predicted step time is within
    :data:`SLACK` of the best any ``k <= limit`` reaches, provided it beats ``current`` by :data:`MIN_GAIN` and,
    over ``remaining_steps`` (``None``: many), saves more than twice ``compile_seconds`` (the new program's
    compile).

    Example:
      >>> choose_steps(Costs(call=300e-6, read=5e-6, device=20e-6))  # the host is the limit: fuse
      32
      >>> choose_steps(Costs(call=300e-6, read=5e-6, device=50e-3))  # the devices are: one step a dispatch
      1
    """
    limit = max(1, int(limit))
    one = costs.step_time(current)
    best = costs.step_time(limit)
    if one <= 0 or best >= one / (1 + MIN_GAIN):
        return current
    k = 1
    while k < limit and costs.step_time(k) > best * (1 + SLACK):
        k *= 2
    k = min(k, limit)
    if k <= current or (remaining_steps is not None
                        and (one - costs.step_time(k)) * remaining_steps <= 2 * compile_seconds):
        return current
    return k


def keeps_paying(seconds_per_step_one: float, seconds_per_step_k: float) -> bool:
    """Whether a fused ``k``, measured at ``seconds_per_step_k``, is worth keeping over one step per dispatch
    (measured at ``seconds_per_step_one``): at least :data:`KEEP_GAIN` faster."""
    return seconds_per_step_k * (1 + KEEP_GAIN) <= seconds_per_step_one


class AutoSteps:
    """A fit's steps per dispatch under ``"auto"``, as a schedule the input's grouping reads by batch index.

    ``k`` holds for the current epoch up to batch ``switch_at``, ``next_k`` from there on (and for the following
    epochs). A decision is made between steps and takes effect a safe distance ahead of every batch the grouping
    may already have read (``lead``), so a background thread grouping ahead never sees it half-way: the
    dispatches depend on the batch index alone, the same on every process.

    Args:
      lead_groups: groups the grouping may have read ahead of the loop (the prefetch depth plus two).
    """

    def __init__(self, lead_groups: int = 3) -> None:
        self.k = 1
        self.next_k = 1
        self.switch_at: int | None = None
        self.lead_groups = lead_groups

    def group(self, index: int) -> int:
        """Steps per dispatch for the group that starts at the epoch's batch ``index``."""
        if self.switch_at is not None and index >= self.switch_at:
            return self.next_k
        return self.k

    def switch(self, k: int, dispatched: int) -> None:
        """``k`` steps per dispatch from the first group that starts a safe distance past the epoch's batch
        ``dispatched`` (the batches dispatched so far); the previous switch must have taken effect."""
        self.k = self.group(dispatched)
        self.next_k = k
        self.switch_at = dispatched + (self.lead_groups + 1) * self.k

    def new_epoch(self) -> None:
        """An epoch starts at batch 0: the newest decision holds from its start."""
        if self.switch_at is not None:
            self.k, self.switch_at = self.next_k, None
