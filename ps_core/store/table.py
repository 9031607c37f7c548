"""Sparse tables: uint64 feature ids → fixed-width float32 rows (`SparseTable`).

A `SparseTable` composes the parts of one table on one shard:

- its storage (`ps_core.store.storage.RowStorage`): the key index and one
  array of whole rows, a row's weights and optimizer state side by side,
  then its metadata words, grown in place;
- the per-row metadata view (`ps_core.store.row_meta.RowMeta`): last_seen,
  decayed shows and clicks, and the flag of a row changed since the last cut;
- admission and the push's checks (`ps_core.store.push`), eviction passes
  (`ps_core.store.eviction.Evictor`), and export cuts
  (`ps_core.store.snapshot.Cuts`).

`pull` never allocates: an absent key reads its deterministic initial value.
`push` sums the gradients of duplicate keys, then applies the optimizer once
per distinct key, in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Unpack

import numpy as np
import numpy.typing as npt

from ..hashing import U64, uniform_from_keys
from ..rows import put_rows, row_view
from .change_log import DEFAULT_LOG_KEYS, ChangeLog
from .eviction import EVICTION_STEP_ROWS, Eviction, Evictor
from .index import KeyIndex
from .lifecycle import NO_LIFECYCLE, Admission, CountSketch, Lifecycle
from .optim import FTRL, Deriving, FTRLMixture, Optimizer
from .pull_cache import PulledRows
from .push import CheckedPush, PushExtras, admitted, checked_push, sum_duplicates
from .row_meta import RowMeta
from .snapshot import Cuts, TableSnapshot, checked_rows
from .staleness import StalenessLog
from .storage import F32, U32, RowStorage
from .table_config import TableConfig

__all__ = ["SparseTable", "F32", "U32"]


class SparseTable:
    """One table's rows on one shard. Not thread-safe: one event loop owns it."""

    def __init__(
        self, config: TableConfig, *, initial_rows: int = 1024, change_log_keys: int = DEFAULT_LOG_KEYS
    ) -> None:
        """`change_log_keys`: what a geo table's `changes` holds at most."""
        self.config = config
        self.dim = config.dim
        self.optimizer: Optimizer = config.row_rule()
        self.width = self.optimizer.width(config.dim)
        self.storage = RowStorage(self.width, initial_rows=initial_rows)
        """The key index and the rows (`ps_core.store.storage`)."""
        self.rows_meta = RowMeta(self.storage)
        """The rows' metadata (`ps_core.store.row_meta`)."""
        self.cuts = Cuts(self.storage, self.rows_meta)
        """The export versions (`ps_core.store.snapshot`)."""
        self.evictor = Evictor(
            self.storage, self.rows_meta, delete=self._evicted, memory_bytes=self.memory_bytes, seed=config.seed
        )
        """The eviction passes and their figures (`ps_core.store.eviction`)."""
        self.pushes = 0
        """Push calls applied."""
        self.pulls = 0
        """Pull calls served."""
        self.staleness = StalenessLog(config.max_staleness)
        """How stale the applied gradients were (`ps_core.store.staleness`)."""
        self.changes = ChangeLog(change_log_keys) if config.mode == "geo" else None
        """A geo table's keys changed by pushes (recorded by the shard, which
        knows their request ids) and removals (`ps_core.store.change_log`)."""
        self._held: list[CheckedPush] = []
        self.held_keys = 0
        """Sync mode: keys of the pushes held for the step's close (`hold`)."""
        self._init_values()
        self.lifecycle = NO_LIFECYCLE
        self.admission: Admission | None = None
        self.set_lifecycle(config.lifecycle)
        self.gate: Callable[[U64], npt.NDArray[np.bool_]] | None = None
        """With lazy embeddings, which keys without a row may get one (their
        score in the gating table reaches the threshold); set by the shard."""
        self.gated = 0
        """Key updates dropped by the lazy-embedding gate."""

    def _init_values(self) -> None:
        """The constants of a key's initial row when its weights start at 0."""
        # The whole row (state, zero metadata) of a key whose initial weight
        # is 0 (init_scale 0): a constant, written to new rows as it is.
        zero_state = self.optimizer.rows_from_weights(np.zeros((1, self.dim), np.float32))
        self._zero_row = row_view(self.storage.full_rows(zero_state))
        # FTRL's step starts by deriving w and sqrt(n) from the rows, as a
        # pull does: a push right after a pull of the same keys, with no row
        # changed in between, takes them from the pull. Fresh rows (absent at
        # the pull) start from `zero_state`, whose derivation is a constant;
        # other initial values would have to be derived per key, so then the
        # push derives everything itself.
        self._derive: Deriving | None = None
        if isinstance(self.optimizer, (FTRL, FTRLMixture)) and self.config.init_scale == 0.0:
            self._derive = self.optimizer
            self._zero_derived = self.optimizer.derive(zero_state, self.dim)

    def set_lifecycle(self, lifecycle: Lifecycle | None) -> None:
        """Take `lifecycle`'s rules from now on. The admission counts carry
        over when the rule and sketch size stay; rows are not touched."""
        lc = lifecycle or NO_LIFECYCLE
        old = self.admission
        self.config = replace(self.config, lifecycle=lifecycle)
        self.lifecycle = lc
        if lc.admit_kind == "none":
            self.admission, self.cuts.sketch_at_cut = None, None
            return
        if old is not None and (old.kind, old.lifecycle.sketch_bytes) == (lc.admit_kind, lc.sketch_bytes):
            old.lifecycle, old.value = lc, lc.admit_value
            return
        self.admission = Admission(lc, seed=self.config.seed)
        sketch = self.admission.sketch
        self.cuts.sketch_at_cut = None if sketch is None else sketch.state()

    # -- the parts' figures, under the names the rest of the code reads -------
    @property
    def index(self) -> KeyIndex:
        """The key index (`RowStorage.index`)."""
        return self.storage.index

    @property
    def data(self) -> F32:
        """(rows, width) each row's weights and optimizer state (a view)."""
        return self.storage.data

    @property
    def meta(self) -> U32:
        """(rows, 3) each row's metadata words (`ps_core.store.row_meta.COLUMNS`)."""
        return self.storage.meta

    @property
    def last_seen(self) -> U32:
        """Each row's event time of its last update (a view)."""
        return self.rows_meta.last_seen

    @property
    def shows(self) -> F32:
        """Each row's stored shows (a copy: the word also holds the changed flag)."""
        return self.rows_meta.shows

    @property
    def clicks(self) -> F32:
        """Each row's stored clicks (a view)."""
        return self.rows_meta.clicks

    @property
    def count_scale(self) -> float:
        """A row's true (decayed) counts are its stored ones times this (`RowMeta.count_scale`)."""
        return self.rows_meta.count_scale

    @property
    def newest_event(self) -> float:
        """The newest event time stamped on a row (TTL's clock)."""
        return self.rows_meta.newest_event

    @property
    def version(self) -> int:
        """The open export version: the cut closing it carries the rows changed now."""
        return self.cuts.version

    @property
    def last_snapshot(self) -> int:
        """The version of the last cut (0, the empty table, before any)."""
        return self.cuts.last_snapshot

    @property
    def evicted(self) -> dict[str, int]:
        """Rows removed by each eviction rule since start."""
        return self.evictor.evicted

    @property
    def last_eviction(self) -> Eviction | None:
        """The report of the latest finished eviction pass."""
        return self.evictor.last_eviction

    @property
    def clock(self) -> int:
        """The table's clock: pushes applied, plus 1 (0 means unknown on the wire)."""
        return self.pushes + 1

    def changed(self) -> npt.NDArray[np.bool_]:
        """For each row handed out, whether it changed since the last cut."""
        return self.rows_meta.changed()

    def __len__(self) -> int:
        return self.storage.index.size

    def memory_bytes(self) -> int:
        """Bytes allocated for this table: index, rows and metadata."""
        sketch = None if self.admission is None else self.admission.sketch
        kept = 0 if sketch is None else 2 * sketch.nbytes  # with its copy at the last cut
        return self.storage.nbytes() + kept

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
        if self.lifecycle.embed_threshold and self.config.embeddings:
            return np.zeros((keys.size, self.dim), dtype=np.float32)
        return self.initial_weights(keys)

    def _initial_rows(self, keys: U64) -> npt.NDArray[np.void]:
        """The storage rows (as `row_view` items) of keys before their first update."""
        if self.config.init_scale == 0.0:
            return self._zero_row
        state = self.optimizer.rows_from_weights(self.initial_weights(keys))
        return row_view(self.storage.full_rows(state))

    def pull(self, keys: npt.ArrayLike) -> F32:
        """Current weights (n, dim) of `keys`, in their order; allocates nothing."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        self.pulls += 1
        storage = self.storage
        rows, free = storage.index.probe(k)
        missing = np.flatnonzero(rows < 0)
        if missing.size == k.size:  # nothing stored (perhaps no row at all yet)
            storage.pull_cache.add(k, rows, missing, free, None)
            return self.absent_weights(k)
        # Absent keys gather row 0 (mode="clip" maps -1 there): one gather
        # and one weight derivation for all keys, then overwrite those few,
        # beats splitting the keys into present and absent first.
        # (A gather of `data`, a strided view, is slow: gather whole rows.)
        full = storage.rows.take(rows, axis=0, mode="clip")
        state = full[:, : self.width].view(np.float32)
        gathered = None
        if self._derive is not None:
            out, sqrt_n = self._derive.derive(state, self.dim)
            gathered = (full, out.copy(), sqrt_n)  # `out` is the caller's
        else:
            out = self.optimizer.weights(state, self.dim)
        storage.pull_cache.add(k, rows, missing, free.take(missing), gathered)
        if missing.size:
            put_rows(out, missing, self.absent_weights(k.take(missing)))
        return out

    # -- pushes --------------------------------------------------------------
    def push(self, keys: npt.ArrayLike, grads: npt.ArrayLike, **extras: Unpack[PushExtras]) -> int:
        """Apply gradients; returns the number of distinct keys updated.

        `grads` is (n, dim) (or (n,) when dim is 1). Gradients of repeated keys
        are summed before one optimizer step per key. The `PushExtras`: the
        shows and clicks to add, and the rows' ``last_seen``. Non-finite
        values are rejected before anything changes.
        """
        return self._apply(checked_push(self.config.name, self.dim, keys, grads, extras))

    def _apply(self, push: CheckedPush) -> int:
        """Apply a checked push, in steps: find or insert the keys' rows
        (reusing the pull of the same keys); gather the rows, checking for
        repeated keys; sum the gradients of repeated keys; one optimizer step
        per row; stamp the rows' metadata; write the rows back whole."""
        if push.keys.size == 0:
            return 0
        storage = self.storage
        pulled = storage.pull_cache.take(push.keys)
        if self.admission is not None or self.gate is not None:
            push, pulled, gated = admitted(storage, push, pulled, self.admission, self.gate)
            self.gated += gated
            if push.keys.size == 0:
                self.pushes += 1  # the admission's counts changed
                return 0
        k, g, c = push.keys, push.grads, push.counts
        rows = storage.rows_for_push(k, pulled, self._initial_rows)
        # With no row changed since the pull, what it gathered and derived
        # still holds, but for the keys it found absent (inserted just now).
        full, derived = self._pulled_rows(pulled)
        full, distinct = storage.gather(k, rows, full)
        row_counts: npt.NDArray[Any] | None
        if distinct:
            # Distinct keys (what the client sends): no grouping needed.
            uniq, summed, row_counts = rows, g, c
        else:
            derived = None  # per occurrence, not per distinct row
            uniq, summed, row_counts = sum_duplicates(rows, g, c)
            full = storage.rows.take(uniq, axis=0)
        # Update the gathered rows in place, then write them back whole.
        w = self.width
        if derived is not None and self._derive is not None:
            self._derive.step(full[:, :w].view(np.float32), summed, derived)
        else:
            self.optimizer.step(full[:, :w].view(np.float32), summed)
        self.rows_meta.stamp(full[:, w:], push.event_time, row_counts)
        storage.rows_1d.put(uniq, row_view(full))
        self.pushes += 1
        storage.pull_cache.wrote()
        return int(uniq.size)

    def _pulled_rows(self, pulled: PulledRows | None) -> tuple[U32 | None, tuple[F32, F32] | None]:
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

    def hold(self, keys: npt.ArrayLike, grads: npt.ArrayLike, **extras: Unpack[PushExtras]) -> int:
        """Sync mode: check a push as `push` does and hold it, unapplied,
        until `apply_held`; returns the number of keys held."""
        push = checked_push(self.config.name, self.dim, keys, grads, extras)
        n = int(push.keys.size)
        if n:
            if push.counts is None:
                push = push._replace(counts=np.zeros((n, 2), dtype=np.float32))
            self._held.append(push)
            self.held_keys += n
        return n

    def apply_held(self) -> int:
        """Sync mode: apply the sum of every held push as one push (the
        gradients of a key summed, one optimizer step); returns the distinct
        keys updated."""
        if not self._held:
            return 0
        held, self._held = self._held, []
        self.held_keys = 0
        keys = np.concatenate([h.keys for h in held])
        grads = np.concatenate([h.grads for h in held])
        counts = np.concatenate([h.counts for h in held if h.counts is not None])
        return self.push(keys, grads, counts=counts, event_time=max(h.event_time for h in held))

    # -- deletes, scores and eviction ------------------------------------------
    def delete(self, keys: npt.ArrayLike, *, distinct: bool = False) -> U64:
        """Remove keys (eviction); returns those that were present. With
        `distinct`, the caller promises no key repeats (a sort is saved).

        The removed keys are remembered until the next `snapshot`, whose delta
        lists them as deleted.
        """
        self.storage.pull_cache.clear()  # freed rows may be reused by other keys
        gone = self.storage.index.delete(keys, distinct=distinct)
        if self.changes is not None:
            self.changes.record(gone)
        self.cuts.deleted(gone)
        return gone

    def _evicted(self, keys: U64) -> None:
        """Delete the distinct live keys an eviction pass removes."""
        self.delete(keys, distinct=True)

    def scores(self, rows: npt.NDArray[np.intp] | None = None) -> F32:
        """The lifecycle score of `rows` (all rows handed out by default),
        from their decayed shows and clicks."""
        return self.rows_meta.scores(self.lifecycle, rows)

    def key_scores(self, keys: U64) -> F32:
        """The lifecycle score of each key; 0 for keys without a row."""
        rows = self.storage.index.lookup(keys)
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
        return self.evictor.evict(self.lifecycle)

    def eviction_steps(self, step_rows: int = EVICTION_STEP_ROWS) -> Iterator[Eviction]:
        """`evict`'s pass over a table of more than `step_rows` rows, a
        slice of `step_rows` rows at a time: between two slices it yields
        (the running report), so its caller lets the event loop run and the
        table's pause stays that of one slice. A smaller table takes `evict`'s
        single step. The row cap's cut is then estimated from a sample of
        the rows the other rules leave, so it takes the table to about its
        low-water mark; the other rules are exact. Pushes and cuts may run
        between slices: rows inserted meanwhile are left to the next pass."""
        return self.evictor.steps(self.lifecycle, step_rows)

    def lifecycle_stats(self) -> dict[str, Any]:
        """The lifecycle's figures, for the shard's stats."""
        out: dict[str, Any] = {"lifecycle": self.lifecycle.to_dict(), **self.evictor.stats()}
        out["embed_gated"] = self.gated
        if self.admission is not None:
            out["admission"] = self.admission.stats()
        return out

    # -- versions, snapshots and restores --------------------------------------
    def _sketch(self) -> CountSketch | None:
        """The admission's sketch, if it counts in one."""
        return None if self.admission is None else self.admission.sketch

    def changed_rows(self) -> tuple[U64, npt.NDArray[np.int64]]:
        """Keys and rows of the live rows changed since the last cut (the next delta's)."""
        rows = np.flatnonzero(self.storage.index.row_live & self.changed()).astype(np.int64)
        return self.storage.index.row_keys[rows], rows

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
        return self.cuts.snapshot(self.config, self._sketch(), since, version)

    def base_copy(self, version: int) -> TableSnapshot:
        """Every live row as a base labelled `version`, without cutting: the open
        version and the deletion log stay as they are (compaction uses this on
        a table restored to `version`)."""
        return self.cuts.base_copy(self.config, self._sketch(), version)

    def rows_where(self, select: Callable[[U64], npt.NDArray[np.bool_]]) -> TableSnapshot:
        """Copies of the live rows whose keys `select` picks (given every live
        key, it answers which), as a base labelled with the open version,
        without cutting: a slot move's hand-off (`ps_core.shard.slot_moves`).
        No admission sketch: its cells count keys of every slot."""
        return self.cuts.copy_selected(self.config, select, self.version)

    def mark_exported(self, version: int) -> None:
        """Declare the table's content to be export `version`: the open version
        becomes ``version + 1``, the next delta is relative to `version`, and
        the deletion log starts empty. `snapshot` calls it; a restore calls it
        after loading a chain."""
        self.cuts.mark_exported(version, self._sketch())

    def load_counts(self, count_scale: float, sketch_cells: npt.ArrayLike, sketch_values: npt.ArrayLike) -> None:
        """A snapshot's count scale and admission-sketch cells (a restore
        applies them version by version, after the rows)."""
        self.cuts.load_counts(self.config.name, self._sketch(), count_scale, sketch_cells, sketch_values)

    def load_rows(
        self,
        keys: npt.ArrayLike,
        data: npt.ArrayLike,
        updated_at: npt.ArrayLike,
        last_seen: npt.ArrayLike,
        shows: npt.ArrayLike,
        clicks: npt.ArrayLike,
        *,
        changed: bool = False,
    ) -> int:
        """Upsert whole rows as stored (state and metadata); returns how many
        keys were new. Keys must be distinct and data finite; a refused call
        changes nothing. `updated_at` is checked, not kept: a loaded row is
        unchanged since the cut it came from, so a later delta carries it only
        if it changes again (meant for restoring a chain, then `mark_exported`).
        With `changed`, the rows are flagged changed: the next delta carries
        them (rows moved in from another shard).
        """
        name = self.config.name
        k, d, meta = checked_rows(name, self.width, keys, data, (updated_at, last_seen, shows, clicks))
        if k.size == 0:
            return 0
        rows, new_rows = self.storage.upsert_distinct(k, name)
        self.storage.pull_cache.wrote()
        if self.changes is not None:  # rows replaced wholesale: no earlier question holds
            self.changes.reset()
        self.storage.data[rows] = d
        self.rows_meta.load(rows, meta[1], meta[2], meta[3], changed=changed)
        return int(new_rows.size)
