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


def run(args: Any) -> None:
    """Builds, warms up and times the hand-written loop; writes the result."""
    import time

    import jax
    import jax.numpy as jnp
    import keras
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import workloads

    wl = workloads.get(args.workload)
    devices = _common.jax_devices(args.devices)
    mesh = jax.make_mesh((args.devices,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))

    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = workloads.build_keras_model(wl)
    spec = workloads.compile_args(wl)
    optimizer, loss_obj = spec["optimizer"], spec["loss"]
    optimizer.build(model.trainable_variables)

    metric_sums = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables], metric_sums)
    state = jax.device_put(state, replicated)
    state_shardings = jax.tree.map(lambda _: replicated, state)

    def loss_fn(trainable: Any, non_trainable: Any, x: Any, y: Any) -> Any:
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_obj(y, y_pred), (non_trainable, y_pred)

    @partial(jax.jit, donate_argnums=(0,), in_shardings=(state_shardings, batch_sharding, batch_sharding),
             out_shardings=(state_shardings, replicated))
    def train_step(state: Any, x: Any, y: Any) -> Any:
        trainable, non_trainable, opt_vars, (loss_sum, correct, count) = state
        (loss, (non_trainable, y_pred)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, x, y)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        hits = jnp.sum(jnp.argmax(y_pred, axis=-1) == y).astype(jnp.float32)
        metric_sums = (loss_sum + loss, correct + hits, count + jnp.float32(y.size))
        return (trainable, non_trainable, opt_vars, metric_sums), loss

    x_host, y_host = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)
    batches = _common.make_batches(x_host, y_host, args.batch)

    def put(i: int) -> tuple[Any, Any]:
        return jax.device_put(batches[i % len(batches)], batch_sharding)

    def steps(n: int) -> None:
        nonlocal state
        pending = None  # the previous step's loss: waiting on it bounds the queue to 2 steps
        nxt = put(0)
        for i in range(n):
            x, y = nxt
            state, loss = train_step(state, x, y)
            if i + 1 < n:
                nxt = put(i + 1)
            if pending is not None:
                pending.block_until_ready()
            pending = loss
        jax.block_until_ready(state)

    t0 = time.perf_counter()
    steps(args.warmup)
    warmup_s = time.perf_counter() - t0
    rates = _common.time_runs(lambda: steps(args.steps), args.repeats, args.steps * args.batch)
    loss_sum, _, _ = jax.device_get(state[3])
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
