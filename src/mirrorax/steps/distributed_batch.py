"""One global batch on the devices, and its pieces however the user holds them.

A :class:`DistributedBatch` is what iterating ``strategy.experimental_distribute_dataset`` gives: the item's
own structure (``(x, y)``, a dict, ...) as global ``jax.Array`` s split over the batch axis, padded to one
fixed shape, with a ``mask`` (1.0 for a real row, 0.0 for padding) and ``num_real``. A step in the global
view (``strategy.jit``) is given it cut to its real rows; per replica (``strategy.run``) its padding stays,
masked.

**Pieces.** Users unpack batches: ``for x, y in dist``, ``images, labels = batch``, ``batch["image"]``, a
dataset of one array whose batches are that array. Each of those arrays is a *piece* of its batch: a plain
``jax.Array`` (every method and ``jnp`` function works), remembered here by identity while it lives when its
batch holds padding (:func:`remember_pieces`). When pieces reach a step, :func:`gather_pieces` takes them
out of the arguments and puts back one :class:`DistributedBatch` per batch they came from (a *stub*: the
pieces given, the batch's mask and count), each piece's place marked; the step is then given each piece cut
to the real rows as the whole batch would be (:func:`unpieced`), and the stub is the step's batch for
``mx.compute_average_loss``, Keras metrics and the padding checks. An array computed from a piece outside
the step (``x / 255``) is no piece; it is taken as one of its batch when a piece of that batch is among the
same arguments and it has the batch's placed rows and layout (row-wise work keeps the rows aligned);
without such a piece it is named by :func:`stray_arrays` (the caller warns).

A full batch's pieces need nothing (a full batch is its real rows), so only padded batches are remembered:
a loop over full batches pays nothing per call. On one device of one process a batch's data is the host's
numpy arrays, never padded (:mod:`mirrorax.inputs.distributed`): no piece at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DistributedBatch", "remember_pieces", "padded_pieces_alive", "gather_pieces", "Pieces", "unpieced",
           "restore_pieces", "piece_of", "is_batch", "host_batches"]

PyTree = Any


def is_batch(x: Any) -> bool:
    """Whether ``x`` is a :class:`DistributedBatch` (duck-typed: its mask, count and data)."""
    return hasattr(x, "mask") and hasattr(x, "num_real") and hasattr(x, "data")


class DistributedBatch:
    """One global batch on the devices; unpacks as its data does (``images, labels = batch``), as TF's do.

    Attributes:
      data: the item's own structure (e.g. ``(x, y)``) as global ``jax.Array`` s split over the batch axis,
        every leaf with the same fixed number of rows (the global batch rounded up to the device count); on one
        device of one process the host's numpy arrays of the batch's real rows.
      mask: float32 ``(rows,)``: 1.0 for a real example, 0.0 for a padding row.
      num_real: a replicated float32 scalar: the real examples of the whole global batch.
      padded: whether this process's rows hold padding (known on the host, with no device read;
        ``None`` for a batch rebuilt from its leaves).
      rows: the real rows of the global batch as a Python int, its padding at its end, when the host knows
        them (arrays, iterables of global batches); ``None`` where only the devices know the count
        (per-process pipelines on several processes). Static: part of the batch's tree structure, so a
        step compiles once per count (the full batches, the short last one), as for a shape.

    Iterating, indexing, ``len`` and attributes the batch does not have go to ``data`` (``x, y = batch``,
    ``batch["image"]``, ``batch.image`` of a named tuple): each array so taken is a piece of the batch that
    still knows its real rows in a step. The batch itself (a pytree of ``data``, ``mask`` and ``num_real``)
    is what :func:`mirrorax.compute_average_loss` takes to leave the padding out.
    """

    __slots__ = ("data", "mask", "num_real", "padded", "rows")

    def __init__(self, data: PyTree, mask: jax.Array, num_real: jax.Array, padded: bool | None = None,
                 rows: int | None = None) -> None:
        self.data = data
        self.mask = mask
        self.num_real = num_real
        self.padded = padded
        self.rows = rows

    @property
    def has_padding(self) -> bool:
        """Whether the global batch may hold padding rows, the same answer on every process: its real rows
        are fewer than its rows, or only the devices know how many are real."""
        return self.rows is None or self.rows < np.shape(self.mask)[0]

    def real_rows_only(self, sharding: jax.sharding.Sharding) -> DistributedBatch:
        """The batch cut to its :attr:`rows` real rows, inside a traced step (the global view); itself when
        the count is unknown (``rows is None``).

        Each leaf keeps its first ``rows`` rows, split over the batch axis again (XLA splits a count that
        the devices do not divide unevenly itself); the mask becomes ones and ``num_real`` the count, both
        constants that XLA folds away.
        """
        n = self.rows
        if n is None:
            return self

        def cut(a: Any) -> Any:
            return jax.lax.with_sharding_constraint(a[:n], sharding)

        return DistributedBatch(jax.tree.map(cut, self.data), jnp.ones((n,), jnp.result_type(self.mask)),
                                jnp.asarray(n, jnp.float32), padded=False, rows=n)

    def keep_padding(self) -> DistributedBatch:
        """The same arrays without the static count (``rows=None``): the form ``strategy.run`` hands its
        replicas, whose rows must be as many on each; one program then serves every row count."""
        if self.rows is None:
            return self
        return DistributedBatch(self.data, self.mask, self.num_real, self.padded)

    def __jax_array__(self) -> jax.Array:
        """The batch's data as one array, as ``jnp.array(batch)`` and ``jnp.asarray(batch)`` make it: an array
        itself, a list of equal arrays stacked on a new leading axis (the JAX AI stack's miniGPT makes its
        tokens so from a grain batch of lists: ``jnp.array(batch).T``). Computed on the devices in one program,
        the rows still split over the batch axis (numpy's conversion, the fallback without this, copies every
        array to the host and back whole, replicated)."""
        if isinstance(self.data, jax.Array):
            return self.data
        if not isinstance(self.data, (list, tuple)):
            raise TypeError(f"jnp.array received a DistributedBatch whose data is a {type(self.data).__name__}; it "
                            "makes one array of an array or a list/tuple of equal arrays. Take the entries first "
                            "(e.g. jnp.array(batch['image'])).")
        return _as_array(self.data)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)

    def __getitem__(self, index: Any) -> Any:
        return self.data[index]

    def __len__(self) -> int:
        return len(self.data)

    def __getattr__(self, name: str) -> Any:
        # Only for names the batch lacks: a named tuple's or a dataclass's fields (``batch.image``).
        if name.startswith("__") or name in DistributedBatch.__slots__:
            raise AttributeError(name)
        data = object.__getattribute__(self, "data")
        try:
            return getattr(data, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}, and neither has its data (of "
                                 f"type {type(data).__name__}). A batch holds data, mask, num_real, padded and "
                                 "rows; its data's entries are reached by unpacking (x, y = batch), indexing "
                                 "(batch['image']) or its data's own attributes.") from None

    def __repr__(self) -> str:
        rows = "" if self.rows is None else f", rows={self.rows}"
        return f"DistributedBatch(data={self.data!r}, mask={self.mask!r}, num_real={self.num_real!r}{rows})"


_as_array = jax.jit(lambda data: jnp.array(data))  # (one program per structure: a list of 256 pieces, one call)


jax.tree_util.register_pytree_with_keys(
    DistributedBatch,
    lambda b: (((jax.tree_util.GetAttrKey("data"), b.data), (jax.tree_util.GetAttrKey("mask"), b.mask),
                (jax.tree_util.GetAttrKey("num_real"), b.num_real)), b.rows),
    lambda rows, children: DistributedBatch(*children, rows=rows),  # type: ignore[misc]  # (data, mask, num_real)
    flatten_func=lambda b: ((b.data, b.mask, b.num_real), b.rows))


# -- pieces -----------------------------------------------------------------------------------------------
class _Record:
    """What the pieces of one batch share (never its data: a piece's life is its own)."""

    __slots__ = ("mask", "num_real", "padded", "rows", "placed", "full")

    def __init__(self, batch: DistributedBatch) -> None:
        self.mask, self.num_real, self.padded, self.rows = batch.mask, batch.num_real, batch.padded, batch.rows
        self.placed = int(np.shape(batch.mask)[0])  # the rows every leaf is placed with
        self.full = not batch.has_padding


class _PieceRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a piece that knows the piece's key (its ``id`` while it lived)."""

    __slots__ = ("key",)
    key: int


# id(piece) -> (a weak reference to the piece, its batch's record); an entry leaves with its piece.
_PIECES: dict[int, tuple[_PieceRef, _Record]] = {}
_padded = [0]  # how many pieces of padded batches live


def _forget(ref: _PieceRef) -> None:
    entry = _PIECES.get(ref.key)
    if entry is not None and entry[0] is ref:
        del _PIECES[ref.key]
        if not entry[1].full:
            _padded[0] -= 1


def remember_pieces(batch: DistributedBatch, record: _Record | None = None) -> _Record:
    """Remembers each array of ``batch.data`` as a piece of ``batch`` while it lives, and returns the record its
    pieces share. A full batch's pieces need nothing in a step (they are its real rows); they are remembered so
    that an array computed from them is not taken for one of a padded batch's. ``record``: one made for an
    earlier batch with the same mask, count and rows (a loop's full batches share it)."""
    if record is None:
        record = _Record(batch)
    full = record.full
    for leaf in jax.tree.leaves(batch.data):
        key = id(leaf)
        old = _PIECES.get(key)
        if old is not None and not old[1].full:  # (an array given again, as another batch's piece)
            _padded[0] -= 1
        ref = _PieceRef(leaf, _forget)
        ref.key = key
        _PIECES[key] = (ref, record)
        if not full:
            _padded[0] += 1
    return record


def padded_pieces_alive() -> bool:
    """Whether any piece of a padded batch lives (a call can hold one only then)."""
    return _padded[0] > 0


def piece_of(a: Any) -> _Record | None:
    """The record of the batch ``a`` is a piece of (``.full``: the batch holds no padding), or ``None``."""
    entry = _PIECES.get(id(a))
    return entry[1] if entry is not None and entry[0]() is a else None


class _Piece:
    """A piece's place among a step's arguments (a pytree node with no leaves): its batch, its position."""

    __slots__ = ("group", "index")

    def __init__(self, group: int, index: int) -> None:
        self.group, self.index = group, index

    def __repr__(self) -> str:
        return f"_Piece({self.group}, {self.index})"


jax.tree_util.register_pytree_node(_Piece, lambda p: ((), (p.group, p.index)), lambda aux, _: _Piece(*aux))


def _is_piece(x: Any) -> bool:
    return isinstance(x, _Piece)


class Pieces:
    """The pieces among a call's arguments: ``stubs`` (one :class:`DistributedBatch` per batch they came
    from, its data the tuple of those pieces) and ``args``, the arguments with each piece's place marked;
    ``stray``: paths of arrays with a padded batch's rows that are no piece of it (see :func:`gather_pieces`)."""

    __slots__ = ("stubs", "args", "stray")

    def __init__(self, stubs: tuple[DistributedBatch, ...], args: tuple[Any, ...], stray: list[str]) -> None:
        self.stubs, self.args, self.stray = stubs, args, stray


def _like(a: Any, record: _Record, layout: Any) -> bool:
    """Whether ``a`` has the placed rows and the layout of ``record``'s pieces (``layout``: one's sharding)."""
    return (isinstance(a, jax.Array) and a.ndim > 0 and a.shape[0] == record.placed
            and (a.sharding is layout or a.sharding == layout))


def gather_pieces(args: tuple[Any, ...]) -> Pieces | None:
    """The pieces of padded batches among ``args`` (whole batches are left as they are), or ``None`` when
    there are none. An array with the placed rows and layout of the one batch whose pieces are there is
    taken as a piece of it too (computed from its pieces outside the step); one with the placed rows of a
    padded batch with a piece alive, split over a mesh axis, that joins no batch here is recorded in
    ``stray`` (with no piece at all, the result holds ``stray`` only: ``stubs`` empty)."""
    leaves, treedef = jax.tree.flatten(args, is_leaf=is_batch)
    groups: dict[int, int] = {}  # id(record) -> its index in found
    found: list[tuple[_Record, list[Any]]] = []
    places: dict[int, tuple[int, int]] = {}

    def join(i: int, leaf: Any, record: _Record) -> None:  # leaf i: a piece of record's batch
        k = groups.get(id(record))
        if k is None:
            k = groups[id(record)] = len(found)
            found.append((record, []))
        places[i] = (k, len(found[k][1]))
        found[k][1].append(leaf)

    for i, leaf in enumerate(leaves):
        record = piece_of(leaf)
        if record is not None:
            join(i, leaf, record)
    stray: list[int] = []
    alive: dict[int, bool] = {}  # rows of the batches with a piece alive -> whether all of them are padded
    records: dict[int, dict[int, _Record]] = {}  # rows -> the batches with a piece alive
    for _, r in list(_PIECES.values()):
        alive[r.placed] = alive.get(r.placed, True) and not r.full
        records.setdefault(r.placed, {})[id(r)] = r
    for i, leaf in enumerate(leaves):
        shape = getattr(leaf, "shape", None)
        if i in places or not shape or shape[0] not in alive or not isinstance(leaf, jax.Array):
            continue
        matches = [k for k, (record, pieces) in enumerate(found) if _like(leaf, record, pieces[0].sharding)]
        if len(matches) == 1:
            join(i, leaf, found[matches[0]][0])
        elif not matches and alive[shape[0]] and _split_rows(leaf):
            # Only padded batches of these rows live: it can be none but theirs. With one such batch alive it
            # is that batch's (computed from it in the loop: jnp.array(batch).T, x / 255); with several, it
            # cannot be told whose.
            same = records[shape[0]]
            if len(same) == 1:
                join(i, leaf, next(iter(same.values())))
            else:
                stray.append(i)
    names = _paths(args, stray) if stray else []
    padded = [k for k, (record, _) in enumerate(found) if not record.full]
    if not padded:
        return Pieces((), args, names) if names else None
    index = {k: j for j, k in enumerate(padded)}  # (a full batch's pieces stay as they are)
    stubs = tuple(DistributedBatch(tuple(found[k][1]), found[k][0].mask, found[k][0].num_real, found[k][0].padded,
                                   found[k][0].rows) for k in padded)
    marked = [(_Piece(index[places[i][0]], places[i][1]) if i in places and places[i][0] in index else leaf)
              for i, leaf in enumerate(leaves)]
    return Pieces(stubs, tuple(jax.tree.unflatten(treedef, marked)), names)


def _split_rows(a: jax.Array) -> bool:
    """Whether ``a``'s rows are split over a mesh axis, as a batch's are."""
    spec = getattr(a.sharding, "spec", None)
    return spec is not None and len(spec) > 0 and spec[0] is not None


def _paths(args: tuple[Any, ...], indices: list[int]) -> list[str]:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_batch)[0]]
    return [f"argument{paths[i]}" for i in indices]


def restore_pieces(stubs: tuple[DistributedBatch, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` (:class:`Pieces`' marked ones) with each marked place given the piece it held, taken from its
    stub in ``stubs``."""
    return tuple(jax.tree.map(lambda x: stubs[x.group].data[x.index] if _is_piece(x) else x, args,
                              is_leaf=_is_piece))


def unpieced(fn: Any) -> Any:
    """``fn`` as a function of ``(stubs, *args)`` (a :class:`Pieces`' fields): each marked place of ``args``
    given the piece it held, taken from its stub (inside a step: the stub as the step sees it, e.g. cut to
    its real rows)."""
    def run(stubs: tuple[DistributedBatch, ...], *args: Any) -> Any:
        return fn(*restore_pieces(stubs, args))

    run.__name__ = getattr(fn, "__name__", "fn")
    run.__qualname__ = getattr(fn, "__qualname__", run.__name__)
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def host_batches(args: tuple[Any, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """What is almost certainly a global batch given whole among a step's positional arguments, not split over
    the devices: host arrays (numpy, TensorFlow or torch tensors) or ``jax.Array`` s laid out whole on each
    device (a ``jnp`` array, a replicated one) of more than one row, at least two with the same leading axis
    and one of them with more axes, either among the arguments themselves (``step(model, x, y)``) or among the
    entries of one argument: one of them of integers (labels: ``step(state, {"image": ..., "label": ...})``),
    or a tuple or list of exactly two (``step(state, (X, Y))``) whose leading axis is none of the others' axes
    (a square kernel and its bias are no batch). A dict of parameters holds no labels. Returns
    ``(path, shape)`` of each."""
    def batch(group: list[tuple[str, Any]], labels: bool, pair: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        rows: dict[int, list[tuple[str, Any]]] = {}
        for path, a in group:
            if _whole_array(a) and np.ndim(a) and np.shape(a)[0] > 1:
                rows.setdefault(int(np.shape(a)[0]), []).append((path, a))
        return [(p, tuple(int(d) for d in np.shape(a))) for n, same in rows.items()
                if len(same) > 1 and any(np.ndim(a) > 1 for _, a in same)
                and (not labels or any(np.asarray(a[:1]).dtype.kind in "iub" for _, a in same)
                     or pair and len(same) == 2 and all(n not in np.shape(a)[1:] for _, a in same))
                for p, a in same]

    found = batch([(f"argument {i}", a) for i, a in enumerate(args)], labels=False)
    for i, a in enumerate(args):
        entries = list(a.items()) if isinstance(a, dict) else list(enumerate(a)) if isinstance(a, (tuple, list)) \
            else []
        found += batch([(f"argument {i}[{k!r}]", v) for k, v in entries], labels=True,
                       pair=isinstance(a, (tuple, list)) and len(a) == 2)
    return found


def _whole_array(x: Any) -> bool:
    """A host array, or a ``jax.Array`` whose rows are not split over the devices."""
    if isinstance(x, jax.Array):
        return not isinstance(x, jax.core.Tracer) and not _split_rows(x)
    return _host_array(x)


def _host_array(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    module = type(x).__module__
    return module.startswith(("tensorflow", "torch")) and hasattr(x, "shape") and hasattr(x, "numpy")
