"""WindowBuilder: closing by count, record time and wall time; revoked partitions."""

from __future__ import annotations

import time
from typing import NamedTuple

from consumers.windows import WindowBuilder


class Rec(NamedTuple):
    """The fields of an aiokafka ConsumerRecord a window reads."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    value: bytes


def recs(p: int, first: int, n: int, ts0: int = 0, step_ms: int = 10) -> list[Rec]:
    return [Rec("t", p, first + i, ts0 + i * step_ms, b"v%d-%d" % (p, first + i)) for i in range(n)]


def test_closes_at_max_events_and_records_offsets() -> None:
    b = WindowBuilder(within_s=1000, max_events=10)
    assert b.add(recs(0, 5, 4)) == [b"v0-5", b"v0-6", b"v0-7", b"v0-8"]  # what the decoder gets
    b.add(recs(1, 0, 5))
    assert b.add([]) == []
    assert not b.should_close()
    b.add(recs(0, 9, 1))
    assert b.should_close()
    w = b.take()
    assert w is not None and w.size == 10 and w.seq == 1
    assert w.next_offsets == {("t", 0): 10, ("t", 1): 5}
    assert w.source(0) == ("t", 0, 5) and w.source(4) == ("t", 1, 0)
    assert w.values[4] == b"v1-0"
    assert len(b) == 0 and b.take() is None


def test_closes_when_records_span_the_window_in_record_time() -> None:
    b = WindowBuilder(within_s=1.0, max_events=10_000)
    b.add(recs(0, 0, 50, ts0=1_000_000, step_ms=10))  # spans 490 ms
    assert not b.should_close()
    b.add(recs(1, 0, 60, ts0=1_000_000, step_ms=10))  # spans 590 ms
    assert not b.should_close()
    b.add(recs(0, 50, 1, ts0=1_001_000))  # now 1 s of record time
    assert b.should_close()
    w = b.take()
    assert w is not None and (w.first_ts_ms, w.last_ts_ms) == (1_000_000, 1_001_000)


def test_an_open_window_closes_after_its_span_of_wall_time() -> None:
    b = WindowBuilder(within_s=0.05, max_events=10_000)
    b.add(recs(0, 0, 1))
    deadline = time.monotonic() + 5
    while not b.should_close():
        assert time.monotonic() < deadline
    assert b.take() is not None


def test_revoked_partitions_are_dropped() -> None:
    b = WindowBuilder(within_s=1000, max_events=100)
    b.add(recs(0, 0, 3))
    b.add(recs(1, 0, 4))
    b.add(recs(2, 7, 2))
    assert b.drop_partitions({("t", 1)}) == 4
    w = b.take()
    assert w is not None and w.size == 5
    assert {w.source(i)[1] for i in range(w.size)} == {0, 2}
    assert w.offsets.tolist() == [0, 1, 2, 7, 8]
    assert w.in_partitions({("t", 2)}).tolist() == [False] * 3 + [True] * 2
    assert w.next_offsets == {("t", 0): 3, ("t", 2): 9}
    assert [v[:3] for v in w.values] == [b"v0-"] * 3 + [b"v2-"] * 2
