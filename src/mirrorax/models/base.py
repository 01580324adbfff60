"""The adapter protocol: what the engine needs from a model, as pure functions over a state pytree.

The training state is a :class:`mirrorax.TrainState`: the model's groups ``params``, ``model_state``,
``optimizer`` and ``metrics`` (for Keras models dicts of arrays keyed by variable path, so a checkpoint
names what it holds), and the engine's counters (``step``, ``skipped``, ...). An adapter reads the groups
(``state.params``) and returns new values; the engine builds the next state.

``train(state, batch)`` must compute the loss as the (weighted) mean over the *real* rows of the global
batch (``batch["mask"]`` is 0 on padding) and update metric accumulators with the mask as weight, so
that the result does not depend on padding or on the device count.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import numpy as np

from mirrorax.train_state import TrainState

PyTree = Any

__all__ = ["ModelAdapter", "SparseTarget", "attach_strategy", "real_count", "strategy_of"]


class SparseTarget(NamedTuple):
    """A target of integer class labels (a sparse categorical cross-entropy), for checking its range.

    Attributes:
      name: how the user knows it (``"y"``, ``"y['cls']"``); labels: the labels (host or traced);
      classes: the model output's last axis; ignore_class: a label the loss skips (or ``None``);
      loss: the loss's name.
    """

    name: str
    labels: Any
    classes: int
    ignore_class: int | None
    loss: str


def real_count(batch: dict[str, PyTree]) -> Any:
    """Real examples in a global batch: the host's count when it sent one, else the sum of the mask."""
    import jax.numpy as jnp

    return batch["num_real"] if "num_real" in batch else jnp.sum(batch["mask"])


class ModelAdapter(abc.ABC):
    """Pure functions over a state pytree; one implementation per model kind."""

    #: True when the model has layers whose training output depends on the whole batch (BatchNorm).
    batch_dependent: bool = False

    #: The model's float type: float inputs are given to it in this type, and the loss's weights, mask
    #: and counts are cast to it (float64 models train in float64 throughout).
    float_dtype: Any = np.dtype(np.float32)

    def check_inputs(self, x: PyTree) -> None:
        """Refuses inputs whose shape the model cannot take (``ValueError`` naming both shapes)."""

    def needs_targets(self, what: str) -> bool:
        """Whether ``what`` (``"fit"``, ``"evaluate"``) needs targets to compute the model's loss (a
        Keras model whose losses are its own trains on inputs alone, as in Keras)."""
        return True

    def sparse_targets(self, y: PyTree, check_shapes: bool = False) -> list[SparseTarget]:
        """The targets in ``y`` that hold integer class labels, with their class counts (after
        :meth:`build`; host or traced arrays).

        Args:
          check_shapes: also refuse targets whose shapes do not fit the model's outputs under its loss
            (raises ``ValueError`` naming both shapes and the fix).
        """
        return []

    @abc.abstractmethod
    def initial_state(self) -> dict[str, PyTree]:
        """The model's current values (host or device arrays), the groups of a :class:`TrainState` the
        model owns: ``{"params": ..., "model_state": ..., "optimizer": ..., "metrics": ...}``."""

    @abc.abstractmethod
    def initial_metrics(self, previous: PyTree | None = None) -> PyTree:
        """Metric accumulators at their reset values; ``previous``: the accumulators being reset (a
        metric's own ``reset_state`` may keep some of what they hold)."""

    @abc.abstractmethod
    def grads(self, state: TrainState, batch: dict[str, PyTree], loss_scale: Any = 1.0
              ) -> tuple[PyTree, Any, PyTree, PyTree]:
        """Gradients of ``loss_scale * loss`` on a global batch, in training mode (traced, pure).

        Returns:
          ``(grads, loss, model_state, metrics)``: grads with the structure of ``state.params``, the
          unscaled loss (mean over the real rows), and the updated non-trainable state and metrics.
        """

    @abc.abstractmethod
    def apply_gradients(self, state: TrainState, grads: PyTree) -> tuple[PyTree, PyTree]:
        """One optimizer update: returns ``(params, optimizer_state)`` (traced, pure)."""

    @abc.abstractmethod
    def evaluate(self, state: TrainState, metrics: PyTree, batch: dict[str, PyTree]) -> PyTree:
        """Updates ``metrics`` with a batch in inference mode (traced, pure)."""

    @abc.abstractmethod
    def predict(self, state: TrainState, x: PyTree) -> PyTree:
        """The model's outputs in inference mode (traced, pure)."""

    def predict_with_state(self, state: TrainState, x: PyTree) -> tuple[PyTree, PyTree]:
        """The outputs and the ``model_state`` after the call: a layer's random stream advances in
        inference mode too (Keras's ``predict`` keeps it). Default: the state unchanged."""
        return self.predict(state, x), state.model_state

    @abc.abstractmethod
    def metric_results(self, metrics: PyTree) -> dict[str, float]:
        """Final metric values from host copies of the accumulators (``{"loss": ..., "accuracy": ...}``)."""

    def keep_metrics(self, metrics: PyTree) -> None:
        """Hands the host copies of finished accumulators to the model's own metric objects, where the
        model has any (Keras's fit and evaluate leave their totals there). Default: nothing."""

    def metric_logs(self, metrics: PyTree) -> dict[str, Any]:
        """Metric results as traced scalars, inside a step (batch logs for callbacks); ``{}`` if the
        adapter cannot compute them in a traced program."""
        return {}

    def write_back(self, state: TrainState) -> None:
        """Stores trained values into the user's model object.

        ``state`` is the device state. Either copy it to the host one variable at a time
        (``host_value``), so that writing back never holds a second copy of the whole state, or lend
        the model this process's copy of each array (no transfer, no new buffer) and take it back in
        :meth:`release`, before the trainer donates the state to the next train step.
        """

    @property
    def written_groups(self) -> tuple[str, ...]:
        """The state groups that :meth:`write_back` stores into the model."""
        return ("params", "model_state", "optimizer")

    def state_paths(self) -> dict[str, dict[str, str]]:
        """For each state group keyed by name (``"params"``, ``"model_state"``, ``"optimizer"``), each key's
        variable path as a layout map matches it (``"dense/kernel"``; an optimizer slot has its variable's
        path). ``{}``: no paths (a layout map then matches nothing)."""
        return {}

    def state_axes(self) -> dict[str, tuple[Any, ...]]:
        """The parameters' own sharding annotations (Flax's ``nnx.with_partitioning``): for each key of the
        ``params`` group, the mesh axes of each dimension; the optimizer's slots held under the same key
        follow them. ``{}``: none (the layout map and ``shard=`` decide)."""
        return {}

    def model_changed(self) -> bool:
        """Whether the model's values were replaced since they were lent (``set_weights``,
        ``load_weights``, Keras's own ``fit`` or ``evaluate``): the trainer then continues from them."""
        return False

    def model_values(self) -> dict[str, PyTree]:
        """The :attr:`written_groups` as the model holds them now (after :meth:`model_changed`)."""
        raise NotImplementedError

    def release(self) -> None:
        """Before a fit's first train step: the model lets go of the values it shares with the state."""

    def expose(self, state: TrainState) -> None:
        """Mid-epoch, before the batch callbacks: lets them read ``state`` through the model."""

    def exposure_read(self) -> bool:
        """After the batch callbacks: whether one read the exposed state (it is then lent to the model)."""
        return False

    def conceal(self) -> None:
        """At an epoch's end: withdraws what :meth:`expose` offered."""

    def build(self, sample: dict[str, PyTree]) -> None:
        """Creates every variable from a host sample batch, before :meth:`initial_state`."""


# A Keras model made or compiled under a strategy's scope carries its strategy here (not a tracked Keras
# attribute): its own fit, evaluate and predict run on it, and mx.plan plans on it.
_STRATEGY_ATTR = "_mirrorax_strategy"


def strategy_of(model: Any) -> Any:
    """The strategy ``model`` was created or compiled under (see :func:`attach_strategy`), or ``None``."""
    return model.__dict__.get(_STRATEGY_ATTR) if hasattr(model, "__dict__") else None


def attach_strategy(model: Any, strategy: Any) -> None:
    """Records that ``model`` belongs to ``strategy`` (``mirrorax.keras.fit``, under ``strategy.scope()``)."""
    object.__setattr__(model, _STRATEGY_ATTR, strategy)
