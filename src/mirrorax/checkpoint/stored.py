"""The stored form of a state: what a checkpoint may hold, the tree Orbax writes for it, and how a stored tree is
compared with the model's.

A :class:`~mirrorax.TrainState` is stored as its plain dict (:meth:`~mirrorax.TrainState.as_dict`); checkpoints
written before the counters were packed hold ``step``, ``skipped``, ... as entries of their own and are read in
that form, then packed (:func:`typed`). Typed PRNG keys are stored as their key data. Nothing here reads or
writes a file: the checkpointer (:mod:`mirrorax.checkpoint.checkpointer`) and its reader
(:mod:`mirrorax.checkpoint.reader`) do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax.integrity import path_str
from mirrorax.train_state import COUNTERS, TrainState, pack_counters

__all__ = ["describe", "stored_form", "first_mismatch", "stored", "unpacked_form", "is_unpacked_form", "typed",
           "check_savable", "json_clean", "check_abstract"]

PyTree = Any


def describe(shape: Any, dtype: Any) -> str:
    return f"shape={tuple(shape)} dtype={np.dtype(dtype).name if dtype is not None else None}"


def stored_form(leaf: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) as Orbax records it: typed PRNG keys are stored as their uint32 key data."""
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(leaf.shape), leaf.dtype


def first_mismatch(held: Any, abstract: PyTree) -> str | None:
    """A sentence naming the first variable whose presence, shape or dtype differs between a checkpoint's
    tree ``held`` and the model's ``abstract`` one, or ``None``."""
    stored_flat = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(held)[0]}
    wanted = [(path_str(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    for path, leaf in wanted:
        shape, dtype = stored_form(leaf)
        if path not in stored_flat:
            return f"variable {path!r} ({describe(shape, dtype)}) is missing from the checkpoint"
        got = stored_flat[path]
        got_shape = tuple(getattr(got, "shape", ()) or ())
        got_dtype = getattr(got, "dtype", None)
        if got_shape != shape or (got_dtype is not None and np.dtype(got_dtype) != np.dtype(dtype)):
            return (
                f"variable {path!r} is {describe(got_shape, got_dtype)} in the checkpoint but "
                f"{describe(shape, dtype)} in the model"
            )
    extra = sorted(set(stored_flat) - {p for p, _ in wanted})
    if extra:
        return (
            f"the checkpoint holds variable {extra[0]!r} that the model does not have"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    return None


def stored(tree: PyTree) -> PyTree:
    """The tree Orbax writes and reads for ``tree``: a :class:`TrainState` as its plain dict, any other
    tree as is."""
    return tree.as_dict() if isinstance(tree, TrainState) else tree


def unpacked_form(like: TrainState) -> dict[str, PyTree]:
    """The stored tree of checkpoints written before the counters were packed: the counters as entries
    of their own (of ``like``'s shapes)."""
    values = like.as_dict()
    del values["counters"]
    values.update({k: getattr(like, k) for k in COUNTERS})
    return values


def is_unpacked_form(held: Any, like: PyTree) -> bool:
    """Whether checkpoint tree ``held`` (its metadata) is of :func:`unpacked_form` while ``like`` is a
    :class:`TrainState` (whose stored form has one ``counters``)."""
    return isinstance(like, TrainState) and isinstance(held, Mapping) and "counters" not in held and "step" in held


def typed(restored: PyTree, like: PyTree) -> PyTree:
    """A restored tree in the type of the abstract tree it was restored for (:func:`stored` undone; the
    counters of a tree of :func:`unpacked_form` packed as ``like``'s are, on their layout)."""
    if not isinstance(like, TrainState):
        return restored
    values = dict(restored)
    if "counters" not in values:
        apart = {k: values.pop(k) for k in COUNTERS}
        sharding = jax.tree.map(lambda a: a.sharding, like.counters)
        values["counters"] = jax.jit(lambda c: pack_counters(**c), out_shardings=sharding)(apart)
    return TrainState.from_dict(values)


def check_savable(state: PyTree) -> None:
    """Refuses, before Orbax sees it, a leaf Orbax cannot write (a string, an object, an empty array).

    Orbax refuses them too, but from inside its save, after some of its background threads started
    waiting for the rest of the save: those then wait for good, and the program hangs at exit.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = path_str(path) or "the top level"
        if isinstance(leaf, (bool, int, float)):
            continue
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(f"Expected the state to save to hold jax.Arrays, numpy arrays and Python numbers. "
                            f"Received {leaf!r:.80} (of type {type(leaf).__name__}) at {where!r}. Convert it "
                            "(np.asarray) or keep it in the meta record (JSON).")
        dtype = np.dtype(leaf.dtype) if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else None
        if dtype is not None and not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
            raise TypeError(f"Expected the arrays of the state to save to hold numbers. Received an array of dtype "
                            f"{dtype} at {where!r}. Encode it as numbers, or keep it in the meta record (JSON).")
        if leaf.size == 0:
            raise ValueError(f"Expected the arrays of the state to save to hold at least one element (Orbax "
                             f"writes no empty array). Received shape {tuple(leaf.shape)} at {where!r}. Leave it "
                             "out of the state.")




def json_clean(value: Any, where: str) -> Any:
    """A copy of ``value`` made of JSON types only (numpy scalars and arrays become Python values)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"Expected the checkpoint meta to have string keys. Received key {k!r} "
                    f"(of type {type(k).__name__}) at {where or 'the top level'}. "
                    "Convert the key with str()."
                )
            out[k] = json_clean(v, f"{where}/{k}" if where else k)
        return out
    if isinstance(value, (list, tuple)):
        return [json_clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (np.ndarray, jax.Array)):
        return json_clean(np.asarray(value).tolist(), where)
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"Expected the checkpoint meta to hold JSON values (dict, list, str, int, float, bool, None "
        f"or numpy numbers). Received {value!r} (of type {type(value).__name__}) at {where!r}. "
        "Convert it to one of those types before saving."
    )




def check_abstract(abstract_state: PyTree, method: str) -> None:
    """Refuses an ``abstract_state`` whose leaves are not shapes with dtypes (e.g. Keras variables)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract_state)
    for path, leaf in flat:
        if not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
            raise TypeError(
                f"Expected abstract_state of Checkpointer.{method} to be a tree of jax.ShapeDtypeStruct "
                f"(or arrays) carrying this run's shardings. Received a {type(leaf).__module__}."
                f"{type(leaf).__qualname__} at {path_str(path) or 'the top level'!r}. Build it from the "
                "state's arrays: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, "
                "sharding=x.sharding), state) (for a Keras model, from its variables' .value)."
            )
