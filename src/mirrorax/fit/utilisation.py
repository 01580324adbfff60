"""Where a fit's time goes: one record per epoch (:class:`Utilisation`), the devices' peaks, input-bound advice.

Each epoch of ``fit`` ends with a :class:`Utilisation`: the model FLOPs utilisation (MFU: the compiled step's
FLOPs per device, ``cost_analysis()``, times the steps per second, over the device's peak), the share of the
epoch the devices were busy and the share the loop waited for its next batch. :mod:`mirrorax.fit.meter`
measures them; this module holds the record, the table of peaks and what to say when the input is the limit.

The records of a model's last fit are read with :func:`utilisation` (a ``Trainer`` has them as
``trainer.utilisation``): beside the ``History``, not in it, so that Keras's ``History`` stays Keras's.

Peaks are the dense (no sparsity) bfloat16 matrix peaks per JAX device, from the vendors' data sheets: what
MFU is quoted against (PaLM's definition). A JAX device of a TPU v2 or v3 is one core (half a chip); from v4
on, one chip. The CPU has no entry: there MFU is not shown. ``MIRRORAX_PEAK_TFLOPS`` sets the peak for a
device the table does not know (or another precision's peak).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["InputBoundWarning", "PEAK_TFLOPS", "Utilisation", "device_memory", "input_advice", "input_kind",
           "parse_bytes", "peak_flops", "record", "utilisation", "warn_input_bound", "INPUT_BOUND_SHARE"]

#: Dense bfloat16 peak of one JAX device, TFLOP/s, by ``device.device_kind`` (exact names first, then
#: names containing the key). GPUs without bfloat16 tensor cores (V100, T4): their float16 peak.
PEAK_TFLOPS: dict[str, float] = {
    "TPU v2": 22.5, "TPU v3": 61.5, "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0,
    "TPU v5p": 459.0, "TPU v6 lite": 918.0, "TPU v6e": 918.0,
    "B200": 2250.0, "H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
    "L4": 121.0, "V100": 125.0, "T4": 65.0,
}

#: The share of an epoch spent waiting for batches above which fit warns that the input is the limit.
INPUT_BOUND_SHARE = 0.2


def peak_flops(device: Any) -> float | None:
    """The dense bfloat16 peak of ``device`` in FLOP/s: ``MIRRORAX_PEAK_TFLOPS`` where set, else the table's
    (:data:`PEAK_TFLOPS`), else ``None`` (the CPU, or a device the table does not know).

    Raises:
      ValueError: ``MIRRORAX_PEAK_TFLOPS`` is not a positive number.

    Example:
      >>> peak_flops(jax.devices()[0])  # a TPU v5e: 1.97e14; the CPU: None
    """
    text = os.environ.get("MIRRORAX_PEAK_TFLOPS", "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"MIRRORAX_PEAK_TFLOPS must be a positive number of TFLOP/s per device; received "
                             f"{text!r}. Set it e.g. to 197 (a TPU v5e's dense bfloat16 peak), or unset it.")
        return value * 1e12
    if getattr(device, "platform", "cpu") == "cpu":
        return None
    kind = str(getattr(device, "device_kind", ""))
    if kind in PEAK_TFLOPS:
        return PEAK_TFLOPS[kind] * 1e12
    for key, tflops in PEAK_TFLOPS.items():  # the table lists "H100 PCIe" before "H100", "L40S" before "L4"
        if not key.startswith("TPU") and key in kind:
            return tflops * 1e12
    return None


def device_memory(devices: Sequence[Any]) -> int | None:
    """A device's memory in bytes: ``MIRRORAX_DEVICE_MEMORY`` (e.g. ``"24GB"``), else the device's own limit where
    JAX knows it (GPUs, TPUs), else ``None``."""
    if os.environ.get("MIRRORAX_DEVICE_MEMORY"):
        return parse_bytes(os.environ["MIRRORAX_DEVICE_MEMORY"])
    try:
        stats = devices[0].memory_stats()
    except Exception:  # noqa: BLE001 - platforms without memory stats
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def parse_bytes(text: str | int) -> int:
    """``"24GB"`` / ``"24GiB"`` / ``"512MB"`` / ``12345`` -> bytes (GB = 10^9, GiB = 2^30).

    Example:
      >>> parse_bytes("24GiB")
      25769803776
    """
    if isinstance(text, (int, np.integer)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"A memory size must look like '24GB', '24GiB' or '512MB'; received {text!r}.")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(unit) + 1 if unit else 0
    return int(value * ((1024 if binary else 1000) ** power))


@dataclasses.dataclass(frozen=True)
class Utilisation:
    """Where one epoch's time went (its training steps; validation not counted).

    Attributes:
      epoch: the epoch (0-based, as ``History.epoch``).
      steps: train steps run; ``seconds``: their wall time, compilation excluded.
      steps_per_second: ``steps / seconds``.
      flops_per_step: the compiled step's FLOPs on one device (``cost_analysis``; ``None`` where no peak is
        known: it is read only where MFU can be shown).
      peak_flops: the device's peak FLOP/s used (:func:`peak_flops`; ``None``: the CPU, or unknown).
      mfu: model FLOPs utilisation, ``flops_per_step * steps_per_second / peak_flops`` (``None`` without a peak).
      device_busy: the share of ``seconds`` the devices were computing (a step's device time, measured on
        idle devices, times the steps, over ``seconds``); ``None`` when the epoch was too short to measure it.
      input_wait: the share of ``seconds`` the loop waited for its next batch.
      host_seconds_per_step, device_seconds_per_step: the host's work per step besides waiting (dispatch,
        callbacks, placing the batch) and the devices' (``None``: not measured).
      steps_per_execution: the steps fused into one dispatch at the epoch's end (``"auto"`` picks it).
    """

    epoch: int
    steps: int
    seconds: float
    steps_per_second: float
    flops_per_step: float | None
    peak_flops: float | None
    mfu: float | None
    device_busy: float | None
    input_wait: float
    host_seconds_per_step: float | None
    device_seconds_per_step: float | None
    steps_per_execution: int

    def figures(self, *, auto: bool = False) -> list[tuple[str, str]]:
        """The figures the epoch's progress line ends with, as ``(name, text)``: MFU (where a peak is known),
        the devices' busy share, the input's wait share (and the steps per execution ``"auto"`` chose)."""
        out = []
        if self.mfu is not None:
            out.append(("MFU", f"{100 * self.mfu:.1f}%"))
        if self.device_busy is not None:
            out.append(("device busy", f"{100 * self.device_busy:.0f}%"))
        out.append(("input wait", f"{100 * self.input_wait:.0f}%"))
        if auto:
            out.append(("steps/execution", f"{self.steps_per_execution} (auto)"))
        return out

    def __str__(self) -> str:
        return " - ".join(f"{name}: {text}" for name, text in self.figures())


# The records of each model's last fit, by the model's id (a weak reference checks it is the same model).
_RECORDS: dict[int, tuple[weakref.ref[Any], list[Utilisation]]] = {}


def record(model: Any, records: list[Utilisation]) -> None:
    """Makes ``records`` (filled epoch by epoch) what :func:`utilisation` returns for ``model``."""
    for k in [k for k, (ref, _) in _RECORDS.items() if ref() is None]:
        del _RECORDS[k]
    _RECORDS[id(model)] = (weakref.ref(model), records)


def utilisation(model_or_trainer: Any) -> list[Utilisation]:
    """The :class:`Utilisation` of each epoch of the last ``fit`` of a model or a :class:`mirrorax.Trainer`.

    A Keras model's own ``model.fit`` under a scope records here too: ``model.history`` stays Keras's
    ``History``, these records stand beside it.

    Raises:
      ValueError: ``model_or_trainer`` has not been fitted.

    Example:
      >>> model.fit(x, y, epochs=2)
      >>> len(mx.utilisation(model)), mx.utilisation(model)[-1].epoch  # one record per epoch
      (2, 1)
    """
    model = getattr(model_or_trainer, "model", model_or_trainer)
    for obj in (model_or_trainer, model):
        held = _RECORDS.get(id(obj))
        if held is not None and held[0]() is obj:
            return list(held[1])
    raise ValueError(f"No fit has run for {type(model_or_trainer).__name__} {model_or_trainer!r:.80}: the figures "
                     "are recorded by fit (mx.Trainer(model).fit, or model.fit under strategy.scope()). Call fit "
                     "first.")


class InputBoundWarning(UserWarning):
    """An epoch spent a large share of its time waiting for the next batch: the input is the limit."""


def input_kind(source: Any) -> str:
    """What feeds a fit, for advice: ``"tf.data"``, ``"grain"``, ``"torch"``, ``"PyDataset"``, ``"arrays"`` or
    ``"iterable"``. ``source`` is the fit's source or what it wraps (its ``iterable`` / ``data`` / ``dataset``)."""
    obj, seen = source, 0
    while obj is not None and seen < 6:
        seen += 1
        for cls in type(obj).__mro__:
            module = cls.__module__ or ""
            if cls.__name__ in ("DatasetV2", "DistributedDataset") and module.startswith("tensorflow"):
                return "tf.data"
            if module.split(".")[0] == "grain":
                return "grain"
            if cls.__name__ == "DataLoader" and module.startswith("torch"):
                return "torch"
            if cls.__name__ == "PyDataset" and "keras" in module:
                return "PyDataset"
            if cls.__name__ == "ArraySource" and module.startswith("mirrorax"):
                return "arrays"
        obj = next((getattr(obj, a) for a in ("iterable", "data", "dataset") if getattr(obj, a, None) is not None),
                   None)
    return "iterable"


_ADVICE = {
    "tf.data": "end the tf.data pipeline with .prefetch(tf.data.AUTOTUNE), map with num_parallel_calls="
               "tf.data.AUTOTUNE, and .cache() it when it fits in memory",
    "grain": "give the grain.DataLoader worker_count=N (N processes make the batches), or .mp_prefetch() a grain "
             "dataset",
    "PyDataset": "construct the PyDataset with workers=N (threads read its batches ahead; add "
                 "use_multiprocessing=True when __getitem__ holds Python's lock)",
    "torch": "give the torch DataLoader num_workers=N",
    "arrays": "the arrays are in memory already: place batches on a thread with mx.Trainer(..., prefetch=2), or "
              "give a larger batch",
    "iterable": "load the data as arrays in memory (fit(x, y) with numpy arrays), or let a thread make the batches "
                "ahead with mx.Trainer(..., prefetch=2)",
}


def input_advice(kind: str) -> str:
    """The fix for an input-bound fit fed by ``kind`` (:func:`input_kind`)."""
    return _ADVICE.get(kind, _ADVICE["iterable"])


def warn_input_bound(u: Utilisation, kind: str) -> bool:
    """Warns (an :class:`InputBoundWarning`) when epoch ``u`` waited for batches more than
    :data:`INPUT_BOUND_SHARE` of its time, naming the fix for the input ``kind``; returns whether it warned."""
    if u.input_wait <= INPUT_BOUND_SHARE:
        return False
    warnings.warn(f"Epoch {u.epoch + 1} waited {100 * u.input_wait:.0f}% of its {u.seconds:.2f} s for the next batch "
                  f"(over {100 * INPUT_BOUND_SHARE:.0f}%): the input ({kind}) is the limit, not the devices. "
                  f"To feed them faster, {input_advice(kind)}. (Said once per fit; mx.utilisation(model) has "
                  "every epoch's figures.)", InputBoundWarning, stacklevel=2)
    return True
