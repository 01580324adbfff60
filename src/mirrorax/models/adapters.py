"""Which adapter a model gets: a Keras 3 model, a :class:`mirrorax.FunctionalModel`, or a Flax NNX module
(the NNX wing's ``NnxModel``, imported only for one).

Above the adapters it chooses between (``base`` knows none of them).
"""

from __future__ import annotations

from typing import Any

from mirrorax.models.base import ModelAdapter
from mirrorax.models.functional import FunctionalModel

__all__ = ["adapt"]


def adapt(model: Any, *, loss: Any = None, optimizer: Any = None, metrics: Any = None,
          mixed_precision: str | None = None) -> ModelAdapter:
    """The adapter for ``model``: a Keras 3 model, a :class:`mirrorax.FunctionalModel` or a Flax NNX module
    (as :class:`mirrorax.nnx.NnxModel`).

    Raises:
      TypeError: ``model`` is of a kind mirrorax does not train.
    """
    if isinstance(model, ModelAdapter):
        return model
    if any(c.__module__.startswith("flax.nnx") and c.__name__ == "Module" for c in type(model).__mro__):
        from mirrorax.nnx.model import NnxModel  # the Flax NNX wing (flax is imported: model is its object)

        model = NnxModel(model, loss=loss, optimizer=optimizer, metrics=metrics or (), mixed_precision=mixed_precision)
        # the NnxModel's own now (an nnx.Optimizer read as its transform; the layers' dtype set)
        loss = optimizer = metrics = mixed_precision = None
    if isinstance(model, FunctionalModel):
        if mixed_precision is not None:
            raise ValueError(f"mixed_precision applies to Keras models and Flax NNX modules; received "
                             f"mixed_precision={mixed_precision!r} "
                             "with a FunctionalModel, which chooses its own compute dtype inside apply_fn. Drop "
                             "mixed_precision and cast params and inputs to bfloat16 in apply_fn.")
        return model.adapter(loss=loss, optimizer=optimizer, metrics=metrics)
    mod = type(model).__module__
    if mod.startswith("keras") or any(c.__module__.startswith("keras") for c in type(model).__mro__):
        from mirrorax.keras.adapter import KerasAdapter

        return KerasAdapter(model, loss=loss, optimizer=optimizer, metrics=metrics, mixed_precision=mixed_precision)
    raise TypeError(f"Trainer takes a Keras 3 model, a Flax NNX module or a mirrorax.FunctionalModel; received "
                    f"{model!r} (of type {type(model).__name__}). Wrap plain JAX code as FunctionalModel(apply_fn, "
                    "params, ...).")
