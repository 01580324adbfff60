"""The ``mirrorax`` command: ``train`` (the main job), ``plan``, ``devices``, ``launch``.

Flags map one-to-one onto library arguments; nothing is read from config files.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {n}")
    return n


def _configure_devices(cpu_devices: int | None) -> None:
    """Must run before anything starts JAX's backend."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if cpu_devices is not None:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrorax",
                                     description="Synchronous data-parallel training for JAX and Keras 3.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the digits CNN on every local device (the main job)",
                           description="Trains a small CNN on handwritten digits (scikit-learn's bundled set, or a "
                                       "local MNIST .npz) on every device, and reports test accuracy and samples/s.")
    train.add_argument("--epochs", type=_positive, default=12)
    train.add_argument("--batch-size", type=_positive, default=64, help="global batch, over all devices (default 64)")
    train.add_argument("--learning-rate", type=float, default=3e-3)
    train.add_argument("--data", default=None, help="a local MNIST .npz (x_train, y_train, x_test, y_test); "
                                                    "default: scikit-learn's bundled 8x8 digits")
    train.add_argument("--cpu-devices", type=_positive, default=None,
                       help="simulate N CPU devices (for machines without accelerators)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--steps-per-execution", type=_positive, default=1)
    train.add_argument("--mixed-precision", choices=["bfloat16", "float16"], default=None)
    train.add_argument("--compilation-cache", default=None,
                       help="JAX persistent compilation cache directory "
                            "(default ~/.cache/mirrorax/xla; 'off' disables)")
    train.add_argument("--checkpoint-dir", default=None, help="save checkpoints here and resume from the newest")
    train.add_argument("--checkpoint-every", default="epoch", help="steps between checkpoints, or 'epoch'")
    train.add_argument("--verbose", default="auto", choices=["auto", "0", "1", "2"])
    train.set_defaults(func=_train)

    plan = sub.add_parser("plan", help="per-device memory, FLOPs and collectives of a train step, before running it",
                          description="Compiles the train step of a model without running it and prints its "
                                      "per-device cost; with --device-memory, the largest global batch that fits in "
                                      "each sharding mode.")
    plan.add_argument("--model", choices=["cnn", "mlp"], default="cnn",
                      help="the main job's digits CNN, or a 784-512-10 MLP")
    plan.add_argument("--batch-size", type=_positive, default=64, help="global batch (default 64)")
    plan.add_argument("--shard", choices=["none", "optimizer", "all"], default="none")
    plan.add_argument("--device-memory", default=None, help="memory per device, e.g. 24GB (default: the device's own)")
    plan.add_argument("--cpu-devices", type=_positive, default=None, help="simulate N CPU devices")
    plan.set_defaults(func=_plan)

    devices = sub.add_parser("devices", help="list the devices JAX sees")
    devices.add_argument("--cpu-devices", type=_positive, default=None)
    devices.set_defaults(func=_devices)

    try:
        from mirrorax.cluster import launch as _launch
    except ImportError:  # pragma: no cover - the launcher ships with the package
        pass
    else:
        _launch.add_parser(sub)
    return parser


def _plan(args: argparse.Namespace) -> int:
    _configure_devices(args.cpu_devices)
    import keras
    import numpy as np

    import mirrorax as mx
    from mirrorax import zoo

    strategy = mx.MirroredStrategy(shard=None if args.shard == "none" else args.shard)
    with strategy.scope():
        if args.model == "cnn":
            model, x = zoo.digits_cnn(), np.zeros((1, 8, 8, 1), np.float32)
        else:
            model, x = zoo.mlp(), np.zeros((1, 784), np.float32)
        model.compile(optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    result = mx.plan(model, x, np.zeros(1, np.int32), batch_size=args.batch_size, strategy=strategy,
                     device_memory=args.device_memory)
    if strategy.is_primary:
        print(result)
    return 0


def _devices(args: argparse.Namespace) -> int:
    _configure_devices(args.cpu_devices)
    import jax

    from mirrorax.cluster import join as cluster

    cluster.maybe_initialize_from_env()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, process {jax.process_index()} of "
          f"{jax.process_count()}")
    for d in jax.devices():
        local = "local" if d.process_index == jax.process_index() else f"process {d.process_index}"
        print(f"  {d.id:>3}  {d.platform:<5} {d.device_kind:<24} {local}")
    print(f"{len(jax.devices())} device(s) in all, {jax.local_device_count()} on this process")
    return 0


def _train(args: argparse.Namespace) -> int:
    """The main job, written as the TF program users know: build and compile under the strategy's
    scope, then the model's own ``fit``. ``--checkpoint-dir`` uses the explicit :class:`mirrorax.Trainer`
    (checkpoints of the whole state, resumable on any device count)."""
    _configure_devices(args.cpu_devices)
    import keras
    import numpy as np

    import mirrorax as mx
    from mirrorax import zoo

    if args.compilation_cache != "off":
        mx.enable_compilation_cache(args.compilation_cache)
    strategy = mx.MirroredStrategy()
    say = print if strategy.is_primary else (lambda *a, **k: None)
    say(f"Devices: {strategy.num_replicas_in_sync} x {strategy.devices[0].platform} "
        f"({strategy.process_count} process(es)); global batch {args.batch_size}")
    (x, y), (xt, yt) = zoo.load_digits(args.data, seed=args.seed)
    say(f"Data: {len(x)} training and {len(xt)} test images of {x.shape[1]}x{x.shape[2]} "
        f"({'MNIST .npz ' + args.data if args.data else 'scikit-learn digits'})")
    keras.utils.set_random_seed(args.seed)
    verbose = args.verbose if args.verbose == "auto" else int(args.verbose)
    if verbose == "auto":  # a bar on a terminal, one line per epoch in a log file or a pipe
        verbose = 1 if sys.stdout.isatty() else 2
    if args.checkpoint_dir:
        with strategy.scope():
            model = zoo.digits_cnn(x.shape[1:], int(max(y.max(), yt.max())) + 1)
            model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        trainer = mx.Trainer(model, steps_per_execution=args.steps_per_execution,
                             mixed_precision=args.mixed_precision)
        every = args.checkpoint_every
        start = time.perf_counter()
        history = trainer.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_data=(xt, yt),
                              seed=args.seed, verbose=verbose, checkpoint_dir=args.checkpoint_dir,
                              checkpoint_every=every if every == "epoch" else int(every))
        wall = time.perf_counter() - start
        result = trainer.evaluate(xt, yt, batch_size=256)
        sps = history.samples_per_second
    else:
        if args.mixed_precision:
            keras.mixed_precision.set_global_policy(f"mixed_{args.mixed_precision}")
        with strategy.scope():  # the TF program: only the strategy line differs
            model = zoo.digits_cnn(x.shape[1:], int(max(y.max(), yt.max())) + 1)
            model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                          steps_per_execution=args.steps_per_execution)
        timer = _epoch_timer(len(x))
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_data=(xt, yt),
                  verbose=verbose if strategy.is_primary else 0, callbacks=[timer])
        wall = time.perf_counter() - start
        loss, accuracy = model.evaluate(xt, yt, batch_size=256, verbose=0)
        result = {"loss": loss, "accuracy": accuracy}
        sps = timer.samples_per_second
    steady = float(np.median(sps[1:])) if len(sps) > 1 else float(sps[0]) if sps else 0.0
    say(f"Test accuracy: {result['accuracy']:.4f} (loss {result['loss']:.4f})")
    say(f"Throughput: {steady:,.0f} samples/s (median over epochs after the first); fit took {wall:.1f} s "
        f"on {strategy.num_replicas_in_sync} device(s)")
    return 0


def _epoch_timer(samples: int):
    """A Keras callback timing each epoch's training part (until validation starts): samples/s."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.samples_per_second: list[float] = []
            self._start = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_test_begin(self, logs=None):
            if self._start:
                self.samples_per_second.append(samples / (time.perf_counter() - self._start))
                self._start = 0.0

    return EpochTimer()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mirrorax`` console script."""
    args = _build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover - python -m mirrorax.cli
    sys.exit(main())
