"""How long a checkpoint save blocks the training loop: mirrorax's ``Checkpointer`` against bare Orbax.

Run from the repository root::

    python -m benchmarks.checkpoint_cost                   # 1 and 8 devices, every sharding mode
    python -m benchmarks.checkpoint_cost --devices 8 --modes all --rounds 3

The state is a Trainer's: a ``mirrorax.zoo.mlp(784, 31744, 10)`` (25.2M parameters) compiled with Adam
and fitted for one step under ``MirroredStrategy(shard=mode)``, so parameters, the two Adam moments,
metrics, step and RNG, 289 MiB, laid out as that mode lays them out. Each round, a jitted step makes
new values (new buffers, as a train step does) and waits for them, as the Trainer drains its window
before a save; then

* ``Checkpointer.save`` is called as the Trainer calls it: through the fit's saving
  (``mirrorax.fit.saving.Saving.save_due`` at an epoch's end: the step read from the state, the fit's record
  made (data position, run, history), the durable tier's save), and
* a bare ``orbax.checkpoint.CheckpointManager`` (async, ``max_to_keep=2``) saves the same state tree
  with ``args.Composite(state=args.StandardSave(state))``,

each timed from the call to its return (the time the loop is blocked) and to the end of
``wait`` / ``wait_until_finished`` (on disk). The previous save is on disk before each timed save, so
neither waits for another. The two alternate, their order swapping every round. One warm-up round
(compilation, first-time set-up) is not counted.

A device count is fixed when JAX starts, so each count runs in its own process (``--child``); the
parent prints one markdown table of the medians and maxima (seconds) and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"None": None, "optimizer": "optimizer", "all": "all"}


def _child(devices: int, modes: list[str], rounds: int, hidden: int, directory: str) -> list[dict[str, Any]]:
    """Measures every mode at ``devices`` devices (this process was started with that many)."""
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np
    import orbax.checkpoint as ocp

    import mirrorax as mx
    from mirrorax import zoo
    from mirrorax.checkpoint import resume
    from mirrorax.checkpoint.checkpointer import Checkpointer
    from mirrorax.checkpoint.policy import SavePoint
    from mirrorax.fit.saving import Saving
    from mirrorax.results import History

    rng = np.random.default_rng(0)
    x = rng.random((64, 784), dtype=np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)

    @jax.jit
    def new_values(state: Any) -> Any:
        # New buffers with new values, as a train step makes; PRNG keys and flags pass through.
        return jax.tree.map(lambda a: a if a.dtype == jnp.bool_ or jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                            else a + jnp.ones((), a.dtype), state)

    results = []
    for mode in modes:
        keras.utils.set_random_seed(0)
        strategy = mx.MirroredStrategy(jax.devices()[:devices], shard=MODES[mode])
        with strategy.scope():
            model = zoo.mlp(784, hidden, 10)
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        trainer = mx.Trainer(model, strategy)
        trainer.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=1, verbose=0)
        state = trainer.state
        state_mib = sum(a.nbytes for a in jax.tree.leaves(state)) / 2**20

        where = tempfile.mkdtemp(prefix=f"ckpt_cost_{devices}_{mode}_", dir=directory)
        ckpt = Checkpointer(os.path.join(where, "mirrorax"), keep=2)
        history = History()
        history.append(0, {"loss": 2.3, "accuracy": 0.1}, 1000.0)
        run = {"batch_size": 32, "shuffle": True, "seed": 0, "steps_per_epoch": None}
        saving = Saving(resume.Record(run, history, {"x": [[784], "float32"], "y": [[], "int32"]}), ckpt, every=100)
        bare = ocp.CheckpointManager(os.path.join(where, "orbax"), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=True))
        step = int(np.asarray(jax.device_get(state["step"])))

        def save_mirrorax(state: Any, step: int, saving: Any = saving, ckpt: Any = ckpt) -> tuple[float, float]:
            t0 = time.perf_counter()
            saving.save_due(SavePoint(step, epoch_end=True), state, 0, 1, lambda: None)
            blocked = time.perf_counter() - t0
            ckpt.wait()
            return blocked, time.perf_counter() - t0

        def save_orbax(state: Any, step: int, bare: Any = bare) -> tuple[float, float]:
            t0 = time.perf_counter()
            bare.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
            blocked = time.perf_counter() - t0
            bare.wait_until_finished()
            return blocked, time.perf_counter() - t0

        times: dict[str, list[tuple[float, float]]] = {"mirrorax": [], "orbax": []}
        for r in range(rounds + 1):
            order = [("mirrorax", save_mirrorax), ("orbax", save_orbax)]
            for name, save in order if r % 2 else order[::-1]:
                state = new_values(state)
                step = int(np.asarray(jax.device_get(state["step"])))
                jax.block_until_ready(state)
                measured = save(state, step)
                if r:  # round 0 warms up
                    times[name].append(measured)
        ckpt.close()
        bare.close()
        results.append({"devices": devices, "mode": mode, "state_mib": state_mib, "times": times,
                        "params": model.count_params()})
        del trainer, state
    return results


def _row(res: dict[str, Any]) -> str:
    blocked = {k: [b for b, _ in v] for k, v in res["times"].items()}
    disk = {k: [d for _, d in v] for k, v in res["times"].items()}
    med = {k: statistics.median(v) for k, v in blocked.items()}
    return (f"| {res['devices']} | {res['mode']} | {med['mirrorax']:.3f} | {max(blocked['mirrorax']):.3f} "
            f"| {med['orbax']:.3f} | {max(blocked['orbax']):.3f} | {med['mirrorax'] / med['orbax']:.2f} "
            f"| {statistics.median(disk['mirrorax']):.2f} | {statistics.median(disk['orbax']):.2f} |")


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of a run's results."""
    head = ("| devices | shard | mirrorax save blocks, median | max | bare Orbax save blocks, median | max "
            "| ratio of medians | mirrorax on disk, median | bare Orbax on disk, median |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    return "\n".join([head] + [_row(r) for r in results])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,8", help="comma-separated device counts (default 1,8)")
    parser.add_argument("--modes", default="None,optimizer,all", help="sharding modes (default all three)")
    parser.add_argument("--rounds", type=int, default=5, help="timed saves per system and mode (default 5)")
    parser.add_argument("--hidden", type=int, default=31744, help="MLP width (31744: 25.2M parameters)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: expected some of {list(MODES)}; received {m!r}")
    if args.child is not None:
        print("RESULT " + json.dumps(_child(args.child, modes, args.rounds, args.hidden, args.dir)), flush=True)
        return

    results = []
    with tempfile.TemporaryDirectory(prefix="ckpt_cost_", dir=args.dir) as directory:
        for n in [int(d) for d in args.devices.split(",") if d]:
            env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n), KERAS_BACKEND="jax")
            env.setdefault("JAX_PLATFORMS", "cpu")
            env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), REPO, env.get("PYTHONPATH", "")])
            cmd = [sys.executable, "-m", "benchmarks.checkpoint_cost", "--child", str(n), "--modes", ",".join(modes),
                   "--rounds", str(args.rounds), "--hidden", str(args.hidden), "--dir", directory]
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{n} devices: the measuring process failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
            results += json.loads(lines[-1][len("RESULT "):])
    first = results[0]
    print(f"{first['params']:,} parameters, {first['state_mib']:.0f} MiB of state; {args.rounds} timed saves "
          "per cell; seconds\n")
    print(table(results))


if __name__ == "__main__":
    main()
