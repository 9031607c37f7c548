"""A table's storage: the key index and one array of whole rows (`RowStorage`).

Rows live in one ``(rows, width + META_WORDS)`` uint32 array, indexed by the
row numbers of a `KeyIndex`: per row, `width` words of state (float32 bits:
weights and optimizer state side by side, so one gather fetches an update's
inputs) followed by its metadata words (`ps_core.store.row_meta` reads them).
A pull's gather brings in the cache lines its push then updates, and a push
reads and writes each row in one gather and one scatter. The array grows in
place with the index's row capacity (`ps_core.store.growth`); the named views
(`data`, `meta`) are made again after each growth.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from ..errors import InvalidValuesError
from ..hashing import U64
from ..rows import row_view
from .growth import grow
from .index import KeyIndex
from .pull_cache import PullCache, PulledRows

__all__ = ["META_WORDS", "RowStorage", "F32", "U32"]

F32 = npt.NDArray[np.float32]
U32 = npt.NDArray[np.uint32]
META_WORDS = 3
"""Metadata words after each row's state (`ps_core.store.row_meta`)."""
_NO_ROWS = np.zeros(0, dtype=np.int64)


class RowStorage:
    """The key index and the rows of one table, with the pull cache that
    lets a push reuse what the pull of the same keys found."""

    def __init__(self, width: int, *, initial_rows: int = 1024) -> None:
        self.width = width
        """State words per row (`Optimizer.width` of the dim)."""
        self.index = KeyIndex(initial_slots=max(16, int(initial_rows / 0.6)))
        # A worker pushes the very keys it pulled: its push reuses what the
        # pull found instead of probing and gathering again.
        self.pull_cache = PullCache(self.index)
        # 0, 1, 2, ... for the duplicate check in `gather`; grown on demand.
        self._stamps = np.arange(1024, dtype=np.uint32)
        self.rows: U32 = np.zeros((0, width + META_WORDS), dtype=np.uint32)
        """Per row, `width` float32 state words, then `META_WORDS` metadata words."""
        self._views()

    def _views(self) -> None:
        """The named views of `rows` (made again whenever it is resized)."""
        self.rows_1d = row_view(self.rows)
        self.data: F32 = self.rows[:, : self.width].view(np.float32)
        self.meta: U32 = self.rows[:, self.width :]
        self._seen = self.meta[:, 0]  # 1-d: a scatter into it is cheaper than into meta[rows, 0]

    @property
    def num_rows(self) -> int:
        """Rows handed out (live or freed)."""
        return self.index.num_rows

    def full_rows(self, state: F32) -> U32:
        """Storage rows holding `state` (n, width) and zero metadata."""
        out = np.zeros((state.shape[0], self.width + META_WORDS), dtype=np.uint32)
        out[:, : self.width] = state.view(np.uint32)
        return out

    def sync_capacity(self) -> None:
        """Grow the rows to the index's row capacity, in place (`KeyIndex.grow`)."""
        cap = self.index.row_capacity
        if cap > self.rows.shape[0]:
            grow(self.rows, (cap, self.rows.shape[1]))
            self._views()

    def nbytes(self) -> int:
        """Bytes allocated: index, rows and metadata."""
        return int(self.index.nbytes() + self.rows.nbytes)

    def rows_for_push(
        self, k: U64, pulled: PulledRows | None, initial: Callable[[U64], npt.NDArray[np.void]]
    ) -> npt.NDArray[np.int64]:
        """The row of each key, inserting absent keys with their `initial`
        rows (`KeyIndex.get_or_insert`, reusing the pull of the same keys if
        there was one)."""
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
        self.sync_capacity()
        if new_rows.size:
            self.rows_1d.put(new_rows, initial(new_keys))
        return rows

    def gather(self, k: U64, rows: npt.NDArray[np.int64], full: U32 | None) -> tuple[U32, bool]:
        """The storage rows `rows` of keys `k` (`full` if the pull gathered
        them already), and whether the keys are distinct."""
        n = k.size
        if n < 2 or (k[1:] > k[:-1]).all():
            # Ascending keys are distinct: a worker's are (they come from
            # np.unique, and a shard's share keeps their order).
            return (self.rows.take(rows, axis=0) if full is None else full), True
        # Duplicate check: stamp each occurrence's position into its row's
        # first metadata word (last_seen) and read it back with the gather
        # the update needs anyway; a repeated row reads a later occurrence's
        # stamp. (Every row stamped gets its last_seen when the push stamps
        # its metadata: nothing of it stays.)
        if self._stamps.size < n:
            self._stamps = np.arange(max(n, 2 * self._stamps.size), dtype=np.uint32)
        stamps = self._stamps[:n]
        self._seen[rows] = stamps
        full = self.rows.take(rows, axis=0)
        return full, bool((full[:, self.width] == stamps).all())

    def upsert_distinct(self, k: U64, table: str) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The rows of keys `k`, inserting the absent ones, and the rows
        inserted; raises `InvalidValuesError` (inserting nothing) if a key
        repeats."""
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
        if int(np.count_nonzero(mark)) != k.size:
            self.index.delete(self.index.row_keys[new_rows])  # undo the inserts
            raise InvalidValuesError(f"table {table}: load_rows keys must be distinct")
        self.sync_capacity()
        return rows, new_rows
