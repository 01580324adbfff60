"""Flax NNX programs on the strategy: mirrorax's wing for Flax's NNX API (``pip install "mirrorax[flax]"``).

* ``@strategy.jit`` in place of ``@nnx.jit``: a step that takes NNX objects (a model, ``nnx.Optimizer``,
  ``nnx.MultiMetric``, ``nnx.Rngs``) and updates them in place runs on every device of the strategy,
  over global batches of ``strategy.experimental_distribute_dataset`` (a short batch cut to its real
  rows), with the one-device numbers (:mod:`mirrorax.nnx.split_merge`).
* ``mx.Trainer(module, loss=..., optimizer=...)``: an ``nnx.Module`` trained by the Trainer's engine
  (checkpoints, resume, preemption, ``shard=``, ``mx.plan``, accumulation, ``on_nonfinite``;
  ``mixed_precision="bfloat16"`` as Flax's layer ``dtype``), written back into it (:class:`NnxModel`).

``import mirrorax`` never imports Flax: the package loads this wing the first time a step is called while
``flax.nnx`` is imported (or looks a model's front-end up). Importing it registers :data:`NNX` (its split/merge
protocol) and ``NNX_FRONT_END`` (an ``nnx.Module`` for ``mx.Trainer``) with the engine.
"""

try:
    import flax.nnx  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised with flax hidden (tests/test_nnx.py)
    raise ImportError("mirrorax.nnx needs Flax NNX (flax>=0.12), which could not be imported: install it with "
                      'pip install "mirrorax[flax]" (or pip install "flax>=0.12").') from error

from mirrorax import front_end
from mirrorax.nnx.model import NNX_FRONT_END
from mirrorax.nnx.model import NnxModel as NnxModel
from mirrorax.nnx.split_merge import NNX as NNX
from mirrorax.nnx.split_merge import NnxSplitMerge as NnxSplitMerge
from mirrorax.steps.split_merge import register

register(NNX)
front_end.register(NNX_FRONT_END)

__all__ = ["NNX", "NnxModel", "NnxSplitMerge"]
