"""A serving replica's table: built for reads, not inserts (`ReadTable`).

A replica never learns: it loads a base and applies deltas, and between them
only reads. So its index is the keys themselves, sorted, searched with
``np.searchsorted`` (one vectorised binary search per pull: no hash slots,
no free rows, no load factor), and its weights hold no optimizer state, in
one of three precisions:

- ``f32``: the weights as trained (8 + 4·dim bytes a key);
- ``f16``: rounded to the nearest float16 (8 + 2·dim);
- ``int8``: block floating point. Keys are bucketed by their top bits
  (hashed ids spread evenly; a bucket holds ~64 keys when the base loads),
  and each bucket has one power-of-two scale 2**e with e chosen so its
  largest magnitude fits 127; a weight is its int8 code times its bucket's
  scale (8 + dim + ~1/64 bytes). Power-of-two scales make a delta cheap and
  drift-free: a bucket a delta touches gets its exponent again, and the
  rows it did not change keep their exact value when the exponent holds or
  falls, and lose at most half a step of the new scale when it grows.

A delta is a merge of sorted arrays, O(rows held) per delta, which a
replica pays once a version (minutes apart), never per read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..checkpoint.serving_files import PRECISIONS
from ..hashing import U64, uniform_from_keys
from ..store.block_int8 import NO_EXP, block_codes, block_exponents
from ..store.storage import F32
from ..store.table_config import TableConfig

__all__ = ["Prepared", "ReadTable", "State"]

_DTYPES = {"f32": np.float32, "f16": np.float16, "int8": np.int8}
_ROWS_PER_BUCKET = 64
_MAX_BUCKET_BITS = 26
_KEYS_PER_RUN = 8


class Prepared(NamedTuple):
    """A version's rows for one table, checked and sorted (`ReadTable.prepare`)."""

    keys: U64
    weights: F32
    deleted: U64


class State(NamedTuple):
    """Everything a read uses, replaced whole (one reference) by `install`:
    a read on the event loop sees one version's arrays or the next one's."""

    keys: U64
    """Every key held, ascending."""
    values: npt.NDArray[Any]
    """(n, dim) weights (f32, f16) or int8 codes, in the order of `keys`."""
    exps: npt.NDArray[np.int8]
    """int8: each bucket's scale exponent (its weights are code · 2**exp)."""
    bucket_bits: int
    """int8: buckets are the keys' top `bucket_bits` bits (-1 before the first load)."""
    directory: npt.NDArray[np.uint32]
    """(2**d + 1,) where the keys with each value of their top d bits start
    (one entry per ~8 keys): a search starts in its key's run, ~8 long."""
    steps: int
    """Halvings that finish a search in the longest run."""


class ReadTable:
    """Sorted keys and their weights, read by vectorised binary search."""

    def __init__(self, config: TableConfig, precision: str = "f32") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
        self.config = config
        self.dim = config.dim
        self.precision = precision
        self.state = _with_directory(
            np.zeros(0, dtype=np.uint64), np.zeros((0, self.dim), dtype=_DTYPES[precision]), np.zeros(0, np.int8), -1
        )
        self.pulls = 0
        self.version = 0
        """The export version the table holds (the replica sets it)."""
        lc = config.lifecycle
        self._lazy = bool(lc is not None and lc.embed_threshold and config.embeddings)

    @property
    def keys(self) -> U64:
        return self.state.keys

    @property
    def values(self) -> npt.NDArray[Any]:
        return self.state.values

    def __len__(self) -> int:
        return int(self.state.keys.size)

    def memory_bytes(self) -> int:
        """Bytes held: keys (the index), weights and bucket scales."""
        st = self.state
        return int(st.keys.nbytes + st.values.nbytes + st.exps.nbytes + st.directory.nbytes)

    # -- reads -------------------------------------------------------------------
    @staticmethod
    def _find(st: State, keys: U64) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
        """Each key's position (where it is, or would go) and whether it is held.

        A lower-bound binary search of all keys at once, each within its
        run of the directory: a few vectorised halvings over short runs,
        whose keys share cache lines (a search of the whole array would miss
        the cache at every step)."""
        n = st.keys.size
        if not n:
            return np.zeros(keys.size, dtype=np.intp), np.zeros(keys.size, dtype=bool)
        run = (keys >> np.uint64(64 - _directory_bits(n))).astype(np.intp) if _directory_bits(n) else 0
        lo = st.directory[run].astype(np.intp)
        count = st.directory[run + 1].astype(np.intp) - lo
        for _ in range(st.steps):
            half = count >> 1
            mid = lo + half
            go = st.keys[np.minimum(mid, n - 1)] < keys
            lo = np.where(go, mid + 1, lo)
            count = np.where(go, count - half - 1, half)
        pos = np.minimum(lo, n - 1)
        return pos, st.keys[pos] == keys

    def contains(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Whether each key has a row."""
        return self._find(self.state, np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1))[1]

    def pull(self, keys: npt.ArrayLike) -> F32:
        """Weights (n, dim) of `keys` in their order; absent keys read as a
        trainer's table reads them (initial values, or zeros for lazy embeddings)."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        st = self.state  # one version's arrays for the whole read
        self.pulls += 1
        if not st.keys.size:
            return self._absent(k)
        pos, found = self._find(st, k)
        out = self._weights(st, pos, k)
        if not found.all():
            missing = np.flatnonzero(~found)
            out[missing] = self._absent(k[missing])
        return out

    def _weights(self, st: State, pos: npt.NDArray[np.intp], keys: U64) -> F32:
        got = st.values.take(pos, axis=0)  # `ps_core.rows`
        if self.precision != "int8":
            return got.astype(np.float32)
        e = st.exps[keys >> np.uint64(64 - st.bucket_bits)] if st.bucket_bits else np.repeat(st.exps[:1], keys.size)
        return np.ldexp(got.astype(np.float32), e.astype(np.int32)[:, None])

    def _absent(self, keys: U64) -> F32:
        scale = self.config.init_scale
        if scale == 0.0 or self._lazy:
            return np.zeros((keys.size, self.dim), dtype=np.float32)
        u = uniform_from_keys(keys, self.config.seed, self.dim)
        return ((u * 2.0 - 1.0) * scale).astype(np.float32)

    def weights(self) -> F32:
        """Every held row's weights (n, dim) as float32, in key order."""
        st = self.state
        return self._weights(st, np.arange(st.keys.size), st.keys)

    # -- loads -------------------------------------------------------------------
    def apply(self, keys: npt.ArrayLike, weights: npt.ArrayLike, deleted: npt.ArrayLike = ()) -> None:
        """Set the weights (m, dim) of `keys` (distinct), inserting the new
        ones, and drop the `deleted` keys: a base on an empty table, or a delta."""
        self.install(self.staged(self.prepare(keys, weights, deleted)))

    def prepare(self, keys: npt.ArrayLike, weights: npt.ArrayLike, deleted: npt.ArrayLike = ()) -> Prepared:
        """Check and sort what `apply` would apply, changing nothing:
        `ValueError` on weights that are not finite or a key listed twice."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        w = np.asarray(weights, dtype=np.float32).reshape(k.size, self.dim)
        gone = np.ascontiguousarray(deleted, dtype=np.uint64).reshape(-1)
        if not np.isfinite(w).all():
            raise ValueError(f"table {self.config.name}: weights hold NaN or infinity")
        order = np.argsort(k, kind="stable")
        k, w = k[order], w[order]
        if k.size > 1 and (k[1:] == k[:-1]).any():
            raise ValueError(f"table {self.config.name}: a version lists a key twice")
        return Prepared(k, w, gone)

    def staged(self, prepared: Prepared) -> State:
        """The state after `prepared` is applied, built beside the held one
        (which stays in use: run it in a thread, then `install`)."""
        k, w, gone = prepared
        st = self.state
        bits = st.bucket_bits
        exps = st.exps
        if self.precision == "int8" and bits < 0:
            rows = max(k.size, 1)
            bits = int(min(_MAX_BUCKET_BITS, max(0, round(np.log2(rows / _ROWS_PER_BUCKET)))))
            exps = np.full(1 << bits, NO_EXP, dtype=np.int8)
            st = st._replace(exps=exps, bucket_bits=bits)
        # Rows replaced or deleted leave; then the given rows go in, in order.
        if st.keys.size:
            pos, hit = self._find(st, np.concatenate([k, gone]))
            keep = np.ones(st.keys.size, dtype=bool)
            keep[pos[hit]] = False
            old_keys = st.keys[keep]
            if self.precision == "int8":
                old_values = self._weights(st, np.flatnonzero(keep), old_keys)
            else:
                old_values = st.values[keep]
        else:
            old_keys = st.keys
            old_values = np.zeros((0, self.dim), np.float32) if self.precision == "int8" else st.values
        at = np.searchsorted(old_keys, k)
        keys = np.insert(old_keys, at, k)
        if self.precision != "int8":
            values = np.insert(old_values, at, w.astype(_DTYPES[self.precision]), axis=0)
            return _with_directory(keys, values, exps, bits)
        codes, exps = _requantize(np.insert(old_values, at, w, axis=0), keys, k, exps, bits)
        return _with_directory(keys, codes, exps, bits)

    def install(self, state: State) -> None:
        """Serve `state` (one reference: atomic for readers)."""
        self.state = state


def _directory_bits(n: int) -> int:
    """Top bits a directory of `n` keys splits them by: ~8 keys a run."""
    return int(min(30, max(0, (n // _KEYS_PER_RUN).bit_length() - 1)))


def _with_directory(keys: U64, values: npt.NDArray[Any], exps: npt.NDArray[np.int8], bits: int) -> State:
    """A state of sorted `keys` and their values, with its directory."""
    d = _directory_bits(keys.size)
    runs = np.bincount((keys >> np.uint64(64 - d)).astype(np.intp), minlength=1 << d) if d else np.array([keys.size])
    directory = np.zeros((1 << d) + 1, dtype=np.uint32)
    np.cumsum(runs, out=directory[1:])
    longest = int(runs.max()) if runs.size else 0
    return State(keys, values, exps, bits, directory, longest.bit_length())


def _requantize(
    exact: F32, keys: U64, changed: U64, exps: npt.NDArray[np.int8], bits: int
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int8]]:
    """int8 codes of `exact` (the held weights as float32, new rows in place)
    and the bucket exponents, the buckets of the `changed` keys given theirs
    again; the others keep theirs (their rows lie on its grid: exact)."""
    if not keys.size:
        return np.zeros((0, exact.shape[1]), dtype=np.int8), exps
    shift = np.uint64(64 - bits)
    bucket = (keys >> shift).astype(np.int64) if bits else np.zeros(keys.size, np.int64)
    touched = np.unique((changed >> shift).astype(np.int64)) if bits else np.zeros(1, np.int64)
    # Keys are sorted, so each bucket's rows are one run: a reduceat over
    # the runs' starts, not an unbuffered np.maximum.at over every row.
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    top = np.zeros(exps.size, dtype=np.float32)
    top[bucket[starts]] = np.maximum.reduceat(np.abs(exact).max(axis=1), starts)
    out = exps.astype(np.int32)
    out[touched] = block_exponents(top)[touched]
    return block_codes(exact, out[bucket]), out.astype(np.int8)
