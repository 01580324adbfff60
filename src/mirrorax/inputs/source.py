"""What a user passes as data, as a source of global batches: arrays or an iterable of batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from mirrorax.input_checks import is_nested_numbers
from mirrorax.inputs.arrays import ArraySource
from mirrorax.inputs.iterables import IterableSource

__all__ = ["make_source", "require_targets", "is_array_tree"]


def make_source(x: Any, y: Any = None, sample_weight: Any = None, *, float_dtype: Any = np.float32,
                check_finite: bool = True) -> ArraySource | IterableSource:
    """An :class:`ArraySource` for arrays, an :class:`IterableSource` for any other iterable.

    Args:
      float_dtype: the model's float type (float32/float64 inputs become it).
      check_finite: refuse NaN/inf in arrays (fit and evaluate; predict passes False).
    """
    if is_array_tree(x):
        return ArraySource(x, y, sample_weight, float_dtype=float_dtype, check_finite=check_finite)
    if y is not None or sample_weight is not None:
        raise ValueError("When x is an iterable of batches, y and sample_weight come from its items; "
                         f"received y of type {type(y).__name__} and sample_weight of type "
                         f"{type(sample_weight).__name__} too. Yield (x, y) or (x, y, sample_weight) instead.")
    if not isinstance(x, Iterable) or isinstance(x, (str, bytes)):
        raise TypeError(f"x must be an array, a tuple/list/dict of arrays, or an iterable of batches; "
                        f"received {type(x).__name__}.")
    return IterableSource(x, float_dtype=float_dtype)


def require_targets(source: ArraySource | IterableSource, what: str) -> None:
    """Refuses a source without targets for ``what`` (``"fit"``, ``"evaluate"``, ``"validation_data"``)."""
    y = source.y if isinstance(source, ArraySource) else source.peek()[1]
    if y is None:
        given = "x alone" if isinstance(source, ArraySource) else "batches of x alone"
        if isinstance(source, ArraySource) and isinstance(source.x, (list, tuple)) and \
                all(isinstance(v, (list, tuple)) for v in source.x):
            given += (" (a list of (x, y) tuples reads as a list of input arrays, as in Keras: pass batches as "
                      "an iterator or generator, e.g. iter(batches))")
        form = {"fit": "fit(x, y)", "evaluate": "evaluate(x, y)"}.get(what, "(x_val, y_val)")
        raise ValueError(f"{what} needs targets to compute the loss; received {given} (y is None). Pass {form}, "
                         "or an iterable that yields (x, y) or (x, y, sample_weight) batches.")


def is_array_tree(x: Any) -> bool:
    if isinstance(x, (np.ndarray, jax.Array)) or hasattr(x, "__array__") and not isinstance(x, Iterator):
        return not isinstance(x, (str, bytes)) and not _looks_iterable_dataset(x)
    if isinstance(x, Mapping):
        return all(is_array_tree(v) for v in x.values())
    if isinstance(x, (tuple, list)):
        return len(x) > 0 and (is_nested_numbers(x) or all(is_array_tree(v) for v in x))
    return False


def _looks_iterable_dataset(x: Any) -> bool:
    return type(x).__module__.startswith(("tensorflow", "torch.utils"))
