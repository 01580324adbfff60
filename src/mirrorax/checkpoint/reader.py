"""Reading a checkpoint directory: its steps listed, each step read back and verified before anything of it is
used, the newest good one found, the damaged ones moved aside.

:func:`read_step` reads step ``s`` of an Orbax manager's directory and returns ``(state, meta)``, or the
sentence that says why the step is damaged: its integrity record (format, step, checksums) read first; the
stored variables compared with the model's (another model is a :class:`CheckpointMismatchError`, not damage);
the arrays and the ``meta`` record read; ``meta`` against its SHA-256, every array against its checksum, the
state's step counter against the directory's name, and, when the caller gives one, the record's own check
(a fit's: the position in the data against the step). The checkpointer skips and moves a damaged step aside
(:meth:`mirrorax.Checkpointer.restore_latest`).

:class:`Restoring` is the reading half of :class:`mirrorax.Checkpointer` (the checkpointer opens the directory,
saves and closes; this half lists, restores and sets damage aside).
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import orbax.checkpoint as ocp

from mirrorax._version import __version__
from mirrorax.checkpoint.errors import CheckpointError, CheckpointMismatchError, CheckpointWarning
from mirrorax.checkpoint.integrity_item import FORMAT_VERSION, IntegrityRestore
from mirrorax.checkpoint.job import placed_like, restorable
from mirrorax.checkpoint.orbax_quirks import drain_abandoned_reads, dropping_orbax_read_errors_of_abandoned_reads
from mirrorax.checkpoint.record import Verify, meta_digest
from mirrorax.checkpoint.storage import short
from mirrorax.checkpoint.stored import check_abstract, first_mismatch, is_unpacked_form, stored, typed, unpacked_form
from mirrorax.cluster.watchdog import in_checkpoint
from mirrorax.integrity import digest
from mirrorax.train_state import TrainState

__all__ = ["Verify", "Restoring", "DAMAGED_SUBDIR", "checkpoint_time", "read_step", "read_integrity"]

PyTree = Any

# Damaged steps are moved here (inside the checkpoint directory) so that Orbax no longer counts them:
# left in place, a damaged step 300 would be "latest", would count towards `keep` and would block
# the resumed run from saving step 300 again.
DAMAGED_SUBDIR = "damaged"

_Method = TypeVar("_Method", bound=Callable[..., Any])


def checkpoint_time(method: _Method) -> _Method:
    """The method's time is the file system's: ``mirrorax launch``'s watchdog does not count it (its
    bound applies to steps and input; a save of a large state may take minutes)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with in_checkpoint():
            return method(self, *args, **kwargs)

    return cast(_Method, run)


class Restoring:
    """The reading half of :class:`mirrorax.Checkpointer`: listing, restoring, damage set aside.

    It reads what the checkpointer sets: ``_manager`` (Orbax's), ``_directory``, ``_keep``, ``_read_only``,
    ``_is_local``, ``_closed``, and calls its ``_finish`` (a pending save waited for) before reading.
    """

    _manager: Any
    _directory: str
    _keep: int | None
    _read_only: bool
    _is_local: bool
    _closed: bool

    def _finish(self) -> None:
        """Waits for the pending save (the checkpointer's)."""

    # ---- listing ---------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps of the finished checkpoints in the directory, ascending (in-progress saves excluded)."""
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step, or ``None`` when there is none.

        This does not read the checkpoint; :meth:`restore_latest` may still find it damaged.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---- restoring -------------------------------------------------------------------------------

    @checkpoint_time
    def read_meta(self) -> dict[str, Any] | None:
        """The ``meta`` record of the newest checkpoint whose record is readable, without its arrays.

        Returns ``None`` when the directory holds no checkpoint (or none with a readable record).

        Example:
            >>> ckpt.read_meta()["epoch"]  # doctest: +SKIP
            3
        """
        self._check_open()
        self._finish()
        for step in reversed(self.all_steps()):
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            except Exception:  # noqa: BLE001 - an unreadable record: look at the next older one
                continue
            if isinstance(restored["meta"], dict):
                return restored["meta"]
        return None

    @checkpoint_time
    def restore(self, step: int, abstract_state: PyTree, *, verify: Verify | None = None
                ) -> tuple[PyTree, dict[str, Any]]:
        """Restores checkpoint ``step`` onto the shardings named in ``abstract_state``.

        Args:
            step: A step from :meth:`all_steps`.
            abstract_state: The state's tree with a ``jax.ShapeDtypeStruct(shape, dtype,
                sharding=...)`` per variable, carrying the shardings of *this* run (see
                :meth:`restore_latest`).
            verify: The record's own check, as for :meth:`restore_latest`.

        Returns:
            ``(state, meta)``.

        Raises:
            TypeError: ``abstract_state`` is not a tree of ``jax.ShapeDtypeStruct`` / arrays.
            CheckpointMismatchError: The checkpoint's variables differ from ``abstract_state``.
            CheckpointError: The checkpoint does not exist or is damaged (the message says how), or
                was written by a newer mirrorax.
        """
        self._check_open()
        check_abstract(abstract_state, "restore")
        self._finish()
        if step not in self.all_steps():
            raise CheckpointError(
                f"No checkpoint for step {step} in {self._directory}. "
                f"Available steps: {self.all_steps()}."
            )
        result = read_step(self._manager, self._directory, step, abstract_state, verify)
        if isinstance(result, str):
            raise CheckpointError(f"Checkpoint step {step} in {self._directory} is damaged: {result}.")
        return result

    @checkpoint_time
    def restore_latest(self, abstract_state: PyTree, *, verify: Verify | None = None
                       ) -> tuple[int, PyTree, dict[str, Any]] | None:
        """Restores the newest good checkpoint onto the shardings named in ``abstract_state``.

        Damaged checkpoints (truncated, missing or corrupted files, checksum mismatch, a record that
        ``verify`` refuses) are skipped newest first, each with a :class:`CheckpointWarning` naming its
        step and what was wrong, and moved into ``<directory>/damaged/`` so that the resumed run can
        write those steps again.

        Args:
            abstract_state: The state's tree with a ``jax.ShapeDtypeStruct(shape, dtype,
                sharding=...)`` per variable; the shardings are this run's (that is how a checkpoint
                from 8 devices lands on 4). Build it from the freshly initialised state with
                ``jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                sharding=x.sharding), state)``.
            verify: The record's own check, ``verify(meta, step)``: ``None`` when the ``meta`` record
                (verified against its digest already) is one to resume from, else the sentence saying
                what is wrong with it (``fit``'s checks its position in the data against its step).

        Returns:
            ``(step, state, meta)`` of the newest good checkpoint, or ``None`` when the directory
            holds no checkpoint (start fresh).

        Raises:
            TypeError: ``abstract_state`` is not a tree of ``jax.ShapeDtypeStruct`` / arrays (e.g.
                Keras variables): a wrong argument, never a verdict on the checkpoints.
            CheckpointMismatchError: The checkpoint comes from a different model; the message names
                the first differing variable with both shapes and dtypes.
            CheckpointError: There are checkpoints, but every one of them is damaged (nothing is
                moved then; the message lists them), or the newest was written by a newer mirrorax.

        Example:
            >>> restored = ckpt.restore_latest(abstract_state)  # doctest: +SKIP
            >>> if restored is not None:
            ...     step, state, meta = restored
        """
        self._check_open()
        check_abstract(abstract_state, "restore_latest")
        self._finish()
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            result = read_step(self._manager, self._directory, step, abstract_state, verify)
            if isinstance(result, str):
                damaged.append((step, result))
                continue
            if damaged:
                self._quarantine(damaged, restored_step=step)
            return (step, *result)
        if damaged:
            raise CheckpointError(
                f"Every checkpoint in {self._directory} is damaged: "
                + "; ".join(f"step {s}: {why}" for s, why in damaged)
                + ". Move or delete the directory to start fresh."
            )
        return None

    def _quarantine(self, damaged: list[tuple[int, str]], restored_step: int) -> None:
        """Moves damaged step directories to ``<directory>/damaged/`` and warns about each."""
        # Every process has finished reading before the primary process renames anything.
        ocp.multihost.sync_global_processes("mirrorax_checkpoint_quarantine_start")
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        for step, why in damaged:
            where = "left in place (read-only)" if self._read_only else "left in place"
            if self._is_local and not self._read_only:
                target = os.path.join(self._directory, DAMAGED_SUBDIR, f"step_{step}_{stamp}")
                if jax.process_index() == 0:
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.move(os.path.join(self._directory, str(step)), target)
                where = f"moved to {target}"
            self._warn(
                stacklevel=3,
                message=f"Checkpoint step {step} in {self._directory} is damaged: {why}. Resuming "
                f"from step {restored_step} instead; the damaged checkpoint was {where}.",
            )
        ocp.multihost.sync_global_processes("mirrorax_checkpoint_quarantine_end")
        if not self._read_only:
            self._manager.reload()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                f"This Checkpointer for {self._directory} is closed. Create a new Checkpointer."
            )

    @staticmethod
    def _warn(message: str, stacklevel: int) -> None:
        """Warns on process 0 only: every process reaches the same conclusion, one of them speaks.

        ``stacklevel`` counts from the caller of ``_warn``, as ``warnings.warn``'s does from its own.
        """
        if jax.process_index() == 0:
            # + 2: this frame, and the public method's _checkpoint_time wrapper (every warning comes from one)
            warnings.warn(message, CheckpointWarning, stacklevel=stacklevel + 2)




def read_step(manager: Any, directory: str, step: int, abstract_state: PyTree, verify: Verify | None = None
              ) -> tuple[PyTree, dict[str, Any]] | str:
    """``(state, meta)`` of checkpoint ``step``, or a sentence saying why it is damaged; ``state`` of the type of
    ``abstract_state`` (a :class:`TrainState` restores a dict-form checkpoint).

    Raises:
      CheckpointMismatchError: the checkpoint holds another model's variables.
      CheckpointError: the step was not written by mirrorax, or by a newer one.
    """
    like, abstract_state = abstract_state, stored(abstract_state)
    step_dir = manager.directory / str(step)
    if not any((step_dir / item).exists() for item in ("state", "integrity")):
        if (step_dir / "meta").exists():
            return "it is incomplete (it holds only its 'meta' record, no 'state' nor 'integrity')"
        # Not damage: someone else's checkpoint (e.g. Keras's OrbaxCheckpoint). Leave it alone.
        raise CheckpointError(
            f"Step directory {step_dir} was not written by mirrorax (it has neither a 'state' "
            "nor an 'integrity' item). Point checkpoint_dir at a directory of its own."
        )
    record = read_integrity(manager, directory, step)
    if isinstance(record, str):
        return record
    try:
        metadata = manager.item_metadata(step)
        held = metadata["state"] if metadata is not None else None
    except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged checkpoint
        return f"its variable metadata cannot be read ({short(exc)})"
    if held is None:
        return "its variable metadata is missing"
    held_tree = getattr(held, "tree", held)
    if is_unpacked_form(held_tree, like):  # written before the counters were packed
        abstract_state = unpacked_form(like)
    mismatch = first_mismatch(held_tree, abstract_state)
    if mismatch is not None:
        raise CheckpointMismatchError(
            f"Checkpoint step {step} in {directory} was written by a different model: "
            f"{mismatch}. Build the same model (same layers, shapes and dtypes) to resume from "
            "it, or point checkpoint_dir at a fresh directory."
        )
    failure = None
    with dropping_orbax_read_errors_of_abandoned_reads():
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(restorable(abstract_state)), meta=ocp.args.JsonRestore()))
        except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged checkpoint
            failure = f"reading it failed ({short(exc)})"
        if failure is not None:
            drain_abandoned_reads()
    if failure is not None:
        return failure
    state, meta = placed_like(restored["state"], abstract_state), restored["meta"]
    if not isinstance(meta, dict):
        return "its meta record is not a JSON object"
    if record["format"] >= 2 and meta_digest(meta) != record.get("meta_sha256"):
        return "its meta record (data position, history, config) does not match its digest (corrupted or edited)"
    checksums, _ = digest(state)
    expected = record["checksums"]
    for path, value in checksums.items():
        if expected.get(path) != value:
            return f"the data of variable {path!r} does not match its checksum (corrupted on disk)"
    state = typed(state, like)
    if isinstance(state, TrainState):
        held_step = int(state.host_counters()["step"])
        if held_step != step:
            return f"its state says step {held_step}, its directory step {step}"
    wrong = verify(meta, step) if verify is not None else None
    if wrong is not None:
        return wrong
    return state, meta


def read_integrity(manager: Any, directory: str, step: int) -> dict[str, Any] | str:
    """The integrity record of checkpoint ``step``, or why it is damaged.

    Raises:
      CheckpointError: The record has a newer format than this mirrorax reads.
    """
    try:
        record = manager.restore(step, args=ocp.args.Composite(integrity=IntegrityRestore()))["integrity"]
    except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged checkpoint
        return f"its integrity record cannot be read ({short(exc)})"
    fmt = record.get("format") if isinstance(record, dict) else None
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        return f"its integrity record is malformed (format {fmt!r})"
    if fmt > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint step {step} in {directory} was written by a newer mirrorax (checkpoint "
            f"format {fmt}; this mirrorax {__version__} reads formats up to {FORMAT_VERSION}). Upgrade "
            "mirrorax (pip install -U mirrorax) to resume from it, or point checkpoint_dir at a fresh "
            "directory. Nothing was moved or changed."
        )
    if not isinstance(record.get("checksums"), dict):
        return "its integrity record is malformed (no checksums)"
    if record.get("step") != step:
        return f"its integrity record is of step {record.get('step')!r}, its directory step {step}"
    return record
