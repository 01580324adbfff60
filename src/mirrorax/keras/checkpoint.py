"""``mx.Checkpoint``: a custom loop's Keras objects saved and restored by name, as ``tf.train.Checkpoint``.

``Checkpoint(model=model, optimizer=optimizer, step=step_variable)`` holds Keras objects (anything with
``.variables``: models, layers, optimizers, metrics) and Keras variables. ``save(prefix)`` writes every
one of their variables' values as the next numbered checkpoint of a :class:`mirrorax.Checkpointer`
directory (asynchronously: Orbax writes while training goes on; integrity checks included);
``restore(path)`` writes the stored values back into the same objects of this program, onto the
devices their values live on now, so a checkpoint written on 8 devices restores on 1 or 3. A model
that was never called (a ``Sequential`` without an ``Input``) is built first from the input shape the
checkpoint recorded, and an optimizer that never stepped is built on the checkpoint's model, as TF's
deferred restore would fill them in on first use.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from typing import Any

import jax

from mirrorax.checkpoint import Checkpointer, CheckpointError

__all__ = ["Checkpoint"]

_SAVERS: dict[str, Checkpointer] = {}


@atexit.register
def _close_all() -> None:  # pending saves finish before the program ends
    while _SAVERS:
        _SAVERS.popitem()[1].close()


def _is_variable(x: Any) -> bool:
    import keras

    return isinstance(x, keras.Variable)


def _is_optimizer(x: Any) -> bool:
    import keras

    return isinstance(x, keras.optimizers.Optimizer)


class Checkpoint:
    """Keras objects saved and restored by name (TF's ``tf.train.Checkpoint``), on Orbax.

    Args:
      **objects: each a Keras model, layer, optimizer or metric (anything with ``.variables``), or a
        Keras variable (a step counter: ``keras.Variable(0, dtype="int32")``).

    Attributes:
      save_counter: how many times :meth:`save` ran in this program (the next checkpoint's number).

    Raises:
      TypeError: an object is neither a Keras variable nor has ``variables``.

    Example:
      >>> checkpoint = mx.Checkpoint(optimizer=optimizer, model=model)
      >>> path = checkpoint.save("training_checkpoints/ckpt")   # training_checkpoints/ckpt/1
      >>> mx.Checkpoint(optimizer=new_optimizer, model=new_model).restore("training_checkpoints/ckpt")
    """

    def __init__(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if not (_is_variable(obj) or hasattr(obj, "variables")):
                raise TypeError(f"mx.Checkpoint({name}=...) takes Keras models, layers, optimizers, metrics (objects "
                                f"with .variables) and Keras variables. Received {obj!r} (of type "
                                f"{type(obj).__name__}). For a step counter, pass keras.Variable(0, dtype='int32').")
        self._objects = dict(objects)
        self.save_counter = 0

    def _variables(self) -> dict[str, list[Any]]:
        return {name: [obj] if _is_variable(obj) else list(obj.variables) for name, obj in self._objects.items()}

    def _saver(self, directory: str) -> Checkpointer:
        # One Checkpointer per directory in the process, shared by every Checkpoint: a second one would
        # clean up the first one's save in progress (Orbax removes unfinished step directories).
        directory = os.path.abspath(directory)
        if directory not in _SAVERS:
            _SAVERS[directory] = Checkpointer(directory, keep=None)
        return _SAVERS[directory]

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Starts writing every object's variables as checkpoint ``save_counter + 1`` under ``file_prefix``
        (a directory of numbered checkpoints); returns that checkpoint's path before the write ends.

        The values are copied off the devices before ``save`` returns; the files are written in the
        background (see :meth:`mirrorax.Checkpointer.save`). :meth:`restore` and :meth:`wait` wait for them.
        """
        saver = self._saver(os.fspath(file_prefix))
        self.save_counter = max(self.save_counter, saver.latest_step() or 0) + 1
        state = {name: [v.value for v in variables] for name, variables in self._variables().items()}
        shapes = {name: list(_input_shape(obj)) for name, obj in self._objects.items()
                  if getattr(obj, "built", False) and isinstance(_input_shape(obj), tuple)}
        saver.save(self.save_counter, state, {"save_counter": self.save_counter, "input_shapes": shapes})
        _write_tf_state(saver.directory)
        return os.path.join(saver.directory, str(self.save_counter))

    def wait(self) -> None:
        """Blocks until every started save (of any ``Checkpoint`` of this process) is on disk."""
        for saver in list(_SAVERS.values()):
            saver.wait()

    def restore(self, save_path: str | os.PathLike[str]) -> Checkpoint:
        """Writes a checkpoint's values back into this checkpoint's objects.

        Args:
          save_path: what :meth:`save` returned (``<prefix>/<n>``), or the prefix itself: its newest good
            checkpoint.

        Returns:
          ``self``.

        Raises:
          CheckpointError: no checkpoint at ``save_path``, or it is damaged.
          mirrorax.CheckpointMismatchError: the objects' variables differ from the stored ones (the
            message names the first).
        """
        if save_path is None:
            raise CheckpointError("Checkpoint.restore received None: no checkpoint was found. Pass what "
                                  "checkpoint.save(prefix) returned, or the prefix itself (its newest checkpoint).")
        path = os.path.abspath(os.fspath(save_path))
        base = os.path.basename(path)
        directory, step = (os.path.dirname(path), int(base)) if base.isdigit() else (path, None)
        if not os.path.isdir(directory):
            raise CheckpointError(f"No checkpoint at {path}: {directory} does not exist. Pass what "
                                  "checkpoint.save(prefix) returned, or that prefix.")
        saver = self._saver(directory)
        self.wait()
        self._build_missing(saver.read_meta() or {})
        variables = self._variables()
        abstract = {name: [jax.ShapeDtypeStruct(v.shape, v.value.dtype, sharding=_sharding(v.value)) for v in vs]
                    for name, vs in variables.items()}
        if step is None:
            found = saver.restore_latest(abstract)
            if found is None:
                raise CheckpointError(f"No checkpoint in {directory}: it holds no numbered checkpoint written by "
                                      "mx.Checkpoint.save.")
            step, state, _ = found
        else:
            state, _ = saver.restore(step, abstract)
        for name, vs in variables.items():
            for v, value in zip(vs, state[name]):
                v.assign(value)
        self.save_counter = max(self.save_counter, step)
        return self

    def _build_missing(self, meta: Mapping[str, Any]) -> None:
        """Builds a never-called model from its recorded input shape, and a never-stepped optimizer on
        the checkpoint's one model (TF fills both in on first use)."""
        shapes = meta.get("input_shapes", {})
        for name, obj in self._objects.items():
            if not _is_variable(obj) and not getattr(obj, "built", True) and name in shapes and hasattr(obj, "build"):
                obj.build(tuple(shapes[name]))
        models = [o for o in self._objects.values() if not _is_variable(o) and not _is_optimizer(o)
                  and getattr(o, "trainable_variables", None)]
        for obj in self._objects.values():
            if _is_optimizer(obj) and not obj.built and len(models) == 1:
                obj.build(models[0].trainable_variables)

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)}; save_counter={self.save_counter})"


def _write_tf_state(prefix: str) -> None:
    """Writes TF's ``checkpoint`` state file beside ``prefix``, naming it: ``tf.train.latest_checkpoint(dir)``
    then returns ``prefix``, which :meth:`Checkpoint.restore` takes (its newest checkpoint), so a ported
    ``checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))`` runs unchanged."""
    if jax.process_index() != 0 or "://" in prefix:
        return
    name = os.path.basename(prefix)
    with open(os.path.join(os.path.dirname(prefix), "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n')


def _input_shape(obj: Any) -> Any:
    try:
        return obj.input_shape
    except (AttributeError, ValueError):
        return None


def _sharding(value: Any) -> Any:
    if isinstance(value, jax.Array):
        return value.sharding
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
