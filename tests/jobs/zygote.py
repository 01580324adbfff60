"""Python processes for the test jobs without the 8 s of imports each: a forked "python" that behaves as one.

Most of the suite's process tests start Python processes (a job, the launcher and its ranks, the CLI, a
benchmark's children), and each fresh one spends about 8 s of CPU importing JAX, Keras, optax, Orbax and
mirrorax before it runs a line of the job (5 s more for TensorFlow, which ``keras.utils.set_random_seed``
imports where it is installed): a third of the whole suite. ``python_path()`` returns a small
executable, the *shim*, that the tests use in place of ``sys.executable``. The shim (a bare ``python -SE``,
~20 ms) hands its arguments, environment, working directory and its stdin/stdout/stderr to a server that
imported those libraries once (without starting JAX's backend, which forbids a fork) and forks a child that
runs the command as ``python`` would, then:

- forwards the signals it receives (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGABRT, SIGUSR1/2, SIGCONT) to the
  child, stops itself when the child is stopped (so that ``/proc/<pid>/stat`` says ``T`` as for the child),
  and exits as the child did: the same status, or killed by the same signal;
- dies with the child, and the child with it: the child watches the shim's pid (``pidfd``) and kills itself
  when the shim is gone, so a ``kill -9`` of the shim (or of its launcher, via PDEATHSIG) ends the job.

What a fresh process has and a forked child would not, the child gets: its own numpy and ``random`` seeds
from the OS, ``os.environ`` as given (JAX options that JAX read from the environment at import are set from
it), ``sys.argv``/``sys.path``/``__main__`` as for ``python script``, ``-m module`` or ``-c code``, unbuffered
streams under ``PYTHONUNBUFFERED``/``-u``, faulthandler under ``PYTHONFAULTHANDLER``. Two servers with
different hash seeds serve ranks of opposite parity (``MIRRORAX_PROCESS_ID``), so two ranks never share a
string hash order that two fresh processes would not. ``sys.executable`` in the child is the shim, so what
the job starts with it (the launcher's ranks, a benchmark's children) is forked too.

Anything the shim does not model runs the real interpreter instead (``exec``, in the shim or the child): an
option other than ``-u``/``-B``, ``-m``, ``-c`` or a script; another ``KERAS_BACKEND`` or ``PYTHONPATH``;
a ``JAX_*`` option JAX reads at import that cannot be set afterwards.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The libraries imported once per server (not the backend: see the module's docstring); "?": where installed.
# TensorFlow is what keras.utils.set_random_seed imports when it is installed (keras-hub's tensorflow-text
# brings it): about 5 s of CPU in every job that seeds, paid once here.
PRELOAD = ("numpy", "jax", "keras", "optax", "orbax.checkpoint", "mirrorax", "tensorflow?")
# Environment variables read at import, by Python or by the preloaded libraries: a child whose value
# differs from the server's runs the real interpreter. JAX_* options are handled one by one (SERVER).
_IMPORT_TIME = ("KERAS_BACKEND", "KERAS_HOME", "PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME",
                "PYTHONNOUSERSITE", "PYTHONOPTIMIZE", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONMALLOC")

SHIM = r'''#!{python} -SE
import json, os, signal, socket, sys
REAL, SOCKETS = {python!r}, {sockets!r}
args = sys.argv[1:]
flags = 0
while flags < len(args) and args[flags] in ("-u", "-B"):
    flags += 1
if flags == len(args) or not (args[flags] in ("-m", "-c") or not args[flags].startswith("-")):
    os.execv(REAL, [REAL, *args])  # anything else: the real interpreter (-S, -X, -W, -I, -, ...)
try:
    rank = int(os.environ.get("MIRRORAX_PROCESS_ID", "0"))
except ValueError:
    rank = 0
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(SOCKETS[rank % len(SOCKETS)])
except OSError:
    os.execv(REAL, [REAL, *args])  # no server (the test session ended): the real interpreter
request = json.dumps({{"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "shim": os.getpid()}})
socket.send_fds(conn, [request.encode() + b"\n"], [0, 1, 2])
replies = conn.makefile("r")
first = replies.readline()
if first != "exec\n" and not first.strip().isdigit():
    os._exit(255)  # the server ended before it answered
if first == "exec\n":
    os.execv(REAL, [REAL, *args])  # what a forked child cannot be (another KERAS_BACKEND, PYTHONPATH, ...)
child = int(first)

def forward(signum, frame):
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass

for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGABRT", "SIGUSR1", "SIGUSR2", "SIGCONT"):
    signal.signal(getattr(signal, name), forward)
for line in replies:
    if line == "stopped\n":
        os.kill(os.getpid(), signal.SIGSTOP)  # as the child: a launcher reads "T" in /proc/<pid>/stat
        continue
    code = int(line)
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)
os._exit(255)  # the server ended without an answer
'''

SERVER = r'''
import json, os, select, signal, socket, sys
SOCKET, SHIM, REAL = sys.argv[1], sys.argv[2], sys.argv[3]
PRELOAD, IMPORT_TIME = sys.argv[4].split(","), sys.argv[5].split(",")
for module in PRELOAD:
    try:
        __import__(module.rstrip("?"))
    except ImportError:
        if not module.endswith("?"):
            raise
from jax._src import xla_bridge
from jax._src import config as jax_config
assert not xla_bridge.backends_are_initialized(), "JAX's backend started before the fork"
import gc
gc.collect()
gc.freeze()  # what the imports made stays out of the children's collections (and unwritten: shared pages)
BORN = dict(os.environ)


def jax_option(key, text):
    """``(name, value)`` of the JAX option that environment variable ``key`` sets to ``text``; None when
    ``key`` is no JAX option (read from os.environ when needed); ValueError when it cannot be set here."""
    holder = jax_config.config._value_holders.get(key.lower()) if key.startswith("JAX_") else None
    if holder is None:
        return None
    now = holder.value
    if isinstance(now, bool):
        return key.lower(), text.lower() in ("1", "true", "t", "yes", "y", "on")
    if isinstance(now, int):
        return key.lower(), int(text)
    if isinstance(now, float):
        return key.lower(), float(text)
    if now is None or isinstance(now, str):
        return key.lower(), text
    raise ValueError(f"{key}: an option of type {type(now).__name__}")


def jax_options(env):
    """The JAX options to set from ``env``, or None when one cannot be (run the real interpreter then)."""
    updates = {}
    for key in set(env) | set(BORN):
        if env.get(key) == BORN.get(key):
            continue
        try:
            option = jax_option(key, env.get(key, ""))
        except ValueError:
            return None
        if option is not None:
            if key not in env:
                return None
            updates[option[0]] = option[1]
    return updates


def follow_the_environment(request):
    """A script that sets ``JAX_*`` options in ``os.environ`` before it starts JAX's backend (as
    ``float64_fit.py`` sets ``JAX_ENABLE_X64``) gets them, as a fresh process that imports JAX after would;
    one that sets another ``KERAS_BACKEND`` runs again in the real interpreter from the start."""
    set_item = os._Environ.__setitem__

    def setitem(environ, key, value):
        set_item(environ, key, value)
        if environ is not os.environ:
            return
        if key in ("KERAS_BACKEND", "KERAS_HOME") and value != BORN.get(key):
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(REAL, [REAL, *request["argv"]], request["env"])
        if xla_bridge.backends_are_initialized():
            return  # too late for a fresh process too
        try:
            option = jax_option(key, value)
        except ValueError:
            os.execve(REAL, [REAL, *request["argv"]], request["env"])
        if option is not None:
            jax_config.config.update(*option)

    os._Environ.__setitem__ = setitem


def forkable(env):
    """Whether a child forked from this server can be what ``python`` started with ``env`` would be."""
    if "PYTHONHASHSEED" in env or any(env.get(k) != BORN.get(k) for k in IMPORT_TIME):
        return False
    return jax_options(env) is not None


def run(request):
    argv, env = request["argv"], request["env"]
    options = jax_options(env)
    os.environ.clear()
    os.environ.update(env)
    for name, value in options.items():
        jax_config.config.update(name, value)
    follow_the_environment(request)
    import random, numpy, faulthandler, io
    numpy.random.seed()
    random.seed()
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    while argv[0] in ("-u", "-B"):
        unbuffered = unbuffered or argv[0] == "-u"
        argv = argv[1:]
    if unbuffered:
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                      errors=sys.stdout.errors, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                      errors="backslashreplace", write_through=True)
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    sys.executable = SHIM
    from mirrorax.cluster.standby import run_command  # (preloaded: as the launcher's standby processes run it)

    run_command(argv)


def child(listener, conn, request, fds, answers):
    listener.close()
    conn.close()
    for other in answers.values():
        other.close()
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    import threading
    shim = os.pidfd_open(request["shim"])

    def die_with_the_shim():
        select.select([shim], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_the_shim, daemon=True, name="zygote-shim-watch").start()
    code = 0
    try:
        run(request)
    except SystemExit as stop:
        code = stop.code
    except BaseException as error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # this server's frames: not in a fresh process's traceback
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        code = "SIGINT" if isinstance(error, KeyboardInterrupt) else 1
    exit_as_python_would(code)


def exit_as_python_would(code):
    """Python's exit: the threading module's exit hooks (``concurrent.futures`` stops its executors there)
    and the wait for the non-daemon threads, both ``threading._shutdown``'s, then the atexit handlers, a
    flush; then leave without tearing down the interpreter (seconds of garbage collection over the
    preloaded libraries for nothing)."""
    import atexit, threading
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code == "SIGINT":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code & 0xFF)


listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(SOCKET)
listener.listen(64)
os.write(1, b"ready\n")
answers = {}
# ZYGOTE_CPU_LOG=file: the CPU time of each forked job, with the test that started it
# (its PYTEST_CURRENT_TEST), for profiling the suite: a forked job's CPU is not the test process's.
CPU_LOG, started = os.environ.get("ZYGOTE_CPU_LOG"), {}
while True:
    ready = select.select([listener, 0, *answers.values()], [], [], 0.05)[0]
    if 0 in ready and not os.read(0, 1 << 16):
        break  # the test session ended
    for pid, conn in list(answers.items()):
        try:
            gone = conn in ready and not conn.recv(1 << 16)
        except OSError:
            gone = True
        if gone:
            # The shim is gone (killed): so is its child, even a stopped one (its own watch cannot run).
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if listener in ready:
        conn, _ = listener.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            data += more
        request = json.loads(data)
        if not forkable(request["env"]):
            for fd in fds:
                os.close(fd)
            conn.sendall(b"exec\n")  # the shim runs the real interpreter
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            child(listener, conn, request, fds, answers)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        answers[pid] = conn
        if CPU_LOG:
            started[pid] = (request["env"].get("PYTEST_CURRENT_TEST", ""), request["argv"])
    while answers:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG | os.WUNTRACED)
        except ChildProcessError:
            break
        if pid == 0:
            break
        conn = answers.get(pid)
        if conn is None:
            continue
        if CPU_LOG and not os.WIFSTOPPED(status):
            test, argv = started.pop(pid, ("", []))
            with open(CPU_LOG, "a") as log:  # one line per forked job: who started it, its CPU
                log.write(json.dumps({"test": test, "argv": argv[:3],
                                      "cpu": usage.ru_utime + usage.ru_stime}) + "\n")
        try:
            if os.WIFSTOPPED(status):
                conn.sendall(b"stopped\n")
                continue
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass  # the shim is gone
        conn.close()
        del answers[pid]
'''

_shim: str | None = None


def python_path(env: dict[str, str]) -> str:
    """The shim's path (servers started on the first call, with ``env``, for the rest of this process)."""
    global _shim
    if _shim is None:
        folder = tempfile.mkdtemp(prefix="mirrorax-zygote-")
        server_file = os.path.join(folder, "server.py")
        Path(server_file).write_text(SERVER)
        sockets = [os.path.join(folder, f"server{i}.sock") for i in range(2)]
        shim = os.path.join(folder, "python")
        Path(shim).write_text(SHIM.format(python=sys.executable, sockets=sockets))
        os.chmod(shim, 0o755)
        servers = []
        for sock in sockets:
            server_env = dict(env, PYTHONHASHSEED=str(secrets.randbelow(2**32)))
            servers.append(subprocess.Popen(
                [sys.executable, server_file, sock, shim, sys.executable, ",".join(PRELOAD), ",".join(_IMPORT_TIME)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=server_env))
        for server in servers:
            assert server.stdout is not None
            line = server.stdout.readline()
            if line != b"ready\n":
                raise RuntimeError(f"a zygote server did not start (exit status {server.wait()})")

        def close() -> None:
            for server in servers:
                if server.stdin:
                    server.stdin.close()
            for server in servers:
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
            shutil.rmtree(folder, ignore_errors=True)

        atexit.register(close)
        _shim = shim
    return _shim
