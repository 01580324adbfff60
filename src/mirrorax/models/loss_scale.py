"""Dynamic loss scaling for float16 training of optax-optimised models, as Keras's ``LossScaleOptimizer`` does it.

float16 keeps 10 bits of mantissa and no exponent below 2**-24: small gradients computed in float16 round to
zero. The loss is multiplied by a scale before differentiation (the model's adapter reads it from this
optimizer's state) and the gradients are divided by it again here, in float32. When any gradient is not
finite (the scale made one overflow), the step's update is dropped (the parameters and the inner
optimizer's state stay as they were) and the scale halves; after ``growth_steps`` finite steps in a row
it doubles. The defaults are Keras's (``initial_scale=2**15``, ``dynamic_growth_steps=2000``), so a model
trained under ``mixed_float16`` here and in Keras scales alike.

The scale is part of the optimizer's state, so checkpoints keep it and a resumed fit goes on with it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["LossScaleState", "dynamic_loss_scale", "is_loss_scaled", "loss_scale_of"]

PyTree = Any

INITIAL_SCALE = 2.0 ** 15
GROWTH_STEPS = 2000


class LossScaleState(NamedTuple):
    """The optimizer state of :func:`dynamic_loss_scale`: the scale, the finite steps since it last changed,
    and the wrapped optimizer's own state."""

    scale: Any  # float32[]
    good_steps: Any  # int32[]
    inner: PyTree


def dynamic_loss_scale(inner: Any, initial_scale: float = INITIAL_SCALE, growth_steps: int = GROWTH_STEPS) -> Any:
    """``inner`` (an optax ``GradientTransformation``) taking gradients of the loss times the scale its state
    holds (see the module's docstring).

    Args:
      inner: the optimizer the unscaled gradients go to.
      initial_scale: the first scale (a power of two keeps the unscaling exact).
      growth_steps: finite steps in a row after which the scale doubles.

    Returns:
      An optax ``GradientTransformation`` whose state is a :class:`LossScaleState` (:func:`is_loss_scaled` tells
      it: the Trainer does not wrap it again).

    Raises:
      ValueError: ``initial_scale`` not positive or ``growth_steps`` below 1.
    """
    import optax

    if not initial_scale > 0 or int(growth_steps) < 1:
        raise ValueError(f"dynamic_loss_scale needs initial_scale > 0 and growth_steps >= 1; received "
                         f"initial_scale={initial_scale!r}, growth_steps={growth_steps!r}.")

    def init(params: PyTree) -> LossScaleState:
        return LossScaleState(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32), inner.init(params))

    def update(grads: PyTree, state: LossScaleState, params: PyTree = None) -> tuple[PyTree, LossScaleState]:
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / state.scale).astype(g.dtype), grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)] or [jnp.bool_(True)]))
        # A step whose gradients overflowed changes nothing: its (garbage) update and inner state are dropped.
        safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, inner_state = inner.update(safe, state.inner, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), inner_state, state.inner)
        good = jnp.where(finite, state.good_steps + 1, 0).astype(jnp.int32)
        grow = good >= growth_steps
        scale = jnp.where(finite, jnp.where(grow, state.scale * 2, state.scale), state.scale / 2)
        return updates, LossScaleState(scale.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32),
                                       inner_state)

    return _loss_scaled(optax)(init, update)


def _loss_scaled(optax: Any) -> type:
    """The type of :func:`dynamic_loss_scale`'s transforms: an optax ``GradientTransformation`` (a subclass of
    its named tuple) that :func:`is_loss_scaled` knows, made once."""
    global _LOSS_SCALED
    if _LOSS_SCALED is None:
        _LOSS_SCALED = type("LossScaledTransformation", (optax.GradientTransformation,), {"__slots__": ()})
    return _LOSS_SCALED


_LOSS_SCALED: type | None = None


def is_loss_scaled(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a :func:`dynamic_loss_scale` transform already."""
    return _LOSS_SCALED is not None and isinstance(optimizer, _LOSS_SCALED)


def loss_scale_of(opt_state: PyTree) -> Any:
    """The scale a :func:`dynamic_loss_scale` state holds (``1.0`` for any other optimizer state)."""
    return opt_state.scale if isinstance(opt_state, LossScaleState) else 1.0
