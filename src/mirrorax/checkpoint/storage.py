"""The file system under both tiers: small files written atomically, a directory proved writable, a failed
write named in one line.

**Atomic small files.** An index, a lock, TF's ``checkpoint`` state file: each is written whole under a
temporary name beside its place (``.<name>.tmp-<pid>-<n>``), flushed to the device (``fsync``), then renamed
over the old one, and the directory entry flushed too. A reader sees the old file or the new one, never a
truncated one, whatever happens meanwhile (a full disk, a kill, a crash of the machine); a write that fails
removes its temporary file and leaves the old one as it was.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re

import jax

from mirrorax.checkpoint.errors import CheckpointError

__all__ = ["write_atomic", "sync_directory", "check_writable", "storage_fault", "short", "save_failed"]

_tmp_names = itertools.count()


def sync_directory(directory: str) -> None:
    """Flushes ``directory``'s entries (a rename, a new file) to the device; best effort (some file systems
    cannot open a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` as the file ``path``: a temporary file beside it, flushed, then renamed over it.

    Raises:
      OSError: the write failed (a full disk, permissions); ``path`` is as it was and no temporary file
        is left.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{next(_tmp_names)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    sync_directory(directory)


def check_writable(directory: str) -> None:
    """Creates ``directory`` if needed and proves that this process can write files in it.

    Raises:
      CheckpointError: it is a file, cannot be created, or a file cannot be written in it.
    """
    hint = "Pass a checkpoint directory on a writable file system (or fix its permissions)."
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(
            f"Expected the checkpoint directory to be a directory. Received {directory!r}, which is "
            f"an existing file. {hint}"
        )
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"Cannot create the checkpoint directory {directory!r}: {short(exc)}. {hint}") from exc
    # os.access() says yes to root on a read-only mount; only writing a file proves it works.
    probe = os.path.join(directory, f".mirrorax-write-test-{os.getpid()}-{jax.process_index()}")
    try:
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"The checkpoint directory {directory!r} is not writable: {short(exc)}. {hint}") from exc


def storage_fault(exc: BaseException) -> str | None:
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


# Orbax appends a bound method's repr (a pybind11 name, then a TensorStore spec over dozens of lines).
_TENSORSTORE_DETAILS = re.compile(r"\.?\s*See full TensorStore details:.*$", re.DOTALL)


def short(exc: BaseException) -> str:
    """``'ValueError: first line of the message (caused by OSError: ...)'``, at most 400 characters
    (the start and the end of a longer one)."""

    def line(e: BaseException) -> str:
        lines = _TENSORSTORE_DETAILS.sub("", str(e)).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"

    text = line(exc)
    if exc.__cause__ is not None:
        text += f" (caused by {line(exc.__cause__)})"
    return text if len(text) <= 400 else text[:200] + " ... " + text[-195:]  # the end says what failed


def save_failed(directory: str, step: int | None, exc: BaseException, latest: int | None) -> CheckpointError:
    """The one-line error of checkpoint ``step`` that could not be written to ``directory`` (``latest``: the
    newest good checkpoint): the file system's advice only for a file-system error, which it names."""
    newest = f"the newest good checkpoint is step {latest}" if latest is not None else "there is no good checkpoint yet"
    what = f"step {step}" if step is not None else "a step"
    storage = storage_fault(exc)
    if storage is not None:
        fix = (f"Free space on that file system (or fix its permissions: {storage}) and run the same "
               "command again to resume from the newest good checkpoint")
    else:  # the values, not the disk: advice about the disk would send the user the wrong way
        fix = ("Nothing is wrong with the file system: Orbax refused what it was given to write. Save "
               "jax.Arrays, numpy arrays and Python numbers (Keras variables through mx.Checkpoint), and "
               "report this error with the state's structure if it holds only those")
    return CheckpointError(f"Checkpoint {what} could not be written to {directory}: {short(exc)}; {newest}. {fix} "
                           "(set MIRRORAX_DEBUG=1 for Orbax's full traceback).")
