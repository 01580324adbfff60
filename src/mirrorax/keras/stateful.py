"""Keras variables through a compiled step: Keras's implementation of the split/merge protocol.

A step given to ``strategy.jit`` or ``strategy.run`` may use Keras objects as TF users write them
(``model(x)``, ``optimizer.apply_gradients``, ``metric.update_state``): it reads and assigns Keras variables
(a model's weights, an optimizer's slots, a metric's totals, a seed generator's state) instead of taking and
returning them. Keras 3's JAX trainer threads such state the same way. :data:`KERAS` (a
:class:`KerasVariables`) is the engine's protocol for them (:mod:`mirrorax.steps.split_merge`; the engine,
:mod:`mirrorax.steps.stateful`, does the rest), each move a method:

1. **Which variables** (:meth:`~KerasVariables.discover`). The step is traced once per input signature
   inside a recording ``keras.StatelessScope``: every variable it reads or assigns is the step's state.
   What the step touches is what it needs, whatever path reaches it (a global, a closure, an attribute of
   an argument, a function it calls), with no registry to keep, and a step that touches none compiles
   exactly as before (the stateless forms are untouched). Variables the step creates while tracing (an
   optimizer's slots on its first ``apply``) are created there and initialised once it ends. A variable
   among the arguments is refused, naming the fix.
2. **Split** (:meth:`~KerasVariables.split`, :meth:`~KerasVariables.layouts`): the variable lists are the
   structure, their values the state: the assigned ones' (donated to each call) apart from the read-only
   ones' (passed, never donated); replicated on the strategy's devices, or as its layout map says.
3. **Merge** (:meth:`~KerasVariables.bind`): ``keras.StatelessScope(state_mapping=...)`` inside the trace;
   the **new state** (:meth:`~KerasVariables.state`) is ``scope.get_current_value`` of the assigned
   variables after the step.
4. **Write-back** (:meth:`~KerasVariables.update`). After the call each assigned variable holds its new
   value: a ``jax.Array`` on the devices (never copied to the host), set without ``assign``'s conversion
   (the program made it with the variable's dtype, shape and layout) and owned by the engine, so
   ``metric.result()``, ``model.predict`` or ``save_weights`` outside the step see it (and, by reading it,
   leave it to the user), and the next call takes it as its input.

**Donation** (:meth:`~KerasVariables.owned`): the assigned variables' values are donated (the program reuses
their buffers, as Keras's trainer donates its state) when the engine owns them, by an explicit rule rather
than by counting references: a value the previous call wrote is owned until anyone reads the variable's
value or assigns it through Keras's API (``v.value``, ``v.numpy()``, ``np.asarray(v)``, ``jnp.asarray(v)``,
operators, ``v.assign``; copying or pickling it). Any other value (the first call's, one the user assigned,
one read since the write) is copied first and the copy is donated, so whatever the user holds stays valid;
in a loop that does not look at the variables between steps, every step reuses the buffers. The token is
the variable's class: a write switches it to a subclass of its own class that adds no state and switches
back at the first such read or assign.

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
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from mirrorax.keras import _internals as internals
from mirrorax.steps.replica import get_replica_context

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["KERAS", "KerasVariables", "value_and_grad", "grad", "check_no_variables"]

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


def _write(variable: Any, value: Any, direct: bool) -> None:
    """``variable.assign(value)`` for a value the step's program made (a replicated ``jax.Array`` of the
    variable's dtype and shape): set without ``assign``'s conversion and shape check where Keras allows,
    and then owned by the engine (see :meth:`KerasVariables.owned`)."""
    setter = internals.direct_assign(variable) if direct else None  # Keras has no public fast path
    if setter is None:
        variable.assign(value)  # (in an enclosing StatelessScope: an update of that scope, not a write)
        return
    setter(value)
    owned = _owned_class(variable) if internals.variable_value(variable) is value else None
    if owned is not None:
        object.__setattr__(variable, "__class__", owned)


class _Found:
    """The variables a discovery trace saw a step read or assign: the objects and the structure of its state
    (the same at every call of the signature). ``assigned``: their values are donated to each call and new
    ones written back; ``kept``: read only, passed and never donated."""

    __slots__ = ("assigned", "kept", "seen")

    def __init__(self, assigned: list[Any], kept: list[Any]) -> None:
        self.assigned, self.kept = assigned, kept
        self.seen: list[Any] = [None] * len(kept)  # the kept variables' values last split


def _layout_of(variable: Any, mesh: BatchMesh) -> Any:
    """Where a variable's value lives during the steps: replicated, or as the strategy's layout map says
    for its path."""
    if not mesh.has_layout_map:
        return mesh.replicated
    return mesh.state_sharding(tuple(variable.shape), "variable", getattr(variable, "path", None))


def _held(variable: Any, direct: bool) -> Any:
    """The value the step's caller sees ``variable`` hold: its own outside any ``StatelessScope``, else the
    scope's (read through Keras's API)."""
    return internals.variable_value(variable) if direct else variable.value


class KerasVariables:
    """The split/merge protocol (:class:`mirrorax.steps.split_merge.SplitMerge`) of Keras variables: found by a
    discovery trace (see the module's docstring), never among the arguments."""

    def owns(self, x: Any) -> bool:
        """``False``: a Keras variable among the arguments is refused (:meth:`discover` names the fix)."""
        return False

    def discover(self, args: tuple[Any, ...], where: str) -> contextlib.AbstractContextManager[Callable[[], Any]]:
        """A recording ``keras.StatelessScope``: every variable the step reads or assigns, as a :class:`_Found`
        (``None``: none). Raises ``TypeError`` when ``args`` hold a Keras variable (JAX wants arrays)."""
        check_no_variables(args, where)
        return self._recording()

    @contextlib.contextmanager
    def _recording(self) -> Iterator[Callable[[], _Found | None]]:
        seen: dict[str, list[Any]] = {}

        def found() -> _Found | None:  # (after the trace: a variable it created is initialised here)
            _initialize_created_variables()
            touched, assigned = seen.get("touched"), seen.get("assigned", [])
            if not touched:
                return None
            mine = {id(v) for v in assigned}
            return _Found(assigned, [v for v in touched if id(v) not in mine])

        with _tracking_scope()(collect_losses=True, initialize_variables=False) as scope:
            yield found
        seen["touched"], seen["assigned"] = list(scope.touched.values()), list(scope.assigned.values())

    def split(self, objects: _Found) -> tuple[_Found, tuple[list[Any], list[Any]]]:
        """The variables' values, ``(assigned, kept)``. A value the engine wrote and nobody took since is read
        without taking it (so that it stays owned); the kept ones are the ones split last time when unchanged."""
        raw = internals.variable_value
        changed = [raw(v) if type(v) in _OWNED_CLASSES else v.value for v in objects.assigned]
        seen = objects.seen
        if not all(raw(v) is a and a is not None for v, a in zip(objects.kept, seen)):
            seen[:] = [v.value for v in objects.kept]
        return objects, (changed, seen)

    def layouts(self, structure: _Found, state: Any, mesh: BatchMesh) -> list[Any]:
        """Replicated, or as the strategy's layout map says for each variable's path."""
        return [_layout_of(v, mesh) for v in (*structure.assigned, *structure.kept)]

    @contextlib.contextmanager
    def bind(self, structure: _Found, state: Any) -> Iterator[Any]:
        """``keras.StatelessScope(state_mapping=...)``: every variable reads its traced value and its
        assignments are collected; yields the scope (:meth:`state` reads the new values from it)."""
        changed, read = state
        with _tracking_scope()(state_mapping=[*zip(structure.assigned, changed), *zip(structure.kept, read)],
                               collect_losses=True, initialize_variables=False) as scope:
            yield scope

    def state(self, structure: _Found, before: Any, objects: Any) -> list[Any]:
        """The assigned variables' new values (``scope.get_current_value``), in their dtypes; per replica
        made one value again by each variable's ``aggregation`` (TF's rule)."""
        ctx = get_replica_context()
        new = []
        for v, old in zip(structure.assigned, before[0]):
            value = jnp.asarray(objects.get_current_value(v), dtype=old.dtype)
            if ctx is not None:
                value = _one_value(ctx, v, old, value)
            new.append(value)
        return new

    def update(self, objects: _Found, state: Any) -> None:
        """The assigned variables' values written as :func:`_write` writes (owned by the engine); a read-only
        one only where the variable does not hold it already (placed), none when the engine hands back the
        values :meth:`split` gave (the same list)."""
        changed, read = state
        direct = _current_scope() is None
        for v, value in zip(objects.assigned, changed):
            _write(v, value, direct)
        if read is not objects.seen:
            for v, value in zip(objects.kept, read):
                if _held(v, direct) is not value:
                    _write(v, value, direct)

    def owned(self, objects: _Found, changed: Any) -> list[bool]:
        """Per assigned variable: whether it is still of its owned class (nobody read or assigned it since a
        write; see :func:`_write`)."""
        return [type(v) in _OWNED_CLASSES for v in objects.assigned]

    def names(self, structure: _Found) -> list[str]:
        """``variable 'sequential/dense/kernel'`` per assigned variable."""
        return [f"variable {getattr(v, 'path', v)!r}" for v in structure.assigned]

    def hold(self, objects: Any, structure: Any, state: Any) -> None:
        """``None``: Keras's variables are found by the step's trace, never among its arguments."""
        return None

    def prune(self, objects: Any, state: Any) -> None:
        """Never asked (a step cannot add or remove a Keras variable the trace found)."""

    def plain(self, x: Any) -> bool:
        """``False``: Keras's variables are found by the step's trace; no argument is a pytree of its own kind."""
        return False


KERAS = KerasVariables()
"""The protocol ``strategy.jit`` uses for Keras variables (registered once Keras is imported)."""


def _one_value(ctx: Any, variable: Any, old: Any, value: Any) -> Any:
    """A variable's per-replica new value made one, by its ``aggregation`` (TF's rule), in replica context ``ctx``.

    ``"sum"`` (a metric's total and count) counts every replica's change, even one that does not vary
    over the replicas (a count of rows per replica); the others leave an unvarying value as it is.
    """
    varies = ctx.varies(value)
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
