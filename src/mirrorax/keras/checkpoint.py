"""``mx.Checkpoint``: a custom loop's Keras objects saved and restored by name, as ``tf.train.Checkpoint``;
``mx.CheckpointManager``: its numbered checkpoints in a directory, the newest few kept, as
``tf.train.CheckpointManager``.

``Checkpoint(model=model, optimizer=optimizer, step=step_variable)`` holds Keras objects (anything with
``.variables``: models, layers, optimizers, metrics) and Keras variables. ``save(prefix)`` writes every
one of their variables' values as the next numbered checkpoint of a :class:`mirrorax.Checkpointer`
directory (asynchronously: Orbax writes while training goes on; integrity checks included);
``restore(path)`` writes the stored values back into the same objects of this program, onto the
devices their values live on now, so a checkpoint written on 8 devices restores on 1 or 3. A model
that was never called (a ``Sequential`` without an ``Input``) is built first from the input shape the
checkpoint recorded, and an optimizer that never stepped is built on the checkpoint's model, as TF's
deferred restore would fill them in on first use.

On several processes every process calls ``save`` and ``restore``, as TF's workers do, and they write
one checkpoint together: at process 0's path. TF's ``write_filepath`` pattern (the chief saves to
``ckpt/``, each worker to a throwaway ``workertemp_<i>/``) thus writes the chief's checkpoint, once; a
worker's own directory is made and left empty (:mod:`mirrorax.checkpoint.job`).

TF's ``checkpoint`` state file is written beside the checkpoints once the first of them is complete (a
directory's first save returns when it is on disk; later ones write in the background). It names their
directory, whose newest good checkpoint :meth:`Checkpoint.restore` takes, so a ported
``checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))`` runs unchanged and, after a crash,
resumes from the newest complete checkpoint. It is written atomically, and only when it changes: a full
disk never leaves it truncated. A save still being written when the program ends is finished first
(:class:`mirrorax.Checkpointer`); one that fails on a full disk ends the program on its one-line
``CheckpointError`` and leaves no temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

from mirrorax._checks import check_int
from mirrorax.checkpoint.checkpointer import Checkpointer, CheckpointError
from mirrorax.checkpoint.job import process_0_directory
from mirrorax.checkpoint.storage import short, write_atomic

__all__ = ["Checkpoint", "CheckpointManager"]

# One Checkpointer per directory in the process, shared by every Checkpoint and manager: a second one would
# clean up the first one's save in progress (Orbax removes unfinished step directories).
_SAVERS: dict[str, Checkpointer] = {}
_ANY: Any = object()  # what a reader asks: any saver of the directory, whatever it keeps


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

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Starts writing every object's variables as checkpoint ``save_counter + 1`` under ``file_prefix``
        (a directory of numbered checkpoints); returns that checkpoint's path (``<file_prefix>/<n>``).

        The values are copied off the devices before ``save`` returns; the files are written in the
        background (see :meth:`mirrorax.Checkpointer.save`), but for the first checkpoint of a directory,
        on disk when ``save`` returns. :meth:`restore`, :meth:`wait` and the end of the program wait for
        them. On several processes every process calls it; the checkpoint is written at process 0's
        ``file_prefix``, whose path every process gets back.
        """
        own = os.path.abspath(os.fspath(file_prefix))
        prefix = _agreed(own)
        self.save_counter = max(self.save_counter, _saver(prefix, _ANY).latest_step() or 0) + 1
        return self._write(own, prefix, self.save_counter)

    def write(self, file_path: str | os.PathLike[str]) -> str:
        """Starts writing every object's variables as the checkpoint ``file_path`` (``<prefix>/<n>``, ``n`` a
        number above the newest checkpoint in ``<prefix>``), ``save_counter`` unchanged (TF's ``write``);
        returns the path written (process 0's, on several processes). Asynchronous as :meth:`save`.

        Raises:
          ValueError: ``file_path`` does not end in a checkpoint number.
        """
        own = os.path.abspath(os.fspath(file_path))
        if not os.path.basename(own).isdigit():
            raise ValueError(f"Checkpoint.write takes '<prefix>/<n>' (n the checkpoint's number). Received "
                             f"{os.fspath(file_path)!r}. Pass e.g. 'checkpoints/ckpt/3', or save(prefix), which "
                             "numbers it.")
        prefix = os.path.dirname(own)
        return self._write(prefix, _agreed(prefix), int(os.path.basename(own)))

    def _write(self, own: str, prefix: str, number: int) -> str:
        """Checkpoint ``number`` of directory ``prefix`` (process 0's; ``own`` is this process's)."""
        if prefix != own and "://" not in own:
            os.makedirs(os.path.dirname(own), exist_ok=True)  # a worker's own path exists, as under TF
        saver = _saver(prefix, _ANY)
        first = not saver.all_steps()
        state = {name: [v.value for v in variables] for name, variables in self._variables().items()}
        shapes = {name: list(_input_shape(obj)) for name, obj in self._objects.items()
                  if getattr(obj, "built", False) and isinstance(_input_shape(obj), tuple)}
        saver.save(number, state, {"save_counter": number, "input_shapes": shapes})
        if first:
            saver.wait()  # the directory's first checkpoint: on disk before TF's state file names the directory
        _write_tf_state(saver)
        return os.path.join(saver.directory, str(number))

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
        directory = _agreed(directory)
        if not os.path.isdir(directory):
            raise CheckpointError(f"No checkpoint at {path}: {directory} does not exist. Pass what "
                                  "checkpoint.save(prefix) returned, or that prefix.")
        saver = _saver(directory, _ANY)
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


class CheckpointManager:
    """Numbered checkpoints of a :class:`Checkpoint` in ``directory``, the newest ``max_to_keep`` kept (TF's
    ``tf.train.CheckpointManager``).

    Checkpoint ``n`` is ``<directory>/<checkpoint_name>/<n>`` (TF's ``<directory>/<checkpoint_name>-<n>``)
    and TF's ``checkpoint`` state file in ``directory`` names ``<checkpoint_name>``, so
    ``tf.train.latest_checkpoint(directory)`` gives a path :meth:`Checkpoint.restore` takes (its newest good
    checkpoint). An older checkpoint is deleted once a newer one is complete. On several processes every
    process calls :meth:`save`, and the checkpoint goes to process 0's ``directory`` (see
    :class:`Checkpoint`); :attr:`latest_checkpoint` and :attr:`checkpoints` name it on every process.

    Args:
      checkpoint: the :class:`Checkpoint` to save.
      directory: where the checkpoints go (created on the first save).
      max_to_keep: how many of the newest checkpoints to keep (>= 1), or ``None`` for all.
      checkpoint_name: the name of the checkpoints' folder in ``directory``.

    Raises:
      TypeError: ``checkpoint`` is not a :class:`Checkpoint`.
      ValueError: ``max_to_keep`` is not a positive int or ``None``.

    Example:
      >>> manager = mx.CheckpointManager(checkpoint, directory="/tmp/run", max_to_keep=3)
      >>> manager.save()                     # '/tmp/run/ckpt/1'
      >>> checkpoint.restore(manager.latest_checkpoint)
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike[str], max_to_keep: int | None,
                 checkpoint_name: str = "ckpt") -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"CheckpointManager takes an mx.Checkpoint. Received {checkpoint!r} (of type "
                            f"{type(checkpoint).__name__}). Pass mx.Checkpoint(model=model, ...).")
        if max_to_keep is not None:
            check_int("max_to_keep", max_to_keep, 1, meaning="the number of newest checkpoints to keep; None keeps all")
        self._checkpoint = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._name = checkpoint_name
        self._max_to_keep = max_to_keep

    @property
    def checkpoint(self) -> Checkpoint:
        """The :class:`Checkpoint` this manager saves."""
        return self._checkpoint

    @property
    def directory(self) -> str:
        """The directory given (this process's, which may differ from process 0's)."""
        return self._directory

    @property
    def max_to_keep(self) -> int | None:
        """How many of the newest checkpoints are kept (``None``: all)."""
        return self._max_to_keep

    def save(self, checkpoint_number: int | None = None) -> str:
        """Starts writing checkpoint ``checkpoint_number`` (default: one above the newest and the checkpoint's
        ``save_counter``, which becomes that number) and returns its path; the older checkpoints beyond
        ``max_to_keep`` go once it is complete. Every process must call it (see the class); asynchronous
        as :meth:`Checkpoint.save`.
        """
        own = os.path.join(self._directory, self._name)
        saver = _saver(_agreed(own), self._max_to_keep)
        if checkpoint_number is None:
            checkpoint_number = max(self._checkpoint.save_counter, saver.latest_step() or 0) + 1
        check_int("checkpoint_number", checkpoint_number, 0)
        self._checkpoint.save_counter = checkpoint_number
        return self._checkpoint.write(os.path.join(own, str(checkpoint_number)))

    @property
    def checkpoints(self) -> list[str]:
        """The paths of the complete checkpoints kept, oldest first."""
        saver = self._reader()
        return [] if saver is None else [os.path.join(saver.directory, str(s)) for s in saver.all_steps()]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the newest complete checkpoint, or ``None`` when there is none."""
        found = self.checkpoints
        return found[-1] if found else None

    def restore_or_initialize(self) -> str | None:
        """Restores the newest good checkpoint into the checkpoint's objects and returns its directory, or
        ``None`` (and changes nothing) when there is none."""
        if self._reader() is None or not self.checkpoints:
            return None
        prefix = os.path.join(self._directory, self._name)
        self._checkpoint.restore(prefix)
        return self.latest_checkpoint

    def _reader(self) -> Checkpointer | None:
        """The saver of this manager's checkpoints (process 0's), or ``None`` when none was written yet."""
        prefix = _agreed(os.path.join(self._directory, self._name))
        if prefix not in _SAVERS and not os.path.isdir(prefix):
            return None
        return _saver(prefix, _ANY)

    def __repr__(self) -> str:
        return (f"CheckpointManager({os.path.join(self._directory, self._name)!r}, "
                f"max_to_keep={self._max_to_keep!r})")


def _agreed(directory: str) -> str:
    """Process 0's ``directory`` on every process of a job (``directory`` itself on one process)."""
    return process_0_directory(directory)[0] if "://" not in directory else directory


def _saver(directory: str, keep: Any) -> Checkpointer:
    """The directory's saver in this process: the one open, or a new one keeping ``keep`` newest
    checkpoints; one that keeps another number is closed first (its saves finished) and reopened."""
    saver = _SAVERS.get(directory)
    if saver is not None and (keep is _ANY or saver.keep == keep):
        return saver
    if saver is not None:
        saver.close()
    _SAVERS[directory] = Checkpointer(directory, keep=None if keep is _ANY else keep)
    return _SAVERS[directory]


def _write_tf_state(saver: Checkpointer) -> None:
    """Writes TF's ``checkpoint`` state file beside the saver's directory, naming it: ``tf.train.latest_checkpoint(
    dir)`` then returns that directory, which :meth:`Checkpoint.restore` takes (its newest good checkpoint), so a
    ported ``checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))`` runs unchanged.

    Written atomically (a temporary file, flushed, renamed), and only when it would change: a file naming the
    directory already is left alone, so a later save on a full disk never touches it, and a reader finds the
    old file or the new one, never a truncated one.

    Raises:
      CheckpointError: the file could not be written (a full disk); the save's own failure, when it failed
        too, is the one said.
    """
    prefix = saver.directory
    if jax.process_index() != 0 or "://" in prefix:
        return
    name = os.path.basename(prefix)
    path = os.path.join(os.path.dirname(prefix), "checkpoint")
    text = f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n'
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except (OSError, UnicodeDecodeError):
        pass
    try:
        write_atomic(path, text.encode())
    except OSError as exc:
        saver.wait()  # a save that failed too (the same full disk) is said first, in its own words
        raise CheckpointError(
            f"TF's checkpoint state file {path} could not be written: {short(exc)}; it is as it was (a reader "
            f"finds the checkpoints in {prefix} through it once it names them). Free space on that file system "
            "(or fix its permissions) and save again.") from None


def _input_shape(obj: Any) -> Any:
    try:
        return obj.input_shape
    except (AttributeError, ValueError):
        return None


def _sharding(value: Any) -> Any:
    if isinstance(value, jax.Array):
        return value.sharding
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
