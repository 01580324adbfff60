"""The training state on the devices, and the model it is lent to.

A :class:`DeviceState` holds one :class:`~mirrorax.train_state.TrainState` laid out as the strategy says
(parameters and optimizer state split over the devices in the sharded modes, everything else replicated),
with process 0's values on every process. It builds the state from the model, lends it back to the model
(``write_back``: the user's model object shows the trained values) and adopts what was changed on the model
meanwhile (``set_weights`` between fits, a callback that changes the learning rate or swaps in EMA
weights): the model is the truth whenever it was changed.

While a train step runs, the state is donated to it: :attr:`DeviceState.value` is then ``None`` and the
loop that dispatched the step holds the state (see :mod:`mirrorax.fit.loop`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mirrorax.cluster import consistency
from mirrorax.fit.hooks import Callbacks
from mirrorax.inputs.batch import Batch
from mirrorax.models.base import ModelAdapter
from mirrorax.strategy import MirroredStrategy
from mirrorax.train_state import TrainState

__all__ = ["DeviceState", "SHARDED_GROUPS"]

PyTree = Any

#: The state groups the sharded modes split over the devices, and the role each has for the strategy.
SHARDED_GROUPS = {"params": "params", "optimizer": "optimizer"}


class DeviceState:
    """One model's training state on a strategy's devices.

    Args:
      adapter: the model's pure functions and the model object the state is lent to.
      strategy: the devices and layouts.

    Attributes:
      value: the state, or ``None`` before the first fit / evaluate / predict (and while a running
        train step holds it).
    """

    def __init__(self, adapter: ModelAdapter, strategy: MirroredStrategy) -> None:
        self.adapter = adapter
        self.strategy = strategy
        self.value: TrainState | None = None

    @property
    def live(self) -> TrainState:
        """The state, which fit, evaluate and predict build (:meth:`ensure`) before any step."""
        if self.value is None:
            raise RuntimeError("The trainer has no state yet: it is built by the first fit/evaluate/predict. "
                               "Call one of them first, or make the trainer with Trainer.load(checkpoint_dir, model).")
        return self.value

    # -- layout and placement ------------------------------------------------------------------------
    def layout(self, state: TrainState | dict[str, PyTree]) -> TrainState | dict[str, PyTree]:
        """Where each leaf of a state (arrays or shapes) lives: :meth:`MirroredStrategy.state_layout` for
        the model's and optimizer's variables (by their paths, for a layout map; by the parameters' own
        annotations, :meth:`ModelAdapter.state_axes`), replicated for the others (a dict of some groups: a
        dict)."""
        s = self.strategy
        groups = state.as_dict() if isinstance(state, TrainState) else state
        # A layout map lays out every variable by its path, BatchNorm's statistics too.
        paths = self.adapter.state_paths() if s.has_layout_map else {}
        axes = self.adapter.state_axes()  # the parameters' own annotations (Flax's), for them and their slots
        roles = {**SHARDED_GROUPS, "model_state": "model_state"}
        layouts = {k: s.state_layout(v, roles[k], paths.get(k), axes if k in SHARDED_GROUPS else None)
                   if k in roles else jax.tree.map(lambda _: s.replicated, v) for k, v in groups.items()}
        return TrainState(**layouts) if isinstance(state, TrainState) else layouts

    def place(self, tree: TrainState | dict[str, PyTree], *, from_host: bool = True) -> Any:
        """A state (or a dict of some of its groups) placed as :meth:`layout` says, of the type given.

        ``from_host``: the values come from this process's model (initial weights, weights set by the
        user), which may differ between processes: every replica then takes process 0's values.

        The model's device buffers are taken over, not copied (its variables let go of them before a
        step donates them, as Keras's own ``fit`` does): the state never lives twice on the devices.
        """
        return self.strategy.place(tree, self.layout(tree), broadcast=from_host, take=True)

    def fresh_metrics(self, previous: PyTree | None = None) -> PyTree:
        """The metric accumulators at their reset values, replicated (equal on every process by
        construction: no broadcast). ``previous``: the accumulators being reset. (Kept one array per metric
        variable, not packed into one vector per dtype: packed ran slower, see ``benchmarks/README.md``, "Why
        the code is as it is".)"""
        s = self.strategy
        return s.place(self.adapter.initial_metrics(previous), s.replicated, broadcast=False)

    def initial_host(self) -> TrainState:
        """The model's values plus the engine's counters at zero, on the host (built model required)."""
        return TrainState.create(**self.adapter.initial_state())

    def abstract(self, state: TrainState | None = None) -> TrainState:
        """``jax.ShapeDtypeStruct``s with shardings for ``state`` (default: the one held; if none is held,
        the model's initial values as :meth:`layout` places them), to restore into or to lower a step for."""
        if state is None:
            state = self.value
        if state is None:
            host = self.initial_host()
            return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=sh),
                                host, self.layout(host))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)

    def ensure(self, sample: Batch) -> None:
        """Builds the model for ``sample`` and the state from it, or adopts what changed on the model.

        Building is incremental: a predict-only start builds layers; targets later add metrics, whose
        accumulators are placed afresh for every epoch and evaluation anyway.
        """
        self.adapter.build(sample.tree())
        if self.value is not None:
            self.value = self.adopt_model_changes(self.value)
            return
        # Process 0's values on every process, laid out as the strategy says; the train steps return the
        # state in the layout it went in with.
        self.value = self.place(self.initial_host())
        # The state took the model's buffers over (place, take=True): the model's variables hold its arrays,
        # lent as write_back lends them. Another trainer of a model sharing these variables (a GAN's generator
        # inside the combined model) may take and donate them: the lent arrays then read as deleted, and this
        # state adopts the model's new values at its next call instead of running on deleted buffers.
        self.adapter.write_back(self.value)

    # -- lending to the model ------------------------------------------------------------------------
    def write_back(self) -> None:
        """Lends the state's values to the model object (nothing before the state exists)."""
        if self.value is not None:
            self.adapter.write_back(self.value)

    def adopt_model_changes(self, state: TrainState, *, model_has_values: bool = True) -> TrainState:
        """``state``, continuing from the model's values where they were replaced since they were lent
        (``set_weights`` between fits or in a callback, Keras's own ``fit``): the model is the truth.

        In a multi-process job every process must call this at the same point: they agree whether any
        model changed, and then every replica takes process 0's model values (a change made on another
        process only is overridden, never half-applied). ``model_has_values``: False mid-epoch when no
        callback of this process read the model (its variables then hold nothing; the state stands in).
        """
        changed = model_has_values and self.adapter.model_changed()
        if self.strategy.process_count > 1:
            changed = consistency.any_process(changed)
        if not changed:
            return state
        if not model_has_values:
            values = {g: getattr(state, g) for g in self.adapter.written_groups}
            return state.replace(**self.place(values))
        state = state.replace(**self.place(self.adapter.model_values()))
        # Lent again at once: a change made after this one (LearningRateScheduler at on_epoch_begin after
        # ReduceLROnPlateau at on_epoch_end) is a change of the lent values too, and is adopted in turn.
        self.adapter.write_back(state)
        return state

    def adopt_callback_changes(self) -> None:
        """After a hook that may change the lent model (``SwapEMAWeights`` at ``on_test_begin``): the state
        takes the model's values, and lends them back so that a later change is seen too."""
        self.value = self.adopt_model_changes(self.live)

    def batch_hook(self, hooks: Callbacks, name: str, index: int, logs: Any, state: TrainState, *,
                   exposed: TrainState | None = None) -> TrainState:
        """Calls batch hook ``name`` while ``state`` is the one held (a callback's evaluate / predict / state
        read it) and ``exposed`` (default ``state``) is what Keras callbacks read through ``Callback.model``.
        Returns ``state`` with what the callbacks changed on the model adopted."""
        self.adapter.expose(state if exposed is None else exposed)
        self.value = state
        hooks.call(name, index, logs)
        state = self.live
        read = self.adapter.exposure_read()
        if read or self.strategy.process_count > 1:  # the processes decide together
            state = self.adopt_model_changes(state, model_has_values=read)
        if read:
            self.adapter.release()
        return state
