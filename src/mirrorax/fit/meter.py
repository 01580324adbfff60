"""A fit's figures, measured as its epochs run: where each step's time goes, and ``steps_per_execution="auto"``.

Per dispatch the loop (:mod:`mirrorax.fit.loop`) waits in two places: for its next batch, and in the window
for an earlier step to finish. :class:`EpochMeter` reads the clock around both (a few clock reads a dispatch);
the rest of the wall time is the host's own work (the dispatch, the hooks, placing the batch). The devices'
time per step is taken on idle devices now and then (a *probe*: the window drained before a dispatch, the
step waited for right after it; at dispatches 2, 5 and 11 of a fit's first epoch and at dispatch 5 of each
later one, the least of the newest kept). Compilation (JAX's compile events) is left out of every figure.

:class:`FitMeter` holds a fit's records (one :class:`~mirrorax.fit.utilisation.Utilisation` per epoch, read
with ``mx.utilisation``), hands each epoch's figures to the progress line and the callbacks, says once when an
epoch was input-bound, and under ``steps_per_execution="auto"`` measures the costs that
:func:`~mirrorax.fit.auto_steps.choose_steps` decides on: 16 dispatches at one step each, then as many steps
at the chosen ``k`` to see that it pays (:func:`~mirrorax.fit.auto_steps.keeps_paying`). Multi-process, process
0's decisions are every process's: the dispatches stay the same everywhere.

``MIRRORAX_FIGURES=0`` turns the figures off (what ``benchmarks/figures_cost.py`` compares against).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrorax.cluster import consistency
from mirrorax.fit.auto_steps import MAX_STEPS, AutoSteps, Costs, choose_steps, keeps_paying, refine
from mirrorax.fit.epoch import EpochHook, EpochRun, Outcome
from mirrorax.fit.utilisation import Utilisation, device_memory, input_kind, peak_flops, record, warn_input_bound
from mirrorax.inputs.prefetch import Prefetcher
from mirrorax.steps.dispatch import wait

if TYPE_CHECKING:
    from mirrorax.fit.hooks import Callbacks
    from mirrorax.fit.progress import Progress
    from mirrorax.inputs.batch import Batch
    from mirrorax.strategy import MirroredStrategy

__all__ = ["EpochMeter", "FitMeter", "compile_seconds", "figures_enabled"]

#: The dispatches (0-based) timed on idle devices: in a fit's first epoch, in each later one. A probe costs the
#: overlap of one step with the host's work: a few in an epoch of hundreds of steps cost nothing measurable.
PROBES_FIRST, PROBES_LATER = (2, 5, 11), (5,)
#: The probes kept per steps per dispatch: the least of them is the devices' time (what a probe times beyond the
#: devices' work, a hand-off to the runtime's threads or a shared host's hiccup, only adds to it: on this
#: repository's CPU the probes of a 3 us step read 2-50 us).
KEEP_PROBES = 7
#: Dispatches at one step each that "auto" measures its costs on (after WARM_UP more).
MEASURE = 16
WARM_UP = 2
#: Steps at the chosen k that "auto" measures before keeping it, over at least VERIFY_DISPATCHES dispatches
#: (the first at a new k compiles its program and the next is probed: neither is timed, one more at least is).
VERIFY_STEPS = 64
VERIFY_DISPATCHES = 3
#: The share of a step's time that the host's own work (its call and its read) must reach at one step a dispatch
#: for "auto" to try fusing where the probed devices' time says they are the limit (:meth:`FitMeter._decide`).
HOST_SHARE = 0.5
#: Dispatches an epoch needs before its input share can name it input-bound.
JUDGE_AFTER = 4

_compile = [0.0]
_listening = [False]


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
    if event.startswith("/jax/core/compile/"):
        _compile[0] += duration_secs


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling (JAX's compile events) since first asked."""
    if not _listening[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening[0] = True
    return _compile[0]


def figures_enabled() -> bool:
    """Whether fit measures its figures (``MIRRORAX_FIGURES``, on unless ``0``)."""
    return os.environ.get("MIRRORAX_FIGURES", "1").strip().lower() not in ("0", "false", "off")


class _Window:
    """The dispatches ``"auto"`` measures: all of them counted (``seen``, ``seen_steps``: when a window is full
    depends on the dispatches alone, the same on every process), their times summed where no compile and no
    probe took part (``dispatches``, ``steps``)."""

    def __init__(self) -> None:
        self.seen = self.seen_steps = self.dispatches = self.steps = 0
        self.wall = self.read = self.wait = 0.0

    def add(self, k: int, wall: float, read: float, waited: float, clean: bool) -> None:
        self.seen += 1
        self.seen_steps += k
        if clean:
            self.dispatches += 1
            self.steps += k
            self.wall, self.read, self.wait = self.wall + wall, self.read + read, self.wait + waited

    @property
    def step_time(self) -> float | None:
        """Wall seconds per step over the clean dispatches (``None``: none was timed)."""
        return self.wall / self.steps if self.steps and self.wall else None

    def costs(self, device: float) -> Costs:
        """What a step cost at the window's k: the host's work per dispatch (the wall time less the two waits),
        the input's wait per step, and ``device``, the devices' time per step."""
        return Costs(call=max(self.wall - self.read - self.wait, 0.0) / self.dispatches, read=self.read / self.steps,
                     device=device)


class FitMeter:
    """One fit's figures and, under ``"auto"``, its steps per dispatch.

    Args:
      model: the model (whose records :func:`mirrorax.fit.utilisation.utilisation` returns).
      strategy: where the steps run. flops: the train step's FLOPs on one device (``None``: unknown).
      steps_per_execution: the trainer's fixed steps per dispatch; auto: ``steps_per_execution="auto"``.
      prefetch: batches placed ahead on a thread (0: none). source: the fit's input (for advice). epochs: the fit's.
      batch_size: the fit's global batch. previous: the same trainer's previous fit's meter: ``"auto"``'s decision
        holds on from there for a fit of the same global batch (its costs are the same), measured afresh otherwise.
    """

    def __init__(self, model: Any, strategy: MirroredStrategy, flops: float | None, *, steps_per_execution: int,
                 auto: bool, prefetch: int, source: Any, epochs: int, batch_size: int = 0,
                 previous: FitMeter | None = None) -> None:
        self.enabled = figures_enabled() or auto
        self.strategy = strategy
        self.peak = peak_flops(strategy.devices[0])
        self.flops = flops if self.peak is not None else None
        self.kind = input_kind(source)
        self.epochs = epochs
        self.records: list[Utilisation] = []
        record(model, self.records)
        self.fixed = steps_per_execution
        self.auto = AutoSteps(lead_groups=prefetch + 2) if auto else None
        self.group: int | Callable[[int], int] = self.auto.group if self.auto is not None else steps_per_execution
        self.probes: dict[int, list[float]] = {}  # steps per dispatch -> the newest probes' device seconds a step
        self.warned = False
        self.batch_bytes: float | None = None  # one step's batch on one device
        self.measuring = False
        self.phase = "measure" if auto else "settled"  # then "verify" a fused k, "settled"; or "deferred"
        self.warm_up = WARM_UP
        self.window = _Window()
        self.one_step: float | None = None  # seconds per step measured at the k a fused k is checked against
        self.one_costs: Costs | None = None  # the costs measured at one step per dispatch
        self.fallback = 1  # the k to go back to if the k being checked does not pay
        self.probe_wanted = False  # a probe at the k being checked, at its first dispatch
        self.compile_cost = 0.0  # the longest compile seen in one dispatch: what a new k's program may cost
        self.batch_size = batch_size
        self.earlier_steps = 0  # steps of the trainer's earlier fits of this batch: how long it trains, so far
        if auto and previous is not None and previous.auto is not None and previous.batch_size == batch_size:
            self.auto, self.one_step, self.compile_cost = previous.auto, previous.one_step, previous.compile_cost
            self.one_costs, self.fallback = previous.one_costs, previous.fallback
            self.probe_wanted = previous.probe_wanted
            # A choice put off because the fit was too short to pay for a compile is looked at again: the first one
            # measured at one step a dispatch, a larger k measured at the k that holds.
            if previous.phase == "deferred":
                self.phase = "measure" if self.auto.next_k == 1 else "verify"
            else:
                self.phase = previous.phase
            self.group, self.probes = self.auto.group, {k: list(v) for k, v in previous.probes.items()}
            self.earlier_steps = previous.earlier_steps + sum(u.steps for u in previous.records)

    @property
    def phase(self) -> str:
        """Where "auto" stands: ``"measure"``, ``"verify"`` (a fused k), ``"settled"``, ``"deferred"`` (to the next
        fit: a k that would pay, but not its compile within this fit's steps and the earlier fits'); ``measuring``
        says whether it measures (what the epoch's clock looks at each step)."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self.measuring = value in ("measure", "verify")

    def epoch(self, run: EpochRun, epoch: int) -> EpochMeter | None:
        """The meter of epoch ``epoch`` (``None``: figures off and no ``"auto"``)."""
        return EpochMeter(self, run, epoch) if self.enabled else None

    def steps_per_execution(self) -> int:
        """The steps per dispatch now (``"auto"``: its newest decision)."""
        return self.auto.next_k if self.auto is not None else self.fixed

    # -- the epoch's record ----------------------------------------------------------------------------
    def end_epoch(self, meter: EpochMeter, progress: Progress, hooks: Callbacks) -> Utilisation | None:
        """Epoch ``meter`` ended (its timed part): its record kept, its figures given to the progress line and
        the callbacks' (Keras's progress bar), an input-bound epoch said (once a fit). Returns the record."""
        u = meter.result()
        if self.auto is not None:
            self.auto.new_epoch()
        if u is None:
            return None
        self.records.append(u)
        figures = u.figures(auto=self.auto is not None)
        progress.figures = figures
        hooks.show_figures(figures)
        if not self.warned and self.strategy.is_primary and meter.dispatches >= JUDGE_AFTER:
            self.warned = warn_input_bound(u, self.kind)
        return u

    def note_probe(self, k: int, seconds: float) -> None:
        kept = self.probes.setdefault(k, [])
        kept.append(seconds / k)
        del kept[:-KEEP_PROBES]

    def note_batch(self, k: int, batch: Batch) -> None:
        leaves = jax.tree.leaves((batch.x, batch.y, batch.sample_weight, batch.mask))
        self.batch_bytes = sum(getattr(a, "nbytes", 0) for a in leaves) / max(k, 1) / len(self.strategy.devices)

    def device_seconds(self, k: int) -> float | None:
        """The devices' seconds per step at ``k`` steps per dispatch (the nearest ``k`` measured): the least of its
        probes (:data:`KEEP_PROBES`)."""
        if not self.probes:
            return None
        return min(self.probes[min(self.probes, key=lambda m: abs(m - k))])

    # -- "auto" ------------------------------------------------------------------------------------------
    def feed(self, run: EpochRun, epoch: int, k: int, wall: float, read: float, waited: float, clean: bool) -> None:
        """One dispatch of ``k`` steps of epoch ``epoch`` for ``"auto"``'s measurements (``clean``: no compile or
        probe in it: its times count); decides when a window is full."""
        auto = self.auto
        assert auto is not None
        if self.phase == "measure" and k == 1:
            if self.warm_up:
                self.warm_up -= 1
                return
            self.window.add(k, wall, read, waited, clean)
            if self.window.seen >= MEASURE and 1 in self.probes:
                self._decide(run, epoch)
        elif self.phase == "verify" and k == auto.next_k:
            self.window.add(k, wall, read, waited, clean)
            if self.window.seen_steps >= VERIFY_STEPS and self.window.seen >= VERIFY_DISPATCHES:
                self._verify(run, epoch)

    def _remaining(self, run: EpochRun, epoch: int) -> int | None:
        """Steps left: this fit's, plus as many as the trainer's earlier fits of this batch ran (a loop of short
        fits trains on); ``None``: epochs of unknown length."""
        if not run.total:
            return None
        return run.total - run.in_epoch + max(self.epochs - epoch - 1, 0) * run.total + self.earlier_steps

    def _decide(self, run: EpochRun, epoch: int) -> None:
        """The measure window is full: the first choice of k (a fit that cannot pay for the compile puts it off to
        the next one)."""
        w, auto = self.window, self.auto
        assert auto is not None
        if not w.dispatches:  # every dispatch compiled something: nothing measured (decided on process 0 anyway)
            w.dispatches = w.steps = 1
        step, costs = w.step_time, w.costs(self._device(1, w))
        limit, remaining = self._limit(run.total), self._remaining(run, epoch)
        k = choose_steps(costs, limit=limit, remaining_steps=remaining, compile_seconds=self.compile_cost)
        best = choose_steps(costs, limit=limit)
        if best == 1 and step and costs.call + costs.read >= HOST_SHARE * step:
            # The probe says the devices are the limit, yet the host's own work is most of the step: the probed
            # time may be a dispatch's more than a step's (a launch and its completion; on a CPU, the hand-off
            # to the runtime's threads), which fusing pays once per k too. A k chosen as if it all were is tried;
            # measured at it, the two points tell the two apart, and it is kept only if it measures faster.
            trial = Costs(call=costs.call, read=costs.read, device=0.0, device_call=costs.device)
            k = choose_steps(trial, limit=limit, remaining_steps=remaining, compile_seconds=self.compile_cost)
            best = choose_steps(trial, limit=limit)
        k, best = self._agreed((k, best), run)
        self.one_costs, self.one_step = costs, step
        self.window = _Window()
        if k > 1:
            self._switch(k, 1, run)
        else:
            self.phase = "deferred" if best > 1 else "settled"

    def _verify(self, run: EpochRun, epoch: int) -> None:
        """The verify window at k is full: k is kept if it pays over the k before it (else that k again), and a
        larger one taken where the costs told apart at both say it pays (:func:`refine`)."""
        w, auto = self.window, self.auto
        assert auto is not None
        k = auto.next_k
        measured = w.step_time
        pays = self.one_step is None or measured is None or keeps_paying(self.one_step, measured)
        further = best = k
        if pays and measured is not None and k in self.probes and self.one_costs is not None:
            at_k = w.costs(self._device(k, w))
            limit, remaining = self._limit(run.total), self._remaining(run, epoch)
            # Two readings, the larger k of the two tried. The line through the two points parts what a dispatch
            # costs from what a step does (the devices' launch, their completion); but measured in windows apart,
            # it reads a host that slowed in the second (a shared machine's drift) as host work per step, which
            # no k removes. k's own costs read as all the dispatch's do not. A k either chooses is kept only if
            # it measures faster (the next verify).
            readings = (refine(self.one_costs, k, call=at_k.call, device=at_k.device), at_k)
            further = max(choose_steps(costs, limit=limit, remaining_steps=remaining,
                                       compile_seconds=self.compile_cost, current=k) for costs in readings)
            best = max(choose_steps(costs, limit=limit, current=k) for costs in readings)
        keep, further, best = self._agreed((int(pays), further, best), run)
        self.window = _Window()
        if not keep:
            auto.switch(self.fallback, run.steps)
            self.phase = "settled"
        elif further > k:
            self.one_step = measured
            self._switch(further, k, run)
        else:
            # A larger k would pay, but not its compile within the steps to come: k holds, and the trainer's next
            # fit measures k again and looks once more (as a first choice put off is: a loop of short fits trains on).
            self.phase = "deferred" if best > k else "settled"

    def _device(self, k: int, w: _Window) -> float:
        """The devices' seconds per step at ``k`` for "auto": the least of the probes (:data:`KEEP_PROBES`), and at
        most the step time the window measured (the steps ran no faster than the devices let them)."""
        probed, step = min(self.probes[k]), w.step_time
        return min(probed, step) if step else probed

    def _switch(self, k: int, fallback: int, run: EpochRun) -> None:
        """To k steps a dispatch (``fallback`` if it does not pay), measured at k once the switch is reached, a
        probe at k among its first dispatches."""
        assert self.auto is not None
        self.auto.switch(k, run.steps)
        self.fallback, self.probe_wanted = fallback, True
        self.phase = "verify"

    def _limit(self, total: int | None) -> int:
        """The most steps one dispatch may run: at most half an epoch, and stacked batches within a sixteenth of
        a device's memory (256 MiB where it is not known)."""
        cap = MAX_STEPS if not total else min(MAX_STEPS, max(1, total // 2))
        if self.batch_bytes:
            budget = (device_memory(self.strategy.devices) or 2**32) / 16
            cap = min(cap, max(1, int(budget // self.batch_bytes)))
        return cap

    def _agreed(self, values: tuple[int, ...], run: EpochRun) -> tuple[int, ...]:
        """``values`` as process 0 has them (the window drained first: the broadcast is a device collective)."""
        if self.strategy.process_count == 1:
            return values
        run.window.drain()
        return tuple(int(v) for v in consistency.broadcast_from_primary(np.array(values, np.int32)))


class EpochMeter(EpochHook):
    """One epoch's clock: the first of the loop's hooks, and wrapped around its batches.

    :meth:`reading` times the input's own batches (the wait for the next batch when batches are placed on the
    loop's thread), :meth:`placing` the placed batches (the wait itself when a thread places them ahead); the time
    from a batch's arrival to the hook's ``after_step`` is the wait for an earlier step in the window. Where one
    step's batch is placed per dispatch on the loop's thread (fit's common case), :meth:`one_by_one` is both.
    """

    def __init__(self, fit: FitMeter, run: EpochRun, epoch: int) -> None:
        self.fit, self.run, self.epoch = fit, run, epoch
        self.dispatches = 0
        self.probe_at = PROBES_LATER if fit.records else PROBES_FIRST
        self.read = 0.0  # in the input's next() (the loop's thread, or the prefetcher's)
        self.placed_wait = 0.0  # in the placed batches' next()
        self.waited = 0.0  # for earlier steps (the window) and the probes
        self.threaded = False
        self.probing = False
        self.probe: float | None = None
        self.start = self.last = time.perf_counter()
        self.compile_start = self.compile_mark = compile_seconds()
        self.marks = (0.0, 0.0)  # (input wait, window wait) at the previous after_step
        self.end: float | None = None

    @property
    def input_wait(self) -> float:
        return self.placed_wait if self.threaded else self.read

    def reading(self, host: Iterator[Batch]) -> Iterator[Batch]:
        """``host``'s batches, timed."""
        clock = time.perf_counter
        t = clock()
        for item in host:
            self.read += clock() - t
            yield item
            t = clock()
        self.read += clock() - t

    def one_by_one(self, host: Iterator[Batch], place: Callable[[Batch], Batch]) -> Iterator[tuple[int, Batch]]:
        """``host``'s batches placed by ``place`` one step a dispatch on the loop's thread
        (:func:`mirrorax.inputs.prefetch.one_by_one`), timed: what :meth:`reading` and :meth:`placing` measure
        around :func:`~mirrorax.inputs.prefetch.device_batches`, in one generator and three clock reads a step
        (with ``after_step``'s, four), the common case's cost kept to the least (benchmarks/figures_cost.py)."""
        clock, it = time.perf_counter, iter(host)
        t = clock()
        for b in it:  # the first batch, read before the first dispatch
            self.read += clock() - t
            item = 0, place(b)
            self.fit.note_batch(*item)
            yield item
            t = clock()
            if self.probing:
                t = self._probed(t)
            break
        for b in it:
            self.read += clock() - t
            item = 0, place(b)
            self.waited -= clock()  # (+ the step before's after_step time: the wait in the window)
            yield item
            t = clock()  # (the step just dispatched)
            if self.probing:
                t = self._probed(t)
        end = clock()
        self.read += end - t
        self.waited -= end  # (the last step's after_step follows)

    def _probed(self, t: float) -> float:
        """A due probe's wait for the step dispatched before ``t``, on devices the probe left idle; returns the
        clock after it."""
        wait(self.run.aux)
        now = time.perf_counter()
        self.probing, self.probe = False, now - t
        self.waited += now - t
        return now

    def placing(self, placed: Any) -> Iterator[tuple[int, Batch]]:
        """``placed``'s ``(k, batch)`` items, timed; a probe's wait for the step just dispatched first.

        (Per step: two clock reads here and one in :meth:`after_step`; the window's wait is summed as the
        after-step times less the arrival times.)"""
        self.threaded = isinstance(placed, Prefetcher)
        it, clock = iter(placed), time.perf_counter
        try:
            t = clock()
            item = next(it, None)  # the first batch, read before the first dispatch
            self.placed_wait += clock() - t
            if item is not None:
                self.fit.note_batch(*item)
            while item is not None:
                yield item
                t = clock()  # (the step just dispatched)
                if self.probing:
                    t = self._probed(t)
                item = next(it, None)
                end = clock()
                self.placed_wait += end - t
                self.waited -= end  # (+ after_step's time: the wait in the window)
        finally:
            close = getattr(placed, "close", None)
            if close is not None:
                close()

    def before_step(self, run: EpochRun) -> Outcome | None:
        if self.dispatches in self.probe_at or (self.fit.probe_wanted and self._at_switch(run)):
            t = time.perf_counter()
            run.window.drain()
            self.waited += time.perf_counter() - t
            self.probing = True
        return None

    def _at_switch(self, run: EpochRun) -> bool:
        """Whether the next dispatch is among the first of the k "auto" switched to (then probed)."""
        auto = self.fit.auto
        return auto is not None and (auto.switch_at is None or run.steps >= auto.switch_at)

    def after_step(self, run: EpochRun) -> Outcome | None:
        now = time.perf_counter()
        self.waited += now
        self.dispatches += 1
        if self.probe is not None or self.fit.measuring:
            self._note(run, now)
        return None

    def _note(self, run: EpochRun, now: float) -> None:
        """A probe's time, and "auto"'s measurements (while it measures): what ``after_step`` does now and then."""
        fit, k = self.fit, run.steps - run.before
        probed, self.probe = self.probe, None
        compiled = compile_seconds() if fit.measuring else self.compile_mark
        # A probe of a dispatch that compiled is not kept (while "auto" measures, where a new k's program runs for
        # the first time: that run took 3-10x the devices' time on this repository's CPU); the next one is probed.
        if probed is not None and compiled <= self.compile_mark:
            fit.note_probe(k, probed)
            if fit.auto is not None and k == fit.auto.next_k:
                fit.probe_wanted = False
        if fit.measuring:
            read, waited = self.input_wait, self.waited
            if compiled > self.compile_mark:
                fit.compile_cost = max(fit.compile_cost, compiled - self.compile_mark)
            fit.feed(run, self.epoch, k, now - self.last, read - self.marks[0], waited - self.marks[1],
                     clean=compiled <= self.compile_mark and probed is None)
            self.compile_mark, self.marks = compiled, (read, waited)
        self.last = now

    def stop(self) -> None:
        """The epoch's timed part ends (before validation)."""
        self.end = time.perf_counter()

    def result(self) -> Utilisation | None:
        """The epoch's record (``None``: no step ran)."""
        run, fit = self.run, self.fit
        end = self.end if self.end is not None else time.perf_counter()
        seconds = end - self.start - (compile_seconds() - self.compile_start)
        if run.steps == 0 or seconds <= 0:
            return None
        k = fit.steps_per_execution()
        sps = run.steps / seconds
        device = fit.device_seconds(k)
        mfu = fit.flops * sps / fit.peak if fit.flops is not None and fit.peak else None
        waited = min(self.input_wait, seconds)
        host = max(seconds - waited - min(self.waited, seconds), 0.0) / run.steps
        return Utilisation(epoch=self.epoch, steps=run.steps, seconds=seconds, steps_per_second=sps,
                           flops_per_step=fit.flops, peak_flops=fit.peak, mfu=mfu,
                           device_busy=None if device is None else min(1.0, device * sps),
                           input_wait=waited / seconds, host_seconds_per_step=host,
                           device_seconds_per_step=device, steps_per_execution=k)
