"""A workload's train step FLOPs as XLA counts them against the formula the accelerator table's MFU uses.

``benchmarks/accelerator.py`` computes MFU from :func:`benchmarks.workloads.flops_per_sample` (``6 x params``
per token, the embedding tables left out, plus attention); each epoch of ``fit`` prints MFU from XLA's count
of the compiled step (``cost_analysis``, what ``mx.plan`` reports). This prints both for each workload, per
sample, and their ratio, with the formula that counted the tables (before issue 58) beside them.

Run: ``python -m benchmarks.model_flops --workloads lm`` (the 219M LM's step compiles in about 15 s on a CPU;
``--layers 2`` for a shallower one of the same widths).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
os.environ.setdefault("KERAS_BACKEND", "jax")

from benchmarks import workloads  # noqa: E402


def count(name: str, layers: int | None = None) -> dict[str, float]:
    """XLA's FLOPs per sample of workload ``name``'s train step (at its global batch, on one device: the
    optimizer's update shared by the batch) and the formulas'."""
    import jax

    import mirrorax as mx

    wl = workloads.get(name)
    if layers is not None:
        wl = dataclasses.replace(wl, layers=layers)
    x, y = workloads.make_data(wl, wl.batch)
    strategy = mx.MirroredStrategy(devices=jax.devices()[:1])
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl))
    xla = mx.plan(mx.Trainer(model, strategy), x, y, batch_size=wl.batch, search=False).flops / wl.batch
    params = int(model.count_params())
    formula = workloads.flops_per_sample(wl, params)
    tables = 6.0 * (wl.vocab + wl.seq_len) * wl.width * wl.seq_len if wl.is_lm else 0.0
    return {"params": params, "xla": xla, "formula": formula, "with_tables": formula + tables}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="lm")
    p.add_argument("--layers", type=int, default=None, help="the language models' blocks (default: theirs)")
    args = p.parse_args(argv)
    for name in args.workloads.split(","):
        c = count(name, args.layers)
        print(f"{name}: {c['params']:,} parameters; FLOPs per sample: XLA {c['xla']:.4e}, formula {c['formula']:.4e} "
              f"(XLA / formula {c['xla'] / c['formula']:.4f}); with the embedding tables counted "
              f"{c['with_tables']:.4e} ({c['xla'] / c['with_tables']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
