"""The record kept beside a state in both tiers, and how it is checked before a resume takes it.

A checkpoint's ``meta`` and a snapshot's record are the same dict for a ``fit`` (made by
:class:`mirrorax.checkpoint.resume.Record`): the position in the data (``step``, ``epoch``,
``batch_in_epoch``), the run's settings, the history, one input row's shapes; a snapshot adds the job that
took it and the group of processes. Each tier writes a digest beside it (:func:`meta_digest`: a checkpoint's
``integrity`` item; a snapshot's ``digest.json``), so a flipped bit is found before the record is read; a
resume then checks what a digest cannot: that the record says the place in the data consistently
(:func:`position_wrong`), and, for a snapshot, that it is this job's (:func:`job_differs`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Verify", "meta_digest", "position_wrong", "job_differs"]

#: A record's own check: ``(meta, step) -> None`` when it holds, else the sentence that says what is wrong.
Verify = Callable[[dict[str, Any], int], "str | None"]


def meta_digest(meta: Any) -> str:
    """SHA-256 (hex) of a JSON record in a canonical form: the same for the record written and the
    record read back (sorted keys, no spaces; Python's JSON floats round-trip exactly)."""
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def position_wrong(meta: dict[str, Any], step: int) -> str | None:
    """Why a fit's record of step ``step`` does not say consistently where in the data it stopped (``epoch``,
    ``batch_in_epoch`` and its own ``step``, counts, the last equal to ``step``), or ``None``. A record without
    the run's settings (an older mirrorax's) is left to the resume, which says so."""
    if not isinstance(meta.get("run"), dict):
        return None
    epoch, batch, held = meta.get("epoch"), meta.get("batch_in_epoch"), meta.get("step", step)
    if not (_count(epoch) and _count(batch) and _count(held)) or held != step:
        return (f"its record does not say consistently where it stopped (epoch {epoch!r}, batch_in_epoch "
                f"{batch!r}, step {held!r} at step {step})")
    return None


#: How a setting of a job's identity is named in a message, by its key.
_WORDS = {"model": "the model (its variables' names, shapes or dtypes)",
          "optimizer_state": "the optimizer (its variables' names, shapes or dtypes)",
          "rows": "the data (its rows)"}


def job_differs(theirs: Mapping[str, Any], mine: Mapping[str, Any], where: str = "") -> str | None:
    """The first setting in which two jobs' identities differ, in words (``"learning_rate: 0.001 in that job,
    0.002 in this one"``), or ``None`` when they are the same job."""
    for key in [*mine, *(k for k in theirs if k not in mine)]:
        a, b = theirs.get(key), mine.get(key)
        if a == b:
            continue
        name = f"{where}/{key}" if where else key
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            inner = job_differs(a, b, name)
            if inner is not None:
                return inner
            continue
        label = _WORDS.get(key, name.rsplit("/", 1)[-1] if where.startswith("hyperparameters") else name)
        if key in _WORDS:
            return f"{label} differs"
        return f"{label}: {_shown(a)} in that job, {_shown(b)} in this one"
    return None


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else json.dumps(value)[:80]
