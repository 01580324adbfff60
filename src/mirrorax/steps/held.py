"""Objects among a step's arguments held between calls: their structure paid for once, not per call.

A step that takes stateful objects (Flax NNX modules, an ``nnx.Optimizer``, metrics, ``nnx.Rngs``) is called
the same way step after step: the same objects in the same argument places, new batches beside them. Splitting
the objects at every call (walking their graph, then walking it again to write the new state back) costs more
than a small model's step on an accelerator; Flax's performance guide pays it once, with ``nnx.split`` before
the loop and ``nnx.update`` after it. A :class:`HeldCall` does that for the user: after a call that split the
objects, each front-end holds them (:meth:`mirrorax.steps.split_merge.SplitMerge.hold`), and a later call with the same
objects in the same places reads their state's leaves, calls the same program and writes the new leaves back,
without walking them. What the user does between calls is still seen: a value assigned to a variable is read
(and placed on the devices if it is not there), and a change of structure (``model.eval()``, an attribute added
or replaced) makes the front-end's :meth:`~mirrorax.steps.split_merge.Held.unchanged` false, so the call splits the
objects again.

Only objects given as arguments themselves are held (``step(model, optimizer, x, y)``); objects inside a
container argument are split at every call.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mirrorax.steps.distributed_batch import DistributedBatch
from mirrorax.steps.split_merge import Held, Split, SplitMerge, is_slot

__all__ = ["HeldCall"]

PyTree = Any

# Types an argument beside the objects may have without holding an object (anything else is looked through).
_PLAIN: tuple[type, ...] = (np.ndarray, DistributedBatch, int, float, bool, type(None), np.generic)
try:
    from jax._src.array import ArrayImpl

    _PLAIN = (ArrayImpl, *_PLAIN)
except ImportError:  # pragma: no cover - a JAX that moved it: jax.Array (an isinstance hook) below
    pass


class HeldCall:
    """One call's objects, held for the calls that follow with the same objects in the same argument places.

    Attributes:
      structure: the split's structure (the program's static argument).
      template: the call's arguments with a slot in each object's place (the places of the objects).
      parts: per protocol with objects: ``(protocol index, its Held)``.
      targets: per part, each leaf's layout on the mesh.
      written: per part, the leaves the engine wrote last (a leaf read back as it is needs no placement).
      donated: whether the objects' state is donated (every argument holding objects in ``donate_argnums``).
      alive: ``False`` once an object held has been garbage collected (the entry is then dropped).
    """

    __slots__ = ("structure", "template", "places", "refs", "parts", "targets", "written", "donated", "alive",
                 "__weakref__")

    def __init__(self, args: tuple[Any, ...], split: Split, parts: list[tuple[int, Held]], targets: list[list[Any]],
                 written: list[list[Any]], donated: bool) -> None:
        self.structure, self.template = split.structure, split.args
        self.places = tuple(sorted(split.positions))
        # (weakly: holding a step must not keep a model alive; its variables go with the entry)
        self.refs = tuple(weakref.ref(args[i]) for i in self.places)
        self.parts, self.targets, self.written, self.donated = parts, targets, written, donated
        self.alive = True
        for i in self.places:
            weakref.finalize(args[i], _drop, weakref.ref(self))

    @classmethod
    def of(cls, args: tuple[Any, ...], split: Split, kinds: Sequence[SplitMerge], targets: list[list[Any]],
           written: list[list[Any]], donated: bool) -> HeldCall | None:
        """The objects of ``split`` (a call with ``args``) held, or ``None`` where a front-end does not hold its
        objects or an object stands inside an argument (not an argument itself)."""
        if not all(is_slot(split.args[i]) for i in split.positions):
            return None
        parts = []
        for (k, structure, _), state in zip(split.structure.value, split.states):
            hold: Callable[..., Held | None] | None = getattr(kinds[k], "hold", None)
            held = hold(tuple(split.objects[k]), structure, state) if hold is not None else None
            if held is None:
                return None
            parts.append((k, held))
        return cls(args, split, parts, targets, written, donated)

    def matches(self, args: tuple[Any, ...]) -> bool:
        """Whether ``args`` hold the held objects in their places."""
        return len(args) == len(self.template) and all(r() is args[i] for i, r in zip(self.places, self.refs))

    def rest(self, args: tuple[Any, ...], owns: Callable[[Any], bool]) -> tuple[Any, ...] | None:
        """``args`` with a slot in each object's place, or ``None`` when another argument holds an object of a
        front-end (``owns``): that call splits them all."""
        template = self.template
        out = list(args)
        for i, a in enumerate(args):
            if i in self.places:
                out[i] = template[i]
            elif not isinstance(a, _PLAIN) and any(owns(x) for x in jax.tree.leaves(a, is_leaf=owns)):
                return None
        return tuple(out)

    def unchanged(self) -> bool:
        """Whether every front-end's objects keep the structure they were held with."""
        return all(held.unchanged() for _, held in self.parts)

    def read(self) -> list[list[Any]]:
        """Each part's leaves now (a value the user assigned since the last call included)."""
        return [held.read() for _, held in self.parts]

    def fresh(self, leaves: list[list[Any]]) -> bool:
        """Whether ``leaves`` are all the ones the engine wrote last (none assigned by the user since)."""
        return all(len(a) == len(b) and all(map(operator.is_, a, b)) for a, b in zip(leaves, self.written))

    def write(self, leaves: list[list[Any]]) -> None:
        """Writes each part's new leaves into its objects; they are the ones written last now."""
        for (_, held), part in zip(self.parts, leaves):
            held.write(part)
        self.written = leaves

    def objects(self, args: tuple[Any, ...]) -> dict[int, list[Any]]:
        """The objects of ``args`` (a call this entry :meth:`matches`), per protocol index, in slot order."""
        out: dict[int, dict[int, Any]] = {}
        for i in self.places:
            slot = self.template[i]
            out.setdefault(slot.kind, {})[slot.index] = args[i]
        return {k: [group[j] for j in sorted(group)] for k, group in out.items()}

    def objects_back(self, out: Any, args: tuple[Any, ...]) -> Any:
        """``out`` with each object slot a step returned replaced by the caller's object (from ``args``)."""
        if isinstance(out, jax.Array):
            return out
        where = {}
        for i in self.places:
            slot = self.template[i]
            where[(slot.kind, slot.index)] = args[i]

        def back(x: Any) -> Any:
            return where[(x.kind, x.index)] if is_slot(x) else x

        return jax.tree.map(back, out, is_leaf=is_slot)


def _drop(ref: weakref.ref[HeldCall]) -> None:
    held = ref()
    if held is not None:
        held.alive = False
        held.parts, held.written = [], []  # (the variables and their arrays go with the objects)
