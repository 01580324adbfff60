"""The system under test: mirrorax through its public API (``MirroredStrategy``, ``Trainer.fit``).

The model is built and compiled under ``strategy.scope()`` with the workload's optimizer, loss and
metrics; ``Trainer(model).fit(x, y, ...)`` runs once with ``--warmup`` steps (compiles), then
``--repeats`` timed ``fit`` calls of ``--steps`` steps each on the same host arrays. A timed call may
not compile again (checked with ``Trainer.compile_counts`` where the engine has it). Each call's time
ends when it returns and the state is ready.

With ``shard`` (the ``mirrorax_optimizer`` and ``mirrorax_all`` systems) the strategy shards the
optimizer state, or the parameters too. Every run also records what one device holds: the state's
bytes (measured on device 0) and the compiled step's temporaries, peak and FLOPs (``mx.plan`` of the
trainer's own step, taken from JAX's compilation cache: no compile more).

Run: ``python -m benchmarks.peers.mirrorax_trainer --workload mlp --devices 2``.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from benchmarks.peers import _common


def run(args: Any, shard: str | None = None) -> None:
    """Builds, warms up and times ``Trainer.fit`` (``shard``: the strategy's mode); writes the result."""
    import time

    import jax
    import keras

    import mirrorax as mx
    from benchmarks import workloads

    wl = workloads.get(args.workload)
    devices = _common.jax_devices(args)
    strategy = mx.MirroredStrategy(devices=devices, shard=shard) if shard else mx.MirroredStrategy(devices=devices)
    if args.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl))
    options: dict[str, Any] = {}
    if args.steps_per_execution > 1:
        if "steps_per_execution" not in inspect.signature(mx.Trainer).parameters:
            raise RuntimeError("this mirrorax has no Trainer(steps_per_execution=...)")
        options["steps_per_execution"] = args.steps_per_execution
    trainer = mx.Trainer(model, strategy, **options)

    x, y = workloads.make_data(wl, args.batch * max(args.steps, args.warmup), seed=args.seed)

    def fit(steps: int) -> None:
        trainer.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
        jax.block_until_ready(trainer.state)

    t0 = time.perf_counter()
    fit(args.warmup)
    warmup_s = time.perf_counter() - t0
    counts = _compile_counts(trainer)
    rates = _common.time_runs(lambda: fit(args.steps), args.repeats, args.steps * args.batch)
    note = f"mirrorax {mx.__version__}" + (f", steps_per_execution={args.steps_per_execution}"
                                             if args.steps_per_execution > 1 else "") + (f", shard={shard}"
                                                                                        if shard else "")
    memory = _per_device_memory(trainer, x, y, args.batch) if args.steps_per_execution == 1 else {}
    after = _compile_counts(trainer)
    if counts is not None and after != counts:
        note += f"; RECOMPILED during timed runs: {counts} -> {after}"
    _common.write_result(args, samples_per_s=rates, warmup_s=warmup_s, device_kind=devices[0].device_kind,
                         num_params=int(model.count_params()), note=note, compile_counts=after, **memory)


def _per_device_memory(trainer: Any, x: Any, y: Any, batch: int) -> dict[str, Any]:
    """Device 0's share: the state's bytes as held, and the compiled step's as its plan reads them."""
    import jax

    import mirrorax as mx

    plan_of = getattr(mx, "plan", None)
    if plan_of is None:  # an older mirrorax
        return {}
    d0 = trainer.strategy.devices[0]
    held = sum(sh.data.nbytes for g in ("params", "optimizer", "model_state")
               for a in jax.tree.leaves(trainer.state[g]) for sh in a.addressable_shards if sh.device == d0)
    p = plan_of(trainer, x[:1], y[:1], batch_size=batch, search=False)  # fit's own program: no compile
    return {"state_bytes_per_device": int(held),
            "planned_state_bytes": int(p.state_bytes),
            "temp_bytes_per_device": int(p.temp_bytes), "peak_bytes_per_device": int(p.peak_bytes),
            "flops_per_step": float(p.flops), "collective_bytes_per_step": int(p.collective_bytes)}


def _compile_counts(trainer: Any) -> dict[str, int] | None:
    fn = getattr(trainer, "compile_counts", None)
    return dict(fn()) if fn is not None else None


def main(argv: list[str] | None = None, *, shard: str | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.mirrorax_trainer --workload W --devices N ...``."""
    args = _common.parse_args("mirrorax" + (f"_{shard}" if shard else ""), argv)
    _common.use_cpu_devices(args.devices)
    _common.main_guard(args, lambda: run(args, shard))


if __name__ == "__main__":
    main(sys.argv[1:])
