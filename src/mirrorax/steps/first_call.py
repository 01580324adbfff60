"""A program's first call, its trace and compile, run as a trace wants the host (:func:`run`).

Two things about the Python host made a step's trace slower than it need be; both are set right for the
length of a first call, and left as found after it:

* **The cyclic garbage collector.** Tracing a training step makes a great many objects that live exactly
  as long as the trace (tracers, the jaxpr's equations, the lowering's IR objects). While they live, the
  collector's younger generations pass them on to the oldest one, and each full collection then scans the
  whole heap: Keras, JAX and (often) TensorFlow loaded, every model built so far. Measured on a 2-core
  host in a fresh process (the CNN benchmark's first ``fit`` under a scope): the step's trace took 0.30 s
  with the collector on against 0.16 s paused, the difference full collections. Paused, the trace's
  objects are freed by their reference counts as the trace ends and never reach the oldest generation.
* **The interpreter's frame stack.** CPython (3.11 on) keeps its frames in chunks of 16 KiB: a call that
  finds no room maps a new chunk, and the return out of it unmaps it at once. A trace goes up and down
  through some hundred frames (Keras's layer calls inside JAX's transformations) tens of thousands of
  times; where that range straddles a chunk's end, each crossing maps, faults in and unmaps a chunk. How
  deep the trace starts decides it, so it struck one caller and not another: Keras's forward pass took
  500-1,300 page faults inside mirrorax's trace of the CNN step and 5-17 inside Keras's own (this CPU
  host, by the thread's fault count), and on a TPU v5e host (13 cores, the runtime's threads busy, where
  an unmap flushes every core's address translations) the same forward pass, the same ~60,000 Python calls,
  took 0.17-0.19 s in mirrorax's trace against 0.02-0.05 s in Keras's. A function that oscillates across a chunk's
  end costs 10.3 us an oscillation against 2.0 us inside one chunk (this host). The first call runs from a
  frame that reserves 512 KiB of the stack, so every frame of the trace lands in the one chunk mapped for
  it.

The same room serves a whole ``fit``, ``evaluate`` or ``predict`` (:func:`with_room`, on the Trainer's
methods): their own Python (placing and planning the state, the loop, the callbacks) goes as deep, and
called from a deep stack (a notebook's, a framework's) a warm one-step ``fit`` paid 22-124 page faults and
2-3 ms more a call on this host (6 ms at 100 frames above the call, 9 at 104-116).
"""

from __future__ import annotations

import functools
import gc
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["run", "with_room", "ROOM_SLOTS"]

T = TypeVar("T")

ROOM_SLOTS = 1 << 16
"""Frame-stack slots (pointers: 512 KiB) the first call's frame reserves for the frames above it."""


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


def _roomy(plain: Callable[..., Any]) -> Callable[..., Any]:
    """``plain`` with a frame that claims ``ROOM_SLOTS`` more evaluation-stack slots than it uses: CPython
    sizes a frame by its code's ``co_stacksize`` and maps a chunk large enough for it (1 MiB), which the
    frames called from it then fill; slots never written are never faulted in. Where a code object cannot
    be so replaced (another interpreter), ``plain`` itself."""
    try:
        code = plain.__code__.replace(co_stacksize=plain.__code__.co_stacksize + ROOM_SLOTS)
        return types.FunctionType(code, plain.__globals__, plain.__name__)
    except (AttributeError, TypeError, ValueError):  # not CPython's code objects
        return plain


_roomy_call = _roomy(_call)
_inside = threading.local()  # whether this thread already runs in the room (a nested call needs no new one)


def _in_room(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """``fn(*args, **kwargs)`` from a frame with the frame stack's room reserved; inside one, as it is."""
    if getattr(_inside, "on", False):
        return fn(*args, **kwargs)
    _inside.on = True
    try:
        return cast(T, _roomy_call(fn, args, kwargs))
    finally:
        _inside.on = False


def run(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with the collector paused (a collection asked for by ``gc.collect()`` still
    runs) and the frame stack's room reserved; the collector is left enabled or disabled as it was found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _in_room(fn, args, kwargs)
    finally:
        if enabled:
            gc.enable()


def with_room(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` run with the frame stack's room reserved (the collector untouched: a whole fit must
    collect)."""

    @functools.wraps(method)
    def roomy(*args: Any, **kwargs: Any) -> T:
        return _in_room(method, args, kwargs)

    return roomy
