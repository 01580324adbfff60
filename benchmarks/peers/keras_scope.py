"""mirrorax, entry point (1): the TF program unchanged, Keras's own ``model.fit`` of a model built and
compiled under ``mx.MirroredStrategy(devices=jax.devices()[:N]).scope()``.

Timing: a warm-up ``fit`` call (compiles), then ``--repeats`` timed ``fit`` calls of ``--steps`` steps each
on the same host arrays; a call's time ends when it returns and the model's variables are ready.

Run: ``python -m benchmarks.peers.keras_scope --workload mlp --devices 2``.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.peers import _common


def run(args: Any) -> None:
    """Builds under the scope, warms up and times ``model.fit``; writes the result."""
    import time

    import jax
    import keras

    import mirrorax as mx
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    devices = _common.jax_devices(args)
    strategy = mx.MirroredStrategy(devices=devices)
    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl), steps_per_execution=args.steps_per_execution)

    x, y = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)

    def fit(steps: int) -> None:
        model.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.trainable_variables])

    t0 = time.perf_counter()
    fit(args.warmup)
    warmup_s = time.perf_counter() - t0
    counts = mx.keras.fit.trainer_of(model).compile_counts()
    rates = _common.time_runs(lambda: fit(args.steps), args.repeats, args.steps * args.batch)
    after = mx.keras.fit.trainer_of(model).compile_counts()
    note = "model.fit under strategy.scope()" + ("" if after == counts else f"; RECOMPILED: {counts} -> {after}")
    _common.write_result(args, samples_per_s=rates, warmup_s=warmup_s, device_kind=devices[0].device_kind,
                         num_params=int(model.count_params()), note=note, compile_counts=after)


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.keras_scope --workload W --devices N ...``."""
    args = _common.parse_args("keras_scope", argv)
    _common.use_cpu_devices(args.devices)
    _common.main_guard(args, lambda: run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
