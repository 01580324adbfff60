"""Keras's ``*_on_batch`` calls under a strategy's scope against plain Keras's: milliseconds a call.

A loop of ``train_on_batch`` (a GAN's, a reinforcement learner's) pays the host's work of every call: the batch
read and checked, the step dispatched, the logs brought back. This times ``train_on_batch``, ``test_on_batch``
and ``predict_on_batch`` of one small model (a tanh MLP, 64 rows, 32 -> 64 -> 10, Adam), built the same way
plainly and under ``mx.MirroredStrategy`` over ``--devices`` devices, alternating the two for ``--rounds``
rounds of ``--calls`` calls (the best round of each is reported: the host's drift hits both alike).

Run: ``python -m benchmarks.on_batch --devices 2`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any


def _model(strategy: Any = None) -> Any:
    import contextlib

    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def _per_call_ms(call: Any, model: Any, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        call(model)
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices of the strategy")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices))
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import numpy as np

    import mirrorax as mx

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    models = {"plain Keras": _model(), f"under scope, {args.devices} devices":
              _model(mx.MirroredStrategy(jax.devices()[:args.devices]))}
    kinds = {"train_on_batch": lambda m: m.train_on_batch(x, y), "test_on_batch": lambda m: m.test_on_batch(x, y),
             "predict_on_batch": lambda m: m.predict_on_batch(x)}
    best: dict[tuple[str, str], float] = {}
    for m in models.values():  # compile every call kind first
        for call in kinds.values():
            for _ in range(5):
                call(m)
    for r in range(args.rounds):
        for name, m in (models.items() if r % 2 == 0 else reversed(models.items())):
            for kind, call in kinds.items():
                ms = _per_call_ms(call, m, args.calls)
                best[(name, kind)] = min(ms, best.get((name, kind), float("inf")))
    print(f"| call | {' | '.join(models)} |\n|---|" + "---:|" * len(models))
    for kind in kinds:
        print(f"| `{kind}` | " + " | ".join(f"{best[(name, kind)]:.2f} ms" for name in models) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
