"""Which adapter a model gets: its front-end's (:func:`mirrorax.front_end.of`: a Keras 3 model, a Flax NNX
module, a third party's kind), or a :class:`mirrorax.FunctionalModel`'s own.

Above the adapters it chooses between (``base`` knows none of them); it imports no front-end's wing.
"""

from __future__ import annotations

from typing import Any

from mirrorax import front_end
from mirrorax.models.base import ModelAdapter
from mirrorax.models.functional import FunctionalModel

__all__ = ["adapt"]


def adapt(model: Any, *, loss: Any = None, optimizer: Any = None, metrics: Any = None,
          mixed_precision: str | None = None) -> ModelAdapter:
    """The adapter for ``model``: a registered front-end's model (Keras 3, Flax NNX) or a
    :class:`mirrorax.FunctionalModel`.

    Raises:
      TypeError: ``model`` is of a kind mirrorax does not train.
    """
    if isinstance(model, ModelAdapter):
        return model
    if isinstance(model, FunctionalModel):
        if mixed_precision is not None:
            raise ValueError(f"mixed_precision applies to Keras models and Flax NNX modules; received "
                             f"mixed_precision={mixed_precision!r} "
                             "with a FunctionalModel, which chooses its own compute dtype inside apply_fn. Drop "
                             "mixed_precision and cast params and inputs to bfloat16 in apply_fn.")
        return model.adapter(loss=loss, optimizer=optimizer, metrics=metrics)
    kind = front_end.of(model)
    if kind is not None:
        adapter: ModelAdapter = kind.adapter(model, loss=loss, optimizer=optimizer, metrics=metrics,
                                             mixed_precision=mixed_precision)
        return adapter
    raise TypeError(f"Trainer takes a Keras 3 model, a Flax NNX module or a mirrorax.FunctionalModel; received "
                    f"{model!r} (of type {type(model).__name__}). Wrap plain JAX code as FunctionalModel(apply_fn, "
                    "params, ...).")
