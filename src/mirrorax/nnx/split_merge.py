"""Flax NNX objects through a compiled step: NNX's own ``split`` / ``merge`` as the engine's protocol.

``strategy.jit`` hands the objects among a step's arguments (modules, ``nnx.Optimizer``, metrics,
``nnx.Rngs``, variables; views made by ``nnx.view`` too) to :data:`NNX`, a
:class:`mirrorax.split_merge.SplitMerge`: ``nnx.split`` of them all together (objects they share, such as
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

import contextlib
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np
from flax import nnx

if TYPE_CHECKING:
    from mirrorax.mesh import BatchMesh

__all__ = ["NNX", "NnxSplitMerge"]

PyTree = Any


_NNX_TYPES = (nnx.Pytree, nnx.Variable)


def _path(path: tuple[Any, ...]) -> str:
    """A state leaf's path as NNX writes it (``0/dense/kernel``: the first object given, its ``dense.kernel``)."""
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)


class NnxSplitMerge:
    """The split/merge protocol (:class:`mirrorax.split_merge.SplitMerge`) of Flax NNX objects."""

    def owns(self, x: Any) -> bool:
        """Modules, optimizers, metrics, ``Rngs`` (``nnx.Pytree``) and variables (``nnx.Variable``)."""
        # (by type: Variable's isinstance hook costs 1 us on every node of every strategy.jit call's arguments)
        return issubclass(type(x), _NNX_TYPES)

    def discover(self, args: tuple[Any, ...], where: str) -> AbstractContextManager[Callable[[], Any]] | None:
        """``None``: NNX objects are found among the arguments only."""
        return None

    def split(self, objects: tuple[Any, ...]) -> tuple[Hashable, PyTree]:
        """``nnx.split`` of the objects together: ``(GraphDef, State)``."""
        return nnx.split(objects)

    @contextlib.contextmanager
    def bind(self, structure: Hashable, state: PyTree) -> Iterator[tuple[Any, ...]]:
        """``nnx.merge``: new objects from the ``GraphDef`` and a (traced) ``State``, handed to the step."""
        yield nnx.merge(cast(Any, structure), state)

    def state(self, structure: Hashable, before: PyTree, objects: tuple[Any, ...]) -> PyTree:
        """The merged objects' ``State`` after the step; their ``GraphDef`` must be ``structure``."""
        graphdef, state = nnx.split(objects)
        if graphdef != structure:
            def paths(tree: PyTree) -> set[str]:
                return {_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}

            added, removed = sorted(paths(state) - paths(before)), sorted(paths(before) - paths(state))
            what = (f"variables added: {added}, removed: {removed}" if added or removed else
                    f"the same {len(paths(state))} variables, but a static attribute or a submodule changed")
            raise ValueError(
                f"The step changed the structure of the NNX objects it was given ({what}; paths from the first "
                "object passed, 0/...). strategy.jit compiles one program per structure and writes the new state "
                "back into the objects as they came in. Make such changes outside the step (e.g. model.train() / "
                "model.eval() or nnx.view(...) before calling it).")
        return state

    def update(self, objects: tuple[Any, ...], state: PyTree) -> None:
        """``nnx.update``: the caller's variables take the new arrays."""
        nnx.update(objects, state)

    def layouts(self, structure: Hashable, state: PyTree, mesh: BatchMesh) -> list[jax.sharding.Sharding]:
        """Replicated, or as each variable's sharding annotation names the mesh's axes."""
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        specs = jax.tree.leaves(nnx.get_partition_spec(state))
        if len(specs) != len(flat):  # (every variable holds one array; anything else is replicated)
            return [mesh.replicated] * len(flat)
        return [mesh.annotated_sharding(np.shape(a), tuple(spec), _path(p)) for (p, a), spec in zip(flat, specs)]

    def owned(self, objects: tuple[Any, ...], changed: PyTree) -> list[bool]:
        """Never asked (donation among the arguments is explicit): nothing is the engine's."""
        return [False] * len(jax.tree.leaves(changed))

    def names(self, structure: Hashable) -> list[str]:
        """Never asked (objects among the arguments are named by their place in the outputs)."""
        return []


NNX = NnxSplitMerge()
"""The protocol ``strategy.jit`` uses for Flax NNX objects (registered when ``mirrorax.nnx`` is imported)."""
