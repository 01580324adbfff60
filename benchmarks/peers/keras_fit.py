"""Peer (2): Keras 3 ``model.fit`` on the JAX backend, with ``keras.distribution.DataParallel`` at N > 1.

At 1 device this is plain ``model.fit`` (no distribution), the baseline most Keras users start from. At
N > 1 the model is built under ``DataParallel(devices=jax.devices()[:N])``. Keras' JAX trainer dispatches
steps without bounding how many are in flight; on a small CPU host that aborts in XLA's rendezvous
("Expected N threads to join the rendezvous"), which the harness records as the result it is.

Timing: a warm-up ``fit`` call (compiles), then ``--repeats`` timed ``fit`` calls of ``--steps`` steps each;
a call's time ends when it returns and the model's variables are ready.

Run: ``python -m benchmarks.peers.keras_fit --workload mlp --devices 1``.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.peers import _common


def run(args: Any) -> None:
    """Builds, warms up and times ``model.fit``; writes the result."""
    import time

    import jax
    import keras

    from benchmarks import workloads

    wl = workloads.get(args.workload)
    devices = _common.jax_devices(args)
    if args.devices > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = workloads.build_keras_model(wl)
    model.compile(**workloads.compile_args(wl), steps_per_execution=args.steps_per_execution)

    x, y = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)

    def fit(steps: int) -> None:
        model.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.variables])

    t0 = time.perf_counter()
    fit(args.warmup)
    warmup_s = time.perf_counter() - t0
    rates = _common.time_runs(lambda: fit(args.steps), args.repeats, args.steps * args.batch)
    _common.write_result(args, samples_per_s=rates, warmup_s=warmup_s, device_kind=devices[0].device_kind,
                         num_params=int(model.count_params()),
                         note="DataParallel" if args.devices > 1 else "no distribution")


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.keras_fit --workload W --devices N ...``."""
    args = _common.parse_args("keras_fit", argv)
    _common.use_cpu_devices(args.devices)
    _common.main_guard(args, lambda: run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
