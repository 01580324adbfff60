"""A snapshot's bytes: copied off the devices, written by one thread per process, read back checksummed.

On disk, ``<directory>/<step>/`` holds ``state.bin`` (every leaf's raw bytes, each at a 64-byte boundary),
``index.json`` (each leaf's path, dtype, shape, offset and CRC-32) and ``meta.json``; it is written as
``<step>.tmp-<pid>`` and renamed when complete, so a killed writer leaves the previous snapshot whole.
Nothing in a snapshot is executable: bytes and JSON. See :mod:`mirrorax.checkpoint.snapshot` for the schedule and the
agreement between processes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mirrorax.cluster.restarts import DIR_ENV, LOST_ENV, SECONDS_ENV, STEPS_ENV, node_name
from mirrorax.integrity import path_str

__all__ = ["DIR_ENV", "SECONDS_ENV", "STEPS_ENV", "LOST_ENV", "node_name", "SnapshotError", "Writer", "writer",
           "on_one_device", "named_leaves", "write", "read", "complete_steps", "place", "stored_like", "key_impl",
           "REACHED_SECONDS"]

FORMAT = 1
STATE_FILE, INDEX_FILE, META_FILE = "state.bin", "index.json", "meta.json"
ALIGN = 64
REACHED_SECONDS = 0.2  # how often the writer records the newest step reached (for a restart's "steps lost")

PyTree = Any


class SnapshotError(RuntimeError):
    """A snapshot cannot be used: damaged, of another model, or the processes cannot agree on one."""


class Writer:
    """One thread per process: copies each snapshot to the host and writes it, one at a time (a new one waits
    for the one being written: at most two copies in memory), and records the newest step reached now and
    then (``reached[name] = (file, step)``: one dict store by the loop; written here when it changed)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=1)
        self.reached: dict[str, tuple[str, int]] = {}
        self.written: dict[str, int] = {}
        self.failure: BaseException | None = None
        threading.Thread(target=self._run, name="mirrorax-snapshots", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def wait(self) -> None:
        self.jobs.join()

    def _run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=REACHED_SECONDS)
            except queue.Empty:
                self._record_reached()
                continue
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - said by the next snapshot taken; training goes on
                self.failure = exc
            finally:
                self.jobs.task_done()
            self._record_reached()

    def _record_reached(self) -> None:
        for name, (path, step) in list(self.reached.items()):
            if self.written.get(name) != step:
                with contextlib.suppress(OSError):
                    _write_atomic(path, f"{step} {time.time():.3f}\n".encode())
                    self.written[name] = step


_writer: list[Writer] = []
_writer_lock = threading.Lock()


def writer() -> Writer:
    """The process's writer thread (started on first use, never more than one)."""
    with _writer_lock:
        if not _writer:
            _writer.append(Writer())
        return _writer[0]


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# -- on the devices ---------------------------------------------------------------------------------------------
def key_impl(leaf: Any) -> str | None:
    """The PRNG implementation of a typed key array (stored as its key data), else ``None``."""
    return str(jax.random.key_impl(leaf)) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else None


@jax.jit
def _copies(leaves: list[Any]) -> list[Any]:
    # A buffer of its own per leaf: the step after the snapshot is given the state's buffers (donated).
    return [jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else jnp.copy(a) for a in leaves]


@functools.lru_cache(maxsize=8)
def _gather(mesh: Any) -> Any:
    """The whole of split leaves on every device of ``mesh``: one program per mesh and signature, compiled once
    (a new function per snapshot would compile at each)."""
    return jax.jit(lambda xs: xs, out_shardings=NamedSharding(mesh, PartitionSpec()))


def on_one_device(leaves: list[Any], window: Any, copy: bool) -> list[Any]:
    """Each leaf's whole value on this process's first device of it, in buffers of their own, dispatched and
    not waited for: a replicated leaf's first copy; a split one (``shard=``) gathered first, a collective
    that every process runs (with ``copy`` False it copies nothing: a process that writes no snapshot).
    ``window``: the strategy's ``in_flight``, drained before the gather (the dispatch bound)."""
    split = [i for i, a in enumerate(leaves) if not a.is_fully_replicated]
    whole = list(leaves)
    if split:
        if window is not None:
            window.drain()
        gathered = _gather(leaves[split[0]].sharding.mesh)([leaves[i] for i in split])
        for i, a in zip(split, gathered):
            whole[i] = a
    return _copies([a.addressable_data(0) for a in whole]) if copy else []


def named_leaves(tree: PyTree) -> tuple[list[tuple[str, Any]], Any]:
    """``[(path, leaf)]`` of a pytree (paths as checkpoints name them) and its treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(p), leaf) for p, leaf in flat], treedef


def stored_like(a: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype a leaf is stored as (a typed key: its key data)."""
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, a)
        return tuple(data.shape), data.dtype
    return tuple(a.shape), a.dtype


def place(host: np.ndarray, like: Any, impl: str | None) -> Any:
    """``host`` laid out as ``like`` (a ``ShapeDtypeStruct`` with a sharding) says; a typed key (``impl``)
    from its data."""
    if impl is None:
        return jax.make_array_from_callback(host.shape, like.sharding, lambda idx: host[idx])
    sharding = like.sharding
    data = jax.make_array_from_callback(host.shape, NamedSharding(sharding.mesh, sharding.spec), lambda idx: host[idx])
    return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=sharding)(data)


# -- on disk --------------------------------------------------------------------------------------------------
def write(directory: str, step: int, arrays: list[Any], index: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Writes snapshot ``step`` into ``directory`` (waiting for each array's copy), then removes the older
    ones and what a killed writer left: the newest complete snapshot is all a node needs."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, str(step))
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    offset = 0
    with open(os.path.join(tmp, STATE_FILE), "wb") as f:
        for entry, a in zip(index, arrays):
            host = np.asarray(a)  # waits for this leaf's copy off the device
            host = host if host.flags.c_contiguous else np.ascontiguousarray(host)
            data = host.reshape(-1).view(np.uint8).data if host.size else memoryview(b"")
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(data)
            entry.update(offset=offset, nbytes=host.nbytes, crc32=zlib.crc32(data))
            offset += host.nbytes
    with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump({"format": FORMAT, "step": step, "leaves": index}, f)
    with open(os.path.join(tmp, META_FILE), "w") as f:
        json.dump(meta, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for name in os.listdir(directory):  # (one writer per node: a temporary directory here is a killed writer's)
        if name.isdigit() and int(name) < step or ".tmp-" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def complete_steps(directory: str) -> list[int]:
    """The complete snapshots in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted((int(n) for n in names if n.isdigit()), reverse=True)


def read(directory: str, step: int) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]], dict[str, Any]]:
    """Snapshot ``step``: its arrays and index entries by path, and its record (``meta.json``).

    Raises:
      SnapshotError: a file is missing or unreadable, or an array's bytes do not match their checksum.
    """
    where = os.path.join(directory, str(step))
    try:
        with open(os.path.join(where, INDEX_FILE)) as f:
            index = json.load(f)
        with open(os.path.join(where, META_FILE)) as f:
            record = json.load(f)
        state = os.path.join(where, STATE_FILE)
        # Mapped, not read: the processes of a node share the pages (a snapshot in /dev/shm is not copied).
        data = np.memmap(state, np.uint8, mode="r") if os.path.getsize(state) else np.zeros(0, np.uint8)
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"snapshot {where} cannot be read ({type(exc).__name__}: {exc})") from None
    arrays, entries = {}, {}
    for entry in index.get("leaves", []):
        raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
        if raw.size != entry["nbytes"] or zlib.crc32(raw.data) != entry["crc32"]:
            raise SnapshotError(f"snapshot {where}: the bytes of {entry['path']!r} do not match their checksum")
        arrays[entry["path"]] = raw.view(jnp.dtype(entry["dtype"])).reshape(entry["shape"])
        entries[entry["path"]] = entry
    return arrays, entries, record
