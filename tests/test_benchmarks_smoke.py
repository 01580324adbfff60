"""Smoke test of the benchmark harness (``python -m benchmarks.run``) on its smallest configuration.

mirrorax and the hand-written JAX loop, the MLP workload, 1 and 2 simulated devices, a few steps: the
harness must run every process, interleave the systems and write the table, the JSON (and the plot where
matplotlib is installed) with a speed ratio for every cell. It checks the plumbing, not the speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess

import pytest
from jobs.procs import clean_env, python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.slow  # starts processes


@pytest.fixture(scope="module")
def smallest(tmp_path_factory):
    """The harness on its smallest configuration: mirrorax and the hand-written loop at 1 and 2 devices."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [*python(), "-m", "benchmarks.run", "--quick", "--workloads", "mlp", "--devices", "1,2",
           "--systems", "mirrorax,jax", "--steps", "4", "--warmup", "1", "--repeats", "1", "--rounds", "1",
           "--idle-wait", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.multi_device
@pytest.mark.timeout(600)  # the shared harness run counts against whichever test sets it up
def test_harness_smallest_config(smallest):
    out, proc = smallest
    summary = json.loads((out / "results.json").read_text())
    cells = {(r["system"], r["devices"]): r for r in summary["rows"]}
    assert set(cells) == {(s, n) for s in ("mirrorax", "jax") for n in (1, 2)}, cells.keys()
    for key, row in cells.items():
        assert row["status"] == "ok", (key, row.get("note"), proc.stdout[-2000:])
        assert row["median"] > 0 and row["peak_rss_mb"] > 0
        assert row["speedup"] > 0  # mirrorax's samples/s over the system's, from the same run
    # Interleaved: at each device count the two systems run back to back, not all of one system first.
    order = [(r["devices"], r["system"]) for r in summary["runs"]]
    assert [n for n, _ in order] == [1, 1, 2, 2], order

    table = (out / "results.md").read_text()
    assert "| mlp | 2 | mirrorax Trainer.fit |" in table and "## Targets" in table
    assert "| mlp | 2 | hand-written JAX loop |" in table
    assert (out / "results.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


@pytest.fixture(scope="module")
def two_device_systems(tmp_path_factory):
    """One harness run at 2 devices for the systems beside mirrorax and the hand-written loop: the
    entry points (model.fit under a scope, the keras.io guide loop) and the sharding modes. Each system
    is a process either way; one harness for all of them saves a harness start. Replicated mirrorax at 2
    devices, the same configuration, is the ``smallest`` run's row."""
    out = tmp_path_factory.mktemp("bench2")
    cmd = [*python(), "-m", "benchmarks.run", "--quick", "--workloads", "mlp", "--devices", "2",
           "--systems", "keras_scope,guide_api,mirrorax_optimizer,mirrorax_all", "--steps", "4",
           "--warmup", "1", "--repeats", "1", "--rounds", "1", "--idle-wait", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    return rows, (out / "results.md").read_text()


@pytest.mark.multi_device
@pytest.mark.timeout(600)  # the shared harness run counts against whichever test sets it up
def test_mirrorax_entry_points_run_as_systems(two_device_systems):
    """model.fit under a scope and the keras.io guide loop on strategy.jit are systems of their own."""
    rows, _ = two_device_systems
    assert {(k, rows[k]["status"]) for k in ("keras_scope", "guide_api")} == {("keras_scope", "ok"),
                                                                              ("guide_api", "ok")}, rows
    assert all(rows[k]["median"] > 0 for k in ("keras_scope", "guide_api"))


@pytest.mark.multi_device
@pytest.mark.timeout(600)  # the shared harness run counts against whichever test sets it up
def test_sharding_modes_run_as_systems_with_their_memory(two_device_systems, smallest):
    """shard='optimizer' and 'all' are systems beside replication; each run records device 0's memory."""
    all_rows, table = two_device_systems
    assert set(all_rows) == {"keras_scope", "guide_api", "mirrorax_optimizer", "mirrorax_all"}
    replicated = [r for r in json.loads((smallest[0] / "results.json").read_text())["rows"]
                  if (r["system"], r["devices"]) == ("mirrorax", 2)]
    rows = {"mirrorax": replicated[0], **{k: all_rows[k] for k in ("mirrorax_optimizer", "mirrorax_all")}}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("note"))
        assert r["state_bytes_per_device"] == r["planned_state_bytes"] > 0  # measured == planned
        assert r["temp_bytes_per_device"] > 0 and r["flops_per_step"] > 0
    state = {k: rows[k]["state_bytes_per_device"] for k in rows}
    assert state["mirrorax_all"] < state["mirrorax_optimizer"] < state["mirrorax"]
    assert "## Sharding modes: one device's memory" in table and "| mlp | 2 | all |" in table


@pytest.mark.multi_device
def test_gpu_script_dry_run_on_cpu(tmp_path):
    """benchmarks/gpu_h200.py --dry: the GPU script's whole path on 2 CPU devices, tiny sizes, for replicated
    mirrorax and shard='all' (each system is a process of its own; the harness tests above run the others)."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run(python("benchmarks/gpu_h200.py", "--dry", "--systems", "mirrorax,mirrorax_all",
                                 "--json-out", str(out)), cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["mirrorax", "mirrorax_all"]
    assert all(r["status"] == "ok" and r["mfu"] > 0 for r in rows.values()), rows
    for mode in ("mirrorax", "mirrorax_all"):
        assert rows[mode]["xla_mfu"] > 0 and rows[mode]["peak_bytes_per_device"] > 0
    assert rows["mirrorax_all"]["state_bytes_per_device"] < rows["mirrorax"]["state_bytes_per_device"]
    assert "XLA MFU" in proc.stdout and "mirrorax_all / replicated" in proc.stdout


def test_accelerator_table_cpu_smoke(tmp_path):
    """``python -m benchmarks.accelerator --cpu-smoke``: the accelerator table's whole path on one CPU device
    at tiny sizes: a process per system, in two alternating rounds (mlp: each ratio from the two rates of a
    round) or once (the LM), every figure of the table, and mx.plan after each mirrorax fit compiling nothing;
    the Flax NNX loops' table (``benchmarks/nnx_loops.py``). The plumbing, not the speed."""
    proc = subprocess.run(python("-m", "benchmarks.accelerator", "--cpu-smoke", "--workloads", "mlp,lm,nnx",
                                 "--systems", "jax,mirrorax,keras_scope", "--peak-tflops", "1", "--process-rounds",
                                 "2", "--out", str(tmp_path)),
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    summary = result["summary"]
    assert sorted(summary) == ["lm", "mlp"] and result["failed"] == []
    for w in ("mlp", "lm"):
        rows = summary[w]
        assert sorted(rows) == ["jax", "keras_scope", "mirrorax"]
        assert rows["jax"]["ratio_to_hand"] == 1.0
        for s, r in rows.items():
            assert r["samples_per_s"] > 0 and r["first_step_s"] > 0 and r["mfu"] > 0 and r["ratio_to_hand"] > 0
            assert r["plan_compiles"] == (None if s == "jax" else 0), (w, s, r)
    assert all(r["tokens_per_s"] > 0 for r in summary["lm"].values())
    # one process per system for the LM: each has its own peak (CPU devices keep none: absent here); two
    # rounds of a process per system for mlp, alternating
    runs = [r for r in result["runs"] if r["workload"] == "lm"]
    assert len(runs) == 3 and all(r["seq_len"] == 16 for r in runs)
    mlp = [(r["process_round"], r["system"]) for r in result["runs"] if r["workload"] == "mlp"]
    assert mlp == [(0, "jax"), (0, "mirrorax"), (0, "keras_scope"), (1, "keras_scope"), (1, "mirrorax"), (1, "jax")]
    assert all(v["processes"] == 2 for v in summary["mlp"].values())
    # Each first step with its trace and compile; on mlp timed on fresh builds twice, the median shown.
    for r in result["runs"]:
        firsts, b = r["first_steps_s"], r["first_step_breakdown"]
        assert len(firsts) == (2 if r["workload"] == "mlp" else 1), r
        assert r["first_step_s"] == pytest.approx(sum(firsts) / len(firsts))
        assert b["compiles"] >= 1 and b["traces"] >= 1 and 0 < b["compile_s"] < r["first_step_s"] + 1, b
        # the medians over the timed builds: the host's trace and lowering, and XLA's compile
        assert 0 < r["first_trace_s"] < max(firsts) and 0 < r["first_compile_s"] < max(firsts) + 1, r
    for rows in summary.values():
        assert all(v["first_trace_s"] > 0 and v["first_compile_s"] > 0 for v in rows.values()), rows
    table = (tmp_path / "results.md").read_text()
    assert "| lm | model.fit under scope |" in table and "python -m benchmarks.accelerator --cpu-smoke" in table
    assert "| of which trace and lowering s |" in table
    # the Flax NNX loops: every system, its ratio to its baseline (Flax's split/merge loop; the functional loop's
    # port: Flax's functional loop)
    nnx = json.loads((tmp_path / "nnx.json").read_text())
    assert [(r["workload"], r["batch"]) for r in nnx] == [("guide", 8)]
    assert sorted(nnx[0]["systems"]) == ["flax_functional", "flax_split_merge", "guide_as_written", "nnx_jit",
                                         "strategy_jit", "strategy_jit_functional", "strategy_jit_guide_as_written",
                                         "strategy_jit_loader", "trainer"]
    assert all(v["steps_per_s"] > 0 and v["ratio"] > 0 for v in nnx[0]["systems"].values())
    assert "| guide | 8 | @strategy.jit, over the loader's batches |" in table and "| guide | 8 | mx.Trainer |" in table


def test_accelerator_auto_systems_cpu_smoke(tmp_path):
    """The table's ``steps_per_execution="auto"`` systems (``mx.Trainer`` and ``model.fit`` under a scope) on the
    MLP at batch 32 (the test above runs the hand loop): fitted until "auto" settles (here at most one chunk),
    then timed; each timed fit's own figures (its printed MFU, k, busy and input shares) set beside the table's
    MFU."""
    proc = subprocess.run(python("-m", "benchmarks.accelerator", "--cpu-smoke", "--workloads", "mlp32",
                                 "--systems", "mirrorax_auto,keras_scope_auto", "--peak-tflops", "1",
                                 "--process-rounds", "1", "--out", str(tmp_path)),
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["summary"]["mlp32"]
    assert sorted(rows) == ["keras_scope_auto", "mirrorax_auto"]
    assert all(r["batch"] == 32 and r["steps"] == 4 for r in result["runs"])
    for s in ("mirrorax_auto", "keras_scope_auto"):
        r = rows[s]
        assert r["ks"] == [1] and r["settle_calls"] == 1 and r["samples_per_s"] > 0, (s, r)
        assert r["fit_mfu"] > 0 and r["chunk_mfu"] > 0 and r["xla_flops_ratio"] > 0 and r["time_ratio"] > 0.5
        assert 0 <= r["input_wait"] <= 1
    table = (tmp_path / "results.md").read_text()
    assert table.count('| mlp32 | Trainer.fit, "auto" |') == 2 and "| printed MFU | benchmark MFU |" in table


def test_gpu_script_names_the_systems_when_one_is_unknown(capsys):
    from benchmarks import gpu_h200

    with pytest.raises(SystemExit) as raised:
        gpu_h200.main(["--dry", "--systems", "mirrorax,tf"])
    assert raised.value.code == 2
    assert "--systems got 'mirrorax,tf'; the systems are mirrorax, mirrorax_optimizer" in capsys.readouterr().err


def test_checkpoint_cost_prints_a_row_per_device_count_and_mode(tmp_path):
    """``python -m benchmarks.checkpoint_cost`` at a tiny width: a process per device count, a table row
    per (devices, mode) with both systems' times. The plumbing, not the speed."""
    cmd = [*python(), "-m", "benchmarks.checkpoint_cost", "--devices", "1,2", "--modes", "None,all",
           "--rounds", "1", "--hidden", "64", "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 2 |")]
    assert [r.split("|")[1:3] for r in rows] == [[" 1 ", " None "], [" 1 ", " all "], [" 2 ", " None "],
                                                 [" 2 ", " all "]], proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[2:]), row
    assert list(tmp_path.iterdir()) == []  # the checkpoints went into a temporary directory, now removed


def test_step_timeline_counts_each_step_once_with_its_idle_gap():
    """``step_timeline.summarize``: a step's event nested in another of the same step (the C++ call inside the
    Python call) counts once; the gaps are between the outer events; other events and timelines are ignored."""
    from benchmarks import step_timeline

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:TPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "XLA Modules"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 3, "args": {"name": "python"}}]
    device = [{"ph": "X", "pid": 1, "tid": 7, "name": "jit_guarded(123)", "ts": t, "dur": 100} for t in (0, 250, 500)]
    host = []
    for t in (0, 200, 400):
        host += [{"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(guarded)", "ts": t, "dur": 60},
                 {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(guarded)", "ts": t + 10, "dur": 40}]
    other = [{"ph": "X", "pid": 2, "tid": 3, "name": "$loop.py:74 run", "ts": 0, "dur": 600}]
    out = step_timeline.summarize(meta + device + host[::-1] + other)
    assert sorted(out) == ["/device:TPU:0 | XLA Modules", "/host:CPU | python"]
    dev, py = out["/device:TPU:0 | XLA Modules"], out["/host:CPU | python"]
    assert dev["steps"] == 3 and dev["busy_median_us"] == 100 and dev["gap_median_us"] == 150
    assert dev["span_ms"] == pytest.approx(0.6)
    assert py["steps"] == 3 and py["busy_median_us"] == 60 and py["gap_median_us"] == 140


def test_step_timeline_reads_the_profilers_trace_on_cpu(tmp_path):
    """``python -m benchmarks.step_timeline`` on the CPU: the interleaved rounds, then each system's profiled
    chunk read back from jax.profiler's Perfetto trace, one host call per step (the CPU client keeps no
    device timeline)."""
    out = tmp_path / "timeline.json"
    proc = subprocess.run(python("-m", "benchmarks.step_timeline", "--workload", "mlp", "--systems", "jax,mirrorax",
                                 "--steps", "4", "--rounds", "2", "--round-steps", "3", "--out", str(out)),
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    systems = json.loads(out.read_text())["systems"]
    assert sorted(systems) == ["jax", "mirrorax"]
    assert systems["jax"]["ratio_to_first"] == 1.0  # the first system is the rounds' reference
    for s, r in systems.items():
        assert len(r["chunk_s"]) == 2 and r["profiled_chunk_s"] > 0
        assert len(r["rounds_s"]) == 2 and r["round_steps"] == 3 and r["ratio_to_first"] > 0
        # The Python thread is named after the interpreter's executable (python, python3, python3.11).
        host = [v for k, v in r["timelines"].items() if k.startswith("/host:")]
        assert len(host) == 1 and host[0]["steps"] == 4, (s, r["timelines"])


def test_snapshot_cost_prints_a_row_with_its_costs():
    """``python -m benchmarks.snapshot_cost`` on 1 device, a few steps, one round: the table's row with the
    loop's wait in a snapshot and the writer's time both measured. The plumbing, not the figure."""
    cmd = [*python(), "-m", "benchmarks.snapshot_cost", "--devices", "1", "--modes", "None", "--rounds", "1",
           "--steps", "12"]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| 1 | None |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0.5 and float(cells[5]) > 0 and float(cells[6]) > 0, row  # state MiB, save, writer


def test_every_baseline_donates_what_its_source_donates():
    """A baseline is written as its source writes it: Flax's fastest loop donates its state and never the batch
    (the nnx_loops baseline once donated the batch: JAX warned, Flax's loop ran 25% slow, and mirrorax looked
    1.25x faster than it), the keras.io loop its state, the guide's functional loop nothing. Checked on the
    compiled steps' own record of their donated arguments."""
    import jax

    from benchmarks import host_proxy, nnx_loops

    found = host_proxy.baselines()
    x, y = nnx_loops.make_data("guide", 64)
    system = nnx_loops.System("flax_split_merge", "guide", x, y, 32, jax.devices()[:1])
    found["nnx_loops.flax_split_merge"] = (system.step, system.example, system.donated)
    assert set(found) == {"flax_loop", "flax_functional", "keras_hand", "nnx_loops.flax_split_merge"}
    for name, (step, example, donated) in found.items():
        positional, _ = step.lower(*example).args_info
        for i, arg in enumerate(positional):
            flags = [leaf.donated for leaf in jax.tree.leaves(arg)]
            if i in donated:
                assert flags and all(flags), (name, i, "its state must be donated")
            else:
                assert not any(flags), (name, i, "only its state may be donated")


@pytest.mark.timeout(600)
def test_host_proxy_runs_each_system_in_its_own_process_against_its_baseline(tmp_path):
    """``python -m benchmarks.host_proxy`` on a few steps: each door and its baseline (added when not named) run in
    processes of their own, alternating, and the table gives each door's ratio and host time beyond its baseline.
    The plumbing, not the speed."""
    out = tmp_path / "proxy.json"
    systems = "strategy_jit_donated,strategy_jit_functional,trainer"
    cmd = [*python(), "-m", "benchmarks.host_proxy", "--systems", systems, "--steps", "20", "--warmup", "5",
           "--repeats", "1", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert set(rows) == {"strategy_jit_donated", "strategy_jit_functional", "trainer", "flax_loop", "flax_functional"}
    for name, row in rows.items():
        assert len(row["runs"]) == 2 and row["steps_per_s"] > 0 and row["host_us"] > 0, name
        assert (row["ratio"] is None) == (name in ("flax_loop", "flax_functional")), name
    assert "| strategy_jit_functional | flax_functional |" in proc.stdout


def test_host_proxy_auto_systems_settle_before_they_are_timed_and_say_their_k():
    """``python -m benchmarks.host_proxy --systems keras_trainer_auto,...``: an ``steps_per_execution="auto"``
    system fits until "auto" has settled (or for at most ``SETTLE`` runs) before it is timed, and its result says
    the k it ran and where "auto" stood. The plumbing, not the speed."""
    from benchmarks import host_proxy

    for system in ("keras_trainer_auto", "keras_scope_auto"):
        out = host_proxy.one(system, steps=40, warmup=5, repeats=1)
        assert out["steps_per_s"] > 0 and 0 <= out["settle_runs"] <= host_proxy.SETTLE, out
        assert out["k"] >= 1 and out["phase"] in ("settled", "deferred", "measure", "verify"), out
        assert out["settle_runs"] == host_proxy.SETTLE or out["phase"] == "settled", out


@pytest.mark.timeout(300)
def test_step_phases_splits_a_steps_host_time_by_phase(tmp_path):
    """``python -m benchmarks.step_phases``: each door's host time per step split into phases that add up to it;
    the held objects' phase is the NNX door's alone, the window's wait is never negative, and on one device no
    batch is placed (its rows go to the dispatch, which transfers them). The plumbing, not the speed."""
    out = tmp_path / "phases.json"
    proc = subprocess.run(python("-m", "benchmarks.step_phases", "--systems", "strategy_jit_donated,trainer", "--steps",
                                 "30", "--warmup", "5", "--out", str(out)),
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"strategy_jit_donated", "trainer"}
    for name, r in rows.items():
        phases = r["phases"]
        assert sum(phases.values()) == pytest.approx(r["us_per_step"]), name
        assert phases["placement"] == 0 and phases["dispatch"] > 0 and phases["window wait"] >= 0, (name, phases)
    assert rows["strategy_jit_donated"]["phases"]["held objects"] > 0 == rows["trainer"]["phases"]["held objects"]
    assert "| strategy_jit_donated |" in proc.stdout


def test_figures_cost_compares_on_off_and_off_again_and_times_the_clock_alone():
    """``python -m benchmarks.figures_cost``: one trainer fits with the figures off, on and off again (the A/A
    beside the A/B), the "on" fits keep their records and the "off" ones none; the clock's cost in a loop of no
    work for both ways the meter wraps the batches is a positive fraction of a microsecond to a few. The
    plumbing, not the speed."""
    proc = subprocess.run(python("-m", "benchmarks.figures_cost", "--steps", "48", "--rounds", "2", "--clock-steps",
                                 "20000"), cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for kind in ("off", "on", "off again"):
        assert re.search(rf"figures {kind} *: [0-9,]+ steps/s", out), out
    assert "off again/off (the A/A" in out and "last epoch with the figures: device busy" in out
    alone = dict(re.findall(r"the clock alone \((\w+); a loop of no work\): ([0-9.]+) us a step", out))
    assert set(alone) == {"one_by_one", "wrapped"} and all(0 < float(v) < 20 for v in alone.values()), out


def test_device_step_times_the_device_alone_and_finds_no_device_work_added():
    """``benchmarks/device_step.py`` (run on the chip to tell a step's device time from its host time): the
    guide's step, a few steps in one program; ``@strategy.jit``'s compiled program does the FLOPs of Flax's loop's
    on one device, give or take a scalar operation (mirrorax adds no device work to a step: 95,958 against 95,957
    here; the CNN's 1.202 GFLOP equal on a TPU), and a loop over placed batches is timed."""
    from benchmarks import device_step

    row = device_step.measure("guide", 8, inner=2, steps=3)
    assert row["device_us_per_step"] > 0 and row["placed_loop_steps_per_s"] > 0, row
    flops = row["flax_cost"]["flops"]
    assert flops > 1000 and 0 <= row["strategy_jit_cost"]["flops"] - flops <= 4, row
    assert "| guide | 8 |" in device_step.markdown([row])
