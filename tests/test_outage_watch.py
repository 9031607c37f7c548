"""A worker's outages on their own (`consumers.outage_watch`, and the one
`retrying` helper of `consumers.outage`): calls retried across them, counted,
a stop ending a wait, and the broker watched over a real socket."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiokafka.errors import KafkaConnectionError, UnknownTopicOrPartitionError
from waiting import until

from consumers.outage import OutageDeadlineError, OutageWatch, retrying, retrying_kafka
from consumers.outage_watch import Outages, Stopped
from consumers.reports import WorkerStats
from ps_core.errors import InvalidRequestError, ShardUnavailableError


class _Flaky:
    """A call that fails with `error` its first `failures` times."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answered"


def _outages(bootstrap: str = "127.0.0.1:1", deadline_s: float = 5.0) -> tuple[Outages, WorkerStats, list[int]]:
    stats, probes = WorkerStats(), []

    async def probe_shards() -> None:
        probes.append(1)

    watch = OutageWatch(deadline_s, log_every_s=0.05, probe_every_s=0.02)
    return Outages(bootstrap, watch, stats, probe_shards), stats, probes


async def test_retrying_tries_again_until_an_answer_and_gives_up_as_told() -> None:
    waits: list[str] = []

    async def wait(exc: Exception, since: float) -> None:
        waits.append(str(exc))

    flaky = _Flaky(2, KafkaConnectionError("down"))
    assert await retrying(flaky, wait) == "answered" and flaky.calls == 3 and len(waits) == 2
    always = _Flaky(10, KafkaConnectionError("down"))
    with pytest.raises(KafkaConnectionError):
        await retrying_kafka(always, attempts=3, pause_s=0.0)
    assert always.calls == 3  # the last attempt's failure is raised as is
    other = _Flaky(1, ValueError("not a Kafka error"))
    with pytest.raises(ValueError):
        await retrying_kafka(other, pause_s=0.0)
    assert other.calls == 1


async def test_a_shard_outage_is_waited_out_and_counted_and_any_other_failure_raised() -> None:
    outages, stats, probes = _outages()
    flaky = _Flaky(1, ShardUnavailableError("no answer", shard_id=1, url="http://s1"))
    assert await outages.retrying(flaky) == "answered"
    assert stats.outages == 1 and probes and stats.outage_seconds >= 0 and stats.waiting_for == ""
    with pytest.raises(InvalidRequestError):
        await outages.retrying(_Flaky(1, InvalidRequestError("bad")))
    assert stats.outages == 1


async def _unanswered() -> None:
    raise KafkaConnectionError("nothing answers")


async def test_a_stop_ends_a_wait_past_which_a_deadline_would_give_up() -> None:
    outages, stats, _ = _outages(deadline_s=0.2)
    with pytest.raises(OutageDeadlineError, match="gave up waiting for the Kafka broker at 127.0.0.1:1"):
        await outages.ride_out(KafkaConnectionError(), _unanswered, time.monotonic())
    assert stats.outages == 1 and stats.waiting_for == ""
    outages, stats, _ = _outages(deadline_s=0)  # waits forever, unless stopped
    waiting = asyncio.create_task(outages.ride_out(UnknownTopicOrPartitionError(), _unanswered, time.monotonic()))
    await until(lambda: stats.waiting_for != "", what="the wait")
    assert stats.waiting_for == "the Kafka broker at 127.0.0.1:1"
    outages.stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(waiting, 5)
    assert stats.waiting_for == "" and stats.outages == 1


async def test_the_broker_watch_holds_windows_while_the_broker_is_away() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there until the server below
    outages, stats, _ = _outages(f"127.0.0.1:{port}")
    back: list[bool] = []

    async def came_back() -> bool:
        back.append(True)
        return False

    watching = asyncio.create_task(outages.watch_broker(came_back))
    try:
        await until(lambda: outages.broker_down, what="the broker seen away")
        assert stats.waiting_for == f"the Kafka broker at 127.0.0.1:{port}" and not back
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        async with server:
            await until(lambda: back and not outages.broker_down, what="the broker seen back")
        assert stats.outages == 1 and stats.waiting_for == ""
    finally:
        # Cancelled until it ends: Python 3.11's wait_for (inside the probe)
        # drops a cancellation that lands as its connection completes.
        while not watching.done():
            watching.cancel()
            await asyncio.wait({watching}, timeout=0.1)
