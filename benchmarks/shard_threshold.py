"""Where sharding a variable stops paying: the train step's time with every variable split over the devices
(``shard="optimizer"`` / ``"all"``, :data:`mirrorax.mesh.SHARD_MIN_SIZE` lowered to 0) against
replication, for variables of one size at a time.

A model of ``--variables`` variables of ``size`` elements each (each used once, so the step's compute is
small and the layout's cost shows), Adam, ``--devices`` simulated CPU devices. Sharding a variable saves
(devices - 1)/devices of its optimizer update and memory and costs a fixed part per collective
(reduce-scatter of its gradient, all-gather of its new value); the threshold is the size above which the
sharded step is no slower.

Run from the repository root::

    python -m benchmarks.shard_threshold --devices 8 --sizes 1024,4096,16384,65536,262144
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--sizes", default="1024,4096,16384,65536,262144", help="elements per variable")
    p.add_argument("--variables", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per mode (the median is reported)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import mirrorax as mx
    from mirrorax import mesh as mesh_lib

    mesh_lib.SHARD_MIN_SIZE = 0  # every variable is split: the size alone decides
    width = 128
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, width)).astype(np.float32)
    y = (np.arange(len(x)) % 10).astype(np.int32)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        shape = (size // width, width)
        params = {f"w{i}": rng.normal(size=shape).astype(np.float32) * 0.01 for i in range(args.variables)}

        def apply(p, x):
            h = x
            for i in range(args.variables):  # each variable once: a scale of the features
                h = h * (1.0 + jnp.mean(p[f"w{i}"], axis=0))
            return h[:, :10]

        times = {}
        for mode in (None, "optimizer", "all"):
            model = mx.FunctionalModel(apply, params, loss="sparse_categorical_crossentropy_from_logits",
                                       optimizer=optax.adam(1e-3))
            trainer = mx.Trainer(model, mx.MirroredStrategy(shard=mode))
            trainer.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=3, shuffle=False, verbose=0)
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                trainer.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=args.steps, shuffle=False,
                            verbose=0)
                jax.block_until_ready(trainer.state)
                runs.append((time.perf_counter() - t0) / args.steps)
            times[str(mode)] = sorted(runs)[len(runs) // 2]
        row = {"size": size, "bytes": size * 4, "step_ms": {k: v * 1e3 for k, v in times.items()},
               "optimizer_vs_none": times["optimizer"] / times["None"], "all_vs_none": times["all"] / times["None"]}
        rows.append(row)
        print(f"size {size:>8,} ({size * 4 / 1024:>6,.0f} KiB) x {args.variables}: step ms  none "
              f"{times['None'] * 1e3:7.2f}  optimizer {times['optimizer'] * 1e3:7.2f} "
              f"({row['optimizer_vs_none']:.3f}x)  all {times['all'] * 1e3:7.2f} ({row['all_vs_none']:.3f}x)",
              flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"devices": args.devices, "variables": args.variables, "batch": args.batch, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
