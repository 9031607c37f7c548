"""Sparse tables: uint64 feature ids → fixed-width float32 rows.

A `SparseTable` keeps, in contiguous growable numpy arrays indexed by row
number (see `KeyIndex`):

- ``data``: ``(rows, dim * optimizer.slots)`` float32, a row's weights and
  optimizer state side by side so one gather fetches an update's inputs;
- ``updated_at``: the export version in which the row last changed, so a delta
  export is a vectorised selection (`changed_since`), not a dirty set;
- ``last_seen`` (event time, whole seconds), ``shows`` and ``clicks``: the
  metadata that admission and eviction policies read.

All of these are views of one ``(rows, width + 4)`` uint32 array, a row's
state (as float32 bits) followed by its four metadata words: a pull's gather
brings in the cache lines its push then updates, and a push reads and writes
each row in one gather and one scatter.

`pull` never allocates: an absent key reads its deterministic initial value.
`push` sums the gradients of duplicate keys, then applies the optimizer once
per distinct key, in place.

`snapshot` is an export cut: a `TableSnapshot` (copies of the rows of a base
or a delta, and the keys deleted since the previous cut), after which the open
`version` moves on. `load_rows` and `mark_exported` are its inverse, for
restores (`ps_core.checkpoint.export`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..errors import InvalidValuesError, TableConfigError
from ..hashing import U64, uniform_from_keys
from ..parsing import json_int
from .index import KeyIndex
from .optim import FTRL, Optimizer, make_optimizer
from .pull_cache import PullCache, Pulled

__all__ = ["TableConfig", "SparseTable", "TableSnapshot", "SnapshotKind", "F32", "U32"]

F32 = npt.NDArray[np.float32]
U32 = npt.NDArray[np.uint32]
SnapshotKind = Literal["base", "delta"]
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_KEYS = np.zeros(0, dtype=np.uint64)
MAX_DIM = 4096
"""Most weights per key a table may have."""
MAX_INIT_SCALE = 1e3
"""Largest initial-weight scale (weights are float32, and an optimizer's
state is a multiple of them)."""
MAX_VERSION = 2**32 - 2
"""Highest export version: rows carry versions as uint32, and a cut at
`version` starts `version + 1`."""


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
        if not isinstance(self.dim, int) or not 1 <= self.dim <= MAX_DIM:
            raise TableConfigError(f"table {name}: dim must be an integer in [1, {MAX_DIM}]")
        if not 0 <= self.init_scale <= MAX_INIT_SCALE:  # NaN fails too
            raise TableConfigError(f"table {name}: init_scale must be in [0, {MAX_INIT_SCALE:g}]")
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
        # JSON integers by value (2.0 is 2), exact only (`ps_core.parsing`).
        dim = json_int(dim, "dim", minimum=1, maximum=MAX_DIM, error=TableConfigError)
        seed = json_int(seed, "seed", maximum=2**63 - 1, error=TableConfigError)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TableConfigError("init_scale must be a number")
        name = raw.get("name")
        if not isinstance(name, str):
            raise TableConfigError("name must be a string (it is required)")
        return cls(name, dim, dict(opt), float(scale), seed)


@dataclass(frozen=True, eq=False)
class TableSnapshot:
    """The rows of one table on one shard at an export cut, as copies it owns.

    A base holds every live row; a delta the live rows changed after `parent`
    and the keys deleted since then. Row ``i`` of every per-row array belongs
    to ``keys[i]``. (Not comparable with ``==``: compare the arrays.)
    """

    table: str
    """The table's name."""
    config: TableConfig
    """The table's declaration: dim, optimizer (so the row layout), initial values."""
    version: int
    """The export version this snapshot closes: its rows have ``updated_at <= version``."""
    kind: SnapshotKind
    """``"base"`` (every live row) or ``"delta"`` (rows changed after `parent`)."""
    parent: int | None
    """For a delta, the version it applies on top of; None for a base."""
    keys: U64
    """(n,) uint64 feature ids, distinct."""
    data: F32
    """(n, dim * slots) float32: each row's weights and optimizer state (see `ps_core.store.optim`)."""
    updated_at: U32
    """(n,) export version of each row's last change."""
    last_seen: U32
    """(n,) event time of each row's last update, whole seconds."""
    shows: U32
    """(n,) impressions counted for each key."""
    clicks: U32
    """(n,) clicks counted for each key."""
    deleted: U64
    """(m,) keys deleted since `parent` and absent at the cut (empty for a base).
    May name keys `parent` never held (inserted and deleted in between)."""

    ARRAYS = ("keys", "data", "updated_at", "last_seen", "shows", "clicks", "deleted")
    """Names of the array fields, in file order."""

    def __post_init__(self) -> None:
        n = self.keys.shape[0] if self.keys.ndim == 1 else -1
        width = self.config.dim * make_optimizer(self.config.optimizer).slots
        expect: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
            "keys": (np.dtype(np.uint64), (n,)),
            "data": (np.dtype(np.float32), (n, width)),
            "updated_at": (np.dtype(np.uint32), (n,)),
            "last_seen": (np.dtype(np.uint32), (n,)),
            "shows": (np.dtype(np.uint32), (n,)),
            "clicks": (np.dtype(np.uint32), (n,)),
        }
        for name, (dtype, shape) in expect.items():
            a = getattr(self, name)
            if a.dtype != dtype or a.shape != shape:
                raise ValueError(
                    f"snapshot of table {self.table}: {name} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}"
                )
        if self.deleted.dtype != np.uint64 or self.deleted.ndim != 1:
            raise ValueError(f"snapshot of table {self.table}: deleted must be 1-d uint64")
        if self.table != self.config.name:
            raise ValueError(f"snapshot names table {self.table}, its config {self.config.name}")
        if (self.kind == "base") != (self.parent is None):
            raise ValueError(f"a {self.kind} snapshot with parent {self.parent}")
        if self.kind == "base" and self.deleted.size:
            raise ValueError("a base snapshot has no deleted keys")
        if self.parent is not None and not 0 <= self.parent < self.version:
            raise ValueError(f"parent {self.parent} is not below version {self.version}")

    @property
    def rows(self) -> int:
        """Number of rows."""
        return int(self.keys.size)

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays."""
        return sum(a.nbytes for a in self.arrays().values())

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The arrays by field name, in `ARRAYS` order."""
        return {name: getattr(self, name) for name in self.ARRAYS}


_META = ("updated_at", "last_seen", "shows", "clicks")
"""The columns of `SparseTable.meta`, in order."""
_COUNT_MAX = float(2**32 - 1)


def _row_view(a: npt.NDArray[Any]) -> npt.NDArray[np.void]:
    """A C-contiguous 2-d array as a 1-d array of opaque rows (same memory).

    Scattering whole rows through it (`put` is quicker than ``[]=`` here) is a
    plain copy of n items, several times cheaper than numpy's 2-d fancy
    assignment.
    """
    v: npt.NDArray[np.void] = a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(-1)
    return v


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
        self.last_snapshot = 0
        """The version of the last cut (`snapshot`, or a restore's `mark_exported`);
        0, the empty table, before any. A delta is always taken relative to it."""
        self.pushes = 0
        """Push calls applied."""
        self.pulls = 0
        """Pull calls served."""
        # A worker pushes the very keys it pulled: its push reuses what the
        # pull found instead of probing and gathering again.
        self._pull_cache = PullCache(self.index)
        # 0, 1, 2, ... for the duplicate check in `push`; grown on demand.
        self._stamps = np.arange(1024, dtype=np.uint32)
        # The whole row (state, zero metadata) of a key whose initial weight
        # is 0 (init_scale 0): a constant, written to new rows as it is.
        zero_state = self.optimizer.rows_from_weights(np.zeros((1, self.dim), np.float32))
        self._zero_row = _row_view(self._full_rows(zero_state))
        # FTRL's step starts by deriving w and sqrt(n) from the rows, as a
        # pull does: a push right after a pull of the same keys, with no row
        # changed in between, takes them from the pull. Fresh rows (absent at
        # the pull) start from `zero_state`, whose derivation is a constant;
        # other initial values would have to be derived per key, so then the
        # push derives everything itself.
        self._derive: FTRL | None = None
        if isinstance(self.optimizer, FTRL) and config.init_scale == 0.0:
            self._derive = self.optimizer
            self._zero_derived = self.optimizer.derive(zero_state, self.dim)
        # Keys deleted since the last cut, for the next delta. Kept as the
        # arrays `delete` returned; folded into one distinct array when they
        # have doubled, so the log holds each deleted key about once.
        self._deleted: list[U64] = []
        self._deleted_len = 0
        self._deleted_fold_at = 1024
        self._alloc(0)

    # -- storage -----------------------------------------------------------
    def _alloc(self, cap: int) -> None:
        self._rows: U32 = np.zeros((cap, self.width + len(_META)), dtype=np.uint32)
        """The storage: per row, `width` float32 state words, then `_META`."""
        self._rows_1d = _row_view(self._rows)
        w = self.width
        self.data: F32 = self._rows[:, :w].view(np.float32)
        self.meta: U32 = self._rows[:, w:]
        """Per-row metadata; its columns are the arrays named in `_META`."""
        self.updated_at: U32 = self.meta[:, 0]
        self.last_seen: U32 = self.meta[:, 1]
        self.shows: U32 = self.meta[:, 2]
        self.clicks: U32 = self.meta[:, 3]

    def _full_rows(self, state: F32) -> U32:
        """Storage rows holding `state` (n, width) and zero metadata."""
        out = np.zeros((state.shape[0], self.width + len(_META)), dtype=np.uint32)
        out[:, : self.width] = state.view(np.uint32)
        return out

    def _sync_capacity(self) -> None:
        """Grow row arrays to the index's row capacity (which grows by 1.5x)."""
        cap = self.index.row_capacity
        old = self._rows.shape[0]
        if cap <= old:
            return
        prev = self._rows
        self._alloc(cap)
        self._rows[:old] = prev

    def __len__(self) -> int:
        return self.index.size

    def memory_bytes(self) -> int:
        """Bytes allocated for this table: index, rows and metadata."""
        return int(self.index.nbytes() + self._rows.nbytes)

    # -- values --------------------------------------------------------------
    def initial_weights(self, keys: U64) -> F32:
        """The weights (n, dim) a key has before its first update."""
        scale = self.config.init_scale
        if scale == 0.0:
            return np.zeros((keys.size, self.dim), dtype=np.float32)
        u = uniform_from_keys(keys, self.config.seed, self.dim)
        return ((u * 2.0 - 1.0) * scale).astype(np.float32)

    def _initial_rows(self, keys: U64) -> npt.NDArray[np.void]:
        """The storage rows (as `_row_view` items) of keys before their first update."""
        if self.config.init_scale == 0.0:
            return self._zero_row
        return _row_view(self._full_rows(self.optimizer.rows_from_weights(self.initial_weights(keys))))

    def pull(self, keys: npt.ArrayLike) -> F32:
        """Current weights (n, dim) of `keys`, in their order; allocates nothing."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        self.pulls += 1
        rows, free = self.index.probe(k)
        missing = np.flatnonzero(rows < 0)
        if missing.size == k.size:  # nothing stored (perhaps no row at all yet)
            self._pull_cache.add(k, rows, missing, free, None)
            return self.initial_weights(k)
        # Absent keys gather row 0 (mode="clip" maps -1 there): one gather
        # and one weight derivation for all keys, then overwrite those few,
        # beats splitting the keys into present and absent first.
        # (A gather of `data`, a strided view, is slow: gather whole rows.)
        full = self._rows.take(rows, axis=0, mode="clip")
        state = full[:, : self.width].view(np.float32)
        gathered = None
        if self._derive is not None:
            out, sqrt_n = self._derive.derive(state, self.dim)
            gathered = (full, out.copy(), sqrt_n)  # `out` is the caller's
        else:
            out = self.optimizer.weights(state, self.dim)
        self._pull_cache.add(k, rows, missing, free.take(missing), gathered)
        if missing.size:
            if self.config.init_scale == 0.0:
                out[missing] = 0.0
            else:
                out[missing] = self.initial_weights(k.take(missing))
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

        In steps: validate; find or insert the keys' rows (reusing the pull of
        the same keys); gather the rows, checking for repeated keys; sum the
        gradients of repeated keys; one optimizer step per row; stamp the
        rows' metadata; write the rows back whole.
        """
        k, g, c, seen = self._checked_push(keys, grads, counts, event_time)
        if k.size == 0:
            return 0
        pulled = self._pull_cache.take(k)
        rows = self._rows_for_push(k, pulled)
        # With no row changed since the pull, what it gathered and derived
        # still holds, but for the keys it found absent (inserted just now).
        full, derived = self._pulled_rows(pulled)
        full, distinct = self._gather(k, rows, full)
        row_counts: npt.NDArray[Any] | None
        if distinct:
            # Distinct keys (what the client sends): no grouping needed.
            uniq, summed, row_counts = rows, g, c
        else:
            derived = None  # per occurrence, not per distinct row
            uniq, summed, row_counts = self._sum_duplicates(rows, g, c)
            full = self._rows.take(uniq, axis=0)
        # Update the gathered rows in place, then write them back whole.
        w = self.width
        if derived is not None and self._derive is not None:
            self._derive.step(full[:, :w].view(np.float32), summed, derived)
        else:
            self.optimizer.step(full[:, :w].view(np.float32), summed)
        self._stamp(full[:, w:], seen, row_counts)
        self._rows_1d.put(uniq, _row_view(full))
        self.pushes += 1
        self._pull_cache.wrote()
        return int(uniq.size)

    def _checked_push(
        self, keys: npt.ArrayLike, grads: npt.ArrayLike, counts: npt.ArrayLike | None, event_time: float | None
    ) -> tuple[U64, F32, F32 | None, float]:
        """A push's keys, gradients (n, dim), counts (n, 2) or None, and event
        time, as arrays; raises `InvalidValuesError` for any bad one."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        g = np.asarray(grads, dtype=np.float32)
        if g.ndim == 1 and self.dim == 1:
            g = g.reshape(-1, 1)
        if g.shape != (k.size, self.dim):
            raise InvalidValuesError(
                f"table {self.config.name}: gradients of shape {g.shape} for {k.size} keys of dim {self.dim}"
            )
        # One pass: a float64 sum of float32 values cannot overflow (below
        # 10**269 of them), so it is finite exactly when they all are.
        if not math.isfinite(g.sum(dtype=np.float64)):
            raise InvalidValuesError(f"table {self.config.name}: gradients hold NaN or inf")
        c = None
        if counts is not None:
            c = np.asarray(counts, dtype=np.float32).reshape(-1, 2) if k.size else None
            # min and max propagate NaN, so the comparisons reject NaN and
            # +-inf too; then whole numbers (np.floor is far cheaper than
            # np.modf).
            if c is not None and (
                c.shape[0] != k.size or not c.min() >= 0 or not c.max() < np.inf or not (np.floor(c) == c).all()
            ):
                raise InvalidValuesError(f"table {self.config.name}: counts must be (n, 2), finite, whole and >= 0")
        seen = time.time() if event_time is None else event_time
        if not (math.isfinite(seen) and 0 <= seen < 2**32):
            raise InvalidValuesError(f"table {self.config.name}: event time {seen!r} is not seconds in [0, 2**32)")
        return k, g, c, seen

    def _rows_for_push(self, k: U64, pulled: Pulled | None) -> npt.NDArray[np.int64]:
        """The row of each key, inserting absent keys with their initial rows
        (`KeyIndex.get_or_insert`, reusing the pull of the same keys if there
        was one)."""
        if pulled is None:
            rows, new_rows, new_keys = self.index.get_or_insert(k)
        elif not pulled.missing.size:
            return pulled.rows
        else:
            rows, missing = pulled.rows, pulled.missing
            if pulled.free is not None:
                # Still absent, and the slots the pull found free still are.
                got, new_rows, new_keys = self.index.insert_absent(k.take(missing), pulled.free)
            else:  # another push may have inserted some since the pull
                got, new_rows, new_keys = self.index.get_or_insert(k.take(missing))
            rows[missing] = got
        self._sync_capacity()
        if new_rows.size:
            self._rows_1d.put(new_rows, self._initial_rows(new_keys))
        return rows

    def _pulled_rows(self, pulled: Pulled | None) -> tuple[U32 | None, tuple[F32, F32] | None]:
        """The storage rows the pull of these keys gathered and `FTRL.derive`
        of their state, with the keys it found absent as inserted now; None,
        None if there are none (or they no longer hold)."""
        if pulled is None or pulled.gathered is None:
            return None, None
        full, weights, sqrt_n = pulled.gathered
        if pulled.missing.size:
            # The inserted rows start as `_zero_row` (gathered is only kept
            # with init_scale 0).
            _row_view(full).put(pulled.missing, self._zero_row)
            for part, zero in zip((weights, sqrt_n), self._zero_derived):
                part[pulled.missing] = zero
        return full, (weights, sqrt_n)

    def _gather(self, k: U64, rows: npt.NDArray[np.int64], full: U32 | None) -> tuple[U32, bool]:
        """The storage rows `rows` of keys `k` (`full` if the pull gathered
        them already), and whether the keys are distinct."""
        n = k.size
        if n < 2 or (k[1:] > k[:-1]).all():
            # Ascending keys are distinct: a worker's are (they come from
            # np.unique, and a shard's share keeps their order).
            return (self._rows.take(rows, axis=0) if full is None else full), True
        # Duplicate check: stamp each occurrence's position into its row's
        # updated_at and read it back with the gather the update needs
        # anyway; a repeated row reads a later occurrence's stamp. (Every
        # row stamped gets updated_at = version in `_stamp`: nothing of it stays.)
        if self._stamps.size < n:
            self._stamps = np.arange(max(n, 2 * self._stamps.size), dtype=np.uint32)
        stamps = self._stamps[:n]
        self.updated_at[rows] = stamps
        full = self._rows.take(rows, axis=0)
        return full, bool((full[:, self.width] == stamps).all())

    def _sum_duplicates(
        self, rows: npt.NDArray[np.int64], g: F32, c: F32 | None
    ) -> tuple[npt.NDArray[np.int64], F32, npt.NDArray[Any] | None]:
        """The distinct rows, and the gradients and counts of each summed."""
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
        return uniq, summed, row_counts

    def _stamp(self, meta: U32, seen: float, row_counts: npt.NDArray[Any] | None) -> None:
        """Stamp updated rows' metadata `meta` in place: the open version, the
        event time, and shows and clicks added."""
        meta[:, 0] = self.version
        meta[:, 1] = int(seen)
        if row_counts is not None:
            # Saturate at 2**32 - 1 instead of wrapping: add in float64 (exact
            # for any uint32 plus a whole float32), clamp, cast back.
            total = np.add(meta[:, 2:], row_counts, dtype=np.float64)
            np.minimum(total, _COUNT_MAX, out=total)
            meta[:, 2:] = total

    # -- versions, snapshots and deletes --------------------------------------
    def changed_since(self, version: int) -> tuple[U64, npt.NDArray[np.int64]]:
        """Keys and rows of live rows changed after `version` (a delta's content)."""
        n = self.index.num_rows
        sel = self.index.row_live[:n] & (self.updated_at[:n] > version)
        rows = np.flatnonzero(sel).astype(np.int64)
        return self.index.row_keys[rows], rows

    def delete(self, keys: npt.ArrayLike) -> U64:
        """Remove keys (eviction); returns those that were present.

        The removed keys are remembered until the next `snapshot`, whose delta
        lists them as deleted.
        """
        self._pull_cache.clear()  # freed rows may be reused by other keys
        gone = self.index.delete(keys)
        if gone.size:
            self._deleted.append(gone)
            self._deleted_len += int(gone.size)
            if self._deleted_len >= 2 * self._deleted_fold_at:
                folded = np.unique(np.concatenate(self._deleted))
                self._deleted, self._deleted_len = [folded], int(folded.size)
                self._deleted_fold_at = max(1024, self._deleted_len)
        return gone

    def snapshot(self, since: int | None = None) -> TableSnapshot:
        """Cut export version `version`: copy its rows, then open the next version.

        ``since=None`` copies every live row (a base). Otherwise `since` must be
        the version of the previous cut (`last_snapshot`) and the delta holds
        the live rows with ``updated_at > since`` plus the keys deleted since
        that cut and absent now (a key deleted and inserted again is a live
        row, not a deletion). Rows changed after the cut belong to the next
        version. Only memory copies happen here: this is the pause of a cut.
        """
        if since is not None and since != self.last_snapshot:
            raise ValueError(
                f"table {self.config.name}: a delta must follow the last cut "
                f"(version {self.last_snapshot}), not version {since}"
            )
        n = self.index.num_rows
        live = self.index.row_live[:n]
        sel = live if since is None else live & (self.updated_at[:n] > since)
        deleted = _NO_KEYS if since is None else self._deleted_since_cut()
        snap = self._copy_rows(np.flatnonzero(sel), self.version, since, deleted)
        self.mark_exported(self.version)
        return snap

    def base_copy(self, version: int) -> TableSnapshot:
        """Every live row as a base labelled `version`, without cutting: the open
        version and the deletion log stay as they are (compaction uses this on
        a table restored to `version`)."""
        n = self.index.num_rows
        return self._copy_rows(np.flatnonzero(self.index.row_live[:n]), version, None, _NO_KEYS)

    def _copy_rows(self, rows: npt.NDArray[np.intp], version: int, parent: int | None, deleted: U64) -> TableSnapshot:
        if rows.size == self.index.num_rows:
            # Every row handed out is selected (no freed rows): a slice copy
            # is a straight memcpy, cheaper than a gather.
            def take(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
                return a[: rows.size].copy()
        else:

            def take(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
                return np.take(a, rows, axis=0)

        return TableSnapshot(
            table=self.config.name,
            config=self.config,
            version=version,
            kind="base" if parent is None else "delta",
            parent=parent,
            keys=take(self.index.row_keys),
            data=take(self.data),
            updated_at=take(self.updated_at),
            last_seen=take(self.last_seen),
            shows=take(self.shows),
            clicks=take(self.clicks),
            deleted=deleted,
        )

    def _deleted_since_cut(self) -> U64:
        """Distinct keys deleted since the last cut that have no row now."""
        if not self._deleted:
            return _NO_KEYS.copy()
        keys = np.unique(np.concatenate(self._deleted))
        absent: U64 = keys[self.index.lookup(keys) < 0]
        return absent

    def mark_exported(self, version: int) -> None:
        """Declare the table's content to be export `version`: the open version
        becomes ``version + 1``, the next delta is relative to `version`, and
        the deletion log starts empty. `snapshot` calls it; a restore calls it
        after loading a chain."""
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"version {version} outside [0, 2**32 - 1)")
        self.last_snapshot = version
        self.version = version + 1
        self._deleted, self._deleted_len, self._deleted_fold_at = [], 0, 1024

    def load_rows(
        self,
        keys: npt.ArrayLike,
        data: npt.ArrayLike,
        updated_at: npt.ArrayLike,
        last_seen: npt.ArrayLike,
        shows: npt.ArrayLike,
        clicks: npt.ArrayLike,
    ) -> int:
        """Upsert whole rows as stored (state, `updated_at` and metadata); returns
        how many keys were new. Keys must be distinct and data finite; a refused
        call changes nothing.

        Rows keep their stored `updated_at`, so a later delta carries them only
        if they change again: meant for restoring a chain, then `mark_exported`.
        """
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        n = k.size
        d = np.asarray(data, dtype=np.float32)
        meta = [np.asarray(a).reshape(-1) for a in (updated_at, last_seen, shows, clicks)]
        name = self.config.name
        if d.shape != (n, self.width):
            raise InvalidValuesError(f"table {name}: rows of shape {d.shape}, expected ({n}, {self.width})")
        if any(m.shape != (n,) for m in meta):
            raise InvalidValuesError(f"table {name}: metadata arrays must hold {n} values each")
        if any(m.size and (m.min() < 0 or m.max() >= 2**32) for m in meta):
            raise InvalidValuesError(f"table {name}: metadata must be in [0, 2**32)")
        if not np.isfinite(d).all():
            raise InvalidValuesError(f"table {name}: rows hold NaN or inf")
        if n == 0:
            return 0
        rows, free = self.index.probe(k)
        absent = np.flatnonzero(rows < 0)
        if absent.size:
            got, new_rows, _ = self.index.insert_absent(k[absent], free[absent])
            rows[absent] = got
        else:
            new_rows = _NO_ROWS
        # Duplicate keys share a row: fewer distinct rows than keys. Marking
        # rows is O(rows), cheaper than sorting the keys.
        mark = np.zeros(self.index.num_rows, dtype=bool)
        mark[rows] = True
        if int(np.count_nonzero(mark)) != n:
            self.index.delete(self.index.row_keys[new_rows])  # undo the inserts
            raise InvalidValuesError(f"table {name}: load_rows keys must be distinct")
        self._sync_capacity()
        self._pull_cache.wrote()
        self.data[rows] = d
        for dst, src in zip((self.updated_at, self.last_seen, self.shows, self.clicks), meta):
            dst[rows] = src
        return int(new_rows.size)
