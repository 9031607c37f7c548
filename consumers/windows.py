"""Micro-batch windows over Kafka records.

A window gathers records of the consumer's partitions until one of:

- its records span `within_s` seconds of record time (the record timestamp,
  which ctrps producers set to the event's ``ts``: Kafka's CreateTime);
- it holds `max_events` records;
- `within_s` seconds of wall time passed since it opened (so a stalled or
  sparse stream still trains);
- a flush is asked for (partition revoke, shutdown).

`WindowBuilder` is the pure part (add records, ask whether to close, take the
window); the worker drives it from ``getmany``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any

__all__ = ["Window", "WindowBuilder", "TopicPartitionKey"]

TopicPartitionKey = tuple[str, int]

_VALUE = attrgetter("value")
_OFFSET = attrgetter("offset")
_TIMESTAMP = attrgetter("timestamp")


@dataclass(frozen=True)
class Window:
    """Records to train on together, and the offsets they cover."""

    seq: int
    """Window number in this worker, from 1."""
    values: list[bytes | None]
    """Record values, partition by partition, in offset order within each."""
    sources: list[tuple[str, int, int]]
    """(topic, partition, offset) of each record, aligned with `values`."""
    next_offsets: dict[TopicPartitionKey, int]
    """Per partition, the offset to commit once the window is applied (last + 1)."""
    first_ts_ms: int
    """Smallest record timestamp (ms)."""
    last_ts_ms: int
    """Largest record timestamp (ms)."""

    @property
    def size(self) -> int:
        """Number of records."""
        return len(self.values)


@dataclass
class WindowBuilder:
    """Accumulates records into windows."""

    within_s: float = 60.0
    max_events: int = 100_000
    _values: list[bytes | None] = field(default_factory=list)
    _sources: list[tuple[str, int, int]] = field(default_factory=list)
    _next: dict[TopicPartitionKey, int] = field(default_factory=dict)
    _first_ts: int | None = None
    _last_ts: int = 0
    _opened_at: float = 0.0
    _seq: int = 0

    def add(self, records: list[Any]) -> None:
        """Add aiokafka ConsumerRecords of one partition (one ``getmany`` entry)."""
        if not records:
            return
        if not self._values:
            self._opened_at = time.monotonic()
        # Attribute extraction through map/attrgetter runs in C: no Python
        # bytecode per record on the fetch path.
        self._values.extend(map(_VALUE, records))
        tp = (records[0].topic, records[0].partition)
        self._sources.extend(zip(repeat(tp[0]), repeat(tp[1]), map(_OFFSET, records)))
        self._next[tp] = records[-1].offset + 1
        stamps = list(map(_TIMESTAMP, records))
        lo, hi = min(stamps), max(stamps)
        if self._first_ts is None or lo < self._first_ts:
            self._first_ts = lo
        if hi > self._last_ts:
            self._last_ts = hi

    def __len__(self) -> int:
        return len(self._values)

    def should_close(self) -> bool:
        """Whether the open window is due."""
        if not self._values:
            return False
        if len(self._values) >= self.max_events:
            return True
        if self._first_ts is not None and self._last_ts - self._first_ts >= self.within_s * 1000:
            return True
        return time.monotonic() - self._opened_at >= self.within_s

    def take(self) -> Window | None:
        """Close the open window and return it (None if empty)."""
        if not self._values:
            return None
        self._seq += 1
        w = Window(
            seq=self._seq,
            values=self._values,
            sources=self._sources,
            next_offsets=self._next,
            first_ts_ms=self._first_ts or 0,
            last_ts_ms=self._last_ts,
        )
        self._values, self._sources, self._next = [], [], {}
        self._first_ts, self._last_ts = None, 0
        return w

    def drop_partitions(self, partitions: set[TopicPartitionKey]) -> int:
        """Forget buffered records of `partitions` (revoked: their new owner
        re-reads them from the committed offset). Returns how many."""
        if not self._values or not partitions:
            return 0
        keep = [i for i, s in enumerate(self._sources) if (s[0], s[1]) not in partitions]
        dropped = len(self._values) - len(keep)
        self._values = [self._values[i] for i in keep]
        self._sources = [self._sources[i] for i in keep]
        for tp in partitions:
            self._next.pop(tp, None)
        return dropped
