"""Keeps gloo's connection chatter out of what a process prints.

On every new communicator, gloo prints ``[Gloo] Rank R is connected to N peer ranks. Expected number of
connected peer ranks is : N`` once per CPU device, from C++ (``std::cout``), with no setting to silence it
(jaxlib 0.10). Each piece of the message is a write of its own and the devices' threads print at once, so
the messages come mangled into each other and into what the process prints itself (a print can land
inside one). Under ``mirrorax launch`` the launcher takes them out as it streams the output
(:class:`ChatterFilter`: the process's own lines come out whole). A process
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

# gloo writes each message in pieces (``std::cout << "[Gloo] Rank " << rank << " is connected to " ...``), each
# piece a write(2) of its own, so another thread's write, a print of this process's Python included, can
# land between any two. A piece and the number written after it:
_PIECES = re.compile(r"\[Gloo\] Rank \d*| ?is connected to \d*| ?peer ranks\. ?"
                     r"|Expected number of connected peer ranks is : \d*")
_MARK = "[Gloo] Rank"
_TAIL = "Expected number of connected peer ranks is :"  # (one write: whole wherever it lands)
_ENDS_MESSAGE = re.compile(re.escape(_TAIL) + r" \d*$")  # a line whose newline is gloo's (``std::endl``)

_state: dict[str, Any] = {}


def verbose(environ: Any = None) -> bool:
    """True when ``MIRRORAX_VERBOSE_COLLECTIVES`` asks to keep gloo's lines."""
    env = os.environ if environ is None else environ
    return env.get("MIRRORAX_VERBOSE_COLLECTIVES", "").strip().lower() in ("1", "true", "yes")


class ChatterFilter:
    """Takes gloo's connection messages out of one process's output, line by line (one filter per stream:
    it has state). What the process printed itself comes out whole, even when gloo's pieces landed in it.

    Example:
      >>> clean = ChatterFilter().clean
      >>> clean("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
      >>> clean("Epoch 1/3")
      'Epoch 1/3'
      >>> clean("[Gloo] Rank 2 is connected to 3 peer ranks. saved to /tmp/ckpt")  # a print landed inside
      'saved to /tmp/ckpt'
      >>> clean("Expected number of connected peer ranks is : 3")  # the rest of that message
      >>> clean("loss [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
      >>> clean("0.5")  # the print that gloo's message cut in two, joined again
      'loss 0.5'
    """

    def __init__(self) -> None:
        # Newlines still to come from messages begun on earlier lines: each message ends its own line, so
        # a line that starts k messages and ends none of them leaves k newlines for later (an empty line,
        # or the rest of a message).
        self.owed = 0
        self.pending = ""  # the start of a printed line that a message's newline cut off

    def clean(self, line: str) -> str | None:
        """``line`` (without its newline) with gloo's pieces taken out; None when nothing of it is left
        to show yet (it was all gloo's, or the start of a line that the next line completes)."""
        if _MARK in line or _TAIL in line or (self.owed and "peer ranks" in line):
            rest = _PIECES.sub("", line)
            gloos = not rest.strip(" 0123456789")  # nothing but gloo's pieces (and its numbers)
            ends = gloos or _ENDS_MESSAGE.search(line) is not None
            self.owed = max(0, self.owed + line.count(_MARK) - ends)
            if gloos:
                return None
            if ends:  # the newline was gloo's: the printed line goes on in the next one
                self.pending += rest
                return None
            line = rest
        elif self.owed and not line.strip():
            self.owed -= 1
            return None
        line, self.pending = self.pending + line, ""
        return line

    def flush(self) -> str | None:
        """What is left of a printed line at the end of the stream (None when nothing)."""
        line, self.pending = self.pending, ""
        return line or None


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
    chatter = ChatterFilter()
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
        out = [kept + b"\n" for kept in (_clean(chatter, line) for line in lines) if kept is not None]
        # A partial line (a progress bar's "\r" updates) goes out at once, unless it may be gloo's (or
        # goes on a line that gloo cut, which comes out when it ends).
        if (pending and not chatter.pending and b"[Gloo]" not in pending
                and not _MARK.encode().startswith(pending[:len(_MARK)])):
            out.append(pending)
            pending = b""
        # Once the real stdout is gone, keep reading (and dropping): a full pipe would block every print.
        broken = broken or not _write(out_fd, b"".join(out))
    if not broken:
        _write(out_fd, (chatter.flush() or "").encode() + pending)
    os.close(read_fd)


def _clean(chatter: ChatterFilter, line: bytes) -> bytes | None:
    """:meth:`ChatterFilter.clean` on bytes: a line it leaves as it was comes out byte for byte."""
    text = line.decode("utf-8", "replace")
    kept = chatter.clean(text)
    return None if kept is None else line if kept == text else kept.encode()


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
