"""Peer (3): ``tf.distribute.MirroredStrategy`` over N logical CPU devices, Keras 3 on the TensorFlow backend.

The same Keras model (built by ``benchmarks.workloads``) is created and compiled under
``MirroredStrategy(["/cpu:0", ..., "/cpu:N-1"])`` after the host CPU is split into N logical devices with
``tf.config.set_logical_device_configuration``, and trained with ``model.fit`` on a ``tf.data`` pipeline of
the same arrays (batched to the global batch, prefetched), which the strategy splits over its replicas.
Keras picks XLA compilation itself (``jit_compile="auto"``).

Needs ``pip install tensorflow-cpu``. Run: ``python -m benchmarks.peers.tf_mirrored --workload mlp --devices 2``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from benchmarks.peers import _common


def run(args: Any) -> None:
    """Builds, warms up and times ``model.fit`` under MirroredStrategy; writes the result."""
    import time

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices)
    import keras

    from benchmarks import workloads

    wl = workloads.get(args.workload)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.devices)])
    if strategy.num_replicas_in_sync != args.devices:
        raise RuntimeError(f"Expected {args.devices} replicas. Received: {strategy.num_replicas_in_sync}")
    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl), steps_per_execution=args.steps_per_execution)

    x, y = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True)
               .with_options(options).prefetch(tf.data.AUTOTUNE))

    def fit(steps: int) -> None:
        model.fit(dataset, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)

    t0 = time.perf_counter()
    fit(args.warmup)
    warmup_s = time.perf_counter() - t0
    rates = _common.time_runs(lambda: fit(args.steps), args.repeats, args.steps * args.batch)
    _common.write_result(args, samples_per_s=rates, warmup_s=warmup_s, device_kind="cpu (logical)",
                         num_params=int(model.count_params()),
                         note=f"tf {tf.__version__}, jit_compile={model.jit_compile}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.tf_mirrored --workload W --devices N ...``."""
    args = _common.parse_args("tf_mirrored", argv)
    os.environ["KERAS_BACKEND"] = "tensorflow"  # process-wide, hence a process of its own
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _common.main_guard(args, lambda: run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
