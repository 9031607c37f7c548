"""Sparse tables: uint64 feature ids → fixed-width float32 rows.

A `SparseTable` keeps, in contiguous growable numpy arrays indexed by row
number (see `KeyIndex`):

- ``data``: ``(rows, dim * optimizer.slots)`` float32, a row's weights and
  optimizer state side by side so one gather fetches an update's inputs;
- ``last_seen`` (event time, whole seconds), ``shows`` and ``clicks``: the
  metadata the lifecycle's rules read (`ps_core.store.lifecycle`); the sign
  bit of ``shows`` flags a row changed since the last cut, so a delta export
  is a vectorised selection (`changed_rows`), not a dirty set.

All of these are views of one ``(rows, width + 3)`` uint32 array, a row's
state (as float32 bits) followed by its three metadata words, grown in place
(`ps_core.store.growth`): a pull's gather brings in the cache lines its push
then updates, and a push reads and writes each row in one gather and one
scatter.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypedDict, Unpack

import numpy as np
import numpy.typing as npt

from ..errors import InvalidValuesError, TableConfigError
from ..hashing import U64, sorted_distinct, uniform_from_keys
from ..parsing import json_int
from ..rows import put_rows, row_view
from .change_log import DEFAULT_LOG_KEYS, ChangeLog
from .growth import grow
from .index import KeyIndex
from .lifecycle import NO_LIFECYCLE, Admission, Lifecycle, score
from .optim import FTRL, AddDeltas, Optimizer, make_optimizer
from .pull_cache import PullCache, Pulled
from .staleness import StalenessLog

__all__ = ["MODES", "TableConfig", "SparseTable", "TableSnapshot", "SnapshotKind", "Eviction", "F32", "U32"]

F32 = npt.NDArray[np.float32]
U32 = npt.NDArray[np.uint32]
SnapshotKind = Literal["base", "delta"]
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_KEYS = np.zeros(0, dtype=np.uint64)
MODES = ("async", "sync", "geo")
"""Update modes a model may be declared with (docs/architecture.md, Update modes)."""
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
    lifecycle: Lifecycle | None = None
    """Admission and eviction rules (`ps_core.store.lifecycle`); None in a
    declaration: the shard's default (a declared table always has one)."""
    mode: str = "async"
    """How the model's workers update it (`MODES`): ``async`` pushes
    gradients the shard applies as they arrive; ``sync`` pushes gradients the
    shard holds until the workers' step closes, then applies their sum
    (`SparseTable.hold`, `apply_held`); ``geo`` pushes parameter differences
    the shard adds (its rows hold weights only: `row_rule`)."""
    max_staleness: int | None = None
    """Async only: a gradient computed from rows more than this many pushes
    old is down-weighted by ``(1 + max_staleness) / (1 + staleness)``; None
    counts staleness without bounding it."""

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
        if self.lifecycle is not None and not isinstance(self.lifecycle, Lifecycle):
            raise TableConfigError(f"table {name}: lifecycle must be a Lifecycle")
        if self.lifecycle is not None and self.lifecycle.embed_threshold and self.dim < 2:
            raise TableConfigError(f"table {name}: lazy embeddings (embed_threshold) need dim > 1")
        if self.lifecycle == NO_LIFECYCLE:
            # The default says nothing: one form of it, so declarations compare equal.
            object.__setattr__(self, "lifecycle", None)
        if self.mode not in MODES:
            raise TableConfigError(f"table {name}: mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.max_staleness is not None:
            if self.mode != "async":
                raise TableConfigError(f"table {name}: max_staleness bounds async updates, not {self.mode}")
            if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
                raise TableConfigError(f"table {name}: max_staleness must be an integer")
            if not 0 <= self.max_staleness < 2**31:
                raise TableConfigError(f"table {name}: max_staleness must be in [0, 2**31)")

    def row_rule(self) -> Optimizer:
        """What the shard applies to a push and how its rows are laid out: the
        declared optimizer, or for a geo model `AddDeltas` (weights only; the
        optimizer runs on the workers' copies)."""
        if self.mode == "geo":
            return AddDeltas()
        return make_optimizer(self.optimizer)

    def accepts(self, declared: TableConfig) -> bool:
        """Whether `declared` declares this table again: the same fields, its
        lifecycle left out (None) or the same."""
        return self == declared or (declared.lifecycle is None and replace(self, lifecycle=None) == declared)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the body of a declaration); the lifecycle only when set."""
        out: dict[str, Any] = {
            "name": self.name,
            "dim": self.dim,
            "optimizer": dict(self.optimizer),
            "init_scale": self.init_scale,
            "seed": self.seed,
        }
        if self.lifecycle is not None:
            out["lifecycle"] = self.lifecycle.to_dict()
        out["mode"] = self.mode
        if self.max_staleness is not None:
            out["max_staleness"] = self.max_staleness
        return out

    @classmethod
    def from_dict(cls, raw: object) -> TableConfig:
        """Build from a decoded JSON object; unknown or mistyped fields are errors."""
        if not isinstance(raw, dict):
            raise TableConfigError("a table declaration is a JSON object")
        unknown = set(raw) - {"name", "dim", "optimizer", "init_scale", "seed", "lifecycle", "mode", "max_staleness"}
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
        raw_lifecycle = raw.get("lifecycle")
        lifecycle = None if raw_lifecycle is None else Lifecycle.from_dict(raw_lifecycle)
        mode = raw.get("mode", "async")  # a declaration written before modes: async
        if not isinstance(mode, str):
            raise TableConfigError("mode must be a string")
        bound = raw.get("max_staleness")
        if bound is not None:
            bound = json_int(bound, "max_staleness", maximum=2**31 - 1, error=TableConfigError)
        return cls(name, dim, dict(opt), float(scale), seed, lifecycle, mode, bound)


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
    """The export version this snapshot closes (every row's ``updated_at``)."""
    kind: SnapshotKind
    """``"base"`` (every live row) or ``"delta"`` (rows changed after `parent`)."""
    parent: int | None
    """For a delta, the version it applies on top of; None for a base."""
    keys: U64
    """(n,) uint64 feature ids, distinct."""
    data: F32
    """(n, dim * slots) float32: each row's weights and optimizer state (see `ps_core.store.optim`)."""
    updated_at: U32
    """(n,) the version of the cut that wrote each row (files of older writers: of its last change)."""
    last_seen: U32
    """(n,) event time of each row's last update, whole seconds."""
    shows: F32
    """(n,) impressions counted for each key, as stored: times `count_scale`
    they are the decayed counts (format 1 stored whole uint32 counts)."""
    clicks: F32
    """(n,) clicks counted for each key, stored as `shows` are."""
    deleted: U64
    """(m,) keys deleted since `parent` and absent at the cut (empty for a base).
    May name keys `parent` never held (inserted and deleted in between)."""
    count_scale: npt.NDArray[np.float64] = field(default_factory=lambda: np.ones(1))
    """(1,) the table's count scale at the cut (`SparseTable.count_scale`)."""
    sketch_cells: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    """(c,) cells of the table's admission sketch (flat positions) set since
    `parent`, or every non-zero cell for a base (`ps_core.store.lifecycle.CountSketch`)."""
    sketch_values: npt.NDArray[np.uint8] = field(default_factory=lambda: np.zeros(0, np.uint8))
    """(c,) their values."""

    ARRAYS = (
        "keys",
        "data",
        "updated_at",
        "last_seen",
        "shows",
        "clicks",
        "deleted",
        "count_scale",
        "sketch_cells",
        "sketch_values",
    )
    """Names of the array fields, in file order."""
    OPTIONAL = frozenset({"count_scale", "sketch_cells", "sketch_values"})
    """Members a format 1 file does not have (their defaults: no decay, no sketch)."""

    def __post_init__(self) -> None:
        for name in ("shows", "clicks"):
            a = getattr(self, name)
            if a.dtype == np.uint32:  # format 1: whole counts
                object.__setattr__(self, name, a.astype(np.float32))
        n = self.keys.shape[0] if self.keys.ndim == 1 else -1
        width = self.config.dim * self.config.row_rule().slots
        expect: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
            "keys": (np.dtype(np.uint64), (n,)),
            "data": (np.dtype(np.float32), (n, width)),
            "updated_at": (np.dtype(np.uint32), (n,)),
            "last_seen": (np.dtype(np.uint32), (n,)),
            "shows": (np.dtype(np.float32), (n,)),
            "clicks": (np.dtype(np.float32), (n,)),
            "count_scale": (np.dtype(np.float64), (1,)),
            "sketch_values": (np.dtype(np.uint8), (self.sketch_cells.shape[0],)),
        }
        for name, (dtype, shape) in expect.items():
            a = getattr(self, name)
            if a.dtype != dtype or a.shape != shape:
                raise ValueError(
                    f"snapshot of table {self.table}: {name} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}"
                )
        if self.deleted.dtype != np.uint64 or self.deleted.ndim != 1:
            raise ValueError(f"snapshot of table {self.table}: deleted must be 1-d uint64")
        if self.sketch_cells.dtype != np.int64 or self.sketch_cells.ndim != 1:
            raise ValueError(f"snapshot of table {self.table}: sketch_cells must be 1-d int64")
        scale = float(self.count_scale[0])
        if not 0 < scale <= 1:
            raise ValueError(f"snapshot of table {self.table}: count_scale {scale} is not in (0, 1]")
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


_META = ("last_seen", "shows", "clicks")
"""The columns of `SparseTable.meta`, in order: uint32 event time, then the
float32 counts; the sign bit of ``shows`` (a count is never negative) marks
the row changed since the last cut."""
_CHANGED = np.uint32(1 << 31)
_COUNT_BITS = np.uint32((1 << 31) - 1)
_COUNT_MAX = float(np.finfo(np.float32).max)
EVICTION_STEP_ROWS = 1 << 20
"""Rows one step of an eviction pass looks at (`SparseTable.eviction_steps`)."""
_CUT_SAMPLE = 1 << 18
"""Rows sampled to place a stepped pass's row-cap cut."""
_MIN_COUNT_SCALE = 1e-25
"""Below this `count_scale` the stored counts are rescaled (float32 holds
counts up to ~3e38, so stored ones up to ~1e13 stay finite)."""


@dataclass
class Eviction:
    """What one eviction pass (`SparseTable.evict`) removed."""

    scanned: int = 0
    """Live rows looked at (the table's rows when the pass began)."""
    inserted: int = 0
    """Rows the table gained since the previous pass ended (what one
    interval's pushes added: a table with a cap exceeds it by at most this)."""
    by_rule: dict[str, int] = field(default_factory=lambda: {"ttl": 0, "score": 0, "max_rows": 0})
    """Rows removed by each rule (a row is counted under the first rule that removes it)."""
    bytes_freed: int = 0
    """Bytes of the removed rows (rows, keys and their index slots), now reusable by new rows."""
    pause_ms: float = 0.0
    """How long the pass held the table."""

    @property
    def removed(self) -> int:
        return sum(self.by_rule.values())


class PushExtras(TypedDict, total=False):
    """What a push (`SparseTable.push`, `hold`) may carry beside its keys and gradients."""

    counts: npt.ArrayLike | None
    """(n, 2) shows and clicks to add to the rows (None: none)."""
    event_time: float | None
    """Seconds since the epoch, the rows' ``last_seen`` (None: now)."""


class SparseTable:
    """One table's rows on one shard. Not thread-safe: one event loop owns it."""

    def __init__(
        self, config: TableConfig, *, initial_rows: int = 1024, change_log_keys: int = DEFAULT_LOG_KEYS
    ) -> None:
        """`change_log_keys`: what a geo table's `changes` holds at most."""
        self.config = config
        self.dim = config.dim
        self.optimizer: Optimizer = config.row_rule()
        self.width = config.dim * self.optimizer.slots
        self.index = KeyIndex(initial_slots=max(16, int(initial_rows / 0.6)))
        self.version = 1
        """The open export version: the cut closing it carries the rows changed now."""
        self.last_snapshot = 0
        """The version of the last cut (`snapshot`, or a restore's `mark_exported`);
        0, the empty table, before any. A delta is always taken relative to it."""
        self.pushes = 0
        """Push calls applied."""
        self.staleness = StalenessLog(config.max_staleness)
        """How stale the applied gradients were (`ps_core.store.staleness`)."""
        self.changes = ChangeLog(change_log_keys) if config.mode == "geo" else None
        """A geo table's keys changed by pushes (recorded by the shard, which
        knows their request ids) and removals (`ps_core.store.change_log`)."""
        self._held: list[tuple[U64, F32, F32, float]] = []
        self.held_keys = 0
        """Sync mode: keys of the pushes held for the step's close (`hold`)."""
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
        self._zero_row = row_view(self._full_rows(zero_state))
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
        self.lifecycle = NO_LIFECYCLE
        self.admission: Admission | None = None
        self._sketch_at_cut: npt.NDArray[np.uint8] | None = None
        self.set_lifecycle(config.lifecycle)
        self.count_scale = 1.0
        """Decay by scale: a row's true (decayed) shows and clicks are its
        stored ones times this. An eviction pass multiplies it by `decay`
        instead of touching every row, and a push adds counts divided by it;
        so rows that did not change need no rewrite (nor a place in the next
        delta), and a restore of stored rows with the last cut's scale
        reads the same counts."""
        self.gate: Callable[[U64], npt.NDArray[np.bool_]] | None = None
        """With lazy embeddings, which keys without a row may get one (their
        score in the gating table reaches the threshold); set by the shard."""
        self.gated = 0
        """Key updates dropped by the lazy-embedding gate."""
        self.newest_event = 0.0
        """The newest event time stamped on a row (TTL's clock)."""
        self.evicted = Eviction().by_rule
        """Rows removed by each eviction rule since start."""
        self.eviction_passes = 0
        self.bytes_freed = 0
        """Bytes of the rows removed by eviction since start (reused by new rows)."""
        self.last_eviction: Eviction | None = None
        self._rows_after_pass = 0
        self.most_over_cap = (0, 0)
        self._sampler = np.random.default_rng([config.seed, 0xE71C7])
        """The most rows over `max_rows` a pass found, and the rows inserted
        since the pass before it (the excess is at most these)."""
        self._alloc(0)

    def set_lifecycle(self, lifecycle: Lifecycle | None) -> None:
        """Take `lifecycle`'s rules from now on. The admission counts carry
        over when the rule and sketch size stay; rows are not touched."""
        lc = lifecycle or NO_LIFECYCLE
        old = self.admission
        self.config = replace(self.config, lifecycle=lifecycle)
        self.lifecycle = lc
        if lc.admit_kind == "none":
            self.admission, self._sketch_at_cut = None, None
            return
        if old is not None and (old.kind, old.lifecycle.sketch_bytes) == (lc.admit_kind, lc.sketch_bytes):
            old.lifecycle, old.value = lc, lc.admit_value
            return
        self.admission = Admission(lc, seed=self.config.seed)
        sketch = self.admission.sketch
        self._sketch_at_cut = None if sketch is None else sketch.state()

    # -- storage -----------------------------------------------------------
    def _alloc(self, cap: int) -> None:
        self._rows: U32 = np.zeros((cap, self.width + len(_META)), dtype=np.uint32)
        """The storage: per row, `width` float32 state words, then `_META`."""
        self._views()

    def _views(self) -> None:
        """The named views of `_rows` (made again whenever it is resized)."""
        self._rows_1d = row_view(self._rows)
        w = self.width
        self.data: F32 = self._rows[:, :w].view(np.float32)
        self.meta: U32 = self._rows[:, w:]
        """Per-row metadata; its columns are the arrays named in `_META`."""
        self.last_seen: U32 = self.meta[:, 0]
        # Counts are float32 (decayed counts are fractions), stored as their
        # bits in the metadata words; see `count_scale`.
        self.clicks: F32 = self.meta[:, 2].view(np.float32)

    @property
    def shows(self) -> F32:
        """Each row's stored shows (a copy: the word also holds the changed flag)."""
        return (self.meta[:, 1] & _COUNT_BITS).view(np.float32)

    def changed(self) -> npt.NDArray[np.bool_]:
        """For each row handed out, whether it changed since the last cut
        (what the next delta holds, if it is live)."""
        return self.meta[: self.index.num_rows, 1] >= _CHANGED

    def _full_rows(self, state: F32) -> U32:
        """Storage rows holding `state` (n, width) and zero metadata."""
        out = np.zeros((state.shape[0], self.width + len(_META)), dtype=np.uint32)
        out[:, : self.width] = state.view(np.uint32)
        return out

    def _sync_capacity(self) -> None:
        """Grow the rows to the index's row capacity, in place (`KeyIndex.grow`)."""
        cap = self.index.row_capacity
        if cap > self._rows.shape[0]:
            grow(self._rows, (cap, self._rows.shape[1]))
            self._views()

    def __len__(self) -> int:
        return self.index.size

    def memory_bytes(self) -> int:
        """Bytes allocated for this table: index, rows and metadata."""
        sketch = None if self.admission is None else self.admission.sketch
        kept = 0 if sketch is None else 2 * sketch.nbytes  # with its copy at the last cut
        return int(self.index.nbytes() + self._rows.nbytes + kept)

    # -- values --------------------------------------------------------------
    def initial_weights(self, keys: U64) -> F32:
        """The weights (n, dim) a key has before its first update."""
        scale = self.config.init_scale
        if scale == 0.0:
            return np.zeros((keys.size, self.dim), dtype=np.float32)
        u = uniform_from_keys(keys, self.config.seed, self.dim)
        return ((u * 2.0 - 1.0) * scale).astype(np.float32)

    def absent_weights(self, keys: U64) -> F32:
        """What a pull reads for keys without a row: their initial weights,
        or zeros with lazy embeddings (the key has no embedding yet)."""
        if self.lifecycle.embed_threshold and self.dim > 1:
            return np.zeros((keys.size, self.dim), dtype=np.float32)
        return self.initial_weights(keys)

    def _initial_rows(self, keys: U64) -> npt.NDArray[np.void]:
        """The storage rows (as `row_view` items) of keys before their first update."""
        if self.config.init_scale == 0.0:
            return self._zero_row
        return row_view(self._full_rows(self.optimizer.rows_from_weights(self.initial_weights(keys))))

    @property
    def clock(self) -> int:
        """The table's clock: pushes applied, plus 1 (0 means unknown on the wire)."""
        return self.pushes + 1

    def pull(self, keys: npt.ArrayLike) -> F32:
        """Current weights (n, dim) of `keys`, in their order; allocates nothing."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        self.pulls += 1
        rows, free = self.index.probe(k)
        missing = np.flatnonzero(rows < 0)
        if missing.size == k.size:  # nothing stored (perhaps no row at all yet)
            self._pull_cache.add(k, rows, missing, free, None)
            return self.absent_weights(k)
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
            put_rows(out, missing, self.absent_weights(k.take(missing)))
        return out

    def push(self, keys: npt.ArrayLike, grads: npt.ArrayLike, **extras: Unpack[PushExtras]) -> int:
        """Apply gradients; returns the number of distinct keys updated.

        `grads` is (n, dim) (or (n,) when dim is 1). Gradients of repeated keys
        are summed before one optimizer step per key. The `PushExtras`: the
        shows and clicks to add, and the rows' ``last_seen``. Non-finite
        values are rejected before anything changes.

        In steps: validate; find or insert the keys' rows (reusing the pull of
        the same keys); gather the rows, checking for repeated keys; sum the
        gradients of repeated keys; one optimizer step per row; stamp the
        rows' metadata; write the rows back whole.
        """
        k, g, c, seen = self._checked_push(keys, grads, extras)
        if k.size == 0:
            return 0
        pulled = self._pull_cache.take(k)
        if self.admission is not None or self.gate is not None:
            k, g, c, pulled = self._admitted(k, g, c, pulled)
            if k.size == 0:
                self.pushes += 1  # the admission's counts changed
                return 0
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
        self._rows_1d.put(uniq, row_view(full))
        self.pushes += 1
        self._pull_cache.wrote()
        return int(uniq.size)

    def hold(self, keys: npt.ArrayLike, grads: npt.ArrayLike, **extras: Unpack[PushExtras]) -> int:
        """Sync mode: check a push as `push` does and hold it, unapplied,
        until `apply_held`; returns the number of keys held."""
        k, g, c, seen = self._checked_push(keys, grads, extras)
        if k.size:
            if c is None:
                c = np.zeros((k.size, 2), dtype=np.float32)
            self._held.append((k, g, c, seen))
            self.held_keys += int(k.size)
        return int(k.size)

    def apply_held(self) -> int:
        """Sync mode: apply the sum of every held push as one push (the
        gradients of a key summed, one optimizer step); returns the distinct
        keys updated."""
        if not self._held:
            return 0
        held, self._held = self._held, []
        self.held_keys = 0
        keys = np.concatenate([h[0] for h in held])
        grads = np.concatenate([h[1] for h in held])
        counts = np.concatenate([h[2] for h in held])
        return self.push(keys, grads, counts=counts, event_time=max(h[3] for h in held))

    def _checked_push(
        self, keys: npt.ArrayLike, grads: npt.ArrayLike, extras: PushExtras
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
        counts, event_time = extras.get("counts"), extras.get("event_time")
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

    def _admitted(self, k: U64, g: F32, c: F32 | None, pulled: Pulled | None) -> tuple[U64, F32, F32 | None, Pulled]:
        """The push without the keys that have no row and are not admitted
        (`Admission.decide`, then the lazy-embedding `gate`), and what the
        lookup found for the rest (the pull's, or a probe's, reused by
        `_rows_for_push`)."""
        if pulled is None:
            rows, free = self.index.probe(k)
            missing = np.flatnonzero(rows < 0)
            pulled = Pulled(k, rows, missing, free.take(missing), None, self.index.mutations, self._pull_cache.writes)
        elif pulled.missing.size and pulled.free is None:
            # Inserts since the pull: some keys absent then may have rows now.
            again = self.index.lookup(k.take(pulled.missing))
            rows = pulled.rows
            rows[pulled.missing] = again
            pulled = pulled._replace(missing=pulled.missing[again < 0])
        missing = pulled.missing
        if not missing.size:
            return k, g, c, pulled
        absent = k.take(missing)
        ok = np.ones(missing.size, dtype=bool)
        if self.admission is not None:
            ok = self.admission.decide(absent, None if c is None else c[missing])
        if self.gate is not None:
            passed = self.gate(absent)
            self.gated += int(np.count_nonzero(ok & ~passed))
            ok &= passed
        if ok.all():
            return k, g, c, pulled
        keep = np.ones(k.size, dtype=bool)
        keep[missing[~ok]] = False
        position = np.cumsum(keep) - 1  # of each kept key in the kept push
        gathered = pulled.gathered
        pulled = Pulled(
            k[keep],
            pulled.rows[keep],
            position[missing[ok]],
            None if pulled.free is None else pulled.free[ok],
            None if gathered is None else (gathered[0][keep], gathered[1][keep], gathered[2][keep]),
            pulled.mutations,
            pulled.writes,
        )
        return k[keep], g[keep], None if c is None else c[keep], pulled

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
            row_view(full).put(pulled.missing, self._zero_row)
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
        # last_seen and read it back with the gather the update needs
        # anyway; a repeated row reads a later occurrence's stamp. (Every
        # row stamped gets its last_seen in `_stamp`: nothing of it stays.)
        if self._stamps.size < n:
            self._stamps = np.arange(max(n, 2 * self._stamps.size), dtype=np.uint32)
        stamps = self._stamps[:n]
        self.last_seen[rows] = stamps
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
        """Stamp updated rows' metadata `meta` in place: the event time, shows
        and clicks added, and the flag of a row changed since the last cut."""
        meta[:, 0] = int(seen)
        if seen > self.newest_event:
            self.newest_event = seen
        if row_counts is None:
            meta[:, 1] |= _CHANGED
            return
        counts = np.empty((meta.shape[0], 2), dtype=np.uint32)
        counts[:, 0] = meta[:, 1] & _COUNT_BITS
        counts[:, 1] = meta[:, 2]
        added = row_counts if self.count_scale == 1.0 else np.divide(row_counts, self.count_scale)
        # In float64, saturating at float32's largest instead of reaching
        # inf (float32 counts are exact to 2**24, then approximate).
        total = np.add(counts.view(np.float32), added, dtype=np.float64)
        np.minimum(total, _COUNT_MAX, out=total)
        meta[:, 1:] = total.astype(np.float32).view(np.uint32)
        meta[:, 1] |= _CHANGED

    # -- versions, snapshots and deletes --------------------------------------
    def changed_rows(self) -> tuple[U64, npt.NDArray[np.int64]]:
        """Keys and rows of the live rows changed since the last cut (the next delta's)."""
        rows = np.flatnonzero(self.index.row_live & self.changed()).astype(np.int64)
        return self.index.row_keys[rows], rows

    def delete(self, keys: npt.ArrayLike, *, distinct: bool = False) -> U64:
        """Remove keys (eviction); returns those that were present. With
        `distinct`, the caller promises no key repeats (a sort is saved).

        The removed keys are remembered until the next `snapshot`, whose delta
        lists them as deleted.
        """
        self._pull_cache.clear()  # freed rows may be reused by other keys
        gone = self.index.delete(keys, distinct=distinct)
        if self.changes is not None:
            self.changes.record(gone)
        # Before any cut (or restore) the next delta's parent is the empty
        # table, which held none of them: nothing to log. So a shard that
        # never exports keeps no log that grows with what it evicts.
        if gone.size and self.last_snapshot > 0:
            self._deleted.append(gone)
            self._deleted_len += int(gone.size)
            if self._deleted_len >= 2 * self._deleted_fold_at:
                folded = sorted_distinct(np.concatenate(self._deleted))
                self._deleted, self._deleted_len = [folded], int(folded.size)
                self._deleted_fold_at = max(1024, self._deleted_len)
        return gone

    def scores(self, rows: npt.NDArray[np.intp] | None = None) -> F32:
        """The lifecycle score of `rows` (all rows handed out by default),
        from their decayed shows and clicks."""
        n = self.index.num_rows
        words = self.meta[:n, 1] if rows is None else self.meta[rows, 1]
        shows = (words & _COUNT_BITS).view(np.float32)
        clicks = self.clicks[:n] if rows is None else self.clicks[rows]
        return score(self.lifecycle, shows, clicks, self.count_scale)

    def key_scores(self, keys: U64) -> F32:
        """The lifecycle score of each key; 0 for keys without a row."""
        rows = self.index.lookup(keys)
        out = np.zeros(keys.size, dtype=np.float32)
        have = np.flatnonzero(rows >= 0)
        if have.size:
            out[have] = self.scores(rows[have])
        return out

    def evict(self) -> Eviction:
        """One eviction pass of the lifecycle's rules at once, in order: TTL,
        decay then the score threshold, then the row cap (lowest scores
        first, down to the low-water mark; among equal scores, the lowest
        rows). The removed keys are deleted as by `delete` (the next delta
        lists them) and their rows reused by later inserts: the arrays do not
        shrink, they stop growing. `eviction_steps` is the same pass in steps."""
        t0 = time.perf_counter()
        lc = self.lifecycle
        n = self.index.num_rows
        live = self.index.row_live
        report = self._new_eviction()
        remove = np.zeros(n, dtype=bool)
        s = self._ttl_and_score(0, n, live, remove, report)
        if lc.max_rows:
            left = np.flatnonzero(live & ~remove)
            over = left.size - int(lc.low_water * lc.max_rows)
            if left.size > lc.max_rows and over > 0:
                left_scores = self.scores(left) if s is None else s[left]
                # The over-th lowest score (a partition of values, cheaper
                # than of indices), then the rows under it and enough of it.
                cut = np.partition(left_scores, over - 1)[over - 1]
                under = left_scores < cut
                ties = np.flatnonzero(left_scores == cut)[: over - int(np.count_nonzero(under))]
                lowest = np.concatenate((left[under], left[ties]))
                remove[lowest] = True
                report.by_rule["max_rows"] = int(lowest.size)
        self._remove(np.flatnonzero(remove), report)
        report.pause_ms = (time.perf_counter() - t0) * 1e3
        self._passed(report)
        return report

    def eviction_steps(self, step_rows: int = EVICTION_STEP_ROWS) -> Iterator[Eviction]:
        """`evict`'s pass over a table of more than `step_rows` rows, a
        slice of `step_rows` rows at a time: between two slices it yields
        (the running report), so its caller lets the event loop run and the
        table's pause stays that of one slice. A smaller table takes `evict`'s
        single step. The row cap's cut is then estimated from a sample of
        the rows the other rules leave, so it takes the table to about its
        low-water mark; the other rules are exact. Pushes and cuts may run
        between slices: rows inserted meanwhile are left to the next pass."""
        if self.index.num_rows <= step_rows:
            yield self.evict()
            return
        t0 = time.perf_counter()
        n = self.index.num_rows
        live = self.index.row_live  # as the pass began
        report = self._new_eviction()
        cap_left, cut = self._sampled_cut(live)
        hold = time.perf_counter() - t0
        for lo in range(0, n, step_rows):
            t = time.perf_counter()
            hi = min(n, lo + step_rows)
            remove = np.zeros(hi - lo, dtype=bool)
            s = self._ttl_and_score(lo, hi, live[lo:hi], remove, report, decay=lo == 0)
            if cap_left > 0:
                if s is None:
                    s = self.scores(np.arange(lo, hi))
                low = np.flatnonzero(live[lo:hi] & ~remove & (s < cut))[:cap_left]
                remove[low] = True
                cap_left -= low.size
                report.by_rule["max_rows"] += int(low.size)
            self._remove(np.flatnonzero(remove) + lo, report)
            hold += time.perf_counter() - t
            report.pause_ms = max(report.pause_ms, hold * 1e3)
            hold = 0.0
            if hi < n:
                yield report
        self._passed(report)
        yield report

    def _new_eviction(self) -> Eviction:
        return Eviction(scanned=len(self), inserted=max(0, len(self) - self._rows_after_pass))

    def _ttl_and_score(
        self,
        lo: int,
        hi: int,
        live: npt.NDArray[np.bool_],
        remove: npt.NDArray[np.bool_],
        report: Eviction,
        *,
        decay: bool = True,
    ) -> F32 | None:
        """Mark in `remove` the rows ``lo:hi`` that TTL and the score
        threshold remove (decaying the counts first when `decay`); count them
        in `report`. Returns the rows' scores when they were computed."""
        lc = self.lifecycle
        if lc.ttl_s and self.newest_event:
            np.logical_and(live, self.last_seen[lo:hi] < self.newest_event - lc.ttl_s, out=remove)
            report.by_rule["ttl"] += int(np.count_nonzero(remove))
        if not lc.min_score:
            return None
        if decay:
            self.count_scale *= lc.decay
            if self.count_scale < _MIN_COUNT_SCALE:
                self._rescale_counts()
        s = self.scores(np.arange(lo, hi)) if (lo, hi) != (0, self.index.num_rows) else self.scores()
        low = live & ~remove & (s < lc.min_score)
        report.by_rule["score"] += int(np.count_nonzero(low))
        remove |= low
        return s

    def _sampled_cut(self, live: npt.NDArray[np.bool_]) -> tuple[int, float]:
        """For a pass in steps: how many rows the cap should remove, and the
        score under which they go, estimated from a sample of the live rows
        that TTL and the score threshold leave (after this pass's decay)."""
        lc = self.lifecycle
        if not lc.max_rows:
            return 0, 0.0
        rows = np.flatnonzero(live)
        sample = rows[self._sampler.integers(0, rows.size, min(rows.size, _CUT_SAMPLE))] if rows.size else rows
        keep = np.ones(sample.size, dtype=bool)
        if lc.ttl_s and self.newest_event:
            keep &= self.last_seen[sample] >= self.newest_event - lc.ttl_s
        s = self.scores(sample)
        if lc.min_score:
            keep &= s * np.float32(lc.decay) >= lc.min_score
            s = s * np.float32(lc.decay)
        left = int(rows.size * keep.mean()) if sample.size else 0
        over = left - int(lc.low_water * lc.max_rows)
        if left <= lc.max_rows or over <= 0 or not keep.any():
            return 0, 0.0
        return over, float(np.quantile(s[keep], over / left))

    def _remove(self, rows: npt.NDArray[np.intp], report: Eviction) -> None:
        """Delete the keys of `rows` (distinct, live) for an eviction pass."""
        if rows.size:
            per_row = self.memory_bytes() / max(1, self.index.row_capacity)
            self.delete(self.index.row_keys[rows], distinct=True)
            report.bytes_freed += int(rows.size * per_row)

    def _passed(self, report: Eviction) -> None:
        """Record a finished pass."""
        lc = self.lifecycle
        for rule, count in report.by_rule.items():
            self.evicted[rule] += count
        self.eviction_passes += 1
        self.bytes_freed += report.bytes_freed
        self._rows_after_pass = len(self)
        if lc.max_rows and report.scanned - lc.max_rows > self.most_over_cap[0]:
            self.most_over_cap = (report.scanned - lc.max_rows, report.inserted)
        self.last_eviction = report

    def _rescale_counts(self) -> None:
        """Fold `count_scale` into every row's stored counts (rare: after
        thousands of decays). Every row changes, so the next delta holds all."""
        n = self.index.num_rows
        shows = (self.meta[:n, 1] & _COUNT_BITS).view(np.float32) * np.float32(self.count_scale)
        self.meta[:n, 1] = shows.view(np.uint32) | _CHANGED
        self.clicks[:n] *= np.float32(self.count_scale)
        self.count_scale = 1.0
        self._pull_cache.wrote()

    def lifecycle_stats(self) -> dict[str, Any]:
        """The lifecycle's figures, for the shard's stats."""
        last = self.last_eviction
        out: dict[str, Any] = {
            "lifecycle": self.lifecycle.to_dict(),
            "evicted": dict(self.evicted),
            "eviction_passes": self.eviction_passes,
            "embed_gated": self.gated,
            "bytes_freed": self.bytes_freed,
            "most_over_cap": self.most_over_cap[0],
            "inserted_before_most_over_cap": self.most_over_cap[1],
            "last_eviction_ms": None if last is None else round(last.pause_ms, 3),
            "last_eviction_bytes_freed": None if last is None else last.bytes_freed,
        }
        if self.admission is not None:
            out["admission"] = self.admission.stats()
        return out

    def snapshot(self, since: int | None = None, version: int | None = None) -> TableSnapshot:
        """Cut export `version` (default: the open version): copy its rows,
        then open the version after it.

        ``since=None`` copies every live row (a base). Otherwise `since` must be
        the version of the previous cut (`last_snapshot`) and the delta holds
        the live rows changed since (flagged) plus the keys deleted since
        that cut and absent now (a key deleted and inserted again is a live
        row, not a deletion). Rows changed after the cut belong to the next
        version. Only memory copies happen here: this is the pause of a cut.
        """
        if since is not None and since != self.last_snapshot:
            raise ValueError(
                f"table {self.config.name}: a delta must follow the last cut "
                f"(version {self.last_snapshot}), not version {since}"
            )
        live = self.index.row_live
        sel = live if since is None else live & self.changed()
        deleted = _NO_KEYS if since is None else self._deleted_since_cut()
        cut = self.version if version is None else version
        snap = self._copy_rows(np.flatnonzero(sel), cut, since, deleted)
        # The cut's number, not the open version: after a cut at MAX_VERSION
        # the open one is past any a cut may take.
        self.mark_exported(cut)
        return snap

    def _sketch_cells(self, parent: int | None) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
        """The admission sketch's cells for a snapshot: those set since the
        last cut for a delta, the non-zero ones for a base."""
        sketch = None if self.admission is None else self.admission.sketch
        if sketch is None:
            return np.zeros(0, np.int64), np.zeros(0, np.uint8)
        flat = sketch.cells.reshape(-1)
        if parent is None or self._sketch_at_cut is None:
            cells = np.flatnonzero(flat)
        else:
            cells = np.flatnonzero(flat != self._sketch_at_cut.reshape(-1))
        return cells.astype(np.int64), flat[cells]

    def load_counts(self, count_scale: float, sketch_cells: npt.ArrayLike, sketch_values: npt.ArrayLike) -> None:
        """A snapshot's count scale and admission-sketch cells (a restore
        applies them version by version, after the rows)."""
        if not 0 < count_scale <= 1:
            raise InvalidValuesError(f"table {self.config.name}: count_scale {count_scale} is not in (0, 1]")
        self.count_scale = float(count_scale)
        cells = np.asarray(sketch_cells, dtype=np.int64)
        sketch = None if self.admission is None else self.admission.sketch
        if sketch is None or not cells.size:
            return
        flat = sketch.cells.reshape(-1)
        if cells.min() < 0 or cells.max() >= flat.size:
            # Another sketch size (the lifecycle changed): its counts do not map.
            return
        flat[cells] = np.asarray(sketch_values, dtype=np.uint8)

    def base_copy(self, version: int) -> TableSnapshot:
        """Every live row as a base labelled `version`, without cutting: the open
        version and the deletion log stay as they are (compaction uses this on
        a table restored to `version`)."""
        n = self.index.num_rows
        return self._copy_rows(np.flatnonzero(self.index.row_live[:n]), version, None, _NO_KEYS, base=True)

    def _copy_rows(
        self, rows: npt.NDArray[np.intp], version: int, parent: int | None, deleted: U64, *, base: bool = False
    ) -> TableSnapshot:
        if rows.size == self.index.num_rows:
            # Every row handed out is selected (no freed rows): a slice copy
            # is a straight memcpy, cheaper than a gather.
            def take(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
                return a[: rows.size].copy()
        else:

            def take(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
                return np.take(a, rows, axis=0)

        cells, values = self._sketch_cells(None if base else parent)
        return TableSnapshot(
            table=self.config.name,
            config=self.config,
            version=version,
            kind="base" if parent is None else "delta",
            parent=parent,
            keys=take(self.index.row_keys),
            data=take(self.data),
            # The flag says only "since the last cut": every row a cut
            # writes is labelled with its version.
            updated_at=np.full(rows.size, version, dtype=np.uint32),
            last_seen=take(self.last_seen),
            shows=(take(self.meta[:, 1]) & _COUNT_BITS).view(np.float32),
            clicks=take(self.clicks),
            deleted=deleted,
            count_scale=np.array([self.count_scale]),
            sketch_cells=cells,
            sketch_values=values,
        )

    def _deleted_since_cut(self) -> U64:
        """Distinct keys deleted since the last cut that have no row now."""
        if not self._deleted:
            return _NO_KEYS.copy()
        keys = sorted_distinct(np.concatenate(self._deleted))
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
        self.meta[: self.index.num_rows, 1] &= _COUNT_BITS  # nothing changed since this cut
        if self._sketch_at_cut is not None and self.admission is not None and self.admission.sketch is not None:
            self._sketch_at_cut[...] = self.admission.sketch.cells

    def load_rows(
        self,
        keys: npt.ArrayLike,
        data: npt.ArrayLike,
        updated_at: npt.ArrayLike,
        last_seen: npt.ArrayLike,
        shows: npt.ArrayLike,
        clicks: npt.ArrayLike,
    ) -> int:
        """Upsert whole rows as stored (state and metadata); returns how many
        keys were new. Keys must be distinct and data finite; a refused call
        changes nothing. `updated_at` is checked, not kept: a loaded row is
        unchanged since the cut it came from, so a later delta carries it only
        if it changes again (meant for restoring a chain, then `mark_exported`).
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
        if any(m.size and (m.min() < 0 or m.max() >= 2**32) for m in meta[:2]):
            raise InvalidValuesError(f"table {name}: updated_at and last_seen must be in [0, 2**32)")
        if any(m.size and not (m.min() >= 0 and np.isfinite(m).all()) for m in meta[2:]):
            raise InvalidValuesError(f"table {name}: shows and clicks must be finite and >= 0")
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
        if self.changes is not None:  # rows replaced wholesale: no earlier question holds
            self.changes.reset()
        self.data[rows] = d
        self.last_seen[rows] = meta[1]
        self.meta[rows, 1] = meta[2].astype(np.float32).view(np.uint32)
        self.clicks[rows] = meta[3]
        return int(new_rows.size)
