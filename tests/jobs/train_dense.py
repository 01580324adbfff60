"""The multi-process equivalence job: a small Dense model trained deterministically.

``train(strategy)`` is imported by the tests for the 1-process runs; run as a script (under
``mirrorax launch``) it trains on every device of the job and writes what this process got to
``$MP_OUT/rank<R>.npz`` (weights, history, evaluate, predict), so that the test can compare processes.
``MP_DIE=kill:R:E`` / ``MP_DIE=raise:R:E`` make process R die at the end of epoch E (for failure tests).
``MP_CASES=mlp_hsdp,mlp_layout_map,gemma_layout_map`` then runs issue 21's 2-D mesh cases in the same
processes, one after another (``model.fit`` under the scope; ``fit_case``), each written to
``$MP_OUT/<case><R>.npz``: one process pair for all of them, as each process start costs ~9 s of imports.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

ROWS, FEATURES, CLASSES, BATCH, EPOCHS = 200, 12, 3, 32, 3  # 200 = 6 full batches + 8 padded rows


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES].argmax(axis=1)).astype(np.int32)
    return x, y


class _Die:
    """A Keras-style callback that makes one process die mid-training."""

    def __init__(self, spec: str, process: int) -> None:
        self.mode, rank, epoch = spec.split(":")
        self.rank, self.epoch, self.process = int(rank), int(epoch), process

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.epoch and self.process == self.rank:
            print(f"process {self.process} dies now ({self.mode}) at {time.time():.3f}", flush=True)
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure in process {self.process}")


def train(strategy, *, epochs: int = EPOCHS, verbose: int | str = 0, callbacks=(), width: int = 16
          ) -> dict[str, np.ndarray]:
    """Array inputs (the engine slices each process's rows), shuffled, with validation."""
    import mirrorax as mx

    x, y = data()
    model = _model(strategy, width)
    trainer = mx.Trainer(model, strategy=strategy)
    history = trainer.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=True, seed=3, verbose=verbose,
                          validation_data=(x[:50], y[:50]), callbacks=list(callbacks))
    result = trainer.evaluate(x, y, batch_size=BATCH)
    predictions = trainer.predict(x, batch_size=BATCH)
    return _results(model, history, result, predictions)


def train_unshuffled(strategy, *, pipeline: bool) -> dict[str, np.ndarray]:
    """Unshuffled; with ``pipeline`` each process feeds only its own rows of every global batch through
    ``strategy.distribute_datasets_from_function`` (the last global batch is short: 8 rows)."""
    import mirrorax as mx

    x, y = data()
    model = _model(strategy)
    trainer = mx.Trainer(model, strategy=strategy)
    if pipeline:
        def dataset_fn(ctx):
            rows = ctx.get_per_pipeline_batch_size(BATCH)
            batches = []
            for start in range(0, ROWS, BATCH):
                xb, yb = x[start:start + BATCH], y[start:start + BATCH]
                share = -(-len(xb) // ctx.num_input_pipelines)
                lo = ctx.input_pipeline_id * share
                assert share <= rows
                batches.append((xb[lo:lo + share], yb[lo:lo + share]))
            return batches

        source = strategy.distribute_datasets_from_function(dataset_fn)
        history = trainer.fit(source, batch_size=BATCH, epochs=2, verbose=0)
    else:
        history = trainer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    result = trainer.evaluate(x, y, batch_size=BATCH)
    return _results(model, history, result, trainer.predict(x, batch_size=BATCH))


def _model(strategy, width: int = 16):
    import keras

    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return model


def _results(model, history, result, predictions) -> dict[str, np.ndarray]:
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    out.update({f"h_{k}": np.asarray(v, np.float64) for k, v in history.history.items()})
    out.update({f"e_{k}": np.asarray(v, np.float64) for k, v in result.items()})
    out["predict"] = np.asarray(predictions)
    return out


# -- issue 21: the 2-D mesh cases (tests/test_mesh2d.py builds the same models for its 1-device results) -----

MESH_CASES = ("mlp_hsdp", "mlp_layout_map", "cnn_hsdp", "cnn_layout_map", "gemma_hsdp", "gemma_layout_map",
              "deep_optimizer")


def tanh_mlp(seed: int = 3, hidden: int = 256):
    """A tanh MLP whose hidden kernel (64 x 256 = 16384 elements) is large enough to split."""
    import keras

    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="tanh", name="hidden"),
                          keras.layers.Dense(10, activation="softmax", name="out")])
    m.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def deep_mlp(seed: int = 4, depth: int = 24, width: int = 128):
    """A tanh MLP of ``depth`` hidden 128 x 128 kernels (16384 elements each: split by ``shard=``), many small
    split leaves like a transformer's: at a fit's end on 2 processes each was gathered by a program of its
    own, and the queue of them deadlocked XLA:CPU (``keras.adapter._local_replicas``)."""
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,)), keras.layers.Dense(width, activation="tanh", name="in")]
    layers += [keras.layers.Dense(width, activation="tanh", name=f"deep{i}") for i in range(depth)]
    m = keras.Sequential(layers + [keras.layers.Dense(10, activation="softmax", name="out")])
    m.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def mesh_layout_map(shape: tuple[int, int] = (2, 4)):
    """A ``keras.distribution.LayoutMap`` over a ``batch`` x ``model`` mesh of every device (of the job)."""
    import keras

    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices=keras.distribution.list_devices())
    lm = keras.distribution.LayoutMap(mesh)
    lm[".*hidden/kernel"] = (None, "model")
    lm[".*hidden/bias"] = ("model",)
    lm[".*out/kernel"] = ("model", None)
    lm[".*conv2d.*/kernel"] = (None, None, None, "model")
    return lm


def _helpers():
    """tests/helpers.py (the tests' own models and data), from a job run as a script too."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import helpers

    return helpers


def batchnorm_cnn():
    """The main job's CNN (Conv2D, BatchNorm), 8 wide, seed 1: tests/helpers.py's ``cnn(dropout=0.0)``."""
    return _helpers().cnn(dropout=0.0)


def cnn_data() -> tuple[np.ndarray, np.ndarray]:
    """64 digits as images (tests/helpers.py's ``digits(64)``)."""
    return _helpers().digits(64)[:2]


def mlp_data() -> tuple[np.ndarray, np.ndarray]:
    """96 digits, flattened (tests/helpers.py's ``flat_digits(96)``)."""
    return _helpers().flat_digits(96)[:2]


def gemma_lm(keras_hub):
    """keras_hub's ``GemmaCausalLM`` on a Gemma backbone (2 layers of width 32, random weights; a vocabulary
    of 512, so that its embeddings, 16384 elements, are large enough for ``shard=`` to split), no
    preprocessor. Its ``fit`` is keras_hub's ``PipelineModel.fit``, a method its class overrides, whose
    ``super().fit`` must land in mirrorax's (``mirrorax.keras.fit``), or each process would train alone."""
    import keras

    keras.utils.set_random_seed(5)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=512, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=4, hidden_dim=32, intermediate_dim=64, head_dim=8,
                                              dropout=0.0)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=[])
    return model


def lm_data() -> tuple[dict[str, np.ndarray], np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, 64, size=(16, 9)).astype("int32")
    return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), "int32")}, tokens[:, 1:]


def import_keras_hub():
    """keras_hub without TensorFlow: its tokenizers and preprocessors need TF (tensorflow-text), these
    models do not, and TF's import costs ~5 s of CPU per process. ``None`` in ``sys.modules`` makes
    ``import tensorflow`` raise ImportError, which keras_hub and Keras take as "not installed"."""
    for name in ("tensorflow", "tensorflow_text"):
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    import keras_hub

    return keras_hub


def case_strategy(case: str):
    """The 2-D strategy of ``case`` on every device of the job (one row of the mesh per process)."""
    import mirrorax as mx

    if case in ("mlp_hsdp", "gemma_hsdp"):
        return mx.MultiWorkerMirroredStrategy(mesh=mx.hybrid_mesh(), shard="all")
    if case == "cnn_hsdp":
        return mx.MultiWorkerMirroredStrategy(mesh=mx.hybrid_mesh(), shard="optimizer")
    if case == "mlp_layout_map":
        return mx.MultiWorkerMirroredStrategy(layout_map=mesh_layout_map(), shard="optimizer")
    if case == "cnn_layout_map":
        return mx.MultiWorkerMirroredStrategy(layout_map=mesh_layout_map())
    if case == "deep_optimizer":
        return mx.MultiWorkerMirroredStrategy(shard="optimizer")  # the Adam slots split over all 8 devices
    if case == "gemma_layout_map":
        import keras

        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=keras.distribution.list_devices())
        return mx.MultiWorkerMirroredStrategy(layout_map=import_keras_hub().models.GemmaBackbone.get_layout_map(mesh))
    raise ValueError(f"case must be one of {MESH_CASES}; received {case!r}")


def fit_case(case: str, strategy, keras_hub=None) -> dict[str, np.ndarray]:
    """``model.fit`` of ``case``'s model under ``strategy``'s scope, unshuffled: the weights (``w<i>``), the
    history (``h_<name>``) and each trainable variable's layout in the
    fit's state (``specs``: path -> its PartitionSpec as a list with an entry per dimension, JSON)."""
    import mirrorax as mx

    if case.startswith("gemma"):
        with strategy.scope():
            model = gemma_lm(keras_hub or import_keras_hub())
        x, y = lm_data()
        history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    elif case.startswith("cnn"):
        with strategy.scope():
            model = batchnorm_cnn()
        x, y = cnn_data()
        history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    elif case == "deep_optimizer":  # two fits, as a warm-up and a timed one: the first one's end hung
        with strategy.scope():
            model = deep_mlp()
        x, y = mlp_data()
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=1, shuffle=False, verbose=0)
        history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    else:
        with strategy.scope():
            model = tanh_mlp()
        x, y = mlp_data()
        history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    specs = {}  # as the fit's state has them (read first: reading the model's weights hands the state over)
    for path, value in mx.keras.fit.trainer_of(model).device_state.live.params.items():
        spec = tuple(getattr(value.sharding, "spec", ()))  # one device: a SingleDeviceSharding
        specs[path] = [list(s) if isinstance(s, tuple) else s for s in spec + (None,) * (value.ndim - len(spec))]
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    out.update({f"h_{k}": np.asarray(v, np.float64) for k, v in history.history.items()})
    out["specs"] = np.asarray(json.dumps(specs))
    return out


if __name__ == "__main__":
    import mirrorax as mx

    shard = os.environ.get("MP_SHARD") or None  # "optimizer" / "all": the state split over the 4 devices
    if os.environ.get("MP_MESH") == "hybrid":  # one row per process: shard= within it (HSDP)
        strategy = mx.MultiWorkerMirroredStrategy(mesh=mx.hybrid_mesh(), shard=shard)
    else:
        strategy = mx.MultiWorkerMirroredStrategy(shard=shard)
    print(f"process {strategy.process_index} of {strategy.process_count}: "
          f"{strategy.num_replicas_in_sync} replicas in sync", flush=True)
    if os.environ.get("MP_MESH"):
        kernel = strategy.state_sharding((FEATURES, int(os.environ.get("MP_WIDTH", "16"))), "params")
        print(f"process {strategy.process_index}: mesh {dict(strategy.mesh.shape)}, process axes "
              f"{strategy.process_axes}, batch axes {strategy.batch_axes}, kernel {tuple(kernel.spec)}", flush=True)
    die = [_Die(os.environ["MP_DIE"], strategy.process_index)] if os.environ.get("MP_DIE") else []
    epochs = int(os.environ.get("MP_EPOCHS", EPOCHS))
    result = train(strategy, epochs=epochs, verbose=2, callbacks=die, width=int(os.environ.get("MP_WIDTH", "16")))
    np.savez(os.path.join(os.environ["MP_OUT"], f"rank{strategy.process_index}.npz"), **result)
    if os.environ.get("MP_PIPELINE"):
        result = train_unshuffled(strategy, pipeline=True)
        np.savez(os.path.join(os.environ["MP_OUT"], f"pipeline{strategy.process_index}.npz"), **result)
    for case in filter(None, os.environ.get("MP_CASES", "").split(",")):
        start = time.process_time()
        result = fit_case(case, case_strategy(case))
        np.savez(os.path.join(os.environ["MP_OUT"], f"{case}{strategy.process_index}.npz"), **result)
        print(f"process {strategy.process_index}: {case} done, {time.process_time() - start:.1f} s CPU", flush=True)
    print(f"process {strategy.process_index} done", flush=True)
    sys.exit(0)
