"""The jitted train / eval / predict steps, and the bounded window of steps in flight.

A train step is a pure function ``(state, batch) -> (state, aux)`` jitted once over the global batch:
state replicated (``NamedSharding(mesh, P())``) and donated, batch split over the batch axis. XLA's
partitioner inserts the all-reduce of gradients and metric sums, so the numbers are the single-device
numbers whatever the device count.

``aux`` holds the step's loss and whether training has halted. With ``on_nonfinite="raise"`` a
non-finite step leaves the state untouched and freezes it (every later step is a no-op, and
``state["nonfinite_step"]`` names the step) so the host can stop at its next look and the trainer still
holds the last good values; with ``"skip"`` the update is dropped and counted in ``state["skipped"]``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mirrorax.models.base import ModelAdapter, real_count
from mirrorax.strategy import BATCH_AXIS, MirroredStrategy

__all__ = ["StepFunctions", "InFlight", "NONFINITE_MODES", "host_value", "host_tree"]

PyTree = Any
NONFINITE_MODES = ("raise", "skip", "ignore")


def _split_micro(a: jax.Array, k: int, replicas: int) -> jax.Array:
    # Micro-batch j takes the j-th chunk of every device's rows: no data moves between devices.
    rows = a.shape[0]
    m = rows // (replicas * k)
    a = a.reshape((replicas, k, m) + a.shape[1:])
    return jnp.swapaxes(a, 0, 1).reshape((k, replicas * m) + a.shape[3:])


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
    """

    def __init__(self, adapter: ModelAdapter, strategy: MirroredStrategy, *, donate: bool = True,
                 on_nonfinite: str = "raise", accumulation_steps: int = 1) -> None:
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
        self.stacked_sharding = NamedSharding(strategy.mesh, P(None, BATCH_AXIS))
        donate_args = (0,) if donate else ()
        self.train = jax.jit(self._train_with_logs, donate_argnums=donate_args, out_shardings=rep)
        self.train_many = jax.jit(self._train_many_with_logs, donate_argnums=donate_args, out_shardings=rep)
        self.evaluate = jax.jit(self._eval_with_logs, donate_argnums=(1,), out_shardings=rep)
        self.predict = jax.jit(self._predict_step, out_shardings=strategy.batch_sharding)
        self._donate_args = donate_args
        self._state_layout: Any = None

    def set_state_layout(self, layout: PyTree) -> None:
        """The train steps return the state laid out as ``layout`` (a pytree prefix of the state of
        ``NamedSharding``s: sharded parameters / optimizer state stay sharded). Replicated by default."""
        if layout == self._state_layout:
            return
        self._state_layout = layout
        rep = self.strategy.replicated
        self.train = jax.jit(self._train_with_logs, donate_argnums=self._donate_args, out_shardings=(layout, rep))
        self.train_many = jax.jit(self._train_many_with_logs, donate_argnums=self._donate_args,
                                  out_shardings=(layout, rep))

    # -- pure functions --------------------------------------------------------------------------
    def _grads(self, state: dict[str, PyTree], batch: dict[str, PyTree]):
        k = self.accumulation_steps
        if k == 1:
            return self.adapter.grads(state, batch)
        replicas = self.strategy.num_replicas_in_sync
        total = jnp.maximum(real_count(batch), 1.0)
        rows = {name: v for name, v in batch.items() if name != "num_real"}  # micro-batches count their mask
        micro = jax.tree.map(lambda a: _split_micro(a, k, replicas), rows)

        def body(carry, mb):
            gsum, lsum, model_state, metrics = carry
            share = jnp.sum(mb["mask"]) / total
            s = dict(state, model_state=model_state, metrics=metrics)
            g, loss, model_state, metrics = self.adapter.grads(s, mb, loss_scale=share)
            gsum = jax.tree.map(jnp.add, gsum, g)
            return (gsum, lsum + loss * share, model_state, metrics), None

        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        init = (zeros, jnp.zeros((), jnp.float32), state["model_state"], state["metrics"])
        (grads, loss, model_state, metrics), _ = jax.lax.scan(body, init, micro)
        return grads, loss, model_state, metrics

    def _train_step(self, state: dict[str, PyTree], batch: dict[str, PyTree]):
        if getattr(self.adapter, "custom", {}).get("train_step"):
            # The model's own train_step computes and applies the update; the checks below still hold.
            params_new, opt_new, model_state, metrics, loss = self.adapter.train_step(state, batch)

            def apply(params_opt):
                return params_new, opt_new
        else:
            grads, loss, model_state, metrics = self._grads(state, batch)

            def apply(params_opt):
                return self.adapter.apply_gradients(dict(state, params=params_opt[0], optimizer=params_opt[1],
                                                         model_state=model_state), grads)
        finite = jnp.isfinite(loss)

        params_opt = (state["params"], state["optimizer"])
        if self.on_nonfinite == "ignore":
            params, opt = apply(params_opt)
            return (dict(state, params=params, optimizer=opt, model_state=model_state, metrics=metrics,
                         step=state["step"] + 1), {"loss": loss, "halted": jnp.zeros((), bool)})
        ok = finite & (state["skipped"] == 0) if self.on_nonfinite == "raise" else finite
        first_bad = jnp.where((state["nonfinite_step"] == 0) & ~finite, state["step"] + 1, state["nonfinite_step"])
        # A branch around the optimizer update alone, not a select over the state: the update runs only
        # when it is applied, and nothing else passes through the branch (operands that only pass
        # through a conditional cost copies). The rest is small and selected.
        params, opt = jax.lax.cond(ok, apply, lambda po: po, params_opt)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        new = dict(state, params=params, optimizer=opt, model_state=keep(model_state, state["model_state"]),
                   metrics=keep(metrics, state["metrics"]), step=state["step"] + 1,
                   skipped=state["skipped"] + (~ok).astype(state["skipped"].dtype), nonfinite_step=first_bad)
        # ``halted`` is sticky in "raise" mode: any later step's aux tells the host that training froze,
        # so the host looks only now and then, never once per step.
        return new, {"loss": loss, "halted": new["skipped"] > 0}

    def _train_many(self, state: dict[str, PyTree], batches: dict[str, PyTree]):
        return jax.lax.scan(self._train_step, state, batches)

    def _eval_step(self, state: dict[str, PyTree], metrics: PyTree, batch: dict[str, PyTree]):
        # The mask's sum is the token the host waits on: the metrics themselves are donated onwards, and
        # a host-sent count would come back as the input buffer itself, ready before the step ran.
        return self.adapter.evaluate(state, metrics, batch), jnp.sum(batch["mask"])

    def _predict_step(self, state: dict[str, PyTree], x: PyTree):
        return self.adapter.predict(state, x)

    # The step's metric results ride along as device scalars (a few divisions in the same program):
    # batch callbacks get them as logs without another dispatch, and nobody waits for them unless a
    # callback reads them.
    def _train_with_logs(self, state: dict[str, PyTree], batch: dict[str, PyTree]):
        new, aux = self._train_step(state, batch)
        return new, dict(aux, logs=self.adapter.metric_logs(new["metrics"]))

    def _train_many_with_logs(self, state: dict[str, PyTree], batches: dict[str, PyTree]):
        new, aux = self._train_many(state, batches)
        return new, dict(aux, logs=self.adapter.metric_logs(new["metrics"]))

    def _eval_with_logs(self, state: dict[str, PyTree], metrics: PyTree, batch: dict[str, PyTree]):
        metrics, token = self._eval_step(state, metrics, batch)
        return metrics, {"token": token, "logs": self.adapter.metric_logs(metrics)}

    # -- helpers ---------------------------------------------------------------------------------
    def compile_counts(self) -> dict[str, int]:
        """How many programs each step kind has compiled (one each, with fixed shapes)."""
        return {name: getattr(self, name)._cache_size()
                for name in ("train", "train_many", "evaluate", "predict")}


class InFlight:
    """A bounded window of dispatched steps: after dispatching step ``i``, wait for step ``i - depth + 1``.

    JAX dispatches asynchronously; without a bound, the host can queue many steps, which both hides
    errors and (on multi-device CPU) overruns XLA's collective rendezvous. ``depth=2`` keeps one step
    running while the next is queued: the host never waits for the step it just dispatched.

    Args:
      depth: steps allowed in flight (>= 1).
      on_done: called with each step's ``aux`` (already computed) when it leaves the window.
    """

    def __init__(self, depth: int = 2, on_done: Callable[[Any], None] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"max_in_flight must be >= 1; received {depth}.")
        self.depth = depth
        self.on_done = on_done
        self._queue: collections.deque[Any] = collections.deque()
        self.last_done: Any = None

    def push(self, aux: Any) -> None:
        self._queue.append(aux)
        while len(self._queue) >= self.depth:
            self._retire(self._queue.popleft())

    def drain(self) -> None:
        while self._queue:
            self._retire(self._queue.popleft())

    def _retire(self, aux: Any) -> None:
        jax.block_until_ready(aux)
        self.last_done = aux
        if self.on_done is not None:
            self.on_done(aux)


def _one_copy(a: Any) -> Any:
    """This process's first copy of a replicated array (no transfer of the others), else ``a``."""
    if isinstance(a, jax.Array) and a.is_fully_replicated and len(a.sharding.device_set) > 1:
        return a.addressable_shards[0].data
    return a


def host_value(a: Any) -> np.ndarray:
    """A host copy of a replicated (or fully addressable) array, on any process count."""
    a = _one_copy(a)
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def host_tree(tree: PyTree) -> PyTree:
    """Host copies of a tree of arrays as :func:`host_value` makes them, in one batched transfer (not
    one wait per leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    local = [_one_copy(a) for a in leaves]
    out = [host_value(a) if isinstance(a, jax.Array) and not a.is_fully_addressable else a for a in local]
    return jax.tree.unflatten(treedef, [np.asarray(a) for a in jax.device_get(out)])
