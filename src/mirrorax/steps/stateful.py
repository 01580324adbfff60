"""What ``strategy.jit`` and ``strategy.run`` return: a step compiled per signature that also threads the
state of the objects it changes in place, through the split/merge protocol (:mod:`mirrorax.steps.split_merge`).

One road for every front-end. A call:

1. **Objects among the arguments** (Flax NNX): split out per call (:func:`mirrorax.steps.split_merge.split_args`);
   the call is then one of a function of ``(structure, states, *args)`` that binds them in their places
   (:func:`mirrorax.steps.split_merge.threaded`), itself a call of step 2. Their state is placed where the
   protocol's layouts say the first time (a leaf already on the strategy's mesh keeps its layout), donated
   when every argument holding objects is in ``donate_argnums``, and written back after the call.
2. **Objects the step reaches by itself** (Keras variables): per input signature the step is traced once
   inside every registered protocol's recorder (:meth:`~mirrorax.steps.split_merge.SplitMerge.discover`); a step
   that touches none compiles exactly as a plain function (the trace is the plain program's, no extra
   input or output). Otherwise its program takes the found objects' state as explicit inputs (``changed``:
   donated, ``read``: passed), binds it for the step and returns the new ``changed`` state, in the
   protocol's layouts. Each call hands it the current state (placed as the layouts say once, and written
   back), donates what the engine wrote last and nobody took since (the protocol's
   :meth:`~mirrorax.steps.split_merge.SplitMerge.owned`; anything else is copied first) and writes the new state
   back after the call (device arrays, never copied to the host).

Around every step, whatever its objects: a batch that knows its real rows reaches it cut to them in the
global view (:func:`mirrorax.steps.replica.real_rows_view`); the step's batch is known to
``mx.compute_average_loss`` (:func:`mirrorax.steps.replica.batch_scope`); Keras metrics see a short batch's padding
masked per replica (:mod:`mirrorax.steps.padding`), a result that lets the padding in is warned once, and outputs
with one row per example are recorded for ``strategy.gather`` & co. (:func:`mirrorax.steps.replica.mark_rows`).
Every call pushes into the strategy's window; a loop of one signature whose step needs none of this takes a
fast path (:meth:`mirrorax.steps.dispatch.StrategyFunction.call_fast`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from mirrorax.steps import first_call as _first_call
from mirrorax.steps.dispatch import MISSED, InFlight, OutShardings, StrategyFunction
from mirrorax.steps.distributed_batch import (
    Pieces,
    gather_pieces,
    host_batches,
    padded_pieces_alive,
    restore_pieces,
    unpieced,
)
from mirrorax.steps.held import HeldCall
from mirrorax.steps.padding import (
    even_out_shardings,
    masked_metric_updates,
    padding_outputs,
    per_row_leaves,
    unmasked_metrics,
    warn_padding,
    warn_replicated_batch,
    warn_stray_rows,
)
from mirrorax.steps.replica import RowValues, batch_scope, find_batch, keep_padding_view, mark_rows, real_rows_view
from mirrorax.steps.split_merge import Split, SplitMerge, objects_back, place, protocols, split_args, threaded

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["StatefulFunction", "check_not_tf_function"]

PyTree = Any


def check_not_tf_function(fn: Any, where: str) -> None:
    """Raises ``TypeError`` if ``fn`` is a TensorFlow ``tf.function`` (a decorator left on a ported step)."""
    if type(fn).__module__.startswith("tensorflow.") and hasattr(fn, "python_function"):
        name = getattr(fn.python_function, "__name__", "fn")
        raise TypeError(
            f"{where} received {name}, a TensorFlow tf.function (type {type(fn).__name__}). TensorFlow would trace "
            f"it into a TF graph that JAX cannot run. Remove @tf.function from {name}: {where} compiles it with "
            "XLA itself (pass the plain Python function).")


def _as_array(x: Any) -> Any:
    """An output JAX would convert (``__jax_array__``: a Keras variable the step returns, e.g.
    ``apply_gradients``' step counter) as its array, read where the step runs (in the bound state)."""
    if isinstance(x, (jax.Array, np.ndarray)) or not callable(getattr(type(x), "__jax_array__", None)):
        return x
    return x.__jax_array__()


class _Found:
    """One signature's objects found by the discovery trace, per protocol, and the program that threads them."""

    __slots__ = ("parts", "targets", "changed", "function", "last")

    def __init__(self, parts: list[tuple[SplitMerge, Any, Any]], targets: list[list[Any]], changed: list[Any]) -> None:
        self.parts = parts  # (protocol, objects, structure)
        self.targets = targets  # per part: each state leaf's layout ((changed, read)'s leaves)
        self.changed = changed  # per part: the changed state's tree
        self.function: StrategyFunction = None  # type: ignore[assignment]  # set once the parts are known
        self.last: list[list[Any]] = [[] for _ in parts]  # per part: the read leaves passed last (placed)


class _Traced:
    """What a trace of a step saw of its outputs: which hold one row per example, their paths, the metrics it
    could not give the mask, and their shapes."""

    __slots__ = ("per_row", "paths", "unmasked", "shapes")

    def __init__(self, per_row: list[bool], paths: list[str], unmasked: list[str], shapes: Any) -> None:
        self.per_row, self.paths, self.unmasked, self.shapes = per_row, paths, unmasked, shapes


def _shape_of(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))


def _shape_key(args: tuple[Any, ...]) -> Any:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((np.shape(a), getattr(a, "dtype", type(a))) for a in leaves)


def _laid_out(a: Any, target: Any) -> bool:
    return isinstance(a, jax.Array) and (a.sharding is target or a.sharding == target)


def _place_stray(mesh: BatchMesh, leaves: list[Any], targets: list[Any], which: Iterable[int]) -> list[int]:
    """Places each leaf of ``which`` not laid out as ``targets`` says (process 0's values), in ``leaves``;
    returns their indices (none: nothing moved)."""
    stray = [j for j in which if not _laid_out(leaves[j], targets[j])]
    if stray:
        for j, a in zip(stray, place(mesh, [leaves[j] for j in stray], [targets[j] for j in stray])):
            leaves[j] = a
    return stray


def _out_layouts(given: OutShardings, state: Callable[[Any, Any], Any]) -> OutShardings:
    """A threading program's ``out_shardings``: ``state(first, second)``, the new state's layouts, of the
    program's two state arguments, then the user's for the step's outputs (given, or a function of the step's
    arguments; ``None``: JAX's choice)."""
    if given is None:
        return None

    def out_shardings(first: Any, second: Any, *args: Any) -> Any:
        user = given(*args) if callable(given) else given
        return None if user is None else (state(first, second), user)

    return out_shardings


def _of_pieces(given: OutShardings) -> OutShardings:
    """``out_shardings`` for the function of ``(stubs, *args)`` (pieces taken out): a callable of the user's
    arguments is given them with each piece back in its place."""
    if not callable(given):
        return given

    def out_shardings(stubs: Any, *args: Any) -> Any:
        return given(*restore_pieces(stubs, args))

    return out_shardings


def _write_back(kinds: Sequence[SplitMerge], structure: Any, objects: dict[int, list[Any]], new: list[list[Any]],
                changed: list[Any] | None) -> None:
    """The new state's leaves ``new`` (per part of ``structure``) written into ``objects`` (per protocol index) by
    each front-end's ``update``; ``changed``: per part, the new state's tree where the step added or removed
    variables (``None``: unchanged), those it removed taken from the objects too (the front-end's ``prune``)."""
    for (k, _, tree), part, after in zip(structure.value, new, changed or [None] * len(new)):
        state = (after or tree).unflatten(part)
        kinds[k].update(tuple(objects[k]), state)
        prune = getattr(kinds[k], "prune", None) if after is not None else None
        if prune is not None:
            prune(tuple(objects[k]), state)


def _pieces_first(run: Callable[..., Any]) -> Callable[..., Any]:
    """``threaded(fn)``'s ``run(structure, leaves, *args)`` as a function of ``(structure, leaves, stubs, *args)``:
    each piece of ``args`` restored from its stub, then the objects bound."""
    @functools.wraps(run)
    def with_pieces(structure: Any, leaves: Any, stubs: Any, *args: Any) -> Any:
        return run(structure, leaves, *restore_pieces(stubs, args))

    return with_pieces


class StatefulFunction:
    """``strategy.jit(fn)`` / ``strategy.run``'s function: a :class:`~mirrorax.steps.dispatch.StrategyFunction` that
    also threads the state of the objects ``fn`` changes in place (see the module's docstring).

    Called like ``fn``. Per input signature ``fn`` is traced once to find the objects it reaches by itself;
    a step that touches none and takes none among its arguments runs as the plain
    :class:`~mirrorax.steps.dispatch.StrategyFunction` (no extra input or output). Every call pushes into the
    strategy's window, as a plain one does.
    """

    def __init__(self, mesh: BatchMesh, window: InFlight, fn: Callable[..., Any], *,
                 donate_argnums: int | Sequence[int] = (), per_replica: bool = False,
                 out_shardings: OutShardings = None, where: str = "strategy.jit", arguments: bool = True,
                 pieces: bool = True, lead: int = 0, objects: bool = True) -> None:
        check_not_tf_function(fn, where)
        self._mesh = mesh
        self._window = window

        user_fn = fn
        sharding = mesh.batch_sharding

        @functools.wraps(user_fn)
        def with_batch(*args: Any) -> Any:
            if not per_replica:  # the global view: a batch whose real rows are known reaches fn cut to them
                args = real_rows_view(args, sharding)
            batch = find_batch(args)  # the step's batch, for compute_average_loss in TF's form
            # Padding the step sees (per replica; a count only the devices know): Keras metrics get the mask.
            mask = batch.mask if batch is not None and getattr(batch, "has_padding", True) else None
            with batch_scope(batch), masked_metric_updates(mask), unmasked_metrics() as unmasked:
                out = user_fn(*args)
            out = jax.tree.map(_as_array, out)
            if self._tracing is not None and batch is not None:  # what the call being made returns
                paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
                self._traced[self._tracing] = _Traced(per_row_leaves(out, np.shape(batch.mask)[0]), paths,
                                                      list(unmasked), jax.tree.map(_shape_of, out))
            return out

        self._fn = fn = with_batch
        self._per_replica = per_replica
        self._where = where
        self._donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self._given_out = out_shardings  # as given (the threaded function of objects among the arguments takes it)
        if out_shardings is not None and not per_replica:
            out_shardings = self._even_outputs(out_shardings)
        self._out_shardings = out_shardings
        self._plain = StrategyFunction(mesh, window, fn, donate_argnums=donate_argnums, per_replica=per_replica,
                                       out_shardings=out_shardings)
        functools.update_wrapper(self, user_fn)  # type: ignore[arg-type]
        self._user_fn = user_fn
        # input shapes -> the objects the discovery trace found and their program, or None (none found)
        self._state: dict[Any, _Found | None] = {}
        # (copies keep their layout: replicated, or a layout map's)
        self._copy = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                             out_shardings=None if mesh.has_layout_map else mesh.replicated)
        self._padding_checked: set[Any] = set()  # signatures whose use of the mask was checked
        self._padding_warned = False
        self._plain_last = False  # the last call ran the plain program and needed nothing more (the fast path)
        self._tracing: Any = None  # the signature of the call being made (its traces record what fn returns)
        self._traced: dict[Any, _Traced] = {}
        # the arrays the calls wrote into found objects and no call took since (not kept alive): donated when
        # the objects still own them
        self._written: dict[int, weakref.ref[Any]] = {}
        self._prune_at = 64  # (dead entries dropped when the record grows past this)
        # objects among the arguments (off for the threaded function itself)
        self._arguments = arguments and objects
        self._objects = objects  # (off: strategy.jit(stateful=False): no object is looked for)
        # (donated state or not, pieces or not) -> the threaded function
        self._threaded: dict[tuple[bool, bool], tuple[StatefulFunction, Any]] = {}
        # pieces of padded batches among the arguments, taken out (off for the functions that take them out)
        self._gathers = pieces
        self._with_pieces: StatefulFunction | None = None  # the function of (stubs, *args) (gather_pieces)
        self._lead = lead  # arguments before the user's (the threaded and piece functions' own)
        self._stray_warned = False
        self._holds: list[HeldCall] = []  # the objects of the latest calls, held (at most 4)
        self._layouts: dict[Any, list[Any]] = {}  # (protocol, structure, shapes) -> each state leaf's layout

    def _even_outputs(self, given: OutShardings) -> Callable[..., Any]:
        """``out_shardings`` as given, except that an output the given layout would split unevenly (one row per
        real example of a batch cut to a count the devices do not divide: 64 rows on 3 devices) is
        replicated: an array is split into equal parts only."""
        def shapes(*args: Any) -> Any:  # what the step's trace recorded (its discovery trace ran first)
            traced = self._traced.get(self._tracing)
            if traced is None:  # (no discovery trace ran: no object to guard either)
                jax.eval_shape(self._fn, *args)
                traced = self._traced[self._tracing]
            return traced.shapes

        return even_out_shardings(given, shapes, self._mesh.replicated, self._mesh.num_replicas_in_sync)

    @property
    def compile_count(self) -> int:
        """How many signatures were compiled (one per distinct input shape/layout and object structure)."""
        return (self._plain.compile_count + sum(e.function.compile_count for e in self._state.values() if e is not None)
                + sum(f.compile_count for f, _ in self._threaded.values())
                + (self._with_pieces.compile_count if self._with_pieces is not None else 0))

    def _split(self, args: tuple[Any, ...]) -> tuple[Split | None, tuple[SplitMerge, ...]]:
        kinds = protocols()
        return (split_args(args, kinds) if kinds and self._arguments else None), kinds

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the program a call with ``args`` runs (the objects' state first)."""
        split, kinds = self._split(args)
        if split is not None:
            self._check_global_view(split, kinds)
            pieces = self._pieces(split.args)
            donated = bool(split.positions) and split.positions <= set(self._donate)
            return self._function(donated, pieces is not None)[0].lower(
                split.structure, self._placed(split, kinds)[0], *self._rest(split.args, pieces))
        pieces = self._pieces(args)
        if pieces is not None:
            return self._pieced().lower(pieces.stubs, *pieces.args)
        with self._call(args):
            entry = self._entry(args)
            if entry is None:
                return self._plain.lower(*args)
            return entry.function.lower(*self._states(entry, donate=False), *args)

    @contextlib.contextmanager
    def _call(self, args: tuple[Any, ...]) -> Iterator[Any]:
        """Marks the traces made inside as those of ``args``' signature (they record what the step returns)."""
        key = _shape_key(args)
        self._tracing = key
        try:
            yield key
        finally:
            self._tracing = None

    def program(self, *args: Any) -> Any:
        """The compiled program of a step whose state is explicit (see
        :meth:`mirrorax.steps.dispatch.StrategyFunction.program`); a step that changes objects is called as a
        function."""
        name = getattr(self._user_fn, "__name__", "fn")
        split, _ = self._split(args)
        if self._pieces(args if split is None else split.args) is not None:
            raise TypeError(f"{name} was given pieces of a padded batch (arrays unpacked from a DistributedBatch, "
                            "e.g. for x, y in dist): a call cuts each to its batch's real rows, which program() "
                            "cannot. Call the function itself, or take program() with whole batches.")
        if split is not None:
            raise TypeError(f"{name} takes stateful objects (e.g. Flax NNX modules): call it as a function (their new "
                            "state is written back after each call). program() is for steps whose state is an "
                            "explicit argument of arrays.")
        with self._call(args):
            entry = self._entry(args)
        if entry is not None:
            what = ", ".join(n for p, _, s in entry.parts for n in p.names(s)[:3])
            raise TypeError(f"{name} reads or assigns stateful objects ({what}; e.g. Keras variables): call it as a "
                            "function (it writes the new values back after each call). program() is for steps whose "
                            "state is an explicit argument.")
        with self._call(args):
            return self._plain.program(*args)

    def _check_not_in_tf_function(self) -> None:
        tf = sys.modules.get("tensorflow")
        if tf is not None and tf.inside_function():
            raise TypeError(f"{self._where} was called while TensorFlow traces a tf.function (a @tf.function left on "
                            "the function that calls it, e.g. distributed_train_step). TensorFlow would run the "
                            "step once while tracing and keep its result as a constant. Remove @tf.function: "
                            f"{self._where} compiles the step with XLA itself.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            # The fast path: the last call's program, when that call needed nothing of this class (no object,
            # no padding to mark, the global view): a loop of one signature then pays no per-leaf look at its
            # arguments (StrategyFunction.call_fast). Whether a call needs more follows from its signature, which
            # JAX's dispatch checks (another one misses), and from its arguments holding no object, which the
            # signature says too (an object is no array).
            if self._plain_last and not (self._gathers and padded_pieces_alive()):  # (else a piece may be there)
                self._check_not_in_tf_function()
                out = self._plain.call_fast(args)
                if out is not MISSED:
                    return out
            if self._holds:
                out = self._call_held(args)
                if out is not MISSED:
                    return out
            split, kinds = self._split(args)
            if split is not None:
                return self._call_split(args, split, kinds)
            pieces = self._pieces(args)
            if pieces is not None:
                self._plain_last = False
                return self._pieced()(pieces.stubs, *pieces.args)
        self._check_not_in_tf_function()
        if kwargs:
            return self._plain(*args, **kwargs)  # raises, naming the fix
        batch = find_batch(args)
        real = getattr(batch, "rows", None)
        if batch is not None and self._per_replica:
            # Every replica holds as many rows, padding included: one program serves every row count.
            args = keep_padding_view(args)
            batch = find_batch(args)
        padding = batch is not None and bool(getattr(batch, "has_padding", False))
        with self._call(args) as key:
            entry = self._entry(args, key)
            sees = padding and (self._per_replica or real is None)
            if sees and not self._padding_warned and getattr(batch, "padded", False):
                self._check_padding(args, batch, entry, key, real)
            # (set before the call: a call that raises leaves it off)
            self._plain_last = False
            if entry is None:
                out = self._plain(*args)
                self._plain_last = not padding and not self._per_replica
            else:
                changed, read = self._states(entry)
                new, out = entry.function(changed, read, *args)
                for (p, objects, _), c, r in zip(entry.parts, new, read):
                    p.update(objects, (c, r))
                    self._wrote(jax.tree.leaves(c))
        if padding:
            self._mark_rows(out, key, batch)
        return out

    def _mark_rows(self, out: Any, key: Any, batch: Any) -> None:
        """Records the outputs holding one row per example of ``batch`` (which has padding), so that
        ``strategy.gather`` & co. give their real rows only."""
        traced = self._traced.get(key)
        leaves = jax.tree.leaves(out)
        if traced is None or len(traced.per_row) != len(leaves):
            return
        cut = not self._per_replica and getattr(batch, "rows", None) is not None
        rows = RowValues(np.shape(batch.mask)[0] // self._mesh.num_replicas_in_sync, None if cut else batch.mask)
        for leaf, per_row in zip(leaves, traced.per_row):
            if per_row and isinstance(leaf, jax.Array):
                mark_rows(leaf, rows)

    def _check_padding(self, args: tuple[Any, ...], batch: Any, entry: _Found | None, key: Any,
                       real: int | None) -> None:
        """Warns once if ``args`` (holding ``batch``, whose padding the step sees; ``real`` of its rows are
        real, ``None``: known to the devices only) go to a program that lets the padding into a result
        (checked once per signature: a trace, nothing compiled)."""
        if key in self._padding_checked:
            return
        self._padding_checked.add(key)
        if entry is None:
            jaxpr, leaves = self._plain.make_jaxpr(*args), jax.tree.leaves(args)
            objects: list[str] = []
        else:
            states = self._states(entry, donate=False)
            jaxpr, leaves = entry.function.make_jaxpr(*states, *args), jax.tree.leaves((states, *args))
            objects = [n for p, _, s in entry.parts for n in p.names(s)]
        traced = self._traced.get(key)
        paths = traced.paths if traced is not None else []
        names = objects + [f"output{p}" for p in paths]  # (the program's outputs: the objects' state, then fn's)
        entered = [names[i] if len(names) == len(jaxpr.out_avals) else f"output {i}"
                   for i in padding_outputs(jaxpr, leaves, batch)]
        metrics = sorted(set(traced.unmasked)) if traced is not None else []
        if not entered and not metrics:
            return
        self._padding_warned = True
        warn_padding(self._where, getattr(self._fn, "__name__", "fn"), real, np.shape(batch.mask)[0],
                     self._mesh.num_replicas_in_sync if self._per_replica else None, entered, metrics)

    # -- objects a discovery trace finds --------------------------------------------------------------
    def _entry(self, args: tuple[Any, ...], key: Any = None) -> _Found | None:
        key = _shape_key(args) if key is None else key
        if key in self._state:
            return self._state[key]
        self._check_host_batches(args[self._lead:])
        if not self._objects:
            self._state[key] = None
            return None
        entry = self._state[key] = _first_call.run(self._discover, args)  # the step's first trace
        return entry

    def _check_host_batches(self, args: tuple[Any, ...]) -> None:
        """Warns (once per signature) when the user's arguments hold what is almost certainly a global batch
        given whole from the host, which a step gets replicated, not split
        (:func:`mirrorax.steps.padding.host_batches`)."""
        if self._mesh.num_replicas_in_sync < 2:
            return
        if self._per_replica:  # strategy.run's function takes (args, kwargs)
            args = (*args[0], *args[1].values()) if len(args) == 2 else args
        found = host_batches(args)
        if found:
            warn_replicated_batch(self._where, getattr(self._user_fn, "__name__", "fn"), found,
                                  self._mesh.num_replicas_in_sync, self._per_replica)

    # -- pieces of padded batches among the arguments ---------------------------------------------------
    def _pieces(self, args: tuple[Any, ...]) -> Pieces | None:
        """The pieces of padded batches among ``args`` (:func:`mirrorax.steps.distributed_batch.gather_pieces`), or
        ``None``; an array with a padded batch's rows that joins none is warned of once."""
        if not (self._gathers and padded_pieces_alive()):
            return None
        pieces = gather_pieces(args)
        if pieces is None:
            return None
        if pieces.stray and not self._stray_warned:
            self._stray_warned = True
            warn_stray_rows(self._where, getattr(self._user_fn, "__name__", "fn"), pieces.stray)
        return pieces if pieces.stubs else None

    @staticmethod
    def _rest(args: tuple[Any, ...], pieces: Pieces | None) -> tuple[Any, ...]:
        return args if pieces is None else (pieces.stubs, *pieces.args)

    def _pieced(self) -> StatefulFunction:
        """The function of ``(stubs, *args)`` (:class:`~mirrorax.steps.distributed_batch.Pieces`): the step given each
        piece from its stub, which the step sees as its batch (cut to its real rows in the global view)."""
        function = self._with_pieces
        if function is None:
            function = self._with_pieces = StatefulFunction(
                self._mesh, self._window, unpieced(self._user_fn), donate_argnums=tuple(i + 1 for i in self._donate),
                per_replica=self._per_replica, out_shardings=_of_pieces(self._given_out), where=self._where,
                arguments=False, pieces=False, lead=self._lead + 1, objects=self._objects)
        return function

    def _discover(self, args: tuple[Any, ...]) -> _Found | None:
        recorders = [(p, r) for p in protocols() if (r := p.discover(args, self._where)) is not None]
        if not recorders:
            return None  # (no front-end finds objects by tracing: the plain program traces fn itself)
        finds: list[tuple[SplitMerge, Callable[[], Any]]] = []
        fn = self._fn

        def probe(*a: Any) -> Any:
            with contextlib.ExitStack() as stack:
                entered = [(p, stack.enter_context(r)) for p, r in recorders]
                out = fn(*a)
            finds[:] = entered
            return out

        traced = StrategyFunction(self._mesh, self._window, probe, per_replica=self._per_replica).trace(*args)
        found = [(p, find()) for p, find in finds]  # (after the trace: what each recorder saw)
        parts = [(p, objects, p.split(objects)) for p, objects in found if objects is not None]
        if not parts:
            if traced is not None:  # the probe computed just what fn does: its trace is the plain program's
                self._plain.adopt(traced, *args)
            return None
        # (the window is not involved: the stateful function pushes its calls as the plain one would)
        entry = _Found([(p, objects, s) for p, objects, (s, _) in parts],
                       [list(p.layouts(s, state, self._mesh)) for p, _, (s, state) in parts],
                       [jax.tree.structure(state[0]) for _, _, (_, state) in parts])
        entry.function = self._stateful(entry)
        return entry

    def _stateful(self, entry: _Found) -> StrategyFunction:
        """The program of ``fn`` with the found objects' state: ``(changed, read, *args) -> (new changed, out)`` (the
        state first: each donated leaf's buffer goes to its new value, the first output of its shape)."""
        fn, parts = self._fn, entry.parts

        def stateful(changed: list[PyTree], read: list[PyTree], *args: Any) -> Any:
            with contextlib.ExitStack() as stack:
                bound = [stack.enter_context(p.bind(s, (c, r))) for (p, _, s), c, r in zip(parts, changed, read)]
                out = fn(*args)
                new = [p.state(s, (c, r), b) for (p, _, s), c, r, b in zip(parts, changed, read, bound)]
            return new, out

        donate = (0, *(i + 2 for i in self._donate))  # the changed state: replaced by the outputs
        layouts = [jax.tree.unflatten(tree, targets[:tree.num_leaves])  # the changed state's, per part
                   for tree, targets in zip(entry.changed, entry.targets)]
        return StrategyFunction(self._mesh, self._window, stateful, donate_argnums=donate,
                                per_replica=self._per_replica,
                                out_shardings=_out_layouts(self._out_shardings, lambda changed, read: layouts))

    def _wrote(self, arrays: list[Any]) -> None:
        """Records ``arrays`` as written by a call into the objects (see :meth:`_states`)."""
        written = self._written
        for a in arrays:
            written[id(a)] = weakref.ref(a)
        if len(written) > self._prune_at:  # (values the user replaced: their arrays died unseen)
            self._written = written = {k: r for k, r in written.items() if r() is not None}
            self._prune_at = 2 * len(written) + 64

    def _states(self, entry: _Found, donate: bool = True) -> tuple[list[PyTree], list[PyTree]]:
        """The found objects' ``(changed, read)`` states for a call, per part: each leaf placed where the
        protocol's layouts say (a leaf elsewhere is placed once and written back); with ``donate``, each
        changed leaf the engine wrote and the object still owns as it is, any other copied (in its layout), so
        that a value the user read, kept or assigned stays valid."""
        written, changed_all, read_all = self._written, [], []
        for i, ((p, objects, _), targets) in enumerate(zip(entry.parts, entry.targets)):
            _, (changed, read) = p.split(objects)
            owned = p.owned(objects, changed) if donate else None  # (before any write-back below)
            c_leaves, c_def = jax.tree.flatten(changed)
            r_leaves, r_def = jax.tree.flatten(read)
            n, leaves, last = len(c_leaves), c_leaves + r_leaves, entry.last[i]
            # (a leaf a call wrote is taken from the record when given to a call: replaced once it ends)
            refs = [(written.pop if donate else written.get)(id(a), None) for a in c_leaves]
            mine = [r is not None and r() is a for r, a in zip(refs, c_leaves)]
            # (checked: a changed leaf the engine did not write, a read one not passed last time as it is)
            fresh = [j for j in range(n) if not mine[j]]
            if len(last) != len(r_leaves) or any(a is not b for a, b in zip(r_leaves, last)):
                fresh += [n + j for j, a in enumerate(r_leaves) if not (j < len(last) and a is last[j])]
            stray = _place_stray(self._mesh, leaves, targets, fresh)
            if stray:
                changed = jax.tree.unflatten(c_def, leaves[:n])
                if stray[-1] >= n:
                    read = jax.tree.unflatten(r_def, leaves[n:])
                p.update(objects, (changed, read))
                r_leaves = leaves[n:]
            entry.last[i] = r_leaves  # (the read leaves only: a changed one is not kept alive)
            if owned is not None:
                copy = [j for j in range(n) if not (owned[j] and mine[j])]
                if copy:
                    for j, a in zip(copy, self._copy([leaves[j] for j in copy])):
                        leaves[j] = a
                    changed = jax.tree.unflatten(c_def, leaves[:n])
            changed_all.append(changed)
            read_all.append(read)  # (as split gave it, unless placed: update may skip it by identity)
        return changed_all, read_all

    # -- objects among the arguments ------------------------------------------------------------------
    def _call_split(self, args: tuple[Any, ...], split: Split, kinds: Sequence[SplitMerge]) -> Any:
        """A call whose objects were split out: their state placed, the threaded program called, the new state
        written back; the objects are then held for the calls that follow (:mod:`mirrorax.steps.held`)."""
        self._plain_last = False  # (the next call with objects looks for them again)
        self._check_global_view(split, kinds)
        if any(isinstance(a, jax.core.Tracer) for part in split.leaves for a in part):
            # Called inside another step's trace (a step that calls another): the objects are that step's,
            # already bound, and its batch already as the step sees it; the inner step runs inline, as a
            # jax.jit inside a jax.jit does (the objects handed over as they are: never rebuilt as pytrees).
            return self._user_fn(*args)
        pieces = self._pieces(split.args)
        leaves, targets = self._placed(split, kinds)
        donated = bool(split.positions) and split.positions <= set(self._donate)
        function, run = self._function(donated, pieces is not None)
        new, out = function(split.structure, leaves, *self._rest(split.args, pieces))
        held = None if split.structure in run.changed else HeldCall.of(args, split, kinds, targets, new, donated)
        if held is None:
            _write_back(kinds, split.structure, split.objects, new, run.changed.get(split.structure))
        else:
            held.write(new)
            self._holds = [h for h in self._holds if h.alive][-3:] + [held]
        return objects_back(out, split)

    def _call_held(self, args: tuple[Any, ...]) -> Any:
        """The call with the objects of an earlier call held (:class:`~mirrorax.steps.held.HeldCall`): their leaves
        read, the same program called, the new leaves written back, nothing walked; else
        :data:`~mirrorax.steps.dispatch.MISSED` (other objects, a changed structure: the call splits them)."""
        held = next((h for h in self._holds if h.alive and h.matches(args)), None)
        if held is None:
            return MISSED
        if not held.unchanged():
            self._holds.remove(held)
            return MISSED
        # (the registered protocols are asked only of an argument that is no plain array, number or batch)
        rest = held.rest(args, lambda x: any(p.owns(x) for p in protocols()))
        if rest is None:
            return MISSED
        self._check_not_in_tf_function()
        leaves = held.read()
        if not held.fresh(leaves):  # (a value the user assigned: placed where it lives, if it is not there)
            for part, targets, last in zip(leaves, held.targets, held.written):
                _place_stray(self._mesh, part, targets, [j for j, a in enumerate(part) if a is not last[j]])
        pieces = self._pieces(rest)
        function, run = self._function(held.donated, pieces is not None)
        new, out = function(held.structure, leaves, *self._rest(rest, pieces))
        if run.changed and held.structure in run.changed:  # (a batch of another shape whose trace adds a variable)
            self._holds.remove(held)
            _write_back(protocols(), held.structure, held.objects(args), new, run.changed[held.structure])
        else:
            held.write(new)
        return held.objects_back(out, args)

    def _check_global_view(self, split: Split, kinds: Sequence[SplitMerge]) -> None:
        if self._per_replica:
            names = sorted({type(o).__name__ for k, group in split.objects.items() for o in group} |
                           {type(kinds[k]).__name__ for k in split.objects})
            raise TypeError(f"{self._where} received stateful objects ({', '.join(names)}) among its arguments. "
                            "Their state is threaded through strategy.jit, the global view (one step over the "
                            "global batch, the one-device numbers on every device); per replica it would "
                            "diverge. Decorate the step with @strategy.jit and call it directly.")

    def _placed(self, split: Split, kinds: Sequence[SplitMerge]) -> tuple[list[list[Any]], list[list[Any]]]:
        """Each protocol's state leaves on the strategy's mesh, and their layouts: a leaf elsewhere (the objects'
        first call, an array the user set) is placed where :meth:`SplitMerge.layouts` says (process 0's values)
        and written back into the caller's objects, so that the next call finds it placed; a leaf on the mesh
        keeps its layout."""
        out, layouts = [], []
        mesh = self._mesh.mesh
        for (k, structure, tree), state, leaves in zip(split.structure.value, split.states, split.leaves):
            key = (k, structure, tuple((getattr(a, "shape", None), getattr(a, "dtype", None)) for a in leaves))
            targets = self._layouts.get(key)
            if targets is None:
                targets = self._layouts[key] = list(kinds[k].layouts(structure, state, self._mesh))
            layouts.append(targets)
            if all(type(a) is not np.ndarray and isinstance(getattr(a, "sharding", None), NamedSharding)
                   and (a.sharding.mesh is mesh or a.sharding.mesh == mesh) for a in leaves):
                out.append(leaves)  # the previous call's outputs (checked without the layouts)
                continue
            leaves = list(leaves)
            if _place_stray(self._mesh, leaves, targets, range(len(leaves))):
                kinds[k].update(tuple(split.objects[k]), tree.unflatten(leaves))
            out.append(leaves)
        return out, layouts

    def _function(self, donated: bool, pieced: bool = False) -> tuple[StatefulFunction, Any]:
        """The function of ``threaded(structure, leaves, *args)`` (one per donation of the state; with
        ``pieced``, ``args`` are ``(stubs, *args)`` of the pieces of padded batches among them), and the
        ``threaded`` run it calls (its ``changed``: the structures its traces saw the step change): objects the
        step also reaches by itself are found in its own discovery trace."""
        entry = self._threaded.get((donated, pieced))
        if entry is None:
            lead = 3 if pieced else 2
            donate = ((1,) if donated else ()) + tuple(i + lead for i in self._donate)
            given = _of_pieces(self._given_out) if pieced else self._given_out
            out_shardings = _out_layouts(given, lambda structure, leaves: jax.tree.map(lambda a: a.sharding, leaves))
            # (the pieces restored before the objects are bound: a step's objects are never rebuilt as pytrees)
            run = threaded(self._user_fn)
            function = StatefulFunction(
                self._mesh, self._window, _pieces_first(run) if pieced else run, donate_argnums=donate,
                out_shardings=out_shardings, where=self._where, arguments=False, pieces=False, lead=self._lead + lead)
            entry = self._threaded[donated, pieced] = (function, run)
        return entry
