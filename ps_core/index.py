"""A vectorised hash index from uint64 feature ids to row numbers.

Open addressing with linear probing over one numpy ``int32`` slot array. A
slot holds a row number, ``EMPTY`` or ``TOMBSTONE``; the key of a row lives
in `KeyIndex.row_keys`, its only copy, which the owning table also uses to
name rows in exports. Every operation takes whole key arrays and probes all of
them at once, one probe step per round: the Python loop runs once per probe
step (a handful of rounds at the load bound), never once per key.

Deletes leave tombstones so that probe chains stay intact; inserts reuse
them, and a rehash drops them. Freed row numbers are recycled by later inserts.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .hashing import U64, mix64

__all__ = ["KeyIndex", "EMPTY", "TOMBSTONE"]

EMPTY = -1
TOMBSTONE = -2

_INDEX_SALT = 0x5BD1E9955BD1E995
I64 = npt.NDArray[np.int64]
_MAX_WINDOW = 32
_OFFSETS = np.arange(_MAX_WINDOW, dtype=np.int64)
# Shared empty results; read-only so no caller can change them for the others.
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_KEYS = np.zeros(0, dtype=np.uint64)
_NO_ROWS.flags.writeable = False
_NO_KEYS.flags.writeable = False


class KeyIndex:
    """uint64 key → row number, for whole arrays of keys at a time.

    Rows are numbered densely from 0; `capacity_rows` may exceed `size` when
    rows have been freed. Keys may be any uint64, zero and 2**64-1 included.
    """

    def __init__(self, initial_slots: int = 1024, max_load: float = 0.6) -> None:
        if not 0.1 <= max_load <= 0.9:
            raise ValueError("max_load must be in [0.1, 0.9]")
        self.max_load = max_load
        nslots = 1 << max(4, int(initial_slots - 1).bit_length())
        self._slots = np.full(nslots, EMPTY, dtype=np.int32)
        self._shift = np.uint64(64 - (nslots.bit_length() - 1))
        self._mask = nslots - 1
        self.row_keys: U64 = np.zeros(0, dtype=np.uint64)
        """The key of each row (meaningless for free rows)."""
        self.row_live = np.zeros(0, dtype=bool)
        """Whether each row holds a key (False for freed rows)."""
        self._num_rows = 0
        self._free: list[I64] = []
        self._size = 0
        self._tombstones = 0
        self.mutations = 0
        """Count of inserting and deleting calls: equal counts mean the same key set."""

    # -- sizes -----------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of keys present."""
        return self._size

    @property
    def num_rows(self) -> int:
        """Rows handed out so far (live and freed); row numbers are below it."""
        return self._num_rows

    @property
    def num_slots(self) -> int:
        return int(self._slots.size)

    def nbytes(self) -> int:
        """Bytes held by the slot array, row keys and live flags."""
        return int(self._slots.nbytes + self.row_keys.nbytes + self.row_live.nbytes)

    # -- queries ---------------------------------------------------------
    def _home(self, keys: U64) -> I64:
        # The top bits of a salted mix: independent of the low bits the
        # sharding function uses.
        return (mix64(keys, _INDEX_SALT) >> self._shift).astype(np.int64)

    def _find(self, keys: U64, want_slots: bool = False) -> tuple[I64, I64 | None]:
        """Row of each key (-1 where absent) and, if asked, its slot.

        Round one probes every key's home slot with whole-array operations.
        Later rounds look at a window of consecutive slots for each key still
        pending; the window doubles per round (2, 4, ... `_MAX_WINDOW`), so the
        long tail of a big batch costs a few rounds instead of dozens.
        """
        n = keys.size
        if n == 0 or self._size == 0:
            empty = np.full(n, -1, dtype=np.int64)
            return empty, (empty.copy() if want_slots else None)
        slots = self._slots
        row_keys = self.row_keys
        mask = self._mask
        pos = self._home(keys)
        r = np.take(slots, pos).astype(np.int64)
        # Empty/tombstone slots read row 0; the `r >= 0` test masks them out.
        hit = (np.take(row_keys, np.maximum(r, 0)) == keys) & (r >= 0)
        rows = np.where(hit, r, -1)
        slots_out = np.where(hit, pos, -1) if want_slots else None
        pending = np.flatnonzero(~hit & (r != EMPTY))
        pos = (np.take(pos, pending) + 1) & mask
        pkeys = np.take(keys, pending)
        width = 2
        while pending.size:
            win = (pos[:, None] + _OFFSETS[:width]) & mask
            r2 = np.take(slots, win).astype(np.int64)
            hit2 = (np.take(row_keys, np.maximum(r2, 0)) == pkeys[:, None]) & (r2 >= 0)
            found = hit2.any(axis=1)
            if found.any():
                col = hit2[found].argmax(axis=1)
                hp = pending[found]
                rows[hp] = r2[found, col]
                if slots_out is not None:
                    slots_out[hp] = win[found, col]
            # A present key sits before the first EMPTY of its chain, so a
            # window holding an EMPTY and no hit proves absence.
            go_on = ~(found | (r2 == EMPTY).any(axis=1))
            pending = pending[go_on]
            pos = (pos[go_on] + width) & mask
            pkeys = pkeys[go_on]
            width = min(2 * width, _MAX_WINDOW)
        return rows, slots_out

    def lookup(self, keys: npt.ArrayLike) -> I64:
        """Row number of each key, -1 where the key is absent."""
        return self._find(np.ascontiguousarray(keys, dtype=np.uint64))[0]

    # -- updates ---------------------------------------------------------
    def get_or_insert(self, keys: npt.ArrayLike) -> tuple[I64, I64, U64]:
        """Row number of each key, inserting the absent ones.

        Returns the rows (in the order of `keys`; duplicates share a row) and
        the rows and keys that were inserted (distinct; empty when none was).
        Freed rows are reused first; the caller initialises new rows.
        """
        k = np.ascontiguousarray(keys, dtype=np.uint64)
        rows, _ = self._find(k)
        missing = rows < 0
        if not missing.any():
            return rows, _NO_ROWS, _NO_KEYS
        rows[missing], new_rows, new_keys = self.insert_absent(k[missing])
        return rows, new_rows, new_keys

    def insert_absent(self, keys: npt.ArrayLike) -> tuple[I64, I64, U64]:
        """Insert keys the caller knows are absent (e.g. a lookup said so and
        `mutations` has not moved since); repeats are allowed.

        Returns the row of each key, and the distinct rows and keys inserted.
        """
        new_keys, inverse = np.unique(np.ascontiguousarray(keys, dtype=np.uint64), return_inverse=True)
        new_rows = self._insert_absent(new_keys)
        return new_rows[inverse.reshape(-1)], new_rows, new_keys

    def delete(self, keys: npt.ArrayLike) -> U64:
        """Remove keys; returns the keys that were present (each once)."""
        k = np.unique(np.ascontiguousarray(keys, dtype=np.uint64))
        rows, slots = self._find(k, want_slots=True)
        assert slots is not None
        present = rows >= 0
        if not present.any():
            return np.zeros(0, dtype=np.uint64)
        self._slots[slots[present]] = TOMBSTONE
        freed = rows[present]
        self.row_live[freed] = False
        self._free.append(freed)
        self._size -= int(freed.size)
        self.mutations += 1
        self._tombstones += int(freed.size)
        return k[present]

    def _take_rows(self, n: int) -> I64:
        """n row numbers: recycled free rows first, then fresh ones."""
        parts: list[I64] = []
        need = n
        while need and self._free:
            block = self._free.pop()
            if block.size > need:
                self._free.append(block[need:])
                block = block[:need]
            parts.append(block)
            need -= int(block.size)
        if need:
            start = self._num_rows
            self._ensure_row_capacity(start + need)
            parts.append(np.arange(start, start + need, dtype=np.int64))
            self._num_rows += need
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _ensure_row_capacity(self, n: int) -> None:
        cap = self.row_keys.size
        if n <= cap:
            return
        new_cap = max(n, cap + cap // 2, 1024)
        keys = np.zeros(new_cap, dtype=np.uint64)
        keys[:cap] = self.row_keys
        live = np.zeros(new_cap, dtype=bool)
        live[:cap] = self.row_live
        self.row_keys, self.row_live = keys, live

    @property
    def row_capacity(self) -> int:
        """Allocated row entries (≥ `num_rows`); tables size their rows to it."""
        return int(self.row_keys.size)

    def _insert_absent(self, keys: U64) -> I64:
        """Insert keys known to be absent and distinct; returns their rows."""
        n = int(keys.size)
        self._reserve(n)
        rows = self._take_rows(n)
        self.row_keys[rows] = keys
        self.row_live[rows] = True
        self._place(keys, rows)
        self._size += n
        self.mutations += 1
        return rows

    def _place(self, keys: U64, rows: I64) -> None:
        """Write rows into the first free slot of each key's probe chain.

        Keys whose first free slot is the same all write it; the one whose row
        reads back won, the others probe on from the next slot. Round one
        tries each home slot; later rounds scan doubling windows as `_find`.
        """
        slots = self._slots
        mask = self._mask
        pos = self._home(keys)
        prow = rows.astype(np.int32)
        width = 1
        while pos.size:
            if width == 1:
                target = pos
                cur = np.take(slots, pos)
                has_free = np.asarray(cur < 0)
            else:
                win = (pos[:, None] + _OFFSETS[:width]) & mask
                free = np.take(slots, win) < 0
                has_free = np.asarray(free.any(axis=1))
                target = win.ravel()[np.arange(0, win.size, width) + free.argmax(axis=1)]
                cur = np.take(slots, target)
            tpos = target[has_free]
            trow = prow[has_free]
            slots[tpos] = trow
            won_sub = np.take(slots, tpos) == trow
            if self._tombstones:
                was_tomb = cur[has_free] == TOMBSTONE
                self._tombstones -= int(np.count_nonzero(won_sub & was_tomb))
            won = np.zeros(pos.size, dtype=bool)
            won[has_free] = won_sub
            # Losers restart just past the slot they lost; keys with no free
            # slot in the window skip the whole window.
            lost = ~won
            pos = np.where(has_free, target + 1, pos + width)[lost] & mask
            prow = prow[lost]
            width = min(2 * width, _MAX_WINDOW)

    def _reserve(self, incoming: int) -> None:
        """Rehash before the load (keys + tombstones) would pass `max_load`."""
        nslots = self._slots.size
        if self._size + self._tombstones + incoming <= self.max_load * nslots:
            return
        want = self._size + incoming
        new_slots = nslots
        while want > self.max_load * new_slots:
            new_slots *= 2
        self._rehash(new_slots)

    def _rehash(self, nslots: int) -> None:
        self._slots = np.full(nslots, EMPTY, dtype=np.int32)
        self._shift = np.uint64(64 - (nslots.bit_length() - 1))
        self._mask = nslots - 1
        self._tombstones = 0
        live_rows = np.flatnonzero(self.row_live[: self._num_rows]).astype(np.int64)
        if live_rows.size:
            self._place(self.row_keys[live_rows], live_rows)
