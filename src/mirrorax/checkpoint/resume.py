"""What ``fit`` keeps beside its state in either tier (a checkpoint, a snapshot), and how it resumes from it.

``meta`` holds the data position (epoch, batch within the epoch: global batches, so it means the same
examples on any device count), the run's data settings, the history so far, and the shapes of one
input row (``sample_spec``) so that ``Trainer.load`` can rebuild a model's variables without data.

For an input that can save its own position, ``meta["input_state"]`` also holds that position
(:class:`mirrorax.inputs.position.InputState`), so a resumed epoch continues the input where it stopped.
It is JSON (never pickled): a checkpoint is data, and reading one runs no code from it.

``meta["run"]["hyperparameters"]`` holds the optimizer's learning rate as *configured* when the run
started (before any callback changed it). On resume the checkpoint's value is used (it may hold a
schedule callback's change), unless this run configured another value than the checkpoint's run did:
then the user changed it on purpose, and the new value is used, with a warning either way.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from mirrorax._host import host_value
from mirrorax._version import __version__
from mirrorax.checkpoint.errors import CheckpointError, CheckpointWarning
from mirrorax.checkpoint.record import position_wrong
from mirrorax.inputs.batch import Batch
from mirrorax.inputs.position import InputState, UnsafeInputState, check_loadable
from mirrorax.integrity import path_str
from mirrorax.train_state import TrainState

__all__ = ["Record", "Resumed", "resume", "accept", "sample_spec", "sample_from_spec", "hyperparameters"]

_HYPERPARAMETERS = ("learning_rate",)  # scalar optimizer variables a user sets, by the end of their path

PyTree = Any


class Resumed(NamedTuple):
    """Where a resumed fit starts: the state, the data position, the input's own saved state, and the data
    order's (a snapshot's: what Keras's order draws the resumed pass from)."""

    state: TrainState
    epoch: int
    batch_in_epoch: int
    step: int
    input_state: dict[str, Any] | None
    order_state: dict[str, Any] | None = None


def resume(ckpt: Any, abstract_state: Any, run: dict[str, Any], history: Any) -> Resumed | None:
    """Restores the newest good checkpoint of ``ckpt`` (a :class:`mirrorax.Checkpointer`) if there is one, its
    record verified (:func:`~mirrorax.checkpoint.record.position_wrong`: one that does not say consistently where it
    stopped is damaged, skipped), and accepts it (:func:`accept`)."""
    restored = ckpt.restore_latest(abstract_state, verify=position_wrong)
    if restored is None:
        return None
    step, state, meta = restored
    return accept(step, state, meta, f"Checkpoint step {step} in {ckpt.directory}", run, history)


def accept(step: int, state: TrainState, meta: dict[str, Any], where: str, run: dict[str, Any], history: Any
           ) -> Resumed:
    """A verified record of either tier (``where``: its words, ``"Checkpoint step 40 in ..."``) as a
    :class:`Resumed`, its history restored into ``history``.

    Refuses (``CheckpointError``) a record of a run whose global batch, shuffle, seed or steps_per_epoch
    differ (those decide which examples each step sees), one of an older mirrorax without the run's settings,
    and an input state that cannot be loaded safely.
    """
    saved = meta.get("run")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{where} was written by an older mirrorax (version {meta.get('mirrorax_version', 'unknown')}; its "
            "meta record has no run settings: batch size, shuffle, seed). This mirrorax cannot tell where "
            "in the data it stopped. Resume with the mirrorax that wrote it, or start fresh in a new "
            "checkpoint_dir (Trainer.load still reads its weights).")
    input_state = meta.get("input_state")
    if isinstance(input_state, dict):
        try:
            check_loadable(input_state)
        except UnsafeInputState as exc:
            raise CheckpointError(f"{where} cannot be resumed safely: {exc}.") from None
    if saved.get("batch_size") != run["batch_size"]:
        raise CheckpointError(
            f"{where} was written with global batch_size={saved.get('batch_size')}; this run asks for "
            f"batch_size={run['batch_size']}. Resuming with another global batch would change the result: pass "
            "the same batch_size (any device count works), or a fresh checkpoint_dir.")
    for key in ("shuffle", "seed", "steps_per_epoch"):
        if saved.get(key) != run[key]:
            raise CheckpointError(
                f"{where} was written with {key}={saved.get(key)!r}; this run asks for {key}={run[key]!r}, which "
                "would change the data order. Pass the same value, or a fresh checkpoint_dir.")
    state = _reconcile_hyperparameters(state, run.get("hyperparameters") or {}, saved.get("hyperparameters"), where)
    history.restore(meta.get("history", {}))
    order = meta.get("order_state")
    return Resumed(state, int(meta["epoch"]), int(meta["batch_in_epoch"]), int(step), input_state,
                   order if isinstance(order, dict) else None)


def hyperparameters(state: TrainState | None) -> dict[str, float]:
    """The optimizer's scalar hyperparameters held in ``state`` (a Keras optimizer's learning rate),
    by variable path."""
    if state is None:
        return {}
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.optimizer)[0]:
        name = path_str(path)
        if name.rsplit("/", 1)[-1] in _HYPERPARAMETERS and getattr(leaf, "shape", None) == () and \
                np.issubdtype(leaf.dtype, np.floating):
            out[name] = float(host_value(leaf))
    return out


def _reconcile_hyperparameters(state: TrainState, configured: dict[str, float], saved: dict[str, float] | None,
                               where: str) -> TrainState:
    """The restored state with each hyperparameter the user changed since the checkpoint's run started
    (``configured`` differs from ``saved``) set to the new value; the checkpoint's value otherwise."""
    held = hyperparameters(state)
    replace: dict[str, float] = {}
    for path, new in configured.items():
        if path not in held:
            continue
        name = path.rsplit("/", 1)[-1]
        old = held[path]
        if saved is not None and path in saved:
            if np.float32(saved[path]) != np.float32(new):
                replace[path] = new
                _say(f"{where}: the optimizer's {name} is {new:g} in this run and was {saved[path]:g} when the "
                     f"checkpoint's run started: this run uses {new:g} (the checkpoint held {old:g}).")
        elif np.float32(old) != np.float32(new):
            _say(f"{where}: the optimizer's {name} is {new:g} in this run but {old:g} in the checkpoint, "
                 f"which does not record its run's configured value (an older mirrorax): resuming with the "
                 f"checkpoint's {old:g}. To use another value, set it in a callback's on_train_begin.")
    if not replace:
        return state

    def put(path: Any, leaf: Any) -> Any:
        value = replace.get(path_str(path))
        return leaf if value is None else jax.device_put(np.asarray(value, leaf.dtype), leaf.sharding)

    return state.replace(optimizer=jax.tree_util.tree_map_with_path(put, state.optimizer))


def _say(message: str) -> None:
    if jax.process_index() == 0:
        warnings.warn(message, CheckpointWarning, stacklevel=4)


class Record:
    """The record a fit keeps beside its state in both tiers (a checkpoint's ``meta``, a snapshot's): where in
    the data (``step``, ``epoch``, ``batch_in_epoch``: global batches, and the input's own position), the run's
    settings, the history so far, one input row's shapes, the mirrorax that wrote it.

    Args:
      run: the run's settings a resume must find the same (global batch, shuffle, seed, steps per epoch; the
        optimizer's hyperparameters as configured).
      history: the fit's :class:`mirrorax.History`.
      spec: :func:`sample_spec` of the fit's input.
      inputs: the input's own position (``None``: found by index, or replayed).
    """

    def __init__(self, run: dict[str, Any], history: Any, spec: dict[str, Any], inputs: InputState | None = None
                 ) -> None:
        self.run, self.history, self.spec, self.inputs = run, history, spec, inputs

    def meta(self, step: int, epoch: int, batch_in_epoch: int, order: dict[str, Any] | None = None) -> dict[str, Any]:
        """The record of ``step``, at batch ``batch_in_epoch`` of ``epoch``; ``order``: the data order's state (a
        snapshot keeps it, for Keras's order)."""
        meta = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "run": self.run,
                "history": self.history.as_dict(), "sample_spec": self.spec, "mirrorax_version": __version__}
        if batch_in_epoch and self.inputs is not None:
            position = self.inputs.state_at(batch_in_epoch)
            if position is not None:
                meta["input_state"] = position
        if order is not None:
            meta["order_state"] = order
        return meta


def sample_spec(sample: Batch) -> dict[str, Any]:
    """Shapes and dtypes of one row of x and y: enough to rebuild the model's variables for loading."""
    def spec(t: Any) -> Any:
        return None if t is None else jax.tree.map(lambda a: [list(a.shape[1:]), str(a.dtype)], t)

    return {"x": spec(sample.x), "y": spec(sample.y)}


def sample_from_spec(spec: dict[str, Any]) -> Batch:
    """Zeros shaped as :func:`_sample_spec` recorded (two rows), to rebuild a model's variables."""
    def zeros(t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, list) and len(t) == 2 and isinstance(t[1], str):
            return np.zeros([2, *t[0]], t[1])
        if isinstance(t, dict):
            return {k: zeros(v) for k, v in t.items()}
        return type(t)(zeros(v) for v in t)

    return Batch(zeros(spec["x"]), zeros(spec["y"]), np.ones(2, np.float32), np.ones(2, np.float32))
