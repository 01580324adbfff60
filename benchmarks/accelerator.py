"""The accelerator table in one command: every mirrorax entry point against the hand-written JAX loop and
plain Keras, on the four workloads, with speed, MFU, peak device memory and time to first step.

Run from the repository root, on a machine with an accelerator (a TPU or GPU that JAX sees)::

    python -m benchmarks.accelerator                  # the whole table (about 9 minutes on one TPU v5e)
    python -m benchmarks.accelerator --workloads lm   # some workloads, some systems (--systems jax,mirrorax)
    python -m benchmarks.accelerator --workloads nnx  # the Flax NNX loops alone (benchmarks/nnx_loops.py)
    python -m benchmarks.accelerator --workloads mlp,mlp32,cnn,lm --systems jax,mirrorax_auto,keras_scope_auto
    python -m benchmarks.accelerator --cpu-smoke      # the same path on 1 CPU device at tiny sizes (CI)

The workload ``nnx`` is the Flax NNX table (``benchmarks/nnx_loops.py``: Flax's MNIST CNN and a small
transformer at batch 32 and 256, Flax's split/merge ``jax.jit`` loop, ``@nnx.jit``, ``@strategy.jit`` and
``mx.Trainer``), run in a process of its own; its rows follow the Keras table in ``results.md``.

The systems, on the same model, data, optimizer and global batch (``benchmarks/workloads.py``):

* ``jax``: the hand-written loop (``benchmarks/peers/jax_loop.py``): ``stateless_call`` / ``stateless_apply``
  in one ``jax.jit`` step, the state donated, each batch placed one step ahead, 2 steps in flight;
* ``mirrorax``: ``mx.Trainer(model).fit`` of a model compiled under ``MirroredStrategy().scope()``;
* ``keras_scope``: that model's own ``model.fit`` (the TF program unchanged);
* ``guide_api``: the keras.io guide's loop on ``strategy.jit`` (``benchmarks/peers/guide_api.py``);
* ``keras_fit``: plain Keras ``model.fit`` (no strategy);
* ``mirrorax_auto``, ``keras_scope_auto`` (not in the default table): ``mx.Trainer(model,
  steps_per_execution="auto")`` and ``model.fit`` of a model compiled with ``steps_per_execution="auto"`` under
  the scope. Before they are timed they fit chunks until ``"auto"`` has settled on its ``k`` (at most
  ``Plan.settle`` chunks; their number and time are in ``results.json``, ``settle_calls`` / ``settle_s``): the
  table gives the steady state, as the others' leaves their compiles out.

Each mirrorax system's timed ``fit`` calls also leave their own figures (``mx.utilisation``: the epoch's
printed MFU, the devices' busy share, the input's wait share, the ``k`` it ran at): a second table sets the
printed MFU beside the benchmark's own (``fit_figures`` in ``results.json``). The two differ where their FLOPs
differ (XLA's count of the compiled step against ``flops_per_sample``'s formula: ``xla_flops_ratio``) and
where their times do (a chunk includes its ``fit`` call's set-up, an epoch's record does not: the
``time_ratio``, the chunk's seconds over the record's).

How it measures. Every system runs in a process of its own: a system sharing a process with others slows
the hand loop (the bf16 transformer's ran 8,349-8,877 samples/s beside mirrorax's systems and 9,475-9,717
alone), which flattered mirrorax. The small workloads (``mlp``, ``cnn``, ``transformer``) run
``--process-rounds`` rounds (default 3) of a process per system, the processes alternating in ABBA order;
the ratio to the hand loop is the median over the rounds of the two systems' rates in that round, so drift
hits both alike. A process times ``rounds`` chunks; a chunk is one ``fit`` call (one ``steps(n)`` call of a
hand loop) of the workload's steps, its set-up included. The language model ``lm`` runs each system once,
so that the device's peak memory (``memory_stats()["peak_bytes_in_use"]``) is that system's.
Every process first runs a tiny Keras ``fit`` and a tiny mirrorax ``fit`` (the one-time costs of a process:
imports, JAX's and Keras's first programs), then each system's **time to first step**: its first call of
one step, from the call to the step's state being ready (the step's trace and compile included; the table
also gives, as medians over the timed builds, the XLA compile's share, which is the compiler's time and
varies up to 2x between builds of one program on a TPU, and the trace and lowering's, which is the
host's Python work and what a system controls), then a warm-up call, then the timed chunks. On a TPU the
first large program a process compiles takes ~1.5 s longer (the CNN: 4.7 s first, 3.2 s last in one
order; the same in reverse), so on mlp and cnn each process builds and times its system ``first_rounds``
times after an untimed first step of the hand loop; the median is shown.
MFU: model FLOPs per sample (``workloads.flops_per_sample``: ``6 x params`` per token, the embedding tables
left out, plus attention) times samples/s over the device's dense bf16 peak (``--peak-tflops``; known: TPU
v5e 197, v4 275, v5p 459, v6e 918, H100/H200 989 TFLOP/s). ``mx.plan`` is called after each mirrorax
system's timed runs and must compile nothing (``plan_compiles``).

Writes ``<out>/results.json`` (every process's raw figures) and ``<out>/results.md`` (the table), after
every process, so a run cut short keeps what it measured; ``<out>`` defaults to
``benchmarks/results/accelerator-<UTC time>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("jax", "mirrorax", "keras_scope", "guide_api", "keras_fit", "mirrorax_auto", "keras_scope_auto")
#: The table's systems unless ``--systems`` names others.
DEFAULT_SYSTEMS = SYSTEMS[:5]
AUTO = ("mirrorax_auto", "keras_scope_auto")
LABELS = {"jax": "hand-written JAX loop", "mirrorax": "Trainer.fit", "keras_scope": "model.fit under scope",
          "guide_api": "guide loop on strategy.jit", "keras_fit": "plain Keras fit",
          "mirrorax_auto": 'Trainer.fit, "auto"', "keras_scope_auto": 'model.fit under scope, "auto"'}
# Dense bf16 peaks, TFLOP/s per device, by jax's device_kind.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v4": 275.0, "TPU v5p": 459.0, "TPU v5": 459.0,
               "TPU v6 lite": 918.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H200": 989.0}


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one workload is measured on an accelerator.

    Attributes:
      steps: steps per timed chunk (one ``fit`` call); rounds: chunks per system; warmup: steps of the
      warm-up call after the first step; bf16: Keras's ``mixed_bfloat16`` policy; alone: one process per
      system (its own peak device memory) instead of one per workload; first_rounds: fresh builds per
      system whose first step is timed (systems in one process: forward and reverse order in turn, after
      one untimed first step of the hand loop, so that no system pays the compiler's first program alone);
      settle: the most chunks a ``steps_per_execution="auto"`` system fits before it is timed, until its
      choice of ``k`` has settled (a fused program must pay twice its compile within the steps to come, and
      a one-epoch fit counts the trainer's earlier fits' steps: on the CNN that is ~10,000 steps).
    """

    steps: int
    rounds: int = 3
    warmup: int = 10
    bf16: bool = False
    alone: bool = False
    first_rounds: int = 1
    settle: int = 8


# mlp, cnn: chunks of 2,048 steps, a multiple of every k "auto" may choose (an epoch's last steps short of a
# whole k run one a dispatch). The LM: 16 steps a chunk; "auto" decides after 18 dispatches of a fit, so
# ``--steps 24`` or more lets it decide in one (at 32 steps the fit's set-up is ~1.5-2.5% of an LM chunk).
PLANS = {"mlp": Plan(2048, first_rounds=4), "mlp32": Plan(2048, first_rounds=4), "cnn": Plan(2048, first_rounds=4),
         "transformer": Plan(1000, bf16=True), "lm": Plan(16, warmup=2, bf16=True, alone=True)}
SMOKE = {"mlp": Plan(4, rounds=2, warmup=1, first_rounds=2), "mlp32": Plan(4, rounds=2, warmup=1, settle=1),
         "cnn": Plan(4, rounds=2, warmup=1), "transformer": Plan(3, rounds=2, warmup=1, bf16=True),
         "lm": Plan(2, rounds=2, warmup=1, bf16=True, alone=True, settle=1)}


# -- the systems (in a child process) --------------------------------------------------------------------
class Runner:
    """One system on one workload: ``call(n)`` trains ``n`` steps and returns when the state is ready."""

    def __init__(self, call: Any, model: Any, trainer: Any = None) -> None:
        self.call, self.model, self.trainer = call, model, trainer


def build(system: str, wl: workloads.Workload, x: Any, y: Any, devices: list[Any]) -> Runner:
    """The system's model, optimizer and loop on ``devices`` (built, not yet compiled)."""
    import jax
    import keras

    import mirrorax as mx
    from benchmarks.peers.guide_api import GuideLoop
    from benchmarks.peers.jax_loop import HandLoop

    keras.utils.set_random_seed(0)
    batch = wl.batch
    if system == "jax":
        model = workloads.build_keras_model(wl)
        spec = workloads.compile_args(wl)
        mesh = jax.make_mesh((len(devices),), ("batch",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
        hand = HandLoop(model, spec["optimizer"], spec["loss"], mesh,
                        [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x) - batch + 1, batch)])
        return Runner(hand.steps, model)
    if system == "guide_api":
        model = workloads.build_keras_model(wl)
        guide = GuideLoop(model, workloads.compile_args(wl)["optimizer"], mx.MirroredStrategy(devices=devices),
                          x, y, batch, from_logits=wl.is_lm)
        return Runner(guide.steps, model)
    if system == "keras_fit":
        if len(devices) > 1:
            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl))

        def keras_fit(n: int) -> None:
            model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
            jax.block_until_ready([v.value for v in model.variables])

        return Runner(keras_fit, model)
    strategy = mx.MirroredStrategy(devices=devices)
    with strategy.scope():
        model = workloads.build_keras_model(wl)
        model.compile(**workloads.compile_args(wl),
                      **({"steps_per_execution": "auto"} if system == "keras_scope_auto" else {}))
    if system in ("keras_scope", "keras_scope_auto"):
        def scope_fit(n: int) -> None:
            model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
            jax.block_until_ready([v.value for v in model.variables])

        return Runner(scope_fit, model, trainer=model)
    trainer = mx.Trainer(model, strategy, steps_per_execution="auto" if system == "mirrorax_auto" else 1)

    def trainer_fit(n: int) -> None:
        trainer.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=n, shuffle=False, verbose=0)
        jax.block_until_ready(trainer.state)

    return Runner(trainer_fit, model, trainer=trainer)


def _process_warmup(devices: list[Any]) -> None:
    """A process's one-time costs, paid before any system is timed: a tiny plain Keras fit and a tiny
    mirrorax fit (imports, JAX's and Keras's first programs)."""
    import keras
    import numpy as np

    import mirrorax as mx

    x, y = np.zeros((8, 4), np.float32), np.zeros((8,), np.int32)
    for under in (None, mx.MirroredStrategy(devices=devices)):
        if under is None:
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        else:
            with under.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
                model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)


class _Compiles:
    """Counts XLA compiles (and persistent-cache loads) while active, and keeps where their time went."""

    def __init__(self) -> None:
        self.count = 0
        self.events: list[tuple[str, str, float]] = []  # (event's last word, function, seconds)

    def _duration(self, event: str, duration: float, **kwargs: Any) -> None:
        if event.endswith("backend_compile_duration"):
            self.count += 1
        if event.startswith("/jax/core/compile/"):
            self.events.append((event.rsplit("/", 1)[-1], str(kwargs.get("fun_name", "?")), duration))

    def breakdown(self) -> dict[str, Any]:
        """Seconds spent tracing, lowering and compiling, and the five longest compiles by function."""
        total = {k: 0.0 for k in ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration",
                                 "backend_compile_duration")}
        for kind, _, secs in self.events:
            if kind in total:
                total[kind] += secs
        compiles = sorted(((f, round(t, 3)) for k, f, t in self.events if k == "backend_compile_duration"),
                          key=lambda e: -e[1])
        return {"trace_s": total["jaxpr_trace_duration"], "lower_s": total["jaxpr_to_mlir_module_duration"],
                "compile_s": total["backend_compile_duration"], "compiles": self.count,
                "traces": sum(k == "jaxpr_trace_duration" for k, _, _ in self.events), "longest": compiles[:5]}

    def _event(self, event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.count += 1

    def __enter__(self) -> _Compiles:
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc: Any) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)


def _auto_phase(runner: Runner) -> str | None:
    """Where ``"auto"`` stands in a mirrorax system's newest fit (``fit/meter.py``: ``"settled"`` once its ``k``
    is chosen and checked); ``None``: the system does not run ``"auto"``."""
    import mirrorax as mx
    from mirrorax.keras.fit import trainer_of

    trainer = runner.trainer
    if trainer is None:
        return None
    engine = trainer if isinstance(trainer, mx.Trainer) else trainer_of(trainer)  # model.fit's own Trainer
    meter = engine.loop.meter
    return None if meter is None or meter.auto is None else str(meter.phase)


def _fit_figures(runner: Runner) -> dict[str, Any] | None:
    """The figures the newest fit of a mirrorax system recorded for its (one) epoch: what its progress line
    printed (``mx.utilisation``); ``None`` for the other systems."""
    import mirrorax as mx

    if runner.trainer is None:
        return None
    u = mx.utilisation(runner.model)[-1]
    return {"mfu": u.mfu, "device_busy": u.device_busy, "input_wait": u.input_wait, "k": u.steps_per_execution,
            "steps": u.steps, "seconds": u.seconds, "steps_per_second": u.steps_per_second,
            "flops_per_step": u.flops_per_step, "peak_flops": u.peak_flops,
            "host_seconds_per_step": u.host_seconds_per_step, "device_seconds_per_step": u.device_seconds_per_step}


def child(workload: str, systems: list[str], plan: Plan, out_path: str, process_round: int = 0) -> None:
    """Measures ``systems`` on ``workload`` in this process; appends one JSON line per system to ``out_path``
    (``process_round``: which of the parent's rounds of processes this one is)."""
    import jax
    import keras

    import mirrorax as mx

    wl = workloads.get(workload)
    devices = jax.devices()[:1]
    if plan.bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x, y = workloads.make_data(wl, wl.batch * max(plan.steps, plan.warmup, 1))
    _process_warmup(devices)
    runners, results = {}, {}
    firsts: dict[str, list[float]] = {s: [] for s in systems}
    breakdowns: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}  # each timed build's trace and compile
    if plan.first_rounds > 1:
        build("jax", wl, x, y, devices).call(1)  # the compiler's first program of this size, untimed
        for r in range(plan.first_rounds - 1):
            for s in systems[::-1] if r % 2 == 0 else systems:
                runner = build(s, wl, x, y, devices)
                t0 = time.perf_counter()
                with _Compiles() as counted:
                    runner.call(1)
                firsts[s].append(time.perf_counter() - t0)
                breakdowns[s].append(counted.breakdown())
                del runner
    for s in systems:
        runners[s] = build(s, wl, x, y, devices)
        t0 = time.perf_counter()
        with _Compiles() as first_compiles:
            runners[s].call(1)
        firsts[s].append(time.perf_counter() - t0)
        breakdowns[s].append(first_compiles.breakdown())
        first = statistics.median(firsts[s])
        t0 = time.perf_counter()
        runners[s].call(plan.warmup)
        warmup_s = time.perf_counter() - t0
        settle_calls, t0 = 0, time.perf_counter()
        while s in AUTO and settle_calls < plan.settle and _auto_phase(runners[s]) != "settled":
            runners[s].call(plan.steps)  # "auto" measures, decides, compiles its k and checks it here
            settle_calls += 1
        settle_s = time.perf_counter() - t0
        params = int(runners[s].model.count_params())
        results[s] = {"system": s, "workload": workload, "process_round": process_round,
                      "first_step_s": first, "first_steps_s": firsts[s],
                      "warmup_s": warmup_s, "chunk_s": [], "steps": plan.steps, "batch": wl.batch,
                      "settle_calls": settle_calls, "settle_s": settle_s, "auto_phase": _auto_phase(runners[s]),
                      "fit_figures": [],
                      "bf16": plan.bf16, "num_params": params, "seq_len": wl.seq_len,
                      "flops_per_sample": workloads.flops_per_sample(wl, params), "device_kind": devices[0].device_kind,
                      "first_step_breakdown": first_compiles.breakdown(),
                      # medians over the timed builds: the host's part (trace and lowering), and XLA's
                      "first_trace_s": statistics.median(b["trace_s"] + b["lower_s"] for b in breakdowns[s]),
                      "first_compile_s": statistics.median(b["compile_s"] for b in breakdowns[s])}
        print(f"{workload} {s}: first step {first:.2f} s (" + " ".join(f"{v:.2f}" for v in firsts[s])
              + f"); the last one's trace and compile: {json.dumps(first_compiles.breakdown())}", flush=True)
    for r in range(plan.rounds):
        for s in systems if r % 2 == 0 else systems[::-1]:
            t0 = time.perf_counter()
            runners[s].call(plan.steps)
            results[s]["chunk_s"].append(time.perf_counter() - t0)
            figures = _fit_figures(runners[s])  # (read after the clock: a list's last item)
            if figures is not None:
                results[s]["fit_figures"].append(figures)
    for s in systems:
        trainer = runners[s].trainer
        if trainer is not None:  # mx.plan of what was just trained: fit's own program, no compile
            x1, y1 = x[:1], y[:1]
            with _Compiles() as counted:
                mx.plan(trainer, x1, y1, batch_size=wl.batch, search=False)
            results[s]["plan_compiles"] = counted.count
    if plan.alone:
        stats = devices[0].memory_stats() or {}
        for s in systems:
            results[s]["device_peak_bytes"] = stats.get("peak_bytes_in_use")
    with open(out_path, "a") as f:
        for s in systems:
            f.write(json.dumps(results[s]) + "\n")


# -- the table (in the parent) ---------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]], peak_tflops: float | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and system: samples/s (the median chunk of all its processes), tokens/s, the ratio to the
    hand loop (the median over the rounds of processes of the two rates of each round: drift hits both alike),
    MFU, peak device memory and time to first step (medians over its processes)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["workload"], r["system"]), []).append(r)

    def rate_of(run: dict[str, Any]) -> float:
        return statistics.median(run["steps"] * run["batch"] / t for t in run["chunk_s"]) if run["chunk_s"] \
            else float("nan")

    for (w, s), runs in by.items():
        r = runs[-1]
        rates = [r_["steps"] * r_["batch"] / t for r_ in runs for t in r_["chunk_s"]]
        rate = statistics.median(rates) if rates else float("nan")
        hand = {run.get("process_round", 0): run for run in by.get((w, "jax"), [])}
        pairs = [(rate_of(run), rate_of(hand[run.get("process_round", 0)])) for run in runs
                 if run.get("process_round", 0) in hand]
        ratio = statistics.median(a / b for a, b in pairs) if pairs else None
        peak = peak_tflops or PEAK_TFLOPS.get(r.get("device_kind", ""))
        flops = r["flops_per_sample"] * rate
        compiles = [run.get("plan_compiles") for run in runs if run.get("plan_compiles") is not None]
        out.setdefault(w, {})[s] = {
            "samples_per_s": rate, "tokens_per_s": rate * r["seq_len"] if r["seq_len"] else None,
            "ratio_to_hand": ratio, "mfu": flops / (peak * 1e12) if peak else None,
            "device_peak_mib": r["device_peak_bytes"] / 2**20 if r.get("device_peak_bytes") else None,
            "first_step_s": statistics.median(run["first_step_s"] for run in runs),
            "plan_compiles": max(compiles) if compiles else None,
            "first_compile_s": statistics.median(run.get("first_compile_s", (run.get("first_step_breakdown") or {})
                                                         .get("compile_s")) or 0.0 for run in runs),
            "first_trace_s": statistics.median(run.get("first_trace_s") or 0.0 for run in runs),
            "processes": len(runs), "step_ms": 1e3 / (rate / r["batch"]) if rate else None}
        figures = [(run, f, t) for run in runs for f, t in zip(run.get("fit_figures") or [], run["chunk_s"])]
        if figures:
            out[w][s].update(_printed(figures, peak))
    return out


def _printed(figures: list[tuple[dict[str, Any], dict[str, Any], float]], peak: float | None) -> dict[str, Any]:
    """What a mirrorax system's fits recorded, ``(run, record, chunk seconds)`` per timed chunk: the printed MFU
    (median) beside the benchmark's own MFU of the same chunks, and what parts them: the FLOPs counted (XLA's
    count of the compiled step over the formula's) and the time (the chunk's over the epoch's record's)."""
    def median(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    own = [run["flops_per_sample"] * run["steps"] * run["batch"] / t / (peak * 1e12) if peak else None
           for run, _, t in figures]
    xla = [f["flops_per_step"] / (run["flops_per_sample"] * run["batch"]) if f.get("flops_per_step") else None
           for run, f, _ in figures]
    runs = {id(run): run for run, _, _ in figures}.values()
    return {"k": figures[-1][1]["k"], "ks": sorted({f["k"] for _, f, _ in figures}),
            "fit_mfu": median([f["mfu"] for _, f, _ in figures]), "chunk_mfu": median(own),
            "xla_flops_ratio": median(xla), "time_ratio": median([t / f["seconds"] for _, f, t in figures]),
            "device_busy": median([f["device_busy"] for _, f, _ in figures]),
            "input_wait": median([f["input_wait"] for _, f, _ in figures]),
            "settle_calls": max(run.get("settle_calls", 0) for run in runs),
            "settle_s": median([run.get("settle_s") for run in runs]),
            "auto_phase": sorted({str(run.get("auto_phase")) for run in runs})}


def markdown(summary: dict[str, dict[str, dict[str, Any]]], device: str) -> str:
    """The table: a row per workload and system."""
    lines = [f"Device: {device}. Ratio: samples/s over the hand-written loop's (>= 0.98 is the bar).", "",
             "| workload | system | samples/s | tokens/s | ms/step | / hand loop | MFU | peak device MiB | "
             "first step s | of which XLA compile s | of which trace and lowering s | plan compiles |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for w, systems in summary.items():
        for s in SYSTEMS:
            if s not in systems:
                continue
            v = systems[s]
            lines.append(f"| {w} | {LABELS[s]} | {v['samples_per_s']:,.1f} | {f(v['tokens_per_s'], ',.0f')} | "
                         f"{f(v['step_ms'], '.3f')} | {f(v['ratio_to_hand'], '.3f')} | "
                         f"{f(v['mfu'] and 100 * v['mfu'], '.1f')}{'%' if v['mfu'] else ''} | "
                         f"{f(v['device_peak_mib'], ',.0f')} | {v['first_step_s']:.2f} | "
                         f"{f(v.get('first_compile_s'), '.2f')} | {f(v.get('first_trace_s'), '.3f')} | "
                         f"{f(v['plan_compiles'], 'd')} |")
    printed = [(w, s, systems[s]) for w, systems in summary.items() for s in SYSTEMS
               if s in systems and "fit_mfu" in systems[s]]
    if printed:
        lines += ["", "Each fit's own figures (`mx.utilisation`: what its progress line printed), medians over the "
                  "timed chunks. MFU difference: printed less the benchmark's own, in points; it parts into the "
                  "FLOPs counted (XLA's count of the step over the formula's) and the time (a chunk's seconds, its "
                  "fit's set-up included, over the epoch record's). \"auto\" settled: the chunks fitted before "
                  "timing and their seconds.", "",
                  "| workload | system | k | printed MFU | benchmark MFU | difference | XLA FLOPs / formula | "
                  "chunk s / epoch s | device busy | input wait | \"auto\" settled |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}%"

        for w, s, v in printed:
            diff = None if v["fit_mfu"] is None or v["chunk_mfu"] is None else 100 * (v["fit_mfu"] - v["chunk_mfu"])
            settled = (f"{v['settle_calls']} chunks, {v['settle_s']:.1f} s ({'/'.join(v['auto_phase'])})"
                       if s in AUTO else "-")
            lines.append(f"| {w} | {LABELS[s]} | {'/'.join(str(k) for k in v['ks'])} | {pct(v['fit_mfu'])} | "
                         f"{pct(v['chunk_mfu'])} | {f(diff, '+.2f')} | {f(v['xla_flops_ratio'], '.4f')} | "
                         f"{f(v['time_ratio'], '.4f')} | {pct(v['device_busy'])} | {pct(v['input_wait'])} | "
                         f"{settled} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs the table; returns 0 if every process ran."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="mlp,cnn,transformer,lm,nnx")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"among {','.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--rounds", type=int, default=None, help="timed chunks per system (default 3)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per timed chunk (default: mlp, mlp32, cnn 2048; transformer 1000; lm 16)")
    p.add_argument("--first-rounds", type=int, default=None,
                   help="fresh builds per system whose first step is timed (default: mlp, cnn 4; others 1)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (default: known)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per process (default 420)")
    p.add_argument("--process-rounds", type=int, default=3,
                   help="processes per system on the small workloads, alternating (default 3); the LM: one each")
    p.add_argument("--cpu-smoke", action="store_true", help="1 CPU device, tiny sizes: checks the path only")
    p.add_argument("--process-round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    plans = SMOKE if args.cpu_smoke else PLANS
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    nnx = "nnx" in wanted
    names = [workloads.get(w).name for w in wanted if w != "nnx"]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; expected among {list(SYSTEMS)}")
    if args.child:
        os.environ.setdefault("KERAS_BACKEND", "jax")
        plan = plans[args.child]
        if args.rounds:
            plan = dataclasses.replace(plan, rounds=args.rounds)
        if args.steps:
            plan = dataclasses.replace(plan, steps=args.steps)
        if args.first_rounds and not plan.alone:
            plan = dataclasses.replace(plan, first_rounds=args.first_rounds)
        child(args.child, systems, plan, args.child_out, args.process_round)
        return 0
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"accelerator-{stamp}")
    os.makedirs(out, exist_ok=True)
    raw = os.path.join(out, "results.jsonl")
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="jax")
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "src"), env.get("PYTHONPATH", "")])
    if args.cpu_smoke:
        env.update(JAX_PLATFORMS="cpu", MIRRORAX_BENCH_TINY_LM="1", JAX_NUM_CPU_DEVICES="1")
    if args.peak_tflops:  # fit's printed MFU against the same peak as the table's
        env["MIRRORAX_PEAK_TFLOPS"] = str(args.peak_tflops)
    failed = []
    command = "python -m benchmarks.accelerator " + " ".join(argv if argv is not None else sys.argv[1:])
    for w in names:
        # A process per system: a system sharing a process slows the hand loop (the bf16 transformer's ran
        # 8,349-8,877 samples/s beside mirrorax's systems, 9,475-9,717 alone). The small workloads run
        # ``--process-rounds`` rounds of them, alternating; the LM one each (its peak memory is the process's).
        rounds = 1 if plans[w].alone else max(1, args.process_rounds)
        groups = [(r, [s]) for r in range(rounds) for s in (systems if r % 2 == 0 else systems[::-1])]
        for process_round, group in groups:
            cmd = [sys.executable, "-m", "benchmarks.accelerator", "--child", w, "--systems", ",".join(group),
                   "--child-out", raw, "--process-round", str(process_round)] + \
                  (["--rounds", str(args.rounds)] if args.rounds else []) + \
                  (["--steps", str(args.steps)] if args.steps else []) + \
                  (["--first-rounds", str(args.first_rounds)] if args.first_rounds else []) + \
                  (["--cpu-smoke"] if args.cpu_smoke else [])
            t0 = time.monotonic()
            try:
                rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            print(f"{w} {','.join(group)}: rc {rc} in {time.monotonic() - t0:.0f} s", flush=True)
            if rc != 0:
                failed.append(f"{w}/{','.join(group)}: {rc}")
            rows = [json.loads(line) for line in open(raw)] if os.path.exists(raw) else []
            summary = summarize(rows, args.peak_tflops)
            device = rows[0]["device_kind"] if rows else "?"
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump({"date": stamp, "command": command, "device": device, "failed": failed,
                           "summary": summary, "runs": rows}, f, indent=1)
            with open(os.path.join(out, "results.md"), "w") as f:
                f.write(f"{stamp}, `{command}`\n\n" + markdown(summary, device)
                        + (f"\nFailed: {failed}\n" if failed else ""))
    if nnx:
        if not names:  # (the NNX table alone)
            with open(os.path.join(out, "results.md"), "w") as f:
                f.write(f"{stamp}, `{command}`\n")
        nnx_args = (["--workloads", "guide", "--batches", "8", "--steps", "3", "--rounds", "2", "--process-rounds", "1"]
                    if args.cpu_smoke else ["--workloads", "cnn,transformer", "--batches", "32,256", "--steps", "1000",
                                            "--rounds", "3", "--process-rounds", str(max(1, args.process_rounds))])
        cmd = [sys.executable, "-m", "benchmarks.nnx_loops", *nnx_args, "--out", os.path.join(out, "nnx.json")]
        t0 = time.monotonic()
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"nnx: rc {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(f"nnx: {rc}")
        from benchmarks import nnx_loops

        nnx_rows = json.load(open(os.path.join(out, "nnx.json"))) if os.path.exists(os.path.join(out, "nnx.json")) \
            else []
        with open(os.path.join(out, "results.md"), "a") as f:
            f.write("\nFlax NNX loops (`benchmarks/nnx_loops.py`), steps/s and the ratio to Flax's split/merge "
                    "`jax.jit` loop (>= 0.98 is the bar):\n\n" + nnx_loops.markdown(nnx_rows)
                    + (f"\nFailed: {failed}\n" if failed else ""))
    print(open(os.path.join(out, "results.md")).read(), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
