"""Peer (1): the keras.io "Multi-GPU distributed training with JAX" loop, written the way a JAX expert would.

The same Keras model, trained through ``model.stateless_call(..., training=True)`` and
``optimizer.stateless_apply`` inside one jitted step; the state (trainable, non-trainable, optimizer
variables and device-side loss/accuracy sums) is replicated with ``NamedSharding(mesh, P())`` and donated
(``donate_argnums``); each batch is placed on the mesh with ``NamedSharding(mesh, P("batch"))`` one step
ahead (prefetch), and at most 2 steps are in flight: after dispatching step i the loop waits for step
i-1's loss. (On a 2-core host, 3 or more queued steps with collectives abort in XLA's CPU rendezvous.)

Run: ``python -m benchmarks.peers.jax_loop --workload mlp --devices 2``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

from benchmarks.peers import _common


class HandLoop:
    """The hand-written step and loop, shared by this peer and ``benchmarks/interleaved.py``.

    The state (trainable, non-trainable, optimizer variables, loss/accuracy/count sums) is replicated
    and donated; ``steps(n)`` places each batch one step ahead and keeps at most 2 steps in flight.

    Args:
        model: a built Keras model, trained through ``stateless_call``.
        optimizer: a Keras optimizer (built here on the model's trainable variables).
        loss_obj: a Keras loss, ``loss_obj(y_true, y_pred)``.
        mesh: a 1-D ``jax.sharding.Mesh``; batches are split over ``axis``.
        batches: host ``(x, y)`` global batches; step ``i`` takes ``batches[i % len(batches)]``.
        axis: the mesh axis that splits a batch.
    """

    def __init__(self, model: Any, optimizer: Any, loss_obj: Any, mesh: Any, batches: list[tuple[Any, Any]],
                 axis: str = "batch") -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        replicated, self._split = NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))
        optimizer.build(model.trainable_variables)
        metric_sums = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
                 [v.value for v in optimizer.variables], metric_sums)
        self.state = jax.device_put(state, replicated)
        state_shardings = jax.tree.map(lambda _: replicated, self.state)
        self.batches = batches

        def loss_fn(trainable: Any, non_trainable: Any, x: Any, y: Any) -> Any:
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            return loss_obj(y, y_pred), (non_trainable, y_pred)

        @partial(jax.jit, donate_argnums=(0,), in_shardings=(state_shardings, self._split, self._split),
                 out_shardings=(state_shardings, replicated))
        def train_step(state: Any, x: Any, y: Any) -> Any:
            trainable, non_trainable, opt_vars, (loss_sum, correct, count) = state
            (loss, (non_trainable, y_pred)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                trainable, non_trainable, x, y)
            trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
            # Counted in float32, as the other sums: XLA then reduces it over the devices in the gradients'
            # one all-reduce (summed as an int, it took an all-reduce of its own: on 8 CPU devices a second
            # rendezvous of every device a step, 13-15% of the MLP's step).
            hits = jnp.sum((jnp.argmax(y_pred, axis=-1) == y).astype(jnp.float32))
            metric_sums = (loss_sum + loss, correct + hits, count + jnp.float32(y.size))
            return (trainable, non_trainable, opt_vars, metric_sums), loss

        self.train_step = train_step

    def put(self, i: int) -> tuple[Any, Any]:
        """Places batch ``i`` (cyclically) on the mesh, split over the batch axis."""
        import jax

        return jax.device_put(self.batches[i % len(self.batches)], self._split)

    def steps(self, n: int) -> None:
        """Runs ``n`` steps from the first batch; returns when the state is ready."""
        import jax

        pending = None  # the previous step's loss: waiting on it bounds the queue to 2 steps
        nxt = self.put(0)
        for i in range(n):
            x, y = nxt
            self.state, loss = self.train_step(self.state, x, y)
            if i + 1 < n:
                nxt = self.put(i + 1)
            if pending is not None:
                pending.block_until_ready()
            pending = loss
        jax.block_until_ready(self.state)


def run(args: Any) -> None:
    """Builds, warms up and times the hand-written loop; writes the result."""
    import time

    import jax
    import keras

    from benchmarks import workloads

    wl = workloads.get(args.workload)
    devices = _common.jax_devices(args)
    mesh = jax.make_mesh((args.devices,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)

    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = workloads.build_keras_model(wl)
    spec = workloads.compile_args(wl)
    x_host, y_host = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)
    loop = HandLoop(model, spec["optimizer"], spec["loss"], mesh, _common.make_batches(x_host, y_host, args.batch))

    t0 = time.perf_counter()
    loop.steps(args.warmup)
    warmup_s = time.perf_counter() - t0
    rates = _common.time_runs(lambda: loop.steps(args.steps), args.repeats, args.steps * args.batch)
    loss_sum, _, _ = jax.device_get(loop.state[3])
    _common.write_result(args, samples_per_s=rates, warmup_s=warmup_s, device_kind=devices[0].device_kind,
                         num_params=int(model.count_params()),
                         note=f"mean loss {float(loss_sum) / (args.warmup + args.repeats * args.steps):.4f}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.jax_loop --workload W --devices N ...``."""
    args = _common.parse_args("jax_loop", argv)
    _common.use_cpu_devices(args.devices)
    _common.main_guard(args, lambda: run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
