"""One state on every process: values enter the replicated state from process 0, and stay equal.

In a multi-process job each process builds its own model, so anything a process takes from its host
(freshly initialised weights of an unseeded model, weights set with ``set_weights``/``load_weights``)
may differ between processes. Placed as "replicated", such values would give each process's devices a
different model, and the all-reduce would average the gradients of different models: a silent wrong
result. TF's ``MirroredVariable``, DDP and Horovod broadcast the initial state from one worker; so do we:
:func:`broadcast_from_primary` makes every process hold process 0's values, bit for bit.

:func:`check_replicas` is the cheap guard that this holds: a checksum per variable, computed on the
devices, compared across processes; it names the first variable that differs.

:func:`any_process` lets the processes agree on a host-side decision (did any process's model change?)
without a device collective, so it can be asked between dispatched steps without waiting for them.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import jax
import numpy as np

from mirrorax._host import host_value
from mirrorax.cluster.join import coordination_client
from mirrorax.cluster.watchdog import waiting_for_peers

__all__ = ["broadcast_from_primary", "broadcast_from", "any_process", "check_replicas", "ReplicaMismatchError",
           "debug_checks"]

PyTree = Any


class ReplicaMismatchError(RuntimeError):
    """Processes hold different values of what should be one replicated state."""


def debug_checks() -> bool:
    """``MIRRORAX_DEBUG=1``: extra consistency checks (replica digests every epoch, not only at start)."""
    return os.environ.get("MIRRORAX_DEBUG", "") not in ("", "0", "false", "False")


def _contiguous_host_copy(a: Any) -> np.ndarray:
    """``a`` as C-contiguous numpy (its raw bytes are sent as they lie)."""
    a = host_value(a)
    return a if a.flags.c_contiguous else a.copy(order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)


def broadcast_from_primary(tree: PyTree) -> PyTree:
    """``tree`` with process 0's values on every process (numpy leaves), bit for bit.

    Every process must call it with a tree of the same structure, shapes and dtypes. The leaves travel
    as their raw bytes in one buffer and one device collective, so every dtype (bool, integer, PRNG
    seeds, ``-0.0``, NaN payloads) arrives unchanged. On one process it returns ``tree`` as it is.

    Example:
      >>> weights = broadcast_from_primary({"w": np.random.normal(size=(3,))})  # the same on every process
    """
    return broadcast_from(tree, 0)


def broadcast_from(tree: PyTree, source: int) -> PyTree:
    """``tree`` with process ``source``'s values on every process, as :func:`broadcast_from_primary` (a
    restarted job's snapshot may be held by any process)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    host = [_contiguous_host_copy(a) for a in leaves]
    raw = np.concatenate([h.reshape(-1).view(np.uint8) for h in host] + [np.zeros(0, np.uint8)])
    padded = np.zeros(-(-raw.size // 4) * 4 or 4, np.uint8)
    padded[:raw.size] = raw
    # broadcast_one_to_all sums process 0's words with the others' zeros: exact for unsigned integers.
    words = np.asarray(multihost_utils.broadcast_one_to_all(padded.view(np.uint32),
                                                            is_source=jax.process_index() == source), np.uint32)
    data = words.view(np.uint8)
    out, offset = [], 0
    for h in host:
        size = h.nbytes
        out.append(data[offset:offset + size].copy().view(h.dtype).reshape(h.shape))
        offset += size
    return jax.tree.unflatten(treedef, out)


_round = itertools.count()
_previous_key: list[str] = []


def any_process(flag: bool, timeout_s: float = 300.0) -> bool:
    """True on every process when ``flag`` is True on at least one (every process must call it).

    Goes through JAX's coordination service (a key per process), not a device collective: it does not
    wait for the steps already dispatched, so the loop can ask it between steps.
    """
    if jax.process_count() == 1:
        return bool(flag)
    client = coordination_client()
    pid, n = jax.process_index(), jax.process_count()
    if client is None:  # a JAX whose client moved: a device collective (waits for the dispatched steps)
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.array([bool(flag)], np.int32))))
    r = next(_round)
    client.key_value_set(f"mirrorax/agree/{r}/{pid}", "1" if flag else "0")
    result = bool(flag)
    with waiting_for_peers():  # for mirrorax launch's watchdog: a rank late here is not the one stuck
        for other in range(n):
            if other != pid:
                value = client.blocking_key_value_get(f"mirrorax/agree/{r}/{other}", int(timeout_s * 1000))
                result = result or value == "1"
    # Every process has read round r-1's keys before it wrote round r's (it finished round r-1), and
    # we have read everyone's round r: this process's round r-1 key is no longer needed by anyone.
    for key in _previous_key:
        try:
            client.key_value_delete(key)
        except Exception:  # noqa: BLE001 - already gone; the store is cleaned at job end anyway
            pass
    _previous_key[:] = [f"mirrorax/agree/{r - 1}/{pid}"] if r > 0 else []
    return result


def check_replicas(state: PyTree, what: str = "training state") -> None:
    """Raises :class:`ReplicaMismatchError` naming the first variable whose value differs between processes.

    One checksum per variable (of this process's first copy), gathered across processes in one small
    transfer. Every process must call it. On one process it does nothing.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    checksums = _checksums(state)
    names = list(checksums)
    mine = np.asarray([checksums[n] for n in names], np.uint32).reshape(len(names), 2)
    every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, variables, 2)
    for i, name in enumerate(names):
        differs = [p for p in range(every.shape[0]) if not np.array_equal(every[p, i], every[0, i])]
        if differs:
            raise ReplicaMismatchError(
                f"The {what} differs between processes: variable {name!r} on process(es) {differs} does not "
                "equal process 0's. Every replica should hold process 0's values. This is a bug in how the "
                "values entered the state (please report it), or values were changed on some processes only "
                "behind mirrorax's back (e.g. a variable assigned directly on one process).")


#: A state whose replicated variables hold at most this many bytes on this process is checksummed on the host.
HOST_DIGEST_BYTES = 256 * 2**20


def _checksums(state: PyTree) -> dict[str, list[int]]:
    """:func:`mirrorax.integrity.digest`'s checksums of ``state``. The variables whose first copy is whole on this
    process are summed on the host when they are small (or live on CPU devices, where the host reads them in
    place): a fit's start in every process of a job compiled a digest program for them, seconds on a loaded CPU
    host (2.8 s of a restarted process's start, on the benchmark's CNN) for a megabyte of state. The others (split
    over processes) are summed on the devices, together."""
    from mirrorax._host import local_copy
    from mirrorax.integrity import HostDigest, digest, path_str

    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    # (A replicated variable of a multi-process job is not addressable as a whole: its copy on this process is.)
    copies = [(path_str(p), local_copy(x)) for p, x in flat]
    whole = {name: x for name, x in copies if not isinstance(x, jax.Array) or x.is_fully_addressable}
    size = sum(int(getattr(x, "nbytes", 0)) for x in whole.values())
    on_cpu = all(getattr(d, "platform", "") == "cpu" for x in whole.values() if isinstance(x, jax.Array)
                 for d in x.sharding.device_set)
    if size > HOST_DIGEST_BYTES and not on_cpu:
        return digest(state)[0]
    split = {path_str(p): x for p, x in flat if path_str(p) not in whole}
    checksums = HostDigest(whole).result()[0]
    if split:
        checksums.update(digest(split)[0])
    return {path_str(p): checksums[path_str(p)] for p, _ in flat}

