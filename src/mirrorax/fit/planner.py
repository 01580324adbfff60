"""``mx.plan`` (``mirrorax.fit.planner``): what a training step will cost on each device, known before step 1.

The train step is compiled without running (``jit(...).lower(abstract args).compile()``, abstract arrays
carry the strategy's layouts), and read: XLA's ``memory_analysis()`` (arguments, outputs, temporaries,
per device), ``cost_analysis()["flops"]`` and the collectives in the compiled program (their result
bytes, their device groups and what each device sends within its host and across hosts:
:mod:`mirrorax.traffic`). The state's own bytes per device come from each variable's shape and layout, exactly. Given a
per-device memory, the largest global batch that fits is searched for in every sharding mode, with
compile-only programs (a few seconds each).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import IO, Any

import jax
import numpy as np

from mirrorax.fit import utilisation
from mirrorax.fit.device_state import DeviceState
from mirrorax.fit.functions import StepFunctions
from mirrorax.fit.utilisation import parse_bytes, peak_flops
from mirrorax.inputs.batch import Batch, RealRows, padded_batch_size
from mirrorax.inputs.make import make_source
from mirrorax.models.adapters import adapt
from mirrorax.models.base import strategy_of
from mirrorax.steps import first_call as _first_call
from mirrorax.strategy import MirroredStrategy, get_strategy
from mirrorax.traffic import Traffic, collective_bytes, traffic_of

__all__ = ["Plan", "plan", "plan_step", "at_fit_start", "fit_flops", "parse_bytes", "remember_trainer"]

MODES: tuple[Any, ...] = (None, "optimizer", "all")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclasses.dataclass
class Plan:
    """What one train step costs per device (bytes), for one layout and global batch.

    Attributes:
      shard: the strategy's mode (``None``, ``"optimizer"``, ``"all"``).
      num_devices, batch_size: the devices the step runs on and the global batch planned for.
      param_bytes, optimizer_bytes, model_state_bytes: the state's bytes held on one device (exact).
      gradient_bytes: the gradients' bytes on one device: the parameters' (their full size, or their slice
        when the parameters are split: ``shard="all"``, a layout map).
      argument_bytes, output_bytes, temp_bytes: XLA's ``memory_analysis()`` of the compiled step, one device.
      peak_bytes: arguments + outputs - aliased (donated) + temporaries: the step's peak on one device.
      flops: floating-point operations of one step on one device (``cost_analysis``).
      peak_flops: the device's dense bfloat16 peak in FLOP/s that fit's MFU is measured against
        (:func:`mirrorax.fit.utilisation.peak_flops`; ``None``: the CPU, or a device of unknown peak).
      device_kind: the devices' kind (``jax.Device.device_kind``).
      collective_bytes: bytes produced by the step's collectives on one device (all-reduce, all-gather, ...).
      traffic: the step's collectives with their device groups, and the bytes every device sends per step
        within its host and across hosts (:class:`mirrorax.Traffic`; hosts: ``plan(hosts=...)``).
      device_memory: the per-device memory planned against (``None``: unknown).
      largest_batch: ``{mode: largest global batch that fits}`` when ``device_memory`` is known.
    """

    shard: Any
    num_devices: int
    batch_size: int
    param_bytes: int
    optimizer_bytes: int
    model_state_bytes: int
    gradient_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    peak_bytes: int
    flops: float
    collective_bytes: int
    device_memory: int | None = None
    traffic: Traffic | None = None
    largest_batch: dict[Any, int | None] = dataclasses.field(default_factory=dict)
    peak_flops: float | None = None
    device_kind: str = ""

    @property
    def state_bytes(self) -> int:
        """Parameters + optimizer state + non-trainable state on one device."""
        return self.param_bytes + self.optimizer_bytes + self.model_state_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the step's peak fits ``device_memory`` (``None`` when that is unknown)."""
        return None if self.device_memory is None else self.peak_bytes <= self.device_memory

    @property
    def across_hosts_bytes(self) -> int:
        """Bytes the step's collectives send from one host to another, all devices together (0: one host)."""
        return self.traffic.across_bytes if self.traffic is not None else 0

    @property
    def seconds_at_peak(self) -> float | None:
        """The step's FLOPs at the device's peak: the fastest the step could run (``None``: no peak known)."""
        return self.flops / self.peak_flops if self.peak_flops else None

    def _peak_words(self) -> str:
        if self.peak_flops is None:
            return f"no peak known for {self.device_kind or 'this device'}: MFU not shown"
        return f"peak {self.peak_flops / 1e12:,.4g} TFLOP/s"

    def summary(self) -> str:
        """One line, as ``fit`` prints it with ``verbose``."""
        across = (f", {_mib(self.across_hosts_bytes)} across {self.traffic.num_hosts} hosts"
                  if self.traffic is not None and self.traffic.num_hosts > 1 else "")
        return (f"plan: {self.num_devices} devices, shard={self.shard!r}, global batch {self.batch_size}: per device "
                f"state {_mib(self.state_bytes)} (params {_mib(self.param_bytes)}, optimizer "
                f"{_mib(self.optimizer_bytes)}), step peak {_mib(self.peak_bytes)}, {self.flops / 1e9:.3g} GFLOP "
                f"({self._peak_words()}), collectives {_mib(self.collective_bytes)}{across}")

    def __str__(self) -> str:
        rows = [("parameters", self.param_bytes), ("gradients", self.gradient_bytes),
                ("optimizer state", self.optimizer_bytes), ("non-trainable state", self.model_state_bytes),
                ("step arguments (state + batch)", self.argument_bytes), ("step outputs", self.output_bytes),
                ("activations / temporaries", self.temp_bytes), ("step peak", self.peak_bytes),
                ("collectives per step", self.collective_bytes)]
        lines = [f"mirrorax plan: {self.num_devices} device(s), shard={self.shard!r}, global batch {self.batch_size}",
                 "  per device:"]
        lines += [f"    {name:<32} {_mib(v):>14}" for name, v in rows]
        lines.append(f"    {'FLOPs per step':<32} {self.flops:>14,.3g}")
        if self.peak_flops is not None:
            kind = f" ({self.device_kind})" if self.device_kind else ""
            lines.append(f"    {'peak FLOP/s' + kind:<32} {self.peak_flops:>14,.3g}")
            lines.append(f"    {'step at peak':<32} {1e6 * (self.seconds_at_peak or 0.0):>11,.4g} us")
        else:
            lines.append(f"    peak FLOP/s: {self._peak_words()} (MIRRORAX_PEAK_TFLOPS sets one)")
        if self.traffic is not None and self.traffic.num_hosts > 1:  # one host: all of it is within
            t = self.traffic
            lines.append(f"  sent by the collectives per step, all {len(t.hosts)} devices on {t.num_hosts} host(s):")
            lines.append(f"    {'within a host':<32} {_mib(t.within_bytes):>14}")
            lines.append(f"    {'across hosts':<32} {_mib(t.across_bytes):>14}")
        if self.device_memory is not None:
            lines.append(f"  device memory {_mib(self.device_memory)}: the step "
                         f"{'fits' if self.fits else 'does NOT fit'}")
            for mode, b in self.largest_batch.items():
                lines.append(f"    largest global batch that fits with shard={mode!r}: "
                             f"{b if b is not None else 'none (the state alone does not fit)'}")
        return "\n".join(lines)


def _per_device_bytes(tree: Any, shardings: Any) -> int:
    total = 0
    for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        shape = tuple(a.shape)
        local = s.shard_shape(shape) if hasattr(s, "shard_shape") else shape
        total += int(math.prod(local)) * np.dtype(getattr(a, "dtype", np.float32)).itemsize
    return total


def plan(model_or_trainer: Any, x: Any, y: Any = None, *, batch_size: int, device_memory: int | str | None = None,
         strategy: Any = None, search: bool = True, hosts: Any = None) -> Plan:
    """Compiles the train step without running it and reports its per-device cost.

    Args:
      model_or_trainer: a compiled Keras model, a :class:`mirrorax.FunctionalModel` or a :class:`mirrorax.Trainer`.
      x, y: a sample of the inputs (arrays; only their row shapes and dtypes matter).
      batch_size: the global batch to plan for.
      device_memory: memory per device (bytes or ``"24GB"``); default: the device's own limit where JAX
        knows it (GPUs, TPUs), else unknown (no search).
      strategy: the strategy (default: the trainer's; else the one whose scope the model was made under;
        else the enclosing scope's, else every device).
      search: with a known ``device_memory``, find the largest global batch that fits in each mode.
      hosts: which host each device is on, for the traffic within and across hosts: ``None`` (each
        device's ``process_index``), an int ``k`` (the strategy's devices in order, cut into ``k`` equal
        blocks: ``hosts=2`` plans 8 simulated devices as 2 hosts of 4), a ``{device id: host}`` mapping
        or a function ``device -> host``.

    Returns:
      A :class:`Plan`; ``print(plan)`` shows the table.

    Example:
      >>> print(mx.plan(model, x_train[:1], y_train[:1], batch_size=256, device_memory="24GB"))
    """
    held = _Steps.of(model_or_trainer) or _Steps.of(_trainer_of(model_or_trainer))
    model = held.model if held is not None else model_or_trainer
    # A Keras model made under a strategy's scope is planned on that strategy, as its fit runs.
    base = strategy or (held.steps.strategy if held is not None else strategy_of(model) or get_strategy())
    if held is None or held.steps.strategy is not base:
        held = _Steps.build(model, base)
    memory = parse_bytes(device_memory) if device_memory is not None else utilisation.device_memory(base.devices)
    source = make_source(x, y, float_dtype=held.steps.adapter.float_dtype)
    # One row stands for the shapes: the plan is of a full global batch, not of a batch cut to that row.
    # A full batch of arrays carries its real rows as fit's batches do (all of them), so the program planned
    # is the one fit compiles and runs: a plan after a fit of the same shapes compiles nothing.
    one = source.sample(1, base)

    def full(b: int) -> Batch:
        return dataclasses.replace(one, rows=b if isinstance(one.rows, int) else None)

    result = plan_step(held.steps, held.device, full(batch_size), batch_size, memory, hosts=hosts)
    if memory is not None and search:
        for mode in MODES:
            other = held.in_mode(mode)
            result.largest_batch[mode] = _largest(
                lambda b, o=other: plan_step(o.steps, o.device, full(b), b).peak_bytes, memory,
                base.num_replicas_in_sync, batch_size)
    return result


@dataclasses.dataclass
class _Steps:
    """A model's step functions and device state on one strategy: what a plan compiles and reads."""

    model: Any  # what in_mode builds another strategy's steps for
    steps: StepFunctions
    device: DeviceState

    @classmethod
    def of(cls, obj: Any) -> _Steps | None:
        """The step functions and device state ``obj`` holds (a :class:`mirrorax.Trainer`), else ``None``."""
        steps, device = getattr(obj, "steps", None), getattr(obj, "device_state", None)
        if isinstance(steps, StepFunctions) and isinstance(device, DeviceState):
            return cls(obj.model, steps, device)
        return None

    @classmethod
    def build(cls, model: Any, strategy: MirroredStrategy) -> _Steps:
        """Fresh step functions and device state for ``model`` on ``strategy`` (a ``Trainer``'s defaults)."""
        adapter = adapt(model)
        return cls(model, StepFunctions(adapter, strategy), DeviceState(adapter, strategy))

    def in_mode(self, mode: Any) -> _Steps:
        """These steps when their strategy shards as ``mode``, else the same model's on the same devices
        sharded so."""
        s = self.steps.strategy
        if mode == s.shard:
            return self
        # The adapter's model carries the settings (a Flax NNX module's NnxModel: the Trainer's loss and optimizer).
        return _Steps.build(getattr(self.steps.adapter, "model", self.model),
                            MirroredStrategy(devices=list(s.devices), shard=mode))


def _largest(peak: Any, memory: int, step: int, start: int) -> int | None:
    """The largest multiple of ``step`` whose step peak (``peak(batch)``, one compile each) fits ``memory``,
    to within 1/32 of the answer (or ``step``): the true largest is below the result plus that tolerance.

    A step's memory is its state plus activations that grow about linearly with the batch, so each probe
    is read off the line through the two nearest batches measured (the largest seen to fit, and the
    smallest seen not to, or else the first), and the next one is at least the tolerance above the
    largest that fits: a good line closes the bracket in two probes. About 4-5 compiles per mode.
    """
    seen: dict[int, int] = {}

    def p(b: int) -> int:
        if b not in seen:
            seen[b] = peak(b)
        return seen[b]

    def tolerance(b: int) -> int:
        return max(step, b // 32 // step * step)

    cap = 2**24 // step * step
    lo, hi = step, None  # the largest batch seen to fit, the smallest seen not to
    if p(lo) > memory:
        return None
    probe = min(max(start, 8 * step) // step * step, cap)
    while True:
        if probe <= lo or (hi is not None and probe >= hi):
            if hi is None or hi - lo <= step:
                break
            probe = (lo + hi) // 2 // step * step  # the line misled: bisect
            if probe <= lo:
                break
        if p(probe) <= memory:
            lo = probe
        else:
            hi = probe
        if (hi is not None and hi - lo <= tolerance(lo)) or (hi is None and lo >= cap):
            break
        other = hi if hi is not None else min(seen)
        if other == lo:
            other = max(b for b in seen if b != lo) if len(seen) > 1 else lo + step
        slope = max((seen.get(other, seen[lo]) - seen[lo]) / (other - lo), 1.0) if other != lo else 1.0
        estimate = int(lo + (memory - seen[lo]) / slope) // step * step
        probe = min(max(estimate, lo + tolerance(lo)), cap)
    return lo


def plan_step(steps: StepFunctions, device: DeviceState, sample: Batch, batch_size: int,
              memory: int | None = None, *, hosts: Any = None, full: bool = True, flops: bool = False) -> Plan:
    """The plan of the train step ``steps.train`` at ``batch_size`` (``sample``: a batch of the inputs,
    for their row shapes and dtypes).

    When ``device`` already holds the state (``fit`` about to run), the step is lowered for that very
    state, so the program compiled here is the one the first step runs: the step function hands it over,
    and planning at ``fit`` start costs no second compile. Otherwise the model is built for ``sample`` and
    the state it would start from is planned. ``full=False``: the memory only (``flops`` is NaN and
    ``collective_bytes`` -1 in what is returned), as fit's memory check needs; with ``flops=True`` the FLOPs
    too (``cost_analysis`` alone, without the program's text: fit's MFU).
    """
    s = steps.strategy
    if device.value is None:
        steps.adapter.build(sample.tree())
    # The held state keys like its abstract stand-in (``signature``): the stand-in, ~8 us a leaf (5 ms a
    # fit for a 600-leaf LM state), is made only when the plan is not known yet, or when no state is held
    # (then it is the key too, made once).
    held = device.value
    abstract = device.abstract() if held is None else None
    padded = padded_batch_size(batch_size, s)
    on_host = steps.host_rows  # (the rows as fit gives them: host arrays, or placed on the devices)

    def batch_spec(a: Any) -> Any:
        a = np.asarray(a)
        if on_host:
            return jax.ShapeDtypeStruct((padded,) + a.shape[1:], jax.dtypes.canonicalize_dtype(a.dtype))
        return jax.ShapeDtypeStruct((padded,) + a.shape[1:], a.dtype, sharding=s.batch_sharding)

    one = sample.step_tree()
    batch = {k: jax.tree.map(batch_spec, v) for k, v in one.items() if k not in ("num_real", "rows") and v is not None}
    if "num_real" in one:  # as the fit's batches carry it
        batch["num_real"] = jax.ShapeDtypeStruct((), np.float32, sharding=s.replicated)
    if isinstance(sample.rows, int):  # as the fit's batches carry it (a first batch short of the global one: cut)
        batch["rows"] = RealRows(min(sample.rows, padded))
    # One compiled program, one reading: fit plans at every start (where the device's memory is known) and
    # mx.plan after a fit plans the program that fit runs. Reading a large program's analyses and text
    # took ~0.5 s a call on a TPU (a 219M-parameter LM), paid by every fit; and fit's memory check reads only
    # the memory analysis: the cost and the text are read when a plan is shown (``full``), from the same
    # compiled program, kept beside its plan.
    key = None
    if hosts is None:
        key = (steps.train.signature(abstract if held is None else held, batch), batch_size)
    known = _PLANS.setdefault(steps.train, {}).get(key) if key is not None else None
    rate, kind = peak_flops(s.devices[0]), str(s.devices[0].device_kind)
    if known is not None:
        made, compiled = known
        if full and compiled is not None:
            made = _read_cost(made, compiled, s, hosts)
            _PLANS[steps.train][key] = (made, None)
        elif flops and compiled is not None and math.isnan(made.flops):
            made = _read_flops(made, compiled)
            _PLANS[steps.train][key] = (made, compiled)
        return dataclasses.replace(made, device_memory=memory, largest_batch={}, peak_flops=rate, device_kind=kind)
    if abstract is None:
        abstract = device.abstract()
    layouts = jax.tree.map(lambda a: a.sharding, abstract)
    # the trace and compile of the step fit's first call then runs (see mirrorax.steps.first_call)
    compiled = _first_call.run(lambda: steps.train.lower(abstract, batch).compile())
    mem = compiled.memory_analysis()
    param_bytes = _per_device_bytes(abstract.params, layouts.params)
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    made = Plan(shard=s.shard, num_devices=len(s.devices), batch_size=batch_size, param_bytes=param_bytes,
                optimizer_bytes=_per_device_bytes(abstract.optimizer, layouts.optimizer),
                model_state_bytes=_per_device_bytes(abstract.model_state, layouts.model_state),
                gradient_bytes=param_bytes,  # a gradient has its parameter's layout: whole, or the same slice
                argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
                temp_bytes=int(mem.temp_size_in_bytes), peak_bytes=int(peak), flops=float("nan"),
                collective_bytes=-1, device_memory=memory, peak_flops=rate, device_kind=kind)
    if full:
        made, compiled = _read_cost(made, compiled, s, hosts), None
    elif flops:
        made = _read_flops(made, compiled)
    if key is not None:
        _PLANS[steps.train][key] = (dataclasses.replace(made, largest_batch={}), compiled)
    return made


def _read_cost(made: Plan, compiled: Any, s: Any, hosts: Any) -> Plan:
    """``made`` with what the compiled program's cost analysis and text say (FLOPs, collectives)."""
    text = compiled.as_text()
    return dataclasses.replace(_read_flops(made, compiled), collective_bytes=collective_bytes(text),
                               traffic=traffic_of(text, list(np.asarray(s.mesh.devices).flat), hosts))


def _read_flops(made: Plan, compiled: Any) -> Plan:
    """``made`` with the compiled program's FLOPs on one device (its cost analysis)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dataclasses.replace(made, flops=float(cost.get("flops", 0.0)))


# The plans read off each train step function's compiled programs (see plan_step), each with its compiled
# program until its cost and text are read (None after), and the trainer each model was last given
# (mx.plan(model) then plans the program that trainer's fit runs).
_PLANS: weakref.WeakKeyDictionary[Any, dict[Any, tuple[Plan, Any]]] = weakref.WeakKeyDictionary()
_TRAINERS: dict[int, weakref.ref[Any]] = {}
# The FLOPs of each trainer's step as its newest fit planned them (where a peak is known: fit's MFU).
_FIT_FLOPS: weakref.WeakKeyDictionary[StepFunctions, float] = weakref.WeakKeyDictionary()


def remember_trainer(model: Any, trainer: Any) -> None:
    """Records that ``trainer`` (which holds ``steps`` and ``device_state``) trains ``model``: ``mx.plan(model)``
    plans on its step functions and state, so a plan after its fit compiles nothing."""
    for k in [k for k, ref in _TRAINERS.items() if ref() is None]:
        del _TRAINERS[k]
    _TRAINERS[id(model)] = weakref.ref(trainer)


def _trainer_of(model: Any) -> Any:
    ref = _TRAINERS.get(id(model))
    trainer = ref() if ref is not None else None
    return trainer if trainer is not None and getattr(trainer, "model", None) is model else None


def at_fit_start(model: Any, steps: StepFunctions, device: DeviceState, sample: Batch, batch_size: int, *,
                 announce: bool, stream: IO[str]) -> Plan | None:
    """What ``fit`` does with the plan before step 1: writes its summary line to ``stream`` (``announce``)
    and raises when the step will not fit the device's memory (known on accelerators, or from
    ``MIRRORAX_DEVICE_MEMORY``). Returns the plan, or ``None`` when neither was asked for.

    ``device`` must hold the state: the program compiled here is then the one step 1 runs (no second
    compile). (With ``steps_per_execution > 1`` fit runs another program: its caller then announces
    nothing, and the plan is made only where the memory check or the MFU needs it.) Where the device's peak
    is known, the step's FLOPs are read too (:func:`fit_flops`: the MFU of fit's progress line).
    """
    memory = utilisation.device_memory(steps.strategy.devices)
    peak = peak_flops(steps.strategy.devices[0])
    _FIT_FLOPS.pop(steps, None)
    if memory is None and not announce and peak is None:
        return None
    here = plan_step(steps, device, sample, batch_size, memory, full=announce, flops=peak is not None)
    if not math.isnan(here.flops):
        _FIT_FLOPS[steps] = here.flops
    if announce:
        stream.write(here.summary() + "\n")
    if memory is not None and not here.fits:
        raise _does_not_fit(_Steps(model, steps, device), sample, batch_size, here, memory)
    return here


def fit_flops(steps: StepFunctions) -> float | None:
    """The FLOPs on one device of ``steps``' train step as its newest fit planned it (``None``: not read, as on
    a CPU without ``MIRRORAX_PEAK_TFLOPS``: no MFU to show)."""
    return _FIT_FLOPS.get(steps)


def _does_not_fit(held: _Steps, sample: Batch, batch_size: int, here: Plan, memory: int) -> MemoryError:
    s = held.steps.strategy
    options = [f"MirroredStrategy(shard={mode!r}) fits batch {batch_size}" for mode in MODES
               if mode != s.shard and _fits(held.in_mode(mode), sample, batch_size, memory)]
    largest = _largest(lambda b: plan_step(held.steps, held.device, sample, b, memory).peak_bytes, memory,
                       s.num_replicas_in_sync, batch_size)
    if largest:
        options.append(f"with shard={s.shard!r}, a global batch of at most {largest} fits")
    return MemoryError(
        f"The train step needs {_mib(here.peak_bytes)} per device (state {_mib(here.state_bytes)}, activations and "
        f"temporaries {_mib(here.temp_bytes)}) at global batch {batch_size} with shard={s.shard!r}, but a device has "
        f"{_mib(memory)}. " + ("; ".join(options) + "." if options else "No mode fits even a batch of one per device: "
                               "the model is too large for these devices.")
        + " (mx.plan(model, x, y, batch_size=...) shows the whole plan.)")


def _fits(held: _Steps, sample: Batch, batch_size: int, memory: int) -> bool:
    return bool(plan_step(held.steps, held.device, sample, batch_size, memory).fits)
