"""mirrorax, entry point (3): the keras.io "Multi-GPU distributed training with JAX" loop (the same as
``jax_loop``) written on the strategy's own API: ``strategy.replicate``, ``experimental_distribute_dataset``,
``strategy.jit`` with ``compute_average_loss``. No ``jax.sharding`` import, no ``device_put``, no waits.

Run: ``python -m benchmarks.peers.guide_api --workload mlp --devices 2``.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.peers import _common


def run(args: Any) -> None:
    """Builds, warms up and times the loop on the strategy's API; writes the result."""
    import time

    import jax
    import jax.numpy as jnp
    import keras

    import mirrorax as mx
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    devices = _common.jax_devices(args.devices)
    strategy = mx.MirroredStrategy(devices=devices)
    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = workloads.build_keras_model(wl)
    spec = workloads.compile_args(wl)
    optimizer = spec["optimizer"]
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=wl.name == "transformer", reduction=None)
    optimizer.build(model.trainable_variables)
    state = strategy.replicate(([v.value for v in model.trainable_variables],
                                [v.value for v in model.non_trainable_variables],
                                [v.value for v in optimizer.variables]))

    @strategy.jit(donate_argnums=0)
    def train_step(state: Any, batch: Any) -> Any:
        trainable, non_trainable, opt_vars = state
        x, y = batch.data

        def loss_fn(trainable: Any) -> Any:
            y_pred, nt = model.stateless_call(trainable, non_trainable, x, training=True)
            return mx.compute_average_loss(per_example(y, y_pred), batch), nt

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return (trainable, non_trainable, opt_vars), jnp.asarray(loss)

    x_host, y_host = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)

    def steps(n: int) -> None:
        nonlocal state
        done = 0
        while done < n:
            for batch in strategy.experimental_distribute_dataset((x_host, y_host), batch_size=args.batch):
                state, _ = train_step(state, batch)
                done += 1
                if done == n:
                    break
        jax.block_until_ready(state)

    t0 = time.perf_counter()
    steps(args.warmup)
    warmup_s = time.perf_counter() - t0
    rates = _common.time_runs(lambda: steps(args.steps), args.repeats, args.steps * args.batch)
    _common.write_result(args, samples_per_s=rates, warmup_s=warmup_s, device_kind=devices[0].device_kind,
                         num_params=int(model.count_params()),
                         note=f"strategy.jit, compiled {train_step.compile_count}x")


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.guide_api --workload W --devices N ...``."""
    args = _common.parse_args("guide_api", argv)
    _common.use_cpu_devices(args.devices)
    _common.main_guard(args, lambda: run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
