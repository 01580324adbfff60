"""What a user passes as data (``x, y, sample_weight``, ``validation_data``, ``class_weight``), as a
:class:`~mirrorax.inputs.source.Source`: an :class:`ArraySource` for arrays, an :class:`IterableSource`
for any other iterable of batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from mirrorax.inputs.arrays import ArraySource
from mirrorax.inputs.checks import is_nested_numbers
from mirrorax.inputs.iterables import IterableSource
from mirrorax.inputs.source import Source

__all__ = ["make_source", "validation_source", "is_array_tree", "is_source", "class_weights"]


def make_source(x: Any, y: Any = None, sample_weight: Any = None, *, float_dtype: Any = np.float32,
                check_finite: bool = True, scan_in_background: bool = False, arrays: bool | None = None) -> Source:
    """An :class:`ArraySource` for arrays, an :class:`IterableSource` for any other iterable.

    Args:
      float_dtype: the model's float type (float32/float64 inputs become it).
      check_finite: refuse NaN/inf in arrays (fit and evaluate; predict passes False).
      scan_in_background: scan large arrays on a thread; the caller joins it (``ArraySource.wait_checked``).
      arrays: whether ``x`` holds arrays (:func:`is_array_tree`), when the caller has looked already;
        ``None``: looked at here.
    """
    if is_array_tree(x) if arrays is None else arrays:
        return ArraySource(x, y, sample_weight, float_dtype=float_dtype, check_finite=check_finite,
                           scan_in_background=scan_in_background)
    if y is not None or sample_weight is not None:
        raise ValueError("When x is an iterable of batches, y and sample_weight come from its items; "
                         f"received y of type {type(y).__name__} and sample_weight of type "
                         f"{type(sample_weight).__name__} too. Yield (x, y) or (x, y, sample_weight) instead.")
    if not isinstance(x, Iterable) or isinstance(x, (str, bytes)):
        raise TypeError(f"x must be an array, a tuple/list/dict of arrays, or an iterable of batches; "
                        f"received {x!r:.80} (of type {type(x).__name__}). Pass e.g. np.asarray(x).")
    return IterableSource(x, float_dtype=float_dtype)


def is_source(x: Any) -> bool:
    """Whether ``x`` is a source already (:func:`make_source`'s), not data."""
    return isinstance(x, (ArraySource, IterableSource))


def validation_source(validation_data: Any, *, float_dtype: Any = np.float32, check_finite: bool = True,
                      targets: bool = True, scan_in_background: bool = False) -> Source | None:
    """The source of ``fit``'s ``validation_data`` (``None`` for none), targets required unless the model
    needs none (``targets=False``: ``(x_val,)`` is accepted too, as Keras unpacks it).

    Raises:
      ValueError: not ``(x_val, y_val)``, ``(x_val, y_val, sample_weight_val)`` nor an iterable of
        ``(x, y)`` batches; no targets.
    """
    if validation_data is None:
        return None
    source: Source
    if isinstance(validation_data, list) and len(validation_data) in (2, 3) and \
            not isinstance(validation_data[0], (tuple, list)):
        validation_data = tuple(validation_data)  # as Keras reads [x_val, y_val]
    if isinstance(validation_data, tuple) and validation_data and is_array_tree(validation_data[0]):
        if len(validation_data) not in ((1, 2, 3) if not targets else (2, 3)):
            raise ValueError(
                f"validation_data must be (x_val, y_val), (x_val, y_val, sample_weight_val) or an iterable of "
                f"(x, y) batches; received a tuple of {len(validation_data)} element(s) (of types "
                f"{[type(v).__name__ for v in validation_data]}). Pass validation_data=(x_val, y_val).")
        source = ArraySource(*validation_data, float_dtype=float_dtype, check_finite=check_finite,
                             scan_in_background=scan_in_background)
    elif is_array_tree(validation_data):
        raise ValueError(f"validation_data must be (x_val, y_val), (x_val, y_val, sample_weight_val) or an "
                         f"iterable of (x, y) batches; received {type(validation_data).__name__} of inputs "
                         "alone. Pass validation_data=(x_val, y_val).")
    else:
        source = make_source(validation_data, float_dtype=float_dtype)
    if targets:
        source.require_targets("validation_data")
    return source


def is_array_tree(x: Any) -> bool:
    """Whether ``x`` is arrays (one, or a dict/list/tuple of them) as Keras's data adapters read it
    (``array_slicing.can_slice_array``): numpy, ``jax.Array``, a ``tf.Tensor`` (``tf.RaggedTensor`` and
    ``tf.SparseTensor`` too, refused later with the fix), pandas, anything with ``__array__``; also a
    nested list of numbers. Anything else (a ``tf.data.Dataset``, a ``PyDataset``, a generator, a
    ``DataLoader``) is an iterable of batches."""
    if _is_array(x):
        return True
    if isinstance(x, Mapping):
        return len(x) > 0 and all(is_array_tree(v) for v in x.values())
    if isinstance(x, (tuple, list)):
        return len(x) > 0 and (is_nested_numbers(x) or all(is_array_tree(v) for v in x))
    return False


def _is_array(x: Any) -> bool:
    """One array as Keras's data adapters take it (not a structure of them, not a string, not an iterator)."""
    if isinstance(x, (str, bytes, Iterator)):
        return False
    return isinstance(x, (np.ndarray, jax.Array)) or hasattr(x, "__array__") or _is_tf_tensor(x)


def _is_tf_tensor(x: Any) -> bool:
    # Keras's data_adapter_utils.is_tensorflow_tensor: a Tensor subclass, a RaggedTensor or a SparseTensor
    # of TensorFlow (the two composites have no __array__). Read from the class: TensorFlow is not imported.
    cls = type(x)
    if cls.__name__ in ("RaggedTensor", "SparseTensor"):
        return "tensorflow.python." in cls.__module__
    return any(c.__name__ == "Tensor" and "tensorflow.python." in c.__module__ for c in cls.__mro__)


def class_weights(y: Any, class_weight: Any, sample_weight: Any) -> np.ndarray:
    """Per-example weights from ``{class: weight}`` (Keras's rule: the label, or the argmax of one-hot)."""
    if sample_weight is not None:
        raise ValueError("Pass sample_weight or class_weight, not both (as Keras); received both: "
                         f"class_weight={class_weight!r:.80} and a sample_weight of type "
                         f"{type(sample_weight).__name__}. Multiply the class weights into sample_weight "
                         "yourself to use them together.")
    if not isinstance(class_weight, dict):
        raise TypeError(f"class_weight must be a dict {{class index: weight}}; received {class_weight!r:.80} "
                        f"(of type {type(class_weight).__name__}). Pass e.g. class_weight={{0: 1.0, 1: 5.0}}.")
    labels = np.asarray(y)
    if labels.ndim > 1 and labels.shape[-1] > 1:
        labels = labels.argmax(axis=-1)
    labels = labels.reshape(len(labels), -1)[:, 0].astype(np.int64)
    missing = sorted(set(np.unique(labels).tolist()) - set(int(k) for k in class_weight))
    if missing:
        raise ValueError(f"class_weight has no weight for class(es) {missing[:10]} found in y; received keys "
                         f"{sorted(class_weight)[:10]}. Give every class a weight.")
    table = {int(k): float(v) for k, v in class_weight.items()}
    return np.asarray([table[int(c)] for c in labels], np.float32)
