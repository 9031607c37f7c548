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

import itertools

import numpy as np
import numpy.typing as npt

from ..hashing import U64, sorted_distinct
from .growth import grow, next_capacity

__all__ = ["KeyIndex", "EMPTY", "TOMBSTONE"]

EMPTY = -1
TOMBSTONE = -2

I64 = npt.NDArray[np.int64]
_MAX_WINDOW = 32
# Probe offsets from a home slot; longer chains (rare) make their own.
_OFFSETS = np.arange(1024, dtype=np.int64)
_S32 = np.uint64(32)
_HOME_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: 2**64 / golden ratio
# Window widths of the probe rounds after the home slot, then `_MAX_WINDOW`
# until done. Per-call overhead dominates a few-thousand-key batch, so few
# rounds beat small windows: at load 0.6 about a quarter of the keys probe
# past home, a few percent past 4 more slots, almost none past 32.
_WINDOWS = (4,)
_NO_SLOT = np.iinfo(np.int64).max
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

    @property
    def row_live(self) -> npt.NDArray[np.bool_]:
        """For each row handed out, whether it holds a key (False for freed
        rows): derived from the free list, not stored, so a fresh array."""
        live = np.ones(self._num_rows, dtype=bool)
        for block in self._free:
            live[block] = False
        return live

    def nbytes(self) -> int:
        """Bytes held by the slot array and row keys."""
        return int(self._slots.nbytes + self.row_keys.nbytes)

    # -- queries ---------------------------------------------------------
    def _home(self, keys: U64) -> I64:
        # Multiply-shift hashing (the top bits of an odd multiple) of the
        # keys folded by an xorshift, so every key bit reaches the bits used:
        # four numpy calls where fmix64 takes eleven. Feature ids are hashes
        # already, so this only has to spread them; the low bits of fmix64
        # that pick a key's shard are unrelated to it. Values are below
        # 2**31, so the int64 view is the same number.
        h = keys >> _S32
        h ^= keys
        h *= _HOME_MULT
        h >>= self._shift
        return h.view(np.int64)

    def _find(self, keys: U64, want_slots: bool = False, want_free: bool = False) -> tuple[I64, I64 | None, I64 | None]:
        """Row of each key (-1 where absent) and, if asked, the slot of each
        present key and the first free slot (EMPTY or TOMBSTONE) of each
        absent key's probe chain, where an insert would put it (meaningful
        until the next insert or delete; entries of the other keys are junk).

        Round one probes every key's home slot with whole-array operations.
        Later rounds look at a window of consecutive slots for each key still
        pending (`_WINDOWS`), so the long tail of a big batch costs a few
        rounds instead of dozens. Per-call overhead dominates at the batch
        sizes of training (a few thousand keys), so each round is written to
        make few numpy calls: windows are read with ``mode="wrap"`` (the slot
        count is a power of two) instead of masking positions, and row keys
        with ``mode="clip"``, which maps EMPTY and TOMBSTONE to row 0: with no
        tombstones such a false match can only be at an EMPTY slot, which ends
        the probe as absent either way, so the ``>= 0`` mask is needed only
        when tombstones exist.
        """
        n = keys.size
        if n == 0 or self._size == 0:
            rows = np.full(n, -1, dtype=np.int64)
            # With no key stored every slot is free: the home slot is the answer.
            return rows, (rows.copy() if want_slots else None), (self._home(keys) if want_free else None)
        slots = self._slots
        row_keys = self.row_keys
        tombs = self._tombstones > 0
        pos = self._home(keys)
        r = slots.take(pos)
        hit = row_keys.take(r, mode="clip") == keys
        if tombs:
            hit &= r >= 0
            go = r != EMPTY
        else:
            go = r >= 0
        # Probe on where the home slot holds another key (or a tombstone).
        np.greater(go, hit, out=go)
        pending = np.flatnonzero(go)
        rows = r.astype(np.int64)  # right for a hit and for EMPTY (-1) ...
        rows[pending] = -1  # ... and pending keys are absent until found
        slots_out = np.where(rows >= 0, pos, -1) if want_slots else None
        free = pos if want_free else None  # right where the home slot is free
        if not pending.size:
            return rows, slots_out, free
        # The pending keys' index, home and key, one array so that a round
        # drops the finished ones in one call.
        st = np.empty((3, pending.size), dtype=np.int64)
        st[0] = pending
        pos.take(pending, out=st[1])
        keys.view(np.int64).take(pending, out=st[2])
        # With tombstones, a pending key whose home is one has found its free slot.
        need = r.take(pending) >= 0 if (want_free and tombs) else None
        self._probe_windows(keys_left=st, rows=rows, slots_out=slots_out, free=free, need=need, tombs=tombs)
        return rows, slots_out, free

    def _probe_windows(
        self,
        *,
        keys_left: I64,
        rows: I64,
        slots_out: I64 | None,
        free: I64 | None,
        need: npt.NDArray[np.bool_] | None,
        tombs: bool,
    ) -> None:
        """`_find`'s later rounds: probe a window of consecutive slots past
        the home of each key still pending (`keys_left`: rows of index,
        home and key bits), writing what each finds into `rows`, `slots_out`
        and `free` as `_find` describes; `need` marks the keys still looking
        for a free slot (with tombstones)."""
        slots = self._slots
        row_keys = self.row_keys
        mask = self._mask
        st = keys_left
        lo = 1  # offset from home of the next window
        widths = itertools.chain(_WINDOWS, itertools.repeat(_MAX_WINDOW))
        while st.shape[1]:
            width = next(widths)
            idx, home, pkeys = st[0], st[1], st[2].view(np.uint64)
            if lo + width <= _OFFSETS.size:
                offsets = _OFFSETS[lo : lo + width, None]
            else:
                offsets = np.arange(lo, lo + width, dtype=np.int64)[:, None]
            # Windows are (width, pending): numpy reduces over a leading axis
            # with whole-row operations, over a short trailing one slowly.
            win = offsets + home
            r2 = slots.take(win, mode="wrap")
            h2 = row_keys.take(r2, mode="clip") == pkeys
            if tombs:
                h2 &= r2 >= 0
            # A key's probe stops at its slot or at the first EMPTY of its
            # chain (a present key sits before it), whichever comes first.
            # Without tombstones every negative slot is EMPTY, and a false
            # match sits on one. (np.where then a reduction: a reduction's
            # own where= is far slower on masks this dense.)
            stop = r2 == EMPTY if tombs else r2 < 0
            stop |= h2
            first = np.where(stop, win, _NO_SLOT).min(axis=0)
            go_on = first == _NO_SLOT
            first &= mask  # junk where go_on
            # The slot a probe stopped at holds the key's row, or EMPTY (-1)
            # if the key is absent; keys probing on read junk, overwritten
            # when they stop.
            rows[idx] = slots.take(first)
            if slots_out is not None:
                slots_out[idx] = np.where(go_on, -1, first)
            if free is not None:
                if need is None:
                    # Absent keys stopped at their chain's EMPTY; the others'
                    # entries are junk (overwritten if they probe on).
                    free[idx] = first
                else:
                    fr = np.where(r2 < 0, win, _NO_SLOT).min(axis=0)
                    fill = fr != _NO_SLOT
                    fill &= need
                    free[idx[fill]] = fr[fill] & mask
                    need &= ~fill
            st = st[:, go_on]
            if need is not None:
                need = need[go_on]
            lo += width

    def lookup(self, keys: npt.ArrayLike) -> I64:
        """Row number of each key, -1 where the key is absent."""
        return self._find(np.ascontiguousarray(keys, dtype=np.uint64))[0]

    def probe(self, keys: npt.ArrayLike) -> tuple[I64, I64]:
        """`lookup`, plus where each absent key would go: the first free slot
        of its probe chain (junk for present keys). Pass those slots to
        `insert_absent` while `mutations` has not moved; they spare the
        insert walking the chains again."""
        rows, _, free = self._find(np.ascontiguousarray(keys, dtype=np.uint64), want_free=True)
        assert free is not None
        return rows, free

    # -- updates ---------------------------------------------------------
    def get_or_insert(self, keys: npt.ArrayLike) -> tuple[I64, I64, U64]:
        """Row number of each key, inserting the absent ones.

        Returns the rows (in the order of `keys`; duplicates share a row) and
        the rows and keys that were inserted (distinct; empty when none was).
        Freed rows are reused first; the caller initialises new rows.
        """
        k = np.ascontiguousarray(keys, dtype=np.uint64)
        rows, _, free = self._find(k, want_free=True)
        assert free is not None
        missing = np.flatnonzero(rows < 0)
        if not missing.size:
            return rows, _NO_ROWS, _NO_KEYS
        got, new_rows, new_keys = self.insert_absent(k.take(missing), free.take(missing))
        rows[missing] = got
        return rows, new_rows, new_keys

    def insert_absent(self, keys: npt.ArrayLike, free: I64 | None = None) -> tuple[I64, I64, U64]:
        """Insert keys the caller knows are absent (e.g. a lookup said so and
        `mutations` has not moved since); repeats are allowed. `free`, if
        given, is each key's first free slot as `probe` reported it at the
        current `mutations`.

        Returns the row of each key, and the distinct rows and keys inserted
        (keys ascending, rows handed out in that order). The arrays may share
        memory with each other and with `keys`: treat them as read-only.
        """
        k = np.ascontiguousarray(keys, dtype=np.uint64)
        if k.size < 2 or (k[1:] > k[:-1]).all():
            # Ascending, so distinct and in order already: a worker's keys
            # come from np.unique, and a shard's share keeps their order.
            new_rows = self._insert_absent(k, free)
            return new_rows, new_rows, k
        order = k.argsort()
        new_keys = k.take(order)
        if new_keys.size > 1 and (new_keys[1:] == new_keys[:-1]).any():
            new_keys, first, inverse = np.unique(k, return_index=True, return_inverse=True)
            hint = None if free is None else free.take(first)
            new_rows = self._insert_absent(new_keys, hint)
            return new_rows[inverse.reshape(-1)], new_rows, new_keys
        # Distinct (the usual case): a sort is several times cheaper than np.unique.
        new_rows = self._insert_absent(new_keys, None if free is None else free.take(order))
        rows = np.empty_like(new_rows)
        rows[order] = new_rows
        return rows, new_rows, new_keys

    def delete(self, keys: npt.ArrayLike, *, distinct: bool = False) -> U64:
        """Remove keys; returns the keys that were present (each once). With
        `distinct`, the caller promises no key repeats (a sort is saved)."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        if not distinct:
            k = sorted_distinct(k)
        rows, slots, _ = self._find(k, want_slots=True)
        assert slots is not None
        present = rows >= 0
        if not present.any():
            return np.zeros(0, dtype=np.uint64)
        self._slots[slots[present]] = TOMBSTONE
        freed = rows[present]
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
        if n > cap:
            grow(self.row_keys, (next_capacity(cap, n),))

    @property
    def row_capacity(self) -> int:
        """Allocated row entries (≥ `num_rows`); tables size their rows to it."""
        return int(self.row_keys.size)

    def _insert_absent(self, keys: U64, free: I64 | None = None) -> I64:
        """Insert keys known to be absent and distinct; returns their rows.
        `free`: each key's first free slot (see `insert_absent`)."""
        n = int(keys.size)
        if self._reserve(n):
            free = None  # rehashed: the slots moved
        start = self._num_rows
        rows = self._take_rows(n)
        if self._num_rows - start == n:
            # All fresh rows, one range: slices instead of scatters.
            self.row_keys[start : start + n] = keys
        else:
            self.row_keys[rows] = keys
        self._place(keys, rows, free)
        self._size += n
        self.mutations += 1
        return rows

    def _place(self, keys: U64, rows: I64, free: I64 | None = None) -> None:
        """Write rows into the first free slot of each key's probe chain.

        Keys whose first free slot is the same all write it; the one whose row
        reads back won, the others probe on from the next slot. Round one
        writes each key's first free slot if `free` gives it (a lookup found
        it), else scans from the home slot; later rounds scan windows, read
        as in `_find`.
        """
        slots = self._slots
        mask = self._mask
        prow = rows.astype(np.int32)
        if free is None:
            pos = self._home(keys)
            width = 1
        else:
            pos = free
            width = 0  # the targets are known to be free
        while pos.size:
            skipped = None
            if width:
                # The first free slot of each (width, pending) window.
                win = _OFFSETS[:width, None] + pos
                first = np.where(slots.take(win, mode="wrap") < 0, win, _NO_SLOT).min(axis=0)
                has = first != _NO_SLOT
                if not has.all():
                    # Keys with no free slot in the window skip all of it.
                    none = ~has
                    skipped = ((pos[none] + width) & mask, prow[none])
                    first, prow = first[has], prow[has]
                target = first & mask
            else:
                target = pos
            was_tomb = slots.take(target) == TOMBSTONE if self._tombstones else None
            slots[target] = prow
            won = slots.take(target) == prow
            if was_tomb is not None:
                self._tombstones -= int(np.count_nonzero(won & was_tomb))
            if skipped is None and won.all():
                return
            # Losers probe on just past the slot they lost.
            lost = ~won
            pos = (target[lost] + 1) & mask
            prow = prow[lost]
            if skipped is not None:
                pos = np.concatenate((pos, skipped[0]))
                prow = np.concatenate((prow, skipped[1]))
            # A loser's chain usually has a free slot close by: start wide.
            width = min(max(2 * width, 8), _MAX_WINDOW)

    def _reserve(self, incoming: int) -> bool:
        """Rehash before the load (keys + tombstones) would pass `max_load`;
        returns whether it did."""
        nslots = self._slots.size
        if self._size + self._tombstones + incoming <= self.max_load * nslots:
            return False
        want = self._size + incoming
        new_slots = nslots
        while want > self.max_load * new_slots:
            new_slots *= 2
        self._rehash(new_slots)
        return True

    def _rehash(self, nslots: int) -> None:
        self._slots = np.full(nslots, EMPTY, dtype=np.int32)
        self._shift = np.uint64(64 - (nslots.bit_length() - 1))
        self._mask = nslots - 1
        self._tombstones = 0
        live_rows = np.flatnonzero(self.row_live).astype(np.int64)
        if live_rows.size:
            self._place(self.row_keys[live_rows], live_rows)
