"""Keeps gloo's connection chatter out of what a process prints.

On every new communicator, gloo prints ``[Gloo] Rank R is connected to N peer ranks. Expected number of
connected peer ranks is : N`` once per CPU device, from C++ (``std::cout``), with no setting to silence it
(jaxlib 0.10); the devices' threads print at once, so the lines come mangled into each other. Under
``mirrorax launch`` the launcher drops them as it streams the output (:class:`ChatterFilter`). A process
of a CPU job started otherwise (``srun``, ``mpirun``, by hand) routes its file descriptor 1 through a
pipe (a pseudo-terminal when it was a terminal, so that ``isatty()`` stays true) to a small relay
process that copies everything but those lines to the real stdout (:func:`install`). ``MIRRORAX_VERBOSE_COLLECTIVES=1``
keeps them in both cases.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
from typing import Any

__all__ = ["ChatterFilter", "install", "restore", "verbose"]

# Everything one of gloo's lines (or a mangle of several) is made of.
_FRAGMENTS = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks "
                        r"is :|\d+|\s+")
_MARK = "[Gloo] Rank"

_state: dict[str, Any] = {}


def verbose(environ: Any = None) -> bool:
    """True when ``MIRRORAX_VERBOSE_COLLECTIVES`` asks to keep gloo's lines."""
    env = os.environ if environ is None else environ
    return env.get("MIRRORAX_VERBOSE_COLLECTIVES", "").strip().lower() in ("1", "true", "yes")


class ChatterFilter:
    """Says which lines of one process's output to keep (one filter per stream: it has state).

    Example:
      >>> keep = ChatterFilter().keep
      >>> keep("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
      False
      >>> keep("Epoch 1/3")
      True
    """

    def __init__(self) -> None:
        # Newlines still to come from mangled messages: each message ends its own line, so a line that
        # holds k of them leaves k - 1 newlines for later (an empty line, or the rest of a fragment).
        self.owed = 0

    def keep(self, line: str) -> bool:
        """False for gloo's connection lines, their fragments and the empty lines they leave."""
        if _MARK in line or (self.owed and "peer ranks" in line):
            if not _FRAGMENTS.sub("", line):
                self.owed = max(0, self.owed + line.count(_MARK) - 1)
                return False
        elif self.owed and not line.strip():
            self.owed -= 1
            return False
        return True


def install() -> bool:
    """Routes file descriptor 1 through a relay process that drops the chatter, until :func:`restore`.

    The relay is a process, not a thread, so that what this process printed last still comes out when
    it dies suddenly (SIGKILL, an abort from C++): the relay reads the pipe to its end. It ignores
    SIGINT, SIGTERM and SIGHUP (a Ctrl-C or a preemption must not break this process's stdout) and
    leaves when every writer has closed the pipe.

    Returns:
      True if it was installed now; False if already installed or stdout cannot be duplicated.
    """
    if _state:
        return False
    try:
        sys.stdout.flush()
        original = os.dup(1)
    except (OSError, ValueError):
        return False
    if os.isatty(original):
        read_fd, write_fd = os.openpty()
        _as_terminal(original, write_fd)
    else:
        read_fd, write_fd = os.pipe()
    try:
        relay = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__)], stdin=read_fd,
                                 stdout=original, stderr=subprocess.DEVNULL)
    except OSError:
        for fd in (read_fd, write_fd, original):
            os.close(fd)
        return False
    os.close(read_fd)
    os.dup2(write_fd, 1)
    os.close(write_fd)
    _state.update(original=original, relay=relay)
    atexit.register(restore)
    return True


def restore() -> None:
    """Gives file descriptor 1 back, once the relay copied what was written before (bounded: 2 s)."""
    if not _state:
        return
    original, relay = _state.pop("original"), _state.pop("relay")
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os.dup2(original, 1)  # closes our end of the pipe: the relay reads to the end and leaves
    os.close(original)
    try:
        relay.wait(timeout=2.0)
    except subprocess.TimeoutExpired:  # a child process of ours still holds the pipe: the relay stays
        pass


def _as_terminal(terminal: int, pty: int) -> None:
    """The pseudo-terminal gets the real one's size, and passes bytes unchanged (the real terminal
    translates newlines itself)."""
    try:
        import fcntl
        import termios

        fcntl.ioctl(pty, termios.TIOCSWINSZ, fcntl.ioctl(terminal, termios.TIOCGWINSZ, b"\0" * 8))
        attrs = termios.tcgetattr(pty)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(pty, termios.TCSANOW, attrs)
    except (ImportError, OSError):
        pass


def _copy(read_fd: int, out_fd: int) -> None:
    keep = ChatterFilter().keep
    pending, broken = b"", False
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:  # EIO: a pseudo-terminal whose last writer closed
            chunk = b""
        if not chunk:
            break
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        out = [line + b"\n" for line in lines if keep(line.decode("utf-8", "replace"))]
        # A partial line (a progress bar's "\r" updates) goes out at once, unless it may be gloo's.
        if pending and b"[Gloo]" not in pending and not _MARK.encode().startswith(pending[:len(_MARK)]):
            out.append(pending)
            pending = b""
        # Once the real stdout is gone, keep reading (and dropping): a full pipe would block every print.
        broken = broken or not _write(out_fd, b"".join(out))
    if not broken:
        _write(out_fd, pending)
    os.close(read_fd)


def _write(fd: int, data: bytes) -> bool:
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:
            return False
    return True


if __name__ == "__main__":  # the relay: stdin is the pipe (or pseudo-terminal), stdout the real stdout
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, signal.SIG_IGN)
    _copy(0, 1)
