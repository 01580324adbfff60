"""The benchmark workloads, shared by every system: model, data, loss, optimizer and sizes.

Every system trains the same thing on the same seeded data with the same global batch and step count:

* ``mlp``         (a) ``mirrorax.zoo.mlp()`` 784-512-10 on MNIST-shaped data (28x28 flattened), batch 256.
* ``cnn``         (b) ``mirrorax.zoo.digits_cnn()``, the ``mirrorax train`` CNN, on 8x8x1 digits-shaped data.
* ``transformer`` (c) a decoder-only language model: 4 pre-LayerNorm blocks, width 256, 4 heads, feed-forward
  1024, sequence 128, vocabulary 1024, next-token cross-entropy; ``bf16`` uses Keras' ``mixed_bfloat16``.

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
      timeout_s: a run (one subprocess) that takes longer is killed and recorded as a timeout.
      rounds: processes per (devices, system) in a full run (each does a warm-up and timed runs).
      seq_len: sequence length (language model only).
      vocab: vocabulary size (language model only).
    """

    name: str
    title: str
    batch: int
    steps: int
    warmup: int
    quick_steps: int
    timeout_s: float
    rounds: int = 2
    seq_len: int = 0
    vocab: int = 0


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", "(a) MLP 784-512-10, MNIST-shaped", batch=256, steps=100, warmup=10,
                    quick_steps=30, timeout_s=240),
    "cnn": Workload("cnn", "(b) mirrorax train CNN, 8x8x1 digits", batch=256, steps=100, warmup=10,
                    quick_steps=30, timeout_s=240),
    # On 2 CPU cores a step of the LM takes about a second: one round, few steps, still the sizes.
    "transformer": Workload("transformer", "(c) Transformer LM 4x256, seq 128", batch=16, steps=5, warmup=2,
                            quick_steps=2, timeout_s=420, rounds=1, seq_len=128, vocab=1024),
}
"""The workloads by name."""

ALIASES: dict[str, str] = {"a": "mlp", "b": "cnn", "c": "transformer", "lm": "transformer"}
"""The issue's letters (and ``lm``) for the workload names."""

# Transformer sizes (the issue's: 4 layers, width 256, sequence 128). ``MIRRORAX_BENCH_TINY_LM=1`` (set by
# ``benchmarks/gpu_h200.py --cpu-smoke`` for its processes) shrinks it to one small block, so that a smoke
# run checks the whole path without compiling the real model: a plumbing check, never a measurement.
TINY_LM = os.environ.get("MIRRORAX_BENCH_TINY_LM") == "1"
LM_LAYERS, LM_WIDTH, LM_HEADS, LM_FFN = (1, 64, 2, 256) if TINY_LM else (4, 256, 4, 1024)
if TINY_LM:
    WORKLOADS["transformer"] = dataclasses.replace(WORKLOADS["transformer"], seq_len=16, vocab=256)


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
      ``int32 (n,)``; transformer ``int32 (n, seq)`` tokens and ``int32 (n, seq)`` next tokens.
    """
    rng = np.random.default_rng(seed)
    if workload.name == "mlp":
        return rng.random((num_samples, 784), dtype=np.float32), rng.integers(0, 10, num_samples, dtype=np.int32)
    if workload.name == "cnn":
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

    if workload.name == "mlp":
        return _zoo().mlp()
    if workload.name == "cnn":
        return _zoo().digits_cnn()
    return _transformer_lm(keras, workload.seq_len, workload.vocab)


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


def _transformer_lm(keras: Any, seq_len: int, vocab: int) -> Any:
    """A decoder-only LM: token + learned position embeddings, pre-LN blocks with causal attention."""

    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned ``(seq_len, width)`` position embedding."""

        def build(self, input_shape: tuple[int, ...]) -> None:
            self.pos = self.add_weight(shape=(input_shape[-2], input_shape[-1]),
                                       initializer=keras.initializers.RandomNormal(stddev=0.02), name="pos")

        def call(self, x: Any) -> Any:
            return x + keras.ops.cast(self.pos, x.dtype)[None]

    tokens = keras.Input((seq_len,), dtype="int32")
    x = keras.layers.Embedding(vocab, LM_WIDTH)(tokens)
    x = PositionEmbedding()(x)
    for _ in range(LM_LAYERS):
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.MultiHeadAttention(LM_HEADS, LM_WIDTH // LM_HEADS)(h, h, use_causal_mask=True)
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.Dense(LM_FFN, activation="gelu")(h)
        h = keras.layers.Dense(LM_WIDTH)(h)
        x = keras.layers.Add()([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    logits = keras.layers.Dense(vocab, dtype="float32")(x)
    return keras.Model(tokens, logits, name="transformer_lm")


def compile_args(workload: Workload) -> dict[str, Any]:
    """The ``model.compile`` arguments every Keras system uses: Adam(1e-3), sparse CE, accuracy."""
    import keras

    return {
        "optimizer": keras.optimizers.Adam(1e-3),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=workload.name == "transformer"),
        "metrics": ["accuracy"],
    }


def flops_per_sample(workload: Workload, num_params: int) -> float:
    """Training FLOPs per sample (forward + backward), for MFU.

    ``6 * params`` per token for the weight matmuls (embedding lookups counted too, a slight over-count),
    plus attention's two ``T x T`` products per layer: ``2 * 2 * T^2 * width`` forward, times 3 with the
    backward pass, so ``12 * layers * T^2 * width`` per sequence; the causal half is counted as well
    because dense attention computes the whole score matrix.
    """
    if workload.name != "transformer":
        return 6.0 * num_params
    t = workload.seq_len
    return 6.0 * num_params * t + 12.0 * LM_LAYERS * t * t * LM_WIDTH
