"""Objects a step mutates, threaded through its compiled program: the split/merge protocol.

A step given to ``strategy.jit`` may take stateful objects as arguments and change them in place, as
Flax NNX programs do (``train_step(model, optimizer, metrics, rngs, batch)`` under ``@nnx.jit``). JAX
compiles functions of arrays, so each call of such a step runs in four moves, each one method of the
objects' front-end (a :class:`SplitMerge`):

1. **split** (host): the objects among the arguments are split into a *structure* (hashable, static:
   part of the program's signature, as a shape is; a new structure compiles a new program) and a *state*
   (a pytree of arrays). The state lives where :meth:`SplitMerge.layouts` says (replicated, or as a
   variable's own sharding annotation says): a leaf laid out otherwise is placed once (process 0's
   values on every process) and written back, so the next call finds it placed.
2. **merge** (in the trace): new objects are merged from the structure and the traced state and handed
   to the step in the arguments' places. The step is the one ``strategy.jit`` compiles for any function:
   a batch that knows its real rows reaches it cut to them, the dispatch bound holds.
3. **state** (in the trace, after the step): the merged objects' new state is an output of the program,
   in the state's layout. The structure must come out as it went in (a step that adds or removes a
   variable is refused, naming the fix).
4. **update** (host, after the call): the new state is written into the caller's objects, as device
   arrays (no host copy). An object the step returns is returned as the caller's object.

Donation is explicit, as ``nnx.jit``'s: the objects' state is donated to the call when every argument that
holds objects is in ``donate_argnums`` (their arrays are then replaced, never copied); otherwise the call
writes new arrays and the old ones stay valid.

Front-ends register their protocol here: :func:`register` for one already imported, or
:func:`register_front_end` for one loaded the first time a step is called while its library is imported
(the package registers ``mirrorax.nnx`` for ``flax.nnx``, so that ``import mirrorax`` never imports Flax).
Keras variables take their own road (``mirrorax.keras.stateful``: found by a tracing scope, not among the
arguments); DESIGN.md maps that road onto these four moves.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from mirrorax.dispatch import MISSED, InFlight, OutShardings
from mirrorax.keras.stateful import StatefulFunction

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["SplitMerge", "SplitMergeFunction", "register", "register_front_end", "protocols"]

PyTree = Any


class SplitMerge(Protocol):
    """How one kind of stateful object travels through a compiled step (see the module's docstring).

    A front-end implements it for its objects (``mirrorax.nnx.NNX`` for Flax NNX's modules, optimizers,
    metrics and ``Rngs``) and registers it with :func:`register`.
    """

    def owns(self, x: Any) -> bool:
        """Whether ``x`` (a node of a step's arguments) is an object of this kind, split whole."""
        ...

    def split(self, objects: tuple[Any, ...]) -> tuple[Hashable, PyTree]:
        """``(structure, state)`` of ``objects`` together (objects they share are split once)."""
        ...

    def merge(self, structure: Hashable, state: PyTree) -> tuple[Any, ...]:
        """New objects from :meth:`split`'s two parts, in order (inside the trace: ``state`` is traced)."""
        ...

    def state(self, structure: Hashable, before: PyTree, objects: tuple[Any, ...]) -> PyTree:
        """The state of merged ``objects`` after the step, in :meth:`split`'s tree (``before``: the state they
        were merged from); raises ``ValueError`` when their structure is no longer ``structure``."""
        ...

    def update(self, objects: tuple[Any, ...], state: PyTree) -> None:
        """Writes ``state`` (new device arrays, :meth:`split`'s tree) into the caller's ``objects``."""
        ...

    def layouts(self, state: PyTree, mesh: BatchMesh) -> list[jax.sharding.Sharding]:
        """Where each leaf of ``state`` lives on ``mesh`` (one per ``jax.tree.leaves(state)``)."""
        ...


_PROTOCOLS: list[SplitMerge] = []
_FRONT_ENDS: dict[str, Callable[[], None]] = {}


def register(protocol: SplitMerge) -> None:
    """Makes ``strategy.jit`` split and merge the objects ``protocol`` owns (registering twice: no effect)."""
    if not any(p is protocol for p in _PROTOCOLS):
        _PROTOCOLS.append(protocol)


def register_front_end(module: str, load: Callable[[], None]) -> None:
    """Calls ``load()`` (which imports a front-end that :func:`register` s its protocol) the first time a
    step is called while ``module`` is imported: a library's objects can exist only once it is."""
    _FRONT_ENDS.setdefault(module, load)


def protocols() -> tuple[SplitMerge, ...]:
    """The registered protocols, after loading the front-ends whose library is imported now."""
    if _FRONT_ENDS:
        for module in [m for m in _FRONT_ENDS if m in sys.modules]:
            _FRONT_ENDS.pop(module)()
    return tuple(_PROTOCOLS)


class _Slot:
    """Where an object stood among the arguments (a pytree node with no leaves): protocol, position."""

    __slots__ = ("kind", "index")

    def __init__(self, kind: int, index: int) -> None:
        self.kind, self.index = kind, index

    def __repr__(self) -> str:
        return f"_Slot({self.kind}, {self.index})"


jax.tree_util.register_pytree_node(_Slot, lambda s: ((), (s.kind, s.index)), lambda aux, _: _Slot(*aux))


class _Structure:
    """The objects' structures, per protocol (static: the aux data of a node with no leaves)."""

    __slots__ = ("value",)

    def __init__(self, value: tuple[tuple[int, Hashable], ...]) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Structure, lambda s: ((), s.value), lambda value, _: _Structure(value))


def _is_slot(x: Any) -> bool:
    return isinstance(x, _Slot)


class _Split:
    """A call's arguments with their objects split out: ``args`` holds a :class:`_Slot` in each object's place."""

    __slots__ = ("objects", "structure", "states", "args", "positions")

    def __init__(self, objects: dict[int, list[Any]], structure: _Structure, states: list[PyTree],
                 args: tuple[Any, ...], positions: set[int]) -> None:
        self.objects, self.structure, self.states, self.args = objects, structure, states, args
        self.positions = positions  # the arguments that hold objects


def split_args(args: tuple[Any, ...], kinds: Sequence[SplitMerge], per_replica: bool = False) -> _Split | None:
    """``args`` with the objects ``kinds`` own split out, or ``None`` when they hold none."""
    owner: dict[int, int] = {}

    def is_object(x: Any) -> bool:
        for k, p in enumerate(kinds):
            if p.owns(x):
                owner[id(x)] = k
                return True
        return False

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
    structure = _Structure(tuple((k, s) for k, (s, _) in parts))
    slotted = jax.tree.unflatten(treedef, leaves)
    positions = {i for i, a in enumerate(slotted) if any(_is_slot(x) for x in jax.tree.leaves(a, is_leaf=_is_slot))}
    return _Split(objects, structure, [st for _, (_, st) in parts], tuple(slotted), positions)


class SplitMergeFunction(StatefulFunction):
    """What ``strategy.jit(fn)`` returns: a :class:`~mirrorax.keras.stateful.StatefulFunction` that also takes
    objects a registered :class:`SplitMerge` owns among its arguments (see the module's docstring).

    A call without such objects is the stateful function's own; with them, the objects are split, their
    state goes through one compiled program (per structure and signature) with the rest of the
    arguments, and comes back into them. Every call pushes into the strategy's window.
    """

    def __init__(self, mesh: BatchMesh, window: InFlight, fn: Callable[..., Any], *,
                 donate_argnums: int | Sequence[int] = (), per_replica: bool = False,
                 out_shardings: OutShardings = None, where: str = "strategy.jit") -> None:
        super().__init__(mesh, window, fn, donate_argnums=donate_argnums, per_replica=per_replica,
                         out_shardings=out_shardings, where=where)
        self._user_fn = fn
        self._user_donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self._user_out = out_shardings
        self._threaded: dict[bool, StatefulFunction] = {}  # donated state or not -> the program's function
        self._layouts: dict[Any, list[Any]] = {}  # (protocol, structure, shapes) -> each state leaf's layout

    # -- calling -------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            out = self._call_fast(args)  # the last call took no objects and its program fits: no split to look for
            if out is not MISSED:
                return out
        kinds = protocols()
        split = split_args(args, kinds) if kinds and not kwargs else None
        if split is None:
            return super().__call__(*args, **kwargs)
        self._plain_last = False  # (the next call with objects looks for them again)
        self._check_global_view(split)
        states = self._placed(split, kinds)
        out, new = self._function(split)(split.structure, states, *split.args)
        for (k, _), state in zip(split.structure.value, new):
            kinds[k].update(tuple(split.objects[k]), state)
        return _objects_back(out, split)

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower`` of the program a call with ``args`` runs (objects: their state first)."""
        kinds = protocols()
        split = split_args(args, kinds) if kinds else None
        if split is None:
            return super().lower(*args)
        self._check_global_view(split)
        return self._function(split).lower(split.structure, self._placed(split, kinds), *split.args)

    def program(self, *args: Any) -> Any:
        """The compiled program of a step that takes no objects (see :meth:`StatefulFunction.program`)."""
        kinds = protocols()
        if kinds and split_args(args, kinds) is not None:
            raise TypeError(f"{getattr(self._user_fn, '__name__', 'fn')} takes stateful objects (e.g. Flax NNX "
                            "modules): call it as a function (their new state is written back after each call). "
                            "program() is for steps whose state is an explicit argument of arrays.")
        return super().program(*args)

    @property
    def compile_count(self) -> int:
        """How many signatures were compiled (one per distinct input shape/layout and object structure)."""
        return super().compile_count + sum(f.compile_count for f in self._threaded.values())

    # -- the parts -----------------------------------------------------------------------------------
    def _check_global_view(self, split: _Split) -> None:
        if self._per_replica:
            kinds = protocols()
            names = sorted({type(o).__name__ for k, group in split.objects.items() for o in group} |
                           {type(kinds[k]).__name__ for k in split.objects})
            raise TypeError(f"{self._where} received stateful objects ({', '.join(names)}) among its arguments. "
                            "Their state is threaded through strategy.jit, the global view (one step over the "
                            "global batch, the one-device numbers on every device); per replica it would "
                            "diverge. Decorate the step with @strategy.jit and call it directly.")

    def _placed(self, split: _Split, kinds: Sequence[SplitMerge]) -> list[PyTree]:
        """Each protocol's state on the strategy's mesh: a leaf elsewhere (the objects' first call, an array
        the user set) is placed where :meth:`SplitMerge.layouts` says (process 0's values) and written back
        into the caller's objects, so that the next call finds it placed; a leaf on the mesh keeps its layout."""
        states = []
        mesh = self._mesh.mesh
        for (k, structure), state in zip(split.structure.value, split.states):
            leaves, treedef = jax.tree.flatten(state)
            if all(type(a) is not np.ndarray and isinstance(getattr(a, "sharding", None), NamedSharding)
                   and (a.sharding.mesh is mesh or a.sharding.mesh == mesh) for a in leaves):
                states.append(state)  # the previous call's outputs (checked without the layouts)
                continue
            key = (k, structure, tuple((getattr(a, "shape", None), getattr(a, "dtype", None)) for a in leaves))
            targets = self._layouts.get(key)
            if targets is None:
                targets = self._layouts[key] = list(kinds[k].layouts(state, self._mesh))
            stray = [i for i, (a, t) in enumerate(zip(leaves, targets))
                     if not (isinstance(a, jax.Array) and (a.sharding is t or a.sharding == t))]
            if stray:
                for i, a in zip(stray, _place(self._mesh, [leaves[i] for i in stray], [targets[i] for i in stray])):
                    leaves[i] = a
                state = jax.tree.unflatten(treedef, leaves)
                kinds[k].update(tuple(split.objects[k]), state)
            states.append(state)
        return states

    def _function(self, split: _Split) -> StatefulFunction:
        """The stateful function of ``threaded(structure, states, *args)`` (one per donation of the state)."""
        donated = bool(split.positions) and split.positions <= set(self._user_donate)
        function = self._threaded.get(donated)
        if function is None:
            donate = ((1,) if donated else ()) + tuple(i + 2 for i in self._user_donate)
            given = self._user_out
            out_shardings: OutShardings = None
            if given is not None:
                def out_shardings(structure: Any, states: Any, *args: Any) -> Any:
                    user = given(*args) if callable(given) else given
                    return None if user is None else (user, jax.tree.map(lambda a: a.sharding, states))
            function = self._threaded[donated] = StatefulFunction(
                self._mesh, self._window, _threaded(self._user_fn), donate_argnums=donate,
                out_shardings=out_shardings, where=self._where)
        return function


def _threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a function of ``(structure, states, *args)``: the objects merged into their slots of
    ``args``, and their new states returned beside ``fn``'s outputs."""
    @functools.wraps(fn)
    def threaded(structure: _Structure, states: list[PyTree], *args: Any) -> Any:
        kinds = protocols()
        merged = {k: kinds[k].merge(s, state) for (k, s), state in zip(structure.value, states)}
        args = jax.tree.map(lambda x: merged[x.kind][x.index] if _is_slot(x) else x, args, is_leaf=_is_slot)
        out = fn(*args)
        mine = {id(o): _Slot(k, i) for k, group in merged.items() for i, o in enumerate(group)}

        def returned(x: Any) -> Any:
            slot = mine.get(id(x))
            if slot is not None:
                return slot
            raise TypeError(f"{getattr(fn, '__name__', 'fn')} returned {type(x).__name__} object that is none of "
                            "its arguments. A step compiled by strategy.jit updates the objects it is given in place "
                            "and returns arrays (or those same objects); create new objects outside the step.")

        def owned(x: Any) -> bool:
            return any(p.owns(x) for p in kinds)

        out = jax.tree.map(lambda x: returned(x) if owned(x) else x, out, is_leaf=owned)
        return out, [kinds[k].state(s, state, merged[k]) for (k, s), state in zip(structure.value, states)]

    return threaded


def _objects_back(out: Any, split: _Split) -> Any:
    """``out`` with each object slot the step returned replaced by the caller's object."""
    return jax.tree.map(lambda slot: split.objects[slot.kind][slot.index] if _is_slot(slot) else slot, out,
                        is_leaf=_is_slot)


def _place(mesh: BatchMesh, leaves: list[Any], targets: list[Any]) -> list[Any]:
    """``leaves`` placed on ``targets`` (process 0's values); typed PRNG keys (``jax.random.key``, an
    ``nnx.Rngs`` stream's) as their key data, wrapped again."""
    impls = [jax.random.key_impl(a) if _is_key(a) else None for a in leaves]
    data = [jax.random.key_data(a) if impl is not None else a for a, impl in zip(leaves, impls)]
    placed = mesh.place(data, targets)
    return [jax.random.wrap_key_data(a, impl=impl) if impl is not None else a for a, impl in zip(placed, impls)]


def _is_key(a: Any) -> bool:
    dtype = getattr(a, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
