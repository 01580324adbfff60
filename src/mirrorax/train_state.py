"""``TrainState``: the training state as a typed, frozen dataclass that JAX treats as a pytree.

The jitted steps take and return it; ``jax.tree.map``, layouts (a ``TrainState`` of ``NamedSharding``s)
and ``jax.ShapeDtypeStruct`` trees keep its type. A checkpoint stores it as the plain dict
:meth:`TrainState.as_dict` gives (the keys are the field names), which is the form checkpoints had
before the state was typed, so checkpoints written before and after read each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["TrainState"]

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class TrainState:
    """The whole training state: the model's variables, the optimizer's, the metric sums and counters.

    Every field is a data field of the pytree (there is no static field), in the order below: that is
    the order of ``jax.tree.leaves(state)`` for the groups (inside a group, its own tree's order). On
    the devices the leaves are ``jax.Array``s, in a step tracers, after :meth:`Trainer.host_state`
    numpy arrays; a layout is a ``TrainState`` of ``NamedSharding``s.

    Attributes:
      params: the trainable variables (a dict of arrays keyed by variable path for Keras models, the
        user's pytree for a :class:`FunctionalModel`).
      model_state: the non-trainable variables (BatchNorm statistics, random seed state); ``{}`` if none.
      optimizer: the optimizer's state (a Keras optimizer's variables by path, or an optax state).
      metrics: the metric accumulators of the running epoch or evaluation (sums and counts).
      step: ``int32[]``, train steps applied so far (counted on from a checkpoint's after a resume).
      skipped: ``int32[]``, steps whose update was dropped for a non-finite loss (``on_nonfinite="skip"``;
        with ``"raise"`` a non-zero value means training froze at ``nonfinite_step``).
      nonfinite_step: ``int32[]``, the 1-based step whose loss first was non-finite; 0 if none.
      bad_label: ``int32[4]``, the first label outside its target's classes: ``(step, target, row,
        value)`` with the value's float32 bits (labels may be floats); zeros if none.

    Example:
      >>> state = TrainState.create(params={"w": np.ones(3)}, model_state={}, optimizer=(), metrics={})
      >>> state = state.replace(params={"w": np.zeros(3)})
      >>> jax.tree.map(lambda a: a.shape, state).params
      {'w': (3,)}
      >>> state["params"] is state.params  # the older, dict-like read
      True
    """

    params: PyTree
    model_state: PyTree
    optimizer: PyTree
    metrics: PyTree
    step: Any
    skipped: Any
    nonfinite_step: Any
    bad_label: Any

    @classmethod
    def create(cls, *, params: PyTree, model_state: PyTree, optimizer: PyTree, metrics: PyTree) -> TrainState:
        """A fresh state of these values: counters at zero (host arrays, placed with the rest)."""
        return cls(params=params, model_state=model_state, optimizer=optimizer, metrics=metrics,
                   step=np.zeros((), np.int32), skipped=np.zeros((), np.int32),
                   nonfinite_step=np.zeros((), np.int32), bad_label=np.zeros(4, np.int32))

    @classmethod
    def from_dict(cls, values: Mapping[str, PyTree]) -> TrainState:
        """The state a dict of its fields describes (the form a checkpoint stores: :meth:`as_dict`).

        Raises:
          KeyError: ``values`` lacks a field or holds a key that is none.
        """
        keys = set(values)
        missing, extra = [k for k in _FIELDS if k not in keys], sorted(keys - set(_FIELDS), key=str)
        if missing or extra:
            raise KeyError(f"A TrainState needs exactly the entries {', '.join(_FIELDS)}; received "
                           f"{sorted(keys, key=str)} (missing: {missing or 'none'}, unknown: {extra or 'none'}). "
                           "Pass a dict from TrainState.as_dict() or a checkpoint of a mirrorax state.")
        return cls(**{k: values[k] for k in _FIELDS})

    def replace(self, **changes: PyTree) -> TrainState:
        """A copy with the given fields replaced (``dataclasses.replace``); the state is never changed in place.

        Raises:
          TypeError: a name that is not a field.
        """
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise TypeError(f"TrainState has no field {unknown[0]!r}; its fields are {', '.join(_FIELDS)}. "
                            f"Received replace({', '.join(sorted(changes))}).")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, PyTree]:
        """``{field name: value}``: the plain dict form, which checkpoints store (the same keys as ever)."""
        return {k: getattr(self, k) for k in _FIELDS}

    def keys(self) -> tuple[str, ...]:
        """The field names, in order (with ``state[key]``, ``dict(state)`` gives :meth:`as_dict`)."""
        return _FIELDS

    def __getitem__(self, key: str) -> PyTree:
        """``state["params"]``: the older, dict-like way to read a field (``state.params`` is the same)."""
        if isinstance(key, str) and key in _FIELDS:
            return getattr(self, key)
        raise KeyError(f"TrainState has no entry {key!r}; its entries are {', '.join(_FIELDS)}. Read them as "
                       "attributes (state.params) or with state['params'].")

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in _FIELDS

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __repr__(self) -> str:
        groups = ", ".join(f"{k}=<{len(jax.tree.leaves(getattr(self, k)))} leaves>" for k in _FIELDS[:4])
        return f"TrainState({groups}, step={self.step!r})"


_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainState))
jax.tree_util.register_dataclass(TrainState, data_fields=list(_FIELDS), meta_fields=[])
