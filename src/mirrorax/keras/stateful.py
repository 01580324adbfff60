"""Steps that use Keras objects as TF users write them: ``model(x)``, ``optimizer.apply_gradients``, metrics.

A step given to ``strategy.jit`` or ``strategy.run`` may read and assign Keras variables (a model's
weights, an optimizer's slots, a metric's totals, a seed generator's state) instead of taking and returning
them. Keras 3's JAX trainer threads such state the same way:

1. **Which variables.** The step is traced once per input signature inside a recording
   ``keras.StatelessScope``: every variable it reads or assigns is the step's state. What the step
   touches is what it needs, whatever path reaches it (a global, a closure, an attribute of an
   argument, a function it calls), with no registry to keep, and a step that touches none compiles
   exactly as before (the stateless forms are untouched). Variables the step creates while tracing
   (an optimizer's slots on its first ``apply``) are created there and initialised once it ends.
2. **The program.** The real trace takes those variables' values as explicit inputs (mapped with
   ``keras.StatelessScope(state_mapping=...)``), collects their assignments and returns the new values
   as outputs, replicated on the strategy's devices. The assigned variables' values are donated (the
   program reuses their buffers, as Keras's trainer donates its state) when the engine owns them, by an
   explicit rule rather than by counting references: a value the previous call wrote is owned until
   anyone reads the variable's value or assigns it through Keras's API (``v.value``, ``v.numpy()``,
   ``np.asarray(v)``, ``jnp.asarray(v)``, operators, ``v.assign``; copying or pickling it). Any other value
   (the first call's, one the user assigned, one read since the write) is copied first and the copy is
   donated, so whatever the user holds stays valid; in a loop that does not look at the variables between
   steps, every step reuses the buffers. The token is the variable's class: a write switches it to a
   subclass of its own class that adds no state and switches back at the first such read or assign.
3. **Write-back.** After the call each assigned variable holds its new value: a ``jax.Array`` on the
   devices (never copied to the host), set without ``assign``'s conversion (the program made it with
   the variable's dtype, shape and layout) and owned by the engine, so ``metric.result()``,
   ``model.predict`` or ``save_weights`` outside the step see it (and, by reading it, leave it to the
   user), and the next call takes it as its input.

Per replica (``strategy.run``) a variable's new value may differ between the replicas (a metric's
total over the replica's rows, a BatchNormalization statistic). It is made one value again by the
variable's ``aggregation``, as TF's distributed variables are: ``"sum"`` (Keras metrics) adds every
replica's change, ``"only_first_replica"`` (an optimizer's step counter) takes replica 0's value, and
``"mean"`` / ``"none"`` take the mean over the replicas. Gradients need no such rule: the gradient of a
replicated value comes out summed over the replicas.

:func:`value_and_grad` and :func:`grad` differentiate a loss written with the model as an object with
respect to Keras variables (TF's ``GradientTape.gradient(loss, model.trainable_variables)``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax.dispatch import MISSED, InFlight, OutShardings, StrategyFunction
from mirrorax.keras import _internals as internals
from mirrorax.padding import (
    even_out_shardings,
    masked_metric_updates,
    padding_outputs,
    per_row_leaves,
    unmasked_metrics,
    warn_padding,
)
from mirrorax.replica import (
    RowValues,
    batch_scope,
    find_batch,
    get_replica_context,
    keep_padding_view,
    mark_rows,
    real_rows_view,
    varies_over,
)

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["StatefulFunction", "value_and_grad", "grad", "check_not_tf_function", "check_no_variables"]

PyTree = Any
_SCOPE_CLASS: Any = None


def _keras() -> Any:
    import keras

    return keras


def _is_variable(x: Any) -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(x, keras.Variable)


def _tracking_scope() -> Any:
    """A ``keras.StatelessScope`` that records the variables read from it and assigned in it."""
    global _SCOPE_CLASS
    if _SCOPE_CLASS is None:
        keras = _keras()
        class TrackingScope(keras.StatelessScope):  # type: ignore[misc, name-defined]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.touched: dict[int, Any] = {}
                self.assigned: dict[int, Any] = {}

            def get_current_value(self, variable: Any) -> Any:
                self.touched.setdefault(id(variable), variable)
                value = super().get_current_value(variable)
                if value is None:
                    # Not mapped (a variable the first trace creates or meets): its own value, read as the
                    # enclosing scope sees it. Keras reads some values through this method alone
                    # (regularization losses), where None would fail.
                    internals.set_stateless_scope(self.original_scope)
                    try:
                        value = variable.value
                    finally:
                        internals.set_stateless_scope(self)
                return value

            def add_update(self, update: Any) -> None:
                variable = update[0]
                self.touched.setdefault(id(variable), variable)
                self.assigned.setdefault(id(variable), variable)
                super().add_update(update)

        _SCOPE_CLASS = TrackingScope
    return _SCOPE_CLASS


def _current_scope() -> Any:
    keras = sys.modules.get("keras")
    if keras is None:
        return None
    return internals.stateless_scope()


def _initialize_created_variables() -> None:
    # Variables created while tracing (an optimizer's slots on its first apply) wait uninitialised;
    # leaving an outermost StatelessScope initialises them, here outside any trace.
    with _keras().StatelessScope():
        pass


def check_not_tf_function(fn: Any, where: str) -> None:
    """Raises ``TypeError`` if ``fn`` is a TensorFlow ``tf.function`` (a decorator left on a ported step)."""
    if type(fn).__module__.startswith("tensorflow.") and hasattr(fn, "python_function"):
        name = getattr(fn.python_function, "__name__", "fn")
        raise TypeError(
            f"{where} received {name}, a TensorFlow tf.function (type {type(fn).__name__}). TensorFlow would trace "
            f"it into a TF graph that JAX cannot run. Remove @tf.function from {name}: {where} compiles it with "
            "XLA itself (pass the plain Python function).")


def check_no_variables(args: Any, where: str) -> None:
    """Raises ``TypeError`` naming the fix if ``args`` holds a Keras variable (JAX wants arrays)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_variable)[0]:
        if _is_variable(leaf):
            raise TypeError(
                f"{where} received a Keras variable at args{jax.tree_util.keystr(path)} ({leaf.path}), where JAX "
                "expects arrays. Either leave the variables out of the arguments and use the Keras objects in the "
                "step (model(x), optimizer.apply_gradients, metric.update_state: their state is threaded for you), "
                "or pass the values: [v.value for v in model.trainable_variables].")


# -- ownership: which values a call may donate --------------------------------------------------------
# A value a call wrote into a variable is the engine's until someone else may hold it. The token is the
# variable's class: the write switches the variable to a subclass of its own class (no slot or behaviour
# added) whose public doors to the value (``value``, hence ``numpy()``, ``np.asarray``, ``jnp.asarray``,
# operators and indexing; ``assign`` and the direct assign; copy, deepcopy and pickle) switch it back
# first. A variable still of its owned class holds what the engine wrote, and nobody took it since.
_OWNED: dict[type, type | None] = {}  # a variable's class -> its owned subclass (None: never owned)
_OWNED_CLASSES: set[type] = set()


def _owned_class(variable: Any) -> type | None:
    """The owned subclass of ``variable``'s class (made once per class), or ``None`` when a value can leave
    the variable without a read (Keras's NNX variables are JAX pytrees: ``jax.tree`` reaches the value)."""
    base = type(variable)
    if base in _OWNED:
        return _OWNED[base]
    owned: type | None = None
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(variable)):
        def release(self: Any) -> None:
            object.__setattr__(self, "__class__", base)

        def value(self: Any) -> Any:
            release(self)
            return self.value

        def assign(self: Any, value: Any) -> Any:
            release(self)
            return self.assign(value)

        def direct_assign(self: Any, value: Any) -> Any:
            release(self)
            return self._direct_assign(value)

        def reduce_ex(self: Any, protocol: Any) -> Any:  # copy.copy, deepcopy, pickle: of the variable's class
            release(self)
            return self.__reduce_ex__(protocol)

        body: dict[str, Any] = {"__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__,
                                "__doc__": base.__doc__, "value": property(value, doc=base.value.__doc__),
                                "assign": assign, "__reduce_ex__": reduce_ex}
        if internals.has_direct_assign(base):
            body["_direct_assign"] = direct_assign
        metaclass: Any = type(base)
        owned = metaclass(base.__name__, (base,), body)
        _OWNED_CLASSES.add(owned)
    _OWNED[base] = owned
    return owned


def _is_owned(variable: Any, written: Any) -> bool:
    """Whether ``variable`` holds ``written`` (what the last call wrote) and nobody took it since."""
    return type(variable) in _OWNED_CLASSES and written is not None and internals.variable_value(variable) is written


def _write(variable: Any, value: Any, direct: bool) -> None:
    """``variable.assign(value)`` for a value the step's program made (a replicated ``jax.Array`` of the
    variable's dtype and shape): set without ``assign``'s conversion and shape check where Keras allows,
    and then owned by the engine (see :func:`_is_owned`)."""
    setter = internals.direct_assign(variable) if direct else None  # Keras has no public fast path
    if setter is None:
        variable.assign(value)  # (in an enclosing StatelessScope: an update of that scope, not a write)
        return
    setter(value)
    owned = _owned_class(variable) if internals.variable_value(variable) is value else None
    if owned is not None:
        object.__setattr__(variable, "__class__", owned)


class _Entry:
    """One signature's stateful program and the variables it threads."""

    __slots__ = ("variables", "assigned", "kept", "function", "seen")

    def __init__(self, variables: list[Any], assigned: list[Any], function: StrategyFunction) -> None:
        self.variables = variables
        self.assigned = assigned  # their values are donated to each call, new values written back
        mine = {id(v) for v in assigned}
        self.kept = [v for v in variables if id(v) not in mine]  # read only: passed, never donated
        self.function = function
        self.seen: list[Any] = [None] * len(self.kept)  # the kept variables' values last passed


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


class StatefulFunction:
    """``strategy.jit(fn)`` / ``strategy.run``'s function: a :class:`~mirrorax.dispatch.StrategyFunction`
    that also threads the Keras variables ``fn`` reads or assigns (see the module's docstring).

    Called like ``fn``. Per input signature ``fn`` is traced once to find its variables; a step that
    touches none runs as the plain :class:`~mirrorax.dispatch.StrategyFunction` (no extra input or
    output). Every call pushes into the strategy's window, as a plain one does.
    """

    def __init__(self, mesh: BatchMesh, window: InFlight, fn: Callable[..., Any], *,
                 donate_argnums: int | Sequence[int] = (), per_replica: bool = False,
                 out_shardings: OutShardings = None, where: str = "strategy.jit") -> None:
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
            # a Keras variable returned (apply_gradients returns the step counter) comes back as its value
            out = jax.tree.map(lambda x: x.value if _is_variable(x) else x, out, is_leaf=_is_variable)
            if self._tracing is not None and batch is not None:  # what the call being made returns
                paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
                self._traced[self._tracing] = _Traced(per_row_leaves(out, np.shape(batch.mask)[0]), paths,
                                                      list(unmasked), jax.tree.map(_shape_of, out))
            return out

        self._fn = fn = with_batch
        self._per_replica = per_replica
        self._where = where
        self._donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        if out_shardings is not None and not per_replica:
            out_shardings = self._even_outputs(out_shardings)
        self._out_shardings = out_shardings
        self._plain = StrategyFunction(mesh, window, fn, donate_argnums=donate_argnums, per_replica=per_replica,
                                       out_shardings=out_shardings)
        functools.update_wrapper(self, user_fn)  # type: ignore[arg-type]
        # input shapes -> the stateful program and its variables, or None (the step touches none)
        self._state: dict[Any, _Entry | None] = {}
        # (copies keep their layout: replicated, or a layout map's)
        self._copy = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                             out_shardings=None if mesh.has_layout_map else mesh.replicated)
        self._padding_checked: set[Any] = set()  # signatures whose use of the mask was checked
        self._padding_warned = False
        self._plain_last = False  # the last call ran the plain program and needed nothing more (_call_fast)
        self._tracing: Any = None  # the signature of the call being made (its traces record what fn returns)
        self._traced: dict[Any, _Traced] = {}
        # id of an assigned variable -> what the last call (of any signature) wrote into it (not kept alive)
        self._written: dict[int, weakref.ref[Any]] = {}

    def _even_outputs(self, given: OutShardings) -> Callable[..., Any]:
        """``out_shardings`` as given, except that an output the given layout would split unevenly (one row per
        real example of a batch cut to a count the devices do not divide: 64 rows on 3 devices) is
        replicated: an array is split into equal parts only."""
        def shapes(*args: Any) -> Any:  # what the step's trace recorded (its discovery trace ran first)
            traced = self._traced.get(self._tracing)
            if traced is None:  # (no Keras imported, no discovery trace: no variable to guard either)
                jax.eval_shape(self._fn, *args)
                traced = self._traced[self._tracing]
            return traced.shapes

        return even_out_shardings(given, shapes, self._mesh.replicated, self._mesh.num_replicas_in_sync)

    @property
    def compile_count(self) -> int:
        """How many signatures were compiled (one per distinct input shape/layout)."""
        return self._plain.compile_count + sum(e.function.compile_count for e in self._state.values() if e is not None)

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the program a call with ``args`` runs (the variables' values first)."""
        with self._call(args):
            entry = self._entry(args)
            if entry is None:
                return self._plain.lower(*args)
            return entry.function.lower(self._values(entry.assigned), self._values(entry.kept), *args)

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
        """The compiled program of a step that touches no Keras variable (see
        :meth:`mirrorax.dispatch.StrategyFunction.program`); a stateful step is called as a function."""
        with self._call(args):
            stateful = self._entry(args) is not None
        if stateful:
            raise TypeError(f"{getattr(self._fn, '__name__', 'fn')} reads or assigns Keras variables: call it as a "
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

    def _call_fast(self, args: tuple[Any, ...]) -> Any:
        """The call through the last call's program when that call needed nothing of this class (no Keras
        variable, no padding to mark, the global view), else :data:`~mirrorax.dispatch.MISSED`: a loop of one
        signature then pays no per-leaf look at its arguments (:meth:`StrategyFunction.call_fast`). Whether
        a call needs more follows from its signature, which JAX's dispatch checks (another one misses)."""
        if not self._plain_last:
            return MISSED
        self._check_not_in_tf_function()
        return self._plain.call_fast(args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            out = self._call_fast(args)
            if out is not MISSED:
                return out
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
                out, new = entry.function(self._owned(entry), self._kept(entry), *args)
                direct = _current_scope() is None
                for v, value in zip(entry.assigned, new):
                    _write(v, value, direct)
                    self._written[id(v)] = weakref.ref(value)
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

    def _owned(self, entry: _Entry) -> list[Any]:
        """The assigned variables' values, to be donated to the call: the arrays the last call wrote where
        the engine still owns them (see :func:`_is_owned`), else a copy of the current value, in its layout
        (a value the user read, kept or assigned stays valid)."""
        values: list[Any] = []
        copy: list[int] = []  # written by the last call, but read or taken since
        fresh: list[int] = []  # not ours: the first call's, or assigned since
        for i, v in enumerate(entry.assigned):
            ref = self._written.get(id(v))
            ours = ref() if ref is not None else None
            values.append(ours)
            if not _is_owned(v, ours):
                (copy if ours is not None and internals.variable_value(v) is ours else fresh).append(i)
        if fresh:
            for i, a in zip(fresh, self._values([entry.assigned[i] for i in fresh])):
                values[i] = a
        if copy or fresh:
            which = sorted(copy + fresh)
            for i, a in zip(which, self._copy([values[i] for i in which])):
                values[i] = a
        return values

    def _kept(self, entry: _Entry) -> list[Any]:
        """The read-only variables' values (the ones passed last time when unchanged: no check)."""
        seen = entry.seen
        if all(internals.variable_value(v) is a and a is not None for v, a in zip(entry.kept, seen)):
            return seen
        seen[:] = self._values(entry.kept)
        return list(seen)

    def _check_padding(self, args: tuple[Any, ...], batch: Any, entry: _Entry | None, key: Any,
                       real: int | None) -> None:
        """Warns once if ``args`` (holding ``batch``, whose padding the step sees; ``real`` of its rows are
        real, ``None``: known to the devices only) go to a program that lets the padding into a result
        (checked once per signature: a trace, nothing compiled)."""
        if key in self._padding_checked:
            return
        self._padding_checked.add(key)
        if entry is None:
            jaxpr, leaves = self._plain.make_jaxpr(*args), jax.tree.leaves(args)
            variables: list[Any] = []
        else:
            values = (self._values(entry.assigned), self._values(entry.kept))
            jaxpr, leaves = entry.function.make_jaxpr(*values, *args), jax.tree.leaves((values, *args))
            variables = entry.assigned
        traced = self._traced.get(key)
        paths = traced.paths if traced is not None else []
        names = [f"output{p}" for p in paths] + [f"variable {getattr(v, 'path', v)!r}" for v in variables]
        entered = [names[i] if len(names) == len(jaxpr.out_avals) else f"output {i}"
                   for i in padding_outputs(jaxpr, leaves, batch)]
        metrics = sorted(set(traced.unmasked)) if traced is not None else []
        if not entered and not metrics:
            return
        self._padding_warned = True
        warn_padding(self._where, getattr(self._fn, "__name__", "fn"), real, np.shape(batch.mask)[0],
                     self._mesh.num_replicas_in_sync if self._per_replica else None, entered, metrics)

    # -- building -------------------------------------------------------------------------------------
    def _entry(self, args: tuple[Any, ...], key: Any = None) -> _Entry | None:
        key = _shape_key(args) if key is None else key
        if key in self._state:
            return self._state[key]
        check_no_variables(args, self._where)
        entry = self._state[key] = self._discover(args)
        return entry

    def _discover(self, args: tuple[Any, ...]) -> _Entry | None:
        if "keras" not in sys.modules:
            return None  # no Keras variable can exist without Keras imported
        scope_class = _tracking_scope()
        found: dict[str, Any] = {}
        fn = self._fn

        def probe(*a: Any) -> Any:
            with scope_class(collect_losses=True, initialize_variables=False) as scope:
                out = fn(*a)
            found["touched"], found["assigned"] = list(scope.touched.values()), list(scope.assigned.values())
            return out

        traced = StrategyFunction(self._mesh, self._window, probe, per_replica=self._per_replica).trace(*args)
        _initialize_created_variables()
        variables, assigned = found["touched"], found["assigned"]
        if not variables:
            if traced is not None:  # the probe computed just what fn does: its trace is the plain program's
                self._plain.adopt(traced, *args)
            return None
        # (the window is not involved: the stateful function pushes its calls as the plain one would)
        entry = _Entry(variables, assigned, None)  # type: ignore[arg-type]  # the program needs the split
        entry.function = self._stateful(entry.assigned, entry.kept)
        return entry

    def _stateful(self, assigned: list[Any], kept: list[Any]) -> StrategyFunction:
        fn, scope_class, axis, per_replica = self._fn, _tracking_scope(), self._mesh.batch_axis, self._per_replica

        def stateful(owned: list[Any], values: list[Any], *args: Any) -> Any:
            with scope_class(state_mapping=[*zip(assigned, owned), *zip(kept, values)], collect_losses=True,
                             initialize_variables=False) as scope:
                out = fn(*args)
            new = []
            for v, old in zip(assigned, owned):
                value = jnp.asarray(scope.get_current_value(v), dtype=old.dtype)
                if per_replica:
                    value = _one_value(v, old, value, varies_over(value, axis))
                new.append(value)
            return out, new

        given = self._out_shardings
        donate = (0, *(i + 2 for i in self._donate))  # the assigned variables' values: replaced by the outputs
        if given is None:
            out_shardings: OutShardings = None
        else:
            def out_shardings(owned: Any, values: Any, *args: Any) -> Any:
                user = given(*args) if callable(given) else given
                return None if user is None else (user, [self._layout_of(v) for v in assigned])
        return StrategyFunction(self._mesh, self._window, stateful, donate_argnums=donate, per_replica=per_replica,
                                out_shardings=out_shardings)

    def _layout_of(self, variable: Any) -> Any:
        """Where a variable's value lives during the steps: replicated, or as the strategy's layout map
        says for its path."""
        if not self._mesh.has_layout_map:
            return self._mesh.replicated
        return self._mesh.state_sharding(tuple(variable.shape), "variable", getattr(variable, "path", None))

    def _values(self, variables: list[Any]) -> list[Any]:
        """The variables' values, each replicated on the strategy's devices, or laid out as the layout map
        says (placed, and written back, once)."""
        targets = [self._layout_of(v) for v in variables]
        values = [v.value for v in variables]
        stray = [i for i, (a, t) in enumerate(zip(values, targets))
                 if not (isinstance(a, jax.Array) and (a.sharding is t or a.sharding == t))]
        if stray:
            placed = self._mesh.place([values[i] for i in stray], [targets[i] for i in stray])
            for i, a in zip(stray, placed):
                variables[i].assign(a)
                values[i] = a
        return values


def _one_value(variable: Any, old: Any, value: Any, varies: bool) -> Any:
    """A variable's per-replica new value made one, by its ``aggregation`` (TF's rule).

    ``"sum"`` (a metric's total and count) counts every replica's change, even one that does not vary
    over the replicas (a count of rows per replica); the others leave an unvarying value as it is.
    """
    ctx = get_replica_context()
    assert ctx is not None  # only called per replica
    aggregation = getattr(variable, "aggregation", "none")
    if aggregation == "sum":
        delta = value - old
        return old + (ctx.all_reduce("sum", delta) if varies else ctx.num_replicas_in_sync * delta)
    if not varies:
        return value
    if aggregation == "only_first_replica":
        first = ctx.replica_id_in_sync_group == 0
        return ctx.all_reduce("sum", jnp.where(first, value, jnp.zeros_like(value)))
    mean = ctx.all_reduce("mean", value)
    return mean.astype(value.dtype) if jnp.issubdtype(value.dtype, jnp.integer) else mean


# -- gradients with the model as an object ----------------------------------------------------------------
def value_and_grad(fn: Callable[..., Any], variables: Any, *, has_aux: bool = False) -> Callable[..., Any]:
    """``fn`` and its gradient with respect to Keras ``variables`` (TF's ``GradientTape``, as a function).

    ``fn`` computes a loss with the Keras objects themselves (``model(x, training=True)``,
    ``model.losses``); it is called once, with the variables' current values traced, and the gradient
    has one array per variable, in order: ``zip(grads, variables)`` goes to
    ``optimizer.apply_gradients``. Assignments made inside ``fn`` (BatchNormalization statistics, a
    seed generator, a metric) take effect as they would without the gradient. Inside ``strategy.run``
    the gradient of the (replicated) variables comes out summed over the replicas, as TF's
    ``apply_gradients`` sums them: with :func:`mirrorax.compute_average_loss` it is the gradient of the
    global batch's mean.

    Args:
      fn: the loss function; called with the arguments given to the returned function. Returns a
        scalar, or ``(scalar, aux)`` with ``has_aux=True``.
      variables: Keras variables (e.g. ``model.trainable_variables``), or a model or layer: its
        ``trainable_variables`` when called. A model that has not been built yet (a ``Sequential``
        without an ``Input``) is built by a first run of ``fn``, as TF's tape sees the variables that
        the first call creates.
      has_aux: ``fn`` returns ``(loss, aux)``; the result is then ``((loss, aux), grads)``.

    Returns:
      A function of ``fn``'s arguments returning ``(loss, grads)`` (``((loss, aux), grads)``).

    Raises:
      TypeError: ``variables`` holds something that is not a Keras variable, or is empty.

    Example:
      >>> def loss_fn():
      ...     predictions = model(images, training=True)
      ...     return compute_loss(labels, predictions, model.losses), predictions
      >>> (loss, predictions), grads = mx.value_and_grad(loss_fn, model.trainable_variables, has_aux=True)()
      >>> optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """
    owner = variables if hasattr(variables, "trainable_variables") else None
    if owner is None:
        variables = list(variables)
        bad = [v for v in variables if not _is_variable(v)]
        if bad or not variables:
            received = (f"{bad[0]!r} (of type {type(bad[0]).__name__}). For arrays, use "
                        "jax.value_and_grad(fn)(arrays)." if bad else "no variable: a model that is not built yet "
                        "has none. Pass the model itself, mx.value_and_grad(fn, model), and its first call builds it.")
            raise TypeError("mx.value_and_grad differentiates with respect to Keras variables (e.g. "
                            f"model.trainable_variables) or a model's. Received {received}")

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        outer = _current_scope()
        scope_class = _tracking_scope()
        if owner is not None and not owner.trainable_variables:
            with scope_class(collect_losses=True, initialize_variables=False) as scratch:  # builds the model
                if outer is not None:
                    scratch.state_mapping.update(outer.state_mapping)
                fn(*args, **kwargs)
            if outer is None:
                _initialize_created_variables()
        targets = list(owner.trainable_variables) if owner is not None else variables
        current = [v.value for v in targets]
        touched: dict[int, Any] = {}

        def inner(values: list[Any]) -> Any:
            with scope_class(collect_losses=True, initialize_variables=False) as scope:
                if outer is not None:  # what the step assigned so far, and the step's own inputs
                    scope.state_mapping.update(outer.state_mapping)
                for v, value in zip(targets, values):
                    scope.state_mapping[id(v)] = value
                result = fn(*args, **kwargs)
            touched.update(scope.touched)
            loss, aux = result if has_aux else (result, None)
            updates = [(v, scope.state_mapping[id(v)]) for v in scope.assigned.values()]
            return loss, (aux, updates)

        (loss, (aux, updates)), grads = jax.value_and_grad(inner, has_aux=True)(current)
        if outer is not None and hasattr(outer, "touched"):  # a stateful step's scope: its state includes these
            for key, v in touched.items():
                outer.touched.setdefault(key, v)
        for v, value in updates:
            if outer is not None:
                outer.add_update((v, value))
            else:
                v.assign(value)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def grad(fn: Callable[..., Any], variables: Any, *, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of ``fn`` with respect to Keras ``variables``: :func:`value_and_grad` without the value
    (``(grads, aux)`` with ``has_aux=True``).

    Example:
      >>> grads = mx.grad(lambda: loss_object(labels, model(images, training=True)), model.trainable_variables)()
    """
    vg = value_and_grad(fn, variables, has_aux=has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
