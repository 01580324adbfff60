"""The benchmark workloads, shared by every system: model, data, loss, optimizer and sizes.

Every system trains the same thing on the same seeded data with the same global batch and step count:

* ``mlp``         (a) ``mirrorax.zoo.mlp()`` 784-512-10 on MNIST-shaped data (28x28 flattened), batch 256.
* ``mlp32``       the same MLP at batch 32 (a step of even less device work: all host).
* ``cnn``         (b) ``mirrorax.zoo.digits_cnn()``, the ``mirrorax train`` CNN, on 8x8x1 digits-shaped data.
* ``transformer`` (c) a decoder-only language model: 4 pre-LayerNorm blocks, width 256, 4 heads, feed-forward
  1024, sequence 128, vocabulary 1024, next-token cross-entropy; ``bf16`` uses Keras' ``mixed_bfloat16``.
* ``lm``          (d) the same model at an accelerator's size: 12 blocks, width 1024, 8 heads, feed-forward
  4096, sequence 1024, vocabulary 32768 (219M parameters), global batch 8; meant for one accelerator in
  ``mixed_bfloat16`` (``benchmarks/accelerator.py``), far too slow for a CPU.

Keras systems (mirrorax, the hand-written JAX loop, ``model.fit``, tf.distribute) build the model with
:func:`build_keras_model`; the PyTorch peer builds the equivalent ``nn.Module`` in ``peers/torch_ddp.py``.
This module imports neither Keras nor a backend at import time, so a peer can set ``KERAS_BACKEND`` and
the device count first.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

__all__ = ["Workload", "WORKLOADS", "ALIASES", "get", "make_data", "build_keras_model", "compile_args",
           "flops_per_sample"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark workload: what is trained and the sizes a full run uses.

    Attributes:
      name: short name (``mlp``, ``cnn``, ``transformer``).
      title: one line for tables and plots.
      batch: global batch (samples per step, summed over all devices).
      steps: timed steps per timed run in a full run.
      warmup: warm-up steps (compilation plus a few steps) before timing.
      quick_steps: timed steps per timed run with ``--quick``.
      accel_steps: timed steps per timed run on an accelerator, unless ``--steps`` says otherwise: a run of the
        CPU's few steps lasts milliseconds there, and times a ``fit`` call's set-up more than its steps.
      timeout_s: a run (one subprocess) that takes longer is killed and recorded as a timeout.
      rounds: processes per (devices, system) in a full run (each does a warm-up and timed runs).
      seq_len: sequence length (language models only).
      vocab: vocabulary size (language models only).
      layers, width, heads, ffn: the blocks, the model width, the attention heads and the feed-forward
        width (language models only).
    """

    name: str
    title: str
    batch: int
    steps: int
    warmup: int
    quick_steps: int
    timeout_s: float
    rounds: int = 2
    accel_steps: int = 0
    seq_len: int = 0
    vocab: int = 0
    layers: int = 0
    width: int = 0
    heads: int = 0
    ffn: int = 0
    model: str = ""

    @property
    def kind(self) -> str:
        """The model trained: ``mlp``, ``cnn``, or the language model's name."""
        return self.model or self.name

    @property
    def is_lm(self) -> bool:
        """Whether this is a language model (samples are sequences of ``seq_len`` tokens)."""
        return self.seq_len > 0


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", "(a) MLP 784-512-10, MNIST-shaped", batch=256, steps=100, warmup=10,
                    quick_steps=30, timeout_s=240, accel_steps=2000),
    "mlp32": Workload("mlp32", "(a) MLP 784-512-10, MNIST-shaped, batch 32", batch=32, steps=100, warmup=10,
                      quick_steps=30, timeout_s=240, accel_steps=2000, model="mlp"),
    "cnn": Workload("cnn", "(b) mirrorax train CNN, 8x8x1 digits", batch=256, steps=100, warmup=10,
                    quick_steps=30, timeout_s=240, accel_steps=2000),
    # On 2 CPU cores a step of the LM takes about a second: one round, few steps, still the sizes.
    "transformer": Workload("transformer", "(c) Transformer LM 4x256, seq 128", batch=16, steps=5, warmup=2,
                            quick_steps=2, timeout_s=420, rounds=1, accel_steps=1000, seq_len=128, vocab=1024,
                            layers=4, width=256, heads=4, ffn=1024),
    "lm": Workload("lm", "(d) LM 12x1024, seq 1024, 219M parameters", batch=8, steps=16, warmup=3, quick_steps=8,
                   timeout_s=420, rounds=1, accel_steps=16, seq_len=1024, vocab=32768, layers=12, width=1024,
                   heads=8, ffn=4096),
}
"""The workloads by name."""

ALIASES: dict[str, str] = {"a": "mlp", "b": "cnn", "c": "transformer", "d": "lm"}
"""The issue's letters for the workload names."""

# ``MIRRORAX_BENCH_TINY_LM=1`` (set by the accelerator script's ``--cpu-smoke`` for its processes) shrinks
# both language models to one small block, so that a smoke run checks the whole path without compiling the
# real model: a plumbing check, never a measurement.
TINY_LM = os.environ.get("MIRRORAX_BENCH_TINY_LM") == "1"
if TINY_LM:
    for _name in ("transformer", "lm"):
        WORKLOADS[_name] = dataclasses.replace(WORKLOADS[_name], seq_len=16, vocab=256, layers=1, width=64,
                                               heads=2, ffn=256)


def get(name: str) -> Workload:
    """Returns the workload called ``name`` (or its letter ``a``/``b``/``c``).

    Raises:
      ValueError: no such workload.
    """
    key = ALIASES.get(name, name)
    if key not in WORKLOADS:
        raise ValueError(f"Expected a workload among {sorted(WORKLOADS)} or {sorted(ALIASES)}. "
                         f"Received: {name!r}")
    return WORKLOADS[key]


def make_data(workload: Workload, num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random inputs and integer labels of the workload's shapes (the same for every system).

    Returns:
      ``(x, y)``: mlp ``float32 (n, 784)`` and ``int32 (n,)``; cnn ``float32 (n, 8, 8, 1)`` and
      ``int32 (n,)``; the language models ``int32 (n, seq)`` tokens and ``int32 (n, seq)`` next tokens.
    """
    rng = np.random.default_rng(seed)
    if workload.kind == "mlp":
        return rng.random((num_samples, 784), dtype=np.float32), rng.integers(0, 10, num_samples, dtype=np.int32)
    if workload.kind == "cnn":
        return (rng.random((num_samples, 8, 8, 1), dtype=np.float32),
                rng.integers(0, 10, num_samples, dtype=np.int32))
    tokens = rng.integers(0, workload.vocab, (num_samples, workload.seq_len + 1), dtype=np.int32)
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


def build_keras_model(workload: Workload) -> Any:
    """Builds the workload's Keras 3 model (uncompiled) with whatever backend Keras runs on.

    The dtype policy in force (e.g. ``keras.mixed_precision.set_global_policy("mixed_bfloat16")``) applies;
    the transformer's logits stay float32 so the loss is computed in float32.
    """
    import keras

    if workload.kind == "mlp":
        return _zoo().mlp()
    if workload.kind == "cnn":
        return _zoo().digits_cnn()
    return _transformer_lm(keras, workload)


def _zoo() -> Any:
    """``mirrorax.zoo``, loaded from its file so that peers need neither JAX nor the rest of mirrorax.

    (Importing ``mirrorax`` starts with JAX; the TensorFlow and PyTorch peers only want the two model
    definitions, which ``zoo.py`` writes with plain Keras.)
    """
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "mirrorax", "zoo.py")
    if not os.path.exists(path):
        from mirrorax import zoo

        return zoo
    if "_mirrorax_zoo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_mirrorax_zoo", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_mirrorax_zoo"] = module
    return sys.modules["_mirrorax_zoo"]


def _transformer_lm(keras: Any, wl: Workload) -> Any:
    """A decoder-only LM: token + learned position embeddings, pre-LN blocks with causal attention."""

    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned ``(seq_len, width)`` position embedding."""

        def build(self, input_shape: tuple[int, ...]) -> None:
            self.pos = self.add_weight(shape=(input_shape[-2], input_shape[-1]),
                                       initializer=keras.initializers.RandomNormal(stddev=0.02), name="pos")

        def call(self, x: Any) -> Any:
            return x + keras.ops.cast(self.pos, x.dtype)[None]

    tokens = keras.Input((wl.seq_len,), dtype="int32")
    x = keras.layers.Embedding(wl.vocab, wl.width)(tokens)
    x = PositionEmbedding()(x)
    for _ in range(wl.layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.MultiHeadAttention(wl.heads, wl.width // wl.heads)(h, h, use_causal_mask=True)
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.Dense(wl.ffn, activation="gelu")(h)
        h = keras.layers.Dense(wl.width)(h)
        x = keras.layers.Add()([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    logits = keras.layers.Dense(wl.vocab, dtype="float32")(x)
    return keras.Model(tokens, logits, name=f"{wl.name}_lm")


def compile_args(workload: Workload) -> dict[str, Any]:
    """The ``model.compile`` arguments every Keras system uses: Adam(1e-3), sparse CE, accuracy."""
    import keras

    return {
        "optimizer": keras.optimizers.Adam(1e-3),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=workload.is_lm),
        "metrics": ["accuracy"],
    }


def flops_per_sample(workload: Workload, num_params: int) -> float:
    """Training FLOPs per sample (forward + backward), for MFU.

    ``6 * params`` per token for the weight matmuls, the language models' lookup tables (the token and the
    position embeddings: a lookup multiplies nothing) left out, as PaLM's MFU counts them; plus attention's
    two ``T x T`` products per layer: ``2 * 2 * T^2 * width`` forward, times 3 with the backward pass, so
    ``12 * layers * T^2 * width`` per sequence; the causal half is counted as well because dense attention
    computes the whole score matrix. (The 219M LM: 1.290e12 per sequence; XLA's count of the compiled train
    step at batch 8, 1.297e12; with the tables counted, as before issue 58, 1.502e12: 16% over.
    ``python -m benchmarks.model_flops``.) A convolution's FLOPs are not ``6 x params``: the CNN's figure
    undercounts its step ~13x (XLA's count is what fit's printed MFU uses).
    """
    if not workload.is_lm:
        return 6.0 * num_params
    t = workload.seq_len
    matmul_params = num_params - (workload.vocab + t) * workload.width
    return 6.0 * matmul_params * t + 12.0 * workload.layers * t * t * workload.width
