"""The one integer check every option goes through: an ``int`` (numpy's too, never ``bool``) in range."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int"]


def check_int(name: str, value: Any, low: int | None = 1, *, meaning: str = "", error: type[Exception] = ValueError
              ) -> None:
    """Refuses ``value`` unless it is an integer of at least ``low`` (any integer when ``low`` is None).

    Args:
      name: the argument's name, as the caller wrote it.
      meaning: what the number counts, said in the message (e.g. ``"seconds"``).
      error: the exception to raise (``TypeError`` where only the type is checked).

    Raises:
      ValueError (or ``error``): e.g. ``max_in_flight must be an integer >= 1; received 0.``
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or \
            (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        note = f" ({meaning})" if meaning else ""
        kind = "" if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else \
            f" (of type {type(value).__name__})"
        raise error(f"{name} must be an integer{bound}{note}; received {value!r}{kind}.")
