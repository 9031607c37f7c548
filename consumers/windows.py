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
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Window", "WindowBuilder", "TopicPartitionKey"]

TopicPartitionKey = tuple[str, int]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

_VALUE = attrgetter("value")
_OFFSET = attrgetter("offset")
_TIMESTAMP = attrgetter("timestamp")
_NO_I32 = np.zeros(0, dtype=np.int32)
_NO_I64 = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Window:
    """Records to train on together, and the offsets they cover."""

    seq: int
    """Window number in this worker, from 1."""
    values: list[bytes | None]
    """Record values, partition by partition, in offset order within each."""
    partitions: list[TopicPartitionKey]
    """The partitions the records come from; `record_partition` indexes it."""
    record_partition: I32
    """(size,) index into `partitions` of each record's partition."""
    offsets: I64
    """(size,) each record's offset in its partition."""
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

    def source(self, i: int) -> tuple[str, int, int]:
        """(topic, partition, offset) of record `i`."""
        topic, partition = self.partitions[int(self.record_partition[i])]
        return topic, partition, int(self.offsets[i])

    def in_partitions(self, partitions: set[TopicPartitionKey]) -> npt.NDArray[np.bool_]:
        """(size,) whether each record comes from one of `partitions`."""
        member = np.array([tp in partitions for tp in self.partitions], dtype=bool)
        out: npt.NDArray[np.bool_] = member[self.record_partition]
        return out


@dataclass
class WindowBuilder:
    """Accumulates records into windows.

    Record sources are kept as arrays (a partition number and an offset per
    record), not a tuple per record: a window holds up to `max_events`
    records, and tuples would be objects for the garbage collector to scan
    on every collection while the window is alive.
    """

    within_s: float = 60.0
    max_events: int = 100_000
    _values: list[bytes | None] = field(default_factory=list)
    _partitions: list[TopicPartitionKey] = field(default_factory=list)
    _part_ids: list[I32] = field(default_factory=list)
    _offsets: list[I64] = field(default_factory=list)
    _next: dict[TopicPartitionKey, int] = field(default_factory=dict)
    _first_ts: int | None = None
    _last_ts: int = 0
    _opened_at: float = 0.0
    _seq: int = 0

    def add(self, records: list[Any]) -> list[bytes | None]:
        """Add aiokafka ConsumerRecords of one partition (one ``getmany``
        entry); returns their values, in order."""
        if not records:
            return []
        if not self._values:
            self._opened_at = time.monotonic()
        n = len(records)
        # Attribute extraction through map/attrgetter runs in C: no Python
        # bytecode per record on the fetch path.
        values: list[bytes | None] = list(map(_VALUE, records))
        self._values.extend(values)
        tp = (records[0].topic, records[0].partition)
        if tp not in self._partitions:
            self._partitions.append(tp)
        self._part_ids.append(np.full(n, self._partitions.index(tp), dtype=np.int32))
        self._offsets.append(np.fromiter(map(_OFFSET, records), dtype=np.int64, count=n))
        self._next[tp] = records[-1].offset + 1
        stamps = np.fromiter(map(_TIMESTAMP, records), dtype=np.int64, count=n)
        lo, hi = int(stamps.min()), int(stamps.max())
        if self._first_ts is None or lo < self._first_ts:
            self._first_ts = lo
        if hi > self._last_ts:
            self._last_ts = hi
        return values

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
            partitions=self._partitions,
            record_partition=np.concatenate(self._part_ids) if self._part_ids else _NO_I32,
            offsets=np.concatenate(self._offsets) if self._offsets else _NO_I64,
            next_offsets=self._next,
            first_ts_ms=self._first_ts or 0,
            last_ts_ms=self._last_ts,
        )
        self._values, self._partitions, self._next = [], [], {}
        self._part_ids, self._offsets = [], []
        self._first_ts, self._last_ts = None, 0
        return w

    def drop_partitions(self, partitions: set[TopicPartitionKey]) -> int:
        """Forget buffered records of `partitions` (revoked: their new owner
        re-reads them from the committed offset). Returns how many."""
        if not self._values or not partitions:
            return 0
        part_ids = np.concatenate(self._part_ids)
        member = np.array([tp in partitions for tp in self._partitions], dtype=bool)
        keep = np.flatnonzero(~member[part_ids])
        dropped = len(self._values) - int(keep.size)
        if not dropped:
            return 0
        self._values = [self._values[i] for i in keep.tolist()]
        self._part_ids = [part_ids[keep]]
        self._offsets = [np.concatenate(self._offsets)[keep]]
        for tp in partitions:
            self._next.pop(tp, None)
        if not self._values:
            self._part_ids, self._offsets = [], []
        return dropped
