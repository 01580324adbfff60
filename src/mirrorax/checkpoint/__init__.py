"""Checkpoints: the training state saved and restored with Orbax, on any device and process count.

* :mod:`~mirrorax.checkpoint.checkpointer`: :class:`Checkpointer`, Orbax save/restore of the state, elastic
  restore (its public names are this package's too: ``mirrorax.checkpoint.Checkpointer``); its reading half,
  :mod:`~mirrorax.checkpoint.reader` (a step read back verified, damaged steps set aside); the stored form of
  a state, :mod:`~mirrorax.checkpoint.stored`;
* :mod:`~mirrorax.checkpoint.errors`: what both tiers raise and warn; :mod:`~mirrorax.checkpoint.storage`:
  the file system under them (small files written atomically, a failed write in one line);
* :mod:`~mirrorax.integrity` / :mod:`~mirrorax.checkpoint.integrity_item`: the checksums a step
  is verified by, and the Orbax item that writes them;
* :mod:`~mirrorax.checkpoint.orbax_quirks`: work-arounds for Orbax's behaviours (its threads, its atexit save);
* :mod:`~mirrorax.checkpoint.dir_lock`: one writer per checkpoint directory;
* :mod:`~mirrorax.checkpoint.job`: what a checkpoint needs of a multi-process job;
* :mod:`~mirrorax.checkpoint.resume`: the record ``fit`` keeps beside the state in either tier (position,
  history, run) and how it resumes; :mod:`~mirrorax.checkpoint.record`: that record's digest and checks (its
  position, a job's identity); :mod:`~mirrorax.checkpoint.policy`: when to save, as policy objects;
* :mod:`~mirrorax.checkpoint.snapshot` / :mod:`~mirrorax.checkpoint.snapshot_io`: ``mx.Snapshots``, each
  node's copy of the state for elastic restarts (one folder per job), and its bytes, verified before use.

A fit's saving (the two tiers, when each saves, the resume) is :mod:`mirrorax.fit.saving`.

The checkpointer imports Orbax and TensorStore (~25 MB of resident memory), so this package imports
nothing itself: its public names load on first use, and a module of the package (``snapshot``, which
``import mirrorax`` loads) does not load the checkpointer.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded on first use (below); imported here for type checkers
    from mirrorax.checkpoint.checkpointer import Checkpointer as Checkpointer
    from mirrorax.checkpoint.checkpointer import CheckpointError as CheckpointError
    from mirrorax.checkpoint.checkpointer import CheckpointMismatchError as CheckpointMismatchError
    from mirrorax.checkpoint.checkpointer import CheckpointWarning as CheckpointWarning
    from mirrorax.checkpoint.checkpointer import all_finite as all_finite

__all__ = ["CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "Checkpointer", "all_finite"]


def __getattr__(name: str):  # PEP 562
    if name in __all__:
        from mirrorax.checkpoint import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module 'mirrorax.checkpoint' has no attribute {name!r}")
