"""Flax NNX objects through a compiled step: NNX's own ``split`` / ``merge`` as the engine's protocol.

``strategy.jit`` hands the objects among a step's arguments (modules, ``nnx.Optimizer``, metrics,
``nnx.Rngs``, variables; views made by ``nnx.view`` too) to :data:`NNX`, a
:class:`mirrorax.steps.split_merge.SplitMerge`: ``nnx.split`` of them all together (objects they share, such as
a view's variables, split once) gives the ``GraphDef`` (the structure, static) and the ``State``;
``nnx.merge`` rebuilds them inside the trace (:meth:`NnxSplitMerge.bind`); ``nnx.split`` after the step
reads the new state (the ``GraphDef`` must be unchanged); ``nnx.update`` writes it into the caller's
objects. NNX's objects are found among the arguments only (nothing to discover), and their donation is
explicit (``donate_argnums``, as ``nnx.jit``'s). So a program written
for ``@nnx.jit`` runs under ``@strategy.jit`` unchanged: BatchNorm statistics, the optimizer's state and
step, metric totals and the ``Rngs`` counters of Dropout advance as they would on one device.

Each variable lives replicated on the strategy's devices unless it carries Flax's sharding annotation
(``nnx.with_partitioning``, ``out_sharding=``; an ``nnx.Optimizer``'s state inherits its parameter's),
which names mesh axes of the strategy's mesh (``MirroredStrategy(mesh=...)``): it is then split as
annotated.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np
from flax import nnx

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["NNX", "NnxSplitMerge", "partition_axes"]

PyTree = Any


_NNX_TYPES = (nnx.Pytree, nnx.Variable)


def _path(path: tuple[Any, ...]) -> str:
    """A state leaf's path as NNX writes it (``0/dense/kernel``: the first object given, its ``dense.kernel``)."""
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)


class NnxSplitMerge:
    """The split/merge protocol (:class:`mirrorax.steps.split_merge.SplitMerge`) of Flax NNX objects."""

    def owns(self, x: Any) -> bool:
        """Modules, optimizers, metrics, ``Rngs`` (``nnx.Pytree``) and variables (``nnx.Variable``)."""
        # (by type: Variable's isinstance hook costs 1 us on every node of every strategy.jit call's arguments)
        return issubclass(type(x), _NNX_TYPES)

    def plain(self, x: Any) -> bool:
        """A ``State`` (``nnx.split``'s, ``nnx.state``'s): what a functional step takes beside its ``GraphDef`` and
        returns, as under ``jax.jit`` (flattened to its arrays at each call; never split or written back)."""
        return type(x) is nnx.State

    def discover(self, args: tuple[Any, ...], where: str) -> AbstractContextManager[Callable[[], Any]] | None:
        """``None``: NNX objects are found among the arguments only."""
        return None

    def split(self, objects: tuple[Any, ...]) -> tuple[Hashable, PyTree]:
        """``nnx.split`` of the objects together: ``(GraphDef, State)``."""
        _take_cached_partial()
        return nnx.split(objects)

    @contextlib.contextmanager
    def bind(self, structure: Hashable, state: PyTree) -> Iterator[tuple[Any, ...]]:
        """``nnx.merge``: new objects from the ``GraphDef`` and a (traced) ``State``, handed to the step."""
        yield nnx.merge(cast(Any, structure), state)

    def state(self, structure: Hashable, before: PyTree, objects: tuple[Any, ...]) -> PyTree:
        """The merged objects' ``State`` after the step. Their ``GraphDef`` is ``structure``, or differs by
        variables the step added or removed (a module that creates one in its ``__call__``, as ``nnx.jit``
        allows): :meth:`update` and :meth:`prune` write those. Any other change raises ``ValueError``."""
        graphdef, state = nnx.split(objects)
        if graphdef != structure:
            def paths(tree: PyTree) -> set[str]:
                return {_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}

            added, removed = sorted(paths(state) - paths(before)), sorted(paths(before) - paths(state))
            if added or removed:
                return state
            raise ValueError(
                f"The step changed the structure of the NNX objects it was given (the same {len(paths(state))} "
                "variables, but a static attribute or a submodule changed). strategy.jit compiles one program per "
                "structure and writes the new state back into the objects as they came in. Make such changes "
                "outside the step (e.g. model.train() / model.eval() or nnx.view(...) before calling it).")
        return state

    def update(self, objects: tuple[Any, ...], state: PyTree) -> None:
        """``nnx.update``: the caller's variables take the new arrays (a variable the step added is added)."""
        nnx.update(objects, state)

    def prune(self, objects: tuple[Any, ...], state: PyTree) -> None:
        """Removes from the caller's objects the variables ``state`` no longer holds (the step removed them, e.g.
        with ``nnx.pop``)."""
        keep = {p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
        gone = [p for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(objects))[0] if p not in keep]
        for path in gone:
            keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
            if keys and keys[-1] == "value":
                keys = keys[:-1]
            parent: Any = objects
            for key in keys[:-1]:
                parent = parent[key] if isinstance(parent, (tuple, list, dict)) else getattr(parent, key)
            if isinstance(parent, nnx.Pytree):
                delattr(parent, keys[-1])
            else:
                del parent[keys[-1]]

    def layouts(self, structure: Hashable, state: PyTree, mesh: BatchMesh) -> list[jax.sharding.Sharding]:
        """Replicated, or as each variable's sharding annotation names the mesh's axes."""
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        specs = partition_axes(state)
        if len(specs) != len(flat):  # (every variable holds one array; anything else is replicated)
            return [mesh.replicated] * len(flat)
        return [mesh.annotated_sharding(np.shape(a), spec, _path(p)) for (p, a), spec in zip(flat, specs)]

    def owned(self, objects: tuple[Any, ...], changed: PyTree) -> list[bool]:
        """Never asked (donation among the arguments is explicit): nothing is the engine's."""
        return [False] * len(jax.tree.leaves(changed))

    def names(self, structure: Hashable) -> list[str]:
        """Never asked (objects among the arguments are named by their place in the outputs)."""
        return []

    def hold(self, objects: tuple[Any, ...], structure: Hashable, state: PyTree) -> NnxHeld | None:
        """The objects held for the calls that follow (:class:`NnxHeld`)."""
        return NnxHeld.of(objects, state)


def partition_axes(state: PyTree) -> list[tuple[Any, ...]]:
    """Each variable's sharding annotation in ``state``, as the mesh axes of each dimension (``()``: none), in
    the order of ``state``'s leaves.

    Flax's ``nnx.with_partitioning(init, sharding)`` takes the axes as JAX's tutorials write them, a
    ``NamedSharding(mesh, P(...))`` (its spec is read; the strategy's mesh must have its axes), a
    ``PartitionSpec`` or a tuple of axis names (resolved through Flax's logical axis rules where it has any):
    ``nnx.get_partition_spec`` takes the last two only."""
    def axes(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, nnx.Variable):
            return ()
        sharding = v.get_metadata().get("out_sharding")
        if isinstance(sharding, jax.sharding.NamedSharding):
            return tuple(sharding.spec)
        spec = nnx.spmd.get_var_pspec(v) if sharding else None
        return () if spec is None else tuple(spec)

    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [axes(v) for v in variables]


def _take_cached_partial() -> None:
    """Takes the cache ``nnx.cached_partial(step, model, ...)`` hands the transform it calls (Flax's graph
    context, which raises after the call unless a transform took it). ``strategy.jit`` holds the objects itself
    (:class:`NnxHeld`: the partial's objects, Flax's copies that share the caller's variables, are held like any
    others), so the cache is left unused."""
    context = nnx.graph.GRAPH_CONTEXT
    if context.tmp_static_cache is not None:
        context.tmp_static_cache = None


def _slot_writer() -> Callable[[Any, Any], None] | None:
    """``put(variable, value)``: the value written into the slot ``Variable.get_raw_value`` reads, past Flax's
    per-write trace check; ``None`` where this Flax keeps its value elsewhere (checked on a variable made here:
    ``set_raw_value`` is used then)."""
    probe = nnx.Variable(np.zeros(()))
    value = np.ones(())

    def put(variable: Any, a: Any) -> None:
        object.__setattr__(variable, "_raw_value", a)

    try:
        put(probe, value)
    except (AttributeError, TypeError):  # pragma: no cover - a Flax without the slot
        return None
    return put if probe.get_raw_value() is value else None


_put = _slot_writer()
_SLOT = "_raw_value"
_get = operator.attrgetter(_SLOT)
_set = object.__setattr__


class NnxHeld:
    """Flax NNX objects held between calls (:class:`mirrorax.steps.split_merge.Held`): the ``Variable`` s of their
    state, in its leaves' order, read and written in place; and what makes their structure, each ``nnx.Pytree`` 's
    attributes and each list's and dict's items among them, as they were (by identity), to tell that they are
    unchanged without walking the graph.

    Not seen: a ``Variable``'s metadata changed in place (``set_metadata``), which no training loop does
    between steps; everything else a loop does between calls (a value assigned, ``model.eval()``,
    ``nnx.view``, an attribute added, removed or replaced, a list of submodules changed) is.
    """

    __slots__ = ("variables", "containers")

    def __init__(self, variables: list[Any], containers: list[tuple[Any, tuple[Any, ...]]]) -> None:
        self.variables, self.containers = variables, containers

    @classmethod
    def of(cls, objects: tuple[Any, ...], state: PyTree) -> NnxHeld | None:
        """``objects`` held, ``state`` the ``State`` ``nnx.split`` just gave of them; ``None`` if its leaves are not
        the variables' own values (a Flax whose ``split`` copies)."""
        variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        values = jax.tree.leaves(state)
        if len(variables) != len(values) or not all(isinstance(v, nnx.Variable) and v.get_raw_value() is a
                                                    for v, a in zip(variables, values)):
            return None
        containers: list[tuple[Any, tuple[Any, ...]]] = []
        for _, node in nnx.iter_graph(objects):
            if isinstance(node, nnx.Variable):
                continue
            if isinstance(node, nnx.Pytree):
                attributes = vars(node)
                containers.append((attributes, tuple(attributes.values())))
            elif type(node) is dict:
                containers.append((node, tuple(node.values())))
            elif type(node) is list:
                containers.append((node, tuple(node)))
        return cls(variables, containers)

    def unchanged(self) -> bool:
        """Every attribute, list item and dict entry is the object it was held with (a static attribute set to an
        equal but new value counts as a change: the call then splits the objects again)."""
        _take_cached_partial()
        for container, was in self.containers:
            now = container.values() if type(container) is dict else container
            if len(now) != len(was) or not all(map(operator.is_, now, was)):
                return False
        return True

    def read(self) -> list[Any]:
        """Each variable's value now."""
        if _put is not None:  # (the slot get_raw_value reads, read in C: a loop of small steps pays it each call)
            return list(map(_get, self.variables))
        return [v.get_raw_value() for v in self.variables]

    def write(self, leaves: list[Any]) -> None:
        """Each variable takes its new value.

        Flax's ``set_raw_value`` checks, at every write, that no trace is under way (a value traced inside a
        program must not leak into a variable made outside it), and that check costs more than the write:
        5 us a variable, 136 us a step for the performance guide's 26 variables, where its whole step takes
        220 us. The leaves answer it once: a call made outside any trace gives arrays, and then each value is
        put in the slot ``get_raw_value`` reads (:func:`_put`); a call made inside a trace gives tracers, which
        go through Flax's checked ``set_raw_value``."""
        if leaves and isinstance(leaves[0], jax.core.Tracer) or _put is None:
            for v, a in zip(self.variables, leaves):
                v.set_raw_value(a)
            return
        collections.deque(map(_set, self.variables, itertools.repeat(_SLOT), leaves), maxlen=0)  # (_put, in C)


NNX = NnxSplitMerge()
"""The protocol ``strategy.jit`` uses for Flax NNX objects (registered when ``mirrorax.nnx`` is imported)."""
