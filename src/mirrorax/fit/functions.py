"""The train / eval / predict steps, each a public ``strategy.jit`` function.

A train step is a pure function ``(state, batch) -> (state, aux)`` compiled once over the global batch
by :meth:`MirroredStrategy.jit` with known output layouts (``out_shardings=``): the state comes back in
the layout it went in with (replicated, or split in the sharded modes) and is donated, the batch is
split over the batch axis. XLA's partitioner inserts the all-reduce of gradients and metric sums, so the
numbers are the single-device numbers whatever the device count. The loop (:mod:`mirrorax.fit.loop`) calls
each step's compiled ``program`` and pushes it into the strategy's dispatch window, as a custom loop can.

A batch whose padding sits at its end carries its real row count statically (``batch["rows"]``, a
:class:`~mirrorax.inputs.batch.RealRows`): every step first cuts it to those rows
(:func:`real_rows_only`), so the model computes on exactly the rows Keras would give it (a forward pass
that mixes rows, Keras's per-output loss trackers weighted by the batch's rows). That count is part of
the compiled signature: a full-batch program and a tail program per step kind at most, as Keras's own
jit retraces for a short batch. On the ``Auto`` mesh axis XLA partitions a count that does not divide
by the devices unevenly itself.

``aux`` holds the step's loss and whether training has halted. With ``on_nonfinite="raise"`` a
non-finite step leaves the state untouched and freezes it (every later step is a no-op, and
``state.nonfinite_step`` names the step) so the host can stop at its next look and the trainer still
holds the last good values; with ``"skip"`` the update is dropped and counted in ``state.skipped``.

Integer labels outside a sparse cross-entropy's classes freeze the state the same way in every mode
(``state.bad_label`` records the first: step, target, row, value), since JAX's one-hot would score
them as no class at all and train on silently: the host reads the record when it looks for non-finite
steps and raises (:meth:`StepFunctions.take_bad_labels`). Array inputs are checked on the host before
anything runs; this catches them in iterables, where reading every batch on the host would cost time.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax import batch_sums
from mirrorax._host import host_tree, host_value
from mirrorax.as_made import split_transposes
from mirrorax.fit.hooks import PackedLogs
from mirrorax.inputs.batch import RealRows
from mirrorax.inputs.placement import host_rows
from mirrorax.models.base import ModelAdapter, real_count
from mirrorax.steps.dispatch import StrategyFunction, layout
from mirrorax.strategy import MirroredStrategy
from mirrorax.train_state import TrainState, pack_counters

__all__ = ["StepFunctions", "NONFINITE_MODES", "NonFiniteMode", "host_value", "host_tree", "real_rows_only"]

PyTree = Any
NonFiniteMode = Literal["raise", "skip", "ignore"]
NONFINITE_MODES: tuple[NonFiniteMode, ...] = ("raise", "skip", "ignore")


def _split_micro(a: jax.Array, k: int, replicas: int) -> jax.Array:
    # Micro-batch j takes the j-th chunk of every device's rows: no data moves between devices.
    rows = a.shape[0]
    m = rows // (replicas * k)
    a = a.reshape((replicas, k, m) + a.shape[1:])
    return jnp.swapaxes(a, 0, 1).reshape((k, replicas * m) + a.shape[3:])


def real_rows_only(batch: dict[str, PyTree], sharding: jax.sharding.Sharding
                   ) -> tuple[dict[str, PyTree], int | None]:
    """``batch`` cut to its real rows when it carries their count (``batch["rows"]``), and that count
    (``None``: the batch as it came, its padding, if any, masked).

    The cut batch's mask is a constant of ones and its count a constant, which XLA folds away: the
    masking that per-process pipelines still need costs the cut batch nothing. Such a batch comes without
    them (:meth:`Batch.step_tree <mirrorax.inputs.batch.Batch.step_tree>`), and without its sample weights when the
    user gave none: constants of ones here too.
    """
    rows = batch.get("rows")
    if rows is None:
        return batch, None
    if not isinstance(rows, RealRows) or not isinstance(rows.count, int):
        raise TypeError(f"Expected batch['rows'] to be RealRows with one int count. Received: {rows!r}. This "
                        "is a bug in mirrorax: please report it.")
    n = rows.count

    def cut(a: jax.Array) -> jax.Array:
        # Split over the devices again, XLA padding an uneven split at the end: a batch short of a
        # multiple of the device count (64 rows of 66 on 3 devices) keeps its rows where they are; a
        # pass's short tail, placed on the first devices, is spread over all of them (a few rows move)
        # instead of being computed, or gathered, on one.
        return jax.lax.with_sharding_constraint(a[:n], sharding)

    out = {k: v for k, v in batch.items() if k != "rows"}
    for name in ("x", "y", "sample_weight"):
        out[name] = jax.tree.map(cut, batch.get(name))
    if out["sample_weight"] is None:  # unweighted: 1 for every row
        out["sample_weight"] = jnp.ones((n,), jnp.float32)
    out["mask"] = jnp.ones((n,), batch["mask"].dtype if "mask" in batch else jnp.float32)
    out["num_real"] = jnp.asarray(n, jnp.float32)
    return out, n


def _cut_micro(batch: dict[str, PyTree], rows: int, k: int) -> list[dict[str, PyTree]]:
    """A cut batch of ``rows`` rows as up to ``k`` consecutive micro-batches of near-equal sizes (each
    counting its own rows, as a micro-batch of a full batch counts its mask)."""
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(rows), k) if len(part)])
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = {name: jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], batch.get(name))
                for name in ("x", "y", "sample_weight", "mask")}
        out.append(part)
    return out


class StepFunctions:
    """Builds and holds the jitted steps of one adapter on one strategy.

    Args:
      adapter: the model's pure functions.
      strategy: the devices and layouts.
      donate: donate the state buffers to the train step (saves a copy of the state per step).
      on_nonfinite: ``"raise"`` (freeze and report), ``"skip"`` (drop the update, count it) or
        ``"ignore"``.
      accumulation_steps: split each global batch into this many micro-batches, run them one after
        the other and apply one update with their averaged gradients (equal to the whole batch).
      placed_ahead: a thread places the batches ahead of the steps (the Trainer's ``prefetch``): they reach
        the steps on the devices, never as host arrays (:attr:`host_rows`).
    """

    def __init__(self, adapter: ModelAdapter, strategy: MirroredStrategy, *, donate: bool = True,
                 on_nonfinite: NonFiniteMode = "raise", accumulation_steps: int = 1,
                 placed_ahead: bool = False) -> None:
        if on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}; received {on_nonfinite!r}.")
        self.adapter = adapter
        self.strategy = strategy
        self.on_nonfinite = on_nonfinite
        self.accumulation_steps = int(accumulation_steps)
        if self.accumulation_steps > 1 and getattr(adapter, "custom", {}).get("train_step"):
            raise ValueError(f"accumulation_steps={accumulation_steps} splits the batch inside mirrorax's own train "
                             "step; the model overrides train_step, which sees the whole global batch. Use "
                             "accumulation_steps=1, or drop the train_step override.")
        rep = strategy.replicated
        # Evaluation: the metrics donated and returned, all replicated; prediction: the outputs split as
        # the batch is, the model state replicated.
        # (the whole state is explicit: no trace to look for Keras variables, and the batch is the Trainer's)
        self.evaluate = StrategyFunction(strategy, strategy.in_flight, self._eval_with_logs,
                                         donate_argnums=1, out_shardings=rep)
        self.predict = StrategyFunction(strategy, strategy.in_flight, self._predict_step,
                                        out_shardings=(strategy.batch_sharding, rep))
        self._donate_args = (0,) if donate else ()
        self._placed_ahead = bool(placed_ahead)
        self._check_labels = True
        self._variants: dict[bool, tuple[Any, Any]] = {}
        self._select()

    @property
    def host_rows(self) -> bool:
        """Whether a step is given its batch's rows as the host's arrays, which JAX's dispatch transfers: on one
        device of one process (:func:`mirrorax.inputs.placement.host_rows`), unless a thread places the batches
        ahead. ``fit``'s batches and the program a plan compiles (``mx.plan``, fit's start) both follow it, so that
        they key one program."""
        return not self._placed_ahead and host_rows(self.strategy)

    def check_labels_in_step(self, on: bool) -> None:
        """Whether the train steps look for labels outside the classes (on by default).

        Off for inputs whose every label the host has already checked (in-memory arrays): the record
        is a search of the labels in every step. Each setting keeps its own compiled steps, so switching compiles once.
        """
        if bool(on) != self._check_labels:
            self._check_labels = bool(on)
            self._select()

    def _out(self, state: Any, *_: Any) -> Any:
        """The train steps' output layouts: the state as it came in, the step's flags and logs replicated."""
        rep = self.strategy.replicated
        return layout(state, rep), rep

    def _select(self) -> None:
        flag = self._check_labels
        if flag not in self._variants:
            # The state comes back in the layout it went in with (replicated or sharded), the step's flags
            # and logs replicated. (Their layouts are known, so fn is traced once per signature, as
            # Keras's own fit does.)
            # The window waits on the step's packed flags and logs (one fresh output, never donated): no
            # token output more (each output of a step costs host time on an accelerator).
            s = self.strategy

            def jit(fn: Callable[..., Any]) -> StrategyFunction:
                return StrategyFunction(s, s.in_flight, fn, donate_argnums=self._donate_args,
                                        out_shardings=self._out, ready=_packed_of, flat_state=True)

            self._variants[flag] = (jit(functools.partial(self._train_with_logs, check_labels=flag)),
                                    jit(functools.partial(self._train_many_with_logs, check_labels=flag)))
        self.train, self.train_many = self._variants[flag]

    # -- pure functions --------------------------------------------------------------------------
    def _grads(self, state: TrainState, batch: dict[str, PyTree], rows: int | None = None):
        k = self.accumulation_steps
        if k == 1:
            return self.adapter.grads(state, batch)
        if rows is not None:
            return self._grads_cut(state, batch, rows)
        replicas = self.strategy.num_replicas_in_sync
        total = jnp.maximum(real_count(batch), 1.0)
        fields = {name: v for name, v in batch.items() if name != "num_real"}  # micro-batches count their mask
        micro = jax.tree.map(lambda a: _split_micro(a, k, replicas), fields)

        def body(carry, mb):
            gsum, lsum, model_state, metrics = carry
            share = (jnp.sum(mb["mask"]) / total).astype(self.adapter.float_dtype)
            s = state.replace(model_state=model_state, metrics=metrics)
            g, loss, model_state, metrics = self.adapter.grads(s, mb, loss_scale=share)
            gsum = jax.tree.map(jnp.add, gsum, g)
            return (gsum, lsum + loss * share, model_state, metrics), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        init = (zeros, jnp.zeros((), self.adapter.float_dtype), state.model_state, state.metrics)
        (grads, loss, model_state, metrics), _ = jax.lax.scan(body, init, micro)
        return grads, loss, model_state, metrics

    def _grads_cut(self, state: TrainState, batch: dict[str, PyTree], rows: int):
        """Accumulated gradients of a batch cut to its ``rows`` real rows: micro-batches of consecutive
        rows, one after the other (their sizes differ, so no scan), each weighted by its share of rows."""
        gsum = jax.tree.map(jnp.zeros_like, state.params)
        loss = jnp.zeros((), self.adapter.float_dtype)
        model_state, metrics = state.model_state, state.metrics
        for mb in _cut_micro(batch, rows, self.accumulation_steps):
            share = jnp.asarray(mb["mask"].shape[0] / rows, self.adapter.float_dtype)
            s = state.replace(model_state=model_state, metrics=metrics)
            g, part, model_state, metrics = self.adapter.grads(s, mb, loss_scale=share)
            gsum = jax.tree.map(jnp.add, gsum, g)
            loss = loss + part * share
        return gsum, loss, model_state, metrics

    def _even(self, rows: int | None) -> bool:
        """Whether a step's rows split evenly over the replicas, micro-batches included (then its metric
        sums may be packed per replica, :mod:`mirrorax.batch_sums`)."""
        return rows is None or (self.accumulation_steps == 1 and rows % self.strategy.num_replicas_in_sync == 0)

    def _train_step(self, state: TrainState, batch: dict[str, PyTree], check_labels: bool = True):
        batch, rows = real_rows_only(batch, self.strategy.batch_sharding)
        with contextlib.nullcontext() if self._even(rows) else batch_sums.whole():
            return self._train_rows(state, batch, check_labels, rows)

    def _train_rows(self, state: TrainState, batch: dict[str, PyTree], check_labels: bool, rows: int | None):
        labels = self._label_record(batch) if check_labels else None
        if getattr(self.adapter, "custom", {}).get("train_step"):
            # The model's own train_step computes and applies the update; the checks below still hold.
            # Only the Keras adapter has train_step, and only it sets custom["train_step"].
            params_new, opt_new, model_state, metrics, loss = cast(Any, self.adapter).train_step(state, batch)

            def apply(params_opt):
                return params_new, opt_new
        else:
            # The kernels' gradients enter the guard's branch as the backward pass made them.
            (grads, loss, model_state, metrics), restore = split_transposes(
                functools.partial(self._grads, rows=rows), state, batch,
                one_device=self.strategy.mesh.devices.size == 1)

            def apply(params_opt):
                return self.adapter.apply_gradients(state.replace(params=params_opt[0], optimizer=params_opt[1],
                                                                  model_state=model_state), restore(grads))
        finite = jnp.isfinite(loss)

        params_opt = (state.params, state.optimizer)
        # Every mode runs the update in the guard's branch, on_nonfinite="ignore" with the labels checked on
        # the host too (Keras's fit under a scope): its predicate is then the state's clean label record,
        # true at every step. The same program without the branch took 41-45 s to compile on a TPU v5e
        # (a 219M-parameter LM) against 33-41 s with it, and ran at the same speed (benchmarks/README.md).
        if labels is None:
            bad_label = state.bad_label
            labels_ok = bad_label[0] == 0
        else:  # the first record sticks: every later step is a no-op until the host takes it
            here = labels.at[0].set(jnp.where(labels[0] > 0, state.step + 1, 0))
            kept = state.bad_label[0] > 0
            if self.on_nonfinite == "raise":  # frozen by a non-finite step first: that is the error to report
                kept = kept | (state.skipped > 0)
            bad_label = jnp.where(kept, state.bad_label, here)
            labels_ok = bad_label[0] == 0
        if self.on_nonfinite == "ignore":
            nonfinite_ok = jnp.ones((), bool)
        else:
            nonfinite_ok = finite & (state.skipped == 0) if self.on_nonfinite == "raise" else finite
        ok = nonfinite_ok & labels_ok
        if self.on_nonfinite == "ignore":
            # The other modes' predicate tests the loss, so XLA sees it only after the forward pass; this
            # one (the label record alone) is known when the step starts. On a TPU v5e the 219M-parameter
            # LM's step compiled with the early predicate moved ~0.7 GB more a step between HBM and VMEM
            # and ran 2 ms (1.7%) slower than the same step with the loss's predicate. The barrier makes
            # the predicate wait for the loss, as in every other mode; it computes nothing.
            ok, loss = jax.lax.optimization_barrier((ok, loss))
        first_bad = jnp.where((state.nonfinite_step == 0) & ~finite & labels_ok, state.step + 1,
                              state.nonfinite_step)
        # A branch around the optimizer update, not a select over the state: the update runs only when
        # it is applied, in place. The step's metrics and model state (small) take the same branch: one
        # select per leaf cost more than the branch (about 1 ms a step on 2 processes x 4 CPU devices).
        def applied(operands):
            po, new_rest, _ = operands
            return apply(po), new_rest

        def unchanged(operands):
            po, _, old_rest = operands
            return po, old_rest

        (params, opt), (model_state, metrics) = jax.lax.cond(
            ok, applied, unchanged, (params_opt, (model_state, metrics), (state.model_state, state.metrics)))
        skipped = state.skipped + (~nonfinite_ok & labels_ok).astype(state.skipped.dtype)
        new = state.replace(params=params, optimizer=opt, model_state=model_state, metrics=metrics,
                            step=state.step + 1, skipped=skipped, nonfinite_step=first_bad, bad_label=bad_label)
        # ``halted`` is sticky: any later step's aux tells the host that training froze, so the host
        # looks only now and then, never once per step.
        halted = bad_label[0] > 0
        if self.on_nonfinite == "raise":
            halted = halted | (new.skipped > 0)
        return new, {"loss": loss, "halted": halted}

    def _train_many(self, state: TrainState, batches: dict[str, PyTree], check_labels: bool = True):
        step = functools.partial(self._train_step, check_labels=check_labels)
        rows = batches.get("rows")
        if rows is None:
            return jax.lax.scan(step, state, batches)
        # Steps with other real row counts (a group holding a pass's short last batch) cannot share one
        # scan body: each run of equal counts is its own scan, one after the other in this program.
        stacked = {k: v for k, v in batches.items() if k != "rows"}
        counts = rows.count if isinstance(rows.count, tuple) else (rows.count,)
        auxes, start = [], 0
        for count, run in itertools.groupby(counts):
            length = len(list(run))
            part = jax.tree.map(lambda a, lo=start, hi=start + length: a[lo:hi], stacked)
            if count is not None:
                part = dict(part, rows=RealRows(count))
            state, aux = jax.lax.scan(step, state, part)
            auxes.append(aux)
            start += length
        return state, jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)

    def _eval_step(self, state: TrainState, metrics: PyTree, batch: dict[str, PyTree]):
        """The metrics after ``batch``, and its bad-label record (``None``: no integer-label targets)."""
        batch, rows = real_rows_only(batch, self.strategy.batch_sharding)
        with contextlib.nullcontext() if self._even(rows) else batch_sums.whole():
            labels = self._label_record(batch)
            metrics = self.adapter.evaluate(state, metrics, batch)
        return metrics, labels

    def _label_record(self, batch: dict[str, PyTree]) -> jax.Array | None:
        """``int32[4]``: ``(1, target, row, value)`` for the first real row holding a label outside its
        target's classes (or a non-integer one), zeros when every label fits; ``None`` when the model has
        no integer-label targets. The value travels as its float32 bits (labels may be floats)."""
        targets = self.adapter.sparse_targets(batch.get("y"))
        if not targets:
            return None
        self._label_targets = [(t.name, t.classes, t.loss) for t in targets]  # for the host's message
        real = batch["mask"] > 0
        record = jnp.zeros(4, jnp.int32)
        # Over the (sharded) batch axis every step sums one count, which XLA can fold into the gradients'
        # all-reduce; the bad label's row and value are reduced in a branch taken only when there is one.
        # An argmax or an index by a computed row would be an all-gather in every step (which, measured,
        # also changed how a dead peer process reached the others: as a broken all-gather in the step
        # instead of mirrorax's failure notice).
        for i, t in reversed(list(enumerate(targets))):  # the first target's record wins
            lab = t.labels
            if jnp.issubdtype(lab.dtype, jnp.floating):
                bad = (lab < 0) | (lab >= t.classes) | (lab != jnp.floor(lab))
            else:  # (uint8 labels cannot hold a class count of 256 or more to compare with)
                lab = lab.astype(jnp.int32)
                bad = (lab < 0) | (lab >= t.classes)
            if t.ignore_class is not None:
                bad = bad & (lab != t.ignore_class)
            rows = bad.shape[0]
            per_row = bad.reshape(rows, -1) & real[:, None]
            flat = lab.reshape(rows, -1).astype(jnp.float32)
            # Each row's first bad value: along the row, on the device that holds it.
            first = jnp.take_along_axis(flat, jnp.argmax(per_row, axis=1)[:, None], axis=1)[:, 0]
            row_bad = jnp.any(per_row, axis=1)

            def locate(row_bad, first, i=i, rows=rows):
                row_ids = jnp.arange(rows, dtype=jnp.int32)
                row = jnp.min(jnp.where(row_bad, row_ids, rows))
                value = jnp.sum(jnp.where(row_ids == row, first, 0.0))
                return jnp.stack([jnp.ones((), jnp.int32), jnp.asarray(i, jnp.int32), row,
                                  jax.lax.bitcast_convert_type(value, jnp.int32)])

            found = jnp.sum(row_bad.astype(jnp.float32)) > 0  # a sum: it joins the gradients' all-reduce
            record = jax.lax.cond(found, locate, lambda *_, record=record: record, row_bad, first)
        return record

    def _predict_step(self, state: TrainState, x: PyTree, rows: RealRows | None = None):
        """The outputs, and the model state after them (a random stream moves on, as in Keras).

        ``rows``: the real rows of ``x`` (its padding at the end); the model sees only those, and the
        outputs come back padded with zeros to ``x``'s rows, split evenly as ``x`` was (the host keeps
        the real ones).
        """
        if rows is None:
            return self.adapter.predict_with_state(state, x)
        padded = jax.tree.leaves(x)[0].shape[0]
        cut, n = real_rows_only({"x": x, "mask": jnp.ones((padded,)), "rows": rows}, self.strategy.batch_sharding)
        y, model_state = self.adapter.predict_with_state(state, cut["x"])

        def pad(a: jax.Array) -> jax.Array:
            if a.ndim == 0 or a.shape[0] != n:
                return a
            return jnp.pad(a, [(0, padded - n)] + [(0, 0)] * (a.ndim - 1))
        return jax.tree.map(pad, y), model_state

    # The step's metric results ride along (a few divisions in the same program), packed with its sticky
    # "halted" flag into ONE small array: batch callbacks get them as logs without another dispatch,
    # nobody waits for them unless a callback reads them, and the step has one output beside the state
    # (each output costs host time on an accelerator: ~7 us a step on a TPU v5e, a step of the MLP
    # benchmark taking ~0.7 ms there). Read on the host with halted() and batch_logs().
    def _train_with_logs(self, state: TrainState, batch: dict[str, PyTree], check_labels: bool = True):
        with self._split():
            new, aux = self._train_step(state, batch, check_labels)
        return new, self._pack(aux["halted"], self.adapter.metric_logs(new.metrics))

    def _train_many_with_logs(self, state: TrainState, batches: dict[str, PyTree],
                              check_labels: bool = True):
        with self._split():
            new, aux = self._train_many(state, batches, check_labels)
        return new, self._pack(jnp.any(aux["halted"]), self.adapter.metric_logs(new.metrics))

    def _pack(self, halted: jax.Array, logs: dict[str, Any]) -> jax.Array:
        """``[halted, *logs]`` (logs by name) as one array of the logs' float type (traced)."""
        names = tuple(sorted(logs))
        self._log_names = names  # the same for every program of this adapter: its metrics
        values = [jnp.asarray(logs[n]) for n in names]
        dtype = jnp.result_type(jnp.float32, *[v.dtype for v in values])
        return jnp.stack([jnp.asarray(halted, dtype), *(v.astype(dtype) for v in values)])

    @staticmethod
    def halted(packed: jax.Array) -> bool:
        """Whether a train step's packed output says training froze (reads the small array)."""
        return bool(host_value(packed)[0])

    def batch_logs(self, packed: jax.Array) -> PackedLogs:
        """A train step's batch logs, read from its packed output when a callback first reads one."""
        return PackedLogs(self._log_names, packed, offset=1)

    def _eval_with_logs(self, state: TrainState, metrics: PyTree, batch: dict[str, PyTree]):
        with self._split():
            metrics, labels = self._eval_step(state, metrics, batch)
        return metrics, {"labels": labels, "logs": self.adapter.metric_logs(metrics)}

    def _split(self) -> Any:
        """While a step is traced: where its batch is split, for sums packed into one all-reduce
        (:mod:`mirrorax.batch_sums`)."""
        return batch_sums.over(self.strategy.mesh, self.strategy.batch_axis)

    # -- helpers ---------------------------------------------------------------------------------
    def labels_halted(self, state: TrainState) -> bool:
        """Whether a bad label froze ``state`` (reads one small replicated array)."""
        return bool(state.host_counters()["bad_label"][0])

    def take_bad_labels(self, state: TrainState, where: Callable[[int], str]
                        ) -> tuple[TrainState, ValueError | None]:
        """The error a bad label froze ``state`` with (``None`` if none), and the state to continue from:
        the record cleared and the step counter back at the last applied step, so the same trainer
        trains on once the labels are fixed.

        Args:
          where: the words for the step (its counter) the label froze, e.g. ``"epoch 2, batch 5 of the epoch"``.
        """
        record = state.host_counters()["bad_label"]
        if not record[0]:
            return state, None
        step = int(record[0])
        state = _counters_set(state, bad_label=np.zeros(4, np.int32), step=step - 1)
        place = f"in row {int(record[2])} of the global batch of step {step} ({where(step)})"
        return state, ValueError(self._label_message(record, place) + " The update of that step was not "
                                 "applied: the trainer and the model hold the values from before it.")

    @staticmethod
    def clear_nonfinite(state: TrainState, bad_step: int) -> TrainState:
        """``state`` after a non-finite step froze it (``on_nonfinite="raise"``), ready to train on: the
        record cleared and the step counter back at the last applied step (``bad_step - 1``)."""
        return _counters_set(state, skipped=0, nonfinite_step=0, step=bad_step - 1)

    def eval_watch(self) -> Callable[[Any], None]:
        """An ``on_done`` for the evaluation steps' ``aux`` as they leave the dispatch window: raises on a
        batch holding a bad label."""
        count = itertools.count(1)

        def watch(aux: Any) -> None:
            index = next(count)
            labels = aux["labels"]
            if labels is not None and host_value(labels)[0]:
                record = host_value(labels)
                raise ValueError(self._label_message(record, f"in row {int(record[2])} of batch {index} of the "
                                                     "evaluated data"))
        return watch

    def _label_message(self, record: np.ndarray, where: str) -> str:
        from mirrorax.inputs.checks import label_message

        targets = getattr(self, "_label_targets", None) or [("y", "?", "sparse_categorical_crossentropy")]
        name, classes, loss = targets[min(int(record[1]), len(targets) - 1)]
        value = np.asarray(record[3], np.int32).view(np.float32)
        if value != np.floor(value):
            return (f"{name} holds the non-integer label {value} {where}; the loss {loss} takes integer class "
                    f"indices 0..{classes - 1}. Pass integer labels.")
        return label_message(name, value, classes, loss, where)

    def compile_counts(self) -> dict[str, int]:
        """How many programs each step kind has compiled (one per placed shape and real row count)."""
        return {"train": self.train.compile_count, "train_many": self.train_many.compile_count,
                "evaluate": self.evaluate.compile_count, "predict": self.predict.compile_count}


def _counters_set(state: TrainState, **values: Any) -> TrainState:
    """``state`` (on the devices, after a step) with these counters set to host values, the others kept,
    its counters in the layout they had (an update of the array held, as every process makes it)."""
    now = {**state.host_counters(), **values}
    return state.replace(counters=state.counters * 0 + pack_counters(**now))


def _packed_of(out: tuple[Any, jax.Array]) -> jax.Array:
    """A train step's packed flags and logs: the output its window waits on."""
    return out[1]
