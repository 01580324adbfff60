"""Checkpoints of the whole training state, written asynchronously, restorable on any device count.

A checkpoint is one Orbax step directory ``<directory>/<step>/`` with three items:

* ``state``: the state pytree (parameters, optimizer state, non-trainable state, metric
  accumulators, step, RNG), saved with ``StandardSave`` in its stored form (:mod:`mirrorax.checkpoint.stored`:
  a :class:`mirrorax.TrainState` as its plain dict);
* ``meta``: a JSON dict chosen by the caller (data position, history, config);
* ``integrity``: a JSON record written by this module: its format version, the step, a checksum per
  variable of the values being saved, summed in Orbax's background commit from host arrays taken when
  the save started (one process), or on the devices before the save starts (several processes, whose
  shards no single process holds), and the SHA-256 of the ``meta`` record. Orbax and TensorStore
  notice a truncated or missing file, but a flipped byte inside an array's data, or in ``meta``,
  restores silently as a wrong number or a wrong place in the data; the digests, verified on every
  restore, catch that. Nothing in a checkpoint is executable: arrays and JSON, read as data.

Orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it when complete, so a crash
during a save leaves the previous checkpoints intact and only a temporary directory behind (removed
the next time a :class:`Checkpointer` opens the directory); a save that fails to write (a full disk)
removes its own as it reports the failure. Reading (listing, restoring, damaged steps set aside) is
the checkpointer's other half, :class:`mirrorax.checkpoint.reader.Restoring`.

A writing :class:`Checkpointer` holds ``<directory>/.mirrorax-lock`` until it is closed, so a second run
on the same directory is refused at the start (a lock left by a dead process of this host is taken
over). ``read_only=True`` (what ``Trainer.load`` uses) neither locks nor writes anything.

Every process of a multi-process job must call :meth:`Checkpointer.save`,
:meth:`Checkpointer.restore_latest`, :meth:`Checkpointer.wait` and :meth:`Checkpointer.close` in the
same order; Orbax coordinates the writes and the primary process writes the shared metadata. The
processes write one directory, process 0's, whatever directory each named (TF's workers name paths of
their own: :mod:`mirrorax.checkpoint.job`), and values that live on one process's devices (a Keras
variable made outside the strategy's scope) are written from process 0.

A save still being written when the program ends is finished before Python stops the executors Orbax
writes with (every writing checkpointer still open is closed then); one that fails then is said in one
line, and the process exits with status 1.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from mirrorax._checks import check_int
from mirrorax.checkpoint.dir_lock import release
from mirrorax.checkpoint.errors import CheckpointError, CheckpointMismatchError, CheckpointWarning
from mirrorax.checkpoint.integrity_item import IntegrityHandler, IntegritySave, NonFiniteState
from mirrorax.checkpoint.job import claim_directory, savable, use_distributed_barriers
from mirrorax.checkpoint.orbax_quirks import (
    QuietSaveErrors,
    close_abandoned_writes,
    close_at_exit,
    forget_at_exit,
    stop_tensorstore_metric_leak,
    stop_tensorstore_spec_leak,
)
from mirrorax.checkpoint.reader import Restoring, checkpoint_time
from mirrorax.checkpoint.record import meta_digest
from mirrorax.checkpoint.storage import save_failed
from mirrorax.checkpoint.stored import check_savable, json_clean, stored
from mirrorax.cluster.consistency import debug_checks
from mirrorax.integrity import HostDigest, all_finite, digest

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "Checkpointer",
    "all_finite",
]

PyTree = Any



class Checkpointer(Restoring):
    """Saves and restores the complete training state in a directory of Orbax checkpoints.

    Saving is asynchronous: :meth:`save` returns once the arrays are copied off the devices, and the
    files are written in a background thread while training continues. Each checkpoint appears
    atomically (Orbax writes a temporary directory and renames it), the ``keep`` newest are kept,
    and a state holding NaN or Inf is never written. Restoring takes the *new* shardings, so a
    checkpoint written on 8 devices or 2 processes resumes on any other device or process count.

    The constructor creates ``directory`` if needed and proves it writable, so a bad path fails at
    the start of ``fit``, not at the first save an hour later.

    Args:
        directory: Where the step directories go; created if missing. A local path, or a URL that
            Orbax understands (``gs://...``; then the writability check is left to Orbax).
        keep: How many of the newest checkpoints to keep (>= 1), or ``None`` to keep all.
        async_save: Write in a background thread (the default). ``False`` makes :meth:`save` return
            only when the checkpoint is on disk.
        read_only: Only read (restore, list): the directory must exist, may be read-only, is not
            locked, and nothing in it is created, moved or deleted (a damaged step is skipped, left
            in place); :meth:`save` is refused.

    Raises:
        ValueError: ``keep`` is not a positive int or ``None``.
        CheckpointError: ``directory`` cannot be created or written, or another live run writes it
            (its host and pid are named; see ``docs/checkpoints.md``).

    Example:
        >>> with Checkpointer("/tmp/run1/checkpoints", keep=3) as ckpt:  # doctest: +SKIP
        ...     restored = ckpt.restore_latest(abstract_state)
        ...     if restored is not None:
        ...         step, state, meta = restored
        ...     ckpt.save(step, state, {"epoch": epoch, "batch_in_epoch": 0})
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int | None = 3, async_save: bool = True,
        read_only: bool = False,
    ) -> None:
        if keep is not None:
            check_int("keep", keep, 1, meaning="the number of newest checkpoints to keep; None keeps all")
        self._directory = os.fspath(directory)
        self._keep = keep
        self._read_only = bool(read_only)
        self._is_local = "://" not in self._directory
        self._locked = False
        self._pending_step: int | None = None
        self._failed = False  # a save failed (and was said): Orbax's later echoes of it are dropped
        self._quiet = QuietSaveErrors()
        self._closed = True  # until the manager exists: close() then has nothing to release
        if self._is_local:
            self._directory = os.path.abspath(self._directory)
            if self._read_only:
                if not os.path.isdir(self._directory):
                    raise CheckpointError(
                        f"Expected an existing checkpoint directory to read. Received {self._directory!r}, "
                        "which is not a directory. Pass the checkpoint_dir that fit(checkpoint_dir=...) wrote."
                    )
            else:
                self._directory, self._locked = claim_directory(self._directory)
        if jax.process_count() > 1:
            use_distributed_barriers()
        stop_tensorstore_metric_leak()
        stop_tensorstore_spec_leak()
        try:
            self._manager = ocp.CheckpointManager(
                self._directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=keep,
                    enable_async_checkpointing=async_save,
                    # Removes `<step>.orbax-checkpoint-tmp-*` left by a crash during a save.
                    cleanup_tmp_directories=not self._read_only,
                    read_only=self._read_only,
                    create=not self._read_only,
                ),
                item_handlers={
                    "state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(),
                    "integrity": IntegrityHandler(),
                },
            )
        except BaseException:
            self._unlock()
            raise
        self._closed = False
        if not self._read_only:
            close_at_exit(self)

    def _unlock(self) -> None:
        if self._locked:
            self._locked = False
            release(self._directory)

    # ---- properties ------------------------------------------------------------------------------

    @property
    def directory(self) -> str:
        """The checkpoint directory (absolute for local paths)."""
        return self._directory

    @property
    def keep(self) -> int | None:
        """How many of the newest checkpoints are kept (``None``: all)."""
        return self._keep

    @property
    def read_only(self) -> bool:
        """Whether this checkpointer only reads (``Checkpointer(..., read_only=True)``)."""
        return self._read_only

    # ---- saving ----------------------------------------------------------------------------------

    @checkpoint_time
    def save(self, step: int, state: PyTree, meta: Mapping[str, Any]) -> bool:
        """Starts writing ``state`` and ``meta`` as checkpoint ``step``; returns before the write ends.

        Blocks only while the arrays are copied to host memory (and while a previous save is still
        being written); the files, and the checksums of the integrity record, are written in the
        background, so the arrays may be donated to the next step (or deleted) as soon as ``save``
        returns. Call :meth:`wait` (or :meth:`close`) before relying on the files. Must be called
        by every process with the same ``step``.

        Nothing is written when a floating-point variable holds NaN or Inf: a
        :class:`CheckpointWarning` names it, and the previous checkpoint stays the newest (none is
        deleted to make room). With one process the values are checked in the background, so the
        save is abandoned there and the warning comes from the next :meth:`save`, :meth:`wait`,
        :meth:`close` or restore; with several, the check is done before the save starts and
        ``save`` returns ``False``. It also returns ``False``, writing nothing, when checkpoint
        ``step`` already exists (e.g. a run that resumed at ``step`` and ends there).

        Args:
            step: The number of optimizer steps taken so far (>= 0); names the checkpoint.
            state: The pytree of ``jax.Array``s to save, e.g. a :class:`mirrorax.TrainState` (stored
                as its dict, ``{"params": {...}, "model_state": {...}, ..., "step": ...}``) or any
                dict of arrays.
            meta: JSON-able dict (numpy numbers are converted): data position, history, config.

        Returns:
            ``True`` when a save was started, ``False`` when it was skipped (see above).

        Raises:
            ValueError: ``step`` is not a non-negative int.
            TypeError: ``meta`` is not a dict of JSON values (the message names the bad entry).
            CheckpointError: ``step`` is older than the newest checkpoint in the directory, the
                checkpointer is read-only, or the previous save failed to write (disk full: the
                message names the step and the newest good checkpoint).

        Example:
            >>> ckpt.save(100, state, {"epoch": 1, "batch_in_epoch": 36})  # doctest: +SKIP
            True
        """
        self._check_open()
        if self._read_only:
            raise CheckpointError(
                f"This Checkpointer for {self._directory} is read-only (read_only=True): it cannot save. "
                "Open the directory with Checkpointer(directory) to write checkpoints."
            )
        check_int("step", step, 0)
        step = int(step)
        state = savable(stored(state))
        check_savable(state)
        if not isinstance(meta, Mapping):
            raise TypeError(
                f"Expected meta to be a dict of JSON values. Received: meta={meta!r:.80} (of type "
                f"{type(meta).__name__}). Pass e.g. meta={{'epoch': 3}}."
            )
        clean_meta = json_clean(meta, "")
        meta_sha256 = meta_digest(clean_meta)
        # Orbax writes the newest steps after waiting for the previous save, so the listing is
        # current only after that save is done.
        self._finish()
        latest = self.latest_step()
        if latest is not None and step == latest:
            return False
        if latest is not None and step < latest:
            raise CheckpointError(
                f"Cannot save step {step} into {self._directory}: it already holds the newer "
                f"checkpoint {latest}. Resume from it (Checkpointer.restore_latest) or write this run "
                "into a fresh directory."
            )
        if jax.process_count() == 1:
            # Host arrays of the values (aliases of the device buffers on CPU), summed with the
            # writes: a reduction over the whole state on the devices, waited for here, would cost
            # the loop more than Orbax's own copy does.
            integrity = IntegritySave(step, pending=HostDigest(state), meta_sha256=meta_sha256)
        else:
            # Each process holds only its shards, so the sums need the devices' collectives, which
            # must be dispatched from here, in the same order on every process as the train steps.
            checksums, non_finite = digest(state)
            if non_finite:
                self._warn_non_finite(step, non_finite, stacklevel=2)
                return False
            integrity = IntegritySave(step, checksums=checksums, meta_sha256=meta_sha256)
        if not debug_checks():
            self._quiet.start()
        try:
            started = bool(
                self._manager.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state),
                        meta=ocp.args.JsonSave(clean_meta),
                        integrity=integrity,
                    ),
                    force=True,
                )
            )
        except Exception as exc:  # noqa: BLE001 - a failed write (disk full, permissions) said in one line
            close_abandoned_writes()
            self._quiet.stop(failed=True)
            self._remove_unfinished(step)
            self._manager.reload()
            self._raise_save_failed(step, exc)
        self._pending_step = step if started else None
        return started

    @checkpoint_time
    def wait(self) -> None:
        """Blocks until every started save is on disk (raises the error of a failed background write)."""
        self._finish()

    @checkpoint_time
    def close(self) -> None:
        """Waits for pending saves, then releases Orbax's threads and the directory's lock. Safe to
        call twice."""
        if self._closed:
            return
        self._closed = True
        forget_at_exit(self)
        try:
            self._finish()
        finally:
            try:
                self._close_manager()
            finally:
                self._unlock()

    def _close_manager(self) -> None:
        """Orbax's close. After a failed save (said already, in one line) Orbax's echoes of it are dropped:
        the same error raised again by its close, tracebacks logged from its background threads (one still
        creating the step's directories meets executors already shut down): the clean error stays the last
        word."""
        if not self._failed:
            self._manager.close()
            return
        self._quiet.start()
        try:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001, S110 - an echo of the failure already raised
                pass
            close_abandoned_writes()
        finally:
            self._quiet.end()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        ro = ", read_only=True" if self._read_only else ""
        return f"Checkpointer({self._directory!r}, keep={self._keep!r}{ro})"

    # ---- small helpers ---------------------------------------------------------------------------

    def _finish(self) -> None:
        """Waits for the pending save; one abandoned for NaN or Inf leaves no trace but a warning."""
        step, self._pending_step = self._pending_step, None
        try:
            self._manager.wait_until_finished()
            self._quiet.stop(failed=False)
        except NonFiniteState as refused:
            self._quiet.stop(failed=True)
            # The step was never finalised. Orbax forgets its list of steps after a failed save:
            # re-read it, or the next saves would not count the older checkpoints towards `keep`.
            # Its temporary directory stays (the array writes may still be going on) until the next
            # Checkpointer opens the directory, as after a crash.
            self._manager.reload()
            self._warn_non_finite(refused.step, refused.paths, stacklevel=3)
        except Exception as exc:  # noqa: BLE001 - a failed background write (disk full...) in one line
            close_abandoned_writes()  # their echoes come now, while the hook holds them back
            self._quiet.stop(failed=True)
            self._remove_unfinished(step)
            self._manager.reload()
            self._raise_save_failed(step, exc)

    def _remove_unfinished(self, step: int | None) -> None:
        """Removes the temporary directory of a save that failed to write (``<step>.orbax-checkpoint-tmp*``):
        its writes have ended, and a full disk gets its space back now, not when the directory is next
        opened. Process 0, for the job; best effort (what it cannot remove, the next opening does)."""
        if step is None or not self._is_local or jax.process_index() != 0:
            return
        for leftover in glob.glob(os.path.join(glob.escape(self._directory), f"{step}.orbax-checkpoint-tmp*")):
            shutil.rmtree(leftover, ignore_errors=True)

    def _raise_save_failed(self, step: int | None, exc: BaseException) -> None:
        """Raises the one-line :class:`CheckpointError` for a save that failed to write.

        Orbax's own error (hundreds of lines of traceback through its threads) is kept as the error's
        ``cause`` attribute, and chained as ``__cause__`` under ``MIRRORAX_DEBUG=1``.
        """
        try:
            latest = self.latest_step()
        except Exception:  # noqa: BLE001 - the listing itself may fail on a broken file system
            latest = None
        error = save_failed(self._directory, step, exc, latest)
        error.cause = exc  # type: ignore[attr-defined]
        self._failed = True
        if debug_checks():
            raise error from exc
        raise error from None

    def _warn_non_finite(self, step: int, paths: list[str], stacklevel: int) -> None:
        """The warning for a state refused for NaN or Inf; ``stacklevel`` as :meth:`_warn`'s."""
        latest = self.latest_step()
        self._warn(
            stacklevel=stacklevel + 1,
            message=f"Checkpoint step {step} was not saved: variable {paths[0]!r}"
            + (f" (and {len(paths) - 1} more)" if len(paths) > 1 else "")
            + f" holds NaN or Inf. The newest checkpoint in {self._directory} stays "
            f"{latest if latest is not None else '(none)'}.",
        )
