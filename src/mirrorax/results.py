"""What training returns and raises: :class:`History`, :class:`NonFiniteLossError`."""

from __future__ import annotations

from typing import Any

__all__ = ["History", "NonFiniteLossError"]


class NonFiniteLossError(FloatingPointError):
    """Training produced a non-finite loss (``on_nonfinite="raise"``). The trainer and the model keep the
    values from before that step."""


class History:
    """What ``fit`` returns: ``history`` maps each metric (and ``val_`` metric) to one value per epoch.

    Attributes:
      history: ``{"loss": [...], "accuracy": [...], "val_loss": [...], ...}``, as Keras's ``History``.
      epoch: the epoch indices run.
      samples_per_second: training throughput of each epoch (real examples only).
    """

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self.samples_per_second: list[float] = []

    def append(self, epoch: int, logs: dict[str, float], samples_per_second: float) -> None:
        self.epoch.append(epoch)
        self.samples_per_second.append(samples_per_second)
        for k, v in logs.items():
            self.history.setdefault(k, []).append(v)

    def restore(self, saved: dict[str, Any]) -> None:
        """Takes the epochs recorded in a checkpoint (``as_dict`` form)."""
        self.history = {k: list(v) for k, v in saved.get("history", {}).items()}
        self.epoch = list(saved.get("epoch", []))
        self.samples_per_second = list(saved.get("samples_per_second", []))

    def as_dict(self) -> dict[str, Any]:
        return {"history": self.history, "epoch": self.epoch, "samples_per_second": self.samples_per_second}

    def __repr__(self) -> str:
        return f"History(epochs={len(self.epoch)}, keys={list(self.history)})"
