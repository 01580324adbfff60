"""mirrorax: synchronous data-parallel training for JAX and Keras 3.

The ``tf.distribute.MirroredStrategy`` experience on ``jax.sharding``: variables replicated, each global
batch split over the devices, one jitted step, the single-device result on any device count.

Example:
  >>> import os; os.environ["KERAS_BACKEND"] = "jax"
  >>> import keras, mirrorax as mx
  >>> strategy = mx.MirroredStrategy()
  >>> with strategy.scope():
  ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
  ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
  >>> history = mx.Trainer(model).fit(x, y, batch_size=256, epochs=5)
"""

from typing import TYPE_CHECKING

from mirrorax._version import __version__ as __version__
from mirrorax.checkpoint.snapshot import SnapshotError as SnapshotError
from mirrorax.checkpoint.snapshot import Snapshots as Snapshots
from mirrorax.checkpoint.snapshot import SnapshotWarning as SnapshotWarning
from mirrorax.cluster.consistency import ReplicaMismatchError as ReplicaMismatchError
from mirrorax.cluster.join import ClusterError as ClusterError
from mirrorax.cluster.join import ClusterInfo as ClusterInfo
from mirrorax.cluster.join import initialize as initialize
from mirrorax.cluster.preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from mirrorax.cluster.preemption import Preempted as Preempted
from mirrorax.fit.cache import enable_compilation_cache as enable_compilation_cache
from mirrorax.fit.planner import Plan as Plan
from mirrorax.fit.planner import plan as plan
from mirrorax.fit.utilisation import InputBoundWarning as InputBoundWarning
from mirrorax.fit.utilisation import Utilisation as Utilisation
from mirrorax.fit.utilisation import utilisation as utilisation
from mirrorax.front_end import register_lazy as _register_lazy_front_end
from mirrorax.inputs.distributed import DistributedDataset as DistributedDataset
from mirrorax.inputs.reading import FitReading as FitReading
from mirrorax.inputs.reading import PassOrder as PassOrder

# mirrorax.keras.fit is imported for what importing it does: strategy.scope() then routes the Keras models made in it.
from mirrorax.keras import fit as _keras_fit  # noqa: F401
from mirrorax.keras.stateful import grad as grad
from mirrorax.keras.stateful import value_and_grad as value_and_grad
from mirrorax.mesh import hybrid_mesh as hybrid_mesh
from mirrorax.models.base import ModelAdapter as ModelAdapter
from mirrorax.models.functional import FunctionalModel as FunctionalModel
from mirrorax.results import History as History
from mirrorax.results import NonFiniteLossError as NonFiniteLossError
from mirrorax.steps.distributed_batch import DistributedBatch as DistributedBatch
from mirrorax.steps.padding import PaddingIgnoredWarning as PaddingIgnoredWarning
from mirrorax.steps.padding import ReplicatedBatchWarning as ReplicatedBatchWarning
from mirrorax.steps.replica import ReduceOp as ReduceOp
from mirrorax.steps.replica import ReplicaContext as ReplicaContext
from mirrorax.steps.replica import compute_average_loss as compute_average_loss
from mirrorax.steps.replica import get_replica_context as get_replica_context
from mirrorax.steps.replica import masked_mean as masked_mean
from mirrorax.steps.replica import scale_regularization_loss as scale_regularization_loss
from mirrorax.steps.split_merge import register as _register
from mirrorax.strategy import InputContext as InputContext
from mirrorax.strategy import MirroredStrategy as MirroredStrategy
from mirrorax.strategy import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from mirrorax.strategy import get_strategy as get_strategy
from mirrorax.traffic import Collective as Collective
from mirrorax.traffic import Traffic as Traffic
from mirrorax.traffic import traffic as traffic
from mirrorax.train_state import TrainState as TrainState
from mirrorax.trainer import Trainer as Trainer


def _load_keras() -> None:  # Keras's record and split/merge protocol, loaded by the engine's first look (a
    # model's front-end, a step's protocols) while keras is imported
    from mirrorax.front_end import register
    from mirrorax.keras.front_end import KERAS_FRONT_END
    from mirrorax.keras.stateful import KERAS

    register(KERAS_FRONT_END)
    _register(KERAS)


def _load_nnx() -> None:  # the Flax NNX wing, loaded by the engine's first look while flax.nnx is imported
    import mirrorax.nnx  # noqa: F401  (registers its split/merge protocol and its front-end's record)


_register_lazy_front_end("keras", _load_keras)
_register_lazy_front_end("flax.nnx", _load_nnx)

if TYPE_CHECKING:  # loaded on first use (below); imported here for type checkers and the API reference
    from mirrorax.checkpoint.checkpointer import Checkpointer as Checkpointer
    from mirrorax.checkpoint.checkpointer import CheckpointError as CheckpointError
    from mirrorax.checkpoint.checkpointer import CheckpointMismatchError as CheckpointMismatchError
    from mirrorax.checkpoint.checkpointer import CheckpointWarning as CheckpointWarning
    from mirrorax.keras.checkpoint import Checkpoint as Checkpoint
    from mirrorax.keras.checkpoint import CheckpointManager as CheckpointManager

# The checkpoint layer imports Orbax and TensorStore (~25 MB of resident memory): loaded on first use.
_LAZY = {"Checkpoint", "CheckpointManager", "CheckpointError", "CheckpointMismatchError", "CheckpointWarning",
         "Checkpointer"}


def __getattr__(name: str):  # PEP 562
    if name in ("Checkpoint", "CheckpointManager"):
        from mirrorax.keras import checkpoint as object_checkpoint

        return getattr(object_checkpoint, name)
    if name in _LAZY:
        from mirrorax.checkpoint import checkpointer as checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'mirrorax' has no attribute {name!r}")

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "Checkpointer",
    "ClusterError",
    "ClusterInfo",
    "Collective",
    "DistributedBatch",
    "DistributedDataset",
    "FitReading",
    "FunctionalModel",
    "History",
    "InputBoundWarning",
    "InputContext",
    "MirroredStrategy",
    "ModelAdapter",
    "MultiWorkerMirroredStrategy",
    "NonFiniteLossError",
    "PaddingIgnoredWarning",
    "PassOrder",
    "ReplicatedBatchWarning",
    "Plan",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaMismatchError",
    "SnapshotError",
    "SnapshotWarning",
    "Snapshots",
    "Traffic",
    "TrainState",
    "Trainer",
    "Utilisation",
    "compute_average_loss",
    "enable_compilation_cache",
    "get_replica_context",
    "get_strategy",
    "grad",
    "hybrid_mesh",
    "initialize",
    "masked_mean",
    "plan",
    "scale_regularization_loss",
    "traffic",
    "utilisation",
    "value_and_grad",
]
