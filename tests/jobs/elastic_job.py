"""The elastic job: three trainings a lost worker must not change, run one after the other (issue 48).

Phases, each on 300 digits at global batch 48 (7 batches per epoch, the last one 12 rows), 3 epochs:

* ``fit``: a Keras model (Dense, BatchNormalization, Dropout) compiled under ``strategy.scope()``, its own
  ``model.fit`` (Keras's shuffle order), then ``model.evaluate``;
* ``trainer``: the same model through ``mx.Trainer`` on ``MirroredStrategy(shard="all")``;
* ``loop``: a custom loop on ``strategy.jit`` (a tanh MLP, optax Adam) with ``mx.Snapshots``.

``cnn`` (not run unless named in ``EJ_PHASES``): the benchmark's CNN workload (``mirrorax.zoo.digits_cnn()``,
global batch 256, Adam) through its own ``model.fit`` under the scope, 3 epochs (``EJ_CNN_EPOCHS``) of 8 steps
on seeded random 8x8x1 inputs: what ``benchmarks/elastic_restart.py`` restarts.

With ``EJ_TIMES=1`` every process prints ``TIME <rank> <milestone> <time>`` as it reaches each milestone of its
start (``start``: the process began, ``script``: the script began (a standby process began before),
``imported``: JAX, Keras and mirrorax imported, ``joined``: the strategy built, ``compiled``: the last compile
before its fit's loop ended, ``train_begin``: fit's restore done and its loop begun, ``first_step``: its first
step done), for the benchmark's table of phases.

Run three ways: as it is (one process; ``--devices N``), under ``mirrorax launch`` (each process one JAX
process), or as Ray Train's training function (:func:`ray_main`: each worker one JAX process). Process 0
writes ``<EJ_OUT>/<phase>.npz`` (weights, history, evaluation) and prints ``PHASE <name> <step> <processes>
<time>`` after each step of each phase (flushed; the time is the wall clock's, as ``time.time()``).

Faults (``EJ_EVENTS``, comma-separated ``action:phase:step:who:processes``; each happens once, a marker file
in ``EJ_OUT`` says it did): after step ``step`` of ``phase``, in a job of ``processes`` processes, the
process ``who`` (``rank<R>``, ``slot<S>``: ``mirrorax launch``'s slot, or ``all``)

* ``kill``: prints ``KILL <phase> <step> <time>`` and SIGKILLs itself;
* ``hold``: writes ``held-<phase>-<step>-<rank>`` (its pid and node) and waits to be killed (the test kills it
  and removes its node);
* ``wait``: waits to be killed, after process 0 wrote ``wait-<phase>-<step>`` (the test adds a node: Ray's
  resize ends this group).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

ROWS, BATCH, EPOCHS, STEPS_PER_EPOCH = 300, 48, 3, 7
CNN_BATCH, CNN_STEPS_PER_EPOCH = 256, 8
HOLD_LIMIT_S = 300  # a test that never ends a hold: end the job rather than hang
_compiles: list[float] = []  # (EJ_TIMES) when each compile of this process ended


def _start_time() -> float:
    """When this process began (wall clock), from /proc: its start in clock ticks since boot, against uptime."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def stamp(what: str, at: float | None = None) -> None:
    """``TIME <rank> <what> <time>`` under ``EJ_TIMES`` (the rank as the launcher or Ray says)."""
    if not os.environ.get("EJ_TIMES"):
        return
    rank = os.environ.get("MIRRORAX_PROCESS_ID") or os.environ.get("EJ_RANK", "?")  # (never JAX's: it would start)
    print(f"TIME {rank} {what} {time.time() if at is None else at:.3f}", flush=True)


def _count_compiles() -> None:
    import jax

    def ended(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _compiles.append(time.time())
        if os.environ.get("EJ_TIMES") == "all":
            stamp(f"event:{event.rsplit('/', 1)[-1]}:{duration:.3f}")

    jax.monitoring.register_event_duration_secs_listener(ended)


def _out() -> str:
    return os.environ["EJ_OUT"]


def _events() -> list[list[str]]:
    return [e.split(":") for e in os.environ.get("EJ_EVENTS", "").split(",") if e]


def at_step(phase: str, step: int) -> None:
    """The faults due after ``step`` of ``phase`` in this process; prints the progress line on process 0."""
    import jax

    n, rank = jax.process_count(), jax.process_index()
    if rank == 0:
        print(f"PHASE {phase} {step} {n} {time.time():.3f}", flush=True)
    for i, (action, where, at, who, size) in enumerate(_events()):
        if (where, int(at), int(size)) != (phase, step, n):
            continue
        me = who == "all" or who == f"rank{rank}" or who == f"slot{os.environ.get('MIRRORAX_SLOT', rank)}"
        marker = os.path.join(_out(), f"done-{i}-{action}-{where}-{at}")
        if not me or (os.path.exists(marker) and action != "wait"):
            continue
        if action == "wait" and os.path.exists(marker):
            continue
        if action == "kill":
            open(marker, "w").close()
            print(f"KILL {phase} {step} {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hold":
            open(marker, "w").close()
            node = _node()
            held = os.path.join(_out(), f"held-{phase}-{step}-{rank}")
            with open(f"{held}.tmp", "w") as f:
                json.dump({"pid": os.getpid(), "node": node}, f)
            os.replace(f"{held}.tmp", held)
            _forever(f"held at {phase} step {step}")
        if action == "wait":
            time.sleep(0.5)  # every process past the step (its snapshot taken) before the marker
            if rank == 0:
                open(marker, "w").close()
            _forever(f"waiting at {phase} step {step}")


def _forever(what: str) -> None:
    deadline = time.monotonic() + HOLD_LIMIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise SystemExit(f"{what} for {HOLD_LIMIT_S} s: nobody ended the hold")


def _node() -> str:
    if "ray" in sys.modules:
        import ray

        return ray.get_runtime_context().get_node_id()
    return ""


def data():
    """300 digits to train on and the test digits, flat; from ``EJ_DATA`` (an ``.npz`` of them) when set: a Ray
    worker then spends no time importing scikit-learn."""
    import numpy as np

    if os.environ.get("EJ_DATA"):
        with np.load(os.environ["EJ_DATA"]) as d:
            return d["x"], d["y"], d["xt"], d["yt"]
    from mirrorax import zoo

    (x, y), (xt, yt) = zoo.load_digits()
    return x.reshape(len(x), -1)[:ROWS], y[:ROWS], xt.reshape(len(xt), -1), yt


def keras_model():
    """Dense, BatchNormalization, Dropout; every initializer and the dropout seeded (no global seed: a restart
    before the first snapshot builds the same model)."""
    import keras

    init = keras.initializers.GlorotUniform
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="tanh", kernel_initializer=init(seed=1)),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2, seed=2),
        keras.layers.Dense(10, activation="softmax", kernel_initializer=init(seed=3)),
    ])
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def steps_callback(phase: str, per_epoch: int = STEPS_PER_EPOCH):
    """A Keras callback that runs the faults after each step of a fit (its batch within the epoch, counted
    over the fit), and stamps the fit's start and its first step (``EJ_TIMES``)."""
    import keras

    epoch, first = [0], [True]

    def begin(logs=None) -> None:
        stamp("compiled", _compiles[-1] if _compiles else None)
        stamp("train_begin")

    def batch_end(b: int, logs=None) -> None:
        if first[0]:
            first[0] = False
            if os.environ.get("EJ_TIMES") and logs:  # the step done on every process, not only dispatched
                float(next(iter(logs.values())))
            stamp("first_step")
        at_step(phase, epoch[0] * per_epoch + b + 1)

    return keras.callbacks.LambdaCallback(on_train_begin=begin, on_train_batch_end=batch_end,
                                          on_epoch_begin=lambda e, logs=None: epoch.__setitem__(0, e))


def phase_fit(mx) -> dict:
    import numpy as np

    x, y, xt, yt = data()
    strategy = mx.MirroredStrategy()
    np.random.seed(5)  # Keras's shuffle order is drawn from numpy's global generator
    with strategy.scope():
        model = keras_model()
    hist = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
                     callbacks=[steps_callback("fit")])
    evaluated = model.evaluate(xt, yt, batch_size=BATCH, verbose=0, return_dict=True)
    return {"weights": model.get_weights(), "history": hist.history, "epochs": list(hist.epoch),
            "evaluate": evaluated}


def phase_trainer(mx) -> dict:
    x, y, xt, yt = data()
    strategy = mx.MirroredStrategy(shard="all")
    with strategy.scope():
        model = keras_model()
    trainer = mx.Trainer(model, strategy)
    hist = trainer.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, seed=7, verbose=0,
                       callbacks=[steps_callback("trainer")])
    return {"weights": model.get_weights(), "history": hist.history, "epochs": list(hist.epoch),
            "evaluate": trainer.evaluate(xt, yt, batch_size=BATCH)}


def phase_loop(mx) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    x, y, xt, yt = data()
    strategy = mx.MirroredStrategy()
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(0, 0.1, (64, 32)).astype(np.float32), "b1": np.zeros(32, np.float32),
              "w2": rng.normal(0, 0.1, (32, 10)).astype(np.float32), "b2": np.zeros(10, np.float32)}
    optimizer = optax.adam(1e-2)

    def apply(p, xb):
        return jnp.tanh(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss_fn(p, batch):
        xb, yb = batch.data
        losses = optax.softmax_cross_entropy_with_integer_labels(apply(p, xb), yb)
        return mx.compute_average_loss(losses, batch)

    @strategy.jit(donate_argnums=0)
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    state = strategy.replicate({"params": params, "opt": optimizer.init(params)})
    snapshots = mx.Snapshots(name="loop")  # MIRRORAX_SNAPSHOT_DIR: off when unset
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = snapshots.restore_latest(abstract)
    step, history, losses = 0, [], []
    if restored is not None:
        step, state, meta = restored
        history, losses = meta["history"], meta["losses"]
    while step < EPOCHS * STEPS_PER_EPOCH:
        epoch, batch_in_epoch = divmod(step, STEPS_PER_EPOCH)
        order = np.random.default_rng([11, epoch]).permutation(ROWS)[batch_in_epoch * BATCH:]
        for batch in strategy.experimental_distribute_dataset((x[order], y[order]), batch_size=BATCH):
            state, loss = train_step(state, batch)
            step += 1
            losses.append(loss)
            snapshots.reached(step)
            if snapshots.due(step):  # the record of where the loop is: the epoch's losses so far (floats)
                losses = [float(v) for v in losses]
                snapshots.save(step, state, {"history": history, "losses": losses}, window=strategy.in_flight)
            at_step("loop", step)
        history.append(float(np.mean([float(v) for v in losses])))
        losses = []
    snapshots.save(step, state, {"history": history, "losses": []})  # the loop is over: a restart skips it
    snapshots.close()
    host = jax.device_get(state["params"])
    accuracy = float(np.mean(np.argmax(np.asarray(apply(host, xt)), -1) == yt))
    return {"weights": [host[k] for k in sorted(host)], "history": {"loss": history}, "epochs": list(range(EPOCHS)),
            "evaluate": {"accuracy": accuracy}}


def phase_cnn(mx) -> dict:
    import keras
    import numpy as np

    from mirrorax import zoo

    rng = np.random.default_rng(0)
    rows = CNN_BATCH * CNN_STEPS_PER_EPOCH
    x, y = rng.random((rows, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, rows, dtype=np.int32)
    strategy = mx.MirroredStrategy()
    stamp("joined")
    np.random.seed(5)  # Keras's shuffle order (keras.utils.set_random_seed would import TensorFlow where installed)
    with strategy.scope():
        model = zoo.digits_cnn()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    hist = model.fit(x, y, batch_size=CNN_BATCH, epochs=int(os.environ.get("EJ_CNN_EPOCHS", EPOCHS)), shuffle=True,
                     verbose=0, callbacks=[steps_callback("cnn", CNN_STEPS_PER_EPOCH)])
    return {"weights": model.get_weights(), "history": hist.history, "epochs": list(hist.epoch),
            "evaluate": {"accuracy": hist.history["accuracy"][-1]}}


PHASES = {"fit": phase_fit, "trainer": phase_trainer, "loop": phase_loop, "cnn": phase_cnn}


def main() -> None:
    stamp("start", _start_time())
    stamp("script" if not os.environ.get("MIRRORAX_STOOD_BY") else "script(stood-by)")  # (a standby started before)
    import jax
    import keras  # noqa: F401  (every phase uses it: imported here, the milestones tell the imports from the join)
    import numpy as np

    import mirrorax as mx

    stamp("imported")
    if os.environ.get("EJ_TIMES"):
        _count_compiles()

    for name in os.environ.get("EJ_PHASES", "fit,trainer,loop").split(","):
        result = PHASES[name](mx)
        if jax.process_index() == 0:
            arrays = {f"w{i}": w for i, w in enumerate(result["weights"])}
            arrays.update({f"history/{k}": np.asarray(v) for k, v in result["history"].items()})
            arrays.update({f"evaluate/{k}": np.asarray(v) for k, v in result["evaluate"].items()})
            arrays["epochs"] = np.asarray(result["epochs"])
            tmp = os.path.join(_out(), f"{name}.tmp.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, os.path.join(_out(), f"{name}.npz"))
            print(f"DONE {name} on {jax.process_count()} processes", flush=True)


def ray_main(config: dict | None = None) -> None:
    """Ray Train's training function: the environment the test gives, then :func:`main`."""
    os.environ.update((config or {}).get("env", {}))
    if os.environ.get("EJ_TIMES"):
        import ray.train

        os.environ["EJ_RANK"] = str(ray.train.get_context().get_world_rank())
    stamp("function")  # (a Ray worker's process may have started before: its start is when Ray started it)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    main()


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if "--devices" in sys.argv:
        import jax

        jax.config.update("jax_num_cpu_devices", int(sys.argv[sys.argv.index("--devices") + 1]))
    main()
