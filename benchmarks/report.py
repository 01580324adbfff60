"""Turns the benchmark's per-process results into the table, the target checks, the JSON and the plot."""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

import numpy as np

from benchmarks import workloads

__all__ = ["summarize", "markdown", "memory_table", "write", "plot"]

TARGETS_TEXT = "speed ratios are mirrorax's median samples/s divided by the system's, from the same run"


def _agg(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r["status"] == "ok"]
    rates = [v for r in ok for v in r.get("samples_per_s", [])]
    row: dict[str, Any] = {"runs_ok": len(ok), "runs": len(runs), "timed_runs": len(rates)}
    if rates:
        q = np.percentile(rates, [0, 25, 50, 75, 100])
        row.update(min=float(q[0]), q1=float(q[1]), median=float(q[2]), q3=float(q[3]), max=float(q[4]))
        row["warmup_s"] = float(np.median([r["warmup_s"] for r in ok if r.get("warmup_s") is not None]))
    rss = [r["peak_rss_mb"] for r in (ok or runs) if r.get("peak_rss_mb")]
    row["peak_rss_mb"] = max(rss) if rss else None
    failures = [r for r in runs if r["status"] != "ok"]
    if not ok:
        row["status"] = failures[0]["status"]
    elif failures:
        row["status"] = f"ok ({len(failures)}/{len(runs)} {failures[0]['status']})"
    else:
        row["status"] = "ok"
    notes = [r.get("note", "") for r in failures] or [r.get("note", "") for r in ok if "RECOMPILED" in
                                                      r.get("note", "")]
    row["note"] = notes[0] if notes else ""
    row["num_params"] = next((r["num_params"] for r in ok if r.get("num_params")), None)
    for key in _MEMORY_KEYS:  # the same in every run of a cell: the first one's
        row[key] = next((r[key] for r in ok if r.get(key) is not None), None)
    return row


# What mirrorax's runs record of one device (benchmarks/peers/mirrorax_trainer.py).
_MEMORY_KEYS = ("state_bytes_per_device", "planned_state_bytes", "temp_bytes_per_device", "peak_bytes_per_device",
                "flops_per_step", "collective_bytes_per_step")
_MODES = ("mirrorax", "mirrorax_optimizer", "mirrorax_all")


def summarize(runs: list[dict[str, Any]], args: Any, skipped: dict[str, str],
              systems: dict[str, Any]) -> dict[str, Any]:
    """Aggregates the runs per (workload, devices, system) and checks the issue's targets."""
    rows = []
    for w in args.workloads:
        for n in args.devices:
            base = None
            group = []
            for s in systems:
                mine = [r for r in runs if r["workload"] == w and r["devices"] == n and r["system"] == s]
                if not mine:
                    continue
                row = dict(workload=w, devices=n, system=s, label=systems[s].label, **_agg(mine))
                group.append(row)
                if s == "mirrorax":
                    base = row
            for row in group:
                if base and base.get("median") and row.get("median"):
                    row["speedup"] = base["median"] / row["median"]
                if base and base.get("median") and row.get("median") and row.get("peak_rss_mb"):
                    row["mem_ratio"] = base["peak_rss_mb"] / row["peak_rss_mb"]
            rows.extend(group)
    versions: dict[str, str] = {}
    for r in runs:
        versions.update(r.get("versions", {}))
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "versions": versions,
        "config": {k: getattr(args, k) for k in ("workloads", "devices", "systems", "rounds", "repeats",
                                                 "steps", "warmup", "batch", "bf16", "quick",
                                                 "steps_per_execution")},
        "sizes": {w: {"batch": next((r["batch"] for r in runs if r["workload"] == w), None),
                      "steps": next((r["steps"] for r in runs if r["workload"] == w), None),
                      "rounds": 1 + max((r["round"] for r in runs if r["workload"] == w), default=0)}
                  for w in args.workloads},
        "skipped": skipped,
        "rows": rows,
        "targets": _targets(rows),
        "runs": runs,
    }


def _find(rows: list[dict[str, Any]], w: str, n: int, s: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["workload"] == w and r["devices"] == n and r["system"] == s), None)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each checked where both sides ran: ``pass``, ``FAIL`` or ``n/a``."""
    out = []

    def check(what: str, w: str, n: int, peer: str, bound: float, key: str = "speedup") -> None:
        mine, other = _find(rows, w, n, "mirrorax"), _find(rows, w, n, peer)
        if other is None or mine is None:
            return
        value = other.get(key)
        if value is None:
            why = other["status"] if not other.get("median") else mine["status"]
            out.append(dict(target=what, workload=w, devices=n, value=None, bound=bound, result="n/a",
                            why=f"{peer}: {why}" if not other.get("median") else f"mirrorax: {why}"))
            return
        ok = value <= bound if key == "mem_ratio" else value >= bound
        out.append(dict(target=what, workload=w, devices=n, value=value, bound=bound,
                        result="pass" if ok else "FAIL", why=""))

    for r in rows:
        if r["system"] not in _MODES[1:]:
            continue
        w, n, base = r["workload"], r["devices"], _find(rows, r["workload"], r["devices"], "mirrorax")
        if base is None:
            continue
        if r["system"] == "mirrorax_optimizer" and r.get("median") and base.get("median"):
            value = r["median"] / base["median"]
            out.append(dict(target="shard='optimizer' >= 0.97x replicated speed", workload=w, devices=n,
                            value=value, bound=0.97, result="pass" if value >= 0.97 else "FAIL", why=""))
        if n == 8 and w == "transformer" and r.get("state_bytes_per_device") and base.get("state_bytes_per_device"):
            # "all": the whole state; "optimizer": the optimizer's share (its parameters stay whole).
            value = r["state_bytes_per_device"] / base["state_bytes_per_device"]
            bound = 1.1 / 8 if r["system"] == "mirrorax_all" else None
            if bound is not None:
                out.append(dict(target="shard='all' state per device <= replicated/8 x 1.1", workload=w, devices=n,
                                value=value, bound=bound, result="pass" if value <= bound else "FAIL", why=""))
    for r in rows:
        if r["system"] != "mirrorax":
            continue
        w, n = r["workload"], r["devices"]
        check(">= 0.97x hand-written JAX", w, n, "jax", 0.97)
        check(">= 1.1x Keras model.fit", w, n, "keras_fit", 1.1)
        if n == 8:
            check(">= 3x tf.distribute MirroredStrategy", w, n, "tf", 3.0)
        check("peak RSS <= 1.1x hand-written JAX", w, n, "jax", 1.1, key="mem_ratio")
    return out


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    """mirrorax's three sharding modes side by side: one device's memory, and the speed against replication."""
    mine = [r for r in rows if r["system"] in _MODES and r.get("state_bytes_per_device") is not None]
    if not mine:
        return []
    lines = ["", "## Sharding modes: one device's memory", "",
             "State: parameters + optimizer state + non-trainable state held on device 0 (measured; equal to "
             "`mx.plan`'s). Temporaries and peak: the compiled train step's `memory_analysis()` per device "
             "(peak = arguments + outputs - donated + temporaries). Speed: samples/s over the replicated run's.", "",
             "| workload | devices | shard | state MiB | ÷ replicated | step temporaries MiB | step peak MiB | "
             "GFLOP/step/device | speed ÷ replicated |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    mib = 2.0 ** 20
    for r in mine:
        base = _find(rows, r["workload"], r["devices"], "mirrorax")
        state_ratio = (r["state_bytes_per_device"] / base["state_bytes_per_device"]
                       if base and base.get("state_bytes_per_device") else None)
        speed = r["median"] / base["median"] if base and base.get("median") and r.get("median") else None
        shard = {"mirrorax": "none", "mirrorax_optimizer": "optimizer", "mirrorax_all": "all"}[r["system"]]
        lines.append(f"| {r['workload']} | {r['devices']} | {shard} | {r['state_bytes_per_device'] / mib:,.2f} | "
                     f"{_fmt(state_ratio, '.3f')} | {_fmt((r.get('temp_bytes_per_device') or 0) / mib, ',.2f')} | "
                     f"{_fmt((r.get('peak_bytes_per_device') or 0) / mib, ',.2f')} | "
                     f"{_fmt((r.get('flops_per_step') or 0) / 1e9, ',.3f')} | {_fmt(speed, '.3f')} |")
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The results as markdown: set-up, the table, the target checks, skipped systems."""
    cfg = summary["config"]
    lines = [
        "# mirrorax benchmark",
        "",
        f"{summary['when']} on {summary['host']['platform']}, {summary['host']['cpus']} CPU core(s). "
        + ", ".join(f"{k} {v}" for k, v in sorted(summary["versions"].items())) + ".",
        "",
        f"Devices: simulated CPU devices (JAX `jax_num_cpu_devices`, TF logical CPUs, PyTorch processes) "
        f"sharing the host's cores. Each cell: {cfg['rounds'] or 'per-workload'} process(es) per system "
        f"(`rounds` below), interleaved round-robin, x {cfg['repeats']} timed run(s) after warm-up; "
        "samples/s is the median over all "
        f"timed runs, min-max beside it. `mirrorax ÷ system` = mirrorax's median / the system's "
        f"(> 1: mirrorax faster). Peak RSS: the process's VmHWM (PyTorch: summed over its ranks)."
        + (" Mixed bfloat16." if cfg.get("bf16") else ""),
        "",
        "Sizes: " + "; ".join(f"{workloads.get(w).title}: global batch {s['batch']}, {s['steps']} timed steps, "
                              f"{s['rounds']} round(s)"
                              for w, s in summary["sizes"].items()) + ".",
        "",
        "| workload | devices | system | samples/s (median) | min-max | IQR | mirrorax ÷ system | "
        "peak RSS MiB | status |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in summary["rows"]:
        spread = f"{_fmt(r.get('min'))}-{_fmt(r.get('max'))}" if r.get("median") else "-"
        iqr = f"{_fmt(r.get('q1'))}-{_fmt(r.get('q3'))}" if r.get("median") else "-"
        status = r["status"] + (f": {r['note']}" if r.get("note") and r["status"] != "ok" else "")
        lines.append(f"| {r['workload']} | {r['devices']} | {r['label']} | {_fmt(r.get('median'))} | {spread} | "
                     f"{iqr} | {_fmt(r.get('speedup'), '.2f')} | {_fmt(r.get('peak_rss_mb'))} | "
                     f"{status.replace('|', '/')} |")
    lines += memory_table(summary["rows"])
    lines += ["", "## Targets", "", f"From the issue; {TARGETS_TEXT}.", "",
              "| target | workload | devices | measured | result |", "|---|---|---:|---:|---|"]
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {t['workload']} | {t['devices']} | {value} | "
                     f"{t['result']}{' (' + t['why'] + ')' if t['why'] else ''} |")
    loaded = [r for r in summary["runs"] if r.get("other_load", 0) > 0.1]
    if loaded:
        lines += ["", f"Note: in {len(loaded)} of {len(summary['runs'])} processes, other work on the host took "
                  f"more than 10% of the CPU (up to {max(r['other_load'] for r in loaded):.0%}); see "
                  "`other_load` in results.json."]
    counts = {k: sum(t["result"] == k for t in summary["targets"]) for k in ("pass", "FAIL", "n/a")}
    lines += ["", f"{counts['pass']} pass, {counts['FAIL']} fail, {counts['n/a']} not applicable.",
              "", "GPU target (workload (c) in bf16 on one H200, samples/s and MFU): not measured by this "
              "command; run `python benchmarks/gpu_h200.py` on a machine with the GPU."]
    if summary["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {s}: {why}" for s, why in summary["skipped"].items()]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: str) -> None:
    """Samples/s against devices, one subplot per workload, one line per system (min-max as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = summary["config"]["workloads"]
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.2), squeeze=False)
    for ax, w in zip(axes[0], names):
        rows = [r for r in summary["rows"] if r["workload"] == w]
        for system in dict.fromkeys(r["system"] for r in rows):
            mine = [r for r in rows if r["system"] == system]
            good = [r for r in mine if r.get("median")]
            bad = [str(r["devices"]) for r in mine if not r.get("median")]
            label = mine[0]["label"] + (f" ({mine[-1]['status'] if bad else ''} at {','.join(bad)})" if bad else "")
            if good:
                xs = [r["devices"] for r in good]
                ys = np.array([r["median"] for r in good])
                err = np.array([[y - r["min"] for y, r in zip(ys, good)], [r["max"] - y for y, r in zip(ys, good)]])
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label,
                            linewidth=2.5 if system == "mirrorax" else 1.5)
            else:
                ax.plot([], [], marker="x", linestyle="none", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(summary["config"]["devices"], [str(d) for d in summary["config"]["devices"]])
        ax.set_xlabel("devices")
        ax.set_ylabel("samples/s (median)")
        ax.set_title(workloads.get(w).title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(summary: dict[str, Any], out: str) -> list[str]:
    """Writes ``results.md``, ``results.json`` and (with matplotlib) ``results.png`` into ``out``.

    Returns:
      the paths written.
    """
    paths = [os.path.join(out, name) for name in ("results.md", "results.json", "results.png")]
    with open(paths[0], "w") as f:
        f.write(markdown(summary))
    with open(paths[1], "w") as f:
        json.dump(summary, f, indent=1, default=str)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("results.png skipped: matplotlib not installed (pip install matplotlib)")
        return paths[:2]
    plot(summary, paths[2])
    return paths
