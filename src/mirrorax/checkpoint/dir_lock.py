"""One writer per checkpoint directory: a lock file naming the run that writes it.

Two runs writing one directory corrupt each other's steps (Orbax renames, deletes for ``keep``, and
both number their steps the same way). The writer holds ``<directory>/.mirrorax-lock``, a JSON record
``{"host": ..., "pid": ..., "since": ...}`` created whole and atomically (a temporary file linked to its
place, which fails if the lock exists); a second run is refused at the start with the owner's host and pid.
A lock whose owner is a dead process of this host (a run killed with ``kill -9``, a crashed machine's
reboot) is taken over with a warning. A lock of another host cannot be checked from here: the error says
to delete the file if that run is over.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import os
import socket
import threading

__all__ = ["LOCK_NAME", "DirectoryLocked", "acquire", "release", "alive"]

LOCK_NAME = ".mirrorax-lock"

_held: dict[str, int] = {}  # lock path -> Checkpointers of this process holding it
_guard = threading.Lock()


class DirectoryLocked(RuntimeError):
    """The directory is locked by another live run (the message names its host and pid)."""


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is running (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read(path: str) -> dict[str, object]:
    try:
        with open(path) as fh:
            record = json.load(fh)
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _create(path: str) -> bool:
    """Creates the lock file for this process, whole at once; ``False`` if it exists.

    The record is written to a temporary file first and linked to ``path`` (``link`` fails if ``path``
    exists), so the lock never exists without its owner: a crash between creating and writing it would
    leave an empty lock that names no one and refuses every later run. (Where links are not supported,
    ``O_CREAT | O_EXCL``, then the write.)
    """
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": stamp}).encode()
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(record)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(record)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def acquire(directory: str) -> str | None:
    """Takes the lock of ``directory`` for this process.

    Returns ``None``, or a sentence to warn with when a stale lock (its owner is a dead process of
    this host) was taken over. Re-entrant within a process (a second Checkpointer of the same run).

    Raises:
        DirectoryLocked: another live process holds it (or one of another host, which cannot be
            checked).
    """
    path = os.path.join(directory, LOCK_NAME)
    with _guard:
        if _held.get(path):
            _held[path] += 1
            return None
        taken_over = None
        for _ in range(3):  # another run may take a stale lock over at the same moment
            if _create(path):
                _held[path] = 1
                return taken_over
            owner = _read(path)
            host, pid = owner.get("host"), owner.get("pid")
            here = host == socket.gethostname()
            if here and pid == os.getpid():  # left by this process (a Checkpointer never closed)
                _held[path] = 1
                return None
            if here and isinstance(pid, int) and not alive(pid):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                taken_over = (f"Took over the lock of checkpoint directory {directory}: its owner, process "
                              f"{pid} on this host ({host}), is no longer running.")
                continue
            if not owner and not os.path.exists(path):
                continue  # released meanwhile
            raise DirectoryLocked(
                f"Checkpoint directory {directory} is in use by another run (process {pid} on host {host}, "
                f"since {owner.get('since')}; lock file {path}). Two runs writing one directory overwrite "
                "each other's checkpoints. Wait for that run to end, give this run its own checkpoint_dir, "
                f"or, if that run is over (e.g. its host crashed), delete {path}."
            )
        raise DirectoryLocked(f"Could not take the lock {path}: other runs keep taking it. Retry.")


def release(directory: str) -> None:
    """Gives back this process's hold on the lock of ``directory`` (the file goes with the last)."""
    path = os.path.join(directory, LOCK_NAME)
    with _guard:
        count = _held.get(path, 0)
        if count > 1:
            _held[path] = count - 1
            return
        _held.pop(path, None)
        if count and _read(path).get("pid") == os.getpid():
            try:
                os.remove(path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise


@atexit.register
def _release_at_exit() -> None:
    """A process that ends without closing its Checkpointer (``sys.exit`` in a script) leaves no lock."""
    for path in list(_held):
        _held[path] = 1
        release(os.path.dirname(path))
