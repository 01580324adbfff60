"""mirrorax, entry point (3): the keras.io "Multi-GPU distributed training with JAX" loop (the same as
``jax_loop``) written on the strategy's own API: ``strategy.replicate``, ``experimental_distribute_dataset``,
``strategy.jit`` with ``compute_average_loss``. No ``jax.sharding`` import, no ``device_put``, no waits.

Run: ``python -m benchmarks.peers.guide_api --workload mlp --devices 2``.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.peers import _common


class GuideLoop:
    """The keras.io guide's loop on the strategy's API, shared by this peer and ``benchmarks/interleaved.py``.

    Args:
        model: a built Keras model, trained through ``stateless_call``.
        optimizer: a Keras optimizer (built here on the model's trainable variables).
        strategy: the ``mx.MirroredStrategy`` to train on.
        x, y: the host arrays; ``steps(n)`` cuts them into global batches of ``batch_size``, cyclically.
        from_logits: whether the model's outputs are logits (the language model's are).
    """

    def __init__(self, model: Any, optimizer: Any, strategy: Any, x: Any, y: Any, batch_size: int,
                 from_logits: bool = False) -> None:
        import jax
        import jax.numpy as jnp
        import keras

        import mirrorax as mx

        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits, reduction=None)
        optimizer.build(model.trainable_variables)
        self.state = strategy.replicate(([v.value for v in model.trainable_variables],
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

        self.train_step = train_step
        self._strategy, self._data, self._batch_size = strategy, (x, y), batch_size

    def steps(self, n: int) -> None:
        """Runs ``n`` steps from the first batch; returns when the state is ready."""
        import jax

        done = 0
        while done < n:
            for batch in self._strategy.experimental_distribute_dataset(self._data, batch_size=self._batch_size):
                self.state, _ = self.train_step(self.state, batch)
                done += 1
                if done == n:
                    break
        jax.block_until_ready(self.state)


def run(args: Any) -> None:
    """Builds, warms up and times the loop on the strategy's API; writes the result."""
    import time

    import keras

    import mirrorax as mx
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    devices = _common.jax_devices(args)
    strategy = mx.MirroredStrategy(devices=devices)
    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = workloads.build_keras_model(wl)
    x_host, y_host = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)
    loop = GuideLoop(model, workloads.compile_args(wl)["optimizer"], strategy, x_host, y_host, args.batch,
                     from_logits=wl.is_lm)

    t0 = time.perf_counter()
    loop.steps(args.warmup)
    warmup_s = time.perf_counter() - t0
    rates = _common.time_runs(lambda: loop.steps(args.steps), args.repeats, args.steps * args.batch)
    _common.write_result(args, samples_per_s=rates, warmup_s=warmup_s, device_kind=devices[0].device_kind,
                         num_params=int(model.count_params()),
                         note=f"strategy.jit, compiled {loop.train_step.compile_count}x")


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.guide_api --workload W --devices N ...``."""
    args = _common.parse_args("guide_api", argv)
    _common.use_cpu_devices(args.devices)
    _common.main_guard(args, lambda: run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
