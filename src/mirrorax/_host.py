"""Host copies of arrays: the one place that decides how a value on the devices reaches numpy.

A replicated array is read from this process's first copy (one transfer, not one per device); an array
split over other processes' devices is gathered from them (every process must then call it together).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["local_copy", "host_value", "host_tree"]


def local_copy(a: Any) -> Any:
    """This process's first copy of a replicated array over several devices (no transfer of the
    others, still on its device), else ``a`` itself."""
    if isinstance(a, jax.Array) and a.is_fully_replicated and len(a.sharding.device_set) > 1:
        return a.addressable_data(0)
    return a


def host_value(a: Any) -> np.ndarray:
    """The whole value of ``a`` as numpy, on any process count.

    Args:
      a: a ``jax.Array`` (replicated, split over this process's devices, or split over other
        processes' devices too: then gathered, and every process must call this together), or anything
        ``np.asarray`` takes.

    Example:
      >>> host_value(strategy.replicate(np.ones(3)))
      array([1., 1., 1.])
    """
    a = local_copy(a)
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils  # (imports jax's multi-process helpers on first use)

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def host_tree(tree: Any) -> Any:
    """:func:`host_value` of every leaf of ``tree``, in one batched transfer (not one wait per leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    local = [local_copy(a) for a in leaves]
    out = [host_value(a) if isinstance(a, jax.Array) and not a.is_fully_addressable else a for a in local]
    return jax.tree.unflatten(treedef, [np.asarray(a) for a in jax.device_get(out)])
