"""The per-row metadata of a table (`RowMeta`): event time, counts, changed flag.

Each row of a `RowStorage` ends with three uint32 words (`COLUMNS`):

- ``last_seen``: event time of the row's last update, whole seconds (TTL's clock);
- ``shows`` and ``clicks``: float32 counts stored as their bits (decayed
  counts are fractions). The true counts are the stored ones times
  `RowMeta.count_scale`: an eviction pass decays by multiplying the scale
  instead of touching every row, and a push adds counts divided by it; so
  rows that did not change need no rewrite (nor a place in the next delta).
- the sign bit of ``shows`` (a count is never negative) flags a row changed
  since the last cut, so a delta export is a vectorised selection, not a
  dirty set.

The lifecycle's rules (`ps_core.store.lifecycle`) read these.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .lifecycle import Lifecycle, score
from .storage import F32, U32, RowStorage

__all__ = ["COLUMNS", "CHANGED", "COUNT_BITS", "RowMeta", "stored_shows"]

COLUMNS = ("last_seen", "shows", "clicks")
"""The metadata words of a row, in order."""
CHANGED = np.uint32(1 << 31)
"""The flag bit of a row changed since the last cut (in its ``shows`` word)."""
COUNT_BITS = np.uint32((1 << 31) - 1)
"""The bits of a ``shows`` word that hold the count."""
_COUNT_MAX = float(np.finfo(np.float32).max)
MIN_COUNT_SCALE = 1e-25
"""Below this `RowMeta.count_scale` the stored counts are rescaled (float32
holds counts up to ~3e38, so stored ones up to ~1e13 stay finite)."""


def stored_shows(words: U32) -> F32:
    """The stored shows of ``shows`` words (the changed flag cleared), as a new array."""
    return (words & COUNT_BITS).view(np.float32)


class RowMeta:
    """A view of a storage's metadata words, and the table-wide figures they
    are read with: the count scale and the newest event time."""

    def __init__(self, storage: RowStorage) -> None:
        self._storage = storage
        self.count_scale = 1.0
        """A row's true (decayed) shows and clicks are its stored ones times this."""
        self.newest_event = 0.0
        """The newest event time stamped on a row (TTL's clock)."""

    @property
    def words(self) -> U32:
        """The (rows, 3) metadata words (`COLUMNS`), a view of the storage."""
        return self._storage.meta

    @property
    def last_seen(self) -> U32:
        """Each row's event time of its last update (a view)."""
        return self._storage.meta[:, 0]

    @property
    def shows(self) -> F32:
        """Each row's stored shows (a copy: the word also holds the changed flag)."""
        return stored_shows(self._storage.meta[:, 1])

    @property
    def clicks(self) -> F32:
        """Each row's stored clicks (a view)."""
        return self._storage.meta[:, 2].view(np.float32)

    def changed(self) -> npt.NDArray[np.bool_]:
        """For each row handed out, whether it changed since the last cut
        (what the next delta holds, if it is live)."""
        return self._storage.meta[: self._storage.num_rows, 1] >= CHANGED

    def clear_changed(self) -> None:
        """Nothing changed since now (a cut)."""
        self._storage.meta[: self._storage.num_rows, 1] &= COUNT_BITS

    def stamp(self, block: U32, seen: float, row_counts: npt.NDArray[Any] | None) -> None:
        """Stamp updated rows' metadata `block` (their gathered words) in
        place: the event time, shows and clicks added, and the changed flag."""
        block[:, 0] = int(seen)
        if seen > self.newest_event:
            self.newest_event = seen
        if row_counts is None:
            block[:, 1] |= CHANGED
            return
        counts = np.empty((block.shape[0], 2), dtype=np.uint32)
        counts[:, 0] = block[:, 1] & COUNT_BITS
        counts[:, 1] = block[:, 2]
        added = row_counts if self.count_scale == 1.0 else np.divide(row_counts, self.count_scale)
        # In float64, saturating at float32's largest instead of reaching
        # inf (float32 counts are exact to 2**24, then approximate).
        total = np.add(counts.view(np.float32), added, dtype=np.float64)
        np.minimum(total, _COUNT_MAX, out=total)
        block[:, 1:] = total.astype(np.float32).view(np.uint32)
        block[:, 1] |= CHANGED

    def scores(self, lifecycle: Lifecycle, rows: npt.NDArray[np.intp] | None = None) -> F32:
        """The lifecycle score of `rows` (all rows handed out by default),
        from their decayed shows and clicks."""
        meta = self._storage.meta
        n = self._storage.num_rows
        words = meta[:n, 1] if rows is None else meta[rows, 1]
        clicks = meta[:n, 2] if rows is None else meta[rows, 2]
        return score(lifecycle, stored_shows(words), clicks.view(np.float32), self.count_scale)

    def decay(self, factor: float) -> None:
        """Multiply every row's counts by `factor` (through the scale; the
        rows are rewritten only when the scale gets too small)."""
        self.count_scale *= factor
        if self.count_scale < MIN_COUNT_SCALE:
            self._rescale()

    def _rescale(self) -> None:
        """Fold `count_scale` into every row's stored counts (rare: after
        thousands of decays). Every row changes, so the next delta holds all."""
        n = self._storage.num_rows
        meta = self._storage.meta
        shows = stored_shows(meta[:n, 1]) * np.float32(self.count_scale)
        meta[:n, 1] = shows.view(np.uint32) | CHANGED
        clicks = meta[:n, 2].view(np.float32)
        clicks *= np.float32(self.count_scale)
        self.count_scale = 1.0
        self._storage.pull_cache.wrote()

    def load(
        self,
        rows: npt.NDArray[np.int64],
        last_seen: npt.ArrayLike,
        shows: npt.ArrayLike,
        clicks: npt.ArrayLike,
        *,
        changed: bool = False,
    ) -> None:
        """Write stored metadata to `rows`: unflagged, as of a cut (a restore),
        or flagged `changed` (rows moved in, which the next delta carries)."""
        self.last_seen[rows] = last_seen
        words = np.asarray(shows).astype(np.float32).view(np.uint32)
        self._storage.meta[rows, 1] = words | CHANGED if changed else words
        self.clicks[rows] = clicks
