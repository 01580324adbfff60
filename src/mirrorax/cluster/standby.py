"""Standby processes: the next group's processes, started and past their imports before a restart needs them.

After a loss, each process of the restarted group would start Python and import JAX, Keras and mirrorax (4-5 s
of CPU each, all at once) before it could join. With restarts (``--max-restarts``, ``--min-nprocs``),
``mirrorax launch`` starts, once a group trains, as many *standby* processes as the next group may need: each is
the command's Python running this module (``python -m mirrorax.cluster.standby ARGS``), which imports the
libraries the command will use (NumPy, JAX, mirrorax; Keras where ``KERAS_BACKEND=jax``; the modules named in
``MIRRORAX_STANDBY_PRELOAD``) and waits on its standard input. A restart hands each its place in the new group
(the variables that differ from one group to the next: the coordinator, the process count and id, the slot, what
the last group lost) as one JSON line; the process sets them and runs the command as ``python`` would (a script,
``-m module`` or ``-c code``; standard input then reads as empty). Standby processes that are not needed are
ended with the launch.

What a fresh interpreter would do differently is followed: a JAX option the script sets in ``os.environ`` before
JAX's backend starts (``JAX_ENABLE_X64``, ``JAX_PLATFORMS``) is applied, as JAX would read it at its import, and
a script that asks for another ``KERAS_BACKEND`` than the one imported starts afresh in a new interpreter (its
place kept). Only a command that is a Python interpreter running a script, a module or code (``-u`` and ``-B``
allowed before it) stands by; ``MIRRORAX_STANDBY=0`` turns standby processes off.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["command", "enabled", "main", "run_command", "PRELOAD_ENV", "STANDBY_ENV", "STOOD_BY_ENV"]

PRELOAD_ENV = "MIRRORAX_STANDBY_PRELOAD"  # more modules a standby process imports (comma-separated)
STANDBY_ENV = "MIRRORAX_STANDBY"  # "0": no standby processes
STOOD_BY_ENV = "MIRRORAX_STOOD_BY"  # set to "1" in a process that stood by before it ran the command
_FLAGS = ("-u", "-B")
_PYTHON = re.compile(r"python[\d.]*")


def enabled(env: Any) -> bool:
    """Whether ``env`` (the children's environment) allows standby processes."""
    return env.get(STANDBY_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def command(cmd: Sequence[str]) -> list[str] | None:
    """The command of a standby process for ``cmd``, or ``None`` when ``cmd`` cannot stand by (not ``python
    [-u] [-B] (script | -m module | -c code) ...``).

    Example:
      >>> command(["python", "-u", "train.py", "--epochs", "3"])[1:4]
      ['-u', '-m', 'mirrorax.cluster.standby']
      >>> command(["bash", "run.sh"]) is None
      True
    """
    if not cmd or not _PYTHON.fullmatch(os.path.basename(cmd[0])):
        return None
    args = list(cmd[1:])
    flags = []
    while args and args[0] in _FLAGS:
        flags.append(args.pop(0))
    if not args or (args[0] in ("-m", "-c") and len(args) < 2) or (args[0].startswith("-") and args[0] not in (
            "-m", "-c")):
        return None
    return [cmd[0], *flags, "-m", "mirrorax.cluster.standby", json.dumps({"flags": flags, "args": args})]


def main(spec: str) -> None:
    """A standby process: imports, waits for its place, then runs the command (``spec``: its flags and arguments)."""
    command = json.loads(spec)
    modules = ["numpy", "jax", "mirrorax"] + (["keras"] if os.environ.get("KERAS_BACKEND") == "jax" else [])
    modules += [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    for module in modules:
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 - the script imports it itself, and says what is wrong
            pass
    line = sys.stdin.readline()
    if not line:  # the launch ended without needing this process
        sys.exit(0)
    os.environ.update(json.loads(line))
    os.environ[STOOD_BY_ENV] = "1"  # (for the script to tell, and a test)
    _follow_the_environment(command)
    run_command(command["args"])


def _follow_the_environment(command: dict[str, Any]) -> None:
    """JAX options the script sets in ``os.environ`` are applied while JAX's backend has not started (a fresh
    interpreter would import JAX after them); another ``KERAS_BACKEND`` than the imported one restarts the command
    in a fresh interpreter."""
    import jax

    from mirrorax.cluster.join import backend_started

    environ_type = type(os.environ)
    set_item = environ_type.__setitem__
    keras_backend = os.environ.get("KERAS_BACKEND") if "keras" in sys.modules else None

    def setitem(environ: Any, key: str, value: str) -> None:
        set_item(environ, key, value)
        if environ is not os.environ:
            return
        if key == "KERAS_BACKEND" and keras_backend is not None and value != keras_backend:
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, *command["flags"], *command["args"]])
        option = key.lower()
        if key.startswith("JAX_") and option in jax.config.values and not backend_started():
            jax.config.update(option, _parse(value, jax.config.values[option]))

    environ_type.__setitem__ = setitem  # type: ignore[method-assign]


def _parse(text: str, now: Any) -> Any:
    """``text`` as a value of the JAX option whose value is ``now`` (as JAX reads its environment variables)."""
    if isinstance(now, bool):
        return text.strip().lower() in ("1", "true", "t", "yes", "y", "on")
    if isinstance(now, int):
        return int(text)
    if isinstance(now, float):
        return float(text)
    return text


def run_command(args: Sequence[str]) -> None:
    """Runs ``python ARGS`` in this process, as the interpreter would: a script, ``-m module`` or ``-c code``
    (``sys.argv``, ``sys.path[0]`` and ``__main__`` as it sets them)."""
    import runpy
    import types

    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        sys.modules.pop(args[1], None)  # imported already (a preloaded module): run afresh, as __main__
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        module = types.ModuleType("__main__")
        sys.modules["__main__"] = module
        exec(compile(args[1], "<string>", "exec"), module.__dict__)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1])
