"""What a table's recent pulls found, for the push of the same keys that
usually follows (`PullCache`).

A worker pulls a batch's keys, computes gradients and pushes the very same
keys: the push can reuse the pull's index lookup, and with FTRL the rows it
gathered and the weights it derived, instead of doing that work again.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ..hashing import U64
from .index import KeyIndex

__all__ = ["PulledRows", "PullCache", "Gathered"]

F32 = npt.NDArray[np.float32]
U32 = npt.NDArray[np.uint32]
Gathered = tuple[U32, F32, F32]
"""Storage rows gathered by a pull (one per key, junk for absent keys), and
`FTRL.derive` of their state: weights and sqrt(n)."""


class PulledRows(NamedTuple):
    """What one pull learnt."""

    keys: U64
    """A copy of the keys pulled."""
    rows: npt.NDArray[np.int64]
    """Their rows, -1 where absent."""
    missing: npt.NDArray[np.intp]
    """Positions of the absent keys."""
    free: npt.NDArray[np.int64] | None
    """Those keys' first free index slots (`KeyIndex.probe`); None once stale."""
    gathered: Gathered | None
    """With FTRL, what the pull gathered and derived (see `Gathered`); None
    otherwise, for older pulls, or once stale."""
    mutations: int
    """The index's `mutations` at the pull."""
    writes: int
    """The cache's `writes` at the pull."""


class PullCache:
    """The latest pulls of one table, each usable once by a push of exactly
    the same keys (`take`).

    Invariants (what `take` hands out is valid, or None):

    - ``rows``: a present key's row holds until the key is deleted (rehashing
      moves index slots, never rows), so the table calls `clear` on every
      delete; absent keys stay absent until an insert, which `free` covers.
    - ``free``: the free index slots of the absent keys hold while the index's
      `mutations` is unchanged (no insert, delete or rehash since); else
      `take` gives None and the absent keys are looked up again.
    - ``gathered``: the gathered rows and derived weights hold while no row
      has changed: the table calls `wrote` after every change to rows (a
      push, a load); else `take` gives None. They are kept for the latest
      `gathered_kept` pulls only (they are the bulk of an entry: a push
      follows its pull closely).
    """

    def __init__(self, index: KeyIndex, *, size: int = 8, gathered_kept: int = 2) -> None:
        self._index = index
        self._entries: deque[PulledRows] = deque(maxlen=size)
        self._gathered_kept = gathered_kept
        self.writes = 0
        """Calls that changed rows (`wrote`)."""

    def add(
        self,
        keys: U64,
        rows: npt.NDArray[np.int64],
        missing: npt.NDArray[np.intp],
        free: npt.NDArray[np.int64],
        gathered: Gathered | None,
    ) -> None:
        """Remember a pull of `keys` (copied): their `rows`, the positions
        `missing` of the absent ones and those keys' `free` slots, and with
        FTRL what it `gathered`. The arrays other than `keys` become the cache's."""
        self._entries.append(PulledRows(keys.copy(), rows, missing, free, gathered, self._index.mutations, self.writes))
        if len(self._entries) > self._gathered_kept:
            old = self._entries[-1 - self._gathered_kept]
            if old.gathered is not None:
                self._entries[-1 - self._gathered_kept] = old._replace(gathered=None)

    def take(self, keys: U64) -> PulledRows | None:
        """Remove and return the latest pull of exactly `keys`, if any, with
        `free` and `gathered` None where they no longer hold. Its arrays are
        the caller's now (no copies)."""
        entries = self._entries
        for i in range(len(entries) - 1, -1, -1):
            p = entries[i]
            if p.keys.size == keys.size and (p.keys == keys).all():
                del entries[i]
                if p.mutations != self._index.mutations:
                    p = p._replace(free=None)
                if p.writes != self.writes:
                    p = p._replace(gathered=None)
                return p
        return None

    def wrote(self) -> None:
        """Rows have changed: gathered rows of earlier pulls are stale."""
        self.writes += 1

    def clear(self) -> None:
        """Keys were deleted: their rows may go to other keys, so no entry holds."""
        self._entries.clear()
