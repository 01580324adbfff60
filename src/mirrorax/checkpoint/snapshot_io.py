"""A snapshot's bytes: copied off the devices, written by one thread per process, read back verified.

On disk, ``<directory>/<step>/`` holds ``state.bin`` (every leaf's raw bytes, each at a 64-byte boundary),
``index.json`` (the format, the step, each leaf's path, dtype, shape, offset, size and CRC-32), ``meta.json``
(the record: the step, the caller's meta, the job that took it, the group of processes) and ``digest.json``
(the SHA-256 of the two JSON files). It is written as ``<step>.tmp-<pid>``, every file flushed to the device,
then renamed: a killed writer leaves the previous snapshots whole, and a write that fails (a full disk)
removes its temporary directory. A node keeps its newest ``keep`` complete snapshots (2: a damaged newest
one falls back to the one before).

Read back (:func:`read`), a snapshot is used only when everything holds: the JSON files against their
digest (a flipped bit in a position, a shape, an offset), the index's own sense (the step of its directory,
number dtypes only, sizes that match shapes and fit the file), each array's bytes against its CRC-32, and
the caller's check of the record (a fit's position against its step). Anything else is a
:class:`SnapshotError` naming the snapshot and what was wrong. Nothing in a snapshot is executable: bytes
(memory-mapped) and JSON. See :mod:`mirrorax.checkpoint.snapshot` for the schedule and the agreement
between processes.

**The newest step reached** (what a restart's "steps lost" counts from) is noted by the loop at every step
into a 32-byte file mapped into memory (:class:`Reached`): a store, no system call; the page outlives a
killed process, so the note is exact whatever the writer thread is doing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import os
import queue
import re
import shutil
import socket
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mirrorax.checkpoint.dir_lock import alive
from mirrorax.checkpoint.errors import SnapshotError
from mirrorax.checkpoint.record import Verify, meta_digest
from mirrorax.checkpoint.storage import sync_directory, write_atomic
from mirrorax.cluster.restarts import DIR_ENV, LOST_ENV, SECONDS_ENV, STEPS_ENV, node_name
from mirrorax.cluster.watchdog import LAUNCHER_PID_ENV
from mirrorax.integrity import path_str

__all__ = ["DIR_ENV", "SECONDS_ENV", "STEPS_ENV", "LOST_ENV", "node_name", "SnapshotError", "Writer", "writer",
           "Reached", "on_one_device", "named_leaves", "write", "read", "complete_steps", "place", "stored_like",
           "key_impl", "FORMAT", "job_key", "other_jobs", "move_aside", "claim_launch_dir"]

FORMAT = 2  # 1: no digest of the JSON files (read by no mirrorax since)
STATE_FILE, INDEX_FILE, META_FILE, DIGEST_FILE = "state.bin", "index.json", "meta.json", "digest.json"
ALIGN = 64
DAMAGED = ".damaged"  # a snapshot moved aside: <step>.damaged

PyTree = Any


class Writer:
    """One thread per process: copies each snapshot to the host and writes it, one at a time (a new one waits
    for the one being written: at most two copies in memory)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=1)
        self.failure: BaseException | None = None
        threading.Thread(target=self._run, name="mirrorax-snapshots", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def wait(self) -> None:
        self.jobs.join()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - said by the next snapshot taken; training goes on
                self.failure = exc
            finally:
                self.jobs.task_done()


_writer: list[Writer] = []
_writer_lock = threading.Lock()


def writer() -> Writer:
    """The process's writer thread (started on first use, never more than one)."""
    with _writer_lock:
        if not _writer:
            _writer.append(Writer())
        return _writer[0]


class Reached:
    """The newest step a job reached, noted at every step in ``path``, a file of two 16-byte slots mapped into
    memory: each note writes ``(step, step ^ CHECK)`` into the other slot than the last, so a process killed in
    the middle of a note leaves the slot before it whole; :meth:`read` takes the newest whole slot."""

    SIZE, CHECK = 32, 0x5EED5EED5EED5EED

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < self.SIZE:
                os.ftruncate(fd, self.SIZE)
            self._map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)
        self._slot = 0

    def note(self, step: int) -> None:
        struct.pack_into("<qq", self._map, 16 * self._slot, step, step ^ self.CHECK)
        self._slot ^= 1

    @classmethod
    def read(cls, path: str) -> int:
        """The newest step noted in ``path`` (``-1``: none, or no such file)."""
        try:
            with open(path, "rb") as f:
                data = f.read(cls.SIZE)
        except OSError:
            return -1
        steps = [a for a, b in (struct.unpack_from("<qq", data, o) for o in (0, 16) if len(data) >= o + 16)
                 if b == a ^ cls.CHECK]
        return max(steps, default=-1)


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


# -- whose ------------------------------------------------------------------------------------------------------
def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def job_key(job: dict[str, Any] | None) -> str:
    """The suffix of a job's snapshot directory: 12 hex digits of its identity's SHA-256 (``""``: no identity)."""
    return "" if job is None else meta_digest(job)[:12]


def other_jobs(node_dir: str, name: str, mine: str) -> list[tuple[str, dict[str, Any]]]:
    """The other jobs' snapshot directories of run ``name`` in ``node_dir`` (``<name>`` and ``<name>-<key>``
    but ``mine``) that hold a snapshot, with the identity their newest one names (``{}``: none)."""
    try:
        names = sorted(os.listdir(node_dir))
    except OSError:
        return []
    found = []
    for entry in names:
        where = os.path.join(node_dir, entry)
        if where == mine or not (entry == name or entry.startswith(f"{name}-")) or not os.path.isdir(where):
            continue
        for step in complete_steps(where)[:1]:
            try:
                with open(os.path.join(where, str(step), META_FILE)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                record = {}
            job = record.get("job") if isinstance(record, dict) else None
            found.append((where, job if isinstance(job, dict) else {}))
    return found


# -- on disk --------------------------------------------------------------------------------------------------
def write(directory: str, step: int, arrays: list[Any], index: list[dict[str, Any]], record: dict[str, Any],
          keep: int = 2) -> None:
    """Writes snapshot ``step`` into ``directory`` (waiting for each array's copy), then removes the snapshots
    older than the newest ``keep`` and what a killed writer left. A write that fails leaves nothing of itself.

    Raises:
      OSError: the write failed (a full disk, a bad path); the snapshots before it are as they were.
    """
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, str(step))
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
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
            f.flush()
            os.fsync(f.fileno())
        texts = {INDEX_FILE: _canonical({"format": FORMAT, "step": step, "leaves": index}),
                 META_FILE: _canonical(record)}
        texts[DIGEST_FILE] = _canonical({name: hashlib.sha256(text).hexdigest() for name, text in texts.items()})
        for name, text in texts.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        sync_directory(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync_directory(directory)
    kept = complete_steps(directory)[:keep]
    for name in os.listdir(directory):  # (one writer per node: a temporary directory here is a killed writer's)
        if (name.isdigit() and int(name) not in kept) or ".tmp-" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def complete_steps(directory: str) -> list[int]:
    """The complete snapshots in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted((int(n) for n in names if n.isdigit()), reverse=True)


def read(directory: str, step: int, verify: Verify | None = None
         ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]], dict[str, Any]]:
    """Snapshot ``step``, verified (see the module): its arrays and index entries by path, and its record.

    Raises:
      SnapshotError: a file is missing or unreadable, or anything of it fails its check (the message says
        which).
    """
    where = os.path.join(directory, str(step))
    try:
        texts = {}
        for name in (INDEX_FILE, META_FILE, DIGEST_FILE):
            with open(os.path.join(where, name), "rb") as f:
                texts[name] = f.read()
        state = os.path.join(where, STATE_FILE)
        size = os.path.getsize(state)
        # Mapped, not read: the processes of a node share the pages (a snapshot in /dev/shm is not copied).
        data = np.memmap(state, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        digests = json.loads(texts[DIGEST_FILE])
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"snapshot {where} cannot be read ({type(exc).__name__}: {exc})") from None
    for name in (INDEX_FILE, META_FILE):
        if not isinstance(digests, dict) or digests.get(name) != hashlib.sha256(texts[name]).hexdigest():
            raise SnapshotError(f"snapshot {where}: its {name} does not match its digest (corrupted or edited)")
    index, record = json.loads(texts[INDEX_FILE]), json.loads(texts[META_FILE])
    wrong = _index_wrong(index, step, size) or _record_wrong(record, step)
    if wrong is None and verify is not None:
        wrong = verify(record["meta"], step)
    if wrong is not None:
        raise SnapshotError(f"snapshot {where}: {wrong}")
    arrays, entries = {}, {}
    for entry in index["leaves"]:
        raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
        if zlib.crc32(raw.data) != entry["crc32"]:
            raise SnapshotError(f"snapshot {where}: the bytes of {entry['path']!r} do not match their checksum")
        arrays[entry["path"]] = raw.view(jnp.dtype(entry["dtype"])).reshape(entry["shape"])
        entries[entry["path"]] = entry
    return arrays, entries, record


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _index_wrong(index: Any, step: int, size: int) -> str | None:
    """Why an index (its digest verified) cannot be read into arrays, or ``None``: only number dtypes are
    read, each array's bytes inside the file, as many as its shape says."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        got = index.get("format") if isinstance(index, dict) else None
        return f"its index is of snapshot format {got!r}; this mirrorax reads format {FORMAT}"
    if index.get("step") != step:
        return f"its index is of step {index.get('step')!r}, its directory step {step}"
    leaves = index.get("leaves")
    if not isinstance(leaves, list):
        return "its index lists no leaves"
    for entry in leaves:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            return f"its index holds an entry without a path ({entry!r:.80})"
        path, shape = entry["path"], entry.get("shape")
        try:
            dtype = jnp.dtype(entry.get("dtype"))
        except (TypeError, ValueError):
            return f"variable {path!r} has dtype {entry.get('dtype')!r}, not a dtype"
        if dtype.hasobject or not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
            return f"variable {path!r} has dtype {entry.get('dtype')!r}: only number and bool arrays are read"
        if not isinstance(shape, list) or not all(_int(d) for d in shape):
            return f"variable {path!r} has shape {shape!r}, not a list of sizes"
        if not all(_int(entry.get(k)) for k in ("offset", "nbytes", "crc32")):
            return f"variable {path!r} has no offset, size or checksum"
        if entry["nbytes"] != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            return f"variable {path!r} is {entry['nbytes']} bytes, not the {shape} x {dtype.itemsize} its shape says"
        if entry["offset"] + entry["nbytes"] > size:
            return f"variable {path!r} ends at byte {entry['offset'] + entry['nbytes']} of a {size}-byte file"
    return None


def _record_wrong(record: Any, step: int) -> str | None:
    """Why a snapshot's record (its digest verified) is not one of step ``step``, or ``None``."""
    if not isinstance(record, dict) or not isinstance(record.get("meta"), dict):
        return "its record is not a JSON object with a meta record"
    if record.get("step") != step:
        return f"its record is of step {record.get('step')!r}, its directory step {step}"
    return None


def move_aside(directory: str, step: int) -> str:
    """Moves damaged snapshot ``step`` to ``<step>.damaged`` (out of the complete ones); returns where."""
    target = os.path.join(directory, f"{step}{DAMAGED}")
    with contextlib.suppress(OSError):
        shutil.rmtree(target, ignore_errors=True)
        os.replace(os.path.join(directory, str(step)), target)
    return target


# The folder ``mirrorax launch`` makes for a launch's snapshots (``tempfile.mkdtemp(prefix=...)``), and its mark.
_LAUNCH_DIR = re.compile(r"mirrorax-snapshots-[A-Za-z0-9_]{8}")
LAUNCHER_FILE = "launcher.json"
_claimed: set[str] = set()


def claim_launch_dir(base: str) -> None:
    """Marks a launch's snapshot folder with its launcher, and removes the folders of this host's launchers that
    died without removing theirs.

    ``mirrorax launch`` makes ``<tmp>/mirrorax-snapshots-XXXXXXXX`` for a launch and removes it when it ends; a
    launcher killed with SIGKILL (its children die with it) never does, and each such launch left its snapshots
    behind. Its processes (the launcher's pid in ``MIRRORAX_LAUNCHER_PID``) write ``launcher.json`` (host, pid)
    into it; the next launch's processes remove every such folder of this host whose launcher is gone. Only
    folders of that form in the temporary directory, marked so: nothing a user named. Once per process and
    folder; best effort.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    base = os.path.abspath(base)
    parent = os.path.dirname(base)
    if base in _claimed or not launcher.isdigit() or not _LAUNCH_DIR.fullmatch(os.path.basename(base)) or \
            parent != os.path.abspath(tempfile.gettempdir()):
        return
    _claimed.add(base)
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        write_atomic(os.path.join(base, LAUNCHER_FILE), _canonical({"host": host, "pid": int(launcher)}))
    for name in os.listdir(parent):
        other = os.path.join(parent, name)
        if other == base or not _LAUNCH_DIR.fullmatch(name):
            continue
        try:
            with open(os.path.join(other, LAUNCHER_FILE)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # not marked (or not a launch's): left alone
        pid = owner.get("pid") if isinstance(owner, dict) else None
        if owner.get("host") == host and isinstance(pid, int) and pid != int(launcher) and not alive(pid):
            shutil.rmtree(other, ignore_errors=True)
