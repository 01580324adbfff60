"""Below Ray Train's minimum of workers: say what the run waits for, and end it after a deadline.

With ``ScalingConfig(num_workers=(min, max))``, Ray Train restarts a group that lost a worker on the workers
the cluster has room for, as long as that is at least ``min``. Below it, Ray waits for as long as it takes,
saying only in its controller's log, now and then, that it decided not to restart ("... falling below the
minimum"). :class:`WaitForWorkers` watches the controller's state (``mirrorax.cluster.ray_train.JaxTrainer``
feeds it from a controller callback): once the run has trained and then falls below the minimum, it says
once what Ray waits for, and after ``deadline_s`` seconds ends the run with :class:`BelowMinimumWorkers`,
whose message says how to resume. Nothing is removed: each node's snapshots and the checkpoints stay for
the rerun. Before the run's first group has started, the wait is said but not bounded (a cluster's
autoscaler may take minutes to add nodes).

``mirrorax.cluster.ray_train`` also counts the workers Ray may start with :func:`room`: Ray's own view of the
cluster lags a lost node by seconds.

Pure: the callback passes the state's name, a way to read the cluster's nodes (``ray.nodes()``) and the time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["BelowMinimumWorkers", "WaitForWorkers", "room", "DEFAULT_DEADLINE_S", "CHECK_SECONDS"]

#: How long a run that lost workers waits below its minimum before it ends (``JaxTrainer(wait_for_workers_s=)``).
DEFAULT_DEADLINE_S = 300.0
#: How often the cluster's nodes are read while the run waits (the controller's loop calls far more often).
CHECK_SECONDS = 2.0
#: The controller's states in which its group trains, and those after which nothing more happens.
RUNNING, TERMINAL = "RunningState", frozenset({"FinishedState", "ErroredState", "AbortedState"})


class BelowMinimumWorkers(RuntimeError):
    """A Ray Train run ended because the cluster had room for fewer than its minimum of workers for longer than
    ``JaxTrainer(wait_for_workers_s=...)``. Its snapshots and checkpoints are kept: rerun to resume."""


def room(nodes: Sequence[Mapping[str, Any]], per_worker: Mapping[str, float], max_workers: int) -> int:
    """How many workers of ``per_worker`` resources the live ``nodes`` (``ray.nodes()``: ``"Alive"``,
    ``"Resources"``) hold, at most ``max_workers`` (as Ray's elastic policy counts them, from the nodes' totals).

    Example:
      >>> room([{"Alive": True, "Resources": {"CPU": 4.0}}, {"Alive": False, "Resources": {"CPU": 4.0}}],
      ...      {"CPU": 2.0}, 8)
      2
    """
    total = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        have = node.get("Resources") or {}
        fits = [have.get(name, 0.0) // need for name, need in per_worker.items() if need > 0]
        total += int(min(fits)) if fits else max_workers
    return min(total, max_workers)


class WaitForWorkers:
    """How long a run has waited below its minimum of workers; what to say; when to end it.

    Args:
      min_workers, max_workers: ``ScalingConfig(num_workers=(min, max))``.
      per_worker: the resources of one worker (``{"CPU": 1.0, "GPU": 1.0}``).
      deadline_s: how long a run that has trained waits below ``min_workers`` before it ends.

    Raises:
      ValueError: ``deadline_s`` is not a positive number of seconds.
    """

    def __init__(self, min_workers: int, max_workers: int, per_worker: Mapping[str, float],
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if not (isinstance(deadline_s, (int, float)) and deadline_s > 0):
            raise ValueError(f"wait_for_workers_s must be a positive number of seconds; received {deadline_s!r}. "
                             f"Pass e.g. wait_for_workers_s={DEFAULT_DEADLINE_S:g} (the default).")
        self.min_workers, self.max_workers = int(min_workers), int(max_workers)
        self.per_worker = {k: float(v) for k, v in per_worker.items()}
        self.deadline_s = float(deadline_s)
        self.trained = False  # a group of the run has been running: a wait after it is bounded
        self.since: float | None = None  # when the run fell below the minimum (None: it is not below)
        self.room = -1  # the workers the cluster had room for at the last look
        self.next_look = float("-inf")

    def observe(self, state: str, nodes: Callable[[], Sequence[Mapping[str, Any]]], now: float) -> str | None:
        """The controller's state is now ``state`` (its class name, e.g. ``"RestartingState"``); returns a line to
        say, if there is one new.

        Raises:
          BelowMinimumWorkers: the run that trained has been below its minimum for ``deadline_s``.
        """
        if state == RUNNING or state in TERMINAL:
            self.trained = self.trained or state == RUNNING
            self.since = None
            return None
        if now < self.next_look:
            self._check_deadline(now)
            return None
        self.next_look = now + CHECK_SECONDS
        self.room = room(nodes(), self.per_worker, self.max_workers)
        if self.room >= self.min_workers:  # Ray has room: it starts the group (or is starting it)
            self.since = None
            return None
        if self.since is not None:
            self._check_deadline(now)
            return None
        self.since = now
        what = (f"mirrorax: Ray Train waits for room for {self.min_workers} workers (the minimum of "
                f"ScalingConfig(num_workers=({self.min_workers}, {self.max_workers})), each "
                f"{_resources(self.per_worker)}); the cluster's live nodes have room for {self.room}.")
        if not self.trained:
            return f"{what} The run starts when there is room (its first group has not started)."
        return (f"{what} The run ends in {self.deadline_s:g} s unless room appears "
                "(JaxTrainer(wait_for_workers_s=...)); its snapshots and checkpoints are kept.")

    def _check_deadline(self, now: float) -> None:
        if self.since is None or not self.trained or now - self.since < self.deadline_s:
            return
        raise BelowMinimumWorkers(
            f"Ray Train waited {now - self.since:.0f} s (wait_for_workers_s={self.deadline_s:g}) for room for "
            f"{self.min_workers} workers, the minimum of ScalingConfig(num_workers=({self.min_workers}, "
            f"{self.max_workers})); the cluster's live nodes had room for {self.room}. The run ends here, and "
            "nothing is lost: its snapshots (on each node, in MIRRORAX_SNAPSHOT_DIR) and checkpoints are kept. To "
            "resume from them, run the same script again (the same RunConfig(name=...)) once the cluster has room for "
            f"{self.min_workers} workers, or with a lower minimum; pass a larger wait_for_workers_s to wait longer.")


def _resources(per_worker: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(per_worker.items())) + "}"
