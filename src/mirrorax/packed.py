"""Small arrays that travel as one: a pytree's small leaves packed into one vector per dtype.

Every array a compiled program takes or gives costs host time at each call (JAX's C++ dispatch handles
each leaf; a donated scalar in and out, measured: ~2 us a call on CPU, ~8 us on a TPU v5e). A train
step's metric accumulators are a handful of scalars (a loss Mean's total and count, an accuracy's): as a
:class:`Packed` they are one float32 vector. Inside a traced step :meth:`Packed.unpack` gives the tree
back as slices (XLA fuses them with their use), and :func:`pack` packs the updated tree again; on the
host the same :meth:`Packed.unpack` reads views of a host copy.

Where each leaf sits is static (the pytree node's auxiliary data): a ``jax.tree.map`` over a
:class:`Packed` (shardings, ``jax.ShapeDtypeStruct``s, host copies) keeps it, and two trees of other
shapes or dtypes are different pytree structures, as they were unpacked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Packed", "pack", "unpacked", "MAX_PACKED_SIZE"]

PyTree = Any

#: Leaves with more elements than this travel as themselves (a confusion matrix's counts, a metric
#: with thousands of thresholds): packing them would copy them every step for no dispatch saved.
MAX_PACKED_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one leaf of the packed tree sits: array ``index``, from ``offset`` (``None``: the whole
    array is the leaf, unpacked), ``shape`` and ``dtype`` (its name)."""

    index: int
    offset: int | None
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class _Where:
    """The static half of a :class:`Packed`: the tree's structure, each leaf's slot, each array's name."""

    treedef: Any
    slots: tuple[_Slot, ...]
    names: tuple[str, ...]


class Packed:
    """A pytree's leaves as one vector per dtype (small leaves) plus its large leaves as they are.

    A pytree node: its children are :attr:`arrays` (named by dtype, ``"float32"``, and by the large
    leaves' paths); the layout is static. Build one with :func:`pack`; read the tree with :meth:`unpack`.

    Attributes:
      arrays: the packed vectors, then the leaves kept as they are.
      where: the static layout: the tree's structure and where each leaf sits (the pytree's aux data).

    Example:
      >>> p = pack({"loss": {"total": np.float32(3.0), "count": np.float32(2.0)}})
      >>> len(jax.tree.leaves(p)), p.names
      (1, ('float32',))
      >>> p.unpack()["loss"]["total"]
      array(3., dtype=float32)
    """

    __slots__ = ("arrays", "where")

    def __init__(self, arrays: tuple[Any, ...], where: _Where) -> None:
        self.arrays = tuple(arrays)
        self.where = where

    @property
    def names(self) -> tuple[str, ...]:
        """Each array's name: the dtype of a packed vector, or the path of a leaf kept as it is."""
        return self.where.names

    def unpack(self) -> PyTree:
        """The tree that was packed, of the arrays held: slices inside a traced step, views on the host.

        A :class:`Packed` of anything else (shardings, ``jax.ShapeDtypeStruct``s) gives each leaf its
        array's value; a ``ShapeDtypeStruct`` the leaf's shape and dtype with the array's sharding.
        """
        leaves = [_leaf(self.arrays[s.index], s) for s in self.where.slots]
        return jax.tree.unflatten(self.where.treedef, leaves)

    def stored(self) -> dict[str, Any]:
        """``{name: array}``: the plain dict a checkpoint stores (see :meth:`from_stored`)."""
        return dict(zip(self.names, self.arrays))

    def from_stored(self, values: dict[str, Any]) -> Packed:
        """A :class:`Packed` of this layout holding ``values`` (a dict :meth:`stored` gave)."""
        return Packed(tuple(values[n] for n in self.names), self.where)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {getattr(a, 'shape', '?')}" for n, a in zip(self.names, self.arrays))
        return f"Packed({len(self.where.slots)} leaves in {{{shapes}}})"


def _leaf(array: Any, slot: _Slot) -> Any:
    if slot.offset is None:
        return array
    if isinstance(array, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(slot.shape, array.dtype, sharding=array.sharding)
    if not isinstance(array, (np.ndarray, jax.Array)):
        return array  # a sharding, or any per-array value: the same for each leaf in it
    size = int(np.prod(slot.shape, dtype=np.int64))
    return array[slot.offset:slot.offset + size].reshape(slot.shape)


def _packable(a: Any) -> bool:
    # (bfloat16 and float8 are numbers to JAX, though numpy files them as void)
    numeric = not jnp.issubdtype(a.dtype, jax.dtypes.extended) and \
        (jnp.issubdtype(a.dtype, jnp.number) or jnp.issubdtype(a.dtype, jnp.bool_))
    return numeric and int(np.size(a)) <= MAX_PACKED_SIZE


def _name(path: tuple[Any, ...], taken: set[str]) -> str:
    """A kept leaf's name: its path's keys joined by ``/`` (``auc/true_positives``), made unique."""
    name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path) or "leaf"
    while name in taken:
        name += "_"
    return name


def pack(tree: PyTree) -> Packed:
    """``tree``'s leaves packed: the small ones (at most :data:`MAX_PACKED_SIZE` elements, a numeric
    dtype) into one flat vector per dtype, in order of first appearance; the others as they are.

    A vector of host values (numpy, Python numbers) is numpy; one with a ``jax.Array`` or tracer among
    them a ``jax.Array``.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [a if isinstance(a, (np.ndarray, jax.Array)) else np.asarray(a) for _, a in flat]
    groups: dict[str, list[Any]] = {}
    kept: list[tuple[str, Any]] = []
    slots: list[tuple[str, int | None, tuple[int, ...], str]] = []
    for (path, _), a in zip(flat, leaves):
        dtype = str(a.dtype)
        if _packable(a):
            parts = groups.setdefault(dtype, [])
            offset = sum(int(np.size(p)) for p in parts)
            parts.append(a)
            slots.append((dtype, offset, tuple(a.shape), dtype))
        else:
            name = _name(path, set(groups) | {n for n, _ in kept})
            kept.append((name, a))
            slots.append((name, None, tuple(a.shape), dtype))
    names = tuple(groups) + tuple(n for n, _ in kept)
    index = {n: i for i, n in enumerate(names)}
    arrays = tuple(_concatenate(parts) for parts in groups.values()) + tuple(a for _, a in kept)
    where = _Where(treedef, tuple(_Slot(index[n], off, shape, dt) for n, off, shape, dt in slots), names)
    return Packed(arrays, where)


def _concatenate(parts: list[Any]) -> Any:
    if all(isinstance(p, np.ndarray) for p in parts):  # host values stay on the host
        return np.concatenate([np.ravel(p) for p in parts])
    return jnp.concatenate([jnp.ravel(p) for p in parts])


def unpacked(tree: PyTree) -> PyTree:
    """``tree.unpack()`` for a :class:`Packed`, any other tree as it is."""
    return tree.unpack() if isinstance(tree, Packed) else tree


def _flatten_with_keys(p: Packed) -> tuple[list[tuple[Any, Any]], _Where]:
    return [(jax.tree_util.DictKey(n), a) for n, a in zip(p.names, p.arrays)], p.where


def _flatten(p: Packed) -> tuple[tuple[Any, ...], _Where]:
    return p.arrays, p.where


def _unflatten(where: _Where, arrays: Any) -> Packed:
    return Packed(tuple(arrays), where)


jax.tree_util.register_pytree_with_keys(Packed, _flatten_with_keys, _unflatten, _flatten)
