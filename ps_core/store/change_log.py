"""Which keys of a geo table changed, and since when: what a geo worker
asks for at each round's end instead of reading every row again.

In geo mode each worker trains a local copy and pushes differences; rows
other workers changed must be read again. A `ChangeLog` keeps, in order,
the keys of each push a table applied (with the push's request id) and of
each removal (eviction, delete), each numbered by the log's own sequence. A
worker asks `since` the sequence number of its last answer, naming its own
pushes' request ids, and gets the keys everybody else changed since: the
rows of its copy to read again. (The log's own numbers, not the table's
push clock: a removal between two pushes must count as after the question
asked between them.)

It is one log per table, not one per worker (as a per-worker recorder
would be): nothing to register, nothing to expire when a worker leaves,
and its memory is one bounded budget whatever the number of workers. When
the log has dropped entries a question reaches back to, or the table is
not the one the worker asked before (`incarnation`: a restart, a restore),
the answer is *incomplete*: the worker then takes every row it holds as
changed. So a bound that is too small costs reads, never correctness.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from ..hashing import U64

__all__ = ["DEFAULT_LOG_KEYS", "ENTRY_KEYS", "ChangeLog", "Changes"]

DEFAULT_LOG_KEYS = 1 << 20
"""Keys a table's log holds at most (8 MiB of keys): at 2 workers pushing
about 0.4 keys per event, some 1.3M events of changes."""
ENTRY_KEYS = 16
"""What an entry's bookkeeping (its array and tuple, ~130 bytes) counts as,
in keys, against the bound: many tiny pushes must not hold unbounded memory."""


class Changes(NamedTuple):
    """An answer of `ChangeLog.since`."""

    keys: U64
    """Distinct keys changed since the clock asked, by pushes other than the
    named ones and by removals (sorted)."""
    complete: bool
    """Whether `keys` is every such key; if not, take every row as changed."""
    seq: int
    """The log's sequence number now: the `since` of the next question."""
    incarnation: int
    """This table's incarnation, for the next question."""


class _LoggedChange(NamedTuple):
    seq: int
    request_id: int
    """The push's request id; 0 for a removal (never one's own)."""
    keys: U64


class ChangeLog:
    """The keys changed in one table, by push or removal, oldest first."""

    def __init__(self, max_keys: int = DEFAULT_LOG_KEYS) -> None:
        if max_keys < 0:
            raise ValueError("max_keys must be >= 0")
        self.max_keys = max_keys
        self.incarnation = 0
        self.seq = 0
        """Entries ever recorded: the number of the newest."""
        self._entries: deque[_LoggedChange] = deque()
        self.keys_held = 0
        self.dropped_through = 0
        """The newest sequence number whose entry was dropped: questions
        from before it are incomplete."""
        self.incomplete = 0
        """Answers that were incomplete."""
        self.reset()

    def reset(self) -> None:
        """Forget every entry and start a new incarnation (the table's rows
        were replaced: no earlier question can be answered)."""
        self.incarnation = secrets.randbits(63) | 1
        self._entries.clear()
        self.keys_held = 0
        self.dropped_through = self.seq

    def record(self, keys: U64, request_id: int = 0) -> None:
        """Note that `keys` changed (by a push with its `request_id`, or a
        removal with 0). Past `max_keys` (an entry counting as its keys plus
        `ENTRY_KEYS`), entries go, oldest first."""
        if not keys.size:
            return
        self.seq += 1
        self._entries.append(_LoggedChange(self.seq, request_id, np.array(keys, dtype=np.uint64, copy=True)))
        self.keys_held += int(keys.size)
        while self.keys_held + ENTRY_KEYS * len(self._entries) > self.max_keys and self._entries:
            gone = self._entries.popleft()
            self.keys_held -= int(gone.keys.size)
            self.dropped_through = gone.seq

    def since(self, seq: int, incarnation: int, own: Iterable[int]) -> Changes:
        """The keys changed after sequence number `seq` but by the pushes
        whose request ids are in `own`, as asked by a worker whose last
        answer came from this log's `incarnation`."""
        if incarnation != self.incarnation or not self.dropped_through <= seq <= self.seq:
            self.incomplete += 1
            return Changes(np.zeros(0, dtype=np.uint64), False, self.seq, self.incarnation)
        mine = set(own)
        parts: list[U64] = []
        # Newest first: stop at the first entry the asker has seen.
        for entry in reversed(self._entries):
            if entry.seq <= seq:
                break
            if entry.request_id == 0 or entry.request_id not in mine:
                parts.append(entry.keys)
        keys: U64 = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)
        return Changes(keys, True, self.seq, self.incarnation)

    def stats(self) -> dict[str, int]:
        """Entries and keys held, and incomplete answers given."""
        return {"entries": len(self._entries), "keys": self.keys_held, "incomplete": self.incomplete}
