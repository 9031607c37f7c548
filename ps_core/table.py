"""Sparse tables: uint64 feature ids → fixed-width float32 rows.

A `SparseTable` keeps, in contiguous growable numpy arrays indexed by row
number (see `KeyIndex`):

- ``data``: ``(rows, dim * optimizer.slots)`` float32, a row's weights and
  optimizer state side by side so one gather fetches an update's inputs;
- ``updated_at``: the export version in which the row last changed, so a delta
  export is a vectorised selection (`changed_since`), not a dirty set;
- ``last_seen`` (event time, whole seconds), ``shows`` and ``clicks``: the
  metadata that admission and eviction policies read.

`pull` never allocates: an absent key reads its deterministic initial value.
`push` sums the gradients of duplicate keys, then applies the optimizer once
per distinct key, in place.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import InvalidValuesError, TableConfigError
from .hashing import U64, uniform_from_keys
from .index import KeyIndex
from .optim import Optimizer, make_optimizer

__all__ = ["TableConfig", "SparseTable", "F32"]

F32 = npt.NDArray[np.float32]
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_KEYS = np.zeros(0, dtype=np.uint64)
_MAX_DIM = 4096


@dataclass(frozen=True)
class TableConfig:
    """The declaration of a table; identical on every shard."""

    name: str
    """Table name, as used in RPC frames (ASCII letters, digits, ``_.-``)."""
    dim: int = 1
    """Weights per key: 1 for a linear term, k for an FM embedding."""
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "ftrl"})
    """``{"name": "sgd"|"adagrad"|"ftrl", **hyperparameters}``."""
    init_scale: float = 0.0
    """Initial weights are uniform in ``[-init_scale, init_scale)``; 0 starts at zero."""
    seed: int = 0
    """Seed of the initial values (a pure function of key and seed)."""

    def __post_init__(self) -> None:
        name = self.name
        if not name or len(name) > 64 or not all(c.isalnum() or c in "_.-" for c in name):
            raise TableConfigError(f"bad table name {name!r}: 1-64 of [A-Za-z0-9_.-]")
        if not name.isascii():
            raise TableConfigError(f"bad table name {name!r}: ASCII only")
        if not isinstance(self.dim, int) or not 1 <= self.dim <= _MAX_DIM:
            raise TableConfigError(f"table {name}: dim must be an integer in [1, {_MAX_DIM}]")
        if not math.isfinite(self.init_scale) or self.init_scale < 0:
            raise TableConfigError(f"table {name}: init_scale must be finite and >= 0")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise TableConfigError(f"table {name}: seed must be an integer in [0, 2**63)")
        # Normalise the optimizer spec (defaults filled in) so that two
        # declarations of the same table compare equal however they were written.
        object.__setattr__(self, "optimizer", make_optimizer(dict(self.optimizer)).spec())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the body of a declaration)."""
        return {
            "name": self.name,
            "dim": self.dim,
            "optimizer": dict(self.optimizer),
            "init_scale": self.init_scale,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, raw: object) -> TableConfig:
        """Build from a decoded JSON object; unknown or mistyped fields are errors."""
        if not isinstance(raw, dict):
            raise TableConfigError("a table declaration is a JSON object")
        unknown = set(raw) - {"name", "dim", "optimizer", "init_scale", "seed"}
        if unknown:
            raise TableConfigError(f"unknown table fields: {sorted(unknown)}")
        opt = raw.get("optimizer", {"name": "ftrl"})
        if isinstance(opt, str):
            opt = {"name": opt}
        if not isinstance(opt, dict):
            raise TableConfigError("optimizer is a name or an object with a name")
        dim, seed, scale = raw.get("dim", 1), raw.get("seed", 0), raw.get("init_scale", 0.0)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TableConfigError("dim must be an integer")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TableConfigError("seed must be an integer")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TableConfigError("init_scale must be a number")
        name = raw.get("name")
        if not isinstance(name, str):
            raise TableConfigError("name must be a string (it is required)")
        return cls(name, dim, dict(opt), float(scale), seed)


def _saturating_add(
    counts: npt.NDArray[np.uint32], add: npt.NDArray[Any]
) -> npt.NDArray[np.uint32]:
    """uint32 counters plus whole-number increments, saturating at 2**32 - 1."""
    total = counts.astype(np.float64) + add
    out: npt.NDArray[np.uint32] = np.minimum(total, float(2**32 - 1)).astype(np.uint32)
    return out


class SparseTable:
    """One table's rows on one shard. Not thread-safe: one event loop owns it."""

    def __init__(self, config: TableConfig, *, initial_rows: int = 1024) -> None:
        self.config = config
        self.dim = config.dim
        self.optimizer: Optimizer = make_optimizer(config.optimizer)
        self.width = config.dim * self.optimizer.slots
        self.index = KeyIndex(initial_slots=max(16, int(initial_rows / 0.6)))
        self.version = 1
        """The open export version: rows changed now get ``updated_at = version``."""
        self.pushes = 0
        """Push calls applied."""
        self.pulls = 0
        """Pull calls served."""
        # Rows looked up by recent pulls: a worker pushes the very keys it
        # pulled, so its push reuses the lookup instead of probing again. A
        # row stays valid until its key is deleted (rehashing moves slots,
        # never rows), so `delete` clears this.
        self._pulled: deque[tuple[U64, npt.NDArray[np.int64], int]] = deque(maxlen=8)
        self._alloc(0)

    # -- storage -----------------------------------------------------------
    def _alloc(self, cap: int) -> None:
        self.data: F32 = np.zeros((cap, self.width), dtype=np.float32)
        self.updated_at = np.zeros(cap, dtype=np.uint32)
        self.last_seen = np.zeros(cap, dtype=np.uint32)
        self.shows = np.zeros(cap, dtype=np.uint32)
        self.clicks = np.zeros(cap, dtype=np.uint32)

    def _sync_capacity(self) -> None:
        """Grow row arrays to the index's row capacity (which grows by 1.5x)."""
        cap = self.index.row_capacity
        old = self.data.shape[0]
        if cap <= old:
            return
        arrays = (self.data, self.updated_at, self.last_seen, self.shows, self.clicks)
        self._alloc(cap)
        for new, prev in zip(
            (self.data, self.updated_at, self.last_seen, self.shows, self.clicks), arrays
        ):
            new[:old] = prev

    def __len__(self) -> int:
        return self.index.size

    def memory_bytes(self) -> int:
        """Bytes allocated for this table: index, rows and metadata."""
        return int(
            self.index.nbytes()
            + self.data.nbytes
            + self.updated_at.nbytes
            + self.last_seen.nbytes
            + self.shows.nbytes
            + self.clicks.nbytes
        )

    # -- values --------------------------------------------------------------
    def initial_weights(self, keys: U64) -> F32:
        """The weights (n, dim) a key has before its first update."""
        scale = self.config.init_scale
        if scale == 0.0:
            return np.zeros((keys.size, self.dim), dtype=np.float32)
        u = uniform_from_keys(keys, self.config.seed, self.dim)
        return ((u * 2.0 - 1.0) * scale).astype(np.float32)

    def pull(self, keys: npt.ArrayLike) -> F32:
        """Current weights (n, dim) of `keys`, in their order; allocates nothing."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        self.pulls += 1
        rows = self.index.lookup(k)
        self._pulled.append((k.copy(), rows, self.index.mutations))
        present = rows >= 0
        if present.all():
            return self.optimizer.weights(np.take(self.data, rows, axis=0), self.dim)
        out = np.empty((k.size, self.dim), dtype=np.float32)
        absent = ~present
        out[absent] = self.initial_weights(k[absent])
        if present.any():
            out[present] = self.weights_of_rows(rows[present])
        return out

    def push(
        self,
        keys: npt.ArrayLike,
        grads: npt.ArrayLike,
        *,
        counts: npt.ArrayLike | None = None,
        event_time: float | None = None,
    ) -> int:
        """Apply gradients; returns the number of distinct keys updated.

        `grads` is (n, dim) (or (n,) when dim is 1). Gradients of repeated keys
        are summed before one optimizer step per key. `counts`, if given, is
        (n, 2) of shows and clicks to add. `event_time` (seconds; default now)
        becomes the rows' ``last_seen``. Non-finite values are rejected before
        anything changes.
        """
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        g = np.asarray(grads, dtype=np.float32)
        if g.ndim == 1 and self.dim == 1:
            g = g.reshape(-1, 1)
        if g.shape != (k.size, self.dim):
            raise InvalidValuesError(
                f"table {self.config.name}: gradients of shape {g.shape} for "
                f"{k.size} keys of dim {self.dim}"
            )
        if not np.isfinite(g).all():
            raise InvalidValuesError(f"table {self.config.name}: gradients hold NaN or inf")
        c = None
        if counts is not None:
            c = np.asarray(counts, dtype=np.float32).reshape(-1, 2) if k.size else None
            if c is not None and (
                c.shape[0] != k.size
                or not np.isfinite(c).all()
                or (c < 0).any()
                or (c != np.floor(c)).any()
            ):
                raise InvalidValuesError(
                    f"table {self.config.name}: counts must be (n, 2), finite, whole and >= 0"
                )
        seen = time.time() if event_time is None else event_time
        if not (math.isfinite(seen) and 0 <= seen < 2**32):
            raise InvalidValuesError(
                f"table {self.config.name}: event time {seen!r} is not seconds in [0, 2**32)"
            )
        if k.size == 0:
            return 0
        rows, new_rows, new_keys = self._rows_for_push(k)
        self._sync_capacity()
        if new_rows.size:
            self.data[new_rows] = self.optimizer.rows_from_weights(self.initial_weights(new_keys))
            self.shows[new_rows] = 0
            self.clicks[new_rows] = 0
        ordered = np.sort(rows)
        if not (ordered[1:] == ordered[:-1]).any():
            # Distinct keys (what the client sends): no grouping needed, and a
            # sort is ~3x cheaper than np.unique's inverse.
            uniq, summed, row_counts = rows, g, c
        else:
            uniq, inverse = np.unique(rows, return_inverse=True)
            inverse = inverse.reshape(-1)
            m = uniq.size
            # Reusing the inverse with bincount beats np.add.at by a wide margin.
            summed = np.empty((m, self.dim), dtype=np.float32)
            for j in range(self.dim):
                summed[:, j] = np.bincount(inverse, weights=g[:, j], minlength=m)
            row_counts = None
            if c is not None:
                row_counts = np.stack([np.bincount(inverse, c[:, 0], m), np.bincount(inverse, c[:, 1], m)], axis=1)
        block = np.take(self.data, uniq, axis=0)
        self.optimizer.step(block, summed)
        self.data[uniq] = block
        self.updated_at[uniq] = self.version
        self.last_seen[uniq] = np.uint32(int(seen))
        if row_counts is not None:
            self.shows[uniq] = _saturating_add(self.shows[uniq], row_counts[:, 0])
            self.clicks[uniq] = _saturating_add(self.clicks[uniq], row_counts[:, 1])
        self.pushes += 1
        return int(uniq.size)

    def _rows_for_push(self, k: U64) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], U64]:
        """`KeyIndex.get_or_insert`, reusing a recent pull's lookup of the same keys."""
        for i in range(len(self._pulled) - 1, -1, -1):
            keys, rows, mutations = self._pulled[i]
            if keys.size == k.size and np.array_equal(keys, k):
                del self._pulled[i]
                missing = np.flatnonzero(rows < 0)
                if not missing.size:
                    return rows, _NO_ROWS, _NO_KEYS
                if mutations == self.index.mutations:  # still absent: no probing
                    got, new_rows, new_keys = self.index.insert_absent(k[missing])
                else:  # another push may have inserted some since the pull
                    got, new_rows, new_keys = self.index.get_or_insert(k[missing])
                rows = rows.copy()
                rows[missing] = got
                return rows, new_rows, new_keys
        return self.index.get_or_insert(k)

    # -- versions and deletes ----------------------------------------------
    def changed_since(self, version: int) -> tuple[U64, npt.NDArray[np.int64]]:
        """Keys and rows of live rows changed after `version` (a delta's content)."""
        n = self.index.num_rows
        sel = self.index.row_live[:n] & (self.updated_at[:n] > version)
        rows = np.flatnonzero(sel).astype(np.int64)
        return self.index.row_keys[rows], rows

    def delete(self, keys: npt.ArrayLike) -> U64:
        """Remove keys (eviction); returns those that were present."""
        self._pulled.clear()  # freed rows may be reused by other keys
        return self.index.delete(keys)

    def weights_of_rows(self, rows: npt.NDArray[np.int64]) -> F32:
        """Weights (n, dim) of given row numbers."""
        return self.optimizer.weights(np.take(self.data, rows, axis=0), self.dim)
