"""Key sets a shard remembers from pulls, so the push that follows can name
them instead of sending its keys again (`KeySets`).

A training step pulls a mini-batch's keys and, a moment later, pushes
gradients for the very same keys in the same order. With a key set, the
pull asks the shard to keep its keys under the request's id, and the push
sends that id (8 bytes) in place of its keys (8 bytes each): a push's bytes
fall from 12–20 to 4–6 per key in float32 and to 3–4 in float16.

The store is bounded three ways, so a client that pulls and never pushes
cannot grow it: a set is used once (`take` removes it), sets older than
`ttl_s` are dropped, and the oldest go first beyond `max_sets` sets or
`max_keys` keys in all. A push naming a set that is gone is refused with
`KeySetExpiredError` before anything is applied, and the client sends it
again with its keys: a key set only ever saves bytes, it never loses a push.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

from ..errors import KeySetExpiredError
from ..hashing import U64

__all__ = ["KeySets"]


class _KeySet(NamedTuple):
    table: str
    keys: U64
    born: float


class KeySets:
    """Pulled key sets by id: remembered once, taken once, bounded."""

    def __init__(self, *, max_sets: int = 4096, max_keys: int = 8_000_000, ttl_s: float = 120.0) -> None:
        self.max_sets = max_sets
        self.max_keys = max_keys
        """Keys held in all (8 bytes each: 64 MB at the default)."""
        self.ttl_s = ttl_s
        self._sets: OrderedDict[int, _KeySet] = OrderedDict()
        self._keys = 0
        self.remembered = 0
        """Sets remembered since start."""
        self.used = 0
        """Pushes that named a set held."""
        self.expired = 0
        """Pushes that named a set no longer held (sent again with keys)."""
        self.dropped = 0
        """Sets dropped unused: too old, or beyond the bounds."""

    def __len__(self) -> int:
        return len(self._sets)

    @property
    def keys_held(self) -> int:
        """Keys held in all the sets."""
        return self._keys

    def remember(self, set_id: int, table: str, keys: U64) -> None:
        """Keep a copy of `keys` of `table` under `set_id` (a pull's request
        id); a set remembered again under the same id replaces it."""
        old = self._sets.pop(set_id, None)
        if old is not None:
            self._keys -= old.keys.size
        if keys.size > self.max_keys:
            self.dropped += 1
            return
        now = time.monotonic()
        self._sets[set_id] = _KeySet(table, keys.copy(), now)
        self._keys += keys.size
        self.remembered += 1
        self._trim(now)

    def take(self, set_id: int, table: str, count: int) -> U64:
        """The keys remembered under `set_id`, removed from the store;
        `KeySetExpiredError` when they are gone or are not `count` keys of
        `table` (nothing may be applied then)."""
        self._trim(time.monotonic())
        entry = self._sets.pop(set_id, None)
        if entry is not None:
            self._keys -= entry.keys.size
        if entry is None or entry.table != table or entry.keys.size != count:
            self.expired += 1
            what = "is not held" if entry is None else f"holds {entry.keys.size} keys of table {entry.table!r}"
            raise KeySetExpiredError(
                f"key set {set_id} {what}, the push names {count} keys of table {table!r}: send its keys"
            )
        self.used += 1
        return entry.keys

    def stats(self) -> dict[str, int]:
        """Counters and sizes, for the shard's stats and `/metrics`."""
        return {
            "sets": len(self._sets),
            "keys": self._keys,
            "remembered": self.remembered,
            "used": self.used,
            "expired": self.expired,
            "dropped": self.dropped,
        }

    def _trim(self, now: float) -> None:
        """Drop sets past their age, then the oldest beyond the bounds."""
        sets = self._sets
        while sets:
            set_id, entry = next(iter(sets.items()))
            if now - entry.born <= self.ttl_s and len(sets) <= self.max_sets and self._keys <= self.max_keys:
                break
            del sets[set_id]
            self._keys -= entry.keys.size
            self.dropped += 1
