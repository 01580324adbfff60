"""Time to first step of ``Trainer.fit`` with ``on_nonfinite="raise"`` against ``"ignore"``, alternated.

Measured on a TPU v5e at commit 92e3751, where ``"ignore"`` with host-checked labels compiled the step
without the non-finite guard's ``lax.cond``: the 219M-parameter LM's step compiled in 41.0 s that way
against 33.0 s with the branch (benchmarks/README.md). Every mode now has the branch, so on today's code
both modes compile the same program shape; the script stays as the record, and to look again with a
later XLA. Fresh builds alternated, after an untimed first step of the hand loop; prints (seconds to the
first step, of which XLA compile, of which trace) per build.

    python -m benchmarks.guard_compile --workload lm --rounds 1     # on an accelerator
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="cnn")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import keras

    import mirrorax as mx
    from benchmarks import accelerator as acc
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    if acc.PLANS[wl.name].bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x, y = workloads.make_data(wl, wl.batch * 2)
    devices = jax.devices()[:1]
    acc._process_warmup(devices)
    acc.build("jax", wl, x, y, devices).call(1)  # the compiler's first program of this size, untimed
    out: dict[str, list[tuple[float, float, float]]] = {"raise": [], "ignore": []}
    for r in range(args.rounds):
        for mode in ("ignore", "raise") if r % 2 == 0 else ("raise", "ignore"):
            keras.utils.set_random_seed(0)
            strategy = mx.MirroredStrategy(devices=devices)
            with strategy.scope():
                model = workloads.build_keras_model(wl)
                model.compile(**workloads.compile_args(wl))
            trainer = mx.Trainer(model, strategy, on_nonfinite=mode)
            with acc._Compiles() as counted:
                t0 = time.perf_counter()
                trainer.fit(x, y, batch_size=wl.batch, epochs=1, steps_per_epoch=1, shuffle=False, verbose=0)
                jax.block_until_ready(trainer.state)
                took = time.perf_counter() - t0
            b = counted.breakdown()
            out[mode].append((round(took, 2), round(b["compile_s"], 2), round(b["trace_s"], 2)))
            print(wl.name, mode, out[mode][-1], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
