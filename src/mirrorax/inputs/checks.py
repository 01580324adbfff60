"""Checks of what users pass as data: numbers, finite values, weights, labels within the classes.

Each check names the argument (``x``, ``y['cls']``, ``sample_weight``), what it received, where (the
example's index) and how to fix it, and runs on the host before any update is applied.

The NaN/inf scan of the arrays (:class:`FiniteScan`) is the one check whose cost grows with the data
(24 ms for 60000 x 784 float32): for arrays of ``BACKGROUND_MIN_BYTES`` or more, ``fit`` runs it on
threads (one per core this process may use, started once per process and then kept idle), over row chunks
(numpy's reductions release the GIL), while the host builds the
state and plans the first step, and joins it before anything of the fit can change (see
:meth:`FiniteScan.wait`). An array whose
memory nothing can write (see :func:`immutable_place`) is scanned once: later fits and evaluations of it
find it in a cache. A writeable numpy array is scanned by every call: it may have changed in between.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["check_batch_size", "check_finite_values", "check_labels", "label_message", "to_numeric",
           "tree_numeric", "leaves", "check_weights", "batch_weights", "rows_shape",
           "is_nested_numbers", "FiniteScan", "BACKGROUND_MIN_BYTES", "immutable_place", "known_finite",
           "all_finite"]

BACKGROUND_MIN_BYTES = 1 << 22
"""Arrays of at least this many bytes (together) are scanned on a thread: about 1 ms of scan, well above
the cost of starting one (below it the scan runs at once, and a NaN is refused before anything is built)."""

CHUNK_BYTES = 1 << 25
"""Rows per chunk of a scan on threads: about 32 MiB (a few ms; smaller chunks cost measurably more
CPU time per byte), so the cores share the work."""


def check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer (the global batch, over all devices); "
                         f"received {batch_size!r}. Use e.g. batch_size=256.")
    return int(batch_size)


def to_numeric(a: Any, what: str, float_dtype: Any = np.float32) -> np.ndarray:
    """``a`` as a numeric numpy array; float32/float64 become ``float_dtype`` (the model's), as Keras's own
    data adapters cast floats to ``floatx``, and int64 becomes int32."""
    a = _composite_dense(a, what)
    if hasattr(a, "numpy") and not isinstance(a, np.ndarray):
        a = a.numpy()
    try:
        arr = np.asarray(a)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"{what} could not be made one array ({e}). Pass a rectangular array: pad ragged "
                         "rows to one length first.") from None
    if arr.dtype.kind == "c":
        raise TypeError(f"{what} must hold real numbers; received complex values (dtype {arr.dtype}, shape "
                        f"{arr.shape}). Pass np.real({what}), or the real and imaginary parts as separate "
                        "features.")
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
                                   or arr.dtype.kind == "V" and "float" in arr.dtype.name):
        raise TypeError(f"{what} must hold numbers; received an array of dtype {arr.dtype} (shape "
                        f"{arr.shape}). Convert it first, e.g. np.asarray({what}, dtype=np.float32), or "
                        "encode strings/categories as integers.")
    if arr.ndim == 0:
        raise ValueError(f"{what} must have a leading example axis; received a scalar {arr!r}.")
    if arr.dtype in (np.float32, np.float64) and arr.dtype != float_dtype:
        arr = arr.astype(float_dtype)
    elif arr.dtype == np.int64:
        info = np.iinfo(np.int32)
        if arr.size and (arr.max() > info.max or arr.min() < info.min):
            i = int(np.argmax((arr > info.max) | (arr < info.min)))
            raise ValueError(f"{what} holds {arr.flat[i]}, beyond int32, which is what integer inputs become on "
                             f"the devices; it would wrap around silently. Map the values onto a smaller range "
                             f"first (e.g. np.unique({what}, return_inverse=True)[1] for ids).")
        arr = arr.astype(np.int32)
    return arr


def _composite_dense(a: Any, what: str) -> Any:
    """``a`` as Keras's data adapters densify it for JAX: a pandas ``Series`` as one column (``(n, 1)``,
    Keras's ``PandasSeriesSliceable``), a ``tf.RaggedTensor`` whose rows are all one length as its dense
    tensor. A ragged tensor of varying lengths and a ``tf.SparseTensor`` are refused: Keras pads each batch
    of a ragged one to its own longest row (a new shape per batch) and hands JAX sparse batches, where
    mirrorax compiles one dense shape."""
    cls = type(a)
    if cls.__name__ == "Series" and cls.__module__.startswith("pandas"):
        return np.expand_dims(a.to_numpy(), -1)
    if "tensorflow.python." not in cls.__module__:
        return a
    if cls.__name__ == "RaggedTensor":
        dense = a.to_tensor()
        if int(np.prod(dense.shape)) == int(np.size(a.flat_values)):
            return dense
        raise ValueError(f"{what} is a tf.RaggedTensor whose rows have different lengths (shape {a.shape}). Keras "
                         "pads each batch to its own longest row, a new shape per batch; mirrorax compiles one "
                         f"shape. Pad every row to one length first: {what}.to_tensor() (or, for text, "
                         "TextVectorization(output_sequence_length=...)).")
    if cls.__name__ == "SparseTensor":
        raise TypeError(f"{what} is a tf.SparseTensor (shape {a.shape}); mirrorax feeds dense batches. Densify "
                        f"it first: tf.sparse.to_dense({what}).")
    return a


def tree_numeric(tree: Any, what: str, float_dtype: Any = np.float32) -> Any:
    if tree is None:
        return None
    if isinstance(tree, Mapping):
        return {k: tree_numeric(v, f"{what}[{k!r}]", float_dtype) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)) and not is_nested_numbers(tree):
        return type(tree)(tree_numeric(v, f"{what}[{i}]", float_dtype) for i, v in enumerate(tree))
    return to_numeric(tree, what, float_dtype)


def is_nested_numbers(x: Any) -> bool:
    """A (nested) Python list/tuple of plain numbers: one array written as lists (``[0, 2, 1]``), not a
    tuple of arrays."""
    while isinstance(x, (list, tuple)) and len(x) > 0:
        x = x[0]
    return isinstance(x, (int, float, bool, np.generic)) and not isinstance(x, np.ndarray)


def leaves(tree: Any, name: str) -> list[tuple[str, np.ndarray]]:
    """``(name, array)`` for every array of ``tree``: ``x``, ``x['a']``, ``x[1]``."""
    if tree is None:
        return []
    if isinstance(tree, Mapping):
        return [leaf for k, v in tree.items() for leaf in leaves(v, f"{name}[{k!r}]")]
    if isinstance(tree, (tuple, list)):
        return [leaf for i, v in enumerate(tree) for leaf in leaves(v, f"{name}[{i}]")]
    return [(name, tree)]


def _index_text(name: str, idx: Any) -> str:
    return f"{name}[{', '.join(str(int(i)) for i in idx)}]"


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of the float array ``a`` is finite: its sum is (NaN and inf propagate through
    it), in one pass with no temporary. (An overflowing sum of finite values reads as ``False``: the
    caller then searches.)"""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.sum(a)))


def check_finite_values(a: np.ndarray, what: str) -> None:
    """Refuses NaN/inf in a float array, naming the first one.

    A finite sum proves every value finite (NaN and inf propagate through it) in one pass with no
    temporary: 24 ms for 60000 x 784 float32 against 57 ms for ``np.isfinite``. Only a non-finite sum
    (a bad value, or an overflow) pays for the search, in row chunks.
    """
    if a.dtype.kind in "biu" or a.size == 0 or all_finite(a):
        return
    step = max(1, (1 << 22) // max(1, int(np.prod(a.shape[1:], dtype=np.int64))))
    for lo in range(0, a.shape[0], step):
        ok = np.isfinite(a[lo:lo + step])
        if not ok.all():
            idx = np.argwhere(~ok)[0]
            idx[0] += lo
            raise ValueError(
                f"{what} holds {a[tuple(idx)]} at {_index_text(what, idx)} (example {idx[0]}); fit and evaluate "
                f"refuse NaN and inf in x, y and sample_weight: one such value makes the loss, and then every "
                f"weight, non-finite. Fix or drop those examples first (keep = np.isfinite({what})"
                f".reshape(len({what}), -1).all(axis=1)), or pass Trainer(..., on_nonfinite='skip') to train on "
                f"and drop the steps they spoil.")


def immutable_place(a: np.ndarray) -> tuple[Any, tuple[Any, ...]] | None:
    """The object that owns ``a``'s memory and ``a``'s place in it, when nothing can write that memory;
    else ``None``.

    Immutable: a read-only array whose memory belongs to a ``bytes`` object (``np.frombuffer(b)``) or to a
    ``jax.Array`` (``np.asarray`` of a single-device array is a read-only view of its buffer). Not: a
    writeable array; a read-only array that owns its memory (``a.flags.writeable = True`` gives the
    writes back); a view of a read-only ``memoryview`` of a ``bytearray``; a memory-mapped file (another
    process may rewrite it). The weakly referenced object is the ``jax.Array`` (``np.asarray`` makes a new
    view per call), else ``a`` itself (it holds its ``bytes`` alive).
    """
    if a.flags.writeable:
        return None
    owner: Any = a
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    if isinstance(owner, memoryview):
        if not owner.readonly:
            return None
        owner = owner.obj
    if isinstance(owner, jax.Array):
        if owner.is_deleted():
            return None
        target: Any = owner
    elif type(owner) is bytes:
        target = a
    else:
        return None
    return target, (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)


# id(target) -> (weak reference to target, place): arrays found finite whose memory nothing can write.
_finite_places: dict[int, tuple[weakref.ref[Any], tuple[Any, ...]]] = {}
_finite_lock = threading.Lock()


def known_finite(a: np.ndarray) -> bool:
    """Whether ``a`` was scanned and found finite, and its memory cannot have changed since."""
    found = immutable_place(a)
    if found is None:
        return False
    target, place = found
    with _finite_lock:
        entry = _finite_places.get(id(target))
    return entry is not None and entry[0]() is target and entry[1] == place


def _remember_finite(a: np.ndarray) -> None:
    found = immutable_place(a)
    if found is None:
        return
    target, place = found
    key = id(target)

    def forget(ref: weakref.ref[Any]) -> None:
        with _finite_lock:
            if key in _finite_places and _finite_places[key][0] is ref:
                del _finite_places[key]

    with _finite_lock:
        _finite_places[key] = (weakref.ref(target, forget), place)


def _usable_cores() -> int:
    """The cores this process may run on (a TPU VM's container sees fewer than the host's ``cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (not Linux)
        return os.cpu_count() or 1


class _Scanners:
    """The scan's worker threads: started once per process (starting one per core at every ``fit`` call
    cost ~30 ms a call on a 13-core TPU host), idle on a queue between scans. A job is a callable each
    worker runs once; a fork leaves the child a fresh, empty set."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._count = 0

    def run(self, job: Any) -> int:
        """Hands ``job`` to every worker (starting them the first time); returns how many will run it."""
        with self._lock:
            while self._count < _usable_cores():
                threading.Thread(target=self._work, daemon=True, name="mirrorax-finite-scan").start()
                self._count += 1
            n = self._count
        for _ in range(n):
            self._jobs.put(job)
        return n

    def _work(self) -> None:
        while True:
            self._jobs.get()()


_scanners = _Scanners()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: globals().update(_scanners=_Scanners()))


class FiniteScan:
    """The NaN/inf scan (:func:`check_finite_values`) of named arrays, skipping those :func:`known_finite`.

    With ``background`` and at least ``BACKGROUND_MIN_BYTES`` to read, it runs on the process's scan threads
    (one per usable core, kept between scans; each sums row chunks of about ``CHUNK_BYTES``) and :meth:`wait`
    waits for them; a chunk whose sum
    is not finite sends its array to :func:`check_finite_values`, which finds the first bad value, so the
    error is the one a scan in one piece raises. Otherwise it runs in the constructor, which raises what
    it finds.

    Args:
      named: ``(name, array)`` pairs, as :func:`leaves` gives them.
      background: scan large arrays on a thread (the caller must :meth:`wait` before using the data).

    Raises:
      ValueError: (without ``background``, or for small arrays) a NaN or inf, named and placed.
    """

    def __init__(self, named: Sequence[tuple[str, np.ndarray]], *, background: bool = False) -> None:
        self._todo = [(n, a) for n, a in named if a.dtype.kind not in "biu" and a.size and not known_finite(a)]
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._finished.set()
        self._suspects: set[int] = set()  # indices into _todo of arrays with a chunk not finite
        if background and sum(a.nbytes for _, a in self._todo) >= BACKGROUND_MIN_BYTES:
            chunks = iter([(i, lo, lo + rows) for i, (_, a) in enumerate(self._todo)
                           for rows in [max(1, CHUNK_BYTES // max(1, a.nbytes // len(a)))]
                           for lo in range(0, len(a), rows)])
            lock = threading.Lock()
            self._finished.clear()
            running = [0]  # workers still on this job (set before any can finish)

            def job() -> None:
                self._sum_chunks(chunks, lock)
                with lock:
                    running[0] -= 1
                    if running[0] == 0:
                        self._finished.set()

            with lock:
                running[0] = _scanners.run(job)
        else:
            self._suspects = set(range(len(self._todo)))  # searched (and remembered) by wait, here
            self.wait()

    def _sum_chunks(self, chunks: Iterator[tuple[int, int, int]], lock: threading.Lock) -> None:
        try:
            while True:
                with lock:
                    i, lo, hi = next(chunks, (-1, 0, 0))
                if i < 0:
                    return
                if i not in self._suspects and not all_finite(self._todo[i][1][lo:hi]):
                    self._suspects.add(i)
        except BaseException as e:  # raised by wait(), in the caller's thread
            self._error = e

    @property
    def done(self) -> bool:
        """Whether the scan's threads have finished (:meth:`wait` then only searches a suspect array)."""
        return self._finished.is_set()

    def wait(self) -> None:
        """Joins the scan; raises the error it found (every time it is called)."""
        self._finished.wait()
        if self._error is None:
            try:
                for i, (name, a) in enumerate(self._todo):
                    if i in self._suspects:
                        check_finite_values(a, name)  # the first bad value, named (or an overflow: fine)
                    _remember_finite(a)
            except ValueError as e:
                self._error = e
            self._todo = []
        if self._error is not None:
            raise self._error


def check_labels(targets: Sequence[Any], note: str = "") -> None:
    """Refuses integer labels outside ``0..classes-1`` (and non-integer ones) of sparse cross-entropy
    targets.

    Args:
      targets: ``SparseTarget``s (name, labels, classes, ignore_class, loss) with host arrays.
      note: appended to the message (where the labels came from).
    """
    for t in targets:
        lab = np.asarray(t.labels)
        if lab.dtype.kind not in "biuf" or lab.size == 0:
            continue
        if lab.dtype.kind == "f":
            frac = lab != np.floor(lab)
            if t.ignore_class is not None:
                frac &= lab != t.ignore_class
            if frac.any():
                idx = np.argwhere(frac)[0]
                raise ValueError(
                    f"{t.name} holds the non-integer label {lab[tuple(idx)]} at {_index_text(t.name, idx)} "
                    f"(example {idx[0]}){note}; the loss {t.loss} takes integer class indices 0..{t.classes - 1} "
                    f"(it would truncate this one). Pass integer labels, or one-hot targets with "
                    f"loss='categorical_crossentropy'.")
        if lab.min() >= 0 and lab.max() < t.classes:
            continue
        bad = (lab < 0) | (lab >= t.classes)
        if t.ignore_class is not None:
            bad &= lab != t.ignore_class
        if not bad.any():
            continue
        idx = np.argwhere(bad)[0]
        raise ValueError(label_message(t.name, lab[tuple(idx)], t.classes, t.loss,
                                       f"at {_index_text(t.name, idx)} (example {idx[0]}){note}"))


def label_message(name: str, value: Any, classes: int, loss: str, where: str) -> str:
    value = float(value)
    shown = int(value) if value == int(value) else value
    binary = (" For two classes with one sigmoid unit, use loss='binary_crossentropy'." if classes == 1 else "")
    return (f"{name} holds the label {shown} {where}, but the model's output has {classes} units, so the loss "
            f"{loss} takes labels 0..{classes - 1} (JAX would silently score this one as no class). Give the "
            f"output layer as many units as there are classes (at least max(label) + 1), or map the labels "
            f"onto 0..{classes - 1} first, e.g. np.unique({name.split('[')[0]}, return_inverse=True)[1].{binary}")


def check_weights(sample_weight: Any, float_dtype: Any) -> np.ndarray:
    if isinstance(sample_weight, (Mapping, tuple, list)) and not is_nested_numbers(sample_weight):
        raise ValueError(f"sample_weight must be one array of one weight per example; received a "
                         f"{type(sample_weight).__name__} of them. Per-output sample weights are not supported: "
                         "weight the examples (shape (n,)), or weight the losses with compile(loss_weights=...).")
    w = _per_example(to_numeric(sample_weight, "sample_weight", float_dtype))
    if w.ndim != 1:
        raise ValueError(f"sample_weight must be one weight per example, of shape (n,) or (n, 1); received shape "
                         f"{w.shape}. Per-timestep weights are not supported: weight each example with one number.")
    if w.dtype.kind not in "f":
        w = w.astype(float_dtype)
    check_finite_values(w, "sample_weight")
    if (w < 0).any():
        i = int(np.argmax(w < 0))
        raise ValueError(f"sample_weight holds the negative weight {w[i]} at example {i}; weights must be >= 0 "
                         "(a negative weight maximises that example's loss). Use 0 to leave an example out.")
    return w


def rows_shape(shape: tuple[int, ...]) -> str:
    return "(rows" + "".join(f", {d}" for d in shape) + ("" if shape else ",") + ")"


def batch_weights(w: Any, n: int, index: int, float_dtype: Any) -> np.ndarray:
    w = _per_example(to_numeric(w, "sample_weight", float_dtype).astype(float_dtype))
    if w.shape != (n,):
        raise ValueError(f"Batch {index} of the input has sample_weight of shape {w.shape} for {n} examples; "
                         f"it must be ({n},): one weight per example.")
    return w


def _per_example(w: np.ndarray) -> np.ndarray:
    # Keras's losses align (n, 1) weights with (n,) per-example losses: the same weights.
    return w.reshape(-1) if w.ndim == 2 and w.shape[1] == 1 else w
