"""Issue 21: a strategy over a 2-D mesh. Hybrid sharding (HSDP: ``shard=`` over the inner axis, replicated
over the outer) and Keras layout maps, through ``model.fit``, ``mx.Trainer`` and ``strategy.jit`` / ``run``,
give the 1-device result; the state is laid out as the mode or the map says; checkpoints move between
mesh shapes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import assert_weights_close, cnn, digits, flat_digits
from jax.sharding import PartitionSpec as P
from jobs import train_dense

import mirrorax as mx

pytestmark = pytest.mark.multi_device


mlp = train_dense.tanh_mlp  # a tanh MLP whose hidden kernel (64 x 256 = 16384 elements) is large enough to split
layout_map = train_dense.mesh_layout_map  # the MLP's and the CNN's layers over a ("batch", "model") mesh


def fit_under(strategy, make, x, y, **kw):
    with strategy.scope():
        model = make()
    hist = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, **kw)
    return model, hist.history


def spec_of(a) -> tuple:
    """``a``'s PartitionSpec as a tuple with an entry per dimension (JAX may drop trailing ``None`` s)."""
    spec = tuple(a.sharding.spec)
    return spec + (None,) * (a.ndim - len(spec))


def one_device():
    return mx.MirroredStrategy(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def mlp_data():
    x, y, _, _ = flat_digits(96)
    return x, y


@pytest.fixture(scope="module")
def mlp_one_device(mlp_data):
    model, hist = fit_under(one_device(), mlp, *mlp_data)
    return model, hist


# -- the mesh ------------------------------------------------------------------------------------

def test_hybrid_mesh_is_one_row_per_process_and_splits_the_batch_over_both_axes():
    mesh = mx.hybrid_mesh(4)
    assert dict(mesh.shape) == {"replica": 2, "shard": 4}
    assert list(mesh.devices.flat) == jax.devices()
    assert dict(mx.hybrid_mesh().shape) == {"replica": 1, "shard": 8}  # one process: one row
    s = mx.MirroredStrategy(mesh=mesh, shard="all")
    assert s.batch_axis == ("replica", "shard") and s.batch_axes == ("replica", "shard")
    assert s.shard_axis == "shard" and s.process_axes == ()
    assert s.num_replicas_in_sync == 8
    assert s.batch_sharding.spec == P(("replica", "shard"))
    # HSDP: split within a row (the inner axis), replicated over the rows
    assert s.state_sharding((1024, 512), "params").spec == P("shard", None)
    assert s.state_sharding((1024, 512), "params").shard_shape((1024, 512)) == (256, 512)
    assert s.state_sharding((8,), "params") == s.replicated  # small: replicated
    # one axis stays as it was
    s1 = mx.MirroredStrategy(shard="all")
    assert s1.batch_axis == "batch" and s1.batch_axes == ("batch",) and s1.shard_axis == "batch"
    assert s1.state_sharding((1024, 512), "params").spec == P("batch", None)


def test_a_bad_mesh_setting_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"batch_axes must name distinct axes of the mesh \('replica', 'shard'\); "
                                         r"received 'model'"):
        mx.MirroredStrategy(mesh=mx.hybrid_mesh(4), batch_axes="model")
    with pytest.raises(ValueError, match=r"Pass one of devices, mesh and layout_map; received devices and mesh"):
        mx.MirroredStrategy(devices=jax.devices()[:2], mesh=mx.hybrid_mesh(4))
    with pytest.raises(ValueError, match=r"inner must be a positive int that divides the 8 devices; received 3"):
        mx.hybrid_mesh(3)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh or a keras.distribution.DeviceMesh"):
        mx.MirroredStrategy(mesh=[0, 1])
    s = mx.MirroredStrategy(layout_map=layout_map())
    with pytest.raises(ValueError, match=r"splits the variable 'm/hidden/kernel' of shape \(64, 6\) as "
                                         r"\(None, 'model'\): a dimension of 6 over 4 devices"):
        s.state_sharding((64, 6), "params", "m/hidden/kernel")


# -- HSDP ----------------------------------------------------------------------------------------

def test_hsdp_fit_on_2x4_gives_the_one_device_result(mlp_data, mlp_one_device):
    want, want_hist = mlp_one_device
    s = mx.MirroredStrategy(mesh=mx.hybrid_mesh(4), shard="all")
    model, hist = fit_under(s, mlp, *mlp_data)
    assert_weights_close(model, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hist["loss"], want_hist["loss"], rtol=1e-5)
    kernel = model.get_layer("hidden").kernel
    assert kernel.value.sharding.spec == P(None, "shard")  # split within a row only


@pytest.mark.slow  # the CNN compiles slowly on 8 CPU devices
def test_hsdp_cnn_with_batchnorm_on_2x4_gives_the_one_device_result():
    x, y, _, _ = digits(64)
    want, _ = fit_under(one_device(), lambda: cnn(dropout=0.0), x, y)
    model, _ = fit_under(mx.MirroredStrategy(mesh=mx.hybrid_mesh(4), shard="optimizer"), lambda: cnn(dropout=0.0),
                         x, y)
    assert_weights_close(model, want, rtol=1e-5, atol=1e-5)


def wide_mlp() -> keras.Model:
    """Two 32768-element kernels hold 98% of the state: what HSDP splits."""
    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="tanh"),
                          keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(10)])
    m.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def test_hsdp_state_per_device_is_the_replicated_state_over_the_inner_axis(mlp_data):
    x, y = mlp_data
    replicated = mx.plan(wide_mlp(), x[:1], y[:1], batch_size=32, strategy=one_device())  # the whole state
    hsdp = mx.plan(wide_mlp(), x[:1], y[:1], batch_size=32,
                   strategy=mx.MirroredStrategy(mesh=mx.hybrid_mesh(4), shard="all"))
    # parameters and Adam's slots of the large kernels split 4 ways (within a row), the small ones whole
    assert hsdp.state_bytes == pytest.approx(replicated.state_bytes / 4, rel=0.1)
    # the compiled program's arguments on one device: the state's slice (plus the batch's rows)
    assert hsdp.argument_bytes == pytest.approx(replicated.argument_bytes / 4, rel=0.1)


# -- Keras layout maps ---------------------------------------------------------------------------

def test_a_layout_map_fit_on_2x4_gives_the_one_device_result_laid_out_as_the_map_says(mlp_data, mlp_one_device):
    want, want_hist = mlp_one_device
    s = mx.MirroredStrategy(layout_map=layout_map(), shard="optimizer")
    assert s.batch_axis == "batch" and s.num_replicas_in_sync == 2 and s.shard_axis == "batch"
    model, hist = fit_under(s, mlp, *mlp_data)
    assert_weights_close(model, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hist["loss"], want_hist["loss"], rtol=1e-5)
    hidden, out = model.get_layer("hidden"), model.get_layer("out")
    assert hidden.kernel.value.sharding.spec == P(None, "model")
    assert hidden.bias.value.sharding.spec == P("model")
    assert out.kernel.value.sharding.spec == P("model", None)
    assert out.bias.value.sharding.spec == P()  # unmatched: replicated
    slots = {v.path: v.value.sharding.spec for v in model.optimizer.variables}
    # Adam's slots of the hidden kernel: the map's layout, and shard="optimizer" over the batch axis
    assert [spec for path, spec in slots.items() if "hidden_kernel" in path] == [P("batch", "model")] * 2
    # the out kernel's slots are small (2560 elements): the map's layout alone
    assert [spec for path, spec in slots.items() if "out_kernel" in path] == [P("model", None)] * 2


@pytest.mark.slow  # the CNN compiles slowly on 8 CPU devices
def test_a_layout_map_cnn_with_batchnorm_on_2x4_gives_the_one_device_result():
    x, y, _, _ = digits(64)
    want, _ = fit_under(one_device(), lambda: cnn(dropout=0.0), x, y)
    model, _ = fit_under(mx.MirroredStrategy(layout_map=layout_map()), lambda: cnn(dropout=0.0), x, y)
    assert_weights_close(model, want, rtol=1e-5, atol=1e-5)
    kernels = [v for v in model.trainable_variables if "conv2d" in v.path and v.path.endswith("kernel")]
    assert kernels and all(v.value.sharding.spec == P(None, None, None, "model") for v in kernels)


def test_a_model_parallel_distribution_under_the_scope_names_layout_map():
    lm = layout_map()
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=lm, batch_dim_name="batch"))
    try:
        with pytest.raises(ValueError, match=r"MirroredStrategy\(layout_map=...\)"):
            with mx.MirroredStrategy().scope():
                pass
    finally:
        keras.distribution.set_distribution(None)


# -- a keras_hub causal LM with its own layout map ----------------------------------------------

@pytest.fixture(scope="module")
def gemma_one_device():
    """The causal LM's 1-device ``model.fit`` (``train_dense.fit_case``: weights, history, layouts)."""
    keras_hub = pytest.importorskip("keras_hub")
    return train_dense.fit_case("gemma_layout_map", one_device(), keras_hub)


@pytest.fixture(scope="module")
def cnn_one_device():
    """The BatchNorm CNN's 1-device ``model.fit`` (``train_dense.fit_case``), for the 2-process job's cases."""
    return train_dense.fit_case("cnn_hsdp", one_device())


@pytest.mark.slow  # keras_hub's import and a transformer's compile on 8 CPU devices
def test_a_keras_hub_causal_lm_under_hsdp_on_2x4_gives_the_one_device_result(gemma_one_device):
    """GemmaCausalLM's own fit (keras_hub's PipelineModel.fit, which calls super().fit) under HSDP: its
    embeddings split within each row of the mesh, the 1-device numbers."""
    got = train_dense.fit_case("gemma_hsdp", mx.MirroredStrategy(mesh=mx.hybrid_mesh(4), shard="all"),
                               pytest.importorskip("keras_hub"))
    assert_results_close(got, gemma_one_device)
    assert_laid_out(json.loads(str(got["specs"])), {"token_embedding/embeddings": ["shard", None]},
                    others_replicated=True)


@pytest.mark.slow  # keras_hub's import and a transformer's compile on 8 CPU devices
def test_a_keras_hub_backbone_with_its_own_layout_map_on_2x4_gives_the_one_device_result(gemma_one_device):
    keras_hub = pytest.importorskip("keras_hub")
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices=keras.distribution.list_devices())
    strategy = mx.MirroredStrategy(layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh))
    got = train_dense.fit_case("gemma_layout_map", strategy, keras_hub)
    assert_results_close(got, gemma_one_device)
    assert_laid_out(json.loads(str(got["specs"])), {"token_embedding/embeddings": ["model", "batch"],
                                                    "decoder_block/ffw_gating/kernel": ["batch", "model"]})


def assert_laid_out(specs: dict, want: dict, others_replicated: bool = False) -> None:
    """``specs`` (``fit_case``'s: state path -> layout) has ``want``'s layouts (by path suffix, e.g.
    ``hidden/kernel``); with ``others_replicated``, every other variable is replicated."""
    found = set()
    for path, spec in specs.items():
        key = next((k for k in want if path == k or path.endswith("/" + k)), None)
        found.add(key)
        if key is not None or others_replicated:
            assert spec == want.get(key, [None] * len(spec)), path
    assert want.keys() <= found, (sorted(want), sorted(specs))


def assert_results_close(got: dict, want: dict) -> None:
    """``fit_case``'s weights and loss history, against the 1-device run's, within 1e-5."""
    weights = sorted(k for k in want if k.startswith("w"))
    assert sorted(k for k in got if k.startswith("w")) == weights
    for key in weights:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)
    np.testing.assert_allclose(got["h_loss"], want["h_loss"], rtol=1e-5)


# -- custom loops: strategy.jit and strategy.run -------------------------------------------------

def _init(seed=3):
    rng = np.random.default_rng(seed)
    return {"hidden/kernel": rng.normal(0, 0.1, (64, 256)).astype("float32"), "hidden/bias": np.zeros(256, "float32"),
            "out/kernel": rng.normal(0, 0.1, (256, 10)).astype("float32"), "out/bias": np.zeros(10, "float32")}


def _loss(params, batch):
    x, y = batch.data
    h = jnp.tanh(x @ params["hidden/kernel"] + params["hidden/bias"])
    logits = h @ params["out/kernel"] + params["out/bias"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None].astype("int32"), axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / batch.num_real


def jit_loop(strategy, x, y, shard_params=True):
    params = _init()
    paths = {k: k for k in params}
    params = strategy.place(params, strategy.state_layout(params, "params", paths))

    @strategy.jit(donate_argnums=0)
    def step(params, batch):
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    losses = []
    for batch in strategy.experimental_distribute_dataset((x, y), batch_size=32):
        params, loss = step(params, batch)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("make", [lambda: mx.MirroredStrategy(mesh=mx.hybrid_mesh(4), shard="all"),
                                  lambda: mx.MirroredStrategy(layout_map=layout_map())], ids=["hsdp", "layout_map"])
def test_a_strategy_jit_loop_keeps_the_layout_and_gives_the_one_device_result(mlp_data, make):
    x, y = mlp_data
    want, want_losses = jit_loop(one_device(), x, y)
    s = make()
    got, losses = jit_loop(s, x, y)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-5, err_msg=k)
        assert got[k].sharding == s.state_sharding(got[k].shape, "params", k)  # the layout it came in with
    assert got["hidden/kernel"].sharding.spec == (P(None, "shard") if s.shard else P(None, "model"))


def test_strategy_run_on_a_2d_mesh_runs_once_per_batch_slice():
    s = mx.MirroredStrategy(mesh=mx.hybrid_mesh(4))
    batch = next(iter(s.experimental_distribute_dataset(np.arange(16, dtype="float32"), batch_size=16)))

    def replica(b):
        ctx = mx.get_replica_context()
        return ctx.replica_id_in_sync_group, ctx.all_reduce("sum", jnp.sum(b))  # (a dataset of one array: an array)

    ids, total = s.run(replica, args=(batch,))
    assert s.gather(ids).tolist() == list(range(8))
    assert float(total) == float(np.arange(16).sum())
    lm = mx.MirroredStrategy(layout_map=layout_map())  # two replicas: the batch axis
    batch = next(iter(lm.experimental_distribute_dataset(np.arange(16, dtype="float32"), batch_size=16)))
    ids, total = lm.run(replica, args=(batch,))
    assert lm.gather(ids).tolist() == [0, 1] and float(total) == float(np.arange(16).sum())


# -- checkpoints between mesh shapes -------------------------------------------------------------

@pytest.mark.parametrize("written, read", [
    pytest.param("hsdp", "fsdp_1x8", marks=pytest.mark.slow), ("hsdp", "one_device"),
    pytest.param("layout_map", "replicated", marks=pytest.mark.slow)])
def test_a_checkpoint_written_sharded_resumes_on_another_mesh_shape(tmp_path, mlp_data, mlp_one_device, written,
                                                                    read):
    strategies = {"hsdp": lambda: mx.MirroredStrategy(mesh=mx.hybrid_mesh(4), shard="all"),
                  "layout_map": lambda: mx.MirroredStrategy(layout_map=layout_map(), shard="optimizer"),
                  "fsdp_1x8": lambda: mx.MirroredStrategy(shard="all"), "one_device": one_device,
                  "replicated": mx.MirroredStrategy}
    x, y = mlp_data
    model = mlp()
    trainer = mx.Trainer(model, strategies[written]())
    trainer.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, checkpoint_dir=tmp_path)
    saved = trainer.host_state()
    if written == "hsdp":  # mx.Trainer, as model.fit: the 1-device result
        assert_weights_close(model, mlp_one_device[0], rtol=1e-5, atol=1e-5)
    assert not trainer.device_state.live.params["000/sequential/hidden/kernel"].sharding.is_fully_replicated
    target = strategies[read]()
    loaded = mx.Trainer.load(tmp_path, mlp(seed=9), target)
    state = loaded.device_state.live
    for k, v in saved.params.items():
        np.testing.assert_array_equal(np.asarray(state.params[k]), v, err_msg=k)
        assert state.params[k].sharding == target.state_sharding(v.shape, "params")  # the new mesh's layout
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.optimizer), saved.optimizer)
    loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)  # and trains on


# -- two processes ---------------------------------------------------------------------------------

def _has_keras_hub() -> bool:
    import importlib.util

    return importlib.util.find_spec("keras_hub") is not None


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory):
    """One job of 2 processes x 4 devices (``hybrid_mesh()``: one row per process) for every case below,
    one after another in the same processes: HSDP through ``mx.Trainer`` (train_dense's model, a
    2048-wide kernel and its Adam slots split within each process, replicated across), then
    ``train_dense.MESH_CASES`` through ``model.fit`` under the scope (each process start costs ~9 s of
    imports). Returns the output directory and the job's output."""
    from jobs.procs import clean_env, launcher, python, run_all

    out_dir = tmp_path_factory.mktemp("two_processes")
    cases = [c for c in train_dense.MESH_CASES if not c.startswith("gemma") or _has_keras_hub()]
    cmd = launcher("--nprocs", "2", "--cpu-devices-per-proc", "4", "--failure-timeout", "20", "--",
                   *python("tests/jobs/train_dense.py"))
    env = clean_env(MP_OUT=str(out_dir), MP_MESH="hybrid", MP_SHARD="all", MP_WIDTH="2048", MP_EPOCHS="2",
                    MP_CASES=",".join(cases))
    codes, outs, _ = run_all([cmd], [env], timeout=480)
    assert codes[0] == 0, outs[0]
    return out_dir, outs[0]


def _ranks(out_dir, name: str) -> dict:
    """What process 0 wrote for ``name``, after checking that process 1 wrote the same."""
    ranks = [dict(np.load(out_dir / f"{name}{r}.npz")) for r in range(2)]
    assert sorted(ranks[0]) == sorted(ranks[1])
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    return ranks[0]


@pytest.mark.multi_process
@pytest.mark.slow  # starts 2 processes
@pytest.mark.timeout(600)
def test_hsdp_on_two_processes_of_four_devices_gives_the_one_device_result(two_process_job):
    """hybrid_mesh() on 2 processes x 4 devices through mx.Trainer: the outer axis follows the processes."""
    out_dir, out = two_process_job
    assert ("process 1: mesh {'replica': 2, 'shard': 4}, process axes ('replica',), batch axes ('replica', "
            "'shard'), kernel (None, 'shard')") in out, out
    got = _ranks(out_dir, "rank")
    want = train_dense.train(one_device(), epochs=2, width=2048)
    assert sorted(got) == sorted(want)
    for key in want:  # (8 slices summed against 1: measured differences up to 1.7e-6 after 14 Adam steps)
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)


# the layouts of each case's variables on 2 processes (the MLP's others: replicated)
TWO_PROCESS_LAYOUTS = {  # (GemmaBackbone.get_layout_map's, for two of its variables)
    "mlp_hsdp": {"hidden/kernel": [None, "shard"]},  # split within a process, replicated across
    "mlp_layout_map": {"hidden/kernel": [None, "model"], "hidden/bias": ["model"], "out/kernel": ["model", None]},
    "gemma_layout_map": {"token_embedding/embeddings": ["model", "batch"],
                         "decoder_block/ffw_gating/kernel": ["batch", "model"]},
    "cnn_hsdp": {},  # shard="optimizer": the parameters replicated (the slots of the large ones split)
    "cnn_layout_map": {"conv2d/kernel": [None, None, None, "model"]},  # both convolutions' kernels
    "gemma_hsdp": {"token_embedding/embeddings": ["shard", None]},  # the one variable of >= 16384 elements
    "deep_optimizer": {}}  # the parameters replicated (their Adam slots split)


@pytest.mark.multi_process
@pytest.mark.slow  # starts 2 processes (the job of the test above)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", train_dense.MESH_CASES)
def test_a_2d_mesh_fit_on_two_processes_of_four_devices_gives_the_one_device_result(two_process_job, case,
                                                                                   request):
    """HSDP and a layout map through model.fit under the scope, for the tanh MLP, the BatchNorm CNN and
    keras_hub's GemmaCausalLM (its own fit, which calls super().fit; its own layout map), and two fits of a
    deep MLP whose many Adam slots are split over both processes (the first fit's end hung before their
    gathers ran as one program): the 1-device result (computed here, on one of this process's devices, as
    the 1-process tests of this module do), laid out as the strategy says."""
    if case.startswith("gemma") and not _has_keras_hub():
        pytest.skip("keras_hub is not installed")
    out_dir, _ = two_process_job
    got = _ranks(out_dir, case)
    if case.startswith("gemma"):
        want = request.getfixturevalue("gemma_one_device")
    elif case.startswith("cnn"):
        want = request.getfixturevalue("cnn_one_device")
    elif case == "deep_optimizer":  # hung at the first fit's end: one gather program per split leaf
        want = train_dense.fit_case(case, one_device())
    else:
        model, history = request.getfixturevalue("mlp_one_device")
        want = {f"w{i}": w for i, w in enumerate(model.get_weights())} | {"h_loss": np.asarray(history["loss"])}
    assert_results_close(got, want)
    assert_laid_out(json.loads(str(got["specs"])), TWO_PROCESS_LAYOUTS[case],
                    others_replicated=not case.startswith("gemma"))


def test_a_keras_object_step_under_strategy_jit_keeps_the_layout_map(mlp_data):
    x, y = mlp_data

    def train(strategy):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
                                  keras.layers.Dense(10, name="out")])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        @strategy.jit
        def step(inputs):
            images, labels = inputs

            def loss_fn():
                return mx.compute_average_loss(loss_object(labels, model(images, training=True)), inputs)

            loss, grads = mx.value_and_grad(loss_fn, model.trainable_variables)()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = [float(step(b)) for b in strategy.experimental_distribute_dataset((x[:64], y[:64]), batch_size=32)]
        return model, losses

    want, want_losses = train(one_device())
    got, losses = train(mx.MirroredStrategy(layout_map=layout_map()))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_weights_close(got, want, rtol=1e-5, atol=1e-5)
    assert spec_of(got.get_layer("hidden").kernel.value) == (None, "model")
    assert spec_of(got.get_layer("out").kernel.value) == ("model", None)
