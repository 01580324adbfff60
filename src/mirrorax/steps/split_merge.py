"""The split/merge protocol: how a front-end's stateful objects travel through a compiled step.

A step given to ``strategy.jit`` may change objects in place instead of returning their state: Flax NNX
programs take a model, an ``nnx.Optimizer``, metrics and ``nnx.Rngs`` as arguments; TF-style Keras steps
call ``model(x)``, ``optimizer.apply_gradients`` and ``metric.update_state`` on objects they reach by
themselves. JAX compiles functions of arrays, so the engine (:mod:`mirrorax.steps.stateful`) threads such state
through the program in the same moves for every front-end, each one method of the front-end's
:class:`SplitMerge`:

1. **which objects** (host): found one of two ways. *Among the arguments* (:meth:`SplitMerge.owns`, Flax
   NNX): per call, each node of the arguments the protocol owns is taken out, its place kept. *By a
   discovery trace* (:meth:`SplitMerge.discover`, Keras): once per signature the step is traced inside the
   protocol's recorder, which sees every object the step reads or assigns, whatever path reaches it (a
   global, a closure, an attribute of an argument).
2. **split** (host, per call): the objects' *structure* (static: for objects among the arguments part
   of the program's signature, as a shape is; a new structure compiles a new program) and *state* (a
   pytree of arrays). The state lives where :meth:`SplitMerge.layouts` says: a leaf laid out otherwise is
   placed once (process 0's values on every process) and written back, so the next call finds it placed.
3. **merge** (in the trace): :meth:`SplitMerge.bind` binds the structure to the traced state for the
   duration of the step (NNX: new objects handed to the step in the arguments' places; Keras: a
   ``keras.StatelessScope`` mapping each variable to its traced value). The step is the one
   ``strategy.jit`` compiles for any function: a batch that knows its real rows reaches it cut to them,
   the dispatch bound holds.
4. **new state** (in the trace, after the step, still bound): :meth:`SplitMerge.state`, an output of the
   program in the state's layout. The structure must come out as it went in.
5. **write back** (host, after the call): :meth:`SplitMerge.update` writes the new state into the
   caller's objects as device arrays (no host copy). An object the step returns is returned as the
   caller's object.

The state of objects a discovery trace found is a pair ``(changed, read)``: what the step assigns
(donated to each call, an output) and what it only reads (passed, never donated, never an output).

**Donation** follows from where the objects were found. Among the arguments it is explicit, as
``nnx.jit``'s: their state is donated when every argument that holds objects is in ``donate_argnums``
(their arrays are then replaced, never copied); otherwise the call writes new arrays and the old ones stay
valid. Found by the trace (no argument to name), the ``changed`` state is always donated, by ownership:
a leaf the engine's last call wrote that nobody has taken since (:meth:`SplitMerge.owned`) is donated as
it is, anything else is copied first, so that whatever the user holds stays valid.

**Per replica** (``strategy.run``) the objects a trace finds are threaded too, and their protocol makes
each new value one again (Keras: by the variable's ``aggregation``, as TF's distributed variables);
objects among the arguments are refused there (their one-device numbers need the global view).

Front-ends register their protocol here with :func:`register`, when their wing is loaded: the package
registers each wing's load with :func:`mirrorax.front_end.register_lazy` (``mirrorax.nnx`` for ``flax.nnx``,
Keras's for ``keras``), which :func:`protocols` runs the first time a step is called while that library is
imported, so that ``import mirrorax`` imports neither.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import jax

from mirrorax import front_end

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["SplitMerge", "Held", "register", "protocols", "split_args", "threaded",
           "objects_back", "place", "Split", "is_slot"]

PyTree = Any


class SplitMerge(Protocol):
    """How one front-end's stateful objects travel through a compiled step (see the module's docstring).

    A front-end implements it for its objects (``mirrorax.nnx.NNX`` for Flax NNX's modules, optimizers,
    metrics and ``Rngs``; ``mirrorax.keras.stateful.KERAS`` for Keras variables) and registers it with
    :func:`register`. Its objects are found among the arguments (:meth:`owns` says which) or by a
    discovery trace (:meth:`discover` records them); the other way finds none.
    """

    def owns(self, x: Any) -> bool:
        """Whether ``x`` (a node of a step's arguments) is an object of this kind, split whole (``False``
        for objects found by :meth:`discover` only)."""
        ...

    def plain(self, x: Any) -> bool:
        """Whether ``x`` (a node of a step's arguments) is a pytree of this front-end's that a step takes as JAX
        does, flattened, its nodes no objects even where :meth:`owns` would claim them (Flax NNX's ``State``:
        ``nnx.split``'s state, passed to a functional step beside its ``GraphDef``, comes back as the step's
        output, not written back). Optional: absent, nothing is."""
        ...

    def discover(self, args: tuple[Any, ...], where: str) -> AbstractContextManager[Callable[[], Any]] | None:
        """A recorder for one trace of the step with ``args`` (entered inside the trace, around the step),
        or ``None`` when this front-end's objects are found among the arguments only. It yields a function
        that, called after the trace, returns what the step read or assigned (``None``: nothing), as the
        ``objects`` the other methods take. Raises ``TypeError`` for arguments the front-end refuses (Keras:
        a variable passed as an argument), naming the fix."""
        ...

    def split(self, objects: Any) -> tuple[Any, PyTree]:
        """``(structure, state)`` of ``objects`` together (objects they share are split once). For objects
        among the arguments the structure is hashable (part of the program's signature); for found objects it
        is the same at every call, and the state is the pair ``(changed, read)``."""
        ...

    def layouts(self, structure: Any, state: PyTree, mesh: BatchMesh) -> list[jax.sharding.Sharding]:
        """Where each leaf of ``state`` lives on ``mesh`` (one per ``jax.tree.leaves(state)``)."""
        ...

    def bind(self, structure: Any, state: PyTree) -> AbstractContextManager[Any]:
        """Merge, inside the trace (``state`` is traced): while the context is open the step runs on the
        state; it yields what :meth:`state` reads the new state from (objects among the arguments: the new
        objects, in order, handed to the step in their places)."""
        ...

    def state(self, structure: Any, before: PyTree, objects: Any) -> PyTree:
        """The new state after the step, read from what :meth:`bind` yielded, still bound (``before``: the
        state bound): :meth:`split`'s tree, or for found objects its ``changed`` part. Objects among the arguments
        may come out with variables added or removed (a module that creates one in its ``__call__``): the new
        state's tree then differs, and :meth:`update` writes it, structure and all. Raises ``ValueError`` for
        any other change of the objects' structure."""
        ...

    def update(self, objects: Any, state: PyTree) -> None:
        """Writes ``state`` (:meth:`split`'s tree: new device arrays, or the ones placed; for objects among the
        arguments, possibly with variables added by the step) into the caller's ``objects``. A found object's
        ``read`` part is the very object :meth:`split` gave unless a leaf of it was placed (it may then be
        skipped by identity); a leaf the object holds already may be left as it is."""
        ...

    def prune(self, objects: Any, state: PyTree) -> None:
        """For objects among the arguments, after a step that removed variables: removes from ``objects`` those
        ``state`` (the new state, just written by :meth:`update`) no longer holds. Optional."""
        ...

    def owned(self, objects: Any, changed: PyTree) -> list[bool]:
        """For found objects: per leaf of ``changed`` (their state now), whether the object still holds what
        :meth:`update` last wrote and nobody has taken it since (read it, kept it, assigned it): the engine
        may then donate it without a copy when that is an array it wrote."""
        ...

    def names(self, structure: Any) -> list[str]:
        """For found objects: what each leaf of the ``changed`` state is, as a message names it (Keras:
        ``variable 'dense/kernel'``)."""
        ...

    def hold(self, objects: Any, structure: Any, state: PyTree) -> Held | None:
        """For objects among the arguments: ``objects``, just split into ``structure`` and ``state``, held for
        the calls that follow with the same objects (:class:`Held`), or ``None`` (every call splits them)."""
        ...


class Held(Protocol):
    """Objects among a step's arguments held between calls (:meth:`SplitMerge.hold`): the calls that follow with
    the same objects read and write their state without walking them (a walk of a small Flax NNX model and its
    optimizer costs more than its step on an accelerator), while a change made to them between calls is seen."""

    def unchanged(self) -> bool:
        """Whether the objects still have the structure they were held with (nothing added, removed or
        replaced, no static attribute changed): the held program and leaves still apply. Errs towards
        ``False`` (the call then splits them again)."""
        ...

    def read(self) -> list[Any]:
        """The state's leaves now, in the order of the ``state`` held (a value the user assigned included)."""
        ...

    def write(self, leaves: list[Any]) -> None:
        """Writes new leaves (device arrays) into the objects, as :meth:`SplitMerge.update` does."""
        ...


_PROTOCOLS: list[SplitMerge] = []


def register(protocol: SplitMerge) -> None:
    """Makes ``strategy.jit`` and ``strategy.run`` thread the objects ``protocol`` finds (registering twice: no
    effect)."""
    if not any(p is protocol for p in _PROTOCOLS):
        _PROTOCOLS.append(protocol)


def protocols() -> tuple[SplitMerge, ...]:
    """The registered protocols, after loading the wings whose library is imported now
    (:func:`mirrorax.front_end.load_imported`)."""
    front_end.load_imported()
    return tuple(_PROTOCOLS)


# -- objects among the arguments ------------------------------------------------------------------------
class _Slot:
    """Where an object stood among the arguments (a pytree node with no leaves): protocol, position."""

    __slots__ = ("kind", "index")

    def __init__(self, kind: int, index: int) -> None:
        self.kind, self.index = kind, index

    def __repr__(self) -> str:
        return f"_Slot({self.kind}, {self.index})"


jax.tree_util.register_pytree_node(_Slot, lambda s: ((), (s.kind, s.index)), lambda aux, _: _Slot(*aux))


class _Structure:
    """The objects' structures, per protocol: ``(protocol index, structure, the state's treedef)`` (static: the
    aux data of a node with no leaves, itself).

    Its hash is computed once: JAX hashes a call's static structure at every call of a compiled program, and a
    Flax ``GraphDef`` is hashed by walking it (270 us a call for the performance guide's small model, more
    than its step), while a loop passes the same structure every step."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple[tuple[int, Hashable, Any], ...]) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Structure) and self._hash == hash(other)
                                 and self.value == other.value)


jax.tree_util.register_pytree_node(_Structure, lambda s: ((), s), lambda structure, _: structure)


def is_slot(x: Any) -> bool:
    """Whether ``x`` is an object's place among a :class:`Split`'s arguments (``.kind``: its protocol's index,
    ``.index``: its place among that protocol's objects)."""
    return isinstance(x, _Slot)


_is_slot = is_slot


class Split:
    """A call's arguments with their objects split out: ``args`` holds a slot in each object's place;
    ``objects`` (per protocol index, in order), ``structure`` (static), ``states`` (one per protocol with
    objects, as :meth:`SplitMerge.split` gave it) and ``leaves`` (each state's leaves: what a program takes);
    ``positions``: the arguments that hold objects."""

    __slots__ = ("objects", "structure", "states", "leaves", "args", "positions")

    def __init__(self, objects: dict[int, list[Any]], structure: _Structure, states: list[PyTree],
                 leaves: list[list[Any]], args: tuple[Any, ...], positions: set[int]) -> None:
        self.objects, self.structure, self.states, self.leaves, self.args = objects, structure, states, leaves, args
        self.positions = positions


def split_args(args: tuple[Any, ...], kinds: Sequence[SplitMerge]) -> Split | None:
    """``args`` with the objects ``kinds`` own split out, or ``None`` when they hold none."""
    owner: dict[int, int] = {}
    plain = [f for p in kinds if (f := getattr(p, "plain", None)) is not None]

    def is_object(x: Any) -> bool:
        for k, p in enumerate(kinds):
            if p.owns(x):
                owner[id(x)] = k
                return True
        return any(f(x) for f in plain)  # (a leaf of the walk, no object: JAX flattens it in the call)

    leaves, treedef = jax.tree.flatten(args, is_leaf=is_object)
    if not owner:
        return None
    objects: dict[int, list[Any]] = {}
    seen: dict[int, _Slot] = {}
    for i, leaf in enumerate(leaves):
        k = owner.get(id(leaf))
        if k is None:
            continue
        slot = seen.get(id(leaf))
        if slot is None:
            group = objects.setdefault(k, [])
            slot = seen[id(leaf)] = _Slot(k, len(group))
            group.append(leaf)
        leaves[i] = slot
    parts = [(k, kinds[k].split(tuple(group))) for k, group in sorted(objects.items())]
    flat = [jax.tree.flatten(state) for _, (_, state) in parts]
    structure = _Structure(tuple((k, s, tree) for (k, (s, _)), (_, tree) in zip(parts, flat)))
    slotted = jax.tree.unflatten(treedef, leaves)
    positions = {i for i, a in enumerate(slotted) if any(_is_slot(x) for x in jax.tree.leaves(a, is_leaf=_is_slot))}
    return Split(objects, structure, [st for _, (_, st) in parts], [list(x) for x, _ in flat], tuple(slotted),
                 positions)


def threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a function of ``(structure, leaves, *args)`` (a :class:`Split`'s: each protocol's state as its
    leaves' list): the objects bound and handed to ``fn`` in their slots of ``args``; returns their new states'
    leaves and ``fn``'s outputs, in that order (XLA gives each donated leaf's buffer to the first output of its
    shape: the new leaf, not a scalar output of the step's own). (Lists of leaves, not the states' own trees: a
    call flattens its arguments and rebuilds its outputs each time, and a front-end's state tree, NNX's nested
    ``State``, costs tens of microseconds a call to walk in Python; a list of arrays is walked in C.)"""
    @functools.wraps(fn)
    def run(structure: _Structure, leaves: list[list[Any]], *args: Any) -> Any:
        kinds = protocols()
        states = [tree.unflatten(part) for (_, _, tree), part in zip(structure.value, leaves)]
        with contextlib.ExitStack() as stack:
            merged = {k: stack.enter_context(kinds[k].bind(s, state))
                      for (k, s, _), state in zip(structure.value, states)}
            args = jax.tree.map(lambda x: merged[x.kind][x.index] if _is_slot(x) else x, args, is_leaf=_is_slot)
            out = fn(*args)
            mine = {id(o): _Slot(k, i) for k, group in merged.items() for i, o in enumerate(group)}

            def returned(x: Any) -> Any:
                slot = mine.get(id(x))
                if slot is not None:
                    return slot
                raise TypeError(f"{getattr(fn, '__name__', 'fn')} returned {type(x).__name__} object that is none "
                                "of its arguments. A step compiled by strategy.jit updates the objects it is given in "
                                "place and returns arrays (or those same objects); create new objects outside the "
                                "step.")

            def owned(x: Any) -> bool:
                return any(p.owns(x) for p in kinds)

            out = jax.tree.map(lambda x: returned(x) if owned(x) else x, out, is_leaf=owned)
            new = [jax.tree.flatten(kinds[k].state(s, state, merged[k]))
                   for (k, s, _), state in zip(structure.value, states)]
            # A step that added or removed variables (a module that creates one in __call__): the new state's
            # structure, per part, for the call to write back (recorded at the trace: it is static).
            trees = [None if tree == before else tree for (_, tree), (_, _, before) in zip(new, structure.value)]
            if any(t is not None for t in trees):
                run.changed[structure] = trees  # type: ignore[attr-defined]
            return [leaves for leaves, _ in new], out  # (the state first: each donated leaf aliases its own)

    run.changed = {}  # type: ignore[attr-defined]  # structure -> each part's new state tree (None: the same)
    return run


def objects_back(out: Any, split: Split) -> Any:
    """``out`` with each object slot the step returned replaced by the caller's object."""
    return jax.tree.map(lambda slot: split.objects[slot.kind][slot.index] if _is_slot(slot) else slot, out,
                        is_leaf=_is_slot)


def place(mesh: BatchMesh, leaves: list[Any], targets: list[Any]) -> list[Any]:
    """``leaves`` of a state placed on ``targets`` (process 0's values); typed PRNG keys (``jax.random.key``,
    an ``nnx.Rngs`` stream's) as their key data, wrapped again."""
    impls = [jax.random.key_impl(a) if _is_key(a) else None for a in leaves]
    data = [jax.random.key_data(a) if impl is not None else a for a, impl in zip(leaves, impls)]
    placed = mesh.place(data, targets)
    return [jax.random.wrap_key_data(a, impl=impl) if impl is not None else a for a, impl in zip(placed, impls)]


def _is_key(a: Any) -> bool:
    dtype = getattr(a, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
