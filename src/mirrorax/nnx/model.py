"""A Flax NNX model for ``mx.Trainer``: its variables as the engine's state, written back into the model.

``mx.Trainer(model, loss=..., optimizer=...)`` with an ``nnx.Module`` trains it as a
:class:`mirrorax.FunctionalModel` whose parameters are the module's ``nnx.Param`` variables and whose
``model_state`` is everything else it holds (BatchNorm statistics, the ``Rngs`` streams of Dropout), each
a flat dict keyed by the variable's path (``"conv/kernel"``: what a checkpoint names and a layout map
matches). Inside the step the module is merged from them (``nnx.merge``), put in training or inference
mode (``train()`` / ``eval()``), called, and its new state split off; after ``fit`` the trained values are
written into the caller's module (``nnx.update``), so ``model(x)`` and ``nnx.state(model)`` read them.
So the Trainer's whole engine applies: checkpoints and exact resume, preemption, ``shard=``, ``mx.plan``,
gradient accumulation, ``on_nonfinite``.

The optimizer is an optax transform, or an ``nnx.Optimizer`` whose transform (``.tx``) is used: the
Trainer keeps the optimizer's state itself (it is in the checkpoints), and does not write it into the
``nnx.Optimizer``.

Mixed precision is Flax's own: a layer computes in its ``dtype`` and keeps its variables in its
``param_dtype`` (float32 by default). ``mx.Trainer(module, mixed_precision="bfloat16")`` sets the ``dtype`` of
every layer that has one to ``bfloat16`` (as if each had been written ``dtype=jnp.bfloat16``), so the
parameters, their gradients and the optimizer's state stay float32 (the master weights). Whatever computes
the module, its floating outputs are cast to the parameters' type before the loss and the metrics, as
Keras's output layers stay float32 under its ``mixed_bfloat16`` policy. ``"float16"`` sets the layers'
``dtype`` the same way and scales the loss dynamically, as Keras's ``LossScaleOptimizer`` does under
``mixed_float16`` (:mod:`mirrorax.models.loss_scale`: the optimizer is wrapped, the scale is in its state
and so in the checkpoints; a step whose gradients overflow is dropped and halves the scale).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrorax.front_end import FrontEnd
from mirrorax.models.functional import FunctionalModel
from mirrorax.models.loss_scale import dynamic_loss_scale, is_loss_scaled
from mirrorax.nnx.split_merge import partition_axes

__all__ = ["MIXED_PRECISION", "NNX_FRONT_END", "NnxModel", "set_compute_dtype"]

PyTree = Any

MIXED_PRECISION = ("bfloat16", "float16")
"""What ``mx.Trainer(module, mixed_precision=...)`` takes for an NNX module."""


def set_compute_dtype(module: Any, dtype: Any) -> list[str]:
    """Sets the compute ``dtype`` of every layer of ``module`` that has one (Flax layers: a ``dtype`` beside a
    ``param_dtype``), leaving ``param_dtype`` as it is; returns the layers' paths (``""``: the module)."""
    changed = []
    for path, layer in nnx.iter_modules(module):
        if hasattr(layer, "dtype") and hasattr(layer, "param_dtype"):
            layer.dtype = dtype
            changed.append("/".join(str(k) for k in path))
    return changed


def _check_settings(module: Any, loss: Any, optimizer: Any, mixed_precision: Any) -> None:
    missing = [name for name, value in (("loss", loss), ("optimizer", optimizer)) if value is None]
    if missing:
        raise ValueError(f"An NNX module carries no {' and no '.join(missing)}; received {type(module).__name__} with "
                         f"{', '.join(f'{m}=None' for m in missing)}. Pass them to the Trainer: mx.Trainer(module, "
                         "loss='sparse_categorical_crossentropy_from_logits', optimizer=optax.adam(1e-3)) (or an "
                         "nnx.Optimizer), and plan on that trainer: mx.plan(trainer, x, y, batch_size=...).")
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision for an NNX module must be one of {MIXED_PRECISION} or None; received "
                         f"{mixed_precision!r}. Use mixed_precision='bfloat16' (float32 parameters, bfloat16 "
                         "compute; 'float16' adds dynamic loss scaling), or set the layers' dtype= yourself.")


def _to_float(y: Any, dtype: Any) -> Any:
    """Floating outputs narrower than ``dtype`` (a bfloat16 layer's) cast to it, for the loss and metrics."""
    def up(a: Any) -> Any:
        dt = getattr(a, "dtype", None)
        if dt is not None and jnp.issubdtype(dt, jnp.floating) and np.dtype(dt).itemsize < np.dtype(dtype).itemsize:
            return a.astype(dtype)
        return a

    return jax.tree.map(up, y)


def _split(module: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, params, rest)``: the module's ``nnx.Param`` variables and everything else it holds."""
    parts: tuple[Any, ...] = nnx.split(module, nnx.Param, ...)
    return parts[0], parts[1], parts[2]


def _key(path: tuple[Any, ...]) -> str:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)


def _is_prng_key(a: Any) -> bool:
    dtype = getattr(a, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


class _Flat:
    """One ``nnx.State`` as a flat dict of arrays keyed by path, and back (typed PRNG keys as their data)."""

    def __init__(self, state: Any) -> None:
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.keys = [_key(p) for p, _ in flat]
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"Two variables of the NNX model share a path: {sorted(self.keys)}.")
        self.impls = [jax.random.key_impl(a) if _is_prng_key(a) else None for _, a in flat]

    def to_dict(self, state: Any) -> dict[str, Any]:
        leaves = self.treedef.flatten_up_to(state)  # type: ignore[attr-defined]  # jaxlib has no PyTreeDef stub
        return {k: jax.random.key_data(a) if impl is not None else a
                for k, a, impl in zip(self.keys, leaves, self.impls)}

    def to_state(self, values: dict[str, Any]) -> Any:
        leaves = [jax.random.wrap_key_data(values[k], impl=impl) if impl is not None else values[k]
                  for k, impl in zip(self.keys, self.impls)]
        return jax.tree.unflatten(self.treedef, leaves)


class NnxModel(FunctionalModel):
    """An ``nnx.Module`` as a :class:`mirrorax.FunctionalModel` (see the module's docstring); made by
    ``mx.Trainer(module, ...)``, which passes its ``loss``, ``optimizer`` and ``metrics`` here.

    Args:
      module: the ``nnx.Module``: its ``nnx.Param`` variables are trained, its other variables are the
        model state; trained values are written back into it.
      loss, metrics: as :class:`mirrorax.FunctionalModel` takes them (the model's outputs are ``y_pred``).
      optimizer: an optax ``GradientTransformation``, or an ``nnx.Optimizer`` (its ``tx``).
      mixed_precision: ``"bfloat16"``: every layer with a ``dtype`` computes in bfloat16 (set on ``module``),
        its parameters stay in their ``param_dtype``; ``"float16"``: the same in float16, with the loss
        scaled dynamically (the optimizer wrapped in :func:`mirrorax.models.loss_scale.dynamic_loss_scale`);
        ``None``: the layers as they are.

    Raises:
      ValueError: no loss or no optimizer, or a ``mixed_precision`` other than ``"bfloat16"`` / ``"float16"``.
    """

    def __init__(self, module: Any, *, loss: Any, optimizer: Any, metrics: Any = (),
                 mixed_precision: str | None = None) -> None:
        _check_settings(module, loss, optimizer, mixed_precision)
        if isinstance(optimizer, nnx.Optimizer):
            optimizer = optimizer.tx
        if mixed_precision is not None:
            set_compute_dtype(module, jnp.dtype(mixed_precision))
        if mixed_precision == "float16" and not is_loss_scaled(optimizer):
            optimizer = dynamic_loss_scale(optimizer)  # float16's narrow exponent: small gradients underflow
        graphdef, params, rest = _split(module)
        floats = [a.dtype for a in jax.tree.leaves(params) if jnp.issubdtype(a.dtype, jnp.floating)]
        out_dtype = jnp.result_type(jnp.float32, *floats)
        self.module = module
        self._graphdef = graphdef
        self._params, self._rest = _Flat(params), _Flat(rest)

        def apply(params: dict[str, Any], model_state: dict[str, Any] | None, x: Any, training: bool) -> Any:
            merged = nnx.merge(graphdef, self._params.to_state(params), self._rest.to_state(model_state or {}))
            if training:
                merged.train()
            else:
                merged.eval()
            y = _to_float(merged(x), out_dtype)
            new = _split(merged)[2]
            return y, self._rest.to_dict(new)

        # FunctionalModel's fields, but params and model_state are the module's own (the properties below):
        # its __init__ would store host copies of them, and so write numpy arrays into the module.
        self.apply_fn = apply
        self.loss, self.optimizer, self.metrics = loss, optimizer, metrics

    def state_axes(self) -> dict[str, tuple[Any, ...]]:
        """Each annotated parameter's mesh axes (Flax's ``nnx.with_partitioning``), by key."""
        specs = partition_axes(nnx.state(self.module, nnx.Param))
        return {k: spec for k, spec in zip(self._params.keys, specs) if any(a is not None for a in spec)}

    # The parameters and the model state are the module's own: read from it, and written into it (the
    # Trainer's write_back sets them after fit).
    @property  # type: ignore[override]
    def params(self) -> dict[str, Any]:
        return self._params.to_dict(nnx.state(self.module, nnx.Param))

    @params.setter
    def params(self, values: dict[str, Any]) -> None:
        nnx.update(self.module, self._params.to_state(dict(values)))

    @property  # type: ignore[override]
    def model_state(self) -> dict[str, Any]:
        return self._rest.to_dict(_split(self.module)[2])

    @model_state.setter
    def model_state(self, values: dict[str, Any] | None) -> None:
        if values is not None:
            nnx.update(self.module, self._rest.to_state(dict(values)))


def _claims(model: Any) -> bool:
    return isinstance(model, nnx.Module)


def _adapter(model: Any, *, loss: Any = None, optimizer: Any = None, metrics: Any = None,
             mixed_precision: str | None = None) -> Any:
    # the NnxModel's own settings (an nnx.Optimizer read as its transform; the layers' dtype set)
    return NnxModel(model, loss=loss, optimizer=optimizer, metrics=metrics or (),
                    mixed_precision=mixed_precision).adapter()


#: A Flax NNX module, as the engine trains it (``mx.Trainer(module, ...)``); its callbacks are plain objects.
NNX_FRONT_END = FrontEnd(name="flax.nnx", claims=_claims, adapter=_adapter)
