"""Stable 64-bit mixing of feature ids, and the sharding function.

Everything here is a pure function of its input: the same in every process,
Python version and machine (never Python's ``hash()``). Arrays are mixed in a
handful of vectorised numpy operations (a few ns per id).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["mix64", "shard_of", "distinct", "sorted_distinct", "uniform_from_keys", "U64"]

U64 = npt.NDArray[np.uint64]

_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(keys: npt.ArrayLike, salt: int = 0) -> U64:
    """MurmurHash3's 64-bit finaliser (fmix64) of ``keys ^ salt``.

    A bijection on uint64 with full avalanche: every output bit depends on
    every input bit, so any slice of its bits is a good hash. Different salts
    give independent-looking hashes of the same keys (initial values use a
    salt derived from the table's seed; sharding uses none).
    """
    k = np.asarray(keys, dtype=np.uint64)
    if k.ndim == 0:  # numpy scalars would warn on the intended overflow
        return mix64(k.reshape(1), salt).reshape(())
    if salt:
        h = k ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
        h ^= h >> _S33
    else:
        h = k >> _S33  # the first step makes the fresh array, no copy first
        h ^= k
    h *= _C1
    h ^= h >> _S33
    h *= _C2
    h ^= h >> _S33
    return h


def shard_of(keys: npt.ArrayLike, num_shards: int) -> npt.NDArray[np.intp]:
    """The shard that owns each key: ``mix64(key) % num_shards``.

    The one routing function of the system: clients split batches with it,
    shards check ownership with it, restores re-hash with it.
    """
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if num_shards == 1:
        return np.zeros(np.shape(keys), dtype=np.intp)
    h = mix64(keys)  # a fresh array: reduce it in place
    if num_shards & (num_shards - 1) == 0:
        h &= np.uint64(num_shards - 1)  # the same as %, without a division
    else:
        h %= np.uint64(num_shards)
    if h.dtype.itemsize == np.dtype(np.intp).itemsize:
        return h.view(np.intp)  # values < num_shards: the same numbers
    return h.astype(np.intp)


_POS_BITS = 16
_POS_MASK = np.uint64((1 << _POS_BITS) - 1)
_PREFIX = np.uint64(_POS_BITS)


def sorted_distinct(keys: U64) -> U64:
    """``np.unique(keys)`` for uint64 keys, by one sort: several times faster
    than numpy's hash-based unique on hundreds of thousands of keys."""
    out = np.sort(keys)
    if out.size > 1:
        keep = np.empty(out.size, dtype=bool)
        keep[0] = True
        np.not_equal(out[1:], out[:-1], out=keep[1:])
        if not keep.all():
            out = out[keep]
    return out


def distinct(keys: U64) -> tuple[U64, npt.NDArray[np.int64]]:
    """Exactly ``np.unique(keys, return_inverse=True)`` (distinct keys
    ascending, and each key's index among them), faster for a mini-batch.

    Each key's top 48 bits and its position are packed into one uint64 and
    sorted by value (numpy's vectorised sort, ~3x faster than the argsort
    ``np.unique`` needs). Distinct keys sharing their top 48 bits would
    interleave by position: such a batch (about 1 in 10**8 for 3,000 hashed
    ids) is detected and handed to ``np.unique``; so is one of 2**16 keys or
    more, whose positions do not fit.
    """
    n = keys.size
    if n < 2 or n > 1 << _POS_BITS:
        keys_u, inverse = np.unique(keys, return_inverse=True)
        return keys_u, inverse.reshape(-1).astype(np.int64, copy=False)
    packed = keys >> _PREFIX
    packed <<= _PREFIX
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    order = (packed & _POS_MASK).astype(np.intp)
    ordered = keys.take(order)
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    packed >>= _PREFIX
    if (first[1:] & (packed[1:] == packed[:-1])).any():
        keys_u, inverse = np.unique(keys, return_inverse=True)
        return keys_u, inverse.reshape(-1).astype(np.int64, copy=False)
    # Each sorted position's distinct id, as runs of repeated ids: numpy's
    # cumsum of the `first` mask is a scalar loop (~3 ns per key), a
    # repeat of run lengths a copy (~18 us less per 10k-key mini-batch).
    starts = np.flatnonzero(first)
    runs = np.empty(starts.size, dtype=np.int64)
    np.subtract(starts[1:], starts[:-1], out=runs[:-1])
    runs[-1] = n - starts[-1]
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.arange(starts.size, dtype=np.int64).repeat(runs)
    return ordered.take(starts), inverse


def uniform_from_keys(keys: U64, seed: int, width: int) -> npt.NDArray[np.float64]:
    """Deterministic uniform [0, 1) numbers, `width` per key, from (key, seed, column).

    The initial value of an embedding is a pure function of its key and the
    table's seed, so every shard, restore and serving replica agrees on the
    value of a feature it has never stored.
    """
    base = mix64(keys, salt=seed * 0x632BE59BD9B4E019 + 0x1D8E4E27C47D124F)
    cols = np.arange(width, dtype=np.uint64) * _GOLDEN
    h = mix64(base[:, None] ^ cols[None, :])
    # The top 53 bits make an exact double in [0, 1).
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
