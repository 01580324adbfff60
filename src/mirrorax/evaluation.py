"""``Trainer.evaluate`` / ``predict`` and Keras's one-batch calls (``train_on_batch``, ``test_on_batch``).

Each is a loop over the strategy's steps like an epoch of ``fit`` (batches placed ahead, at most
``max_in_flight`` steps outstanding, values read on the host only when needed), written against the
trainer's state-keeping methods (its state, the model it lends values to, the callbacks' changes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrorax._checks import check_int
from mirrorax.hooks import Callbacks
from mirrorax.inputs.arrays import ArraySource
from mirrorax.inputs.make import class_weights, is_array_tree, make_source
from mirrorax.inputs.placement import to_global
from mirrorax.inputs.prefetch import Prefetcher
from mirrorax.inputs.source import Source
from mirrorax.inputs.streams import within_pass
from mirrorax.progress import resolve_verbose
from mirrorax.results import NonFiniteLossError
from mirrorax.step import InFlight, host_tree, host_value

if TYPE_CHECKING:
    from mirrorax.trainer import Trainer

__all__ = ["evaluate", "evaluate_source", "predict", "train_on_batch", "test_on_batch"]


def evaluate(trainer: Trainer, x: Any, y: Any = None, *, batch_size: int | None = None, sample_weight: Any = None,
             verbose: int | str = 0, steps: int | None = None, callbacks: Any = None) -> dict[str, float]:
    """:meth:`Trainer.evaluate`."""
    source = make_source(x, y, sample_weight, float_dtype=trainer.adapter.float_dtype,
                         check_finite=trainer._refuse_nonfinite)
    if trainer.adapter.needs_targets("evaluate"):
        source.require_targets("evaluate")
    batch_size = trainer._batch_size(source, batch_size)
    if steps is not None:
        check_int("steps", steps)
    hooks = Callbacks(callbacks, trainer.model, epochs=1, steps=steps, verbose=0) if callbacks is not None else None
    logs = evaluate_source(trainer, source, batch_size, steps=steps, hooks=hooks)
    if trainer.strategy.is_primary and resolve_verbose(verbose, trainer.stream):
        from mirrorax.progress import format_logs

        trainer.stream.write(f"evaluate - {format_logs(logs)}\n")
    return logs


def evaluate_source(trainer: Trainer, source: Source, batch_size: int, *, steps: int | None = None,
                    hooks: Callbacks | None = None) -> dict[str, float]:
    """Loss and metrics over ``source`` (at most ``steps`` batches, within one pass); ``hooks`` get
    Keras's ``on_test_*`` calls (``fit`` passes its own for validation)."""
    trainer._ensure_state(source.sample(batch_size, trainer.strategy.batch_mesh))
    source.check_targets(trainer.adapter)
    metrics = trainer._place(trainer.adapter.initial_metrics(), from_host=False)
    stream = source.stream(batch_size, trainer.strategy.batch_mesh)
    window, watch = InFlight(trainer.max_in_flight), trainer.steps.eval_watch()
    within = within_pass(stream, steps, warn=trainer._epochs_end_with_data)
    batches = trainer._device_batches(stream.batches(0, within), 1, stream.per_process)
    begin = hooks is not None and hooks.listens["test_begin"]
    end = hooks is not None and hooks.listens["test_end"]
    if hooks is not None:
        trainer.model.stop_evaluating = False  # as Keras: a test-batch callback may set it to stop early
        hooks.call("on_test_begin")
        trainer._adopt_callback_changes()

    def batch_end(index: int, logs: Any) -> None:
        assert hooks is not None
        trainer._state = trainer._batch_hook(hooks, "on_test_batch_end", index, logs, trainer._live_state,
                                       exposed=trainer._live_state.replace(metrics=metrics))

    # As Keras's evaluate: the model's variables hold nothing while the loop runs (the metrics'
    # totals are the loop's own); they are lent the values again at the end.
    trainer.adapter.release()
    try:
        spe, i, aux = trainer.steps_per_execution, -1, None  # batch hooks once per execution, as Keras
        for i, (_, batch) in enumerate(batches):
            if begin and hooks is not None and i % spe == 0:
                hooks.call("on_test_batch_begin", i)
            metrics, aux = trainer.steps.evaluate(trainer._live_state, metrics, batch.tree())
            window.push(aux["token"], on_done=watch)
            if end and hooks is not None and (i + 1) % spe == 0:
                batch_end(i, aux["logs"])
                if getattr(trainer.model, "stop_evaluating", False):
                    break
        if end and hooks is not None and aux is not None and (i + 1) % spe:
            batch_end(i - i % spe + spe - 1, aux["logs"])
        window.drain()
    finally:
        if isinstance(batches, Prefetcher):
            batches.close()
        trainer.adapter.conceal()
        trainer._write_back()
    totals = host_tree(metrics)
    logs = trainer.adapter.metric_results(totals)
    trainer.adapter.keep_metrics(totals)
    if hooks is not None:
        hooks.call("on_test_end", logs)
        trainer._adopt_callback_changes()
    return logs


def predict(trainer: Trainer, x: Any, *, batch_size: int | None = None, verbose: int | str = 0,
            steps: int | None = None, callbacks: Any = None) -> Any:
    """:meth:`Trainer.predict`."""
    if isinstance(x, tuple) and len(x) in (2, 3) and not is_array_tree(x):
        x = x[0]
    # NaN inputs are allowed here: they spoil only their own rows' outputs.
    source = make_source(x, float_dtype=trainer.adapter.float_dtype, check_finite=False)
    batch_size = trainer._batch_size(source, batch_size)
    trainer._ensure_state(source.sample(batch_size, trainer.strategy.batch_mesh, with_targets=False))
    source.check_targets(trainer.adapter)  # the inputs' shapes (no targets here)
    if steps is not None:
        check_int("steps", steps)
    stream = source.stream(batch_size, trainer.strategy.batch_mesh, with_targets=False)
    outputs: list[Any] = []
    hooks = Callbacks(callbacks, trainer.model, epochs=1, steps=steps, verbose=0) if callbacks is not None else None
    end = hooks is not None and hooks.listens["predict_end"]
    spe = trainer.steps_per_execution  # batch hooks once per execution, as Keras

    def collect(item: tuple[Any, Any]) -> None:
        if hooks is not None and getattr(trainer.model, "stop_predicting", False):
            # Dispatched before a callback's stop was seen (the window runs ahead): Keras would not
            # have run it, so neither its outputs nor its hooks count.
            return
        y, mask = item
        mask_h = host_value(mask) > 0
        outputs.append(jax.tree.map(lambda a: host_value(a)[mask_h], y))
        if end and hooks is not None and len(outputs) % spe == 0:
            hooks.call("on_predict_batch_end", len(outputs) - 1, {"outputs": _joined(outputs[-spe:])})

    window = InFlight(trainer.max_in_flight)
    within = within_pass(stream, steps, warn=trainer._epochs_end_with_data)
    batches = trainer._device_batches(stream.batches(0, within), 1, stream.per_process)
    if hooks is not None:
        trainer.model.stop_predicting = False  # as Keras: a predict-batch callback may set it to stop early
        hooks.call("on_predict_begin")
        trainer._adopt_callback_changes()
    begin = hooks is not None and hooks.listens["predict_begin"]
    try:
        for i, (_, batch) in enumerate(batches):
            if begin and hooks is not None and i % spe == 0:
                if end and i:
                    # Keras calls on_predict_batch_end(k) before on_predict_batch_begin(k + 1): the previous
                    # execution's outputs come first (only when both hooks listen does the order show).
                    window.drain()
                    if getattr(trainer.model, "stop_predicting", False):
                        break
                hooks.call("on_predict_batch_begin", i)
            y, model_state = trainer.steps.predict(trainer._live_state, batch.x, batch.real_rows())
            trainer._state = trainer._live_state.replace(model_state=model_state)
            window.push((y, batch.mask), on_done=collect)
            if hooks is not None and getattr(trainer.model, "stop_predicting", False):
                break
        window.drain()
        if end and hooks is not None and len(outputs) % spe:
            n = len(outputs)
            hooks.call("on_predict_batch_end", n - n % spe + spe - 1, {"outputs": _joined(outputs[-(n % spe):])})
    finally:
        if isinstance(batches, Prefetcher):
            batches.close()
    if jax.tree.leaves(trainer._live_state.model_state):
        trainer._write_back()  # the model's random streams moved on (Keras's predict syncs them back too)
    if hooks is not None:
        hooks.call("on_predict_end")
        trainer._adopt_callback_changes()
    return jax.tree.map(lambda *a: np.concatenate(a), *outputs)


def train_on_batch(trainer: Trainer, x: Any, y: Any = None, *, sample_weight: Any = None,
                   class_weight: Any = None) -> dict[str, float]:
    """:meth:`Trainer.train_on_batch`."""
    if class_weight is not None:
        sample_weight = class_weights(y, class_weight, sample_weight)
    source = ArraySource(x, y, sample_weight)
    batch_size = source.num_examples
    host = source.sample(batch_size, trainer.strategy.batch_mesh)
    trainer._ensure_state(host)
    trainer.steps.check_labels_in_step(True)  # (the labels of a single batch are looked at in the step)
    batch = to_global(host, trainer.strategy.batch_mesh)
    state = trainer._live_state.replace(metrics=trainer._place(trainer.adapter.initial_metrics(), from_host=False))
    trainer.adapter.release()
    trainer._state = None
    try:
        state, aux = trainer.steps.train(state, batch.tree())
    finally:
        trainer._state = state if state is not None else trainer._state
    trainer._write_back()
    if trainer.steps.on_nonfinite == "raise" and int(host_value(state.skipped)):
        trainer._state = trainer.steps.clear_nonfinite(state, int(host_value(state.nonfinite_step)))
        raise NonFiniteLossError("The loss of this batch is not finite; the update was not applied (the model "
                                 "keeps its values). Check the batch for NaN/inf or lower the learning rate.")
    totals = host_tree(state.metrics)
    trainer.adapter.keep_metrics(totals)
    return trainer.adapter.metric_results(totals)


def test_on_batch(trainer: Trainer, x: Any, y: Any = None, *, sample_weight: Any = None) -> dict[str, float]:
    """:meth:`Trainer.test_on_batch`."""
    source = ArraySource(x, y, sample_weight)
    return evaluate_source(trainer, source, source.num_examples)


def _joined(outputs: list[Any]) -> Any:
    """Per-batch outputs of one execution as one batch (what Keras's ``on_predict_batch_end`` gets)."""
    return outputs[0] if len(outputs) == 1 else jax.tree.map(lambda *a: np.concatenate(a), *outputs)
