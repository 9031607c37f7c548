"""Eviction passes over a table's rows (`Evictor`), and their reports (`Eviction`).

A pass applies the lifecycle's rules (`ps_core.store.lifecycle`), in order:
TTL (rows unseen for longer than ``ttl_s`` before the newest event time),
decay then the score threshold (``min_score``), then the row cap
(``max_rows``: the lowest scores go, down to the low-water mark). It reads
the rows' metadata through a `RowMeta` and removes keys through the
table's delete, so the next delta lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..hashing import U64
from .lifecycle import Lifecycle
from .row_meta import RowMeta
from .storage import F32, RowStorage

__all__ = ["EVICTION_STEP_ROWS", "Eviction", "Evictor"]

EVICTION_STEP_ROWS = 1 << 20
"""Rows one step of an eviction pass looks at (`Evictor.steps`)."""
_CUT_SAMPLE = 1 << 18
"""Rows sampled to place a stepped pass's row-cap cut."""


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


class Evictor:
    """The eviction passes of one table and their running figures."""

    def __init__(
        self,
        storage: RowStorage,
        meta: RowMeta,
        *,
        delete: Callable[[U64], object],
        memory_bytes: Callable[[], int],
        seed: int,
    ) -> None:
        """`delete` removes distinct live keys (the table's, which logs them
        for the next delta); `memory_bytes` is the table's allocation."""
        self._storage = storage
        self._meta = meta
        self._delete = delete
        self._memory_bytes = memory_bytes
        self.evicted = Eviction().by_rule
        """Rows removed by each eviction rule since start."""
        self.eviction_passes = 0
        self.bytes_freed = 0
        """Bytes of the rows removed by eviction since start (reused by new rows)."""
        self.last_eviction: Eviction | None = None
        self._rows_after_pass = 0
        self.most_over_cap = (0, 0)
        """The most rows over `max_rows` a pass found, and the rows inserted
        since the pass before it (the excess is at most these)."""
        self._sampler = np.random.default_rng([seed, 0xE71C7])

    def evict(self, lc: Lifecycle) -> Eviction:
        """One pass of `lc`'s rules at once (see `SparseTable.evict`)."""
        t0 = time.perf_counter()
        n = self._storage.num_rows
        live = self._storage.index.row_live
        report = self._new_eviction()
        remove = np.zeros(n, dtype=bool)
        s = self._ttl_and_score(lc, 0, n, live, remove, report)
        if lc.max_rows:
            left = np.flatnonzero(live & ~remove)
            over = left.size - int(lc.low_water * lc.max_rows)
            if left.size > lc.max_rows and over > 0:
                left_scores = self._meta.scores(lc, left) if s is None else s[left]
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
        self._passed(lc, report)
        return report

    def steps(self, lc: Lifecycle, step_rows: int = EVICTION_STEP_ROWS) -> Iterator[Eviction]:
        """`evict`'s pass in slices of `step_rows` rows (see `SparseTable.eviction_steps`)."""
        if self._storage.num_rows <= step_rows:
            yield self.evict(lc)
            return
        t0 = time.perf_counter()
        n = self._storage.num_rows
        live = self._storage.index.row_live  # as the pass began
        report = self._new_eviction()
        cap_left, cut = self._sampled_cut(lc, live)
        hold = time.perf_counter() - t0
        for lo in range(0, n, step_rows):
            t = time.perf_counter()
            hi = min(n, lo + step_rows)
            remove = np.zeros(hi - lo, dtype=bool)
            s = self._ttl_and_score(lc, lo, hi, live[lo:hi], remove, report, decay=lo == 0)
            if cap_left > 0:
                if s is None:
                    s = self._meta.scores(lc, np.arange(lo, hi))
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
        self._passed(lc, report)
        yield report

    def _new_eviction(self) -> Eviction:
        size = self._storage.index.size
        return Eviction(scanned=size, inserted=max(0, size - self._rows_after_pass))

    def _ttl_and_score(
        self,
        lc: Lifecycle,
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
        meta = self._meta
        if lc.ttl_s and meta.newest_event:
            np.logical_and(live, meta.last_seen[lo:hi] < meta.newest_event - lc.ttl_s, out=remove)
            report.by_rule["ttl"] += int(np.count_nonzero(remove))
        if not lc.min_score:
            return None
        if decay:
            meta.decay(lc.decay)
        whole = (lo, hi) == (0, self._storage.num_rows)
        s = meta.scores(lc) if whole else meta.scores(lc, np.arange(lo, hi))
        low = live & ~remove & (s < lc.min_score)
        report.by_rule["score"] += int(np.count_nonzero(low))
        remove |= low
        return s

    def _sampled_cut(self, lc: Lifecycle, live: npt.NDArray[np.bool_]) -> tuple[int, float]:
        """For a pass in steps: how many rows the cap should remove, and the
        score under which they go, estimated from a sample of the live rows
        that TTL and the score threshold leave (after this pass's decay)."""
        if not lc.max_rows:
            return 0, 0.0
        meta = self._meta
        rows = np.flatnonzero(live)
        sample = rows[self._sampler.integers(0, rows.size, min(rows.size, _CUT_SAMPLE))] if rows.size else rows
        keep = np.ones(sample.size, dtype=bool)
        if lc.ttl_s and meta.newest_event:
            keep &= meta.last_seen[sample] >= meta.newest_event - lc.ttl_s
        s = meta.scores(lc, sample)
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
            per_row = self._memory_bytes() / max(1, self._storage.index.row_capacity)
            self._delete(self._storage.index.row_keys[rows])
            report.bytes_freed += int(rows.size * per_row)

    def _passed(self, lc: Lifecycle, report: Eviction) -> None:
        """Record a finished pass."""
        for rule, count in report.by_rule.items():
            self.evicted[rule] += count
        self.eviction_passes += 1
        self.bytes_freed += report.bytes_freed
        self._rows_after_pass = self._storage.index.size
        if lc.max_rows and report.scanned - lc.max_rows > self.most_over_cap[0]:
            self.most_over_cap = (report.scanned - lc.max_rows, report.inserted)
        self.last_eviction = report

    def stats(self) -> dict[str, Any]:
        """The passes' figures (`SparseTable.lifecycle_stats` adds the rest)."""
        last = self.last_eviction
        return {
            "evicted": dict(self.evicted),
            "eviction_passes": self.eviction_passes,
            "bytes_freed": self.bytes_freed,
            "most_over_cap": self.most_over_cap[0],
            "inserted_before_most_over_cap": self.most_over_cap[1],
            "last_eviction_ms": None if last is None else round(last.pause_ms, 3),
            "last_eviction_bytes_freed": None if last is None else last.bytes_freed,
        }
