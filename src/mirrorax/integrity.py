"""Integrity digest of a state: a checksum and a finiteness flag per variable.

TensorStore has no checksum over array values, so a flipped byte restores silently as a wrong number;
the checksums written beside each checkpoint catch that. They are integer sums, exact and
associative, so a checkpoint written on 8 devices verifies on 1, and a sum over a variable's pieces
(its shards) is the sum over the whole.

Two ways to the same numbers: :func:`digest` reduces on the devices and waits for the result (restore
uses it); :class:`HostDigest` takes this process's shards as host arrays and sums them with numpy
later, on a background thread (a save uses it, so that the loop never waits on a reduction).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrorax._host import host_value, local_copy

__all__ = ["HostDigest", "all_finite", "digest", "path_str"]

PyTree = Any

_MASK = 0xFFFFFFFF
# Rows of a piece weighted per numpy call: bounds the temporaries at a few MiB per variable.
_CHUNK_WORDS = 1 << 20


def _as_words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as a flat uint32 vector (one word per element, two for 64-bit types)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)])
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size >= 4:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    return words.reshape(-1)


def _leaf_digest(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(uint32[2] checksum, bool finite) of one leaf.

    The checksum is (sum of words, sum of word * (2i + 1)) modulo 2**32. Integer sums are exact and
    associative, so the value does not depend on the device count or the reduction order (a checkpoint
    written on 8 devices verifies on 1); any single changed word changes both sums, because odd
    multipliers are invertible modulo 2**32.
    """
    words = _as_words(x)
    weights = jnp.arange(words.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    checksum = jnp.stack(
        [jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)]
    )
    if jnp.issubdtype(x.dtype, jnp.inexact):
        finite = jnp.all(jnp.isfinite(x))
    else:
        finite = jnp.array(True)
    return checksum, finite


@jax.jit
def _digest_leaves(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """uint32[n, 2] checksums and bool[n] finiteness of n leaves (two small transfers, not 2n)."""
    pairs = [_leaf_digest(x) for x in leaves]
    return jnp.stack([c for c, _ in pairs]), jnp.stack([f for _, f in pairs])


def path_str(path: tuple[Any, ...]) -> str:
    """``('trainable', 'sequential/dense/kernel')`` -> ``'trainable/sequential/dense/kernel'``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def digest(tree: PyTree) -> tuple[dict[str, list[int]], list[str]]:
    """Checksums by variable path, and the paths of floating variables holding NaN or Inf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        return {}, []
    paths = [path_str(p) for p, _ in flat]
    leaves = [local_copy(x) if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
    # One jitted call per set of devices: a jit cannot mix arrays committed to different devices.
    groups: dict[frozenset[Any], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(frozenset(leaf.sharding.device_set), []).append(i)
    checksums: list[list[int]] = [[]] * len(leaves)
    finite: list[bool] = [True] * len(leaves)
    for members in groups.values():
        sums, ok = _digest_leaves([leaves[i] for i in members])
        for i, row, flag in zip(members, host_value(sums).tolist(), host_value(ok).tolist()):
            checksums[i], finite[i] = [int(v) for v in row], bool(flag)
    return dict(zip(paths, checksums)), [p for p, f in zip(paths, finite) if not f]


def _host_words(a: np.ndarray, shape: tuple[int, ...], start: tuple[int, ...]
                ) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """A piece in :func:`_as_words`'s word layout before its final reshape, with the whole's shape and
    the piece's offset in that layout (so a word's flat index in the whole can be computed)."""
    if np.iscomplexobj(a):
        a, shape, start = np.stack([a.real, a.imag]), (2, *shape), (0, *start)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    a = a if a.flags.c_contiguous else a.copy()  # (not ascontiguousarray: that makes a scalar 1-d)
    size = a.dtype.itemsize
    if size == 4:
        return a.view(np.uint32), shape, start
    if size == 8:  # two words per element, the low one first (as XLA's bitcast on a little-endian host)
        return a.reshape(*a.shape, 1).view(np.uint32), (*shape, 2), (*start, 0)
    return a.view({1: np.uint8, 2: np.uint16}[size]).astype(np.uint32), shape, start


def _piece_checksum(a: np.ndarray, shape: tuple[int, ...], start: tuple[int, ...]) -> tuple[int, int]:
    """:func:`_leaf_digest`'s two sums over the words of one piece, each word weighted by its index in
    the whole (so that the pieces' sums add up to the whole's, modulo 2**32)."""
    words, shape, start = _host_words(a, shape, start)
    if words.ndim == 0:
        words, shape, start = words.reshape(1), (1,), (0,)
    strides = [int(np.prod(shape[d + 1:], dtype=np.uint64)) for d in range(len(shape))]
    base = sum(s * g for s, g in zip(start, strides)) & _MASK
    # Index of each word of a row (all axes but the first) in the whole, modulo 2**32.
    inner = np.zeros(words.shape[1:], np.uint32)
    for d in range(1, words.ndim):
        along = (np.arange(words.shape[d], dtype=np.uint64) * strides[d]) & _MASK
        inner = inner + along.astype(np.uint32).reshape((-1,) + (1,) * (words.ndim - 1 - d))
    total = int(words.sum(dtype=np.uint32))
    weighted = 0
    rows = max(1, _CHUNK_WORDS // max(1, inner.size))
    for r0 in range(0, words.shape[0], rows):
        r = np.arange(r0, min(r0 + rows, words.shape[0]), dtype=np.uint64)
        row_base = ((base + r * strides[0]) & _MASK).astype(np.uint32).reshape((-1,) + (1,) * (words.ndim - 1))
        index = row_base + inner  # uint32: wraps modulo 2**32 as the device's sums do
        weights = index * np.uint32(2) + np.uint32(1)
        weighted += int((words[r0:r0 + len(r)] * weights).sum(dtype=np.uint32))
    return total & _MASK, weighted & _MASK


class HostDigest:
    """:func:`digest` of a state, computed from host arrays: taken now, summed later.

    The constructor takes this process's distinct pieces of every variable (one replica of each
    shard) as numpy arrays. On CPU devices these alias the device buffers, and JAX declines to donate
    a buffer that host memory still references, so a later step cannot change them; elsewhere they are
    copies. :meth:`result` does the sums (numpy releases the GIL, so a background thread can run it
    while the loop goes on) and drops the arrays.

    Only for a process that holds every piece of every variable (one process: ``jax.process_count()
    == 1``); :func:`digest` handles the rest.
    """

    def __init__(self, tree: PyTree) -> None:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        self._leaves: list[tuple[str, tuple[int, ...], list[tuple[np.ndarray, tuple[int, ...]]], bool]] = []
        for path, leaf in flat:
            pieces = []
            if isinstance(leaf, jax.Array):
                is_key = jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
                shape = tuple(jax.eval_shape(jax.random.key_data, leaf).shape if is_key else leaf.shape)
                for shard in leaf.addressable_shards:
                    if shard.replica_id != 0:
                        continue
                    data = jax.random.key_data(shard.data) if is_key else shard.data
                    start = tuple(0 if s.start is None else s.start for s in shard.index)
                    pieces.append((np.asarray(data), start + (0,) * (len(shape) - len(start))))
                inexact = not is_key and jnp.issubdtype(leaf.dtype, jnp.inexact)
            else:
                value = np.asarray(leaf)  # as digest's jnp.asarray: 64-bit types narrowed without x64
                value = value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)
                shape, inexact = value.shape, np.issubdtype(value.dtype, np.inexact)
                pieces.append((value, (0,) * value.ndim))
            self._leaves.append((path_str(path), shape, pieces, inexact))

    def result(self) -> tuple[dict[str, list[int]], list[str]]:
        """Checksums by variable path, and the paths of floating variables holding NaN or Inf."""
        checksums: dict[str, list[int]] = {}
        non_finite: list[str] = []
        for path, shape, pieces, inexact in self._leaves:
            total = weighted = 0
            finite = True
            for piece, start in pieces:
                t, w = _piece_checksum(piece, shape, start)
                total, weighted = (total + t) & _MASK, (weighted + w) & _MASK
                if inexact and finite:
                    finite = bool(np.isfinite(piece).all())
            checksums[path] = [total, weighted]
            if not finite:
                non_finite.append(path)
        self._leaves = []
        return checksums, non_finite


def all_finite(tree: PyTree) -> bool:
    """Whether every floating-point value in ``tree`` is finite (no NaN, no +-Inf).

    Works on sharded or replicated ``jax.Array``s (the reduction runs on device, on one copy of a
    replicated array; one small vector comes back to the host), on numpy arrays and on Python
    numbers. Integer and boolean leaves count as finite. In a multi-process job every process must
    call it (for sharded arrays it is a computation over the global arrays); all processes get the
    same answer.

    Args:
        tree: Any pytree of arrays or numbers.

    Returns:
        ``True`` when no leaf holds NaN or Inf (also for a tree without leaves).

    Example:
        >>> import jax.numpy as jnp
        >>> from mirrorax.checkpoint.checkpointer import all_finite
        >>> all_finite({"w": jnp.ones(3), "b": jnp.array([0.0, jnp.nan])})
        False
    """
    return not digest(tree)[1]


