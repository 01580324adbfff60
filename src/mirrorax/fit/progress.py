"""Progress output: a bar per epoch on a terminal, one line per epoch elsewhere, nothing at verbose=0.

Only the primary process (process 0) prints. Metric values shown mid-epoch are fetched from the
devices at most every ``refresh`` seconds, so the bar never forces a host sync per step. An epoch's final
line ends with where its time went (:attr:`Progress.figures`: MFU, the devices' busy share, the input's wait
share; :mod:`mirrorax.fit.meter`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

__all__ = ["Progress", "resolve_verbose", "format_figures", "format_logs"]


def resolve_verbose(verbose: Any, stream: IO[str] | None = None) -> int:
    """``"auto"`` -> 1 (bar) on a terminal or in Jupyter, 2 (line per epoch) otherwise; 0, 1, 2 as given."""
    if verbose == "auto":
        stream = stream or sys.stdout
        # A bar on a terminal and in a Jupyter notebook (whose stdout is no tty but draws \r updates).
        interactive = getattr(stream, "isatty", lambda: False)() or "ipykernel" in sys.modules
        return 1 if interactive else 2
    if verbose in (0, 1, 2) and not isinstance(verbose, bool) or verbose is False or verbose is True:
        return int(verbose)
    raise ValueError(f"verbose must be 'auto', 0, 1 or 2; received {verbose!r}.")


def format_logs(logs: Mapping[str, float]) -> str:
    return " - ".join(f"{k}: {v:.4f}" for k, v in logs.items())


def format_figures(figures: Sequence[tuple[str, str]]) -> str:
    """``[("MFU", "41.2%"), ...]`` as the end of a progress line: ``" - MFU: 41.2% - ..."``."""
    return "".join(f" - {name}: {text}" for name, text in figures)


class Progress:
    """Progress of one epoch.

    Args:
      mode: 0 silent, 1 bar, 2 one line at the end.
      total: steps in the epoch, or ``None`` when unknown.
      epoch, epochs: shown as ``Epoch e/E``.
      fetch_logs: returns the current metric values (a host sync); called at most every ``refresh`` s.

    Attributes:
      figures: what the epoch's final line ends with, ``(name, text)`` pairs (set when the epoch's steps end).
    """

    def __init__(self, mode: int, total: int | None, epoch: int, epochs: int,
                 fetch_logs: Callable[[], Mapping[str, float]], *, stream: IO[str] | None = None,
                 refresh: float = 0.5, width: int = 30) -> None:
        self.mode, self.total, self.fetch_logs = mode, total, fetch_logs
        self.stream = stream or sys.stdout
        self.refresh, self.width = refresh, width
        self.start = time.perf_counter()
        self._last = 0.0
        self._logs: Mapping[str, float] = {}
        self.figures: Sequence[tuple[str, str]] = ()
        if mode == 1:
            self.stream.write(f"Epoch {epoch}/{epochs}\n")
            self.stream.flush()
        self.header = f"Epoch {epoch}/{epochs}"

    def update(self, step: int, samples: int) -> None:
        if self.mode != 1:
            return
        now = time.perf_counter()
        if now - self._last < self.refresh:
            return
        self._last = now
        self._logs = self.fetch_logs()
        self._draw(step, samples, now, end="")

    def _draw(self, step: int, samples: int, now: float, end: str, extra: str = "") -> None:
        elapsed = max(now - self.start, 1e-9)
        if self.total:
            filled = int(self.width * min(step, self.total) / self.total)
            bar = f"{step}/{self.total} [" + "=" * filled + ">" * (filled < self.width) + \
                  "." * (self.width - filled - 1) + "]"
        else:
            bar = f"{step}/?"
        logs = format_logs(self._logs)
        line = f"\r{bar} {elapsed:.1f}s {samples / elapsed:,.0f} samples/s" + (f" - {logs}" if logs else "") + extra
        self.stream.write(line + end)
        self.stream.flush()

    def stop(self) -> float:
        """Ends the timed part of the epoch (before validation); returns its wall time."""
        self.end = time.perf_counter()
        return self.end - self.start

    def finish(self, step: int, samples: int, logs: Mapping[str, float]) -> float:
        """Prints the epoch's final line (with ``logs``); returns the epoch's samples/s."""
        now = getattr(self, "end", None) or time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        self._logs = logs
        if self.mode == 1:
            self._draw(step, samples, now, end="\n", extra=format_figures(self.figures))
        elif self.mode == 2:
            self.stream.write(f"{self.header} - {step} steps - {elapsed:.1f}s - {samples / elapsed:,.0f} samples/s"
                              + (f" - {format_logs(logs)}" if logs else "") + format_figures(self.figures) + "\n")
            self.stream.flush()
        return samples / elapsed
