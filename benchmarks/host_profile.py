"""Per-step host cost of each entry point beside the hand-written loop, in one process.

Interleaved timing first (4 chunks of ``--steps`` steps per system, ABBA order; the best chunk of each),
then a cProfile of one chunk of each system, by own time: where a system's extra host time per step goes
(e.g. JAX's C++ dispatch of a program with more state leaves, a per-leaf lookup in Python).

    python -m benchmarks.host_profile --workload mlp --steps 2000       # on an accelerator
    python -m benchmarks.host_profile --workload transformer --bf16 --steps 1000

The systems are ``benchmarks.accelerator``'s on the same model and data: the hand loop
(``peers/jax_loop.py``), ``Trainer.fit``, ``model.fit`` under the scope and the guide loop on
``strategy.jit`` (``peers/guide_api.py``), all on the first device.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Per-step host cost of each entry point beside the hand loop.")
    p.add_argument("--workload", default="mlp")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--bf16", action="store_true", help="Keras's mixed_bfloat16 policy")
    p.add_argument("--top", type=int, default=22, help="functions shown per profile")
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")

    import jax
    import keras

    import mirrorax as mx
    from benchmarks import workloads
    from benchmarks.peers.guide_api import GuideLoop
    from benchmarks.peers.jax_loop import HandLoop

    wl = workloads.get(args.workload)
    n = args.steps
    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    b = wl.batch
    x, y = workloads.make_data(wl, n * b)
    devices = jax.devices()[:1]
    mesh = jax.make_mesh((1,), ("batch",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    spec = workloads.compile_args(wl)
    keras.utils.set_random_seed(0)
    hand = HandLoop(workloads.build_keras_model(wl), spec["optimizer"], spec["loss"], mesh,
                    [(x[i:i + b], y[i:i + b]) for i in range(0, len(x), b)])
    strategy = mx.MirroredStrategy(devices=devices)
    with strategy.scope():
        m1 = workloads.build_keras_model(wl)
        m1.compile(**workloads.compile_args(wl))
        m2 = workloads.build_keras_model(wl)
        m2.compile(**workloads.compile_args(wl))
    trainer = mx.Trainer(m1, strategy)
    guide = GuideLoop(workloads.build_keras_model(wl), workloads.compile_args(wl)["optimizer"], strategy, x, y, b,
                      from_logits=wl.is_lm)

    def fit(model: keras.Model | mx.Trainer, steps: int) -> None:
        model.fit(x, y, batch_size=b, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)

    systems: dict[str, Callable[[int], None]] = {
        "hand": hand.steps,
        "trainer": lambda k: (fit(trainer, k), jax.block_until_ready(trainer.state))[0],
        "scope": lambda k: (fit(m2, k), jax.block_until_ready([v.value for v in m2.trainable_variables]))[0],
        "guide": guide.steps,
    }
    for f in systems.values():  # compile, then one warm call
        f(5)
        f(5)
    took: dict[str, list[float]] = {k: [] for k in systems}
    for r in range(4):
        for k in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
            t = time.perf_counter()
            systems[k](n)
            took[k].append((time.perf_counter() - t) / n * 1e6)
    for k, v in took.items():
        print(f"{wl.name} {k:8s} {min(v):7.1f} us/step  ratio {min(took['hand']) / min(v):.3f}  "
              f"{[round(a) for a in v]}", flush=True)
    for k, f in systems.items():
        prof = cProfile.Profile()
        prof.enable()
        f(n)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        print(f"==== profile {wl.name} {k} ({n} steps): {stats.total_tt / n * 1e6:.1f} us/step under the profiler\n"  # type: ignore[attr-defined]
              + "\n".join(out.getvalue().splitlines()[4:]), flush=True)


if __name__ == "__main__":
    main()
