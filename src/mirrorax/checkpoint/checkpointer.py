"""Checkpoints of the whole training state, written asynchronously, restorable on any device count.

A checkpoint is one Orbax step directory ``<directory>/<step>/`` with three items:

* ``state``: the state pytree (parameters, optimizer state, non-trainable state, metric
  accumulators, step, RNG), saved with ``StandardSave``. A :class:`mirrorax.TrainState` is stored as
  its plain dict (:meth:`~mirrorax.TrainState.as_dict`: the field names as keys, each group's own tree
  below, the four counters as one array, ``counters``). Checkpoints written before the counters were
  packed (``step``, ``skipped``, ... as entries of their own) restore into a state of one
  ``counters``: they are read in their form, then packed;
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
the next time a :class:`Checkpointer` opens the directory).

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

import datetime
import errno
import functools
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mirrorax._checks import check_int
from mirrorax._version import __version__
from mirrorax.checkpoint.dir_lock import DirectoryLocked, acquire, release
from mirrorax.checkpoint.integrity_item import (
    FORMAT_VERSION,
    IntegrityHandler,
    IntegrityRestore,
    IntegritySave,
    NonFiniteState,
    meta_digest,
)
from mirrorax.checkpoint.job import placed_like, process_0_directory, restorable, savable, use_distributed_barriers
from mirrorax.checkpoint.orbax_quirks import (
    QuietSaveErrors,
    before_executors_shut_down,
    close_abandoned_writes,
    drain_abandoned_reads,
    dropping_orbax_read_errors_of_abandoned_reads,
    stop_tensorstore_metric_leak,
    stop_tensorstore_spec_leak,
)
from mirrorax.cluster.consistency import debug_checks
from mirrorax.cluster.failure import die
from mirrorax.cluster.watchdog import in_checkpoint
from mirrorax.integrity import HostDigest, all_finite, digest, path_str
from mirrorax.train_state import COUNTERS, TrainState, pack_counters

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "Checkpointer",
    "all_finite",
]

PyTree = Any

# Damaged steps are moved here (inside the checkpoint directory) so that Orbax no longer counts them:
# left in place, a damaged step 300 would be "latest", would count towards `keep` and would block
# the resumed run from saving step 300 again.
DAMAGED_SUBDIR = "damaged"


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _checkpoint_time(method: _Method) -> _Method:
    """The method's time is the file system's: ``mirrorax launch``'s watchdog does not count it (its
    bound applies to steps and input; a save of a large state may take minutes)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with in_checkpoint():
            return method(self, *args, **kwargs)

    return cast(_Method, run)


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be used (not writable, or every checkpoint in it is damaged)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was written by a different model: its variables differ in name, shape or dtype."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged) or a save was refused (non-finite state)."""


# --------------------------------------------------------------------------------------------------
# Helpers for the structural comparison and for messages.


def _describe(shape: Any, dtype: Any) -> str:
    return f"shape={tuple(shape)} dtype={np.dtype(dtype).name if dtype is not None else None}"


def _stored_form(leaf: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) as Orbax records it: typed PRNG keys are stored as their uint32 key data."""
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(leaf.shape), leaf.dtype


def _first_mismatch(stored: Any, abstract: PyTree) -> str | None:
    """A sentence naming the first variable whose presence, shape or dtype differs, or ``None``."""
    stored_flat = dict(
        (path_str(p), leaf)
        for p, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]
    )
    wanted = [(path_str(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    for path, leaf in wanted:
        shape, dtype = _stored_form(leaf)
        if path not in stored_flat:
            return f"variable {path!r} ({_describe(shape, dtype)}) is missing from the checkpoint"
        got = stored_flat[path]
        got_shape = tuple(getattr(got, "shape", ()) or ())
        got_dtype = getattr(got, "dtype", None)
        if got_shape != shape or (got_dtype is not None and np.dtype(got_dtype) != np.dtype(dtype)):
            return (
                f"variable {path!r} is {_describe(got_shape, got_dtype)} in the checkpoint but "
                f"{_describe(shape, dtype)} in the model"
            )
    extra = sorted(set(stored_flat) - {p for p, _ in wanted})
    if extra:
        return (
            f"the checkpoint holds variable {extra[0]!r} that the model does not have"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    return None


def _stored(tree: PyTree) -> PyTree:
    """The tree Orbax writes and reads for ``tree``: a :class:`TrainState` as its plain dict, any other
    tree as is."""
    return tree.as_dict() if isinstance(tree, TrainState) else tree


def _unpacked_form(like: TrainState) -> dict[str, PyTree]:
    """The stored tree of checkpoints written before the counters were packed: the counters as entries
    of their own (of ``like``'s shapes)."""
    values = like.as_dict()
    del values["counters"]
    values.update({k: getattr(like, k) for k in COUNTERS})
    return values


def _is_unpacked_form(stored: Any, like: PyTree) -> bool:
    """Whether checkpoint tree ``stored`` (its metadata) is of :func:`_unpacked_form` while ``like`` is a
    :class:`TrainState` (whose stored form has one ``counters``)."""
    return isinstance(like, TrainState) and isinstance(stored, Mapping) and "counters" not in stored \
        and "step" in stored


def _typed(restored: PyTree, like: PyTree) -> PyTree:
    """A restored tree in the type of the abstract tree it was restored for (:func:`_stored` undone; the
    counters of a tree of :func:`_unpacked_form` packed as ``like``'s are, on their layout)."""
    if not isinstance(like, TrainState):
        return restored
    values = dict(restored)
    if "counters" not in values:
        apart = {k: values.pop(k) for k in COUNTERS}
        sharding = jax.tree.map(lambda a: a.sharding, like.counters)
        values["counters"] = jax.jit(lambda c: pack_counters(**c), out_shardings=sharding)(apart)
    return TrainState.from_dict(values)


# Orbax appends a bound method's repr (a pybind11 name, then a TensorStore spec over dozens of lines).
_TENSORSTORE_DETAILS = re.compile(r"\.?\s*See full TensorStore details:.*$", re.DOTALL)


def _short(exc: BaseException) -> str:
    """``'ValueError: first line of the message (caused by OSError: ...)'``, at most 400 characters
    (the start and the end of a longer one)."""

    def line(e: BaseException) -> str:
        lines = _TENSORSTORE_DETAILS.sub("", str(e)).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"

    text = line(exc)
    if exc.__cause__ is not None:
        text += f" (caused by {line(exc.__cause__)})"
    return text if len(text) <= 400 else text[:200] + " ... " + text[-195:]  # the end says what failed


def _check_savable(state: PyTree) -> None:
    """Refuses, before Orbax sees it, a leaf Orbax cannot write (a string, an object, an empty array).

    Orbax refuses them too, but from inside its save, after some of its background threads started
    waiting for the rest of the save: those then wait for good, and the program hangs at exit.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = path_str(path) or "the top level"
        if isinstance(leaf, (bool, int, float)):
            continue
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(f"Expected the state to save to hold jax.Arrays, numpy arrays and Python numbers. "
                            f"Received {leaf!r:.80} (of type {type(leaf).__name__}) at {where!r}. Convert it "
                            "(np.asarray) or keep it in the meta record (JSON).")
        dtype = np.dtype(leaf.dtype) if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else None
        if dtype is not None and not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
            raise TypeError(f"Expected the arrays of the state to save to hold numbers. Received an array of dtype "
                            f"{dtype} at {where!r}. Encode it as numbers, or keep it in the meta record (JSON).")
        if leaf.size == 0:
            raise ValueError(f"Expected the arrays of the state to save to hold at least one element (Orbax "
                             f"writes no empty array). Received shape {tuple(leaf.shape)} at {where!r}. Leave it "
                             "out of the state.")


def _storage_fault(exc: BaseException) -> str | None:
    """The file-system error behind a failed save (``"ENOSPC: No space left on device"``), or ``None`` when
    the failure is not the storage's (Orbax refusing a value, a bug)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            name = errno.errorcode.get(error.errno, "OSError") if error.errno is not None else "OSError"
            return f"{name}: {error.strerror or error}"
        text = str(error)
        for code in ("ENOSPC", "EDQUOT", "EFBIG", "EACCES", "EROFS", "EPERM", "EIO"):
            if code in text or (os.strerror(getattr(errno, code)) in text):
                return f"{code}: {os.strerror(getattr(errno, code))}"
        error = error.__cause__ or error.__context__
    return None


def _json_clean(value: Any, where: str) -> Any:
    """A copy of ``value`` made of JSON types only (numpy scalars and arrays become Python values)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"Expected the checkpoint meta to have string keys. Received key {k!r} "
                    f"(of type {type(k).__name__}) at {where or 'the top level'}. "
                    "Convert the key with str()."
                )
            out[k] = _json_clean(v, f"{where}/{k}" if where else k)
        return out
    if isinstance(value, (list, tuple)):
        return [_json_clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (np.ndarray, jax.Array)):
        return _json_clean(np.asarray(value).tolist(), where)
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"Expected the checkpoint meta to hold JSON values (dict, list, str, int, float, bool, None "
        f"or numpy numbers). Received {value!r} (of type {type(value).__name__}) at {where!r}. "
        "Convert it to one of those types before saving."
    )


# --------------------------------------------------------------------------------------------------


class Checkpointer:
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
                self._open_for_writing()
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
            _writing(self)

    def _open_for_writing(self) -> None:
        """Proves the directory writable and takes its lock: process 0 for the job, which then tells the
        others its directory (the job's checkpoint, whatever directory they named) and whether it took the
        lock; a refusal is raised on every process, before any collective."""
        refusal: str | None = None
        failure: BaseException | None = None
        if jax.process_index() == 0:
            try:
                _check_writable(self._directory)
                message = acquire(self._directory)
            except (CheckpointError, DirectoryLocked) as exc:
                refusal, failure = str(exc), exc
            else:
                self._locked = True
                if message:
                    print(f"mirrorax: {message}", file=sys.stderr, flush=True)
        if jax.process_count() > 1:
            self._directory, verdict = process_0_directory(self._directory, {"refusal": refusal})
            refusal = verdict.get("refusal")
            if refusal is None and jax.process_index() != 0:
                _check_writable(self._directory)  # this process writes its shards there too
        if isinstance(failure, CheckpointError):
            raise failure
        if refusal is not None:
            raise CheckpointError(refusal)

    def _unlock(self) -> None:
        if self._locked:
            self._locked = False
            release(self._directory)

    # ---- properties and listing ------------------------------------------------------------------

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

    def all_steps(self) -> list[int]:
        """Steps of the finished checkpoints in the directory, ascending (in-progress saves excluded)."""
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step, or ``None`` when there is none.

        This does not read the checkpoint; :meth:`restore_latest` may still find it damaged.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---- saving ----------------------------------------------------------------------------------

    @_checkpoint_time
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
        state = savable(_stored(state))
        _check_savable(state)
        if not isinstance(meta, Mapping):
            raise TypeError(
                f"Expected meta to be a dict of JSON values. Received: meta={meta!r:.80} (of type "
                f"{type(meta).__name__}). Pass e.g. meta={{'epoch': 3}}."
            )
        clean_meta = _json_clean(meta, "")
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
            self._quiet.stop(failed=True)
            self._raise_save_failed(step, exc)
        self._pending_step = step if started else None
        return started

    @_checkpoint_time
    def wait(self) -> None:
        """Blocks until every started save is on disk (raises the error of a failed background write)."""
        self._finish()

    @_checkpoint_time
    def close(self) -> None:
        """Waits for pending saves, then releases Orbax's threads and the directory's lock. Safe to
        call twice."""
        if self._closed:
            return
        self._closed = True
        _OPEN.pop(id(self), None)
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
            self._quiet.stop(failed=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        ro = ", read_only=True" if self._read_only else ""
        return f"Checkpointer({self._directory!r}, keep={self._keep!r}{ro})"

    # ---- restoring -------------------------------------------------------------------------------

    @_checkpoint_time
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

    @_checkpoint_time
    def restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Restores checkpoint ``step`` onto the shardings named in ``abstract_state``.

        Args:
            step: A step from :meth:`all_steps`.
            abstract_state: The state's tree with a ``jax.ShapeDtypeStruct(shape, dtype,
                sharding=...)`` per variable, carrying the shardings of *this* run (see
                :meth:`restore_latest`).

        Returns:
            ``(state, meta)``.

        Raises:
            TypeError: ``abstract_state`` is not a tree of ``jax.ShapeDtypeStruct`` / arrays.
            CheckpointMismatchError: The checkpoint's variables differ from ``abstract_state``.
            CheckpointError: The checkpoint does not exist or is damaged (the message says how), or
                was written by a newer mirrorax.
        """
        self._check_open()
        _check_abstract(abstract_state, "restore")
        self._finish()
        if step not in self.all_steps():
            raise CheckpointError(
                f"No checkpoint for step {step} in {self._directory}. "
                f"Available steps: {self.all_steps()}."
            )
        result = self._try_restore(step, abstract_state)
        if isinstance(result, str):
            raise CheckpointError(f"Checkpoint step {step} in {self._directory} is damaged: {result}.")
        return result

    @_checkpoint_time
    def restore_latest(self, abstract_state: PyTree) -> tuple[int, PyTree, dict[str, Any]] | None:
        """Restores the newest good checkpoint onto the shardings named in ``abstract_state``.

        Damaged checkpoints (truncated, missing or corrupted files, checksum mismatch) are skipped
        newest first, each with a :class:`CheckpointWarning` naming its step and what was wrong, and
        moved into ``<directory>/damaged/`` so that the resumed run can write those steps again.

        Args:
            abstract_state: The state's tree with a ``jax.ShapeDtypeStruct(shape, dtype,
                sharding=...)`` per variable; the shardings are this run's (that is how a checkpoint
                from 8 devices lands on 4). Build it from the freshly initialised state with
                ``jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                sharding=x.sharding), state)``.

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
        _check_abstract(abstract_state, "restore_latest")
        self._finish()
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            result = self._try_restore(step, abstract_state)
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

    def _try_restore(self, step: int, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]] | str:
        """``(state, meta)``, or a sentence saying why checkpoint ``step`` is damaged; ``state`` of the
        type of ``abstract_state`` (a :class:`TrainState` restores a dict-form checkpoint)."""
        like, abstract_state = abstract_state, _stored(abstract_state)
        step_dir = self._manager.directory / str(step)
        if not any((step_dir / item).exists() for item in ("state", "integrity")):
            if (step_dir / "meta").exists():
                return "it is incomplete (it holds only its 'meta' record, no 'state' nor 'integrity')"
            # Not damage: someone else's checkpoint (e.g. Keras's OrbaxCheckpoint). Leave it alone.
            raise CheckpointError(
                f"Step directory {step_dir} was not written by mirrorax (it has neither a 'state' "
                "nor an 'integrity' item). Point checkpoint_dir at a directory of its own."
            )
        record = self._read_integrity(step)
        if isinstance(record, str):
            return record
        try:
            metadata = self._manager.item_metadata(step)
            stored = metadata["state"] if metadata is not None else None
        except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged checkpoint
            return f"its variable metadata cannot be read ({_short(exc)})"
        if stored is None:
            return "its variable metadata is missing"
        stored_tree = getattr(stored, "tree", stored)
        if _is_unpacked_form(stored_tree, like):  # written before the counters were packed
            abstract_state = _unpacked_form(like)
        mismatch = _first_mismatch(stored_tree, abstract_state)
        if mismatch is not None:
            raise CheckpointMismatchError(
                f"Checkpoint step {step} in {self._directory} was written by a different model: "
                f"{mismatch}. Build the same model (same layers, shapes and dtypes) to resume from "
                "it, or point checkpoint_dir at a fresh directory."
            )
        failure = None
        with dropping_orbax_read_errors_of_abandoned_reads():
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(restorable(abstract_state)),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged checkpoint
                failure = f"reading it failed ({_short(exc)})"
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
        typed = _typed(state, like)
        if isinstance(typed, TrainState):
            held_step = int(typed.host_counters()["step"])
            if held_step != step:
                return f"its state says step {held_step}, its directory step {step}"
        return typed, meta

    def _read_integrity(self, step: int) -> dict[str, Any] | str:
        """The integrity record of checkpoint ``step``, or why it is damaged.

        Raises:
            CheckpointError: The record has a newer format than this mirrorax reads.
        """
        try:
            record = self._manager.restore(step, args=ocp.args.Composite(integrity=IntegrityRestore()))["integrity"]
        except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged checkpoint
            return f"its integrity record cannot be read ({_short(exc)})"
        fmt = record.get("format") if isinstance(record, dict) else None
        if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
            return f"its integrity record is malformed (format {fmt!r})"
        if fmt > FORMAT_VERSION:
            raise CheckpointError(
                f"Checkpoint step {step} in {self._directory} was written by a newer mirrorax (checkpoint "
                f"format {fmt}; this mirrorax {__version__} reads formats up to {FORMAT_VERSION}). Upgrade "
                "mirrorax (pip install -U mirrorax) to resume from it, or point checkpoint_dir at a fresh "
                "directory. Nothing was moved or changed."
            )
        if not isinstance(record.get("checksums"), dict):
            return "its integrity record is malformed (no checksums)"
        if record.get("step") != step:
            return f"its integrity record is of step {record.get('step')!r}, its directory step {step}"
        return record

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
            self._manager.reload()
            self._raise_save_failed(step, exc)

    def _raise_save_failed(self, step: int | None, exc: BaseException) -> None:
        """Raises the one-line :class:`CheckpointError` for a save that failed to write.

        Orbax's own error (hundreds of lines of traceback through its threads) is kept as the error's
        ``cause`` attribute, and chained as ``__cause__`` under ``MIRRORAX_DEBUG=1``.
        """
        try:
            latest = self.latest_step()
        except Exception:  # noqa: BLE001 - the listing itself may fail on a broken file system
            latest = None
        newest = (f"the newest good checkpoint is step {latest}" if latest is not None
                  else "there is no good checkpoint yet")
        what = f"step {step}" if step is not None else "a step"
        storage = _storage_fault(exc)
        if storage is not None:
            fix = (f"Free space on that file system (or fix its permissions: {storage}) and run the same "
                   "command again to resume from the newest good checkpoint")
        else:  # the values, not the disk: advice about the disk would send the user the wrong way
            fix = ("Nothing is wrong with the file system: Orbax refused what it was given to write. Save "
                   "jax.Arrays, numpy arrays and Python numbers (Keras variables through mx.Checkpoint), and "
                   "report this error with the state's structure if it holds only those")
        error = CheckpointError(
            f"Checkpoint {what} could not be written to {self._directory}: {_short(exc)}; {newest}. {fix} "
            "(set MIRRORAX_DEBUG=1 for Orbax's full traceback)."
        )
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


#: The writing checkpointers not closed yet, closed (their saves finished) when the program ends.
_OPEN: dict[int, Checkpointer] = {}
_exit_hook_registered = False


def _writing(checkpointer: Checkpointer) -> None:
    """Records an open writing checkpointer, so that its pending save is finished when the program ends."""
    global _exit_hook_registered
    _OPEN[id(checkpointer)] = checkpointer
    if not _exit_hook_registered:
        _exit_hook_registered = True
        before_executors_shut_down(_close_at_exit)


def _close_at_exit() -> None:
    """Closes every checkpointer still open when the program ends: a save started as its last act is
    finished, never left a temporary directory. A save that fails then is said in one line and the process
    exits with status 1 (the newest checkpoint is then the one before)."""
    failure: Exception | None = None
    while _OPEN:
        _, checkpointer = _OPEN.popitem()
        try:
            checkpointer.close()
        except Exception as exc:  # noqa: BLE001 - said below, once every checkpointer was closed
            failure = failure or exc
    if failure is not None:
        die(f"mirrorax: {type(failure).__name__}: {failure}", 1)


def _check_writable(directory: str) -> None:
    """Creates ``directory`` if needed and proves that this process can write files in it."""
    hint = "Pass a checkpoint directory on a writable file system (or fix its permissions)."
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(
            f"Expected the checkpoint directory to be a directory. Received {directory!r}, which is "
            f"an existing file. {hint}"
        )
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            f"Cannot create the checkpoint directory {directory!r}: {_short(exc)}. {hint}"
        ) from exc
    # os.access() says yes to root on a read-only mount; only writing a file proves it works.
    probe = os.path.join(directory, f".mirrorax-write-test-{os.getpid()}-{jax.process_index()}")
    try:
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(
            f"The checkpoint directory {directory!r} is not writable: {_short(exc)}. {hint}"
        ) from exc


def _check_abstract(abstract_state: PyTree, method: str) -> None:
    """Refuses an ``abstract_state`` whose leaves are not shapes with dtypes (e.g. Keras variables)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract_state)
    for path, leaf in flat:
        if not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
            raise TypeError(
                f"Expected abstract_state of Checkpointer.{method} to be a tree of jax.ShapeDtypeStruct "
                f"(or arrays) carrying this run's shardings. Received a {type(leaf).__module__}."
                f"{type(leaf).__qualname__} at {path_str(path) or 'the top level'!r}. Build it from the "
                "state's arrays: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, "
                "sharding=x.sharding), state) (for a Keras model, from its variables' .value)."
            )
