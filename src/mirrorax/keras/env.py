"""Keras settings that a model under ``MirroredStrategy.scope()`` cannot honour, refused where they meet.

Two settings would otherwise be ignored without a word: Keras on another backend than JAX (the model
would train on Keras's own single-device loop of that backend) and a global ``keras.distribution``
other than ``DataParallel`` (a ``ModelParallel`` layout map would be replaced by the strategy's layouts:
it belongs in ``MirroredStrategy(layout_map=...)``). ``DataParallel`` asks for what the scope does and is
honoured. Both are read only when the program itself has imported Keras: a pure-JAX program never needs
it.
"""

from __future__ import annotations

import os
import sys

from mirrorax.keras import _internals as internals

__all__ = ["check_scope", "check_distribution"]


def check_scope() -> None:
    """At ``scope()``: refuses Keras on another backend, and a global ``keras.distribution``.

    Raises:
      RuntimeError: Keras (imported by the program) runs on another backend than JAX.
      ValueError: a ``keras.distribution`` is set globally.
    """
    if "keras" not in sys.modules:
        return  # no Keras model can be made in this scope without importing Keras first
    keras = sys.modules["keras"]
    backend = keras.backend.backend()
    if backend != "jax":
        raise RuntimeError(
            f"MirroredStrategy.scope() trains Keras models on the JAX backend, but Keras runs on {backend!r} "
            f"here (KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}): a model made in this scope would train "
            "on that backend's own single-device loop. Set KERAS_BACKEND=jax before importing keras: `export "
            "KERAS_BACKEND=jax`, or os.environ['KERAS_BACKEND'] = 'jax' at the top of the script. (mx.Trainer "
            "with an mx.FunctionalModel needs no Keras and no scope.)")
    check_distribution("scope()")


def check_distribution(where: str) -> None:
    """Refuses a global ``keras.distribution`` (``set_distribution`` or its ``scope()``) other than
    ``DataParallel`` for a model of a strategy; ``where`` names the call (``"scope()"``, ``"compile"``,
    ``"fit"``).

    Raises:
      ValueError: a distribution is set: what it is, why it cannot apply, and the two ways on.
    """
    if "keras" not in sys.modules:
        return
    dist = internals.global_distribution()
    if dist is None or internals.is_data_parallel(dist):
        # DataParallel asks for what the scope does (replicated variables, split batches): honoured, on
        # the strategy's devices.
        return
    kind = type(dist).__name__
    if internals.is_model_parallel(dist):
        why = ("the strategy lays the variables out itself and would ignore its layout map; give the layout map "
               "to the strategy instead: MirroredStrategy(layout_map=...) lays each variable out as the map says "
               "(its batch_dim_name as batch_axes=...)")
        other = "Keras's own fit without the scope for model parallelism"
    else:
        why = "mirrorax replicates every variable on the strategy's devices and would ignore its layouts"
        other = f"Keras's own fit with {kind} without the scope"
    raise ValueError(
        f"keras.distribution is set to {kind} (by keras.distribution.set_distribution or its scope()) at "
        f"{where} under MirroredStrategy.scope(), where mirrorax trains the model: {why}. Unset it with "
        f"keras.distribution.set_distribution(None) to train data-parallel under the scope, or use {other}.")

