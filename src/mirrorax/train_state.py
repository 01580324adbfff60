"""``TrainState``: the training state as a typed, frozen dataclass that JAX treats as a pytree.

The jitted steps take and return it; ``jax.tree.map``, layouts (a ``TrainState`` of ``NamedSharding``s)
and ``jax.ShapeDtypeStruct`` trees keep its type. A checkpoint stores it as the plain dict
:meth:`TrainState.as_dict` gives (the keys are the field names).

The engine's four counters travel as one ``int32[7]`` leaf, :attr:`TrainState.counters` (each leaf a
compiled step takes and gives costs host time at every call: ~8 us a scalar on a TPU v5e); ``step``,
``skipped``, ``nonfinite_step`` and ``bad_label`` read and :meth:`TrainState.replace` writes their parts.
:meth:`TrainState.from_dict` also takes the older dict with the four as entries of their own (the form
checkpoints had before they were packed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax._host import host_value

__all__ = ["TrainState", "COUNTERS", "pack_counters"]

PyTree = Any


#: The counters packed in :attr:`TrainState.counters`, each with its slice of it.
COUNTERS: dict[str, slice] = {"step": slice(0, 1), "skipped": slice(1, 2), "nonfinite_step": slice(2, 3),
                              "bad_label": slice(3, 7)}
_SCALAR = ("step", "skipped", "nonfinite_step")
COUNTERS_SIZE = max(s.stop for s in COUNTERS.values())


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
      metrics: the metric accumulators of the running epoch or evaluation (sums and counts), as the
        adapter makes them (not packed into one vector: see ``DeviceState.fresh_metrics``).
      counters: ``int32[7]``, the four counters below in one array (``step, skipped, nonfinite_step,
        *bad_label``), read and written through their names.
      step: ``int32[]``, train steps applied so far (counted on from a checkpoint's after a resume).
      skipped: ``int32[]``, steps whose update was dropped for a non-finite loss (``on_nonfinite="skip"``;
        with ``"raise"`` a non-zero value means training froze at ``nonfinite_step``).
      nonfinite_step: ``int32[]``, the 1-based step whose loss first was non-finite; 0 if none.
      bad_label: ``int32[4]``, the first label outside its target's classes: ``(step, target, row,
        value)`` with the value's float32 bits (labels may be floats); zeros if none.

    Example:
      >>> state = TrainState.create(params={"w": np.ones(3)}, model_state={}, optimizer=(), metrics={})
      >>> state = state.replace(params={"w": np.zeros(3)}, step=np.int32(2))
      >>> jax.tree.map(lambda a: a.shape, state).params, int(state.step), state.counters.shape
      ({'w': (3,)}, 2, (7,))
      >>> state["params"] is state.params  # the older, dict-like read
      True
    """

    params: PyTree
    model_state: PyTree
    optimizer: PyTree
    metrics: PyTree
    counters: Any

    @property
    def step(self) -> Any:
        return _part(self.counters, "step")

    @property
    def skipped(self) -> Any:
        return _part(self.counters, "skipped")

    @property
    def nonfinite_step(self) -> Any:
        return _part(self.counters, "nonfinite_step")

    @property
    def bad_label(self) -> Any:
        return _part(self.counters, "bad_label")

    @classmethod
    def create(cls, *, params: PyTree, model_state: PyTree, optimizer: PyTree, metrics: PyTree) -> TrainState:
        """A fresh state of these values: counters at zero (host arrays, placed with the rest)."""
        return cls(params=params, model_state=model_state, optimizer=optimizer, metrics=metrics,
                   counters=np.zeros(COUNTERS_SIZE, np.int32))

    @classmethod
    def from_dict(cls, values: Mapping[str, PyTree]) -> TrainState:
        """The state a dict of its fields describes (the form a checkpoint stores: :meth:`as_dict`).

        The older form, ``step``, ``skipped``, ``nonfinite_step`` and ``bad_label`` as entries of their
        own instead of ``counters``, is taken too (arrays, ``jax.ShapeDtypeStruct``s or shardings).

        Raises:
          KeyError: ``values`` lacks a field or holds a key that is none.
        """
        keys = set(values)
        if "counters" not in keys and keys & set(COUNTERS):
            fields = (*_FIELDS[:-1], *COUNTERS)
        else:
            fields = _FIELDS
        missing, extra = [k for k in fields if k not in keys], sorted(keys - set(fields), key=str)
        if missing or extra:
            raise KeyError(f"A TrainState needs exactly the entries {', '.join(_FIELDS)}; received "
                           f"{sorted(keys, key=str)} (missing: {missing or 'none'}, unknown: {extra or 'none'}). "
                           "Pass a dict from TrainState.as_dict() or a checkpoint of a mirrorax state.")
        groups = {k: values[k] for k in _FIELDS[:-1]}
        counters = values["counters"] if fields is _FIELDS else pack_counters(**{k: values[k] for k in COUNTERS})
        return cls(**groups, counters=counters)

    def replace(self, **changes: PyTree) -> TrainState:
        """A copy with the given fields replaced (``dataclasses.replace``); the state is never changed in place.

        ``step``, ``skipped``, ``nonfinite_step`` and ``bad_label`` may be given too: :attr:`counters`
        is rebuilt with them (the others kept).

        Raises:
          TypeError: a name that is not a field nor a counter, or ``counters`` with a counter.
        """
        unknown = sorted(set(changes) - set(_FIELDS) - set(COUNTERS))
        if unknown:
            raise TypeError(f"TrainState has no field {unknown[0]!r}; its fields are {', '.join(_FIELDS)} (and the "
                            f"counters {', '.join(COUNTERS)}). Received replace({', '.join(sorted(changes))}).")
        named = [k for k in COUNTERS if k in changes]
        if named:
            if "counters" in changes:
                raise TypeError(f"replace() got counters and {named[0]}, a part of them: pass one or the other.")
            parts = {k: changes.pop(k) if k in changes else getattr(self, k) for k in COUNTERS}
            changes["counters"] = pack_counters(**parts)
        return dataclasses.replace(self, **changes)

    def host_counters(self) -> dict[str, Any]:
        """The four counters as numpy values, read in one transfer (``{"step": 3, ...}``: ``int32``
        scalars, ``bad_label`` an ``int32[4]``)."""
        values = host_value(self.counters)
        return {k: values[s] if k == "bad_label" else values[s.start] for k, s in COUNTERS.items()}

    def as_dict(self) -> dict[str, PyTree]:
        """``{field name: value}``: the plain dict form, which checkpoints store."""
        return {k: getattr(self, k) for k in _FIELDS}

    def keys(self) -> tuple[str, ...]:
        """The field names, in order (with ``state[key]``, ``dict(state)`` gives :meth:`as_dict`)."""
        return _FIELDS

    def __getitem__(self, key: str) -> PyTree:
        """``state["params"]``: the older, dict-like way to read a field (``state.params`` is the same); a
        counter's name reads it as the attribute does (``state["step"]``)."""
        if isinstance(key, str) and (key in _FIELDS or key in COUNTERS):
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


def _part(counters: Any, name: str) -> Any:
    """Counter ``name``'s part of ``counters``: a slice of an array (a 0-d one for a scalar counter),
    traced or not; a ``ShapeDtypeStruct`` of its shape; anything else (a sharding) as it is."""
    s = COUNTERS[name]
    index: Any = s.start if name in _SCALAR else s
    if isinstance(counters, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(() if name in _SCALAR else (s.stop - s.start,), counters.dtype,
                                    sharding=counters.sharding)
    if isinstance(counters, np.ndarray):
        return counters[index, ...]  # (a 0-d array view, not a numpy scalar)
    if isinstance(counters, jax.Array):
        return counters[index]
    return counters


def pack_counters(*, step: Any, skipped: Any, nonfinite_step: Any, bad_label: Any) -> Any:
    """The four counters as one ``int32[7]`` (:attr:`TrainState.counters`): numpy for host values, a
    ``jax.Array`` when one is (traced or not); for ``jax.ShapeDtypeStruct``s one of shape ``(7,)``; for
    anything else (shardings) ``step``'s."""
    parts = (step, skipped, nonfinite_step, bad_label)
    if isinstance(step, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((COUNTERS_SIZE,), np.int32, sharding=step.sharding)
    if any(isinstance(p, jax.Array) for p in parts):
        return jnp.concatenate([jnp.reshape(jnp.asarray(p, jnp.int32), (-1,)) for p in parts])
    if all(isinstance(p, (np.ndarray, np.generic, int)) for p in parts):
        return np.concatenate([np.reshape(np.asarray(p, np.int32), (-1,)) for p in parts])
    return step


_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainState))
jax.tree_util.register_dataclass(TrainState, data_fields=list(_FIELDS), meta_fields=[])
