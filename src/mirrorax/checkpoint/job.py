"""What a checkpoint of a multi-process job needs of the job: process 0's word, and values Orbax can write.

**Process 0's word.** Every process of a job calls a checkpoint's save and restore together, and they
must write one directory. Process 0 says which, and whether it took the directory's lock
(:func:`from_process_0`), through JAX's coordination service (a key per call, in the order every
process makes the calls), not a device collective: a process 0 that refused or raised must not leave the
others waiting in a collective. When the processes name different directories (TF's ``write_filepath``
pattern: the chief writes ``ckpt/``, worker 1 ``workertemp_1/ckpt``), process 0's is the checkpoint, as
TF's chief's is; a process whose own differs says so once (:func:`process_0_directory`).

**Values Orbax can write.** In a job of several processes Orbax 0.12 writes global arrays only and
refuses an array that lives on one process's devices ("Cannot serialize host local jax.Array"): a Keras
variable made outside the strategy's scope, a step counter. Each process holds the same value of such an
array (one state on every process), so it is written as numpy from process 0 (:func:`savable`) and read
back onto the devices the variable lives on now (:func:`restorable`, :func:`placed_like`).
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import jax
import numpy as np

from mirrorax.checkpoint.dir_lock import DirectoryLocked, acquire
from mirrorax.checkpoint.errors import CheckpointError
from mirrorax.checkpoint.storage import check_writable, short
from mirrorax.cluster.join import coordination_client
from mirrorax.cluster.watchdog import waiting_for_peers

__all__ = ["AGREE_SECONDS", "from_process_0", "process_0_directory", "claim_directory", "savable", "restorable",
           "placed_like", "use_distributed_barriers"]

PyTree = Any

#: How long the other processes wait for process 0's word (its lock, its directory).
AGREE_SECONDS = 300
_rounds: dict[str, itertools.count[int]] = {}
_said: set[tuple[str, str]] = set()
_BROADCAST_BYTES = 8192


def from_process_0(topic: str, value: str) -> str:
    """Process 0's ``value`` on every process (process 0 gets its own back).

    Every process must call it with the same ``topic``, as often and in the same order. Through the
    coordination service's key-value store; on a JAX without a reachable client, a device broadcast of
    the value's bytes (at most 8 KiB).
    """
    round_ = next(_rounds.setdefault(topic, itertools.count()))
    client = coordination_client()
    if client is None:
        from jax.experimental import multihost_utils

        data = value.encode()[:_BROADCAST_BYTES].ljust(_BROADCAST_BYTES, b"\0")
        got = multihost_utils.broadcast_one_to_all(np.frombuffer(data, np.uint8))
        return bytes(np.asarray(got, np.uint8)).rstrip(b"\0").decode()
    key = f"mirrorax/{topic}/{round_}"
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value
    with waiting_for_peers():  # for mirrorax launch's watchdog: process 0 is the one to name if it hangs
        return str(client.blocking_key_value_get(key, AGREE_SECONDS * 1000))


def process_0_directory(directory: str, verdict: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Process 0's checkpoint directory and ``verdict`` (a JSON dict it decided, e.g. on the lock) on every
    process of a job; ``(directory, verdict)`` itself on one process.

    A process whose own ``directory`` differs prints once that the checkpoint goes to process 0's and
    nothing to its own (TF's workers write a throwaway copy to a path of their own: here the processes write
    one checkpoint together).
    """
    if jax.process_count() == 1:
        return directory, dict(verdict or {})
    said = json.loads(from_process_0("checkpoint_directory", json.dumps({"directory": directory,
                                                                          "verdict": verdict or {}})))
    chief = str(said["directory"])
    if chief != directory and (directory, chief) not in _said:
        _said.add((directory, chief))
        print(f"mirrorax: process {jax.process_index()} names checkpoint directory {directory}, process 0 "
              f"{chief}: every process writes the one checkpoint into process 0's (as TF's chief writes it), "
              f"and nothing is written to {directory}.", file=sys.stderr, flush=True)
    return chief, dict(said["verdict"])


def claim_directory(directory: str) -> tuple[str, bool]:
    """Proves a checkpoint directory writable and takes its lock, for the job: process 0 does both and tells
    the others its directory (the job's checkpoint, whatever directory they named) and whether it took the
    lock; a refusal is raised on every process, before any collective. Returns the job's directory and
    whether this process holds its lock.

    Raises:
      CheckpointError: the directory is not writable, or another live run holds it.
    """
    refusal: str | None = None
    failure: BaseException | None = None
    locked = False
    if jax.process_index() == 0:
        try:
            check_writable(directory)
            message = acquire(directory)
        except (CheckpointError, DirectoryLocked) as exc:
            refusal, failure = str(exc), exc
        except OSError as exc:  # the lock's own write (a disk that filled up since the probe)
            refusal = (f"Cannot take the lock of checkpoint directory {directory}: {short(exc)}. Free space on "
                       "that file system (or fix its permissions) and run again.")
        else:
            locked = True
            if message:
                print(f"mirrorax: {message}", file=sys.stderr, flush=True)
    if jax.process_count() > 1:
        directory, verdict = process_0_directory(directory, {"refusal": refusal})
        refusal = verdict.get("refusal")
        if refusal is None and jax.process_index() != 0:
            check_writable(directory)  # this process writes its shards there too
    if isinstance(failure, CheckpointError):
        raise failure
    if refusal is not None:
        raise CheckpointError(refusal)
    return directory, locked


def _host_local(a: Any) -> bool:
    return isinstance(a, jax.Array) and jax.process_count() > 1 and a.is_fully_addressable


def savable(tree: PyTree) -> PyTree:
    """``tree`` with every array of one process's devices as numpy, in a job of several processes (Orbax
    writes numpy from process 0); ``tree`` itself on one process."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(lambda a: np.asarray(a) if _host_local(a) else a, tree)


def _local_sharding(leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return jax.process_count() > 1 and sharding is not None and sharding.is_fully_addressable


def restorable(abstract: PyTree) -> PyTree:
    """The tree Orbax restores for ``abstract``: a leaf laid out on one process's devices is read as
    numpy (Orbax places global arrays only); ``abstract`` itself on one process."""
    if jax.process_count() == 1:
        return abstract
    return jax.tree.map(lambda a: np.empty(a.shape, a.dtype) if _local_sharding(a) else a, abstract)


def placed_like(restored: PyTree, abstract: PyTree) -> PyTree:
    """``restored`` with each leaf :func:`restorable` read as numpy put back on its leaf's devices."""
    if jax.process_count() == 1:
        return restored
    return jax.tree.map(lambda r, a: jax.device_put(r, a.sharding) if _local_sharding(a) else r, restored, abstract)


def use_distributed_barriers() -> None:
    """Makes Orbax synchronise processes through JAX's coordination service, not device collectives.

    By default Orbax 0.12's barrier is ``sync_global_devices``, a collective over every device. An
    asynchronous save reaches it from a background thread, at a moment that differs between processes,
    so one process's barrier meets another's train-step all-reduce: gloo aborts ("Received data size
    doesn't match expected size ... collective mismatch"). The coordination service's barrier involves
    no device, so training collectives stay in step. (Orbax reads the flag through absl; an unparsed
    flag set is marked parsed, which changes nothing for a program that parses its own flags later.)
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    # absl's stub types a flag attribute as the flag's declared value type, which it cannot know here.
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True  # type: ignore[assignment]

