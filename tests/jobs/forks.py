"""A fork server: one process imports the libraries once, then forks a fresh child per job.

Each child starts from a process in which nothing has run (no Keras names, no devices, no compiled
programs, no global policy) and sees no other job's state, but pays no import: about 9 s of CPU each for
JAX, Keras, optax and mirrorax. JAX forbids a fork once its backend is up (it warns, and a warning is an
error in the tests), so the server imports without starting it and checks that it did not.

A job is a list of ``(label, code)`` blocks run in order in one namespace (``__name__`` as given), with
the child's stdout and stderr in a log file and ``cwd`` as its working directory; its exit status is 0
when every block ran. Jobs may run side by side: ``start`` returns at once, ``wait`` collects one.
``tests/test_docs.py`` runs the docs pages this way, ``tests/keras_io/run.py`` the keras.io programs.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# What keras.utils.set_random_seed imports when it is installed (keras-hub's tensorflow-text brings it):
# about 5 s of CPU in every child that seeds, paid once in the server. For the ``modules`` of a ForkServer.
TENSORFLOW_IF_INSTALLED = "tensorflow?"

# The server: reads a job per line on stdin, forks it, answers {"started": pid} at once and {"exit", "pid"} when it
# ends. One thread, no lock: a select loop over stdin that reaps finished children in between.
SERVER = r"""
import json, os, select, sys, time, traceback
for module in sys.argv[1].split(","):
    try:
        __import__(module.rstrip("?"))
    except ImportError:
        if not module.endswith("?"):  # "name?": imported where installed
            raise
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized(), "JAX's backend started before the fork"

def say(**message):
    os.write(1, (json.dumps(message) + "\n").encode())

def child(job):
    code = 1
    try:
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.chdir(job["cwd"])
        namespace = {"__name__": job["name"]}
        for label, text in job["blocks"]:
            start = time.perf_counter()
            exec(compile(text, label, "exec"), namespace)
            print(f"fork-server: {label}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)  # through the interpreter's exit: atexit handlers (Orbax, JAX) run as in a script

say(ready=os.getpid())
pending, running, done = b"", set(), False
while not done or running:
    if not done and select.select([0], [], [], 0.05)[0]:
        data = os.read(0, 1 << 20)
        done = not data
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                child(json.loads(line))
            running.add(pid)
            say(started=pid)
    elif done:
        time.sleep(0.05)
    for pid in list(running):
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            running.discard(pid)
            say(exit=os.waitstatus_to_exitcode(status), pid=pid)
"""


class ForkServer:
    """Starts the server (``python *flags -c SERVER``) with ``env``, importing ``modules`` (``"name?"``: where
    installed)."""

    def __init__(self, modules: list[str], env: dict[str, str], flags: list[str] | None = None,
                 ready_timeout: float = 300) -> None:
        self.proc = subprocess.Popen([sys.executable, *(flags or []), "-c", SERVER, ",".join(modules)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue[str] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()  # one caller reads the answers at a time
        threading.Thread(target=self._read, daemon=True).start()
        self._reply(ready_timeout, "ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # the server ended

    def _reply(self, timeout: float, want: str) -> dict:
        """The next answer of kind ``want``; exits that arrive meanwhile are kept for ``wait``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if not line:
                if line is not None:
                    self.proc.wait()
                    self._lines.put("")  # later calls see the end too
                raise RuntimeError(f"the fork server gave no {want!r} within {timeout:.0f} s "
                                   f"(server exit status {self.proc.poll()})")
            message = json.loads(line)
            if want in message:
                return message
            self._exits[message["pid"]] = message["exit"]

    def start(self, blocks: list[tuple[str, str]], cwd: str | Path, log: str | Path, name: str = "__main__") -> int:
        """Forks a child that runs ``blocks``; returns its pid at once."""
        assert self.proc.stdin is not None
        job = {"blocks": blocks, "cwd": str(cwd), "log": str(log), "name": name}
        with self._lock:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            return int(self._reply(60, "started")["started"])

    def wait(self, pid: int, timeout: float) -> int | None:
        """The child's exit status, or ``None`` when it ran past ``timeout`` (it is killed then)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                try:
                    message = self._reply(max(0.0, deadline - time.monotonic()), "exit")
                except RuntimeError:
                    if self.proc.poll() is not None:
                        raise
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    while pid not in self._exits:  # the killed child's answer, so no later wait reads it
                        message = self._reply(60, "exit")
                        self._exits[message["pid"]] = message["exit"]
                    self._exits.pop(pid)
                    return None
                self._exits[message["pid"]] = message["exit"]
            return self._exits.pop(pid)

    def run(self, blocks: list[tuple[str, str]], cwd: str | Path, log: str | Path, timeout: float,
            name: str = "__main__") -> int | None:
        """``start`` then ``wait``: the exit status, or ``None`` past ``timeout``."""
        return self.wait(self.start(blocks, cwd, log, name), timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
