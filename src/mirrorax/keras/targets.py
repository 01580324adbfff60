"""Keras targets against a model's outputs: shapes that a loss cannot compare, integer-label targets.

Checked on the host from the output shapes Keras infers symbolically (nothing runs or compiles), so a
target of the wrong kind for its loss gets a message with both shapes and the fix instead of a JAX
shape error from inside the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from mirrorax.keras import _internals as internals

__all__ = ["output_spec", "loss_entries", "resolve", "check_target_shape", "fits", "same_rank", "shape_text"]


def output_spec(model: Any, x: Any, keras: Any) -> Any:
    """The model's output shapes (batch axis ``None``) for inputs like ``x``, without running it."""
    try:
        spec = jax.tree.map(lambda a: keras.KerasTensor((None,) + tuple(np.shape(a)[1:]), dtype=str(a.dtype)), x)
        return model.compute_output_spec(spec)
    except Exception:  # noqa: BLE001 - a model Keras cannot trace symbolically: no target checks
        return None


class _LossEntry(NamedTuple):
    path: tuple[Any, ...]
    loss: Any
    name: str


def loss_entries(model: Any, output_spec: Any, keras: Any) -> list[Any]:
    """The compiled losses with the output each applies to: Keras's own list once it is built, else (a
    single output whose build just failed) the one compiled loss."""
    cl = internals.compile_loss(model)
    if cl is None:
        return []
    if getattr(cl, "built", False):
        return list(internals.flat_losses(cl))
    user = internals.user_loss(cl)
    if user is None or isinstance(user, (dict, list, tuple)) or isinstance(output_spec, (dict, list, tuple)):
        return []
    if isinstance(user, str) and user.lower() in ("crossentropy", "ce"):
        return []  # Keras picks the loss from the targets it first sees: nothing to check before that
    loss = keras.losses.get(user) if isinstance(user, str) else user
    name = user if isinstance(user, str) else getattr(loss, "name", getattr(loss, "__name__", "loss"))
    if not isinstance(loss, keras.losses.Loss):
        # As Keras's compile wraps a loss function: the wrapper aligns the ranks of targets and outputs.
        loss = internals.loss_function_wrapper(loss, name)
    return [_LossEntry((), loss, name)]


def resolve(path: Sequence[Any], tree: Any) -> Any:
    for p in path:
        tree = tree[p]
    return tree


_ONE_HOT_LOSSES = ("categorical_crossentropy", "categorical_focal_crossentropy", "kl_divergence")


def shape_text(shape: Sequence[Any]) -> str:
    dims = ["n"] + [str(d) for d in shape[1:]]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def check_target_shape(name: str, y_t: Any, y_p: Any, entry: Any, fn: Any, keras: Any) -> None:
    """Refuses targets whose shape cannot meet the output's under the loss, with the fix.

    Integer labels against a one-hot loss (and one-hot targets against a sparse one) get their own
    advice; any other pairing is tried on abstract shapes (``jax.eval_shape``: nothing runs), so exactly
    what the loss itself would refuse is refused, before anything is compiled.
    """
    t, p = tuple(y_t.shape[1:]), tuple(y_p.shape[1:])
    classes = p[-1] if p else None
    what = f"{name} has shape {shape_text(y_t.shape)} but the model's output{_output_name(entry)} has shape " \
           f"{shape_text(y_p.shape)}"
    fn_name = getattr(fn, "__name__", "")
    if fn is keras.losses.sparse_categorical_crossentropy:
        if fits(t, p[:-1]) or fits(t, p[:-1] + (1,)):
            return
        if fits(t, p) and classes != 1:
            raise ValueError(f"{what}: those look like one-hot targets, but the loss {entry.name} takes integer "
                             f"class labels of shape {shape_text(y_p.shape[:-1])}. Use "
                             f"loss='categorical_crossentropy', or pass {name.split('[')[0]}.argmax(-1).")
        raise ValueError(f"{what}; the loss {entry.name} takes integer class labels of shape "
                         f"{shape_text(y_p.shape[:-1])} (one label per output row).")
    if fn_name in _ONE_HOT_LOSSES:
        if fits(*same_rank(t, p)):
            return
        if (fits(t, p[:-1]) or fits(t, p[:-1] + (1,))) and classes != 1:
            raise ValueError(f"{what}: those look like integer class labels, but the loss {entry.name} takes "
                             f"one-hot targets of the output's shape. Use loss='sparse_categorical_crossentropy', "
                             f"or one-hot encode: keras.utils.to_categorical({name.split('[')[0]}, {classes}).")
        raise ValueError(f"{what}; the loss {entry.name} takes targets of the output's shape "
                         f"{shape_text(y_p.shape)}. Give the output layer {t[-1] if t else 1} units or fix the "
                         "targets.")
    if any(d is None for d in p):
        return  # a variable-length output: only the loss itself can tell
    rows = 2
    t_spec = jax.ShapeDtypeStruct((rows,) + t, y_t.dtype)
    p_spec = jax.ShapeDtypeStruct((rows,) + p, y_p.dtype)
    try:
        jax.eval_shape(lambda a, b: entry.loss(a, b), t_spec, p_spec)
    except Exception as e:  # noqa: BLE001 - whatever the loss refuses, said with the shapes and the fix
        raise ValueError(f"{what}, and the loss {entry.name} cannot compare them ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}). Give the targets the output's shape "
                         f"{shape_text(y_p.shape)}, or change the output layer to fit the targets.") from None


def _output_name(entry: Any) -> str:
    return f" {entry.path[-1]!r}" if entry.path else ""


def same_rank(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Two per-example shapes as Keras's losses align them (``squeeze_or_expand_to_same_rank``): where
    the ranks differ by one and the longer ends in 1, that axis is dropped (or, against a scalar per
    example, added to the other)."""
    if len(a) == len(b) + 1 and a[-1:] == (1,):
        return (a, b + (1,)) if not b else (a[:-1], b)
    if len(b) == len(a) + 1 and b[-1:] == (1,):
        return (a + (1,), b) if not a else (a, b[:-1])
    return a, b


def fits(target: tuple[Any, ...], output: tuple[Any, ...]) -> bool:
    return len(target) == len(output) and all(o is None or t == o for t, o in zip(target, output))
