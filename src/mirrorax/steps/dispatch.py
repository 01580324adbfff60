"""``strategy.jit`` and ``strategy.run``: a user's step compiled once per signature, dispatched with a bound.

Both compile ``fn`` once per input signature (tree structure, shapes, dtypes, layouts) and keep at most
``max_in_flight`` dispatched calls outstanding per strategy: after dispatching call ``i`` the host waits
for call ``i - max_in_flight + 1``, never for the call it just made. (Unbounded, the host queues steps
without limit, which hides errors and, on multi-device CPU hosts, overruns XLA's collective rendezvous.)

Where outputs live, unless the caller gives ``out_shardings``, is decided when a signature is first seen:

1. an output (or a top-level element of a tuple/list output) with the structure, shapes and dtypes of
   an argument keeps that argument's layout (a state passed in and returned stays as it was placed);
2. otherwise a leaf whose leading axis has the global batch's rows (of a batch-split argument) stays
   split over the batch axis;
3. everything else is replicated.

``strategy.run`` is the per-replica form: ``fn`` runs on each replica's rows inside ``jax.shard_map``;
outputs that ``fn`` made equal on every replica come back replicated (JAX tracks which values vary over
the axis), the others as global arrays holding one slice per replica (``tf.distribute``'s ``PerReplica``):
a scalar per replica becomes a ``(num_replicas,)`` array, a per-replica array is concatenated on axis 0.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mirrorax._checks import check_int
from mirrorax.steps import first_call as _first_call
from mirrorax.steps.replica import ReplicaContext, replica_scope, varies_over

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["MISSED", "StrategyFunction", "FlatProgram", "InFlight", "Traced", "wait"]

PyTree = Any


def wait(ready: Any) -> None:
    """Blocks until ``ready`` (an array, or a pytree of them) is computed: what the window waits on. An array
    (a call's token) waits by its own method, not through ``jax.block_until_ready``'s tree walk (2 us a step less
    on a CPU host, where a small step's whole host time is 50 us)."""
    if type(ready) is ARRAY_TYPE:
        ready.block_until_ready()
    else:
        jax.block_until_ready(ready)


class InFlight:
    """The dispatch window: at most ``depth`` dispatched calls outstanding; after pushing call ``i``, the
    host waits for call ``i - depth + 1``, never for the call it just pushed.

    JAX dispatches asynchronously; without a bound, the host can queue many steps, which both hides
    errors and (on multi-device CPU) overruns XLA's collective rendezvous. ``depth=2`` keeps one step
    running while the next is queued. A strategy has one window (``strategy.in_flight``, of depth
    ``max_in_flight``): its ``jit`` and ``run`` functions push each call into it, and a loop that calls a
    :meth:`StrategyFunction.program` itself pushes there too, so one bound holds for every call.

    Args:
      depth: calls allowed in flight (>= 1).

    Attributes:
      last_done: the ``aux`` of the newest entry that left the window (``None`` before the first).

    Example:
      >>> program = step.program(state, batch)  # step = strategy.jit(...): one signature, many calls
      >>> for batch in batches:
      ...     (state, loss), done = program(state, batch)
      ...     strategy.in_flight.push(loss, done, on_done=losses.append)
      >>> strategy.in_flight.drain()
    """

    def __init__(self, depth: int = 2) -> None:
        check_int("max_in_flight", depth)
        self._depth = depth
        self._queue: collections.deque[tuple[Any, Any, Callable[[Any], None] | None]] = collections.deque()
        self._after: list[Callable[[], None]] = []
        self.last_done: Any = None

    @property
    def depth(self) -> int:
        """Calls allowed in flight: the strategy's ``max_in_flight``."""
        return self._depth

    @property
    def pending(self) -> int:
        """Entries pushed and not yet retired (at most ``depth - 1`` between pushes)."""
        return len(self._queue)

    def push(self, aux: Any, ready: Any = None, on_done: Callable[[Any], None] | None = None) -> None:
        """Adds a dispatched call, then waits for the oldest ones until fewer than ``depth`` are pending.

        Args:
          aux: what the entry stands for (e.g. the step's outputs); ``last_done`` once it retires.
          ready: what to wait on (default: ``aux`` itself), e.g. the token of ``program(...)``, or one
            output of the call that is done exactly when the call is: cheaper to wait on than a tree.
          on_done: called as ``on_done(aux)`` when this entry retires (in push order, once).
        """
        queue = self._queue
        queue.append((aux, aux if ready is None else ready, on_done))
        if self._after:  # batches asked to be placed now, while the call just pushed runs
            after, self._after = self._after, []
            for fn in after:
                fn()
        while len(queue) >= self._depth:
            self._retire(*queue.popleft())

    def after_dispatch(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once, right after the next :meth:`push` (before that push waits): an input
        iterator places its next batch there, so the host's copy overlaps the devices' work."""
        self._after.append(fn)

    def drain(self) -> None:
        """Waits for every pending entry, oldest first (their ``on_done`` run in order)."""
        while self._queue:
            self._retire(*self._queue.popleft())

    def _retire(self, aux: Any, ready: Any, on_done: Callable[[Any], None] | None) -> None:
        wait(ready)
        self.last_done = aux
        if on_done is not None:
            on_done(aux)


class Traced:
    """One trace of a function for one signature: its jaxpr and its outputs' shapes.

    :attr:`replay` computes what the function computes by evaluating the jaxpr, without running the
    function's Python again; ``jax.jit(traced.replay)`` compiles the same program as ``jax.jit(fn)``.
    """

    def __init__(self, closed: Any, shapes: PyTree) -> None:
        self.closed, self.shapes = closed, shapes
        self._out_tree = jax.tree.structure(shapes)
        self._run = jax.extend.core.jaxpr_as_fun(closed)

    @classmethod
    def of(cls, fn: Callable[..., Any], args: tuple[Any, ...]) -> Traced:
        """Traces ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct`` s), compiling nothing."""
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        return cls(closed, shapes)

    def replay(self, *args: Any) -> Any:
        """The traced function's outputs for ``args`` (of the traced signature)."""
        return jax.tree.unflatten(self._out_tree, self._run(*jax.tree.leaves(args)))


class _SignatureChanged(Exception):
    """A program called through :meth:`StrategyFunction.call_fast` met arguments it was not compiled for."""


MISSED: Any = object()
"""What :meth:`StrategyFunction.call_fast` returns when the last call's program does not fit the arguments."""


def _batch_axis_of(a: Any, axis_name: str | tuple[str, ...]) -> bool:
    sharding = getattr(a, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec is not None and len(spec) > 0 and spec[0] == axis_name


ARRAY_TYPE: Any = None
"""The concrete ``jax.Array`` type (``type(a) is ARRAY_TYPE`` is cheap; ``isinstance(a, jax.Array)`` is not), or
``None`` on a JAX that moved it (callers then take their general path)."""
try:
    from jax._src.array import ArrayImpl as ARRAY_TYPE
except ImportError:  # pragma: no cover - a JAX without it: the general path below
    pass


def _signature(leaves: Sequence[Any]) -> tuple[Any, ...]:
    # Called on every dispatch: 0.3 us per leaf on the fast path against 1.2 us through jax.Array's
    # isinstance and three properties (measured on a 221-leaf transformer state).
    # Abstract arguments (``jax.ShapeDtypeStruct``, for ``lower``) key like the arrays they stand for, so
    # that lowering ahead (e.g. ``mx.plan`` at fit start) and calling share one compiled program.
    out: list[tuple[Any, ...]] = []
    for a in leaves:
        if type(a) is ARRAY_TYPE:
            aval = a.aval
            out.append((aval.shape, aval.dtype, a.sharding))
        elif isinstance(a, (jax.Array, jax.ShapeDtypeStruct)):
            out.append((a.shape, a.dtype, a.sharding))
        elif isinstance(a, np.ndarray):
            out.append((a.shape, a.dtype, None))
        else:
            out.append((type(a), np.shape(a), getattr(a, "dtype", None)))
    return tuple(out)


def layout(tree: PyTree, default: Any) -> PyTree:
    """Each leaf's sharding (``jax.ShapeDtypeStruct``s, the abstract arguments of ``lower``, carry one
    too), ``default`` for leaves without one (host arrays) and for those not laid out on ``default``'s mesh (a
    ``jnp`` array JAX made on its default device: an output like it lives on the strategy's devices, where the
    next call can take it beside the strategy's arrays; it raised "incompatible devices" on several)."""
    mesh = getattr(default, "mesh", None)

    def one(a: Any) -> Any:
        sharding = getattr(a, "sharding", None)
        return sharding if getattr(sharding, "mesh", None) == mesh else default

    return jax.tree.map(one, tree)


def _dtype(a: Any) -> Any:
    # (``jax.ShapeDtypeStruct``s, the abstract arguments of ``lower``, are no input to ``result_type``)
    return a.dtype if isinstance(a, jax.ShapeDtypeStruct) else jnp.result_type(a)


OutShardings = Any
"""``out_shardings`` of :meth:`MirroredStrategy.jit`: ``None``, a sharding or pytree (prefix) of them, or a
callable of the positional arguments giving one."""


def check_out_shardings(out_shardings: OutShardings, *, received: str = "out_shardings") -> None:
    """Raises ``TypeError`` unless ``out_shardings`` is ``None``, a callable, or a pytree of shardings."""
    if out_shardings is None or callable(out_shardings):
        return
    bad = [leaf for leaf in jax.tree.leaves(out_shardings) if not isinstance(leaf, jax.sharding.Sharding)]
    if bad:
        raise TypeError(f"{received} must be None, a jax.sharding.Sharding (e.g. strategy.replicated), a pytree of "
                        f"them matching the outputs (or a prefix of them), or a callable of the positional "
                        f"arguments returning one; received a {type(out_shardings).__name__} holding "
                        f"{bad[0]!r} (of type {type(bad[0]).__name__}). Use strategy.replicated, "
                        "strategy.batch_sharding or strategy.state_sharding(...) for its leaves.")


class FlatProgram:
    """A compiled ``fn(state, *rest) -> (state, *outputs)`` that takes and gives the state as its leaves'
    list (``StrategyFunction(..., flat_state=True)``). Called, or lowered, with the state itself, it
    flattens it and rebuilds the returned one; :attr:`jitted` takes the leaves.

    Attributes:
      jitted: the ``jax.jit`` function of ``(leaves, *rest)``.
      treedef: the state's structure (the leaves' order).
    """

    def __init__(self, jitted: Any, treedef: Any) -> None:
        self.jitted, self.treedef = jitted, treedef

    def __call__(self, state: Any, *rest: Any) -> Any:
        leaves, *outputs = self.jitted(self._leaves(state), *rest)
        return (self.treedef.unflatten(leaves), *outputs)

    def lower(self, state: Any, *rest: Any) -> Any:
        return self.jitted.lower(self._leaves(state), *rest)

    def _leaves(self, state: Any) -> list[Any]:
        try:
            return cast(list[Any], self.treedef.flatten_up_to(state))
        except (ValueError, TypeError) as e:  # (a TypeError: call_fast's caller then looks the program up)
            raise TypeError(f"Expected a state of structure {self.treedef}; received {jax.tree.structure(state)}.") \
                from e


def _flat_state_body(body: Callable[..., Any], treedef: Any) -> Callable[..., Any]:
    """``body(state, *rest) -> (state, *outputs)`` as a function of the state's leaves (``treedef``'s)."""
    @functools.wraps(body)
    def flat(leaves: list[Any], *rest: Any) -> Any:
        state, *outputs = body(treedef.unflatten(leaves), *rest)
        if jax.tree.structure(state) != treedef:
            raise TypeError(f"A flat_state function returned a state of structure {jax.tree.structure(state)}; "
                            f"it took one of structure {treedef}. Return the state with the structure it came in.")
        return (treedef.flatten_up_to(state), *outputs)

    return flat


class StrategyFunction:
    """What ``strategy.jit(fn)`` and ``strategy.run``'s compiled form return: call it like ``fn``.

    Every call pushes into the strategy's one dispatch window (``strategy.in_flight``), so at most
    ``max_in_flight`` calls are outstanding. A loop calling one signature many times may take the
    compiled :meth:`program` instead and push into the window itself.

    Args:
      mesh: the devices and layouts (a strategy is one).
      window: the dispatch window every call is pushed into (``strategy.in_flight``).
      fn: the function (global view), or the per-replica function with ``per_replica=True``.
      donate_argnums: positional arguments whose buffers the call may reuse (e.g. the state).
      per_replica: run ``fn`` once per replica on its rows (``jax.shard_map``), as ``strategy.run``.
      out_shardings: the outputs' layouts: ``None`` (the rules of this module's docstring), a sharding or
        a pytree of them (a prefix of the outputs' tree, as ``jax.jit``'s), or a callable that takes the
        positional arguments (abstract or concrete) and returns one. Known layouts spare the shape probe
        that the rules need, a second trace of ``fn`` per signature.
      ready: picks from a call's outputs the one the window waits on: an output made anew by every call
        and never donated by a later one (e.g. a step's packed flags). ``None``: the program returns one
        more output for that, a scalar token. Each output of a step costs host time on an accelerator
        (about 7 us a step on a TPU v5e), which a loop of small steps pays every step.
      flat_state: ``fn`` is ``fn(state, ...) -> (state, ...)`` with the state's structure kept: the compiled
        program takes and gives the state as the list of its leaves (a :class:`FlatProgram`), and a loop
        may keep it so between calls (:meth:`flat_program`). JAX flattens a call's arguments and rebuilds
        its outputs at every call; a ``TrainState`` of dicts cost ~35 us a call more than its leaves'
        list on this CPU host (the dicts' keys sorted, the dicts and the dataclass built again).
        Needs ``out_shardings`` and ``ready``.
    """

    def __init__(self, mesh: BatchMesh, window: InFlight, fn: Callable[..., Any], *,
                 donate_argnums: int | Sequence[int] = (), per_replica: bool = False,
                 out_shardings: OutShardings = None, ready: Callable[[Any], Any] | None = None,
                 flat_state: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"Expected a callable for fn. Received: {fn!r} (of type {type(fn).__name__}).")
        check_out_shardings(out_shardings)
        if per_replica and out_shardings is not None:
            raise ValueError("out_shardings is for the global view (strategy.jit); strategy.run lays its outputs "
                             f"out by what each replica returns. Received out_shardings={out_shardings!r} with "
                             "per_replica=True: drop one of them.")
        self._mesh = mesh
        self._window = window
        self._fn = fn
        self._donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self._per_replica = per_replica
        self._out_shardings_arg = out_shardings
        if ready is not None and not callable(ready):
            raise TypeError(f"ready must be a callable of the outputs (e.g. lambda out: out[1]); received {ready!r} "
                            f"(of type {type(ready).__name__}).")
        self._ready = ready
        if flat_state and (out_shardings is None or per_replica or ready is None):
            raise ValueError("flat_state=True needs out_shardings (the state's layout as it came in), ready and "
                             f"the global view; received out_shardings={out_shardings!r}, ready={ready!r}, "
                             f"per_replica={per_replica}.")
        self._flat_state = flat_state
        self._adopted: dict[Any, Traced] = {}  # signature -> a trace made elsewhere (adopt)
        # signature -> (jitted program, whether a call ran it: ``lower`` alone compiles for no call)
        self._compiled: dict[Any, tuple[Callable[..., Any], bool]] = {}
        # The last call's program, for call_fast; while _guard is set, a trace of any program raises.
        self._last: Callable[..., tuple[Any, Any]] | None = None
        self._guard = False
        self._fresh = False  # _for made (or first called) a signature's program
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    # -- calling ---------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            # Donation and layouts are decided per positional argument; keywords have no position.
            raise TypeError(f"{getattr(self._fn, '__name__', 'fn')} (compiled by strategy.jit) takes positional "
                            f"arguments only; received keyword(s) {sorted(kwargs)}. Pass them positionally, or bind "
                            "constants first: strategy.jit(functools.partial(fn, scale=2.0)).")
        self._fresh = False
        self._last = caller = self._caller(self._for(args, called=True))
        if self._fresh:  # this call traces and compiles the program (see mirrorax.steps.first_call)
            out, token = _first_call.run(caller, *args)
        else:
            out, token = caller(*args)
        self._window.push(token)
        return out

    def call_fast(self, args: tuple[Any, ...]) -> Any:
        """``self(*args)`` through the last call's program without looking the signature up: JAX's own
        dispatch (C++) checks the arguments, and a signature the program was not compiled for makes it trace,
        which raises here instead (:data:`MISSED` is returned; nothing ran). A step of a large state pays
        about a microsecond per leaf in :meth:`signature` every call: a loop that calls one signature pays it
        once."""
        caller = self._last
        if caller is None:
            return MISSED
        self._guard = True
        try:
            out, token = caller(*args)
        except (_SignatureChanged, TypeError):  # (TypeError: an argument JAX does not take; nothing ran)
            return MISSED
        finally:
            self._guard = False
        self._window.push(token)
        return out

    def program(self, *args: Any) -> Callable[..., tuple[Any, jax.Array]]:
        """The compiled program for ``args``' signature (counted as called), for a loop that calls it many
        times with arguments of that one signature (fixed batch shapes, the state in its own layout).

        Calling the program skips the per-call signature lookup and does not push into the window:
        it returns ``(outputs, token)``, the token a scalar ready exactly when the call is done, and
        the loop pushes it into ``strategy.in_flight`` itself, keeping the strategy's bound. Call it
        only with arguments of the signature it was made for (same tree, shapes, dtypes, layouts).

        Example:
          >>> program = step.program(state, batch)
          >>> for batch in batches:
          ...     (state, loss), token = program(state, batch)
          ...     strategy.in_flight.push(loss, token)
          >>> strategy.in_flight.drain()
        """
        return self._caller(self._for(args, called=True))

    def flat_program(self, *args: Any) -> tuple[Callable[..., tuple[Any, Any]], Any]:
        """:meth:`program` for a loop that keeps the state as its leaves (``flat_state=True``): returns
        ``(program, treedef)``, where ``program(leaves, *rest)`` gives ``((leaves, *outputs), ready)``, the
        leaves in ``treedef``'s order (the state's structure: ``treedef.unflatten(leaves)`` is the state).
        The same compiled program as :meth:`program`'s and :meth:`lower`'s for these arguments."""
        if not self._flat_state:
            raise TypeError(f"flat_program is for a function made with flat_state=True; received a call on "
                            f"{getattr(self._fn, '__name__', self._fn)!r}, made with flat_state=False. Call "
                            "program(*args) instead.")
        made = self._for(args, called=True)
        return self._caller(made.jitted), made.treedef

    def _caller(self, jitted: Any) -> Callable[..., tuple[Any, Any]]:
        """``jitted`` called as ``program()`` returns it: ``(outputs, what marks the call done)``."""
        ready = self._ready
        if ready is None:
            return cast(Callable[..., tuple[Any, Any]], jitted)

        def call(*args: Any) -> tuple[Any, Any]:
            out = jitted(*args)
            return out, ready(out)

        return call

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the program this call would run (for ``compile()``,
        ``memory_analysis()``, ``cost_analysis()``). ``args`` may be ``jax.ShapeDtypeStruct``s with
        shardings; a later call with arrays like them runs the same program."""
        return self._for(args).lower(*args)

    def trace(self, *args: Any) -> Traced | None:
        """Traces ``fn`` once with ``args``' shapes, as a call would (per replica: inside ``jax.shard_map``
        and the replica context), compiling nothing; e.g. to learn what ``fn`` touches. Returns the trace
        in the global view (:meth:`adopt` hands it to a function of the same computation), else ``None``."""
        if self._per_replica:
            self._per_replica_body(args)  # traces fn once (which outputs vary over the replicas)
            return None
        return Traced.of(self._fn, args)

    def adopt(self, traced: Traced, *args: Any) -> None:
        """Takes ``traced`` (:meth:`trace` of a function computing what this one does, with these ``args``)
        as this function's own trace for ``args``' signature: compiling it then traces ``fn`` no more."""
        if not self._per_replica:
            self._adopted[self.signature(*args)] = traced

    def make_jaxpr(self, *args: Any) -> Any:
        """``jax.make_jaxpr`` of what a call with ``args`` computes (per replica: the ``jax.shard_map``), its
        inputs the leaves of ``args``; traces ``fn`` again, compiling nothing."""
        body = self._per_replica_body(args) if self._per_replica else self._fn
        return jax.make_jaxpr(body)(*args)

    def signature(self, *args: Any) -> Any:
        """A hashable key of ``args``' signature (tree, shapes, dtypes, layouts): two calls with equal keys run
        one compiled program. ``jax.ShapeDtypeStruct``s with shardings key like the arrays they stand for."""
        leaves, treedef = jax.tree.flatten(args)
        return treedef, _signature(leaves)

    def _for(self, args: tuple[Any, ...], called: bool = False) -> Any:
        """The jitted program for ``args``' signature, built the first time it is seen."""
        key = self.signature(*args)
        entry = self._compiled.get(key)
        if entry is None or (called and not entry[1]):
            if entry is None:
                # tracing fn here (when the outputs' layouts need its shapes): mirrorax.steps.first_call
                fn = _first_call.run(self._compile, args)
            else:
                fn = entry[0]
            entry = self._compiled[key] = (fn, called)
            self._fresh = True  # (its first call traces and compiles, unless lowered and compiled before)
        return entry[0]

    @property
    def compile_count(self) -> int:
        """How many signatures were compiled (one per distinct input shape/layout)."""
        return sum(called for _, called in self._compiled.values())

    # -- building ------------------------------------------------------------------------------------
    def _compile(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        return self._build(args)

    def _build(self, args: tuple[Any, ...]) -> Any:
        s = self._mesh
        body = self._per_replica_body(args) if self._per_replica else self._fn
        given = self._out_shardings_arg
        out_shardings = given(*args) if callable(given) else given
        if callable(given) and out_shardings is not None:
            check_out_shardings(out_shardings, received="out_shardings(*args)")
        if out_shardings is None:  # the rules of this module's docstring need the outputs' shapes
            # One trace of fn serves both: the shapes, and the program (jit replays the trace's jaxpr, which
            # runs none of fn's Python again: a Keras model's trace takes seconds).
            traced = self._adopted.pop(self.signature(*args), None) or Traced.of(body, args)
            out_shardings = self._out_shardings(args, traced.shapes)
            body = traced.replay
        if self._flat_state:
            treedef: Any = jax.tree.structure(args[0])
            first = out_shardings[0]
            leaves = [first] * treedef.num_leaves if isinstance(first, jax.sharding.Sharding) else \
                treedef.flatten_up_to(first)
            jitted = jax.jit(_flat_state_body(self._guarded(body), treedef), donate_argnums=self._donate,
                             out_shardings=(leaves, *out_shardings[1:]))
            return FlatProgram(jitted, treedef)
        body = self._guarded(body)

        if self._ready is not None:  # the window waits on an output the caller named
            return jax.jit(body, donate_argnums=self._donate, out_shardings=out_shardings)

        def with_token(*a: Any) -> tuple[Any, jax.Array]:
            # A fresh output of this program: ready exactly when the call is done, and never donated by
            # the next call (the outputs themselves may be), so the window can wait on it.
            return body(*a), jnp.zeros((), jnp.int32)

        return jax.jit(with_token, donate_argnums=self._donate, out_shardings=(out_shardings, s.replicated))

    def _guarded(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """``body``, except that JAX tracing it during :meth:`call_fast` (its compiled signature did not match)
        raises :class:`_SignatureChanged`."""
        @functools.wraps(body)
        def guarded(*a: Any) -> Any:
            if self._guard:
                raise _SignatureChanged
            return body(*a)

        return guarded

    def _out_shardings(self, args: tuple[Any, ...], out_shape: PyTree) -> PyTree:
        s = self._mesh
        axis = s.batch_axis
        batch_rows = {a.shape[0] for a in jax.tree.leaves(args) if _batch_axis_of(a, axis) and a.ndim}

        def layout_of(arg: Any) -> PyTree:
            return layout(arg, s.replicated)

        def by_shape(tree: PyTree) -> PyTree:
            return jax.tree.map(lambda o: s.batch_sharding if o.ndim and o.shape[0] in batch_rows else s.replicated,
                                tree)

        def like_arg(out: PyTree) -> PyTree | None:
            o_leaves, o_def = jax.tree.flatten(out)
            for arg in args:
                a_leaves, a_def = jax.tree.flatten(arg)
                # jaxlib ships no stub for PyTreeDef (it lives in the compiled jaxlib._jax), so mypy cannot type ==.
                if a_def == o_def and all(np.shape(a) == o.shape and _dtype(a) == o.dtype  # type: ignore[operator]
                                          for a, o in zip(a_leaves, o_leaves)):
                    return layout_of(arg)
            return None

        if self._per_replica:
            return self._per_replica_shardings(out_shape, like_arg)
        whole = like_arg(out_shape)
        if whole is not None:
            return whole
        if isinstance(out_shape, (tuple, list)):
            return type(out_shape)(like_arg(o) or by_shape(o) for o in out_shape)
        return by_shape(out_shape)

    # -- per replica (strategy.run) -----------------------------------------------------------------
    def _per_replica_body(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        s = self._mesh
        axis = s.batch_axis
        in_specs = jax.tree.map(lambda a: P(axis) if _batch_axis_of(a, axis) else P(), args)
        fn = self._fn
        seen: dict[str, Any] = {}

        def inner(*a: Any) -> Any:
            with replica_scope(ReplicaContext(axis, s.num_replicas_in_sync)):
                out = fn(*a)
            leaves, seen["treedef"] = jax.tree.flatten(out)
            seen["varying"] = [varies_over(v, axis) for v in leaves]
            return out

        # First trace: which outputs vary over the replicas (every output stacked per replica, so any
        # value is allowed); the real program then gives each leaf its own out_spec.
        probe = jax.shard_map(lambda *a: jax.tree.map(lambda v: jnp.asarray(v)[None], inner(*a)), mesh=s.mesh,
                              in_specs=in_specs, out_specs=P(axis))
        jax.eval_shape(probe, *args)
        flags, treedef = list(seen["varying"]), seen["treedef"]
        self._flags = flags

        def body(*a: Any) -> Any:
            leaves = jax.tree.leaves(inner(*a))
            # A scalar per replica becomes one element of a (num_replicas,) array; arrays concatenate.
            return jax.tree.unflatten(treedef, [jnp.asarray(v)[None] if f and jnp.ndim(v) == 0 else v
                                                for v, f in zip(leaves, flags)])

        out_specs = jax.tree.unflatten(treedef, [P(axis) if f else P() for f in flags])
        return jax.shard_map(body, mesh=s.mesh, in_specs=in_specs, out_specs=out_specs)

    def _per_replica_shardings(self, out_shape: PyTree, like_arg: Callable[[PyTree], PyTree | None]) -> PyTree:
        s = self._mesh
        leaves, treedef = jax.tree.flatten(out_shape)
        shardings = [s.batch_sharding if f else s.replicated for f in self._flags]
        default = jax.tree.unflatten(treedef, shardings)
        # Replicated outputs shaped like an argument (a state passed through) keep that argument's layout.
        if isinstance(out_shape, (tuple, list)):
            parts = []
            for o, d in zip(out_shape, default):
                match = like_arg(o)
                replicated_only = all(x == s.replicated for x in jax.tree.leaves(d))
                parts.append(match if match is not None and replicated_only else d)
            return type(out_shape)(parts)
        match = like_arg(out_shape)
        return match if match is not None and all(x == s.replicated for x in shardings) else default
