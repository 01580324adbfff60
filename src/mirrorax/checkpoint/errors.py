"""What the two tiers say when a record cannot be used: the errors and warnings of checkpoints and snapshots.

They stand apart from the modules that raise them so that every floor of the package reads them without
importing Orbax (the checkpointer loads it; ``import mirrorax`` must not).
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "SnapshotError", "SnapshotWarning"]


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be used (not writable, or every checkpoint in it is damaged)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was written by a different model: its variables differ in name, shape or dtype."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged) or a save was refused (non-finite state)."""


class SnapshotError(RuntimeError):
    """A snapshot cannot be used: damaged, of another model, or the processes cannot agree on one."""


class SnapshotWarning(UserWarning):
    """A snapshot was damaged (skipped), belongs to another job (ignored) or could not be written; training
    goes on."""
